// The shared-memory transport, the comm lane and Comm with one thread per rank in
// one process: every member maps the same segment, so ThreadSanitizer (which
// cannot see between processes) checks the slots' hand-over between ranks and
// the lane's hand-over between a rank's thread and its lane thread. tools/sanitize
// builds this file alone with -fsanitize=thread (label tsan in build-tsan); in the
// normal build it is a unit test. Results are checked against closed forms: rank r
// contributes value(r, i) at element i, distinct per rank and element.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "autotp/comm/comm.h"
#include "autotp/comm/comm_lane.h"
#include "autotp/comm/shared_memory_transport.h"

namespace autotp {
namespace {

// 256-byte slots: 64 floats, 32 doubles per chunk, so most sizes below take several chunks.
constexpr int64_t kSlotBytes = 256;

// Small integers (exact in bfloat16 when `small`), different for every rank and
// element, and not ordered by rank (max and min pick different ranks per element).
double value(int rank, int64_t i, int64_t round, bool small = false) {
  if (small) return static_cast<double>((rank + 1) * 4 + (i + round) % 8);
  const int64_t wave = (i * 7 + round * 3 + rank * 5) % 13;
  return static_cast<double>((rank + 1) * 1000 + (rank % 2 ? -wave : wave) * 10 + i % 10);
}

torch::Tensor contribution(int rank, int64_t n, int64_t round, torch::ScalarType dtype, bool small = false) {
  auto t = torch::empty({n}, torch::kFloat64);
  auto* p = t.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) p[i] = value(rank, i, round, small);
  return t.to(dtype);
}

// What every rank should hold after reducing value(., i) over `size` ranks.
torch::Tensor expected_reduce(int size, int64_t n, int64_t round, ReduceOp op, bool small = false) {
  auto t = torch::empty({n}, torch::kFloat64);
  auto* p = t.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    double acc = value(0, i, round, small);
    for (int r = 1; r < size; ++r) {
      const double v = value(r, i, round, small);
      acc = op == ReduceOp::kSum ? acc + v : op == ReduceOp::kMax ? std::max(acc, v) : std::min(acc, v);
    }
    p[i] = acc;
  }
  return t;
}

// Runs body(rank, transport) on `size` threads that meet in one HashStore; the
// first failure of any rank is rethrown here (after every thread has ended).
void run_ranks(int size, const std::function<void(int, SharedMemoryTransport&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mutex;
  std::string failure;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        SharedMemoryOptions options;
        options.slot_bytes = kSlotBytes;
        options.timeout = std::chrono::seconds(120);
        auto transport = SharedMemoryTransport::create(store, rank, size, options);
        if (!transport) throw std::runtime_error("no shared-memory transport (is /dev/shm writable?)");
        body(rank, *transport);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mutex);
        if (failure.empty()) failure = "rank " + std::to_string(rank) + ": " + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!failure.empty()) FAIL() << failure;
}

// Throws (on the rank's thread) when `got` differs from `want` anywhere.
void check_equal(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  const auto g = got.to(torch::kFloat64), w = want.to(torch::kFloat64);
  if (g.sizes() != w.sizes() || !torch::equal(g, w)) {
    const int64_t bad = g.sizes() == w.sizes() ? g.ne(w).nonzero().flatten()[0].item<int64_t>() : -1;
    throw std::runtime_error(what + ": mismatch" +
                             (bad >= 0 ? " at element " + std::to_string(bad) + ": got " +
                                             std::to_string(g[bad].item<double>()) + ", want " +
                                             std::to_string(w[bad].item<double>())
                                       : " of shape"));
  }
}

// Element counts: empty, one, around a 64-element (fp32) slot, several chunks.
const std::vector<int64_t> kSizes = {0, 1, 31, 63, 64, 65, 200, 1000};

class SharedMemoryThreads : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    // Torch's own intra-op threads (uninstrumented) stay out of the ThreadSanitizer run.
    torch::set_num_threads(1);
  }
};

TEST_P(SharedMemoryThreads, AllReduceSumMaxMin) {
  const int size = GetParam();
  run_ranks(size, [&](int rank, SharedMemoryTransport& shm) {
    int64_t round = 0;
    for (int repeat = 0; repeat < 3; ++repeat) {
      for (const auto dtype : {torch::kFloat32, torch::kFloat64, torch::kInt32, torch::kInt64}) {
        for (const int64_t n : kSizes) {
          for (const auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
            ++round;
            auto t = contribution(rank, n, round, dtype);
            shm.all_reduce(t, op);
            check_equal(t, expected_reduce(size, n, round, op),
                        "all_reduce n=" + std::to_string(n) + " round " + std::to_string(round));
          }
        }
      }
    }
  });
}

TEST_P(SharedMemoryThreads, ReduceScatterRanges) {
  const int size = GetParam();
  run_ranks(size, [&](int rank, SharedMemoryTransport& shm) {
    int64_t round = 0;
    for (int repeat = 0; repeat < 2; ++repeat) {
      for (const int64_t n : kSizes) {
        for (const auto dtype : {torch::kFloat32, torch::kFloat64, torch::kInt64, torch::kBFloat16}) {
          ++round;
          const bool small = dtype == torch::kBFloat16;
          // Uneven ranges: rank r takes [begin, begin + length) of a split that
          // gives the last rank the rest (possibly empty ranges for small n).
          const int64_t base = n / size;
          const int64_t begin = base * rank, length = rank == size - 1 ? n - begin : base;
          const auto full = contribution(rank, n, round, dtype, small);
          const auto want = expected_reduce(size, n, round, ReduceOp::kSum, small).narrow(0, begin, length);
          const std::string what = "reduce_scatter n=" + std::to_string(n) + " round " + std::to_string(round);
          auto got = shm.reduce_scatter(full, begin, length);
          if (small && got.scalar_type() != torch::kFloat32) throw std::runtime_error(what + ": 16-bit not widened");
          check_equal(got, want, what);
          // The same into a given output.
          ++round;
          const auto full2 = contribution(rank, n, round, dtype, small);
          auto out = torch::full({length}, -1, got.options());
          shm.reduce_scatter(full2, begin, length, out);
          check_equal(out, expected_reduce(size, n, round, ReduceOp::kSum, small).narrow(0, begin, length),
                      what + " (out)");
        }
      }
    }
  });
}

TEST_P(SharedMemoryThreads, AllGatherBlocks) {
  const int size = GetParam();
  run_ranks(size, [&](int rank, SharedMemoryTransport& shm) {
    int64_t round = 0;
    for (int repeat = 0; repeat < 3; ++repeat) {
      for (const int64_t n : kSizes) {
        for (const auto dtype : {torch::kFloat32, torch::kFloat64, torch::kInt32, torch::kBFloat16}) {
          ++round;
          const bool small = dtype == torch::kBFloat16;
          std::vector<torch::Tensor> blocks;
          for (int r = 0; r < size; ++r) blocks.push_back(contribution(r, n, round, dtype, small));
          const auto want = torch::cat(blocks);
          const std::string what = "all_gather n=" + std::to_string(n) + " round " + std::to_string(round);
          auto out = torch::full({size * n}, -1, torch::TensorOptions().dtype(dtype));
          shm.all_gather(contribution(rank, n, round, dtype, small), out);
          check_equal(out, want, what);
          // In place: this rank's block of the output is the input.
          auto in_place = torch::full({size * n}, -1, torch::TensorOptions().dtype(dtype));
          in_place.narrow(0, rank * n, n).copy_(blocks[rank]);
          auto own = in_place.narrow(0, rank * n, n);
          shm.all_gather(own, in_place);
          check_equal(in_place, want, what + " (in place)");
        }
      }
    }
  });
}

// The three collectives interleaved, so consecutive generations use different ops.
TEST_P(SharedMemoryThreads, MixedSequence) {
  const int size = GetParam();
  run_ranks(size, [&](int rank, SharedMemoryTransport& shm) {
    for (int64_t round = 1; round <= 60; ++round) {
      const int64_t n = kSizes[round % kSizes.size()] + size;  // at least one element per rank
      const std::string what = "round " + std::to_string(round);
      switch (round % 3) {
        case 0: {
          auto t = contribution(rank, n, round, torch::kFloat32);
          shm.all_reduce(t, ReduceOp::kSum);
          check_equal(t, expected_reduce(size, n, round, ReduceOp::kSum), what);
          break;
        }
        case 1: {
          const int64_t begin = n * rank / size, end = n * (rank + 1) / size;
          auto got = shm.reduce_scatter(contribution(rank, n, round, torch::kFloat32), begin, end - begin);
          check_equal(got, expected_reduce(size, n, round, ReduceOp::kSum).narrow(0, begin, end - begin), what);
          break;
        }
        default: {
          auto out = torch::empty({size * n}, torch::kFloat32);
          shm.all_gather(contribution(rank, n, round, torch::kFloat32), out);
          for (int r = 0; r < size; ++r)
            check_equal(out.narrow(0, r * n, n), contribution(r, n, round, torch::kFloat32), what);
        }
      }
    }
  });
}

// Comm over the transport: started collectives run on each rank's lane thread
// while the rank's thread starts more and mixes in blocking ones (which wait
// for the lane first). The process group is a bare c10d::ProcessGroup: every
// collective used here goes through shared memory.
TEST_P(SharedMemoryThreads, CommLaneOverSharedMemory) {
  const int size = GetParam();
  run_ranks(size, [&](int rank, SharedMemoryTransport& shm) {
    auto transport = std::shared_ptr<SharedMemoryTransport>(&shm, [](SharedMemoryTransport*) {});
    std::vector<int> global_ranks(size);
    for (int r = 0; r < size; ++r) global_ranks[r] = r;
    Comm comm(c10::make_intrusive<c10d::ProcessGroup>(rank, size), global_ranks, "tp");
    comm.use_shared_memory(transport);
    for (int64_t round = 1; round <= 12; ++round) {
      const int64_t rows = size * (round % 4 + 1), cols = 37;
      const int64_t n = rows * cols;
      const std::string what = "round " + std::to_string(round);
      // Started: all-reduce, all-gather into, reduce-scatter into, row gather and scatter.
      auto reduced = contribution(rank, n, round, torch::kFloat32);
      CommWork w1 = comm.start_all_reduce(reduced);
      auto gathered = torch::empty({size * n}, torch::kFloat32);
      const auto local = contribution(rank, n, round + 100, torch::kFloat32);
      CommWork w2 = comm.start_all_gather_into(gathered, local);
      auto scattered = torch::empty({n / size}, torch::kFloat32);
      const auto full = contribution(rank, n, round + 200, torch::kFloat32);
      CommWork w3 = comm.start_reduce_scatter_into(scattered, full);
      torch::Tensor rows_gathered, rows_scattered;
      const auto row_local = contribution(rank, cols * (rank + 1), round + 300, torch::kFloat32).view({rank + 1, cols});
      std::vector<int64_t> row_sizes(size);
      for (int r = 0; r < size; ++r) row_sizes[r] = r + 1;
      CommWork w4 = comm.start_all_gather(rows_gathered, row_local, 0, row_sizes);
      const auto row_full = contribution(rank, n, round + 400, torch::kFloat32).view({rows, cols});
      CommWork w5 = comm.start_reduce_scatter(rows_scattered, row_full);
      // A blocking all-reduce behind them (waits for the lane), then the waits out of order.
      auto blocking = contribution(rank, 129, round + 500, torch::kFloat64);
      comm.all_reduce(blocking, ReduceOp::kMax);
      w3.wait();
      w1.wait();
      w5.wait();
      w2.wait();
      w4.wait();
      check_equal(reduced, expected_reduce(size, n, round, ReduceOp::kSum), what + " start_all_reduce");
      std::vector<torch::Tensor> blocks, row_blocks;
      for (int r = 0; r < size; ++r) {
        blocks.push_back(contribution(r, n, round + 100, torch::kFloat32));
        row_blocks.push_back(contribution(r, cols * (r + 1), round + 300, torch::kFloat32));
      }
      check_equal(gathered, torch::cat(blocks), what + " start_all_gather_into");
      const int64_t chunk = n / size;
      check_equal(scattered, expected_reduce(size, n, round + 200, ReduceOp::kSum).narrow(0, rank * chunk, chunk),
                  what + " start_reduce_scatter_into");
      check_equal(rows_gathered.flatten(), torch::cat(row_blocks), what + " start_all_gather (uneven rows)");
      const int64_t rows_each = rows / size;
      check_equal(rows_scattered.flatten(),
                  expected_reduce(size, n, round + 400, ReduceOp::kSum).narrow(0, rank * rows_each * cols,
                                                                               rows_each * cols),
                  what + " start_reduce_scatter");
      check_equal(blocking, expected_reduce(size, 129, round + 500, ReduceOp::kMax), what + " all_reduce max");
    }
    comm.wait_all();
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, SharedMemoryThreads, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return "n" + std::to_string(info.param); });

// The lane alone: jobs posted from several threads run one at a time in order,
// drain() and idle() from other threads, a failed job fails the later ones.
TEST(CommLaneThreads, PostDrainAndFailureFromManyThreads) {
  CommLane lane;
  std::atomic<int> running{0};
  std::vector<int> order;  // written only by lane jobs
  std::mutex posted_mutex;
  std::vector<int> posted;
  std::vector<std::shared_ptr<LaneJob>> jobs;
  std::vector<std::thread> posters;
  for (int t = 0; t < 4; ++t) {
    posters.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        const int id = t * 1000 + i;
        std::lock_guard<std::mutex> lock(posted_mutex);  // order of posting = order of `posted`
        posted.push_back(id);
        jobs.push_back(lane.post([&, id] {
          if (running.fetch_add(1) != 0) throw std::runtime_error("two jobs at once");
          order.push_back(id);
          running.fetch_sub(1);
        }));
      }
      lane.drain();
      (void)lane.idle();
    });
  }
  for (auto& t : posters) t.join();
  lane.drain();
  EXPECT_TRUE(lane.idle());
  for (auto& job : jobs) {
    EXPECT_TRUE(job->finished());
    EXPECT_NO_THROW(job->wait());
  }
  EXPECT_EQ(order, posted);

  auto failed = lane.post([] { throw std::runtime_error("broken group"); });
  auto later = lane.post([] {});
  std::thread waiter([&] { EXPECT_THROW(later->wait(), std::runtime_error); });
  EXPECT_THROW(failed->wait(), std::runtime_error);
  waiter.join();
  try {
    later->wait();
    FAIL() << "a job after a failure ran";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("broken group"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace autotp
