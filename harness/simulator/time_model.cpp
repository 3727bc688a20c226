#include "simulator/time_model.h"

#include "autotp/tp/expert_parallel.h"
#include "autotp/tp/tp_traffic.h"
#include "autotp/zero/zero_traffic.h"
#include "autotp/zero/zero_units.h"
#include "simulator/memory_model.h"
#include "simulator/op_count.h"

#include <algorithm>
#include <cmath>

#include "autotp/arch/param_layout.h"
#include "autotp/optim/optimizer.h"
#include "autotp/zero/flat_layout.h"
#include "autotp/zero/model_state_bytes.h"

namespace autotp::sim {
namespace {

double factor(CollectiveOp op, int n) {
  return op == CollectiveOp::kAllReduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;  // all-to-all too
}

// The calibrated cost for group size n, or the nearest calibrated size scaled by the ring factor.
const LinearCost* nearest(const std::map<int, LinearCost>& costs, int n, int* found) {
  const LinearCost* best = nullptr;
  int best_n = 0;
  for (const auto& [size, cost] : costs) {
    if (!best || std::abs(size - n) < std::abs(best_n - n)) {
      best = &cost;
      best_n = size;
    }
  }
  *found = best_n;
  return best;
}

// Elementwise costs: seconds for an op on `elements` elements of `element_size` bytes
// (two inputs read, one output written).
struct Elementwise {
  LinearCost forward, forward_grad, forward_backward;
  int64_t element_size = 4;
  double fwd(double elements, double ops = 1) const { return ops * forward.seconds(3 * elements * element_size); }
  double grad(double elements, double ops = 1) const {
    return ops * forward_grad.seconds(3 * elements * element_size);
  }
  double fb(double elements, double ops = 1) const {
    return ops * forward_backward.seconds(3 * elements * element_size);
  }
};

Elementwise elementwise_costs(const ClusterSpec& c, torch::ScalarType dtype) {
  const int64_t element_size = static_cast<int64_t>(c10::elementSize(dtype));
  Elementwise e;
  e.element_size = element_size;
  if (c.calibration) {
    const ComputeCosts& costs = c.calibration->costs_for(dtype_label(dtype));
    e.forward = costs.elementwise_forward;
    e.forward_grad = costs.elementwise_forward_grad;
    e.forward_backward = costs.elementwise_forward_backward;
  } else {
    // One kernel reads and writes its tensors once at HBM speed; the backward of
    // an elementwise op is about two more such kernels.
    e.forward = e.forward_grad = {c.kernel_latency_s, c.memory_bytes_per_s};
    e.forward_backward = {3 * c.kernel_latency_s, c.memory_bytes_per_s / 3};
  }
  return e;
}

// Elementwise work of one decoder layer's forward, as (ops, elements) pairs, and
// ops that only dispatch (views, transposes).
struct LayerOps {
  std::vector<std::pair<double, double>> ops;
  double views = 0;
};

LayerOps layer_ops(const ModelConfig& c, const RankShape& s, int64_t B, int64_t T) {
  const double BT = static_cast<double>(B * T), BTH = BT * s.hidden;
  const double Q = BT * s.local_heads * s.head_dim, K = BT * s.local_kv_heads * s.head_dim;
  const double S = static_cast<double>(B) * s.local_heads * T * T, I = BT * s.local_intermediate;
  LayerOps l;
  if (s.gpt2) {
    l.ops = {{2, BTH} /*layer norms*/, {2, Q} /*k, v per query head*/, {3, S} /*scale, mask, softmax*/,
             {1, Q} /*attention output copy*/, {6, BTH} /*row reduce copies, row biases, residuals*/,
             {8, I} /*gelu_new*/};
    l.views = 10;
  } else {
    l.ops = {{8, BTH} /*two RMSNorms: pow, mul, mul (mean on BTH)*/, {4, BT} /*add, rsqrt*/,
             {4.5, Q} /*rotary q*/, {4.5, K} /*rotary k*/, {2, Q} /*k, v per query head*/,
             {3, S} /*scale, mask, softmax*/, {1, Q} /*attention output copy*/,
             {4, BTH} /*row reduce copies, residuals*/, {2, I} /*silu, product*/};
    l.views = 14;
  }
  if (c.num_experts > 0) {
    // A sparse block (CausalLM::moe_block) dispatches more ops than the dense MLP
    // above counts (whose activation and product cover the experts' volume): the
    // router's softmax, top-k, normalisation, cast and counts, then per expert its
    // token selection (== e, nonzero), the token and slot selects, the gather of its
    // tokens, the weighting and the index_add back, and its own activation and product.
    // Every layer is modelled on layer 0: these count in the share of the layers that are sparse.
    const double E = static_cast<double>(c.num_experts), k = static_cast<double>(c.experts_per_token);
    const double sparse = static_cast<double>(s.sparse_layers) / std::max<int64_t>(1, c.num_layers);
    l.ops.push_back({6 * sparse, BT * E});
    if (s.ep <= 1) {
      const double rows = BT * k / E;  // an expert's share of the tokens
      l.ops.push_back({2 * E * sparse, BT * k});
      l.ops.push_back({3 * E * sparse, rows});
      l.ops.push_back({3 * E * sparse, rows * s.hidden});
      l.ops.push_back({2 * (E - 1) * sparse, 0});
    } else {
      // Expert parallelism (expert_dispatch.cpp): one sort of the choices and the
      // counts, the gather of the rows to send, the regrouping of the rows that
      // arrive, the concatenation of the local experts' outputs and their reordering
      // back, then the weighting and the index_add of the returned rows.
      const double local = static_cast<double>(s.local_experts);
      const double arrived = BT * k * s.expert_rows_share;  // rows this rank's experts compute
      l.ops.push_back({4 * sparse, BT * k});
      l.ops.push_back({3 * sparse, BT * k * s.hidden});
      l.ops.push_back({3 * sparse, arrived * s.hidden});
      l.ops.push_back({2 * local * sparse, 0});
    }
  }
  return l;
}

double sum_ops(const LayerOps& l, const Elementwise& e, bool backward) {
  double t = 0;
  for (const auto& [count, elements] : l.ops) t += backward ? e.fb(elements, count) : e.grad(elements, count);
  return t + l.views * (backward ? e.forward_backward.latency_s : e.forward_grad.latency_s) / 3;
}

// A calibrated per-group-size value: the exact size, else the nearest one, else 0.
double at_group(const std::map<int, double>& values, int n) {
  double found = 0;
  int best = 0;
  for (const auto& [size, value] : values) {
    if (best == 0 || std::abs(size - n) < std::abs(best - n)) {
      best = size;
      found = value;
    }
  }
  return found;
}

}  // namespace

double zero3_gather_elements(const FlatRange& r, int64_t /*padded*/, int dp) {
  // A unit is cut evenly over dp (flat_layout.h): every rank sends its padded 1/dp.
  return static_cast<double>((r.end - r.begin + dp - 1) / dp * dp);
}

nlohmann::json TimeEstimate::to_json() const {
  return {{"compute_s", compute_s},     {"tp_comm_s", tp_comm_s},           {"zero_comm_s", zero_comm_s},
          {"overlap_s", overlap_s},     {"step_s", step_s},                 {"gemm_s", gemm_s},
          {"elementwise_s", elementwise_s}, {"dispatch_s", dispatch_s}, {"counted_ops", counted_ops}, {"counted_nodes", counted_nodes}, {"overhead_s", overhead_s}, {"optimizer_s", optimizer_s},   {"tp_collectives", tp_collectives},
          {"zero_collectives", zero_collectives},
          {"ep_comm_s", ep_comm_s},     {"ep_collectives", ep_collectives}, {"ep_bytes", ep_bytes},
          {"offload", {{"pcie_d2h_bytes", pcie_d2h_bytes},
                       {"pcie_h2d_bytes", pcie_h2d_bytes},
                       {"pcie_d2h_s", pcie_d2h_s},
                       {"pcie_h2d_s", pcie_h2d_s},
                       {"d2h_exposed_s", offload_d2h_exposed_s},
                       {"cpu_adam_s", cpu_adam_s},
                       {"h2d_exposed_s", offload_h2d_exposed_s}}}};
}

double collective_seconds(const ClusterSpec& c, CollectiveOp op, double bytes, int group, GroupScope scope) {
  if (group <= 1) return 0;
  if (c.calibration) {
    // Calibrated: all-reduce and all-gather. A reduce-scatter is the all-reduce's
    // first half (each rank sums only its slice): its bytes term scaled by
    // (n-1)/n over 2(n-1)/n.
    // An all-to-all moves an all-gather's bytes per rank: timed from the all-gather fit.
    const bool gather_like = op == CollectiveOp::kAllGather || op == CollectiveOp::kAllToAll;
    const auto& table = gather_like ? c.calibration->all_gather : c.calibration->all_reduce;
    const CollectiveOp measured = gather_like ? CollectiveOp::kAllGather : CollectiveOp::kAllReduce;
    int n = 0;
    const LinearCost* cost = nearest(table, group, &n);
    if (cost) return cost->latency_s + (bytes / cost->rate) * factor(op, group) / factor(measured, n);
  }
  const LinkSpec& link = scope == GroupScope::kInterNode ? c.inter_node : c.intra_node;
  return link.latency_s + factor(op, group) * bytes / link.bus_bytes_per_s;
}

double gemm_seconds(const ClusterSpec& c, const GemmShape& shape, torch::ScalarType dtype) {
  const bool sixteen_bit = dtype != torch::kFloat32;
  if (c.calibration) return c.calibration->costs_for(dtype_label(dtype)).gemm(shape);
  return c.kernel_latency_s + shape.flops() / (c.peak_flops(sixteen_bit) * c.gemm_efficiency);
}

std::vector<std::pair<GemmShape, double>> step_gemms(const ModelConfig& config, const RankShape& s,
                                                     const SimLayout& l) {
  std::vector<std::pair<GemmShape, double>> g;
  const int64_t BT = l.micro_batch * l.seq_len, T = l.seq_len, D = s.head_dim;
  const double layers = static_cast<double>(config.num_layers);
  const double forwards = l.recompute() ? 2 : 1;  // a recomputed layer runs its forward twice
  for (const auto& lin : s.layer_linears) {
    const int64_t M = std::max<int64_t>(1, std::llround(static_cast<double>(BT) * lin.token_share));
    g.push_back({{M, lin.in, lin.out, 1}, layers * forwards});
    g.push_back({{M, lin.out, lin.in, 1}, layers});  // input gradient
    if (!lin.frozen) g.push_back({{lin.out, M, lin.in, 1}, layers});  // weight gradient (none for LoRA's base)
  }
  const int64_t bh = l.micro_batch * s.local_heads;
  g.push_back({{T, D, T, bh}, layers * forwards});  // scores = q k^T
  g.push_back({{T, T, D, bh}, layers * forwards});  // probs v
  g.push_back({{T, T, D, bh}, 3 * layers});         // dq, dk, dv
  g.push_back({{T, D, T, bh}, layers});             // dprobs
  g.push_back({{BT, s.hidden, s.local_vocab, 1}, 1});  // LM head
  g.push_back({{BT, s.local_vocab, s.hidden, 1}, 1});
  if (s.head_trains) g.push_back({{s.local_vocab, BT, s.hidden, 1}, 1});
  return g;
}

namespace {

int64_t element_bytes(const SimLayout& l) { return static_cast<int64_t>(c10::elementSize(l.dtype)); }

// The step's GEMMs: gemm_s and executed_flops, before the cpu-local slowdown.
void add_gemms(TimeEstimate& t, const ModelConfig& config, const RankShape& s, const SimLayout& l,
               const ClusterSpec& c) {
  const double gas = static_cast<double>(l.gas);
  for (const auto& [shape, count] : step_gemms(config, s, l)) {
    t.gemm_s += count * gas * gemm_seconds(c, shape, l.dtype);
    t.executed_flops += count * gas * shape.flops();
  }
}

// Elementwise work per micro-batch: layers (forward + backward, + a recomputed forward),
// embedding, final norm, cross-entropy, gradient accumulation into the flat buffer.
// `counted` prices the forward + backward's own ops (bytes only where their
// dispatch is priced by counting them); `e` the gradient accumulation into the
// flat buffers (the engine's hooks, which the count leaves out).
double micro_batch_elementwise_s(const ModelConfig& config, const RankShape& s, const SimLayout& l,
                                 const Elementwise& counted, const Elementwise& e) {
  const bool sixteen = l.dtype != torch::kFloat32;
  const int64_t B = l.micro_batch, T = l.seq_len, BT = B * T;
  const double BTH = static_cast<double>(BT) * s.hidden, BTV = static_cast<double>(BT) * s.local_vocab;
  const double L = static_cast<double>(config.num_layers);
  const LayerOps ops = layer_ops(config, s, B, T);
  double micro = L * sum_ops(ops, counted, true);
  if (l.recompute()) micro += L * sum_ops(ops, counted, false);
  micro += counted.fb(BTH, s.vocab_split ? 3 : 1) + counted.fb(BTH, s.gpt2 ? 2 : 4);  // embedding (+ masks), final norm
  micro += counted.fwd(BTV, 6) + counted.fwd(static_cast<double>(BT), 10) + counted.fwd(BTV, 3);  // cross-entropy
  micro += e.fwd(static_cast<double>(s.trained_numel), 1) + s.tensors * e.forward.latency_s;  // grad accumulation
  if (sixteen && s.trained_numel == s.local_numel)
    micro += e.fwd(static_cast<double>(s.local_numel), 2);  // fp32 accumulator add + zero (LoRA: fp32 already)
  return micro;
}

// One optimizer on its partition of `trained` elements over `dp` ranks.
double optimizer_seconds(int64_t trained, int dp, const RankShape& s, const SimLayout& l, const ClusterSpec& c,
                         const Elementwise& e) {
  const bool sixteen = l.dtype != torch::kFloat32;
  const int64_t a = element_bytes(l);
  const int stage = l.zero_stage;
  const int64_t P = (trained + dp - 1) / dp * dp;  // what trains (LoRA: the adapters)
  const double part = static_cast<double>(stage == 0 ? P : P / dp);
  // With offload_optimizer the device computes only the norm: the update runs on
  // the host (cpu_adam_s) and writes the model-dtype parameters there.
  const bool offload = l.offloads_optimizer();
  const double update = offload ? e.fwd(part, 3)  // norm: to fp64, dot, add
                        : c.calibration && c.calibration->optimizer_step
                            ? c.calibration->optimizer_step->seconds(part)  // measured on this machine
                            : e.fwd(part, 3)     // norm: to fp64, dot, add
                                  + e.fwd(part, 10);  // clip + AdamW (decay, two moments, sqrt, div, add, update)
  return e.fwd(static_cast<double>(P), 1)  // zeroing the gradients at the step start
         + update
         // master weights back to 16 bits (on the host with offload)
         + (sixteen && s.trained_numel == s.local_numel && !offload ? e.fwd(part, 1) : 0)
         + (stage == 1 || stage == 2 ? e.fwd(static_cast<double>(P) * a / 4, 2) : 0)  // gather copies
         + (stage >= 2 ? e.fwd(part, 1) : 0);  // the kept gradient partition
}

// Optimizer on the partition: grad norm (fp64), clipping, AdamW's passes, copies back.
// With expert parallelism each of the two optimizers on its own: the dense
// elements over dp, this rank's experts over edp.
double optimizer_seconds(const RankShape& s, const SimLayout& l, const ClusterSpec& c, const Elementwise& e) {
  if (l.ep <= 1) return optimizer_seconds(s.trained_numel, l.dp(), s, l, c, e);
  return optimizer_seconds(s.trained_numel - s.expert_numel, l.dp(), s, l, c, e) +
         optimizer_seconds(s.expert_numel, l.edp(), s, l, c, e);
}

// Compute: GEMMs, elementwise work and the optimizer step (compute_s and its parts).
void add_compute(TimeEstimate& t, const ModelConfig& config, const RankShape& s, const SimLayout& l,
                 const ClusterSpec& c) {
  const Elementwise e = elementwise_costs(c, l.dtype);
  add_gemms(t, config, s, l, c);
  Elementwise counted = e;
  if (c.calibration && c.calibration->dispatch_op_s) {
    // cpu-local: the ops of a forward + backward, counted, each at the measured dispatch cost;
    // their elementwise work then costs its bytes only.
    const OpCounts ops = step_op_counts(config, l);
    t.counted_ops = ops.ops;
    t.counted_nodes = ops.nodes;
    t.dispatch_s = static_cast<double>(l.gas) * (ops.ops + ops.nodes) * *c.calibration->dispatch_op_s;
    counted.forward.latency_s = counted.forward_grad.latency_s = counted.forward_backward.latency_s = 0;
  }
  t.elementwise_s = static_cast<double>(l.gas) * micro_batch_elementwise_s(config, s, l, counted, e);
  t.optimizer_s = optimizer_seconds(s, l, c, e);
  if (c.calibration) {
    // cpu-local: the framework's overhead, a measured share of the forward + backward's costs
    auto at_tp = c.calibration->overhead_ratio_by_tp.find(l.tp);
    const double ratio =
        at_tp != c.calibration->overhead_ratio_by_tp.end() ? at_tp->second : c.calibration->overhead_ratio;
    t.overhead_s = ratio * (t.gemm_s + t.elementwise_s);
    // and the ranks share the machine's cores
    const double slowdown = c.calibration->slowdown(l.gpus);
    t.gemm_s *= slowdown;
    t.elementwise_s *= slowdown;
    t.overhead_s *= slowdown;
    t.dispatch_s *= slowdown;
    t.optimizer_s *= slowdown;
  }
  t.compute_s = t.gemm_s + t.elementwise_s + t.dispatch_s + t.overhead_s + t.optimizer_s;
}

// Tensor-parallel communication: the engine's own list of the step's tp
// collectives (tp_step_collectives, tp/tp_traffic.h), each priced by the
// cluster's collective model for its op.
void add_tp_comm(TimeEstimate& t, const ModelConfig& config, const RankShape& s, const SimLayout& l,
                 const ClusterSpec& c) {
  const int tp = l.tp;
  if (tp <= 1) return;
  const GroupScope tp_scope = tp <= c.gpus_per_node && c.gpus_per_node % tp == 0 ? GroupScope::kIntraNode
                                                                                 : GroupScope::kInterNode;
  TpStepShape ts = s.tp_step;  // the plan's part: row-parallel linears, vocab splits, shared slices
  ts.tp_size = tp;
  ts.recompute.assign(config.num_layers, l.recompute());
  ts.tokens = l.micro_batch * l.seq_len;
  ts.micro_batch = l.micro_batch;
  ts.sequence_parallel = l.sequence_parallel;
  ts.hidden = s.hidden;
  ts.zero_stage = l.zero_stage;
  ts.element_bytes = element_bytes(l);
  ts.fp32_accumulation = l.dtype != torch::kFloat32 && l.gas > 1;  // as zero_step_shape
  ts.reduce_16bit_as_fp32 = c.reduce_16bit_as_fp32;               // Gloo reduces bf16 as fp32
  double micro_batch_s = 0, step_s = 0;
  int64_t micro_batch_calls = 0, step_calls = 0;
  for (const auto& x : tp_step_collectives(ts)) {
    const CollectiveOp op = x.op == TpOp::kAllGather       ? CollectiveOp::kAllGather
                            : x.op == TpOp::kReduceScatter ? CollectiveOp::kReduceScatter
                                                           : CollectiveOp::kAllReduce;
    const double seconds =
        static_cast<double>(x.calls) * collective_seconds(c, op, static_cast<double>(x.bytes) / x.calls, tp, tp_scope);
    (x.per_micro_batch ? micro_batch_s : step_s) += seconds;
    (x.per_micro_batch ? micro_batch_calls : step_calls) += x.calls;
  }
  t.tp_comm_s = static_cast<double>(l.gas) * micro_batch_s + step_s;
  t.tp_collectives = l.gas * micro_batch_calls + step_calls;
  // cpu-local: each lock-step collective waits for a partner that time-sharing descheduled.
  if (c.calibration)
    t.tp_comm_s += static_cast<double>(t.tp_collectives) * c.calibration->skew_share(l.gpus) *
                   at_group(c.calibration->collective_wake_s, tp);
}

// ZeRO collective seconds by the compute they run beside: what overlap_comm can hide.
struct HideableComm {
  double behind_forward = 0, behind_backward = 0, behind_update = 0;
  double step_reductions = 0;  // stage 1: the reduce-scatters at the step (offloaded copies follow them)
};

// The engine's own list of the step's ZeRO collectives (zero_traffic.h) is built from this.
ZeroStepShape zero_step_shape(const ModelConfig& config, const SimLayout& l) {
  const bool mixed = l.dtype != torch::kFloat32;
  ZeroStepShape zs;
  zs.num_layers = config.num_layers;
  zs.gradient_accumulation_steps = l.gas;
  zs.element_bytes = element_bytes(l);
  zs.fp32_accumulation = mixed && l.gas > 1;
  zs.tied_embeddings = config.tie_word_embeddings;
  zs.reduce_bucket_size = l.reduce_bucket_size;
  zs.allgather_bucket_size = l.allgather_bucket_size;
  return zs;
}

// ZeRO / data-parallel communication per step; returns what overlap_comm can hide.
HideableComm add_zero_comm(TimeEstimate& t, const ModelConfig& config, const RankShape& s, const SimLayout& l,
                           const ClusterSpec& c) {
  HideableComm hide;
  const int dp = l.dp(), stage = l.zero_stage;
  const GroupScope dp_scope = l.gpus > c.gpus_per_node ? GroupScope::kInterNode : GroupScope::kIntraNode;
  const GroupScope world_scope = dp_scope;
  if (dp > 1) {
    double zero = 2 * collective_seconds(c, CollectiveOp::kAllReduce, 16, dp, dp_scope);  // tokens, loss
    int64_t calls = 2;
    // cpu-local: what collectives cost inside a step beyond their back-to-back cost
    // when ranks time-share the cores (they arrive apart, in proportion to the
    // compute since they last met): measured shares of the forward + backward.
    const double forward_backward = t.gemm_s + t.elementwise_s + t.dispatch_s + t.overhead_s;
    const double skew = c.calibration ? c.calibration->skew_share(l.gpus) * forward_backward : 0;
    const double after_compute = c.calibration ? skew * at_group(c.calibration->step_collective_skew, dp) : 0;
    const double layer_gathers = c.calibration ? skew * at_group(c.calibration->layer_gather_skew, dp) : 0;
    bool gathers_layers = false;
    // The collectives of what trains (LoRA: the fp32 adapters); stage 3 also gathers the frozen base.
    // With expert parallelism the routed experts' optimizer issues its own over edp.
    const TpPlan plan = layout_plan(config, l);
    const ZeroStepShape zs = zero_step_shape(config, l);
    int64_t edp_calls = 0;  // of `calls`, the experts' (over edp)
    for (const HeldFlat& held : held_flats(config, plan, l, s.tp_rank, false)) {
      const int group = held.dp;
      if (group <= 1) continue;  // a group of one communicates nothing
      std::vector<ZeroCollective> collectives;
      if (l.lora_r > 0) {
        ZeroStepShape trained = zs;
        trained.element_bytes = 4;
        trained.fp32_accumulation = false;
        collectives = zero_step_collectives(held.flat, trained);
        if (stage == 3) {
          const FlatLayout frozen = held_flats(config, plan, l, s.tp_rank, true).front().flat;
          for (const auto& z : zero_step_collectives(frozen, zs))
            if (z.op == ZeroCollective::Op::kAllGather) collectives.push_back(z);
        }
      } else {
        collectives = zero_step_collectives(held.flat, zs);
      }
      for (const auto& z : collectives) {
        CollectiveOp op = z.op == ZeroCollective::Op::kAllGather   ? CollectiveOp::kAllGather
                          : z.op == ZeroCollective::Op::kAllReduce ? CollectiveOp::kAllReduce
                          : c.native_reduce_scatter                ? CollectiveOp::kReduceScatter
                                                                   : CollectiveOp::kAllReduce;
        // An all-reduce of 16-bit gradients moves fp32 where the backend sums in fp32.
        const double widen = op == CollectiveOp::kAllReduce && c.reduce_16bit_as_fp32 && zs.element_bytes == 2 &&
                                     l.lora_r == 0 && !(zs.fp32_accumulation && stage <= 1)
                                 ? 2.0
                                 : 1.0;
        const double seconds =
            z.calls * collective_seconds(c, op, widen * static_cast<double>(z.bytes) / z.calls, group, dp_scope);
        zero += seconds;
        gathers_layers = gathers_layers || z.layer_gather;
        if (z.behind == ZeroCollective::Behind::kForward) hide.behind_forward += seconds;
        if (z.behind == ZeroCollective::Behind::kBackward) hide.behind_backward += seconds;
        if (z.behind == ZeroCollective::Behind::kUpdate) hide.behind_update += seconds;
        if (stage == 1 && z.op == ZeroCollective::Op::kReduceScatter) hide.step_reductions += seconds;
        calls += z.calls;
        if (held.experts) edp_calls += z.calls;
      }
    }
    zero += (stage == 1 || stage == 2 ? 2 : 1) * after_compute;  // the gradient reduction (+ the parameter gather)
    if (gathers_layers) zero += layer_gathers;
    if (c.calibration) {  // each lock-step collective's wait for a descheduled partner
      zero += static_cast<double>(calls - edp_calls) * c.calibration->skew_share(l.gpus) *
              at_group(c.calibration->collective_wake_s, dp);
      if (edp_calls > 0)
        zero += static_cast<double>(edp_calls) * c.calibration->skew_share(l.gpus) *
                at_group(c.calibration->collective_wake_s, l.edp());
    }
    t.zero_comm_s = zero;
    t.zero_collectives = calls;
  }
  if (l.gpus > 1) {  // the global gradient norm over the world
    t.zero_comm_s += collective_seconds(c, CollectiveOp::kAllReduce, 8, l.gpus, world_scope);
    if (c.calibration)
      t.zero_comm_s += c.calibration->skew_share(l.gpus) * at_group(c.calibration->collective_wake_s, l.gpus);
    t.zero_collectives += 1;
  }
  return hide;
}

// A collective on the lane hides behind the compute it runs beside, up to
// that compute (tp traffic stays exposed): the forward is a third of the
// forward + backward work (a quarter with recomputation, which runs in the
// backward). cpu-local has no such time: its shared-memory collectives are
// copies and sums on the cores that compute.
double overlap_seconds(const TimeEstimate& t, const HideableComm& hide, const SimLayout& l,
                       const ClusterSpec& c) {
  if (!l.overlap_comm || c.calibration) return 0;
  const double fb = t.gemm_s + t.elementwise_s, forward = fb / (l.recompute() ? 4 : 3);
  return std::min(hide.behind_forward, forward) + std::min(hide.behind_backward, fb - forward) +
         std::min(hide.behind_update, t.optimizer_s);
}

// ZeRO-Offload's PCIe copies and host update (docs/simulator.md, "ZeRO-Offload"):
// bytes from the engine's flat layout, seconds at the cluster's host link and
// CPU Adam rate, and what of them the step waits for:
//   gradient D2H: each unit's reduced slice is copied once its last micro-batch
//     reduction completes, beside the rest of that backward (stages 2-3) or the
//     remaining reduce-scatters at the step (stage 1). Exposed:
//     max(the copies of the units reduced at the backward's end (stage 1: the
//     largest unit's), D2H - that window);
//   CPU Adam: the partition's fused AdamW bytes (12 + 8 K per element) plus, in
//     mixed precision, the gradient upcast and parameter downcast (2 (low + 4)),
//     at min(cores per rank x the per-core rate, the node's DRAM bandwidth / its ranks);
//   parameter H2D: piece by piece (kUpdateChunk elements) behind the next piece's
//     update: exposed max(one piece, H2D - CPU Adam). With offload_param every
//     stage-3 gather first copies the rank's slice in: those copies join the
//     gathers' chains behind the forward / backward, exposed by what they add to
//     the gathers' exposure there (all of them without overlap_comm).
void add_offload(TimeEstimate& t, const ModelConfig& config, const RankShape& s, const SimLayout& l,
                 const ClusterSpec& c, const HideableComm& hide) {
  if (!l.offloads_optimizer()) return;
  const torch::ScalarType trained = l.lora_r > 0 ? torch::kFloat32 : l.dtype;
  const int64_t low = static_cast<int64_t>(c10::elementSize(trained));
  const bool mixed = trained != torch::kFloat32;
  const int64_t grad_bytes = mixed && l.gas > 1 ? 4 : low;
  const int stage = l.zero_stage;
  const TpPlan plan = layout_plan(config, l);
  const ZeroUnits ids{config.num_layers};
  // Every optimizer offloads its own partition (expert parallelism: the experts' over edp too).
  const std::vector<HeldFlat> flats = held_flats(config, plan, l, s.tp_rank, false);
  const double link = c.host_link_bytes_per_s;
  // Elements of unit u of every optimizer's partition, summed (`sum`) or the largest.
  auto slice = [&](const HeldFlat& h, int u) {
    return u >= 0 && u < static_cast<int>(h.flat.units.size()) ? h.flat.units[u].length / h.dp : int64_t{0};
  };
  auto sum = [&](int u) {
    int64_t n = 0;
    for (const HeldFlat& h : flats) n += slice(h, u);
    return n;
  };
  int64_t part = 0, piece_elements = 0;
  for (const HeldFlat& h : flats) {
    part += h.flat.part;
    piece_elements = std::max(piece_elements, std::min(h.flat.part, kUpdateChunk));
  }
  const double fb = t.gemm_s + t.elementwise_s, forward_share = 1.0 / (l.recompute() ? 4 : 3);
  const double gas = static_cast<double>(l.gas);

  // Gradients, device -> host.
  t.pcie_d2h_bytes = part * grad_bytes;
  t.pcie_d2h_s = static_cast<double>(t.pcie_d2h_bytes) / link;
  int64_t last_copied = 0;  // elements whose copies nothing runs beside
  double window = 0;
  if (stage == 1) {
    for (const HeldFlat& h : flats)
      for (int u = 0; u < static_cast<int>(h.flat.units.size()); ++u) last_copied = std::max(last_copied, slice(h, u));
    window = hide.step_reductions;
  } else {
    // The units reduced at the backward's end (zero_traffic.h's reduced_behind).
    for (const HeldFlat& h : flats)
      for (int u : {static_cast<int>(ZeroUnits::kEmbedding), h.flat.whole_unit, static_cast<int>(ids.layer(0))})
        last_copied += slice(h, u);
    if (config.tie_word_embeddings) last_copied += sum(ids.head());
    window = fb / gas * (1 - forward_share);  // the last micro-batch's backward
  }
  t.offload_d2h_exposed_s =
      std::max(static_cast<double>(last_copied * grad_bytes) / link, t.pcie_d2h_s - window);

  // The host update: cores of the node shared by its ranks, capped by its DRAM bandwidth.
  const int ranks_per_node = std::max(1, std::min(l.gpus, c.gpus_per_node));
  double rate = c.cpu_adam_bytes_per_core_s * c.host_cores / ranks_per_node;
  if (c.host_memory_bytes_per_s > 0) rate = std::min(rate, c.host_memory_bytes_per_s / ranks_per_node);
  const int64_t adam_bytes = 12 + 8 * optimizer_state_count(l.optimizer) + (mixed ? 2 * (low + 4) : 0);
  t.cpu_adam_s = static_cast<double>(part * adam_bytes) / rate;

  // Parameters, host -> device.
  if (!l.offloads_params()) {
    t.pcie_h2d_bytes = part * low;
    t.pcie_h2d_s = static_cast<double>(t.pcie_h2d_bytes) / link;
    const double piece = static_cast<double>(piece_elements * low) / link;
    t.offload_h2d_exposed_s = std::max(piece, t.pcie_h2d_s - t.cpu_adam_s);
    return;
  }
  // offload_param: every gather's slice (zero_traffic.h's stage-3 gathers; the
  // persistent tensors are a unit of their own, held on the device).
  double behind_forward = 0, behind_backward = 0, behind_nothing = 0;  // elements per micro-batch
  const int embed = ZeroUnits::kEmbedding;
  for (int64_t layer = 0; layer < config.num_layers; ++layer) {
    behind_forward += static_cast<double>(sum(ids.layer(layer)));
    behind_backward += static_cast<double>(sum(ids.layer(layer)));
  }
  behind_forward += static_cast<double>(sum(ids.head()));
  behind_nothing += static_cast<double>(sum(ids.head()) + sum(embed));
  if (config.tie_word_embeddings) {
    behind_forward += static_cast<double>(sum(embed));
    behind_nothing += static_cast<double>(sum(embed));
  }
  const double per_element = gas * static_cast<double>(low) / link;
  t.pcie_h2d_bytes = static_cast<int64_t>((behind_forward + behind_backward + behind_nothing) * gas) * low;
  t.pcie_h2d_s = static_cast<double>(t.pcie_h2d_bytes) / link;
  const double f = behind_forward * per_element, b = behind_backward * per_element;
  if (!l.overlap_comm || l.dp() <= 1) {
    t.offload_h2d_exposed_s = t.pcie_h2d_s;
    return;
  }
  const double forward = fb * forward_share, backward = fb - forward;
  auto added = [](double lane, double copies, double compute) {
    return std::max(0.0, lane + copies - compute) - std::max(0.0, lane - compute);
  };
  t.offload_h2d_exposed_s = added(hide.behind_forward, f, forward) + added(hide.behind_backward, b, backward) +
                            behind_nothing * per_element;
}

// cpu-local on a host that takes part of the CPU: every time stretches by what the host keeps.
void apply_host_steal(TimeEstimate& t, const ClusterSpec& c) {
  if (c.calibration && c.host_steal_fraction > 0) {
    const double stretch = 1 / (1 - c.host_steal_fraction);
    for (double* x : {&t.gemm_s, &t.elementwise_s, &t.dispatch_s, &t.overhead_s, &t.optimizer_s, &t.compute_s, &t.tp_comm_s, &t.zero_comm_s,
                      &t.ep_comm_s,
                      &t.overlap_s, &t.pcie_d2h_s, &t.pcie_h2d_s, &t.offload_d2h_exposed_s, &t.cpu_adam_s,
                      &t.offload_h2d_exposed_s})
      *x *= stretch;
  }
}

// Expert parallelism's token exchanges (expert_dispatch.cpp): blocking all-to-alls
// of the ep group, priced as collective_seconds prices an all-to-all.
void add_ep_comm(TimeEstimate& t, const ModelConfig& config, const RankShape& s, const SimLayout& l,
                 const ClusterSpec& c) {
  if (l.ep <= 1) return;
  const GroupScope scope = expert_parallel_scope(c, l);
  const ExpertExchanges x = expert_exchanges(config, s, l);
  const double gas = static_cast<double>(l.gas);
  const double counts_bytes = 8.0 * l.ep * ExpertPlacement{l.ep, 0, config.num_experts}.max_per_rank();
  const double exchange = collective_seconds(c, CollectiveOp::kAllToAll, x.bytes, l.ep, scope);
  const double counts = collective_seconds(c, CollectiveOp::kAllToAll, counts_bytes, l.ep, scope);
  t.ep_comm_s = gas * (static_cast<double>(x.exchanges) * exchange + static_cast<double>(x.count_exchanges) * counts);
  t.ep_collectives = l.gas * (x.exchanges + x.count_exchanges);
  t.ep_bytes = gas * static_cast<double>(x.exchanges) * x.bytes_out;
  if (c.calibration)  // each lock-step exchange's wait for a descheduled partner, as tp's
    t.ep_comm_s += static_cast<double>(t.ep_collectives) * c.calibration->skew_share(l.gpus) *
                   at_group(c.calibration->collective_wake_s, l.ep);
}

}  // namespace

GroupScope expert_parallel_scope(const ClusterSpec& c, const SimLayout& l) {
  const int span = l.ep * l.tp;
  const bool one_node = l.gpus <= c.gpus_per_node || (span <= c.gpus_per_node && c.gpus_per_node % span == 0);
  return one_node ? GroupScope::kIntraNode : GroupScope::kInterNode;
}

ExpertExchanges expert_exchanges(const ModelConfig& config, const RankShape& s, const SimLayout& l) {
  ExpertExchanges x;
  if (l.ep <= 1 || s.sparse_layers == 0) return x;
  const int64_t passes = l.recompute() ? 2 : 1;  // forwards of a layer per micro-batch
  // Per sparse layer: the rows out and the outputs back in each forward, the same two reversed in the backward.
  x.exchanges = s.sparse_layers * (2 * passes + 2);
  x.count_exchanges = s.sparse_layers * passes;
  // Balanced routing: a rank sends its tokens x k rows, 1/ep of them to each ep rank (its
  // own stay); it receives expert_rows_share of that for its experts and sends as many back.
  const double rows = static_cast<double>(l.micro_batch * l.seq_len * config.experts_per_token);
  const double row_bytes = static_cast<double>(config.hidden_size * static_cast<int64_t>(c10::elementSize(l.dtype)));
  x.bytes = rows * std::max(1.0, s.expert_rows_share) * row_bytes;
  x.bytes_out = x.bytes * (l.ep - 1) / l.ep;
  return x;
}

TimeEstimate estimate_time(const ModelConfig& config, const RankShape& s, const SimLayout& l,
                           const ClusterSpec& c) {
  TimeEstimate t;
  add_compute(t, config, s, l, c);
  add_tp_comm(t, config, s, l, c);
  add_ep_comm(t, config, s, l, c);
  const HideableComm hide = add_zero_comm(t, config, s, l, c);
  t.overlap_s = overlap_seconds(t, hide, l, c);
  add_offload(t, config, s, l, c, hide);
  apply_host_steal(t, c);
  t.step_s = t.compute_s + t.tp_comm_s + t.ep_comm_s + t.zero_comm_s - t.overlap_s + t.offload_d2h_exposed_s +
             t.cpu_adam_s + t.offload_h2d_exposed_s;
  const int64_t BT = l.micro_batch * l.seq_len;
  const double gas = static_cast<double>(l.gas);
  t.model_flops = model_flops_per_token(config, l.seq_len) * static_cast<double>(BT) * gas * l.dp();
  // LoRA: no weight gradients for the frozen base, so its model FLOPs are the
  // forward and the input gradients, 4 of full fine-tuning's 6 per parameter and token.
  if (l.lora_r > 0) t.model_flops *= 4.0 / 6.0;
  return t;
}

}  // namespace autotp::sim
