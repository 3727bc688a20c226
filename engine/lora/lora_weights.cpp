#include "autotp/lora/lora_weights.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/ranges.h>

#include <cmath>
#include <filesystem>
#include <set>

#include "autotp/base/text.h"
#include "autotp/base/error.h"
#include "autotp/base/json_file.h"
#include "autotp/io/safetensors.h"

namespace autotp {
namespace {

namespace fs = std::filesystem;

}  // namespace

std::string peft_key(const CausalLM& model, const std::string& param_name) {
  const std::string bias = ".bias";
  if (ends_with(param_name, bias)) {
    const std::string module = param_name.substr(0, param_name.size() - bias.size());
    if (model.plan().contains(module + ".lora_A.weight")) return kPeftKeyPrefix + module + ".base_layer.bias";
  }
  return kPeftKeyPrefix + param_name;
}

LoraConfig read_adapter_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / kAdapterConfigFile).string();
  AUTOTP_USER_CHECK(fs::is_regular_file(path), "--adapter {}: no {} (a PEFT adapter directory holds {} and {})", dir,
                    kAdapterConfigFile, kAdapterConfigFile, kAdapterWeightsFile);
  return LoraConfig::from_adapter_config(read_json_file(path, "adapter config"), path);
}

void init_lora_weights(CausalLM& model, const LoraConfig& lora, uint64_t seed) {
  torch::NoGradGuard no_grad;
  model.set_adapter_scaling(lora.scaling());
  model.set_adapter_dropout(lora.lora_dropout);
  const int rank = model.tp().rank();
  for (auto& p : model.parameters()) {
    if (!p.entry->adapter) continue;
    const auto& shape = p.entry->desc.shape;
    const bool is_a = ends_with(p.name(), ".lora_A.weight");
    auto gen = at::detail::createCPUGenerator(seed ^ fnv1a64(p.name()));
    torch::Tensor full;
    if (is_a && lora.init_lora_weights == "gaussian") {
      full = torch::empty(shape).normal_(0.0, 1.0 / static_cast<double>(lora.r), gen);
    } else if (is_a || lora.init_lora_weights == "false") {
      // kaiming_uniform_(a = sqrt(5)) of an [out, in] weight: bound 1 / sqrt(in).
      const double bound = 1.0 / std::sqrt(static_cast<double>(shape[1]));
      full = torch::empty(shape).uniform_(-bound, bound, gen);
    } else {
      full = torch::zeros(shape);
    }
    p.tensor.copy_(p.spec().slice(full, rank));
  }
}

void load_adapter_weights(CausalLM& model, const std::string& dir) {
  torch::NoGradGuard no_grad;
  const std::string path = (fs::path(dir) / kAdapterWeightsFile).string();
  AUTOTP_USER_CHECK(fs::is_regular_file(path), "--adapter {}: no {}", dir, kAdapterWeightsFile);
  auto file = io::SafetensorsFile::open(path);
  std::set<std::string> unused;
  for (const auto& t : file->tensors()) unused.insert(t.name);
  std::vector<std::string> missing, wrong;
  const int rank = model.tp().rank();
  for (auto& p : model.parameters()) {
    if (!p.trains()) continue;
    const std::string key = peft_key(model, p.name());
    if (!file->contains(key)) {
      missing.push_back(key);
      continue;
    }
    unused.erase(key);
    const auto& info = file->info(key);
    if (info.shape != p.entry->desc.shape) {
      wrong.push_back(fmt::format("{} is [{}] in the file, [{}] in this model", key, fmt::join(info.shape, ", "),
                                  fmt::join(p.entry->desc.shape, ", ")));
      continue;
    }
    p.tensor.copy_(p.spec().slice(file->read(key, p.tensor.scalar_type()), rank));
  }
  AUTOTP_USER_CHECK(wrong.empty(), "{}: tensor shapes do not fit the base model (an adapter for another model?): {}",
                    path, fmt::join(wrong, "; "));
  AUTOTP_USER_CHECK(missing.empty(), "{}: missing {} tensor(s) the adapter config implies: {}", path, missing.size(),
                    fmt::join(missing, ", "));
  AUTOTP_USER_CHECK(unused.empty(),
                    "{}: {} tensor(s) that are not trained parameters of this adapter config and model: {}", path,
                    unused.size(), fmt::join(unused, ", "));
}

std::vector<std::string> adapted_modules(const CausalLM& model) {
  std::vector<std::string> out;
  for (const auto& e : model.plan().entries())
    if (e.adapter && ends_with(e.desc.name, ".lora_A.weight"))
      out.push_back(e.desc.name.substr(0, e.desc.name.size() - std::string(".lora_A.weight").size()));
  return out;
}

}  // namespace autotp
