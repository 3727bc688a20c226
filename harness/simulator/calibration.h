// Calibration of the `cpu-local` cluster: what this machine measured for the
// operations a training step is made of, with the thread count of a real run.
// Compute costs are one rank's (rank 0 measures while the others wait), and the
// contention of N ranks on the shared cores is one measured factor:
//   - GEMM seconds on a fixed grid of shapes and at the exact shapes of a step
//     ([m, k] x [k, n], batched for attention) of a given model, micro-batch and
//     sequence length, at every tp; in fp32 and in bf16
//   - elementwise ops: seconds = latency + bytes / bandwidth, forward without
//     autograd, forward with autograd, and forward + backward; in fp32 and bf16
//   - the framework overhead: the real forward + backward of the model at tp 1
//     over what the costs above predict, as a ratio
//   - the optimizer pass on n partition elements: the fp64 gradient norm,
//     clipping and an AdamW update, seconds = latency + n / elements_per_s
//   - the same overhead ratio at each tp size that fits the world, from the model's
//     real forward + backward with all tp groups running at once
//   - the concurrency slowdown: that forward + backward with every rank running
//     it at once, over rank 0 alone
//   - collectives over `Comm` (Gloo) for each group size that divides the world,
//     with world / size groups running at once as in training:
//     seconds = latency + bytes / bytes_per_s, from a least-squares fit
//   - what those collectives cost on top inside a step, as shares of the forward +
//     backward: the model's forward + backward followed by a model-sized
//     all-reduce and all-gather, and with a ZeRO-3 layer gather before every
//     layer, against the same without them (alternating rounds of both, so that
//     drift falls on both alike); and a tiny collective between short GEMMs
//     against the GEMMs alone (the wait for a descheduled partner)
// Every time is the mean over its measuring window, scaled to a host that takes
// no CPU from this machine (times 1 - the /proc/stat steal fraction of that
// window): a shared VM's steal changes by the minute, and a run's own steal is
// applied when it is simulated.
// Written as JSON by `autotp simulate --calibrate`, read by the cpu-local cluster.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <map>
#include <optional>
#include <tuple>
#include <string>
#include <vector>

#include "autotp/arch/model_config.h"

namespace autotp::sim {

// One matmul shape: batch x ([m, k] x [k, n]).
struct GemmShape {
  int64_t m = 0, k = 0, n = 0, batch = 1;
  double flops() const { return 2.0 * m * k * n * batch; }
  bool operator<(const GemmShape& o) const {
    return std::tie(m, k, n, batch) < std::tie(o.m, o.k, o.n, o.batch);
  }
};

// seconds = latency_s + amount / rate (amount: bytes, or FLOPs for GEMMs).
struct LinearCost {
  double latency_s = 0;
  double rate = 1;  // bytes/s or FLOP/s
  double seconds(double amount) const { return latency_s + amount / rate; }
};

// A regular grid of GEMM shapes (m, k, n each one of these, batch 1) timed in
// every calibration, whatever the model: a shape the calibration did not time is
// priced at the FLOP rate interpolated over it (log-linear in each dimension),
// so that a model it never saw gets its GEMMs' measured efficiency, not a fit.
inline constexpr int64_t kGemmGrid[] = {16, 64, 256, 1024, 2048};

// Compute costs in one dtype, measured by micro-benchmarks on this machine.
struct ComputeCosts {
  std::map<GemmShape, double> gemm_seconds;  // measured shapes (the grid, the calibration model's step shapes)
  LinearCost gemm_fit;                       // over every measured shape (older files: other shapes)
  double gemm_peak_flops = 0;                // best measured FLOP/s (the "peak" for MFU)
  LinearCost elementwise_forward;            // no autograd
  LinearCost elementwise_forward_grad;       // forward while autograd records
  LinearCost elementwise_forward_backward;   // forward and backward of one op
  // Seconds of one GEMM: measured, else at the grid's interpolated rate (a batch
  // of b runs as b GEMMs), else (older files without the grid) the fit.
  double gemm(const GemmShape& shape) const;
};

struct Calibration {
  int world = 1;               // ranks that ran at once
  int threads_per_rank = 1;
  int cores = 1;
  std::string model;           // the model whose step shapes were measured
  std::string device = "cpu";  // "cpu" | "cuda": where the compute was timed (optional key; older files: cpu)
  // The compute dtype of the timed GEMMs, elementwise ops and model steps ("fp32" |
  // "bf16" | "fp16"; optional key, older files: fp32). A CPU with bf16 instructions
  // runs bf16 GEMMs at twice the fp32 rate or more, so a layout is timed with the
  // compute costs of its own dtype (other_dtypes; the simulator notes a dtype
  // neither measured).
  std::string dtype = "fp32";
  int64_t micro_batch = 0, seq_len = 0;
  ComputeCosts compute;  // in `dtype`
  // The same micro-benchmarks in the other compute dtype (a calibration in fp32
  // also times bf16 and the other way round): a layout in that dtype is timed with
  // them. Optional key "other_dtypes" (older files: none).
  std::map<std::string, ComputeCosts> other_dtypes;
  // The compute costs of a layout in `dtype_name`: its own where measured, else the calibration dtype's.
  const ComputeCosts& costs_for(const std::string& dtype_name) const;
  bool has_costs_for(const std::string& dtype_name) const {
    return dtype_name == dtype || other_dtypes.count(dtype_name) > 0;
  }
  std::optional<LinearCost> optimizer_step;  // norm + clip + AdamW; amount = partition elements (absent in older files)
  // ZeRO-Offload's host optimizer: FlatOptimizer::step (at::_fused_adamw_) on fp32
  // CPU tensors, bytes per second per thread (28 bytes per element: parameter and
  // both moments read and written, the gradient read). Absent in older files.
  std::optional<double> cpu_adam_bytes_per_core_s;
  // The framework's fixed cost per dispatched op (dispatcher, autograd graph,
  // allocator), whatever the op's size: the calibration model's narrow copy
  // (op_count.h: its ops on tensors of a few elements) timed forward + backward,
  // over the top-level ops and autograd nodes it dispatches; a step's are
  // counted the same way. CPU only; absent in older files and GPU calibrations
  // (the elementwise fits' latencies stand in).
  std::optional<double> dispatch_op_s;
  // Framework overhead as a share of the compute the micro-benchmarks predict: the
  // calibration model's real forward + backward at tp 1 (rank 0 alone) over the sum
  // of its GEMM and elementwise costs, minus 1, after its counted ops' dispatch
  // costs (what is left grows with the work: cold caches, GEMMs at the model's
  // layouts). A ratio, not seconds, so that it carries to models of other sizes.
  double overhead_ratio = 0;
  // The same at tp sizes > 1 (by tp): the model's forward + backward with every tp
  // group at once, over the concurrency slowdown, beyond the GEMM, elementwise and
  // lock-step tp collective costs, as a share of the GEMM and elementwise costs.
  // Used in place of overhead_ratio at that tp.
  std::map<int, double> overhead_ratio_by_tp;
  // The model's forward + backward with all `world` ranks at once over rank 0 alone
  // (>= 1): on a machine with fewer cores than ranks x threads they share the cores.
  double concurrency_slowdown = 1;
  // Collectives inside a step of ranks that time-share the cores (by group size):
  // they arrive apart in proportion to the compute they ran since they last met,
  // so each waits a share of that compute beyond the collective's back-to-back
  // cost. `step_collective_skew`: per gradient all-reduce and parameter all-gather
  // after the forward + backward, the share of that forward + backward;
  // `layer_gather_skew`: all ZeRO-3 layer gathers of a step together, the share of
  // its forward + backward. Applied in proportion to how much a layout
  // oversubscribes the cores (none where every rank has its cores).
  std::map<int, double> step_collective_skew;
  std::map<int, double> layer_gather_skew;
  // Seconds one lock-step collective over a group of that size costs beyond its
  // back-to-back fit when every rank computes briefly (a 192^3 GEMM) between calls,
  // all groups at once: the wait for a partner that time-sharing had descheduled.
  // Per collective of a step, scaled like the skew (by skew_share).
  std::map<int, double> collective_wake_s;
  double host_steal_fraction = 0;  // what the host took while calibrating (the times are without it)
  std::map<int, LinearCost> all_reduce;      // by group size
  std::map<int, LinearCost> all_gather;      // by group size; amount = gathered bytes
  int64_t memory_bytes = 0;                  // MemTotal of the machine

  // Compute slowdown with `ranks` ranks at once: 1 for one rank, the measured
  // factor for `world`. It is the cores' sharing (oversubscription, below: arithmetic)
  // times what the calibration measured beyond it (concurrency_slowdown over the
  // world's oversubscription: memory bandwidth and caches shared), the latter
  // linear in the number of ranks.
  double slowdown(int ranks) const;
  // Ranks x threads over cores, at least 1: how much `ranks` ranks time-share the cores.
  double oversubscription(int ranks) const;
  // How much of the measured skew a layout of `ranks` ranks has: 0 where it does not
  // oversubscribe the cores, 1 at the calibration's oversubscription, linear.
  double skew_share(int ranks) const;

  nlohmann::json to_json() const;
  static Calibration from_json(const nlohmann::json& j, const std::string& source);
  static Calibration from_file(const std::string& path);  // UserError naming the file
};

// The fused AdamW's rate per core where nothing was measured (the GPU clusters):
// this machine's EPYC core with two threads (docs/simulator.md, "ZeRO-Offload").
constexpr double kDefaultCpuAdamBytesPerCoreS = 10e9;

// Least-squares fit of seconds = latency + amount / rate (latency clamped >= 0).
LinearCost fit_linear_cost(const std::vector<double>& amounts, const std::vector<double>& seconds);

// "fp32" | "bf16" | "fp16": how the simulator names a compute dtype.
const char* dtype_label(torch::ScalarType t);

// Default calibration file: $AUTOTP_CALIBRATION, else reports/calibration/cpu-local.json.
std::string default_calibration_path();

struct CalibrationOptions {
  std::string model = "preset:llama-tiny";  // whose step shapes the GEMMs use
  int64_t micro_batch = 2;
  int64_t seq_len = 64;
  double seconds_per_point = 0.05;  // minimum measuring time per shape / size
  torch::Device device = torch::kCPU;  // where the tensors live: a GPU calibration times the GPU's work
  torch::ScalarType dtype = torch::kFloat32;  // compute dtype of the model's steps (collectives stay fp32)
};

// Runs on every rank of a launched world (collective: all ranks call it); returns the
// calibration on rank 0 (other ranks return theirs with rank-0-agreed numbers).
Calibration run_calibration(const CalibrationOptions& options);

}  // namespace autotp::sim
