#include "autotp/model/causal_lm.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/resource.h>

#include <cmath>
#include <numeric>
#include <regex>
#include <set>

#include "autotp/base/text.h"
#include "autotp/arch/layer_names.h"
#include "autotp/comm/autograd_collectives.h"
#include "autotp/model/attention.h"
#include "autotp/model/expert_dispatch.h"
#include "autotp/model/fused_experts.h"
#include "autotp/model/rms_norm.h"
#include "autotp/base/bf16_matmul.h"
#include "autotp/base/error.h"
#include "autotp/tp/parallel_layers.h"
#include "autotp/model/layer_schedule.h"

namespace autotp {
namespace {

namespace F = torch::nn::functional;

Comm& self_comm() {
  static Comm comm;
  return comm;
}

torch::Tensor rotate_half(const torch::Tensor& x) {
  int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

torch::Tensor gelu_new(const torch::Tensor& x) {
  return 0.5 * x * (1.0 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * torch::pow(x, 3.0))));
}

bool is_split(const PlanEntry& e) { return e.role != TpRole::kReplicated; }

using LayerFn = std::function<torch::Tensor(const torch::Tensor&)>;

}  // namespace

struct CheckpointFn {
  LayerFn run;
  std::function<void()> before_backward, after_backward;
};

struct BackwardCall {
  std::function<void()> fn;
};

namespace {

// Activation checkpointing: the forward keeps only the layer input; the backward
// recomputes the layer with autograd on (re-running its tp collectives in the
// same order on every rank) and back-propagates through the recomputation,
// which accumulates the parameter gradients. `before_backward` runs ahead of the
// recomputation (ZeRO-3 gathers the layer there), `after_backward` once the
// gradients are accumulated (ZeRO-3 releases, ZeRO-2/3 reduce them).
class CheckpointedLayer : public torch::autograd::Function<CheckpointedLayer> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, CheckpointFn* fn) {
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = reinterpret_cast<int64_t>(fn);
    return fn->run(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto* fn = reinterpret_cast<CheckpointFn*>(ctx->saved_data["fn"].toInt());
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    if (fn->before_backward) fn->before_backward();
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      y = fn->run(x);
    }
    torch::autograd::backward({y}, {grad_outputs[0]});
    if (fn->after_backward) fn->after_backward();
    return {x.grad(), torch::Tensor()};
  }
};

// Identity whose backward runs a hook: on a use's output it runs before the
// use's backward (every gradient into the use flows through it); on its input
// after that backward, once autograd has accumulated the use's parameter
// gradients (their AccumulateGrad nodes outrank every other node).
class BackwardHook : public torch::autograd::Function<BackwardHook> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, BackwardCall* call) {
    ctx->saved_data["call"] = reinterpret_cast<int64_t>(call);
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    reinterpret_cast<BackwardCall*>(ctx->saved_data["call"].toInt())->fn();
    return {grad_outputs[0], torch::Tensor()};
  }
};

// Selective recomputation of the attention core: only q, k, v are kept; the
// backward re-runs the attention with autograd on and back-propagates through it.
class RecomputedAttention : public torch::autograd::Function<RecomputedAttention> {
 public:
  using Core = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, Core* core) {
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["core"] = reinterpret_cast<int64_t>(core);
    return (*core)(q, k, v);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto* core = reinterpret_cast<Core*>(ctx->saved_data["core"].toInt());
    auto saved = ctx->get_saved_variables();
    std::vector<torch::Tensor> inputs;
    for (auto& t : saved) inputs.push_back(t.detach().requires_grad_(true));
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      y = (*core)(inputs[0], inputs[1], inputs[2]);
    }
    auto grads = torch::autograd::grad({y}, inputs, {grad_outputs[0]});
    return {grads[0], grads[1], grads[2], torch::Tensor()};
  }
};

}  // namespace

// The routing of one forward's sparse layers (detached), and the gradient that
// HF's load-balancing loss adds to each router probability once router_aux_loss
// has computed it from all of them.
struct RouterAuxState {
  std::map<int64_t, torch::Tensor> selections, prob_sums;  // per sparse layer: [E] counts, [E] sums (fp64)
  int64_t tokens = 0;                                       // per layer
  // [E] fp32, zero until router_aux_loss fills it in place; each RouterAuxGradient
  // node holds a reference, so a backward after the next forward stays safe.
  torch::Tensor grad_per_prob;

  explicit RouterAuxState(int64_t experts) : grad_per_prob(torch::zeros({experts}, torch::kFloat32)) {}

  void record(int64_t layer, const torch::Tensor& selected, const torch::Tensor& probs, int64_t experts) {
    torch::NoGradGuard no_grad;
    selections[layer] = torch::bincount(selected.flatten().cpu(), {}, experts).to(torch::kFloat64);
    prob_sums[layer] = probs.detach().sum(0).to(torch::kCPU, torch::kFloat64);
    tokens = probs.size(0);
  }
};

namespace {

// Identity on the router probabilities whose backward adds the load-balancing
// loss's gradient (it reaches the router through them alone: the expert counts
// come from a top-k and carry none). The gradient is known only after the whole
// forward (the counts span every layer), hence a hook rather than a loss term;
// recomputed layers get it too. `divisor`: tp when each rank's gradient is a
// part that the tp group sums (split experts).
class RouterAuxGradient : public torch::autograd::Function<RouterAuxGradient> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& probs,
                               const torch::Tensor& grad_per_prob, double divisor) {
    ctx->saved_data["grad_per_prob"] = grad_per_prob;
    ctx->saved_data["divisor"] = divisor;
    return probs;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const torch::Tensor grad_per_prob = ctx->saved_data["grad_per_prob"].toTensor();
    const torch::Tensor grad =
        grad_outputs[0] + (grad_per_prob / ctx->saved_data["divisor"].toDouble()).to(grad_outputs[0].device());
    return {grad, torch::Tensor(), torch::Tensor()};
  }
};

void call_hook(const std::function<void(int64_t)>& hook, int64_t use) {
  if (hook) hook(use);
}

}  // namespace

torch::Tensor CausalLM::run_use(int64_t use, const torch::Tensor& x, LayerFn fn, bool checkpoint) {
  const UseHooks& h = hooks_;
  if (!torch::GradMode::is_enabled()) {
    call_hook(h.before_forward, use);
    auto y = fn(x);
    call_hook(h.after_forward, use);
    return y;
  }
  if (checkpoint) {
    // The forward runs with autograd off inside the Function; the recomputation with it on.
    auto entry = std::make_unique<CheckpointFn>();
    UseHooks hooks = hooks_;
    entry->run = [fn, hooks, use](const torch::Tensor& in) {
      const bool recomputing = torch::GradMode::is_enabled();
      if (!recomputing) call_hook(hooks.before_forward, use);
      auto y = fn(in);
      if (!recomputing) call_hook(hooks.after_forward, use);
      return y;
    };
    entry->before_backward = [hooks, use] { call_hook(hooks.before_backward, use); };
    entry->after_backward = [hooks, use] { call_hook(hooks.after_backward, use); };
    CheckpointFn* raw = entry.get();
    backward_state_.push_back(std::shared_ptr<CheckpointFn>(std::move(entry)));
    return CheckpointedLayer::apply(x, raw);
  }
  auto backward_call = [this](std::function<void()> fn) {
    auto call = std::make_shared<BackwardCall>(BackwardCall{std::move(fn)});
    backward_state_.push_back(call);
    return call.get();
  };
  torch::Tensor in = x;
  if (h.after_backward && x.requires_grad())
    in = BackwardHook::apply(x, backward_call([h, use] { h.after_backward(use); }));
  call_hook(h.before_forward, use);
  auto y = fn(in);
  call_hook(h.after_forward, use);
  if (h.before_backward && y.requires_grad())
    y = BackwardHook::apply(y, backward_call([h, use] { h.before_backward(use); }));
  return y;
}

LocalHeads local_heads(const ModelConfig& c, const ShardSpec& q_spec, int tp_rank) {
  LocalHeads h;
  if (q_spec.is_replicated()) {
    h.count = c.num_heads;
  } else {
    const Segment& q = q_spec.segments(tp_rank).front();
    h.first = q.start / c.head_dim;
    h.count = q.length / c.head_dim;
  }
  int64_t group = c.kv_group_size(), kv_first = h.first / group;
  for (int64_t i = 0; i < h.count; ++i) h.kv_index.push_back((h.first + i) / group - kv_first);
  return h;
}

CausalLM::CausalLM(ModelConfig config, TpPlan plan, Comm& tp, torch::ScalarType dtype, torch::Device device)
    : config_(std::move(config)), plan_(std::move(plan)), tp_(tp), dtype_(dtype), device_(device) {
  sequence_parallel_ = plan_.sequence_parallel();
  TORCH_CHECK(plan_.tp_size() == tp_.size(), "CausalLM: plan is for tp ", plan_.tp_size(), " but the tp group has ",
              tp_.size(), " ranks");
  bool lora = false;
  for (const auto& e : plan_.entries()) lora = lora || e.adapter;
  experts_.num_experts = config_.num_experts;
  for (const auto& e : plan_.entries()) {
    if (e.remote) continue;  // another expert-parallel rank holds it
    Parameter p;
    p.entry = &e;
    // LoRA factors are fp32 whatever the model dtype (PEFT's default), zero until
    // initialised; so is whatever else trains beside them (one fp32 ZeRO buffer).
    const bool fp32 = e.adapter || (lora && !e.frozen);
    const auto options = torch::TensorOptions().dtype(fp32 ? torch::kFloat32 : dtype_).device(device_);
    p.tensor = e.adapter ? torch::zeros(e.spec.local_shape(tp_.rank()), options)
                         : torch::empty(e.spec.local_shape(tp_.rank()), options);
    p.tensor.requires_grad_(!e.frozen);
    index_[e.desc.name] = params_.size();
    params_.push_back(std::move(p));
  }
}

CausalLM::~CausalLM() = default;

void CausalLM::set_expert_parallel(const ExpertPlacement& placement, Comm& ep) {
  TORCH_CHECK(placement.ep_size == ep.size() && placement.ep_rank == ep.rank() &&
                  placement.num_experts == config_.num_experts,
              "CausalLM::set_expert_parallel: placement ep ", placement.ep_rank, " of ", placement.ep_size, " over ",
              placement.num_experts, " experts for an ep group rank ", ep.rank(), " of ", ep.size(), " and ",
              config_.num_experts, " experts");
  for (const auto& e : plan_.entries())
    TORCH_CHECK(e.expert < 0 || e.remote != placement.owns(e.expert), "CausalLM::set_expert_parallel: the plan was ",
                "not placed for ep rank ", placement.ep_rank, " (", e.desc.name, ")");
  experts_ = placement;
  ep_ = &ep;
}

Parameter& CausalLM::parameter(const std::string& name) {
  auto it = index_.find(name);
  TORCH_CHECK(it != index_.end(), "CausalLM: no parameter named '", name, "'");
  return params_[it->second];
}

const Parameter* CausalLM::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &params_[it->second];
}

torch::Tensor CausalLM::compute_weight(const Parameter& p) const {
  // LoRA keeps trained base tensors (modules_to_save, biases) in fp32 beside the
  // fp32 adapters; the model computes in its dtype (the cast is differentiable).
  return p.entry->adapter || p.tensor.scalar_type() == dtype_ ? p.tensor : p.tensor.to(dtype_);
}

torch::Tensor CausalLM::tensor(const std::string& name) const {
  const Parameter* p = find(name);
  return p ? compute_weight(*p) : torch::Tensor();
}

void CausalLM::init_random(uint64_t seed) {
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    if (p.entry->adapter) continue;  // LoRA factors: lora_weights.h initialises them
    const auto& d = p.entry->desc;
    torch::Tensor full;
    const bool norm_bias = d.name.size() > 5 && d.name.substr(d.name.size() - 5) == ".bias";
    if (d.kind == ParamKind::kNorm)  // identity norms: Gemma scales by 1 + weight
      full = norm_bias || config_.gemma_norms ? torch::zeros(d.shape) : torch::ones(d.shape);
    else if (d.kind == ParamKind::kBias)
      full = torch::zeros(d.shape);
    else {
      auto gen = at::detail::createCPUGenerator(seed ^ fnv1a64(d.name));
      full = torch::empty(d.shape).normal_(0.0, 0.02, gen);
    }
    p.tensor.copy_(p.spec().slice(full, tp_.rank()));
  }
}

LoadReport CausalLM::load(const io::CheckpointReader& checkpoint) {
  torch::NoGradGuard no_grad;
  LoadReport report;
  std::set<std::string> unused;
  for (const auto& n : checkpoint.names()) unused.insert(n);
  const std::string prefix = config_.base_prefix();
  std::vector<std::string> missing;
  for (const auto& e : plan_.entries()) {  // other ep ranks' experts: theirs to read
    if (!e.remote) continue;
    unused.erase(e.desc.name);
    if (e.desc.name.rfind(prefix, 0) == 0) unused.erase(e.desc.name.substr(prefix.size()));
    unused.erase(transformers5_module_name(e.desc.name));
  }
  for (auto& p : params_) {
    if (p.entry->adapter) continue;  // not part of an HF model (lora_weights.h loads adapters)
    const auto& d = p.entry->desc;
    std::string stored = d.name;
    if (!checkpoint.contains(stored) && d.name.rfind(prefix, 0) == 0) stored = d.name.substr(prefix.size());
    if (!checkpoint.contains(stored) && checkpoint.contains(transformers5_module_name(d.name)))
      stored = transformers5_module_name(d.name);
    const ShardSpec& spec = p.spec();
    if (!checkpoint.contains(stored)) {
      // transformers 5's fused experts: this expert's slice of the layer's 3-D tensor.
      const auto fused = fused_expert_slice(checkpoint, d.name, config_.expert_intermediate_size);
      if (!fused) {
        missing.push_back(d.name);
        continue;
      }
      unused.erase(fused->fused_name);
      const torch::Tensor whole = read_fused_expert(checkpoint, *fused, dtype_);
      AUTOTP_USER_CHECK(whole.sizes().vec() == d.shape, "checkpoint tensor '{}' holds expert {} as [{}], the config needs [{}]",
                        fused->fused_name, fused->expert, fmt::join(whole.sizes(), ", "), fmt::join(d.shape, ", "));
      const torch::Tensor local = spec.slice(whole, tp_.rank());
      report.bytes_read += whole.numel() * static_cast<int64_t>(torch::elementSize(dtype_));
      p.tensor.copy_(local);
      continue;
    }
    unused.erase(stored);
    const auto& info = checkpoint.info(stored);
    AUTOTP_USER_CHECK(info.shape == d.shape, "checkpoint tensor '{}' has shape [{}], the config needs [{}]", stored,
                      fmt::join(info.shape, ", "), fmt::join(d.shape, ", "));
    torch::Tensor local;
    if (spec.is_replicated()) {
      local = checkpoint.read(stored, dtype_);
    } else {
      std::vector<torch::Tensor> parts;
      for (const auto& seg : spec.segments(tp_.rank()))
        parts.push_back(checkpoint.read_slice(stored, spec.dim(), seg.start, seg.length, dtype_));
      local = parts.size() == 1 ? parts[0] : torch::cat(parts, spec.dim());
    }
    report.bytes_read += local.numel() * static_cast<int64_t>(torch::elementSize(info.dtype));
    p.tensor.copy_(local);
  }
  // Buffers HF keeps in state dicts, and tied heads saved anyway, are not parameters.
  static const std::regex ignored(R"((^|.*\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$)");
  std::vector<std::string> unexpected;
  for (const auto& n : unused) {
    if (std::regex_match(n, ignored)) continue;
    if (config_.tie_word_embeddings && n == "lm_head.weight") continue;
    unexpected.push_back(n);
  }
  AUTOTP_USER_CHECK(missing.empty(), "checkpoint is missing {} tensor(s) the {} config needs: {}", missing.size(),
                    config_.architecture, fmt::join(missing, ", "));
  AUTOTP_USER_CHECK(unexpected.empty(), "checkpoint has {} unexpected tensor(s) for {}: {}", unexpected.size(),
                    config_.architecture, fmt::join(unexpected, ", "));
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  report.peak_rss_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  return report;
}

torch::Tensor CausalLM::linear(const std::string& module, const torch::Tensor& x) {
  // A whole (replicated) layer; split ones go through column_inputs and row_partial.
  const Parameter* w = find(module + ".weight");
  TORCH_INTERNAL_ASSERT(w, "no weight for ", module);
  torch::Tensor weight = w->entry->desc.kind == ParamKind::kConv1D ? compute_weight(*w).t() : compute_weight(*w);
  torch::Tensor y = linear_product(x, weight, tensor(module + ".bias"));
  const Parameter* a = find(module + ".lora_A.weight");
  if (!a) return y;
  return with_adapter(module, y, torch::matmul(adapter_input(module, x, nullptr).to(torch::kFloat32), a->tensor.t()));
}

torch::Tensor CausalLM::adapter_input(const std::string& module, const torch::Tensor& x, const ShardSpec* split_in) {
  if (!adapter_dropout_on()) return x;
  const DecoderLayerName name = decoder_layer_name(module);
  const DropoutSite site = adapter_dropout_site(name.within);
  if (!split_in) return dropout(x, name.layer, site, adapter_dropout_, {});
  // A row-parallel input: the whole sequence (a piece of it under tp_overlap_comm's
  // sequence split), this rank's features of the base's input dim.
  std::vector<DimRanges> dims;
  dims.push_back(piece_axis_ == PieceAxis::kSequence ? DimRanges{sequence_length_, {Segment{piece_offset_, x.size(1)}}}
                                                     : DimRanges{x.size(1), {}});
  dims.push_back(DimRanges{split_in->global_shape()[1], split_in->segments(tp_.rank())});
  return dropout(x, name.layer, site, adapter_dropout_, std::move(dims));
}

torch::Tensor CausalLM::with_adapter(const std::string& module, const torch::Tensor& y, const torch::Tensor& u) {
  // PEFT: result + lora_B(lora_A(x)) * scaling, computed in the adapters' fp32.
  const torch::Tensor b = find(module + ".lora_B.weight")->tensor;
  torch::Tensor delta = torch::matmul(u, b.t()) * adapter_scaling_;
  return y.scalar_type() == torch::kFloat32 ? y + delta : (y.to(torch::kFloat32) + delta).to(y.scalar_type());
}

torch::Tensor CausalLM::enter_block(const torch::Tensor& h, bool split) {
  if (!sequence_parallel_) return split ? copy_to_tp(h, tp_) : h;
  check_split_under_sp(split);
  return gather_from_sp(h, tp_, 1, sequence_sizes_);
}

void CausalLM::check_split_under_sp(bool split) const {
  AUTOTP_USER_CHECK(!sequence_parallel_ || split,
                    "sequence_parallel needs every attention and MLP block split over tp; this plan "
                    "replicates one (allowed: sequence_parallel false)");
}

std::vector<torch::Tensor> CausalLM::column_inputs(const std::vector<std::string>& modules, const torch::Tensor& h) {
  const Parameter* first = find(modules.front() + ".weight");
  std::vector<torch::Tensor> outputs;
  if (!is_split(*first->entry)) {  // a replicated block: plain layers
    check_split_under_sp(false);
    for (const auto& m : modules) outputs.push_back(linear(m, h));
    return outputs;
  }
  std::vector<torch::Tensor> weights;
  for (const auto& m : modules) {
    const Parameter* w = find(m + ".weight");
    weights.push_back(w->entry->desc.kind == ParamKind::kConv1D ? compute_weight(*w).t() : compute_weight(*w));
  }
  // LoRA: each lora_A (replicated) reads the same gathered input, in the same
  // autograd node, so its input gradient joins the base's one reduction.
  // With lora_dropout each adapter reads its own dropped input: one more node
  // (and its collectives) per adapter.
  const ColumnInputOptions options{sequence_parallel_, sequence_sizes_, plan_.overlap_comm()};
  std::vector<size_t> adapted;
  std::vector<torch::Tensor> dropped_u;
  for (size_t j = 0; j < modules.size(); ++j)
    if (const Parameter* a = find(modules[j] + ".lora_A.weight")) {
      adapted.push_back(j);
      if (adapter_dropout_on())
        dropped_u.push_back(column_parallel_inputs(adapter_input(modules[j], h, nullptr), {a->tensor}, tp_, options).front());
      else
        weights.push_back(a->tensor);
    }
  outputs = column_parallel_inputs(h, weights, tp_, options);
  for (auto& u : dropped_u) outputs.push_back(std::move(u));
  for (size_t j = 0; j < modules.size(); ++j) {
    torch::Tensor bias = tensor(modules[j] + ".bias");
    if (bias.defined()) outputs[j] = outputs[j] + bias;
  }
  for (size_t k = 0; k < adapted.size(); ++k) {
    const size_t j = adapted[k];
    outputs[j] = with_adapter(modules[j], outputs[j], outputs[modules.size() + k]);
  }
  outputs.resize(modules.size());
  return outputs;
}

torch::Tensor CausalLM::attention(int64_t layer, const std::string& q_param, const torch::Tensor& q,
                                  const torch::Tensor& k, const torch::Tensor& v) {
  // q: [B, Hq, T, D]; k, v: [B, Hkv_local, T, D]
  auto heads = local_heads(config_, find(q_param)->spec(), tp_.rank());
  const double scale = config_.attention_scale > 0 ? config_.attention_scale
                                                   : 1.0 / std::sqrt(static_cast<double>(config_.head_dim));
  const int64_t window = config_.sliding_window_of(layer);
  AttentionExtras extras;
  extras.softcap = config_.attn_softcap;
  if (dropout_ && config_.attention_dropout > 0) {
    // [B, local heads, T, T]: the heads' global indices, every query and key.
    const int64_t T = q.size(2);
    const std::vector<DimRanges> dims = {
        DimRanges{dropout_->step_samples, {Segment{first_sample(), q.size(0)}}},
        DimRanges{config_.num_heads, {Segment{heads.first, heads.count}}}, DimRanges{T, {}}, DimRanges{T, {}}};
    // The key is taken now: a recomputation in the backward draws the same mask.
    const DropoutKey key{dropout_->seed, dropout_->step, layer, DropoutSite::kAttentionProbs};
    extras.on_probs = [key, dims, p = config_.attention_dropout](const torch::Tensor& probs) {
      return apply_dropout(probs, key, p, dims);
    };
  }
  auto core = std::make_shared<RecomputedAttention::Core>(
      [kv_index = heads.kv_index, scale, window, extras](const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v) {
        return causal_attention(q, k, v, kv_index, scale, window, extras);
      });
  if (!selective_recompute_ || !torch::GradMode::is_enabled() || !q.requires_grad()) return (*core)(q, k, v);
  backward_state_.push_back(core);
  return RecomputedAttention::apply(q, k, v, core.get());
}

int64_t CausalLM::first_sample() const {
  return dropout_->sample_offset + (piece_axis_ == PieceAxis::kBatch ? piece_offset_ : 0);
}

torch::Tensor CausalLM::norm(const std::string& module, const torch::Tensor& x) {
  const torch::Tensor& weight = tensor(module + ".weight");
  return config_.gemma_norms ? rms_norm_plus_one(x, weight, config_.norm_eps) : rms_norm(x, weight, config_.norm_eps);
}

torch::Tensor CausalLM::dropout(const torch::Tensor& x, int64_t layer, DropoutSite site, double p,
                                std::vector<DimRanges> dims) {
  if (!dropout_ || p == 0) return x;
  // Dim 1 is a slice of the sequence under sequence parallelism or in a sequence piece
  // (layer_schedule.h); a batch piece starts further into the step's samples.
  const bool token_slice = sequence_parallel_ || piece_axis_ == PieceAxis::kSequence;
  const int64_t token_offset = sequence_parallel_ ? sequence_offset_ : piece_offset_;
  if (dims.empty())
    for (int64_t d = 1; d < x.dim(); ++d)
      dims.push_back(token_slice && d == 1 ? DimRanges{sequence_length_, {Segment{token_offset, x.size(1)}}}
                                           : DimRanges{x.size(d), {}});
  dims.insert(dims.begin(), DimRanges{dropout_->step_samples, {Segment{first_sample(), x.size(0)}}});
  return apply_dropout(x, DropoutKey{dropout_->seed, dropout_->step, layer, site}, p, dims);
}

torch::Tensor CausalLM::mlp_activation(const torch::Tensor& gate) {
  if (config_.activation == "gelu_pytorch_tanh") return torch::gelu(gate, "tanh");
  return torch::silu(gate);
}

torch::Tensor CausalLM::llama_layer(int64_t layer, const torch::Tensor& x, const torch::Tensor& cos,
                                    const torch::Tensor& sin) {
  const std::string p = fmt::format("model.layers.{}.", layer);
  const int64_t D = config_.head_dim;
  const bool fused = config_.fused_projections;
  const std::string q_param = p + (fused ? "self_attn.qkv_proj.weight" : "self_attn.q_proj.weight");
  const Parameter* q_w = find(q_param);
  LayerBlocks blocks = row_reductions();
  blocks.attention = [&](const torch::Tensor& xs) {
    auto h = norm(p + "input_layernorm", xs);
    torch::Tensor q, k, v;
    if (fused) {  // Phi-3: this rank's [q | k | v] columns, each part split on its own
      std::vector<int64_t> widths;
      if (q_w->spec().is_replicated())
        widths = {config_.num_heads * D, config_.num_kv_heads * D, config_.num_kv_heads * D};
      else
        for (const Segment& s : q_w->spec().segments(tp_.rank())) widths.push_back(s.length);
      auto parts = column_inputs({p + "self_attn.qkv_proj"}, h).front().split_with_sizes(widths, -1);
      q = parts[0], k = parts[1], v = parts[2];
    } else {
      auto qkv = column_inputs({p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"}, h);
      q = qkv[0], k = qkv[1], v = qkv[2];
    }
    const int64_t B = q.size(0), T = q.size(1);  // the whole sequence, also under sequence parallelism
    q = q.view({B, T, -1, D});
    k = k.view({B, T, -1, D});
    v = v.view({B, T, -1, D}).transpose(1, 2);
    if (config_.qk_norm) {  // Qwen3, Gemma 3: per head, before RoPE
      q = norm(p + "self_attn.q_norm", q);
      k = norm(p + "self_attn.k_norm", k);
    }
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    return row_partial(p + "self_attn.o_proj", attention(layer, q_param, q, k, v));
  };
  blocks.after_attention = [&](const torch::Tensor& xs, const torch::Tensor& reduced) {
    auto attn = row_output(p + "self_attn.o_proj", reduced);
    if (config_.gemma_norms) attn = norm(p + "post_attention_layernorm", attn);  // Gemma: norms the block's output
    return xs + dropout(attn, layer, DropoutSite::kAttentionOutput, config_.residual_dropout);
  };
  const std::string mlp_norm = p + (config_.gemma_norms ? "pre_feedforward_layernorm" : "post_attention_layernorm");
  if (config_.is_sparse(layer)) {  // the sparse block reduces inside: never cut in pieces
    blocks.attention_split = is_split(*q_w->entry);
    auto out = run_attention_block(x, blocks);
    return out + moe_block(layer, norm(mlp_norm, out));
  }
  blocks.mlp = [&](const torch::Tensor& out) {
    auto h = norm(mlp_norm, out);
    torch::Tensor mlp;
    if (fused) {  // Phi-3: this rank's gate columns, then as many up columns
      auto gate_up = column_inputs({p + "mlp.gate_up_proj"}, h).front().chunk(2, -1);
      mlp = gate_up[1] * mlp_activation(gate_up[0]);
    } else {
      auto gate_up = column_inputs({p + "mlp.gate_proj", p + "mlp.up_proj"}, h);
      mlp = mlp_activation(gate_up[0]) * gate_up[1];
    }
    return row_partial(p + "mlp.down_proj", mlp);
  };
  blocks.after_mlp = [&](const torch::Tensor& out, const torch::Tensor& reduced) {
    auto mlp = row_output(p + "mlp.down_proj", reduced);
    if (config_.gemma_norms) mlp = norm(p + "post_feedforward_layernorm", mlp);
    return out + dropout(mlp, layer, DropoutSite::kMlpOutput, config_.residual_dropout);
  };
  blocks.attention_split = is_split(*q_w->entry);
  blocks.mlp_split = is_split(*find(p + (fused ? "mlp.gate_up_proj.weight" : "mlp.gate_proj.weight"))->entry);
  return run_layer_blocks(x, blocks, piece_axis(x, blocks));
}

torch::Tensor CausalLM::moe_block(int64_t layer, const torch::Tensor& h_in) {
  const std::string block = config_.moe_module(layer) + ".";
  const int64_t hidden = h_in.size(-1);
  // Split experts: every rank routes every token and runs its part of each expert;
  // the weighted sum of the parts is reduced once for the block.
  const bool split = is_split(*find(config_.expert_module(layer, experts_.first(), 0) + ".weight")->entry);
  const torch::Tensor block_in = enter_block(h_in, split);  // the whole sequence under sequence parallelism
  const torch::Tensor x = block_in.reshape({-1, hidden});
  const Parameter* router = find(block + "gate.weight");
  torch::Tensor probs = torch::softmax(linear_product(x, compute_weight(*router)), -1, torch::kFloat32);  // HF: fp32
  if (router_aux_ && config_.router_aux_loss_enabled() && torch::GradMode::is_enabled() && probs.requires_grad())
    probs = RouterAuxGradient::apply(probs, router_aux_->grad_per_prob, router->entry->partial_grad ? tp_.size() : 1);
  auto [weights, selected] = probs.topk(config_.experts_per_token, -1);
  if (router_aux_) router_aux_->record(layer, selected, probs, config_.num_experts);
  if (config_.norm_topk_prob) weights = weights / weights.sum(-1, true);
  weights = weights.to(x.scalar_type());
  auto expert = [&](int64_t e, const torch::Tensor& xe) {
    auto ye = mlp_activation(linear_product(xe, tensor(config_.expert_module(layer, e, 0) + ".weight"))) *
              linear_product(xe, tensor(config_.expert_module(layer, e, 1) + ".weight"));
    return linear_product(ye, tensor(config_.expert_module(layer, e, 2) + ".weight"));
  };
  torch::Tensor out;
  if (ep_ && experts_.ep_size > 1) {
    out = dispatch_to_experts(x, selected, weights, experts_, *ep_,
                              [&](int64_t local, const torch::Tensor& rows) { return expert(experts_.first() + local, rows); });
  } else {
    // Every expert runs, on its tokens (possibly none: its gradient is then zero, not missing).
    out = torch::zeros_like(x);
    for (int64_t e = 0; e < config_.num_experts; ++e) {
      const auto where = (selected == e).nonzero();  // [tokens, 2]: token, slot
      const auto tokens = where.select(1, 0), slots = where.select(1, 1);
      out = out.index_add(0, tokens, expert(e, x.index_select(0, tokens)) * weights.index({tokens, slots}).unsqueeze(-1));
    }
  }
  if (config_.shared_expert_intermediate_size > 0) {  // Qwen2-MoE: every token, behind a sigmoid gate
    const std::string s = block + "shared_expert.";
    auto shared = mlp_activation(linear_product(x, tensor(s + "gate_proj.weight"))) *
                  linear_product(x, tensor(s + "up_proj.weight"));
    shared = linear_product(shared, tensor(s + "down_proj.weight"));
    out = out + torch::sigmoid(linear_product(x, tensor(block + "shared_expert_gate.weight"))) * shared;
  }
  out = out.view(block_in.sizes());
  if (!split) return out;
  return sequence_parallel_ ? reduce_scatter_to_sp(out, tp_, 1, sequence_sizes_) : reduce_from_tp(out, tp_);
}

double CausalLM::router_aux_loss(double gradient_weight) {
  if (!router_aux_ || router_aux_->selections.empty()) return 0;
  // HF concatenates the layers' router logits: means over layers x tokens.
  const auto& r = *router_aux_;
  const double rows = static_cast<double>(r.selections.size()) * static_cast<double>(r.tokens);
  auto counts = torch::zeros({config_.num_experts}, torch::kFloat64), sums = torch::zeros_like(counts);
  for (const auto& [layer, c] : r.selections) counts += c;
  for (const auto& [layer, p] : r.prob_sums) sums += p;
  const double experts = static_cast<double>(config_.num_experts);
  const double loss = experts * (counts / rows * (sums / rows)).sum().item<double>();
  router_aux_->grad_per_prob.copy_(counts * (gradient_weight * experts / (rows * rows)));
  return loss;
}

torch::Tensor CausalLM::expert_token_counts() const {
  if (!router_aux_ || router_aux_->selections.empty()) return {};
  std::vector<torch::Tensor> rows;
  for (const auto& [layer, counts] : router_aux_->selections) rows.push_back(counts);
  return torch::stack(rows);
}

torch::Tensor CausalLM::gpt2_layer(int64_t layer, const torch::Tensor& x) {
  const std::string p = fmt::format("transformer.h.{}.", layer);
  const int64_t D = config_.head_dim;
  const int64_t H = x.size(-1);
  const Parameter* qkv_w = find(p + "attn.c_attn.weight");
  auto layer_norm = [&](const std::string& module, const torch::Tensor& in) {
    return F::layer_norm(in, F::LayerNormFuncOptions({H})
                                 .weight(tensor(module + ".weight"))
                                 .bias(tensor(module + ".bias"))
                                 .eps(config_.norm_eps));
  };
  LayerBlocks blocks = row_reductions();
  blocks.attention = [&](const torch::Tensor& xs) {
    auto qkv = column_inputs({p + "attn.c_attn"}, layer_norm(p + "ln_1", xs)).front();
    const int64_t B = qkv.size(0), T = qkv.size(1);  // the whole sequence, also under sequence parallelism
    auto heads = local_heads(config_, qkv_w->spec(), tp_.rank());
    int64_t width = heads.count * D;  // GPT-2 has as many kv heads as query heads
    auto parts = qkv.split(width, -1);
    auto q = parts[0].view({B, T, -1, D}).transpose(1, 2);
    auto k = parts[1].view({B, T, -1, D}).transpose(1, 2);
    auto v = parts[2].view({B, T, -1, D}).transpose(1, 2);
    return row_partial(p + "attn.c_proj", attention(layer, p + "attn.c_attn.weight", q, k, v));
  };
  blocks.after_attention = [&](const torch::Tensor& xs, const torch::Tensor& reduced) {
    return xs + dropout(row_output(p + "attn.c_proj", reduced), layer, DropoutSite::kAttentionOutput,
                        config_.residual_dropout);
  };
  blocks.mlp = [&](const torch::Tensor& out) {
    return row_partial(p + "mlp.c_proj", gelu_new(column_inputs({p + "mlp.c_fc"}, layer_norm(p + "ln_2", out)).front()));
  };
  blocks.after_mlp = [&](const torch::Tensor& out, const torch::Tensor& reduced) {
    return out + dropout(row_output(p + "mlp.c_proj", reduced), layer, DropoutSite::kMlpOutput,
                         config_.residual_dropout);
  };
  blocks.attention_split = is_split(*qkv_w->entry);
  blocks.mlp_split = is_split(*find(p + "mlp.c_fc.weight")->entry);
  return run_layer_blocks(x, blocks, piece_axis(x, blocks));
}

LayerBlocks CausalLM::row_reductions() {
  LayerBlocks b;
  b.reduce = [this](const torch::Tensor& partial) {
    return sequence_parallel_ ? reduce_scatter_to_sp(partial, tp_, 1, sequence_sizes_) : reduce_from_tp(partial, tp_);
  };
  b.start_reduce = [this](const torch::Tensor& partial) {
    return sequence_parallel_ ? start_reduce_scatter_to_sp(partial, tp_, 1, sequence_sizes_)
                              : start_reduce_from_tp(partial, tp_);
  };
  b.enter_piece = [this](PieceAxis axis, int64_t offset) {
    piece_axis_ = offset < 0 ? PieceAxis::kNone : axis;
    piece_offset_ = std::max<int64_t>(offset, 0);
  };
  return b;
}

PieceAxis CausalLM::piece_axis(const torch::Tensor& x, const LayerBlocks& blocks) const {
  if (!plan_.overlap_comm() || !blocks.attention_split || !blocks.mlp_split) return PieceAxis::kNone;
  if (x.size(0) >= 2) return PieceAxis::kBatch;
  // One sequence: cut along it, except under sequence parallelism (each rank holds a slice already).
  return !sequence_parallel_ && x.size(1) >= 2 ? PieceAxis::kSequence : PieceAxis::kNone;
}

torch::Tensor CausalLM::row_partial(const std::string& module, const torch::Tensor& x) {
  const Parameter* w = find(module + ".weight");
  TORCH_INTERNAL_ASSERT(w, "no weight for ", module);
  if (w->entry->role != TpRole::kRow) return linear(module, x);  // a replicated block: the whole output
  torch::Tensor weight = w->entry->desc.kind == ParamKind::kConv1D ? compute_weight(*w).t() : compute_weight(*w);
  torch::Tensor partial = linear_product(x, weight);
  // LoRA: lora_A is cut like the input, so x_local A_local^T is a partial sum
  // too; B is linear, so its product joins the base's before the one reduction.
  const Parameter* a = find(module + ".lora_A.weight");
  if (!a) return partial;
  return with_adapter(module, partial,
                      torch::matmul(adapter_input(module, x, w->spec().is_replicated() ? nullptr : &w->spec())
                                        .to(torch::kFloat32),
                                    a->tensor.t()));
}

torch::Tensor CausalLM::row_output(const std::string& module, const torch::Tensor& reduced) {
  if (find(module + ".weight")->entry->role != TpRole::kRow) return reduced;  // bias added already
  torch::Tensor bias = tensor(module + ".bias");
  return bias.defined() ? reduced + bias : reduced;  // once, after the reduction
}

torch::Tensor CausalLM::embed(const torch::Tensor& ids) {
  const Parameter& e = params_.front();  // the token embedding comes first in every layout
  TORCH_INTERNAL_ASSERT(e.entry->desc.kind == ParamKind::kEmbedding);
  if (!is_split(*e.entry)) {
    auto x = torch::embedding(compute_weight(e), ids);
    return sequence_parallel_ ? scatter_to_tp(x, tp_, 1, sequence_sizes_) : x;
  }
  return vocab_parallel_embedding(ids, compute_weight(e), e.spec().segments(tp_.rank()).front().start, tp_,
                                  sequence_parallel_ ? sequence_sizes_ : std::vector<int64_t>{});
}

const Parameter& head_param(const std::vector<Parameter>& params, bool tied) {
  return tied ? params.front() : params.back();
}

int64_t CausalLM::vocab_start() const {
  const Parameter& head = head_param(params_, config_.tie_word_embeddings);
  return is_split(*head.entry) ? head.spec().segments(tp_.rank()).front().start : 0;
}

torch::Tensor CausalLM::lm_head_logits(const torch::Tensor& hidden) {
  const Parameter& head = head_param(params_, config_.tie_word_embeddings);
  torch::Tensor logits;
  if (is_split(*head.entry))  // vocab-parallel: a column-parallel layer over the vocabulary
    logits = column_parallel_inputs(hidden, {compute_weight(head)}, tp_,
                                    {sequence_parallel_, sequence_sizes_, plan_.overlap_comm()})
                 .front();
  else  // a replicated head's gradient is whole on every rank: under sequence parallelism keep this rank's tokens
    logits = linear_product(sequence_parallel_ ? gather_from_tp(hidden, tp_, 1, sequence_sizes_) : hidden,
                            compute_weight(head));
  if (config_.final_softcap > 0)  // Gemma 2, elementwise: each rank caps its vocab slice
    logits = torch::tanh(logits / config_.final_softcap) * config_.final_softcap;
  return logits;
}

torch::Tensor CausalLM::hidden_states(const torch::Tensor& input_ids_in) {
  TORCH_CHECK(input_ids_in.dim() == 2, "CausalLM: input_ids must be [batch, seq], got ", input_ids_in.sizes());
  const torch::Tensor input_ids = input_ids_in.to(device_);
  const auto on_device = torch::TensorOptions().device(device_);
  const int64_t T = input_ids.size(1);
  // GPT-2's learned positions end at n_positions; rotary ones do not (HF runs
  // Llama-family models past max_position_embeddings; dynamic rope_scaling is for that).
  AUTOTP_USER_CHECK(config_.family != ModelFamily::kGpt2 || T <= config_.max_positions,
                    "sequence length {} exceeds the model's {} positions (n_positions)", T, config_.max_positions);
  backward_state_.clear();  // the previous forward's backward is done
  router_aux_.reset();
  if (config_.num_experts > 0) {
    router_aux_ = std::make_shared<RouterAuxState>(config_.num_experts);
    backward_state_.push_back(router_aux_);  // recomputed layers still record into it
  }
  auto checkpointed = [this](int64_t l) {
    return l < static_cast<int64_t>(checkpoint_layers_.size()) && checkpoint_layers_[l];
  };
  // The embeddings' backward reads no parameter: hooks around the forward only.
  call_hook(hooks_.before_forward, kEmbeddingUse);
  sequence_length_ = T;
  int64_t first_token = 0, tokens = T;  // this rank's positions from here to the head
  if (sequence_parallel_) {
    sequence_sizes_ = sequence_shard_sizes(T, tp_.size());
    sequence_offset_ = std::accumulate(sequence_sizes_.begin(), sequence_sizes_.begin() + tp_.rank(), int64_t{0});
    first_token = sequence_offset_, tokens = sequence_sizes_[tp_.rank()];
  }
  auto x = embed(input_ids);  // under sequence parallelism this rank's tokens (a reduce-scatter, or a slice)
  if (config_.gemma_norms)  // HF: times sqrt(hidden) rounded to the activation dtype
    x = x * torch::scalar_tensor(std::sqrt(static_cast<double>(config_.hidden_size)), x.options());
  if (config_.family == ModelFamily::kGpt2)  // under sequence parallelism its gradient is partial (tp_plan.cpp)
    x = x + torch::embedding(tensor("transformer.wpe.weight"),
                             torch::arange(first_token, first_token + tokens, on_device.dtype(torch::kLong)))
                .unsqueeze(0);
  x = dropout(x, kEmbeddingUse, DropoutSite::kEmbedding, config_.embedding_dropout);
  call_hook(hooks_.after_forward, kEmbeddingUse);
  // A frozen embedding (LoRA) leaves the stream without a gradient: the layers'
  // backward hooks and recomputed layers need one (HF's enable_input_require_grads).
  if (torch::GradMode::is_enabled() && !x.requires_grad()) x = x.detach().requires_grad_(true);
  if (config_.family == ModelFamily::kGpt2) {
    for (int64_t l = 0; l < config_.num_layers; ++l)
      x = run_use(l, x, [this, l](const torch::Tensor& in) { return gpt2_layer(l, in); }, checkpointed(l));
    return x;
  }
  // Rotary tables in fp32 as HF computes them (rope_scaling included), then cast
  // to the activation dtype.
  const auto global = rotary_tables(config_.rope_scaling, config_.rope_theta, T);
  const torch::Tensor &cos = global.first, &sin = global.second;
  torch::Tensor local_cos = cos, local_sin = sin;
  if (config_.local_rope_theta > 0)  // Gemma 3: sliding layers rotate with their own base, unscaled
    std::tie(local_cos, local_sin) = rotary_tables(RopeScaling{}, config_.local_rope_theta, T);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const bool local = config_.sliding_window_of(l) > 0;
    const torch::Tensor& c = local ? local_cos : cos;
    const torch::Tensor& s = local ? local_sin : sin;
    x = run_use(l, x, [this, l, c, s](const torch::Tensor& in) { return llama_layer(l, in, c, s); }, checkpointed(l));
  }
  return x;
}

std::pair<torch::Tensor, torch::Tensor> CausalLM::rotary_tables(const RopeScaling& scaling, double theta,
                                                                int64_t T) const {
  const int64_t D = config_.head_dim;
  const RotaryFrequencies rope = rotary_frequencies(scaling, theta, D, config_.max_positions, T);
  auto inv_freq = rope.inv_freq.to(device_);
  auto positions = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(device_)).to(torch::kFloat32);
  auto freqs = torch::matmul(inv_freq.view({-1, 1}), positions.view({1, -1})).t();  // [T, D/2]
  auto emb = torch::cat({freqs, freqs}, -1);
  auto cos = emb.cos(), sin = emb.sin();
  if (rope.attention_factor != 1) {  // yarn, longrope: HF scales both tables
    cos = cos * rope.attention_factor;
    sin = sin * rope.attention_factor;
  }
  return {cos.to(dtype_).view({1, 1, T, D}), sin.to(dtype_).view({1, 1, T, D})};
}

torch::Tensor CausalLM::final_norm(const torch::Tensor& x) {
  if (config_.family == ModelFamily::kGpt2) {
    const int64_t H = x.size(-1);
    return F::layer_norm(x, F::LayerNormFuncOptions({H})
                                .weight(tensor("transformer.ln_f.weight"))
                                .bias(tensor("transformer.ln_f.bias"))
                                .eps(config_.norm_eps));
  }
  return norm("model.norm", x);
}

torch::Tensor CausalLM::forward(const torch::Tensor& input_ids) {
  return run_use(
      head_use(), hidden_states(input_ids),
      [this](const torch::Tensor& x) { return lm_head_logits(final_norm(x)); }, /*checkpoint=*/false);
}

torch::Tensor CausalLM::token_losses(const torch::Tensor& input_ids, const torch::Tensor& targets) {
  return losses_from_logits(forward(input_ids), targets);
}

torch::Tensor CausalLM::losses_from_logits(const torch::Tensor& local_logits, const torch::Tensor& targets) {
  const Parameter& head = head_param(params_, config_.tie_word_embeddings);
  Comm& comm = is_split(*head.entry) ? tp_ : self_comm();
  auto flat = local_logits.reshape({-1, local_logits.size(-1)});
  return vocab_parallel_cross_entropy(flat, targets.to(local_logits.device()).reshape({-1}), vocab_start(), comm)
      .view(targets.sizes());
}

torch::Tensor CausalLM::full_logits(const torch::Tensor& input_ids) {
  torch::NoGradGuard no_grad;
  return gather_logits(forward(input_ids));
}

torch::Tensor CausalLM::gather_logits(const torch::Tensor& local_logits) {
  torch::NoGradGuard no_grad;
  const Parameter& head = head_param(params_, config_.tie_word_embeddings);
  if (!is_split(*head.entry)) return local_logits.detach();
  std::vector<int64_t> sizes;
  for (int r = 0; r < tp_.size(); ++r) sizes.push_back(head.spec().local_extent(r));
  return tp_.all_gather(local_logits.detach().contiguous(), 2, sizes);
}


torch::Tensor CausalLM::gather(const Parameter& p) { return gather_full(p.spec(), p.tensor, tp_); }

void CausalLM::sync_shared_grads() {
  for (auto& p : params_) {
    if (!p.tensor.grad().defined()) continue;
    auto grad = p.tensor.mutable_grad();
    sum_partial_grads(*p.entry, grad, tp_);
  }
}

torch::Tensor CausalLM::gather_grad(const Parameter& p) {
  TORCH_CHECK(p.tensor.grad().defined(), "CausalLM::gather_grad: '", p.name(), "' has no gradient");
  return gather_full(p.spec(), p.tensor.grad(), tp_);
}

}  // namespace autotp
