// Safetensors load throughput against plain file reads of the same file (warm
// page cache: what a rank sees when the checkpoint was just written or read).
// The file holds 16 fp32 tensors of [1024, 2048] (128 MiB). bytes/s counts the
// tensor bytes returned (full: all of them; sliced: one tp 2 shard of each, by
// rows (dim 0, contiguous ranges) or by columns (dim 1, strided)).
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "autotp/io/safetensors.h"

namespace {

constexpr int kTensors = 16;
constexpr int64_t kRows = 1024, kCols = 2048;

const std::string& bench_file() {
  static const std::string path = [] {
    std::string p = "/tmp/autotp-bench-" + std::to_string(getpid()) + ".safetensors";
    autotp::io::NamedTensors tensors;
    for (int i = 0; i < kTensors; ++i) tensors.emplace_back("t" + std::to_string(i), torch::randn({kRows, kCols}));
    autotp::io::write_safetensors(p, tensors);
    std::atexit([] { std::remove(bench_file().c_str()); });
    return p;
  }();
  return path;
}

constexpr int64_t kTensorBytes = kRows * kCols * 4;

void bytes_counter(benchmark::State& state, double bytes_per_iteration) {
  state.counters["bytes/s"] = benchmark::Counter(bytes_per_iteration * state.iterations(), benchmark::Counter::kIsRate);
}

// read(2) of the whole file into one buffer: the baseline.
void BM_PlainFileRead(benchmark::State& state) {
  const std::string& path = bench_file();
  std::vector<char> buffer(static_cast<size_t>(kTensors * kTensorBytes + (1 << 20)));
  int64_t total = 0;
  for (auto _ : state) {
    const int fd = open(path.c_str(), O_RDONLY);
    total = 0;
    ssize_t n;
    while ((n = read(fd, buffer.data() + total, buffer.size() - total)) > 0) total += n;
    close(fd);
    benchmark::DoNotOptimize(buffer.data());
  }
  bytes_counter(state, static_cast<double>(total));
}
BENCHMARK(BM_PlainFileRead)->Unit(benchmark::kMillisecond)->UseRealTime();

// Open (map + header) and read every tensor.
void BM_SafetensorsFullRead(benchmark::State& state) {
  const std::string& path = bench_file();
  for (auto _ : state) {
    auto file = autotp::io::SafetensorsFile::open(path);
    for (const auto& info : file->tensors()) benchmark::DoNotOptimize(file->read(info.name).data_ptr());
  }
  bytes_counter(state, static_cast<double>(kTensors * kTensorBytes));
}
BENCHMARK(BM_SafetensorsFullRead)->Unit(benchmark::kMillisecond)->UseRealTime();

// One tp 2 shard of every tensor: rows (range(0) = 0) or columns (range(0) = 1).
void BM_SafetensorsSlicedRead(benchmark::State& state) {
  const std::string& path = bench_file();
  const int64_t dim = state.range(0), extent = dim == 0 ? kRows : kCols;
  for (auto _ : state) {
    auto file = autotp::io::SafetensorsFile::open(path);
    for (const auto& info : file->tensors())
      benchmark::DoNotOptimize(file->read_slice(info.name, dim, extent / 2, extent / 2).data_ptr());
  }
  bytes_counter(state, static_cast<double>(kTensors * kTensorBytes / 2));
}
BENCHMARK(BM_SafetensorsSlicedRead)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
