#include "simulator/op_count.h"

#include <ATen/record_function.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <string_view>

#include "autotp/comm/comm.h"
#include "autotp/model/causal_lm.h"

namespace autotp::sim {
namespace {

thread_local int t_depth = 0;
thread_local OpCounts* t_counts = nullptr;

// Tensor::backward is itself a dispatched op (aten::_backward) that the whole
// backward runs inside: it is not counted and does not nest what it runs (a
// Transparent context tells on_exit not to unwind a level).
struct Transparent : at::ObserverContext {};

// The engine records each node it runs as "autograd::engine::evaluate_function: <node>"
// (the node, its ops and the summing of what it returns into the next nodes' inputs).
bool is_node(const at::RecordFunction& fn) {
  return fn.scope() == at::RecordScope::BACKWARD_FUNCTION ||
         std::string_view(fn.name()).rfind("autograd::engine::evaluate_function", 0) == 0;
}

// The engine's recomputing nodes (causal_lm.cpp) run a forward and a backward
// inside: one node whose contents count as the step's own.
bool recomputes(const at::RecordFunction& fn) {
  const std::string_view name(fn.name());
  return name.find("CheckpointedLayer") != std::string_view::npos ||
         name.find("RecomputedAttention") != std::string_view::npos;
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (std::string_view(fn.name()) == "aten::_backward") return std::make_unique<Transparent>();
  if (is_node(fn) && recomputes(fn)) {
    if (t_counts && t_depth == 0 && fn.scope() != at::RecordScope::BACKWARD_FUNCTION) t_counts->nodes += 1;
    return std::make_unique<Transparent>();
  }
  if (t_counts && t_depth == 0) (is_node(fn) ? t_counts->nodes : t_counts->ops) += 1;
  ++t_depth;
  return nullptr;
}

void on_exit(const at::RecordFunction& /*fn*/, at::ObserverContext* ctx) {
  if (!ctx) --t_depth;
}

// The narrow copy step_op_counts runs: same structure, tiny tensors.
ModelConfig narrowed(const ModelConfig& config, int64_t positions) {
  ModelConfig c = config;
  constexpr int64_t kHeadDim = 4;
  c.head_dim = kHeadDim;
  c.hidden_size = c.num_heads * kHeadDim;  // GPT-2 derives its head width from hidden / heads
  c.intermediate_size = 8;
  c.vocab_size = 64;
  c.max_positions = std::max<int64_t>(c.max_positions, positions);
  // The frequency table is built once per length, so its kind does not change the
  // count; longrope's per-frequency lists would not fit the narrow heads.
  c.rope_scaling = RopeScaling{};
  if (c.expert_intermediate_size > 0) c.expert_intermediate_size = 8;
  if (c.shared_expert_intermediate_size > 0) c.shared_expert_intermediate_size = 8;
  return c;
}

}  // namespace

OpCounts count_ops(const std::function<void()>& fn) {
  OpCounts counts;
  // Installed for `fn` only, also when it throws.
  struct Observing {
    at::CallbackHandle handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(on_enter, on_exit)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
    OpCounts* outer = t_counts;
    ~Observing() {
      t_counts = outer;
      at::removeCallback(handle);
    }
  } observing;
  t_counts = &counts;
  fn();
  return counts;
}

namespace {

// Positions and sequences of the narrow copy: enough tokens that every expert is
// routed some (an expert without tokens skips its ops); the count does not depend
// on them otherwise.
int64_t narrow_positions(const SimLayout& layout) { return std::min<int64_t>(layout.seq_len, 32); }
int64_t narrow_batch(const ModelConfig& config, int64_t positions) {
  const int64_t tokens =
      config.num_experts > 0 ? 4 * config.num_experts / std::max<int64_t>(1, config.experts_per_token) : 1;
  return (tokens + positions - 1) / positions;
}

}  // namespace

struct NarrowStep::Parts {
  Comm self;
  std::unique_ptr<CausalLM> lm;
  torch::Tensor ids;
};

NarrowStep::NarrowStep(const ModelConfig& config, const SimLayout& layout) : parts_(std::make_unique<Parts>()) {
  const int64_t T = narrow_positions(layout);
  ModelConfig small = narrowed(config, T);
  // A window shorter than the layout's sequence stays shorter than the narrow one.
  for (auto& w : small.layer_sliding_window)
    if (w > 0 && w < layout.seq_len) w = std::max<int64_t>(1, T / 2);
  SimLayout one = layout;
  one.tp = 1;
  one.ep = 1;
  one.sequence_parallel = false;
  one.gpus = 1;
  parts_->lm = std::make_unique<CausalLM>(small, layout_plan(small, one), parts_->self, layout.dtype, torch::kCPU);
  CausalLM& lm = *parts_->lm;
  lm.init_random(1);
  if (layout.activation_checkpointing) lm.set_activation_checkpointing(std::vector<bool>(small.num_layers, true));
  lm.set_selective_recompute(layout.selective_recompute && !layout.activation_checkpointing);
  auto gen = at::detail::createCPUGenerator(1);
  parts_->ids = torch::randint(small.vocab_size, {narrow_batch(config, T), T}, gen, torch::kLong);
}

NarrowStep::~NarrowStep() = default;

void NarrowStep::run() {
  torch::AutoGradMode on(true);
  parts_->lm->token_losses(parts_->ids, parts_->ids).sum().backward();
}

OpCounts step_op_counts(const ModelConfig& config, const SimLayout& layout) {
  const int64_t T = narrow_positions(layout);
  // What decides the ops (not the widths the narrow copy replaces).
  const std::string key =
      nlohmann::json{config.architecture, static_cast<int>(config.family), config.num_layers, config.num_heads,
                     config.num_kv_heads, config.qkv_bias, config.o_bias, config.mlp_bias,
                     config.tie_word_embeddings, config.qk_norm, config.fused_projections, config.gemma_norms,
                     config.activation, config.attn_softcap, config.final_softcap,
                     config.attention_dropout + config.residual_dropout + config.embedding_dropout,
                     config.num_experts, config.experts_per_token, config.shared_expert_intermediate_size > 0,
                     config.norm_topk_prob, config.router_aux_loss_enabled(), config.sparse_layers,
                     config.layer_sliding_window, T, static_cast<int>(layout.dtype),
                     layout.activation_checkpointing, layout.selective_recompute, layout.lora_r, layout.lora_targets}
          .dump();
  static std::mutex mutex;
  static std::map<std::string, OpCounts> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  NarrowStep step(config, layout);
  const OpCounts counts = count_ops([&] { step.run(); });
  cache[key] = counts;
  return counts;
}

}  // namespace autotp::sim
