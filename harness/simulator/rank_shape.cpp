#include "simulator/rank_shape.h"

#include <set>

#include "autotp/arch/layer_names.h"
#include "autotp/model/causal_lm.h"

namespace autotp::sim {

int64_t RankShape::max_layer_numel() const {
  int64_t m = 0;
  for (int64_t n : layer_numel) m = std::max(m, n);
  return m;
}

TpPlan build_plan(const ModelConfig& config, int tp, bool sequence_parallel) {
  TpPlanOptions options;
  options.tp_size = tp;
  options.sequence_parallel = sequence_parallel;
  return TpPlan::build(config, options);
}

RankShape rank_shape(const ModelConfig& config, const TpPlan& plan, int tp_rank, int ep_size) {
  RankShape s;
  s.ep = ep_size;
  s.tp = plan.tp_size();
  s.tp_rank = tp_rank;
  s.gpt2 = config.family == ModelFamily::kGpt2;
  s.hidden = config.hidden_size;
  s.head_dim = config.head_dim;
  s.layer_numel.assign(config.num_layers, 0);
  s.layer_ranges.assign(config.num_layers, FlatRange{-1, -1});
  s.tp_step = tp_step_shape(plan, config.num_layers);
  s.shared_numel = s.tp_step.shared_numel;
  auto ends_with = [](const std::string& text, const std::string& suffix) {
    return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (int64_t layer = 0; layer < config.num_layers; ++layer) s.sparse_layers += config.is_sparse(layer) ? 1 : 0;
  // The routed experts this rank holds in one sparse layer (the same count in each).
  std::set<int64_t> held_experts;
  int64_t expert_layer = -1;
  for (const auto& e : plan.entries()) {
    if (e.expert < 0 || e.remote) continue;
    const int64_t layer = decoder_layer_of(e.desc.name);
    if (expert_layer < 0) expert_layer = layer;
    if (layer == expert_layer) held_experts.insert(e.expert);
  }
  s.local_experts = static_cast<int64_t>(held_experts.size());
  if (config.num_experts > 0) {
    TORCH_INTERNAL_ASSERT(ep_size == 1 || s.local_experts < config.num_experts,
                          "rank_shape: ep ", ep_size, " needs the plan placed for one ep rank (place_experts)");
    s.expert_rows_share = static_cast<double>(ep_size * s.local_experts) / static_cast<double>(config.num_experts);
  }
  int64_t routed_width = 0, shared_width = 0;  // of the first sparse layer
  for (const auto& e : plan.entries()) {
    if (e.remote) continue;  // another ep rank's expert: no tensor here
    const int64_t n = e.spec.local_numel(tp_rank);
    if (e.expert >= 0) s.expert_numel += n;
    const FlatRange range{s.local_numel, s.local_numel + n};
    s.local_numel += n;
    if (!e.frozen) s.trained_numel += n;
    ++s.tensors;
    const DecoderLayerName in_layer = decoder_layer_name(e.desc.name);
    if (const int64_t layer = in_layer.layer; layer >= 0) {
      s.layer_numel[layer] += n;
      FlatRange& span = s.layer_ranges[layer];  // first member's start to last member's end, as ZeRO-3 gathers
      if (span.begin < 0) span.begin = range.begin;
      span.end = range.end;
    } else {
      s.outer_numel += n;
      ++s.outer_tensors;
      s.outer_ranges.push_back(range);
    }
    if ((e.desc.kind == ParamKind::kLmHead || (config.tie_word_embeddings && e.desc.kind == ParamKind::kEmbedding)) &&
        e.frozen)
      s.head_trains = false;
    if (e.desc.kind == ParamKind::kEmbedding || e.desc.kind == ParamKind::kLmHead) {
      if (e.role == TpRole::kVocab) s.vocab_split = true;
      if (e.desc.kind == ParamKind::kLmHead || config.tie_word_embeddings) s.local_vocab = e.spec.local_extent(tp_rank);
    }
    const bool linear = e.desc.kind == ParamKind::kLinear || e.desc.kind == ParamKind::kConv1D;
    const std::string& within = in_layer.within;  // e.g. "self_attn.q_proj.weight"
    if (linear && in_layer.layer >= 0 && s.local_dense_intermediate == 0) {  // the first dense MLP, any layer
      const Axis out = e.desc.axes[e.desc.out_dim()];
      const int64_t width = e.spec.local_shape(tp_rank)[e.desc.out_dim()];
      if (out == Axis::kIntermediate) s.local_dense_intermediate = width;
      if (out == Axis::kGateUp) s.local_dense_intermediate = width / 2;
    }
    if (linear && expert_layer >= 0 && in_layer.layer == expert_layer) {
      const Axis out = e.desc.axes[e.desc.out_dim()];
      const int64_t width = e.spec.local_shape(tp_rank)[e.desc.out_dim()];
      if (out == Axis::kExpertIntermediate)
        routed_width = width * config.experts_per_token * ep_size * s.local_experts / config.num_experts;
      if (out == Axis::kSharedExpertIntermediate && ends_with(within, "gate_proj.weight")) shared_width = width;
    }
    if (linear && in_layer.layer == 0 && ends_with(within, ".weight")) {
      auto shape = e.spec.local_shape(tp_rank);
      LocalLinear l;
      l.name = within.substr(0, within.size() - std::string(".weight").size());
      l.in = shape[e.desc.in_dim()];
      l.out = shape[e.desc.out_dim()];
      l.row = e.role == TpRole::kRow;
      l.frozen = e.frozen;
      const bool expert = e.desc.axes[0] == Axis::kExpertIntermediate || e.desc.axes[1] == Axis::kExpertIntermediate;
      if (expert) l.token_share = static_cast<double>(ep_size * config.experts_per_token) / config.num_experts;
      s.layer_linears.push_back(l);
      // What the layer computes per rank, from the axis each projection writes.
      const Axis out = e.desc.axes[e.desc.out_dim()];
      if (out == Axis::kHeads || out == Axis::kQkv) s.local_heads = local_heads(config, e.spec, tp_rank).count;
      if (out == Axis::kKvHeads) s.local_kv_heads = l.out / config.head_dim;
      if (out == Axis::kQkv) {  // [q | k | v]: the k part's width
        s.fused_qkv = true;
        s.local_kv_heads = (e.spec.is_replicated() ? config.num_kv_heads * config.head_dim
                                                   : e.spec.segments(tp_rank).at(1).length) /
                           config.head_dim;
      }
      if (out == Axis::kIntermediate) s.local_intermediate = l.out;
      if (out == Axis::kGateUp) s.local_intermediate = l.out / 2;
      // A token's activations in a sparse block: its top-k experts' (and the shared expert's)
      // features; with ep the rows this rank's experts compute, per token of the rank.
      if (out == Axis::kExpertIntermediate)
        s.local_intermediate = l.out * config.experts_per_token * ep_size * s.local_experts / config.num_experts;
      if (out == Axis::kSharedExpertIntermediate && ends_with(l.name, "gate_proj"))
        s.local_intermediate += l.out;
    }
  }
  s.local_sparse_intermediate = routed_width + shared_width;
  return s;
}

}  // namespace autotp::sim
