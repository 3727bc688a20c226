#include "autotp/tp/parallel_layers.h"

#include "autotp/base/bf16_matmul.h"
#include "autotp/comm/autograd_collectives.h"

namespace autotp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class ColumnParallelInputs : public torch::autograd::Function<ColumnParallelInputs> {
 public:
  // `weights` as a TensorList: autograd tracks each of them.
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, at::TensorList weights, Comm* tp,
                               const ColumnInputOptions& options) {
    torch::Tensor x_full = options.sequence_parallel ? tp->all_gather(x, 1, options.sequence_sizes) : x;
    variable_list outputs;
    // A weight of another dtype (LoRA's fp32 lora_A) reads the input cast to it;
    // a frozen weight gets no gradient (its GEMM is skipped in the backward).
    c10::List<bool> needs_grad;
    for (const auto& w : weights) {
      outputs.push_back(
          matmul_nograd(w.scalar_type() == x_full.scalar_type() ? x_full : x_full.to(w.scalar_type()), w.t()));
      needs_grad.push_back(w.requires_grad());
    }
    ctx->saved_data["needs_grad"] = needs_grad;
    variable_list saved{x};  // under sequence parallelism only this rank's tokens
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["comm"] = reinterpret_cast<int64_t>(tp);
    ctx->saved_data["sequence_parallel"] = options.sequence_parallel;
    ctx->saved_data["sizes"] = options.sequence_sizes;
    ctx->saved_data["overlap"] = options.overlap;
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    Comm& tp = *reinterpret_cast<Comm*>(ctx->saved_data.at("comm").toInt());
    const bool sp = ctx->saved_data.at("sequence_parallel").toBool(), overlap = ctx->saved_data.at("overlap").toBool();
    const std::vector<int64_t> sizes = ctx->saved_data.at("sizes").toIntVector();
    // Under sequence parallelism the input is gathered again, behind the input-gradient GEMM.
    torch::Tensor x_full = x;
    CommWork gather;
    if (sp && overlap)
      gather = tp.start_all_gather(x_full, x, 1, sizes);
    else if (sp)
      x_full = tp.all_gather(x, 1, sizes);
    torch::Tensor grad_x;
    for (size_t j = 1; j < saved.size(); ++j) {
      if (!grads[j - 1].defined()) continue;
      auto term = matmul_nograd(grads[j - 1], saved[j]);
      if (term.scalar_type() != x.scalar_type()) term = term.to(x.scalar_type());
      grad_x = grad_x.defined() ? grad_x.add_(term) : term;
    }
    gather.wait();
    if (!grad_x.defined()) grad_x = torch::zeros(x_full.sizes(), x.options());
    // The input gradient's reduction runs while the weight gradients compute (overlap).
    torch::Tensor reduced;
    CommWork reduce;
    if (sp) {
      torch::Tensor rows = grad_x.movedim(1, 0).contiguous();
      if (overlap)
        reduce = tp.start_reduce_scatter(reduced, rows, sizes);
      else
        reduced = tp.reduce_scatter(rows, sizes);
    } else {
      reduced = grad_x.contiguous();
      if (overlap)
        reduce = tp.start_all_reduce(reduced);
      else
        tp.all_reduce(reduced);
    }
    variable_list out(saved.size() + 2);  // x, the weights, then the Comm and the options
    const auto x_rows = x_full.reshape({-1, x_full.size(-1)});
    const auto needs_grad = ctx->saved_data.at("needs_grad").toBoolList();
    for (size_t j = 1; j < saved.size(); ++j) {
      if (!needs_grad.get(j - 1)) continue;
      const auto& g = grads[j - 1];
      const auto rows = x_rows.scalar_type() == saved[j].scalar_type() ? x_rows : x_rows.to(saved[j].scalar_type());
      out[j] = g.defined() ? matmul_nograd(g.reshape({-1, g.size(-1)}).t(), rows) : torch::zeros_like(saved[j]);
    }
    reduce.wait();
    out[0] = sp ? reduced.movedim(0, 1) : reduced;
    return out;
  }
};

class VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits_in, const torch::Tensor& targets,
                               int64_t vocab_start, Comm* tp, int64_t ignore_index) {
    torch::NoGradGuard no_grad;
    auto logits = logits_in.to(torch::kFloat32);
    const int64_t local_vocab = logits.size(1);
    auto max = std::get<0>(logits.max(1));
    tp->all_reduce(max, ReduceOp::kMax);
    auto shifted = logits - max.unsqueeze(1);
    auto local_targets = targets - vocab_start;
    auto mine = (local_targets >= 0) & (local_targets < local_vocab);
    auto picked = shifted.gather(1, local_targets.clamp(0, local_vocab - 1).unsqueeze(1)).squeeze(1) * mine;
    auto exp = shifted.exp_();  // in place: one [N, V_local] buffer besides the logits
    // One all-reduce carries both the partition function and the target logit.
    auto sums = torch::stack({exp.sum(1), picked});
    tp->all_reduce(sums, ReduceOp::kSum);
    auto loss = sums[0].log() - sums[1];
    auto valid = targets != ignore_index;
    loss = loss * valid;
    ctx->save_for_backward({exp.div_(sums[0].unsqueeze(1)), local_targets, mine & valid, valid});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits_in.scalar_type());
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    auto softmax = saved[0], local_targets = saved[1], mine = saved[2], valid = saved[3];
    auto grad = softmax;  // softmax - onehot(target), scaled by the incoming gradient
    auto rows = torch::arange(grad.size(0), local_targets.options());
    auto mine_rows = rows.masked_select(mine);
    auto mine_cols = local_targets.masked_select(mine);
    grad.index_put_({mine_rows, mine_cols}, grad.index({mine_rows, mine_cols}) - 1.0f);
    grad.mul_((grad_outputs[0].to(torch::kFloat32) * valid).unsqueeze(1));
    auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor column_parallel_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                     Comm& tp) {
  return torch::nn::functional::linear(copy_to_tp(x, tp), weight, bias);
}

torch::Tensor row_parallel_linear(const torch::Tensor& x_local, const torch::Tensor& weight,
                                  const torch::Tensor& bias, Comm& tp) {
  auto y = reduce_from_tp(linear_product(x_local, weight), tp);
  return bias.defined() ? y + bias : y;
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& ids, const torch::Tensor& weight, int64_t vocab_start,
                                       Comm& tp, const std::vector<int64_t>& sequence_sizes) {
  if (tp.size() == 1 && vocab_start == 0)
    return torch::embedding(weight, ids);
  auto local = ids - vocab_start;
  auto outside = (local < 0) | (local >= weight.size(0));
  auto out = torch::embedding(weight, local.masked_fill(outside, 0));
  out = out.masked_fill(outside.unsqueeze(-1), 0);
  return sequence_sizes.empty() ? reduce_from_tp(out, tp) : reduce_scatter_to_sp(out, tp, 1, sequence_sizes);
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits_local, const torch::Tensor& targets,
                                           int64_t vocab_start, Comm& tp, int64_t ignore_index) {
  TORCH_CHECK(logits_local.dim() == 2 && targets.dim() == 1 && logits_local.size(0) == targets.size(0),
              "vocab_parallel_cross_entropy: expected logits [N, V_local] and targets [N], got ",
              logits_local.sizes(), " and ", targets.sizes());
  return VocabParallelCrossEntropy::apply(logits_local, targets, vocab_start, &tp, ignore_index);
}

void sum_shared_slices(const ShardSpec& spec, torch::Tensor& local_grad, Comm& tp) {
  if (spec.is_replicated() || !spec.has_overlap()) return;
  torch::NoGradGuard no_grad;
  auto full = torch::zeros(spec.global_shape(), local_grad.options());
  spec.place(full, local_grad, tp.rank(), /*accumulate=*/true);
  tp.all_reduce(full);
  local_grad.copy_(spec.slice(full, tp.rank()));
}

void sum_partial_grads(const PlanEntry& entry, torch::Tensor& local_grad, Comm& tp) {
  if (!entry.partial_grad) return sum_shared_slices(entry.spec, local_grad, tp);
  torch::NoGradGuard no_grad;
  tp.all_reduce(local_grad);
}

torch::Tensor gather_full(const ShardSpec& spec, const torch::Tensor& local, Comm& tp) {
  if (spec.is_replicated()) return local.detach().clone();
  std::vector<int64_t> sizes;
  for (int r = 0; r < tp.size(); ++r) sizes.push_back(spec.local_numel(r));
  auto flat = tp.all_gather(local.detach().contiguous().view({-1}), 0, sizes);
  auto full = torch::empty(spec.global_shape(), local.options().requires_grad(false));
  int64_t offset = 0;
  for (int r = 0; r < tp.size(); ++r) {
    spec.place(full, flat.narrow(0, offset, sizes[r]).view(spec.local_shape(r)), r);
    offset += sizes[r];
  }
  return full;
}

std::vector<torch::Tensor> column_parallel_inputs(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                                  Comm& tp, const ColumnInputOptions& options) {
  TORCH_CHECK(!weights.empty(), "column_parallel_inputs: no weights");
  return ColumnParallelInputs::apply(x, at::TensorList(weights), &tp, options);
}

}  // namespace autotp
