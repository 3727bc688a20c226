// Compute limits and single-rank layer costs at the shapes of a training step.
// Counters: FLOP/s (GEMM) and bytes/s (copy). Run with --benchmark_format=json.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "autotp/comm/comm.h"
#include "autotp/tp/parallel_layers.h"

namespace {

// fp32 GEMM [m, k] x [k, n]: the compute limit of this machine for the thread count set by --threads.
void BM_Gemm(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(1)));
  const int64_t n = state.range(0);
  auto a = torch::randn({n, n}), b = torch::randn({n, n});
  for (auto _ : state) benchmark::DoNotOptimize(torch::matmul(a, b));
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * n * n * n * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Gemm)->ArgsProduct({{256, 512, 1024}, {1, 2}})->Unit(benchmark::kMillisecond)->UseRealTime();

// Memory copy: the bandwidth limit.
void BM_Copy(benchmark::State& state) {
  at::set_num_threads(1);
  auto src = torch::randn({state.range(0) / 4}), dst = torch::empty_like(src);
  for (auto _ : state) dst.copy_(src);
  state.counters["bytes/s"] = benchmark::Counter(2.0 * state.range(0) * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Copy)->Arg(1 << 20)->Arg(64 << 20)->UseRealTime();

// Column-parallel linear forward + backward at the shard width of tp = range(1) (one rank's work).
void BM_ColumnLinearShard(benchmark::State& state) {
  at::set_num_threads(1);
  const int64_t hidden = 512, tokens = 1024, tp = state.range(0);
  autotp::Comm self;
  auto x = torch::randn({tokens, hidden}, torch::requires_grad());
  auto w = torch::randn({4 * hidden / tp, hidden}, torch::requires_grad());
  for (auto _ : state) {
    auto y = autotp::column_parallel_linear(x, w, torch::Tensor(), self);
    y.sum().backward();
  }
  state.counters["FLOP/s"] = benchmark::Counter(6.0 * tokens * hidden * (4 * hidden / tp) * state.iterations(),
                                                benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ColumnLinearShard)->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
