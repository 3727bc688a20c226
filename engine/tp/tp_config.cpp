#include "autotp/tp/tp_config.h"

#include <cstdint>

namespace autotp {

TensorParallelConfig TensorParallelConfig::read(const JsonSection& top) {
  TensorParallelConfig t;
  JsonSection s = top.section("tensor_parallel", {"autotp_size", "partition_config"});
  int64_t size = s.integer("autotp_size", t.autotp_size);
  s.check(size >= 1 && size <= INT32_MAX, "autotp_size", "an integer >= 1 that divides the world size");
  t.autotp_size = static_cast<int>(size);
  if (s.has("partition_config")) {
    try {
      t.layer_specs = parse_partition_config(s.at("partition_config"));
    } catch (const UserError& e) {
      s.fail("{}", e.what());  // adds the source prefix
    }
  }
  return t;
}

nlohmann::json TensorParallelConfig::to_json() const {
  nlohmann::json tp = {{"autotp_size", autotp_size}};
  if (!layer_specs.empty()) {
    nlohmann::json specs = nlohmann::json::array();
    for (const auto& spec : layer_specs) {
      nlohmann::json s = {{"patterns", spec.patterns}, {"partition_type", tp_role_name(spec.role)}};
      if (!spec.shape.empty()) s["shape"] = spec.shape;
      specs.push_back(std::move(s));
    }
    tp["partition_config"] = {{"layer_specs", std::move(specs)}};
  }
  return tp;
}

}  // namespace autotp
