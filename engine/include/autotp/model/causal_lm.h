// CausalLM: one HF causal language model (Llama family or GPT-2), holding this
// rank's shards of every parameter as laid out by a TpPlan. The model code is
// written once; the plan decides which layers are split, so tp = 1 and tp = N
// run the same code. Parameters are leaf tensors with requires_grad; callers
// (the training engine) may re-home them into flat buffers.
// Not thread safe.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "autotp/comm/comm.h"
#include "autotp/io/safetensors.h"
#include "autotp/arch/model_config.h"
#include "autotp/model/dropout_mask.h"
#include "autotp/model/layer_schedule.h"
#include "autotp/model/sharded_model.h"
#include "autotp/tp/expert_parallel.h"
#include "autotp/tp/tp_plan.h"

namespace autotp {



// Which training micro-batch a forward belongs to: the key of its dropout masks
// (dropout_mask.h). Rows of the masks are the samples' positions in the step's
// global batch, so any tp size, data-parallel split and accumulation draws the same.
struct DropoutContext {
  uint64_t seed = 0;
  int64_t step = 0;           // optimizer steps done before this one
  int64_t sample_offset = 0;  // the micro-batch's first sample within the step's global batch
  int64_t step_samples = 0;   // samples in the step's global batch
};

struct LoadReport {
  int64_t bytes_read = 0;            // bytes of tensor data this rank read
  int64_t peak_rss_bytes = 0;        // process peak resident set after loading
};

class CausalLM : public ShardedModel {
 public:
  // Allocates uninitialised shards for tp rank `tp.rank()` of the plan on `device`
  // (inputs given to forward and token_losses may be on the CPU: they are moved).
  CausalLM(ModelConfig config, TpPlan plan, Comm& tp, torch::ScalarType dtype = torch::kFloat32,
           torch::Device device = torch::kCPU);
  ~CausalLM();

  const ModelConfig& config() const { return config_; }
  const TpPlan& plan() const { return plan_; }
  torch::ScalarType dtype() const override { return dtype_; }
  const torch::Device& device() const override { return device_; }
  Comm& tp() { return tp_; }
  std::vector<Parameter>& parameters() override { return params_; }
  int64_t num_layers() const override { return config_.num_layers; }
  bool tied_head() const override { return config_.tie_word_embeddings; }
  Parameter& parameter(const std::string& name);

  // Seeded init (normal(0, 0.02) matrices, unit norms, zero biases); every tp
  // layout gets the same logical values.
  void init_random(uint64_t seed);
  // Reads this rank's slices from an HF checkpoint. Accepts names with or
  // without the base-model prefix and skips known buffers (GPT-2 attn.bias /
  // attn.masked_bias, rotary inv_freq); other missing or unexpected tensors are a
  // UserError listing them.
  LoadReport load(const io::CheckpointReader& checkpoint);

  // Local vocab shard of the logits [batch, seq, V_local] and its first vocab id.
  torch::Tensor forward(const torch::Tensor& input_ids);
  int64_t vocab_start() const;
  // Per-token cross-entropy [batch, seq] (fp32, 0 where target == -100) of
  // predicting `targets` at each position of `input_ids`; logits never gathered.
  torch::Tensor token_losses(const torch::Tensor& input_ids, const torch::Tensor& targets);
  // The same from logits forward() already returned (one forward for loss and output).
  torch::Tensor losses_from_logits(const torch::Tensor& local_logits, const torch::Tensor& targets);
  // Full logits [batch, seq, vocab], gathered over the tp group (for output only).
  torch::Tensor full_logits(const torch::Tensor& input_ids);
  torch::Tensor gather_logits(const torch::Tensor& local_logits);

  // Recompute these layers in the backward instead of keeping their activations
  // (only each layer's input is kept). Empty = none.
  void set_activation_checkpointing(std::vector<bool> per_layer) { checkpoint_layers_ = std::move(per_layer); }
  // Selective recomputation (Korthikanti et al. 2022): keep each layer's
  // activations but recompute the attention core (its output and softmax
  // statistics) in the backward from the saved q, k, v.
  void set_selective_recompute(bool on) { selective_recompute_ = on; }
  // LoRA (plan entries marked adapter): the factor of their output, lora_alpha / r
  // (or / sqrt(r) with rslora). Adapters are applied wherever the plan has them.
  void set_adapter_scaling(double scaling) { adapter_scaling_ = scaling; }
  double adapter_scaling() const { return adapter_scaling_; }
  // lora_dropout: dropout on each adapter's input while training (set_dropout), a
  // mask of its own per module (adapter_dropout_site), drawn from global coordinates.
  void set_adapter_dropout(double p) { adapter_dropout_ = p; }
  // Dropout (the config's probabilities) for the forwards that follow, until
  // reset; none (evaluation) by default. Keep it set through the micro-batch's
  // backward: recomputed layers draw their masks again from it.
  void set_dropout(std::optional<DropoutContext> context) { dropout_ = context; }

  // Mixture of experts: HF's load-balancing loss (load_balancing_loss_func, no
  // padding mask) of the last forward's routing, over all its sparse layers; 0 for
  // a dense model. The backward that follows also back-propagates
  // `gradient_weight` times it (the caller's d(objective)/d(aux), e.g.
  // router_aux_loss_coef / micro-batches); call between the forward and its backward.
  double router_aux_loss(double gradient_weight);
  // Mixture of experts: how many of the last forward's routing choices went to
  // each expert, [sparse layers, experts] (fp64, layer order); undefined for a dense model.
  torch::Tensor expert_token_counts() const;

  // Expert parallelism: the sparse blocks send each routing choice to the ep
  // rank holding its expert (model/expert_dispatch.h). The plan must have been
  // placed for the same placement (place_experts: other ranks' experts remote).
  // `ep` must outlive the model.
  void set_expert_parallel(const ExpertPlacement& placement, Comm& ep);
  const ExpertPlacement& expert_placement() const { return experts_; }

  // The parameter uses (ShardedModel): the embeddings (kEmbeddingUse), each
  // decoder layer and the head; hooks around each (sharded_model.h).
  void set_use_hooks(UseHooks hooks) override { hooks_ = std::move(hooks); }

  // The whole (logical) tensor of a parameter, gathered over the tp group; every rank gets it.
  torch::Tensor gather(const Parameter& p);
  // Gradient of the whole tensor; call sync_shared_grads() first.
  torch::Tensor gather_grad(const Parameter& p);
  // Sums the gradients of slices held by several ranks (kv heads shared under
  // GQA) over their holders, so every holder has the full gradient.
  void sync_shared_grads();

 private:
  torch::Tensor hidden_states(const torch::Tensor& input_ids);
  torch::Tensor llama_layer(int64_t layer, const torch::Tensor& x, const torch::Tensor& cos,
                            const torch::Tensor& sin);
  torch::Tensor gpt2_layer(int64_t layer, const torch::Tensor& x);
  // Decoder layer `layer`'s attention over this rank's heads (q_param: the weight
  // whose spec says which): its sliding window, scale, softcapping.
  torch::Tensor attention(int64_t layer, const std::string& q_param, const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v);
  // The norm `module` (its ".weight") applied to x: RMSNorm, or Gemma's (1 + w) form.
  torch::Tensor norm(const std::string& module, const torch::Tensor& x);
  torch::Tensor mlp_activation(const torch::Tensor& gate);
  // Layer `layer`'s sparse block on its normed input h [B, T, hidden].
  torch::Tensor moe_block(int64_t layer, const torch::Tensor& h);
  // x [B, ...] times its dropout mask at `site` of `layer` when training with p > 0;
  // `dims` are the global ranges of x's dims after the batch (empty: x is whole).
  torch::Tensor dropout(const torch::Tensor& x, int64_t layer, DropoutSite site, double p,
                        std::vector<DimRanges> dims = {});
  // The step's index of the first sample this forward (or batch piece) computes.
  int64_t first_sample() const;
  torch::Tensor linear(const std::string& module, const torch::Tensor& x);
  // y plus the module's LoRA output from u = x A^T: (u B^T) * scaling in fp32, back in y's dtype.
  torch::Tensor with_adapter(const std::string& module, const torch::Tensor& y, const torch::Tensor& u);
  // The adapter's input: x with lora_dropout applied when training. `split_in`: the
  // global ranges of x's last dim on this rank (a row-parallel layer's input), or
  // null when x's last dim is whole (and its tokens are as the block input's).
  torch::Tensor adapter_input(const std::string& module, const torch::Tensor& x, const ShardSpec* split_in);
  bool adapter_dropout_on() const { return dropout_.has_value() && adapter_dropout_ > 0; }
  // A block's input: copied into the tp region (split block), all-gathered along the
  // sequence under sequence parallelism, or as it is (replicated block).
  torch::Tensor enter_block(const torch::Tensor& h, bool split);
  void check_split_under_sp(bool split) const;
  // A block's input projections (one module or q, k, v / gate, up), biases added:
  // split blocks through column_parallel_inputs (sequence gather, overlapped backward).
  std::vector<torch::Tensor> column_inputs(const std::vector<std::string>& modules, const torch::Tensor& h);
  // A block's output layer: the local product of a row-parallel layer (whole for a
  // replicated one), then its bias once after the reduction.
  torch::Tensor row_partial(const std::string& module, const torch::Tensor& x);
  torch::Tensor row_output(const std::string& module, const torch::Tensor& reduced);
  // The reductions and piece tracking every layer shares (layer_schedule.h).
  LayerBlocks row_reductions();
  // How tp_overlap_comm cuts this layer's input: batch, sequence or not at all.
  PieceAxis piece_axis(const torch::Tensor& x, const LayerBlocks& blocks) const;
  torch::Tensor embed(const torch::Tensor& ids);
  torch::Tensor lm_head_logits(const torch::Tensor& hidden);
  const Parameter* find(const std::string& name) const;
  torch::Tensor tensor(const std::string& name) const;
  // A parameter as the forward reads it: in the model dtype (LoRA's fp32 trained
  // base tensors cast; adapters as they are).
  torch::Tensor compute_weight(const Parameter& p) const;
  // Runs fn on x as use `use` (hooks around it; recomputed in the backward when `checkpoint`).
  torch::Tensor run_use(int64_t use, const torch::Tensor& x, std::function<torch::Tensor(const torch::Tensor&)> fn,
                        bool checkpoint);
  torch::Tensor final_norm(const torch::Tensor& x);
  // cos and sin [1, 1, T, head_dim] in the model dtype, computed in fp32 as HF does.
  std::pair<torch::Tensor, torch::Tensor> rotary_tables(const RopeScaling& scaling, double theta, int64_t T) const;

  ModelConfig config_;
  TpPlan plan_;
  Comm& tp_;
  torch::ScalarType dtype_;
  torch::Device device_;
  std::vector<Parameter> params_;
  std::map<std::string, size_t> index_;
  std::vector<bool> checkpoint_layers_;
  bool selective_recompute_ = false;
  double adapter_scaling_ = 1;
  double adapter_dropout_ = 0;
  std::optional<DropoutContext> dropout_;
  // The routing of the current forward (per sparse layer) and the gradient the
  // load-balancing loss adds to its router probabilities.
  std::shared_ptr<struct RouterAuxState> router_aux_;
  ExpertPlacement experts_;  // ep 1: every expert here
  Comm* ep_ = nullptr;
  UseHooks hooks_;
  // Sequence parallelism (plan_.sequence_parallel()): this forward's tokens per rank
  // (sequence_shard_sizes), this rank's first token and the sequence length.
  bool sequence_parallel_ = false;
  std::vector<int64_t> sequence_sizes_;
  int64_t sequence_offset_ = 0, sequence_length_ = 0;
  // The piece of the micro-batch a layer is computing under tp_overlap_comm.
  PieceAxis piece_axis_ = PieceAxis::kNone;
  int64_t piece_offset_ = 0;
  // Closures the current forward's backward calls (recomputed layers and
  // attention cores, backward hooks), alive until the next forward.
  std::vector<std::shared_ptr<void>> backward_state_;
};

// Local query-head range [first, first + count) of rank `tp_rank` for a q
// projection spec, and the local kv head each local query head reads.
struct LocalHeads {
  int64_t first = 0, count = 0;
  std::vector<int64_t> kv_index;  // per local query head: index into the local kv heads
};
LocalHeads local_heads(const ModelConfig& config, const ShardSpec& q_spec, int tp_rank);

}  // namespace autotp
