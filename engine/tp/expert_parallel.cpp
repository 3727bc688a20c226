#include "autotp/tp/expert_parallel.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "autotp/arch/layer_names.h"
#include "autotp/base/error.h"

namespace autotp {
namespace {

// The ep sizes a layout allows: divisors of the dp size, at most the expert count.
std::vector<int> allowed_ep(int dp, int64_t experts) {
  std::vector<int> out;
  for (int d = 1; d <= dp && d <= experts; ++d)
    if (dp % d == 0) out.push_back(d);
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace

ExpertParallelConfig ExpertParallelConfig::read(const JsonSection& top) {
  ExpertParallelConfig c;
  JsonSection s = top.section("expert_parallel", {"enabled", "autoep_size", "expert_tensor_parallel_size"});
  c.enabled = s.boolean("enabled", s.has("autoep_size"));  // a size alone turns it on
  const int64_t size = s.integer("autoep_size", 1);
  s.check(size >= 1 && size <= INT32_MAX, "autoep_size",
          "an integer >= 1 that divides world size / autotp_size, at most the number of experts");
  c.autoep_size = static_cast<int>(size);
  const int64_t etp = s.integer("expert_tensor_parallel_size", 0);
  s.check(etp >= 0 && etp <= INT32_MAX, "expert_tensor_parallel_size", "autotp_size (or 0 for the same)");
  c.expert_tensor_parallel_size = static_cast<int>(etp);
  return c;
}

nlohmann::json ExpertParallelConfig::to_json() const {
  return {{"enabled", enabled}, {"autoep_size", autoep_size}, {"expert_tensor_parallel_size", expert_tensor_parallel_size}};
}

void ExpertParallelConfig::validate(const ModelConfig& model, int world_size, int tp_size) const {
  if (!enabled) return;
  AUTOTP_USER_CHECK(model.num_experts > 0,
                    "expert_parallel.enabled: {} is a dense model (no routed experts); expert parallelism needs "
                    "a mixture of experts (allowed: false)",
                    model.architecture);
  const int dp = world_size / tp_size;
  AUTOTP_USER_CHECK(dp % autoep_size == 0 && autoep_size <= model.num_experts,
                    "expert_parallel.autoep_size {} must divide world size / autotp_size = {} and be at most the {} "
                    "experts (allowed: {})",
                    autoep_size, dp, model.num_experts, fmt::join(allowed_ep(dp, model.num_experts), ", "));
  AUTOTP_USER_CHECK(expert_tensor_parallel_size == 0 || expert_tensor_parallel_size == tp_size,
                    "expert_parallel.expert_tensor_parallel_size {}: autotp splits each expert over the tensor-parallel "
                    "group as the dense layers (allowed: {} = autotp_size, or 0 for the same); DeepSpeed's fold of "
                    "whole experts over tp x dp is not supported",
                    expert_tensor_parallel_size, tp_size);
}

TpPlan place_experts(TpPlan plan, const ExpertPlacement& placement) {
  if (placement.ep_size == 1) return plan;
  std::vector<std::string> remote;
  for (const auto& e : plan.entries())
    if (e.expert >= 0 && !placement.owns(e.expert)) remote.push_back(e.desc.name);
  for (const auto& name : remote) plan.set_remote(name, true);
  return plan;
}

std::string expert_placement_table(const TpPlan& plan, const ModelConfig& config, int ep_size) {
  const ExpertPlacement all{ep_size, 0, config.num_experts};
  // One expert's shards (expert 0 of the first sparse layer) and the expert elements of tp rank 0.
  std::vector<std::string> shapes;
  int64_t layer = -1, numel = 0;
  for (const auto& e : plan.entries()) {
    if (e.expert < 0) continue;
    numel += e.spec.local_numel(0);
    const int64_t l = decoder_layer_of(e.desc.name);
    if (layer < 0) layer = l;
    if (l != layer || e.expert != 0) continue;
    std::vector<std::string> per_tp;
    for (int t = 0; t < plan.tp_size(); ++t) per_tp.push_back(shape_text(e.spec.local_shape(t)));
    shapes.push_back(fmt::format("{} {}", e.desc.module.substr(e.desc.module.rfind('.') + 1), fmt::join(per_tp, " ")));
  }
  std::string out = fmt::format("expert parallelism: ep {} x tp {}; {} experts per sparse layer, {}{} per ep rank\n",
                                ep_size, plan.tp_size(), config.num_experts, all.count(ep_size - 1),
                                all.count(0) != all.count(ep_size - 1) ? fmt::format("-{}", all.count(0)) : "");
  out += fmt::format("one expert's shard per tp rank: {}\n", fmt::join(shapes, ", "));
  out += fmt::format("{:<8} {:<10} {}\n", "ep rank", "experts", "expert parameters per rank (tp rank 0)");
  for (int r = 0; r < ep_size; ++r) {
    const int64_t first = all.first(r), last = first + all.count(r) - 1;
    out += fmt::format("{:<8} {:<10} {:.3f} M (ep 1: {:.3f} M)\n", r,
                       first == last ? fmt::format("{}", first) : fmt::format("{}-{}", first, last),
                       numel * all.count(r) / config.num_experts / 1e6, numel / 1e6);
  }
  return out;
}

}  // namespace autotp
