// The engine's own collective code on a one-rank group that does not take the
// size-1 shortcut (Comm::communicate_alone): every blocking and started form
// (all-reduce, all-gather, reduce-scatter, their _into forms, the lane) and
// ZeRO's UnitCollectives. NCCL (CUDA tensors) is the point: the GPU machines
// this project can use have one GPU, where NCCL takes one rank, so this is what
// proves its paths run; it skips with a message without a GPU. The same body
// over Gloo with CPU tensors runs everywhere. Groups time out after 20 s, under
// ctest's 45 s, so a stuck collective reports itself instead of being killed.
#include <gtest/gtest.h>

#include <filesystem>
#include <unistd.h>

#include "autotp/base/cuda_runtime.h"
#include "autotp/base/device.h"
#include "autotp/comm/comm.h"
#include "autotp/comm/process_group.h"
#include "autotp/zero/unit_collectives.h"

namespace autotp {
namespace {

struct AloneCase {
  Backend backend;
  torch::ScalarType dtype;
  std::string name() const {
    return std::string(backend == Backend::kNccl ? "Nccl" : "Gloo") + "_" + c10::toString(dtype);
  }
};

void PrintTo(const AloneCase& c, std::ostream* os) { *os << c.name(); }

class CommAlone : public ::testing::TestWithParam<AloneCase> {
 protected:
  void SetUp() override {
    const AloneCase& c = GetParam();
    if (c.backend == Backend::kNccl && cuda_device_count() == 0)
      GTEST_SKIP() << "no GPU here (" << cuda_unavailable_reason() << "): NCCL's paths need one";
    store_path_ = std::filesystem::temp_directory_path() / ("autotp_alone_" + std::to_string(getpid()) + c.name());
    std::filesystem::remove(store_path_);
    auto group = create_process_group(c.backend, create_file_store(store_path_.string(), 1), 0, 1,
                                      std::chrono::seconds(20));
    comm_ = std::make_unique<Comm>(group, std::vector<int>{0}, "alone", c.backend);
    comm_->communicate_alone();
    options_ = torch::TensorOptions().dtype(c.dtype).device(c.backend == Backend::kNccl ? torch::kCUDA : torch::kCPU);
  }
  void TearDown() override {
    comm_.reset();
    if (!store_path_.empty()) std::filesystem::remove(store_path_);
  }
  torch::Tensor values(int64_t n, double first = 1) const {
    return torch::arange(first, first + static_cast<double>(n), options_);
  }
  static void expect_equal(const torch::Tensor& got, const torch::Tensor& want, const char* what) {
    EXPECT_TRUE(torch::equal(got.cpu(), want.cpu())) << what << ": " << got.cpu() << " vs " << want.cpu();
  }

  std::filesystem::path store_path_;
  std::unique_ptr<Comm> comm_;
  torch::TensorOptions options_;
};

TEST_P(CommAlone, BlockingCollectivesRunThroughTheGroup) {
  auto t = values(10);
  comm_->all_reduce(t);
  expect_equal(t, values(10), "all_reduce");
  expect_equal(comm_->all_gather(values(6).view({3, 2}), 0), values(6).view({3, 2}), "all_gather");
  auto gathered = torch::empty({7}, options_);
  comm_->all_gather_into(gathered, values(7));
  expect_equal(gathered, values(7), "all_gather_into");
  expect_equal(comm_->reduce_scatter(values(8).view({4, 2})), values(8).view({4, 2}), "reduce_scatter");
  auto scattered = torch::empty({9}, options_);
  comm_->reduce_scatter_into(scattered, values(9, 3));
  expect_equal(scattered, values(9, 3), "reduce_scatter_into");
  auto b = values(5, 2);
  comm_->broadcast(b);
  expect_equal(b, values(5, 2), "broadcast");
  expect_equal(comm_->all_to_all(values(6).view({3, 2}), {3}, {3}), values(6).view({3, 2}), "all_to_all");
  comm_->barrier();
  // Counted: the shortcut returns before the counting.
  EXPECT_EQ(comm_->stats().all_reduce_calls, 1);
  EXPECT_EQ(comm_->stats().all_gather_calls, 2);
  EXPECT_EQ(comm_->stats().reduce_scatter_calls, 2);
  EXPECT_EQ(comm_->stats().all_to_all_calls, 1);
}

TEST_P(CommAlone, StartedCollectivesCompleteAtWait) {
  auto t = values(12);
  CommWork reduce = comm_->start_all_reduce(t);
  torch::Tensor gathered;
  auto local = values(4, 5);
  CommWork gather = comm_->start_all_gather(gathered, local, 0);
  torch::Tensor scattered;
  auto full = values(6, 7).view({3, 2});
  CommWork scatter = comm_->start_reduce_scatter(scattered, full);
  auto into = torch::empty({8}, options_);
  CommWork gather_into = comm_->start_all_gather_into(into, values(8, 9));
  auto chunk = torch::empty({10}, options_);
  CommWork scatter_into = comm_->start_reduce_scatter_into(chunk, values(10, 11));
  for (CommWork* w : {&reduce, &gather, &scatter, &gather_into, &scatter_into}) w->wait();
  comm_->wait_all();
  expect_equal(t, values(12), "start_all_reduce");
  expect_equal(gathered, local, "start_all_gather");
  expect_equal(scattered, full, "start_reduce_scatter");
  expect_equal(into, values(8, 9), "start_all_gather_into");
  expect_equal(chunk, values(10, 11), "start_reduce_scatter_into");
  EXPECT_EQ(comm_->stats().calls(), 5);
}

TEST_P(CommAlone, ZeroUnitCollectivesOverlapped) {
  // Buckets smaller than the unit: several collectives per unit, queued and completed in order.
  UnitCollectives units(*comm_, /*reduce_bucket_elements=*/4, /*gather_bucket_elements=*/5, /*overlap=*/true);
  auto grads = values(11);
  auto part = torch::ones({11}, options_);
  units.push(units.start_reduce_scatter(grads, part, /*accumulate=*/true));
  auto unit = torch::zeros({11}, options_);
  units.push(units.start_all_gather(values(11, 4), unit));
  units.finish(0);
  expect_equal(part, values(11, 2), "reduce-scattered and accumulated");
  expect_equal(unit, values(11, 4), "all-gathered");
  EXPECT_GT(comm_->stats().calls(), 2);
}

INSTANTIATE_TEST_SUITE_P(Backends, CommAlone,
                         ::testing::Values(AloneCase{Backend::kGloo, torch::kFloat32},
                                           AloneCase{Backend::kNccl, torch::kFloat32},
                                           AloneCase{Backend::kNccl, torch::kBFloat16}),
                         [](const auto& info) { return info.param.name(); });

}  // namespace
}  // namespace autotp
