// Compute limits and single-rank layer costs at the shapes of a training step
// of preset:llama-small (hidden 512, intermediate 1376, 8 heads / 4 kv heads of
// 64, vocab 8000; micro-batch 4 x 256 tokens), each layer at the shard shape
// of tp 1, 2 and 4 (one rank's work, no communication). Counters: FLOP/s
// (GEMMs and linear layers), bytes/s (copies), items/s (tokens or parameters).
// bench/README.md defines every number. Run with --benchmark_format=json.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "autotp/comm/comm.h"
#include "autotp/model/attention.h"
#include "autotp/optim/optimizer.h"
#include "autotp/tp/parallel_layers.h"

namespace {

constexpr int64_t kHidden = 512, kIntermediate = 1376, kVocab = 8000, kHeads = 8, kKvHeads = 4, kHeadDim = 64;
constexpr int64_t kBatch = 4, kSeq = 256, kTokens = kBatch * kSeq;

autotp::Comm& self_comm() {
  static autotp::Comm comm;
  return comm;
}

void flops_counter(benchmark::State& state, double flops_per_iteration) {
  state.counters["FLOP/s"] = benchmark::Counter(flops_per_iteration * state.iterations(), benchmark::Counter::kIsRate);
}

// fp32 GEMM [n, n] x [n, n] with range(1) threads: the compute limit.
void BM_Gemm(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(1)));
  const int64_t n = state.range(0);
  auto a = torch::randn({n, n}), b = torch::randn({n, n});
  for (auto _ : state) benchmark::DoNotOptimize(torch::matmul(a, b));
  flops_counter(state, 2.0 * n * n * n);
}
BENCHMARK(BM_Gemm)->ArgsProduct({{256, 512, 1024}, {1, 2}})->Unit(benchmark::kMillisecond)->UseRealTime();

// fp32 GEMM [m, k] x [k, n] at the shapes of a llama-small step (tokens x
// hidden against the q/o, MLP, down and LM-head weights), 1 and 2 threads.
void BM_GemmStepShape(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(3)));
  const int64_t m = state.range(0), k = state.range(1), n = state.range(2);
  auto a = torch::randn({m, k}), b = torch::randn({k, n}), c = torch::empty({m, n});
  for (auto _ : state) torch::matmul_out(c, a, b);
  flops_counter(state, 2.0 * m * k * n);
}
BENCHMARK(BM_GemmStepShape)
    ->ArgsProduct({{kTokens}, {kHidden}, {kHidden, kIntermediate, kVocab}, {1, 2}})
    ->Args({kTokens, kIntermediate, kHidden, 1})
    ->Args({kTokens, kIntermediate, kHidden, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Memory copy of range(0) bytes with range(1) threads: the bandwidth limit
// (bytes/s counts the read and the write).
void BM_Copy(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(1)));
  auto src = torch::randn({state.range(0) / 4}), dst = torch::empty_like(src);
  for (auto _ : state) dst.copy_(src);
  state.counters["bytes/s"] = benchmark::Counter(2.0 * state.range(0) * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Copy)->ArgsProduct({{1 << 20, 64 << 20}, {1, 2}})->UseRealTime();

// Column-parallel linear forward + backward at the shard width of tp = range(0): [tokens, hidden] -> 4 hidden / tp.
void BM_ColumnLinearShard(benchmark::State& state) {
  at::set_num_threads(1);
  const int64_t tp = state.range(0);
  auto x = torch::randn({kTokens, kHidden}, torch::requires_grad());
  auto w = torch::randn({4 * kHidden / tp, kHidden}, torch::requires_grad());
  for (auto _ : state) {
    auto y = autotp::column_parallel_linear(x, w, torch::Tensor(), self_comm());
    y.sum().backward();
  }
  flops_counter(state, 6.0 * kTokens * kHidden * (4 * kHidden / tp));
}
BENCHMARK(BM_ColumnLinearShard)->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();

// Row-parallel linear (the MLP down projection) forward + backward: [tokens, intermediate / tp] -> hidden.
void BM_RowLinearShard(benchmark::State& state) {
  at::set_num_threads(1);
  const int64_t tp = state.range(0), in = kIntermediate / tp;
  auto x = torch::randn({kTokens, in}, torch::requires_grad());
  auto w = torch::randn({kHidden, in}, torch::requires_grad());
  for (auto _ : state) {
    auto y = autotp::row_parallel_linear(x, w, torch::Tensor(), self_comm());
    y.sum().backward();
  }
  flops_counter(state, 6.0 * kTokens * kHidden * in);
}
BENCHMARK(BM_RowLinearShard)->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();

// Fused q/k/v projection (column-parallel, [q | k | v] heads split by tp) forward + backward.
void BM_FusedQkvShard(benchmark::State& state) {
  at::set_num_threads(1);
  const int64_t tp = state.range(0), out = (kHeads + 2 * kKvHeads) * kHeadDim / tp;
  auto x = torch::randn({kTokens, kHidden}, torch::requires_grad());
  auto w = torch::randn({out, kHidden}, torch::requires_grad());
  for (auto _ : state) {
    auto qkv = autotp::column_parallel_linear(x, w, torch::Tensor(), self_comm());
    auto parts = qkv.split({kHeads * kHeadDim / tp, kKvHeads * kHeadDim / tp, kKvHeads * kHeadDim / tp}, -1);
    (parts[0].sum() + parts[1].sum() + parts[2].sum()).backward();
  }
  flops_counter(state, 6.0 * kTokens * kHidden * out);
}
BENCHMARK(BM_FusedQkvShard)->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();

// Vocab-parallel embedding forward + backward on the last vocab shard of tp
// (ids outside the shard are masked; items/s = tokens).
void BM_VocabEmbeddingShard(benchmark::State& state) {
  at::set_num_threads(1);
  const int64_t tp = state.range(0), rows = kVocab / tp, start = (tp - 1) * rows;
  auto ids = torch::randint(kVocab, {kBatch, kSeq}, torch::kLong);
  auto w = torch::randn({rows, kHidden}, torch::requires_grad());
  for (auto _ : state) {
    auto y = autotp::vocab_parallel_embedding(ids, w, start, self_comm());
    y.sum().backward();
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
}
BENCHMARK(BM_VocabEmbeddingShard)->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();

// Vocab-parallel cross-entropy forward + backward over a [tokens, vocab / tp] logits shard (items/s = tokens).
void BM_VocabCrossEntropyShard(benchmark::State& state) {
  at::set_num_threads(1);
  const int64_t tp = state.range(0), columns = kVocab / tp;
  auto logits = torch::randn({kTokens, columns}, torch::requires_grad());
  auto targets = torch::randint(kVocab, {kTokens}, torch::kLong);
  for (auto _ : state) {
    auto loss = autotp::vocab_parallel_cross_entropy(logits, targets, 0, self_comm());
    loss.sum().backward();
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
}
BENCHMARK(BM_VocabCrossEntropyShard)->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();

// Causal attention forward + backward over one rank's heads (8 / tp query
// heads reading 4 / tp kv heads); FLOP/s counts QK^T and PV over the full square.
// Arg 1 selects the eager form (scores materialised) the fused kernel replaced.
void BM_AttentionShard(benchmark::State& state) {
  at::set_num_threads(1);
  const int64_t tp = state.range(0), heads = kHeads / tp, kv_heads = kKvHeads / tp;
  const bool eager = state.range(1) == 1;
  auto q = torch::randn({kBatch, heads, kSeq, kHeadDim}, torch::requires_grad());
  auto k = torch::randn({kBatch, kv_heads, kSeq, kHeadDim}, torch::requires_grad());
  auto v = torch::randn({kBatch, kv_heads, kSeq, kHeadDim}, torch::requires_grad());
  std::vector<int64_t> kv_index;
  for (int64_t h = 0; h < heads; ++h) kv_index.push_back(h / (kHeads / kKvHeads));
  for (auto _ : state) {
    auto out = eager ? autotp::causal_attention_eager(q, k, v, kv_index, 0.125)
                     : autotp::causal_attention(q, k, v, kv_index, 0.125);
    out.sum().backward();
  }
  flops_counter(state, 3.0 * 2.0 * 2.0 * kBatch * heads * kSeq * kSeq * kHeadDim);
}
BENCHMARK(BM_AttentionShard)
    ->ArgNames({"tp", "eager"})
    ->ArgsProduct({{1, 2, 4}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// AdamW step over one flat fp32 buffer of llama-small's parameters / tp
// (items/s = parameters updated).
void BM_AdamWFlat(benchmark::State& state) {
  at::set_num_threads(1);
  const int64_t tp = state.range(0);
  const int64_t numel = (4 * (2 * kHidden * kHidden + 2 * kHidden * kKvHeads * kHeadDim + 3 * kHidden * kIntermediate) +
                         2 * kVocab * kHidden) / tp;
  autotp::OptimizerConfig config;
  config.weight_decay = 0.01;
  autotp::FlatOptimizer optimizer(config, numel);
  auto params = torch::randn({numel}), grads = torch::randn({numel});
  for (auto _ : state) optimizer.step(params, grads, 1e-4);
  state.SetItemsProcessed(state.iterations() * numel);
}
BENCHMARK(BM_AdamWFlat)->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
