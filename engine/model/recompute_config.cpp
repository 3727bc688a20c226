#include "autotp/model/recompute_config.h"

#include <algorithm>

namespace autotp {

ActivationCheckpointingConfig ActivationCheckpointingConfig::read(const JsonSection& top) {
  ActivationCheckpointingConfig a;
  JsonSection s = top.section("activation_checkpointing", {"enabled", "mode", "layers"});
  a.enabled = s.boolean("enabled", a.enabled);
  // `mode` alone turns checkpointing on (or off); `enabled` alone means full.
  a.mode = s.has("mode") ? s.string("mode", "") : (a.enabled ? "full" : "off");
  s.check(a.mode == "off" || a.mode == "full" || a.mode == "selective", "mode", "\"off\", \"full\", \"selective\"");
  if (s.has("mode") && !s.has("enabled")) a.enabled = a.mode != "off";
  if (!a.enabled || a.mode == "off") a.enabled = false, a.mode = "off";
  if (s.has("layers")) {
    const nlohmann::json& layers = s.at("layers");
    bool ok = layers.is_array();
    for (size_t i = 0; ok && i < layers.size(); ++i) {
      ok = layers[i].is_number_integer() && layers[i].get<int64_t>() >= 0;
      if (ok) a.layers.push_back(layers[i].get<int64_t>());
    }
    std::vector<int64_t> sorted = a.layers;
    std::sort(sorted.begin(), sorted.end());
    ok = ok && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
    s.check(ok, "layers", "an array of distinct layer indices >= 0; empty = every layer");
  }
  return a;
}

nlohmann::json ActivationCheckpointingConfig::to_json() const {
  return {{"enabled", enabled}, {"mode", mode}, {"layers", layers}};
}

}  // namespace autotp
