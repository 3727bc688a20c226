#include "support/model_fixtures.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>

#include "autotp/io/safetensors.h"
#include "autotp/model/presets.h"

namespace autotp::test {

std::string make_temp_dir(const std::string& tag) {
  std::string pattern = "/tmp/autotp-" + tag + "-XXXXXX";
  if (!mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed for " + pattern);
  return pattern;
}

std::string write_line_corpus(const std::string& path, int lines, const std::string& sentence) {
  std::string text;
  for (int i = 0; i < lines; ++i) text += "Line " + std::to_string(i) + ": " + sentence + "\n";
  io::write_text_file_atomic(path, text);
  return path;
}

std::string write_model_dir(const std::string& dir, const nlohmann::json& config,
                            const std::map<std::string, torch::Tensor>& weights) {
  ::mkdir(dir.c_str(), 0755);
  io::NamedTensors tensors(weights.begin(), weights.end());
  io::write_checkpoint(dir, tensors);
  io::write_text_file_atomic(dir + "/config.json", config.dump(2));
  return dir;
}

nlohmann::json preset_config(const std::string& name, const nlohmann::json& overrides) {
  nlohmann::json config = find_preset(name).config;
  config.merge_patch(overrides);
  return config;
}

std::unique_ptr<CausalLM> sharded_preset(const std::string& name, Topology& topo, torch::ScalarType dtype,
                                         uint64_t seed) {
  auto source = resolve_model("preset:" + name);
  TpPlanOptions plan_options;
  plan_options.tp_size = topo.tp_size();
  return load_model(source, TpPlan::build(source.config, plan_options), topo.tp(), dtype, seed);
}

}  // namespace autotp::test
