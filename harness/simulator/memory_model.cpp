#include "simulator/memory_model.h"

#include <algorithm>
#include <vector>
#include <sstream>

#include "autotp/arch/layer_names.h"
#include "autotp/base/text.h"
#include "autotp/lora/lora_plan.h"
#include "autotp/model/attention.h"
#include "autotp/optim/grad_norm.h"
#include "autotp/tp/expert_parallel.h"

namespace autotp::sim {

LoraConfig layout_lora(const SimLayout& layout) {
  LoraConfig lora;
  lora.enabled = layout.lora_r > 0;
  lora.r = std::max<int64_t>(1, layout.lora_r);
  lora.lora_alpha = 2.0 * static_cast<double>(lora.r);
  if (layout.lora_targets == "all-linear") {
    lora.all_linear = true;
  } else {
    std::stringstream names(layout.lora_targets);
    for (std::string name; std::getline(names, name, ',');)
      if (!name.empty()) lora.target_modules.push_back(name);
  }
  return lora;
}

TpPlan layout_plan(const ModelConfig& config, const SimLayout& layout) {
  TpPlan plan = build_plan(config, layout.tp, layout.sequence_parallel);
  if (layout.ep > 1) plan = place_experts(std::move(plan), ExpertPlacement{layout.ep, 0, config.num_experts});
  return layout.lora_r > 0 ? with_lora(std::move(plan), layout_lora(layout)) : plan;
}

std::vector<HeldFlat> held_flats(const ModelConfig& config, const TpPlan& plan, const SimLayout& layout, int tp_rank,
                                 bool frozen) {
  const ZeroUnits ids{config.num_layers};
  auto held = [&](int dp, bool experts_only, bool dense_only) {
    std::vector<const PlanEntry*> entries;
    for (const PlanEntry* e : plan_entries(plan, frozen)) {
      if (e->remote || (experts_only && e->expert < 0) || (dense_only && e->expert >= 0)) continue;
      entries.push_back(e);
    }
    return HeldFlat{zero_layout(entries, ids, tp_rank, dp, layout.zero_stage, layout.persistence_threshold), dp,
                    experts_only};
  };
  if (layout.ep <= 1) return {held(layout.dp(), false, false)};
  return {held(layout.dp(), false, true), held(layout.edp(), true, false)};
}

std::set<std::string> lora_layer_modules(const ModelConfig& config, const SimLayout& layout) {
  std::set<std::string> out;
  if (layout.lora_r <= 0) return out;
  const TpPlan plan = layout_plan(config, layout);
  for (const auto& e : plan.entries()) {
    const DecoderLayerName n = decoder_layer_name(e.desc.name);
    const std::string suffix = ".lora_A.weight";
    if (!e.adapter || n.layer != 0 || !ends_with(n.within, suffix)) continue;
    out.insert(n.within.substr(0, n.within.size() - suffix.size()));
  }
  return out;
}

namespace {

struct ActivationParts {
  int64_t per_layer = 0;       // saved by one decoder layer without recomputation
  int64_t recomputed = 0;      // what a layer holds while it is recomputed in the backward
  int64_t layer_input = 0;     // what a recomputed layer keeps (its input)
  int64_t outer = 0;           // embedding indices, rotary tables, final norm
  int64_t layer_backward = 0;  // transients while one layer runs its backward
  int64_t head_forward = 0;    // transients of the LM head + cross-entropy forward (incl. the saved softmax)
  int64_t head_backward = 0;   // transients at the start of the backward (incl. the saved softmax)
};

ActivationParts activation_parts(const ModelConfig& c, const RankShape& s, const SimLayout& l) {
  const int64_t a = static_cast<int64_t>(c10::elementSize(l.dtype));  // activation element size
  const bool f32 = l.dtype == torch::kFloat32;
  const int64_t B = l.micro_batch, T = l.seq_len, BT = B * T, H = s.hidden, D = s.head_dim;
  const int64_t BTH = BT * H, heads = s.local_heads, I = s.local_intermediate, V = s.local_vocab;
  // The residual stream between blocks: this rank's tokens under sequence parallelism
  // (norms, their outputs kept by the block inputs, a recomputed layer's input).
  const int64_t Bt = B * l.stream_tokens(), BtH = Bt * H;
  // Fused attention (scaled_dot_product_attention) keeps no [T, T] scores: it
  // saves its output [B, heads, T, D] and the fp32 log-sum-exp of each row. The
  // output is laid out [B, T, heads, D], so the output projection's input is a view
  // of it: the layers count that storage once, as the attention output.
  const int64_t attention_output = a * BT * heads * D, attention_lse = 4 * B * heads * T;
  // What the attention core keeps beyond q, k, v and the attention output, and what
  // selective recomputation rebuilds of it in the backward.
  int64_t core_saved = attention_lse, core_rebuilt = attention_output + attention_lse;
  // The eager core (attention.cpp) runs for soft-capping, and for bf16 on CPUs with
  // native bf16 GEMMs at short sequences (eager_attention_core): it keeps the capped
  // scores (tanh's output), the fp32 softmax and, in 16 bits, its cast instead of
  // the fused kernel's log-sum-exp. Its batched GEMMs keep [B heads, T, D] copies of
  // q, k and v, in place of the tensors counted below for the fused kernel (nothing
  // else keeps those); its output is a copy, kept by the projection.
  const bool eager_core = c.attn_softcap > 0 || eager_attention_core(l.dtype, l.cuda, T, D);
  const int64_t scores = B * heads * T * T;
  if (eager_core) core_saved = core_rebuilt = ((c.attn_softcap > 0 ? a : 0) + 4 + (f32 ? 0 : a)) * scores;
  // Its batched GEMMs read q, k, v as views where B or the heads are 1 (the reshape
  // merges a size-1 dimension): a fused qkv output is then kept whole, as by the fused kernel.
  const bool eager_reads_views = B == 1 || heads == 1;
  // Its backward produces dq, dk, dv per query head (and, in 16-bit, an fp32 dq accumulator).
  const int64_t attention_backward = 3 * a * BT * heads * D + (f32 ? 0 : 4 * BT * heads * D);
  ActivationParts p;
  int64_t fused_qkv_rest = 0;  // see below
  if (s.gpt2) {
    // LayerNorm keeps its input, mean and rstd (on the CPU in the input's dtype, on
    // CUDA in fp32); its output is kept by the linear.
    const int64_t norm = 2 * a * BtH + 2 * (l.cuda ? 4 : a) * Bt;
    // As many kv heads as query heads: the kernel reads k and v from c_attn's output.
    p.per_layer = 2 * norm + a * BT * heads * D * 3 /*qkv kept by the q, k, v views*/ + attention_output +
                  core_saved + 5 * a * BT * I /*c_fc output, gelu_new's 3 saved terms, its output*/;
    p.recomputed = p.per_layer;
    p.outer = BT * 8 + T * 8 + norm;  // token ids, positions, ln_f
  } else {
    // RMSNorm (rms_norm.h) keeps its input and the fp32 reciprocal RMS of each
    // row; the linears after it keep its output.
    const int64_t norm = 2 * a * BtH + 4 * Bt;
    const int64_t mlp = 4 * a * BT * I;  // gate, silu(gate), up, their product
    p.recomputed = 2 * norm + 3 * a * BT * heads * D /*q rotated, k and v per query head*/ + attention_output +
                   core_saved + mlp;
    // Gemma: the post-attention and post-feed-forward norms keep their input and
    // reciprocal RMS too (their output goes into the residual add), and every
    // (1 + w) norm is plain autograd ops (rms_norm_plus_one) that also keep the fp32
    // normalised rows; in 16 bits they keep the fp32 copy of the input instead of
    // the input. Per element of a norm's input, beyond an RMSNorm's:
    const int64_t plus_one_extra = c.gemma_norms ? 4 * (f32 ? 1 : 2) - (f32 ? 0 : a) : 0;
    const int64_t gemma_norm_extra = plus_one_extra * BtH;
    if (c.gemma_norms) p.recomputed += 2 * (a * BtH + 4 * Bt) + 4 * gemma_norm_extra;
    // Qwen3 / Gemma 3: per-head q and k norms keep their input and reciprocal RMS.
    if (c.qk_norm) p.recomputed += ((a + plus_one_extra) * BT * D + 4 * BT) * (heads + s.local_kv_heads);
    // A fused qkv projection (Phi-3): where the kv heads are not copied per query head,
    // v is a view of the fused output and keeps all of it (q's and k's columns too).
    fused_qkv_rest = s.fused_qkv ? a * BT * (heads + s.local_kv_heads) * D : 0;
    if (heads == s.local_kv_heads && (!eager_core || eager_reads_views)) p.recomputed += fused_qkv_rest;
    // A sparse block (every sparse layer is modelled on the first): the router reads the
    // whole block input (under sequence parallelism a gathered copy, kept) and keeps
    // fp32 probabilities; each chosen expert copies its tokens in and its output is
    // kept by the routing weight's product; the shared expert's output and sigmoid
    // gate by their product.
    // Dense layers of a mixture (mlp_only_layers, decoder_sparse_step) keep their
    // dense MLP's terms instead: per_layer is the mean over the layers.
    // With ep the inputs are the rows that arrive at this rank's experts (expert_rows_share
    // of its own tokens x k: the same under balanced routing when the experts divide
    // evenly) and the outputs kept are those returned for its own tokens.
    if (c.num_experts > 0) {
      const int64_t k = c.experts_per_token;
      const int64_t expert_inputs = std::llround(s.expert_rows_share * static_cast<double>(k * a * BTH));
      // The routing's indices: top-k's (int64) and, per chosen (token, slot), the pair of
      // int64 indices its gathers keep and the routing weight its product keeps; with
      // norm_topk_prob the division keeps the top-k probabilities and their sum (fp32).
      const int64_t routing = (8 + (l.ep > 1 ? 0 : 16) + a) * k * BT + (c.norm_topk_prob ? 4 * (k + 1) * BT : 0);
      // Without ep the weighted rows are summed by index_add, which keeps them (k rows a token).
      const int64_t combined = l.ep > 1 ? a * BTH : k * a * BTH;
      // Under sequence parallelism the router keeps the gathered block input, and the
      // norm's local output (counted with the norm) is kept by nothing.
      const int64_t gathered_input = l.sequence_parallel ? a * BTH - a * BtH : 0;
      const int64_t shared_expert = c.shared_expert_intermediate_size > 0 ? a * BTH + a * BT : 0;
      const int64_t sparse_mlp = 4 * a * BT * s.local_sparse_intermediate + gathered_input +
                                 4 * BT * c.num_experts + expert_inputs + k * a * BTH + combined + routing +
                                 shared_expert;
      const int64_t dense_mlp = 4 * a * BT * s.local_dense_intermediate;
      const int64_t sparse_layers = s.sparse_layers;
      p.recomputed += (sparse_layers * sparse_mlp + (c.num_layers - sparse_layers) * dense_mlp) /
                          std::max<int64_t>(1, c.num_layers) -
                      mlp;
    }
    p.per_layer = p.recomputed;
    // Token ids, rotary cos / sin, final norm.
    p.outer = BT * 8 + 2 * a * T * D + norm + gemma_norm_extra;
  }
  if (l.lora_r > 0) {
    // LoRA: each adapter keeps u = x A^T [BT, r] (fp32, for B's gradient); where x
    // is not the column block's shared input (row-parallel and replicated bases)
    // also its fp32 copy of x (for A's gradient). Nothing trains in the LM head.
    const std::set<std::string> adapted = lora_layer_modules(c, l);
    for (const auto& lin : s.layer_linears) {
      if (!adapted.count(lin.name)) continue;
      p.recomputed += 4 * BT * l.lora_r + (lin.row ? 4 * BT * lin.in : 0);
    }
    p.per_layer = p.recomputed;
  }
  if (s.vocab_split) p.outer += BT * 8 + BT;  // shifted ids and the outside-shard mask
  // A sliding-window layer's fused kernel keeps its own [T, T] additive mask (converted
  // from the shared boolean one), counted here for all those layers at once.
  if (!s.gpt2 && !eager_core && !l.activation_checkpointing && !l.selective_recompute)
    for (int64_t layer = 0; layer < c.num_layers; ++layer) {
      const int64_t window = c.sliding_window_of(layer);
      if (window > 0 && window < T) p.outer += a * T * T;
    }
  if (l.selective_recompute && !l.activation_checkpointing) {
    // The attention core keeps only q, k, v (already counted) and the projection its
    // output; what the core saved (the fused kernel's log-sum-exp, or the eager core's
    // scores, softmax and copies) is rebuilt in the backward with its output, one layer
    // at a time.
    p.per_layer -= core_saved;
    p.layer_backward += core_rebuilt;
    // Its inputs are k and v as projected (kv heads), not copied per query head.
    if (!s.gpt2 && heads > s.local_kv_heads)
      p.per_layer += fused_qkv_rest - 2 * a * BT * (heads - s.local_kv_heads) * D;
    // They are views of a fused qkv output, which they keep whole, whichever core
    // runs (the eager one's copies, counted above in its place, live only while it runs).
    if (heads == s.local_kv_heads && eager_core && !eager_reads_views) p.per_layer += fused_qkv_rest;
  }
  p.layer_input = a * BtH;
  p.layer_backward += attention_backward + 2 * a * BTH;  // after the terms added above
  if (eager_core) p.layer_backward += 2 * 4 * scores;  // the eager core's softmax and score gradients
  // Expert parallelism: a sparse layer's backward exchanges the output gradients of the
  // rank's tokens x k rows out and the rows of its experts in (all_to_all_rows), both alive
  // while they are exchanged; its forward's exchange buffers are smaller than this moment.
  if (l.ep > 1 && s.sparse_layers > 0)
    p.layer_backward += a * BTH * c.experts_per_token +
                        std::llround(s.expert_rows_share * static_cast<double>(c.experts_per_token * a * BTH));
  if (s.gpt2) p.layer_backward += 2 * a * BT * I;  // gelu_new: its backward keeps two more gradients of the MLP width
  const int64_t ce_saved = 4 * BT * V + BT * 8 + 2 * BT;  // softmax (fp32), local targets, masks
  // The softmax is computed in place in the shifted logits (one fp32 buffer, saved).
  p.head_forward = a * BT * V /*logits*/ + (f32 ? 0 : 4 * BT * V) /*fp32 copy*/ + ce_saved;
  if (c.final_softcap > 0) p.head_forward += 2 * a * BT * V;  // logits / cap and tanh's kept output
  p.head_backward = ce_saved + (f32 ? 0 : a * BT * V) + a * BTH + (l.lora_r > 0 ? 0 : a * V * H) /*LM-head weight gradient*/;
  return p;
}

// Lengths (elements) of the ZeRO units the phases hold: the largest layer, the
// embedding and the head (`head_use`: with the embedding when they are tied).
struct UnitLengths {
  int64_t max_layer = 0, embed = 0, head = 0, head_use = 0;
};

UnitLengths unit_lengths(const ModelConfig& config, const FlatLayout& flat) {
  const ZeroUnits ids{config.num_layers};
  auto unit = [&](int u) {
    return u < static_cast<int>(flat.units.size()) ? flat.units[u].length : int64_t{0};
  };
  UnitLengths u;
  for (int64_t l = 0; l < config.num_layers; ++l) u.max_layer = std::max(u.max_layer, unit(ids.layer(l)));
  u.embed = unit(ZeroUnits::kEmbedding);
  u.head = unit(ids.head());
  u.head_use = u.head + (config.tie_word_embeddings ? u.embed : 0);
  return u;
}

// One micro-batch's activations over the step: kept from the forward to the
// backward, while one layer runs its backward, and at their highest point.
struct ActivationLevels {
  int64_t kept = 0, layer_peak = 0, peak = 0;
  int64_t one_layer = 0;  // what one layer keeps (its input when recomputed)
};

ActivationLevels activation_levels(const ActivationParts& p, int64_t L, bool recompute) {
  ActivationLevels v;
  if (recompute) {
    v.kept = p.layer_input * L + p.outer;
    v.layer_peak = v.kept + p.recomputed + p.layer_backward;  // one layer recomputed in the backward
  } else {
    v.kept = p.per_layer * L + p.outer;
    v.layer_peak = v.kept + p.layer_backward;
  }
  v.peak = std::max({v.kept + p.head_forward, v.kept + p.head_backward, v.layer_peak});
  v.one_layer = recompute ? p.layer_input : p.per_layer;
  return v;
}

// The forward / backward phase beyond the model states and the batch.
struct ForwardBackwardMoments {
  int64_t peak = 0;             // the largest moment
  PeakMoment at_peak;           // what that moment holds besides the model states and the batch
  int64_t transient_grads = 0;  // the largest unit's reduction (stages 2-3)
  int64_t gathered = 0;         // stage 3: gathered and prefetched units
};

// One ZeroOptimizer's units in the forward / backward phase: `u` the units
// gathered (everything at stage 3, the frozen base included), `r` the units whose
// gradients are reduced, over `dp` ranks (expert parallelism: the experts' over edp).
struct OptimizerUnits {
  UnitLengths u, r;
  int dp = 1;
};

// Forward / backward phase: the largest of the moments below, each what is
// alive then besides the model states. Stage 3 holds the unit in use (gathered
// straight into its buffer) and, with overlap_comm, the next use's units
// prefetched; stages 2-3 reduce a unit when its backward ends, with
// overlap_comm behind the next unit's backward (its bucket and reduced slice
// in flight meanwhile; completed before the next bucket is filled).
// `sets`: one per ZeroOptimizer (two with expert parallelism, whose hooks run
// around the same uses: a moment holds both optimizers' units of that use);
// `ra` bytes per reduced element (LoRA: the fp32 adapters; otherwise the model dtype).
ForwardBackwardMoments forward_backward_moments(const ModelConfig& config, const SimLayout& layout,
                                                const ActivationParts& p, const ActivationLevels& v,
                                                const std::vector<OptimizerUnits>& sets, int64_t ra) {
  const int stage = layout.zero_stage;
  const int64_t a = static_cast<int64_t>(c10::elementSize(layout.dtype));
  // offload_param: every use copies the unit's partition in from the host (over one
  // dp rank too, where the copy is the unit), through a temporary of its slice.
  const bool offload_param = layout.offloads_params();
  const bool reduces = stage >= 2;
  // Each term sums, over the optimizers, the bytes of the unit `pick` chooses in each.
  auto over_sets = [&](auto bytes) {
    int64_t sum = 0;
    for (const OptimizerUnits& set : sets) sum += bytes(set);
    return sum;
  };
  auto sharded = [&](const OptimizerUnits& set) { return stage == 3 && (set.dp > 1 || offload_param); };
  auto overlap = [&](const OptimizerUnits& set) { return layout.overlap_comm && set.dp > 1; };
  auto staging = [&](int64_t n, int dp) { return offload_param && dp > 1 ? a * ((n + dp - 1) / dp) : 0; };
  // The slice temporary lives while its unit is being gathered: the prefetched one with overlap.
  auto held = [&](auto pick) {
    return over_sets([&](const OptimizerUnits& set) {
      const int64_t n = pick(set.u);
      return sharded(set) ? a * n + (overlap(set) ? 0 : staging(n, set.dp)) : 0;
    });
  };
  auto ahead = [&](auto pick) {
    return over_sets([&](const OptimizerUnits& set) {
      const int64_t n = pick(set.u);
      return sharded(set) && overlap(set) ? a * n + staging(n, set.dp) : 0;
    });
  };
  auto in_flight = [&](auto pick) {
    return over_sets([&](const OptimizerUnits& set) {
      const int64_t n = pick(set.r);
      return reduces && overlap(set) ? ra * n + 4 * n / set.dp : 0;
    });
  };
  // A unit's reduction: its gradients, their contiguous copy (not for a
  // one-tensor unit: its gradient is the bucket) and the reduced slice (fp32).
  auto reduction = [&](auto pick, bool one_tensor) {
    return over_sets([&](const OptimizerUnits& set) {
      const int64_t n = pick(set.r);
      return reduces ? (one_tensor ? 1 : 2) * ra * n + 4 * n / set.dp : 0;
    });
  };
  auto max_layer = [](const UnitLengths& x) { return x.max_layer; };
  auto head = [](const UnitLengths& x) { return x.head; };
  auto head_use = [](const UnitLengths& x) { return x.head_use; };
  auto embed = [](const UnitLengths& x) { return x.embed; };
  auto nothing = [](const UnitLengths&) { return int64_t{0}; };
  const bool embed_alone = config.family != ModelFamily::kGpt2;
  const bool head_alone =
      stage == 3 && config.family != ModelFamily::kGpt2 && layout.persistence_threshold > config.hidden_size;
  const int64_t kept = v.kept;
  // Each moment as {activations, gathered parameters, gradients in reduction}.
  const std::vector<PeakMoment> moments = {
      // The head's forward; its backward, with the last layer prefetched.
      {kept + p.head_forward, held(head_use), 0},
      {kept + p.head_backward, held(head_use) + ahead(max_layer), 0},
      // In the first layer backward the head's reduction is in flight; in the later
      // ones a layer's, with one layer's activations fewer.
      {v.layer_peak, held(max_layer) + ahead(max_layer),
       config.tie_word_embeddings ? in_flight(nothing) : in_flight(head)},
      {v.layer_peak - v.one_layer, held(max_layer) + ahead(max_layer), in_flight(max_layer)},
      // The last layer's forward prefetches the head.
      {kept, held(max_layer) + ahead(head_use), 0},
      // A unit is released before its gradients are reduced, once its backward is
      // done (a layer's own activations are gone by then).
      {kept - v.one_layer, ahead(max_layer), reduction(max_layer, false)},
      // The head's backward has prefetched the last layer by the time its gradients are reduced.
      config.tie_word_embeddings ? PeakMoment{} : PeakMoment{kept, ahead(max_layer), reduction(head, head_alone)},
      {p.outer, 0, reduction(embed, embed_alone)},  // the backward's end
  };
  ForwardBackwardMoments fb;
  fb.at_peak = *std::max_element(moments.begin(), moments.end(),
                                 [](const PeakMoment& x, const PeakMoment& y) { return x.total() < y.total(); });
  fb.peak = fb.at_peak.total();
  fb.transient_grads =
      reduces ? reduction([](const UnitLengths& x) { return std::max({x.max_layer, x.head, x.embed}); }, false) : 0;
  fb.gathered = held([](const UnitLengths& x) { return std::max({x.max_layer, x.head_use, x.embed}); }) +
                ahead([](const UnitLengths& x) { return std::max(x.max_layer, x.head_use); });
  return fb;
}

// The optimizer phase beyond the model states and the batch.
struct OptimizerMoments {
  int64_t temporaries = 0;  // the norm's fp64 chunk or the update's fp32 chunk
  int64_t unit_comm = 0;    // stages 1-2: one unit's gather or reduction buffers
};

// Optimizer phase: the norm's fp64 chunk, the update's fp32 chunk; stages 1-2
// gather the updated partitions unit by unit (in place; through one bucket
// buffer when a unit exceeds allgather_bucket_size), stage 1 first
// reduce-scatters every unit, two at a time (their received slices; 16-bit
// ones are summed in fp32 and converted).
OptimizerMoments optimizer_moments(const SimLayout& layout, int64_t part, const UnitLengths& u, int dp,
                                   bool accumulate32) {
  const int stage = layout.zero_stage;
  const int64_t a = static_cast<int64_t>(c10::elementSize(layout.dtype));
  const bool mixed = layout.dtype != torch::kFloat32;
  const bool overlap = layout.overlap_comm && dp > 1;
  // The gradient norm's fp64 copy of each chunk (grad_norm.h); on the CPU fp32 and
  // bf16 gradients are squared in fp64 in a loop without copies.
  const bool norm_copies = layout.cuda || layout.dtype == torch::kFloat16;
  const int64_t norm_temporaries = norm_copies ? 8 * std::min(part, grad_norm_chunk(layout.cuda)) : 0;
  // The update's fp32 upcast runs on the host with offload_optimizer.
  const int64_t update_temporaries =
      mixed && !layout.offloads_optimizer() ? 4 * std::min(part, update_chunk(layout.cuda)) : 0;
  const int64_t largest_unit = std::max({u.max_layer, u.head, u.embed});
  const int64_t unit_slice = largest_unit / std::max(dp, 1);
  const int64_t gather_columns =
      std::clamp<int64_t>(std::max<int64_t>(1, layout.allgather_bucket_size) / std::max(dp, 1), 1,
                          std::max<int64_t>(unit_slice, 1));
  const int64_t gather_comm =
      (stage == 1 || stage == 2) && dp > 1 && gather_columns < unit_slice ? a * dp * gather_columns : 0;
  // Stage 1 reduces the accumulated gradients (fp32 with fp32 accumulation);
  // 16-bit ones are summed in fp32 and converted; two in flight with overlap.
  const int64_t grad_bytes = accumulate32 ? 4 : a;
  const int64_t reduce_comm =
      stage == 1 && dp > 1 ? (overlap ? 2 : 1) * grad_bytes * unit_slice + (grad_bytes < 4 ? 6 * unit_slice : 0) : 0;
  OptimizerMoments o;
  o.temporaries = std::max(norm_temporaries, update_temporaries);
  o.unit_comm = std::max(gather_comm, reduce_comm);
  return o;
}

}  // namespace

nlohmann::json MemoryEstimate::to_json() const {
  nlohmann::json j = {{"params", states.params},
          {"grads", states.grads},
          {"master_weights", states.master_weights},
          {"optimizer_states", states.optimizer_states},
          {"activations", activations},
          {"comm_buffers", comm_buffers},
          {"total", total},
          {"model_states", states.total()},
          {"transient_grads", transient_grads},
          // The forward/backward peak moment's components (flat: the memory object has one level).
          {"peak_moment_activations", at_peak.activations},
          {"peak_moment_gathered", at_peak.gathered},
          {"peak_moment_gradients", at_peak.gradients},
          {"optimizer_temporaries", optimizer_temporaries},
          {"forward_backward_peak", forward_backward_peak},
          {"optimizer_peak", optimizer_peak},
          {"peak_phase", peak_phase}};
  if (states.frozen_params > 0) j["frozen_params"] = states.frozen_params;  // LoRA's base
  if (expert_numel > 0) j["expert_parameters"] = expert_numel;            // elements: a mixture of experts
  if (expert_states.total() > 0) j["expert_model_states"] = expert_states.total();  // ep > 1: of model_states
  if (host.total() > 0) {  // ZeRO-Offload only; flat keys, so "total" etc. keep one meaning
    j["host_bytes"] = host.total();
    j["host_master_weights"] = host.master_weights;
    j["host_optimizer_states"] = host.optimizer_states;
    j["host_grads"] = host.grads;
    j["host_params"] = host.params;
  }
  return j;
}

HostBytes offloaded_bytes(const ModelStateBytes& engine, const SimLayout& layout, int64_t part,
                          torch::ScalarType trained_dtype) {
  HostBytes h;
  if (engine.host == 0) return h;
  const bool accumulate32 = trained_dtype != torch::kFloat32 && layout.gas > 1;
  h.master_weights = engine.master_weights;
  h.optimizer_states = engine.optimizer_states;
  h.grads = (accumulate32 ? 4 : static_cast<int64_t>(c10::elementSize(trained_dtype))) * part;
  // The rest: the staged updated parameters (16-bit), or with offload_param the
  // parameter partition the update writes instead.
  h.params = engine.host - h.master_weights - h.optimizer_states - h.grads;
  return h;
}

int64_t saved_activation_bytes(const ModelConfig& config, const RankShape& shape, const SimLayout& layout) {
  auto p = activation_parts(config, shape, layout);
  const int64_t L = config.num_layers;
  return (layout.recompute() ? p.layer_input : p.per_layer) * L + p.outer;
}

MemoryEstimate estimate_memory(const ModelConfig& config, const RankShape& shape, const SimLayout& layout) {
  MemoryEstimate m;
  // What trains is held in fp32 under LoRA (the adapters), else in the model dtype.
  const torch::ScalarType trained_dtype = layout.lora_r > 0 ? torch::kFloat32 : layout.dtype;
  const bool accumulate32 = trained_dtype != torch::kFloat32 && layout.gas > 1;
  // The engine's flat layouts: units cut over dp (flat_layout.h, zero_units.h), of
  // what trains and (LoRA) of the frozen base; with expert parallelism the routed
  // experts of this ep rank are a second optimizer's, over edp.
  const TpPlan plan = layout_plan(config, layout);
  const std::vector<HeldFlat> trained = held_flats(config, plan, layout, shape.tp_rank, false);
  // ZeRO-Offload: the engine's formula says what lives in host memory; the
  // device keeps the rest (master weights and optimizer states leave it, and the
  // stage-3 parameter partition with offload_param: the persistent tensors stay).
  const OffloadPlacement offload{layout.offloads_optimizer(), layout.offloads_params()};
  std::vector<OptimizerUnits> sets;
  for (const HeldFlat& h : trained) {
    const ModelStateBytes engine =
        ZeroOptimizer::analytic_bytes(h.flat, trained_dtype, layout.optimizer, accumulate32, offload);
    const HostBytes host = offloaded_bytes(engine, layout, h.flat.part, trained_dtype);
    m.host.master_weights += host.master_weights;
    m.host.optimizer_states += host.optimizer_states;
    m.host.grads += host.grads;
    m.host.params += host.params;
    m.states += engine;
    if (h.experts) m.expert_states = engine;
    const UnitLengths lengths = unit_lengths(config, h.flat);
    sets.push_back({lengths, lengths, h.dp});
  }
  m.expert_numel = shape.expert_numel;
  m.states.host = m.states.offload_buffers = 0;
  m.expert_states.host = m.expert_states.offload_buffers = 0;
  if (offload.optimizer) {
    m.states.master_weights = m.states.optimizer_states = 0;
    m.expert_states.master_weights = m.expert_states.optimizer_states = 0;
  }
  if (layout.offloads_params()) m.states.params -= m.host.params;
  if (layout.lora_r > 0) {  // one optimizer (LoRA runs without ep)
    const FlatLayout frozen = held_flats(config, plan, layout, shape.tp_rank, true).front().flat;
    m.states.frozen_params = analytic_frozen_bytes(frozen, layout.dtype);
    // Stage 3 gathers a unit's frozen base and adapters together (in their dtypes:
    // counted in model-dtype elements of the same bytes).
    const UnitLengths base = unit_lengths(config, frozen);
    const UnitLengths& reduced = sets.front().r;
    UnitLengths& units = sets.front().u;
    const int64_t a = static_cast<int64_t>(c10::elementSize(layout.dtype));
    auto in_model_dtype = [&](int64_t trained_elements) { return trained_elements * 4 / a; };
    units.max_layer = base.max_layer + in_model_dtype(reduced.max_layer);
    units.embed = base.embed + in_model_dtype(reduced.embed);
    units.head = base.head + in_model_dtype(reduced.head);
    units.head_use = base.head_use + in_model_dtype(reduced.head_use);
  }

  // Activations of one micro-batch at its highest point.
  const ActivationParts p = activation_parts(config, shape, layout);
  const ActivationLevels levels = activation_levels(p, config.num_layers, layout.recompute());
  const int64_t data = 2 * 8 * layout.micro_batch * layout.seq_len * layout.gas;  // input ids + labels
  m.activations = levels.peak + data;

  const ForwardBackwardMoments fb = forward_backward_moments(config, layout, p, levels, sets,
                                                             static_cast<int64_t>(c10::elementSize(trained_dtype)));
  m.forward_backward_peak = m.states.total() + fb.peak + data;
  m.at_peak = fb.at_peak;
  m.at_peak.activations += data;

  // The optimizers step one after the other: the larger one's temporaries and buffers.
  SimLayout trained_layout = layout;
  trained_layout.dtype = trained_dtype;  // the optimizer phase works on what trains
  OptimizerMoments optimizer;
  for (size_t i = 0; i < trained.size(); ++i) {
    const OptimizerMoments o =
        optimizer_moments(trained_layout, trained[i].flat.part, sets[i].r, trained[i].dp, accumulate32);
    optimizer.temporaries = std::max(optimizer.temporaries, o.temporaries);
    optimizer.unit_comm = std::max(optimizer.unit_comm, o.unit_comm);
  }
  const int64_t base = m.states.total() + data;
  m.optimizer_peak = base + std::max(optimizer.temporaries, optimizer.unit_comm);

  // Each kind is its largest amount during the step; the total is the peak of their sum.
  m.transient_grads = fb.transient_grads;
  m.comm_buffers = std::max(fb.gathered, optimizer.unit_comm);
  m.optimizer_temporaries = optimizer.temporaries;
  m.total = std::max(m.forward_backward_peak, m.optimizer_peak);
  m.peak_phase = m.forward_backward_peak >= m.optimizer_peak ? "forward_backward" : "optimizer";
  return m;
}

}  // namespace autotp::sim
