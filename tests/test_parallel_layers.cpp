// The tensor-parallel layer functions (parallel_layers.h) over real Gloo ranks
// (tp = world = 1..4), forward and backward, against the single-rank torch
// layers. Every rank builds the same full inputs and weights from a fixed seed,
// runs the reference with autograd locally, then the sharded layer on its own
// shard (cut like the engine cuts it: split_evenly, contiguous, larger first)
// and compares its part. Sizes do not divide evenly over 2, 3 or 4 ranks.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "autotp/tp/parallel_layers.h"
#include "autotp/tp/shard_spec.h"
#include "support/multiprocess.h"

namespace {

namespace F = torch::nn::functional;
using autotp::Comm;
using autotp::Segment;
using autotp::ShardSpec;
using autotp::test::worker_expect_close;
using autotp::test::worker_expect_equal;

constexpr double kRtol = 1e-5;  // the parity contract (summation order differs between kernels)
constexpr double kAtol = 1e-6;
constexpr int64_t kIgnore = -100;

// The engine's cut of `dim` (tp_plan's contiguous partition): one segment per
// rank, sizes from split_evenly.
ShardSpec contiguous_split(std::vector<int64_t> shape, int64_t dim, int tp) {
  const std::vector<int64_t> sizes = autotp::split_evenly(shape.at(dim), tp);
  std::vector<std::vector<Segment>> per_rank(tp);
  int64_t start = 0;
  for (int r = 0; r < tp; ++r) {
    WORKER_CHECK(r == 0 || sizes[r] <= sizes[r - 1], "split_evenly not larger first");
    per_rank[r].push_back(Segment{start, sizes[r]});
    start += sizes[r];
  }
  WORKER_CHECK(start == shape.at(dim), "split_evenly sums to ", start, " not ", shape.at(dim));
  return ShardSpec::split(std::move(shape), dim, std::move(per_rank));
}

std::vector<int64_t> extents(const ShardSpec& spec) {
  std::vector<int64_t> out;
  for (int r = 0; r < spec.tp_size(); ++r) out.push_back(spec.local_extent(r));
  return out;
}

int64_t start_of(const ShardSpec& spec, int rank) { return spec.segments(rank).at(0).start; }

// A fresh leaf holding a copy of `full` (or of this rank's shard of it).
torch::Tensor leaf(const torch::Tensor& full) { return full.detach().clone().requires_grad_(); }
torch::Tensor shard_leaf(const ShardSpec& spec, const torch::Tensor& full, int rank) {
  return spec.slice(full.detach(), rank).requires_grad_();
}

std::string tag(const Comm& tp, const std::string& what) {
  return "tp" + std::to_string(tp.size()) + " rank " + std::to_string(tp.rank()) + ": " + what;
}

Comm& tp_comm(autotp::test::WorkerContext& ctx) {
  Comm& tp = ctx.topology(ctx.env.world_size)->tp();
  WORKER_CHECK(tp.size() == ctx.env.world_size, "tp group of size ", tp.size());
  return tp;
}

// ---------------------------------------------------------------- column

void check_column(Comm& tp, bool with_bias, int64_t seed) {
  const int r = tp.rank(), n = tp.size();
  const int64_t in = 7, out = 10;
  torch::manual_seed(seed);
  const torch::Tensor x = torch::randn({2, 3, in});
  const torch::Tensor w = torch::randn({out, in});
  const torch::Tensor b = torch::randn({out});
  const torch::Tensor g = torch::randn({2, 3, out});  // upstream gradient of y
  const std::string what = with_bias ? "column+bias " : "column ";

  auto x_ref = leaf(x), w_ref = leaf(w), b_ref = leaf(b);
  auto y_ref = F::linear(x_ref, w_ref, with_bias ? b_ref : torch::Tensor());
  (y_ref * g).sum().backward();

  const ShardSpec w_spec = contiguous_split({out, in}, 0, n);
  const ShardSpec b_spec = contiguous_split({out}, 0, n);
  const ShardSpec y_spec = contiguous_split({2, 3, out}, 2, n);
  auto x_tp = leaf(x);
  auto w_local = shard_leaf(w_spec, w, r);
  auto b_local = shard_leaf(b_spec, b, r);
  auto y_local = autotp::column_parallel_linear(x_tp, w_local, with_bias ? b_local : torch::Tensor(), tp);
  (y_local * y_spec.slice(g, r)).sum().backward();

  worker_expect_close(y_local, y_spec.slice(y_ref.detach(), r), kRtol, kAtol, tag(tp, what + "output slice"));
  worker_expect_close(x_tp.grad(), x_ref.grad(), kRtol, kAtol, tag(tp, what + "input grad (all-reduced)"));
  worker_expect_close(w_local.grad(), w_spec.slice(w_ref.grad(), r), kRtol, kAtol,
                      tag(tp, what + "weight grad"));
  if (with_bias) {
    worker_expect_close(b_local.grad(), b_spec.slice(b_ref.grad(), r), kRtol, kAtol,
                        tag(tp, what + "bias grad"));
  } else {
    WORKER_CHECK(!b_local.grad().defined(), "unused bias got a gradient");
  }
}

AUTOTP_WORKER(column_parallel) {
  Comm& tp = tp_comm(ctx);
  check_column(tp, /*with_bias=*/true, 1234);
  check_column(tp, /*with_bias=*/false, 99);
}

// ---------------------------------------------------------------- row

void check_row(Comm& tp, bool with_bias, int64_t seed) {
  const int r = tp.rank(), n = tp.size();
  const int64_t in = 10, out = 7;
  torch::manual_seed(seed);
  const torch::Tensor x = torch::randn({2, 3, in});
  const torch::Tensor w = torch::randn({out, in});
  const torch::Tensor b = torch::randn({out});
  const torch::Tensor g = torch::randn({2, 3, out});
  const std::string what = with_bias ? "row+bias " : "row ";

  auto x_ref = leaf(x), w_ref = leaf(w), b_ref = leaf(b);
  auto y_ref = F::linear(x_ref, w_ref, with_bias ? b_ref : torch::Tensor());
  (y_ref * g).sum().backward();

  const ShardSpec x_spec = contiguous_split({2, 3, in}, 2, n);
  const ShardSpec w_spec = contiguous_split({out, in}, 1, n);
  auto x_local = shard_leaf(x_spec, x, r);
  auto w_local = shard_leaf(w_spec, w, r);
  auto b_tp = leaf(b);  // replicated
  auto y = autotp::row_parallel_linear(x_local, w_local, with_bias ? b_tp : torch::Tensor(), tp);
  (y * g).sum().backward();

  // A bias added before the reduce would show up tp times here.
  worker_expect_close(y, y_ref.detach(), kRtol, kAtol, tag(tp, what + "output (full)"));
  worker_expect_close(x_local.grad(), x_spec.slice(x_ref.grad(), r), kRtol, kAtol,
                      tag(tp, what + "input grad slice"));
  worker_expect_close(tp.all_gather(x_local.grad(), 2, extents(x_spec)), x_ref.grad(), kRtol, kAtol,
                      tag(tp, what + "input grad gathered"));
  worker_expect_close(w_local.grad(), w_spec.slice(w_ref.grad(), r), kRtol, kAtol,
                      tag(tp, what + "weight grad"));
  if (with_bias) {
    worker_expect_close(b_tp.grad(), b_ref.grad(), kRtol, kAtol, tag(tp, what + "bias grad (full)"));
  } else {
    WORKER_CHECK(!b_tp.grad().defined(), "unused bias got a gradient");
  }
}

AUTOTP_WORKER(row_parallel) {
  Comm& tp = tp_comm(ctx);
  check_row(tp, /*with_bias=*/true, 4321);
  check_row(tp, /*with_bias=*/false, 7);
}

// ------------------------------------------- q/k/v columns, o row, residual

// x -> q, k, v (three column layers on one input) -> h = q * tanh(k) + v
// (elementwise on the local shard) -> o (row) -> out = x + o. The gradient of x
// is the residual's plus one all-reduced contribution per column layer.
AUTOTP_WORKER(attention_like_block) {
  Comm& tp = tp_comm(ctx);
  const int r = tp.rank(), n = tp.size();
  const int64_t hidden = 7, inner = 10;
  torch::manual_seed(2024);
  const torch::Tensor x0 = torch::randn({2, 3, hidden});
  std::vector<torch::Tensor> w, b;  // q, k, v, o
  for (int i = 0; i < 3; ++i) {
    w.push_back(torch::randn({inner, hidden}) * 0.5);
    b.push_back(torch::randn({inner}));
  }
  w.push_back(torch::randn({hidden, inner}) * 0.5);
  b.push_back(torch::randn({hidden}));
  const torch::Tensor g = torch::randn({2, 3, hidden});

  // Reference.
  auto x0_ref = leaf(x0);
  std::vector<torch::Tensor> w_ref, b_ref;
  for (int i = 0; i < 4; ++i) {
    w_ref.push_back(leaf(w[i]));
    b_ref.push_back(leaf(b[i]));
  }
  auto x_ref = x0_ref * 1.5;  // not a leaf: the gradient must flow on through x
  auto q = F::linear(x_ref, w_ref[0], b_ref[0]);
  auto k = F::linear(x_ref, w_ref[1], b_ref[1]);
  auto v = F::linear(x_ref, w_ref[2], b_ref[2]);
  auto out_ref = x_ref + F::linear(q * torch::tanh(k) + v, w_ref[3], b_ref[3]);
  (out_ref * g).sum().backward();

  // Sharded.
  const ShardSpec col_w = contiguous_split({inner, hidden}, 0, n);
  const ShardSpec col_b = contiguous_split({inner}, 0, n);
  const ShardSpec row_w = contiguous_split({hidden, inner}, 1, n);
  auto x0_tp = leaf(x0);
  std::vector<torch::Tensor> w_tp, b_tp;
  for (int i = 0; i < 3; ++i) {
    w_tp.push_back(shard_leaf(col_w, w[i], r));
    b_tp.push_back(shard_leaf(col_b, b[i], r));
  }
  w_tp.push_back(shard_leaf(row_w, w[3], r));
  b_tp.push_back(leaf(b[3]));
  auto x_tp = x0_tp * 1.5;
  auto q_l = autotp::column_parallel_linear(x_tp, w_tp[0], b_tp[0], tp);
  auto k_l = autotp::column_parallel_linear(x_tp, w_tp[1], b_tp[1], tp);
  auto v_l = autotp::column_parallel_linear(x_tp, w_tp[2], b_tp[2], tp);
  auto out = x_tp + autotp::row_parallel_linear(q_l * torch::tanh(k_l) + v_l, w_tp[3], b_tp[3], tp);
  (out * g).sum().backward();

  worker_expect_close(out, out_ref.detach(), kRtol, kAtol, tag(tp, "block output"));
  worker_expect_close(x0_tp.grad(), x0_ref.grad(), kRtol, kAtol, tag(tp, "block input grad"));
  const char* names[] = {"q", "k", "v", "o"};
  for (int i = 0; i < 3; ++i) {
    worker_expect_close(w_tp[i].grad(), col_w.slice(w_ref[i].grad(), r), kRtol, kAtol,
                        tag(tp, std::string(names[i]) + " weight grad"));
    worker_expect_close(b_tp[i].grad(), col_b.slice(b_ref[i].grad(), r), kRtol, kAtol,
                        tag(tp, std::string(names[i]) + " bias grad"));
  }
  worker_expect_close(w_tp[3].grad(), row_w.slice(w_ref[3].grad(), r), kRtol, kAtol,
                      tag(tp, "o weight grad"));
  worker_expect_close(b_tp[3].grad(), b_ref[3].grad(), kRtol, kAtol, tag(tp, "o bias grad"));
}

// ---------------------------------------------------------------- embedding

AUTOTP_WORKER(vocab_parallel_embedding) {
  Comm& tp = tp_comm(ctx);
  const int r = tp.rank(), n = tp.size();
  const int64_t vocab = 13, hidden = 5;
  torch::manual_seed(77);
  const torch::Tensor w = torch::randn({vocab, hidden});
  // Every id once (so every rank's range is hit) plus repeats, shuffled.
  torch::Tensor ids = torch::cat({torch::arange(vocab), torch::tensor({0, 12, 5, 5, 3}, torch::kInt64)});
  ids = ids.index_select(0, torch::randperm(ids.size(0))).reshape({3, 6});
  const torch::Tensor g = torch::randn({3, 6, hidden});

  auto w_ref = leaf(w);
  auto y_ref = torch::embedding(w_ref, ids);
  (y_ref * g).sum().backward();

  const ShardSpec spec = contiguous_split({vocab, hidden}, 0, n);
  const int64_t start = start_of(spec, r), rows = spec.local_extent(r);
  WORKER_CHECK(((ids >= start) & (ids < start + rows)).any().item<bool>(), "no id in rank ", r, "'s range");
  auto w_local = shard_leaf(spec, w, r);
  auto y = autotp::vocab_parallel_embedding(ids, w_local, start, tp);
  (y * g).sum().backward();

  worker_expect_close(y, y_ref.detach(), kRtol, kAtol, tag(tp, "embedding output (full)"));
  worker_expect_close(w_local.grad(), spec.slice(w_ref.grad(), r), kRtol, kAtol,
                      tag(tp, "embedding weight grad"));
}

// ---------------------------------------------------------------- cross-entropy

void check_cross_entropy(Comm& tp, double scale, double offset, int64_t seed, const std::string& name) {
  const int r = tp.rank(), n = tp.size();
  const int64_t vocab = 13;
  torch::manual_seed(seed);
  // Every class once (every rank's range) plus a repeat and ignored entries, shuffled.
  torch::Tensor targets =
      torch::cat({torch::arange(vocab), torch::tensor({kIgnore, int64_t{5}, kIgnore}, torch::kInt64)});
  targets = targets.index_select(0, torch::randperm(targets.size(0)));
  const int64_t tokens = targets.size(0);
  const torch::Tensor logits = torch::randn({tokens, vocab}) * scale + offset;
  const torch::Tensor g = torch::randn({tokens});  // upstream gradient of the per-token loss
  const torch::Tensor valid = targets != kIgnore;
  const std::string what = "cross-entropy " + name + " ";

  const ShardSpec spec = contiguous_split({tokens, vocab}, 1, n);
  const int64_t start = start_of(spec, r), cols = spec.local_extent(r);
  WORKER_CHECK(((targets >= start) & (targets < start + cols)).any().item<bool>(), "no target in rank ", r,
               "'s range");

  // Per-token loss (reduction none) with a weighted backward.
  {
    auto l_ref = leaf(logits);
    auto loss_ref = F::cross_entropy(
        l_ref, targets, F::CrossEntropyFuncOptions().ignore_index(kIgnore).reduction(torch::kNone));
    (loss_ref * g).sum().backward();

    auto l_local = shard_leaf(spec, logits, r);
    auto loss = autotp::vocab_parallel_cross_entropy(l_local, targets, start, tp);
    WORKER_CHECK(loss.scalar_type() == torch::kFloat32, "loss dtype ", loss.scalar_type());
    WORKER_CHECK(torch::isfinite(loss).all().item<bool>(), what, "loss not finite: ", loss);
    (loss * g).sum().backward();

    worker_expect_close(loss, loss_ref.detach(), kRtol, kAtol, tag(tp, what + "per-token loss"));
    worker_expect_equal(loss.masked_select(~valid), torch::zeros({tokens - valid.sum().item<int64_t>()}),
                        tag(tp, what + "ignored loss"));
    worker_expect_close(l_local.grad(), spec.slice(l_ref.grad(), r), kRtol, kAtol,
                        tag(tp, what + "logits grad slice (weighted)"));
    worker_expect_equal(l_local.grad().index({~valid}),
                        torch::zeros({tokens - valid.sum().item<int64_t>(), cols}),
                        tag(tp, what + "logits grad of ignored rows"));
  }
  // Mean over the non-ignored tokens.
  {
    auto l_ref = leaf(logits);
    auto mean_ref = F::cross_entropy(
        l_ref, targets, F::CrossEntropyFuncOptions().ignore_index(kIgnore).reduction(torch::kMean));
    mean_ref.backward();

    auto l_local = shard_leaf(spec, logits, r);
    auto mean = autotp::vocab_parallel_cross_entropy(l_local, targets, start, tp).sum() / valid.sum();
    mean.backward();

    worker_expect_close(mean, mean_ref.detach(), kRtol, kAtol, tag(tp, what + "mean loss"));
    worker_expect_close(l_local.grad(), spec.slice(l_ref.grad(), r), kRtol, kAtol,
                        tag(tp, what + "logits grad slice (mean)"));
  }
}

AUTOTP_WORKER(vocab_parallel_cross_entropy) {
  Comm& tp = tp_comm(ctx);
  check_cross_entropy(tp, 1.0, 0.0, 11, "unit");
  // Logits around 1e3: exp overflows fp32 unless the (global) max is subtracted.
  torch::manual_seed(12);
  WORKER_CHECK(!torch::isfinite((torch::randn({4, 13}) * 3.0 + 1000.0).exp().sum(1)).any().item<bool>(),
               "the large-logit case would not overflow a naive exp");
  check_cross_entropy(tp, 3.0, 1000.0, 12, "offset 1e3");
  // Spread ~1e3: each row's max sits on some rank and the others underflow.
  check_cross_entropy(tp, 1000.0, 0.0, 13, "spread 1e3");
}

}  // namespace

class ParallelLayers : public ::testing::TestWithParam<int> {};

AUTOTP_WORKER_TEST_P(ParallelLayers, ColumnParallelLinear, column_parallel)
AUTOTP_WORKER_TEST_P(ParallelLayers, RowParallelLinear, row_parallel)
AUTOTP_WORKER_TEST_P(ParallelLayers, TwoColumnsThenRowSumInputGrad, attention_like_block)
AUTOTP_WORKER_TEST_P(ParallelLayers, VocabParallelEmbedding, vocab_parallel_embedding)
AUTOTP_WORKER_TEST_P(ParallelLayers, VocabParallelCrossEntropy, vocab_parallel_cross_entropy)

INSTANTIATE_TEST_SUITE_P(TpSizes, ParallelLayers, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "tp" + std::to_string(info.param);
                         });
