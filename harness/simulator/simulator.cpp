#include "simulator/simulator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "autotp/model/presets.h"
#include "autotp/base/error.h"
#include "autotp/tp/expert_parallel.h"

namespace autotp::sim {
std::string format_bytes(double bytes) {
  const double gib = 1024.0 * 1024 * 1024;
  if (bytes >= gib) return fmt::format("{:.2f} GiB", bytes / gib);
  if (bytes >= 1024.0 * 1024) return fmt::format("{:.2f} MiB", bytes / (1024.0 * 1024));
  return fmt::format("{:.1f} KiB", bytes / 1024.0);
}

nlohmann::json SimResult::to_json() const {
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < rank_memory.size(); ++r) {
    auto j = rank_memory[r].to_json();
    j["tp_rank"] = r;
    ranks.push_back(j);
  }
  return {{"fits", fits},
          {"memory", memory.to_json()},
          {"time", time.to_json()},
          {"tokens_per_s", tokens_per_s},
          {"mfu", mfu},
          {"model", model},
          {"architecture", architecture},
          {"parameters", parameters},
          {"cluster", cluster},
          {"layout",
           {{"gpus", layout.gpus},
            {"tp", layout.tp},
            {"dp", layout.dp()},
            {"zero_stage", layout.zero_stage},
            {"micro_batch", layout.micro_batch},
            {"seq_len", layout.seq_len},
            {"gas", layout.gas},
            {"dtype", dtype_label(layout.dtype)},
            {"activation_checkpointing", layout.activation_checkpointing},
            {"recompute", layout.recompute()},
            {"sequence_parallel", layout.sequence_parallel},
            {"optimizer", layout.optimizer.type},
            {"overlap_comm", layout.overlap_comm},
            {"offload_optimizer", layout.offloads_optimizer()},
            {"offload_param", layout.offloads_params()},
            {"ep", layout.ep},
            {"edp", layout.edp()}}},
          {"capacity_bytes", capacity_bytes},
          {"usable_bytes", usable_bytes},
          {"model_flops_per_step", time.model_flops},
          {"rank_memory", ranks},
          {"notes", notes}};
}

std::vector<int> allowed_ep(const ModelConfig& config, int dp) {
  std::vector<int> out;
  for (int ep = 1; ep <= dp && ep <= config.num_experts; ++ep)
    if (dp % ep == 0) out.push_back(ep);
  if (out.empty()) out.push_back(1);  // a dense model (or one dp rank): ep 1 only
  return out;
}

namespace {

// As the engine's ExpertParallelConfig::validate and its LoRA check, with the simulator's flags.
void validate_expert_parallel(const ModelConfig& config, const SimLayout& l) {
  if (l.ep == 1) return;
  const int dp = l.dp();
  AUTOTP_USER_CHECK(config.num_experts > 0,
                    "--ep {}: {} is a dense model (no routed experts); expert parallelism needs a mixture of experts "
                    "(allowed: --ep 1)",
                    l.ep, config.architecture);
  AUTOTP_USER_CHECK(l.ep >= 1 && dp % l.ep == 0 && l.ep <= config.num_experts,
                    "--ep {} must divide --gpus / --tp = {} and be at most the model's {} experts (allowed: {})", l.ep,
                    dp, config.num_experts, fmt::join(allowed_ep(config, dp), ", "));
  AUTOTP_USER_CHECK(l.lora_r == 0,
                    "--ep {} with --lora-r {} is not supported (as the engine: expert parallelism trains without "
                    "LoRA; allowed: --ep 1 with --lora-r)",
                    l.ep, l.lora_r);
}

}  // namespace

void validate_layout(const ModelConfig& config, const ClusterSpec& cluster, const SimLayout& l) {
  AUTOTP_USER_CHECK(l.gpus >= 1, "--gpus must be at least 1, got {}", l.gpus);
  AUTOTP_USER_CHECK(l.tp >= 1 && l.gpus % l.tp == 0, "--tp {} does not divide --gpus {} (allowed: divisors of {})",
                    l.tp, l.gpus, l.gpus);
  AUTOTP_USER_CHECK(l.tp <= config.num_heads, "--tp {} is larger than the model's {} attention heads", l.tp,
                    config.num_heads);
  AUTOTP_USER_CHECK(l.zero_stage >= 0 && l.zero_stage <= 3, "--zero {} is not a ZeRO stage (allowed: 0, 1, 2, 3)",
                    l.zero_stage);
  AUTOTP_USER_CHECK(l.micro_batch >= 1, "--micro-batch must be at least 1, got {}", l.micro_batch);
  AUTOTP_USER_CHECK(l.gas >= 1, "--gas must be at least 1, got {}", l.gas);
  AUTOTP_USER_CHECK(l.seq_len >= 1 && l.seq_len <= config.max_positions,
                    "--seq-len {} is outside the model's positions (allowed: 1..{})", l.seq_len, config.max_positions);
  if (!cluster.calibration && l.gpus > cluster.gpus_per_node)
    AUTOTP_USER_CHECK(l.gpus % cluster.gpus_per_node == 0,
                      "--gpus {} on {} must be a multiple of its {} GPUs per node", l.gpus, cluster.name,
                      cluster.gpus_per_node);
  // As the engine: offload_param needs offload_optimizer (exit 2) and applies at stage 3 only.
  AUTOTP_USER_CHECK(!l.offload_param || l.offload_optimizer,
                    "--offload-param needs --offload-optimizer too (zero_optimization.offload_param without "
                    "offload_optimizer: the engine refuses it)");
  AUTOTP_USER_CHECK(!l.offload_param || l.zero_stage == 3,
                    "--offload-param applies at ZeRO stage 3 only (got --zero {})", l.zero_stage);
  validate_expert_parallel(config, l);
  if (cluster.calibration)
    AUTOTP_USER_CHECK(l.dtype != torch::kFloat16,
                      "--dtype fp16 cannot run on cpu-local (LibTorch has no float16 matmul on CPU; allowed: bf16, fp32)");
}

SimResult simulate(const ResolvedModel& model, const ClusterSpec& cluster, const SimLayout& layout) {
  validate_layout(model.config, cluster, layout);
  SimResult r;
  r.model = model.label;
  r.architecture = model.config.architecture;
  r.parameters = count_parameters(model.config);
  r.cluster = cluster.name;
  r.layout = layout;
  const TpPlan plan = layout_plan(model.config, layout);  // with LoRA's factors when asked
  for (int rank = 0; rank < layout.tp; ++rank) {
    const RankShape shape = rank_shape(model.config, plan, rank, layout.ep);
    MemoryEstimate m = estimate_memory(model.config, shape, layout);
    TimeEstimate t = estimate_time(model.config, shape, layout, cluster);
    if (rank == 0 || m.total > r.memory.total) r.memory = m;
    if (rank == 0 || t.step_s > r.time.step_s) r.time = t;
    r.rank_memory.push_back(m);
  }
  r.capacity_bytes = cluster.memory_bytes;
  r.usable_bytes = cluster.memory_bytes - cluster.reserved_bytes;
  r.fits = r.memory.total <= r.usable_bytes;
  const double tokens = static_cast<double>(layout.micro_batch) * layout.seq_len * layout.gas * layout.dp();
  r.tokens_per_s = tokens / r.time.step_s;
  const double peak = cluster.peak_flops(layout.dtype != torch::kFloat32) * layout.gpus;
  r.mfu = r.time.model_flops / r.time.step_s / peak;
  if (!cluster.assumptions.empty()) r.notes.push_back(cluster.assumptions);
  if (layout.ep > 1) {
    const ExpertPlacement placement{layout.ep, 0, model.config.num_experts};
    r.notes.push_back(fmt::format(
        "assumed, not measured: balanced routing under expert parallelism (every expert gets tokens x top-k / "
        "experts of each rank's rows, dropless); reported is ep rank 0, which holds {} of the {} experts per sparse "
        "layer{}; the all-to-alls ({:.0f} MB per rank per step) are priced as ring traffic on the {} link, not "
        "overlapped",
        placement.max_per_rank(), model.config.num_experts,
        placement.max_per_rank() != placement.count(layout.ep - 1) ? " (the most: the split is uneven)" : "",
        r.time.ep_bytes / 1e6,
        expert_parallel_scope(cluster, layout) == GroupScope::kIntraNode ? "intra-node" : "inter-node"));
  }
  if (cluster.calibration && cluster.calibration->world != layout.gpus)
    r.notes.push_back(fmt::format("cpu-local was calibrated with {} ranks, this layout has {}: contention differs",
                                  cluster.calibration->world, layout.gpus));
  if (cluster.calibration && !cluster.calibration->has_costs_for(dtype_label(layout.dtype)))
    r.notes.push_back(fmt::format("cpu-local was calibrated in {}, this layout computes in {}: its compute times are "
                                  "the {} ones (calibrate with --dtype {})",
                                  cluster.calibration->dtype, dtype_label(layout.dtype), cluster.calibration->dtype,
                                  dtype_label(layout.dtype)));
  if (!r.fits)
    r.notes.push_back(fmt::format("does not fit: peak {} > usable {} per GPU", format_bytes(r.memory.total),
                                  format_bytes(r.usable_bytes)));
  if (layout.offload_optimizer && layout.zero_stage == 0)
    r.notes.push_back("offload_optimizer is ignored at ZeRO stage 0 (as the engine does: it offloads a "
                      "partition)");
  const int64_t node_host = r.memory.host.total() * std::min(layout.gpus, cluster.gpus_per_node);
  if (node_host > cluster.host_memory_bytes && cluster.host_memory_bytes > 0)
    r.notes.push_back(fmt::format("the node's ranks need {} of host memory for the offloaded states, more than "
                                  "its {}",
                                  format_bytes(static_cast<double>(node_host)),
                                  format_bytes(static_cast<double>(cluster.host_memory_bytes))));
  return r;
}

std::vector<SimResult> sweep(const ResolvedModel& model, const ClusterSpec& cluster, const SimLayout& base,
                             bool every_ep) {
  if (!every_ep && base.ep > 1) {  // ep | dp | gpus: an ep that divides no dp of the sweep is bad input
    SimLayout widest = base;
    widest.tp = 1;
    validate_expert_parallel(model.config, widest);
  }
  std::vector<SimResult> out;
  for (int tp = 1; tp <= base.gpus; ++tp) {
    if (base.gpus % tp != 0 || tp > model.config.num_heads) continue;
    // A mixture of experts: every ep of this dp (ep 1 included), or the one asked for where it fits.
    std::vector<int> eps = every_ep ? allowed_ep(model.config, base.gpus / tp) : std::vector<int>{base.ep};
    if (!every_ep && (base.gpus / tp) % base.ep != 0) continue;
    for (int ep : eps) {
      if (ep > 1 && base.lora_r > 0) continue;  // not supported with LoRA
      for (int stage = 0; stage <= 3; ++stage) {
        SimLayout l = base;
        l.tp = tp;
        l.ep = ep;
        l.zero_stage = stage;
        l.offload_param = base.offload_param && stage == 3;  // applies at stage 3 only
        out.push_back(simulate(model, cluster, l));
      }
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const SimResult& a, const SimResult& b) {
    if (a.fits != b.fits) return a.fits;
    return a.tokens_per_s > b.tokens_per_s;
  });
  return out;
}

std::string format_result(const SimResult& r) {
  const auto& l = r.layout;
  const auto& m = r.memory;
  const auto& t = r.time;
  std::string s = fmt::format(
      "{} ({}, {:.3f}B parameters) on {}: {} GPUs = dp {} x tp {}{}, ZeRO-{}, {}, micro-batch {} x seq {} x gas {}{}\n",
      r.model, r.architecture, r.parameters / 1e9, r.cluster, l.gpus, l.dp(), l.tp,
      l.ep > 1 ? fmt::format(" (ep {} x edp {} of dp)", l.ep, l.edp()) : "", l.zero_stage, dtype_label(l.dtype),
      l.micro_batch, l.seq_len, l.gas, l.recompute() ? ", recompute" : "");
  s += "memory per GPU (worst tp rank):\n";
  auto row = [&](const char* name, int64_t bytes) { s += fmt::format("  {:<24}{:>14}\n", name, format_bytes(bytes)); };
  row("parameters", m.states.params);
  row("gradients", m.states.grads);
  row("fp32 master weights", m.states.master_weights);
  row("optimizer moments", m.states.optimizer_states);
  if (l.ep > 1)
    s += fmt::format("  {:<24}{:>14}  (of the above: {:.3f}B expert parameters, ZeRO over edp {})\n",
                     "expert model states", format_bytes(static_cast<double>(m.expert_states.total())),
                     m.expert_numel / 1e9, l.edp());
  row("activations", m.activations);
  row("communication buffers", m.comm_buffers);
  if (m.transient_grads) row("transient gradients", m.transient_grads);
  if (m.optimizer_temporaries) row("optimizer temporaries", m.optimizer_temporaries);
  s += fmt::format("  {:<24}{:>14}  (peak in the {} phase) of {} usable: {}\n", "total", format_bytes(m.total),
                   m.peak_phase == "optimizer" ? "optimizer" : "forward/backward", format_bytes(r.usable_bytes),
                   r.fits ? "fits" : "DOES NOT FIT");
  if (l.offloads_optimizer()) {
    s += fmt::format("host memory per rank (ZeRO-Offload{}):\n",
                     l.offloads_params() ? ", parameters too" : "");
    row("fp32 master weights", m.host.master_weights);
    row("optimizer moments", m.host.optimizer_states);
    row("gradient partition", m.host.grads);
    row(l.offloads_params() ? "parameter partition" : "parameter staging", m.host.params);
    row("total", m.host.total());
    s += fmt::format("  {:<24}{:>14} device->host, {} host->device\n", "PCIe per step",
                     format_bytes(static_cast<double>(t.pcie_d2h_bytes)),
                     format_bytes(static_cast<double>(t.pcie_h2d_bytes)));
  }
  s += "step time:\n";
  auto trow = [&](const char* name, double sec) { s += fmt::format("  {:<24}{:>12.3f} ms\n", name, sec * 1e3); };
  trow("compute", t.compute_s);
  trow("tp communication", t.tp_comm_s);
  if (l.ep > 1) trow("ep all-to-all", t.ep_comm_s);
  trow("ZeRO communication", t.zero_comm_s);
  trow("overlapped", t.overlap_s);
  if (l.offloads_optimizer()) {
    trow("offload D2H exposed", t.offload_d2h_exposed_s);
    trow("CPU Adam", t.cpu_adam_s);
    trow("offload H2D exposed", t.offload_h2d_exposed_s);
  }
  trow("step", t.step_s);
  s += fmt::format("  {:<24}{:>12.0f}\n  {:<24}{:>11.1f}%\n", "tokens/s", r.tokens_per_s, "MFU", 100 * r.mfu);
  for (const auto& n : r.notes) s += "note: " + n + "\n";
  return s;
}

namespace {

bool any_expert_parallel(const std::vector<SimResult>& results) {
  return std::any_of(results.begin(), results.end(), [](const SimResult& r) { return r.layout.ep > 1; });
}

}  // namespace

std::string format_sweep(const std::vector<SimResult>& results) {
  // The ep column only where a layout has expert parallelism (dense sweeps read as before).
  const bool ep = any_expert_parallel(results);
  std::string s = fmt::format("{:>3} {:>3} {}{:>4} {:>12} {:>12} {:>12} {:>10} {:>10} {:>12} {:>7}  {}\n", "tp", "dp",
                              ep ? fmt::format("{:>3} ", "ep") : "", "zero", "states", "activations", "peak",
                              "compute", "comm", "tokens/s", "MFU", "fits");
  for (const auto& r : results)
    s += fmt::format("{:>3} {:>3} {}{:>4} {:>12} {:>12} {:>12} {:>8.1f}ms {:>8.1f}ms {:>12.0f} {:>6.1f}%  {}\n",
                     r.layout.tp, r.layout.dp(), ep ? fmt::format("{:>3} ", r.layout.ep) : "", r.layout.zero_stage,
                     format_bytes(r.memory.states.total()), format_bytes(r.memory.activations),
                     format_bytes(r.memory.total), r.time.compute_s * 1e3,
                     (r.time.tp_comm_s + r.time.ep_comm_s + r.time.zero_comm_s - r.time.overlap_s) * 1e3,
                     r.tokens_per_s, 100 * r.mfu, r.fits ? "yes" : "no");
  return s;
}

std::string markdown_sweep(const std::vector<SimResult>& results) {
  const bool ep = any_expert_parallel(results);
  std::string s = fmt::format(
      "| tp | dp | {}ZeRO | model states | activations | peak / GPU | fits | compute | tp comm | {}ZeRO comm | "
      "hidden | step | tokens/s | MFU |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|{}\n",
      ep ? "ep | " : "", ep ? "ep all-to-all | " : "", ep ? "---|---|" : "");
  for (const auto& r : results)
    s += fmt::format("| {} | {} | {}{} | {} | {} | {} | {} | {:.1f} ms | {:.1f} ms | {}{:.1f} ms | {:.1f} ms | "
                     "{:.1f} ms | {:.0f} | {:.1f}% |\n",
                     r.layout.tp, r.layout.dp(), ep ? fmt::format("{} | ", r.layout.ep) : "", r.layout.zero_stage,
                     format_bytes(r.memory.states.total()), format_bytes(r.memory.activations),
                     format_bytes(r.memory.total), r.fits ? "yes" : "**no**", r.time.compute_s * 1e3,
                     r.time.tp_comm_s * 1e3, ep ? fmt::format("{:.1f} ms | ", r.time.ep_comm_s * 1e3) : "",
                     r.time.zero_comm_s * 1e3, r.time.overlap_s * 1e3, r.time.step_s * 1e3, r.tokens_per_s,
                     100 * r.mfu);
  return s;
}

}  // namespace autotp::sim
