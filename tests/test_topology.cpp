// Topology: the rank -> (dp, tp) mapping as pure functions, validation, the
// environment it is built from, and 4-rank runs whose tp / dp group sums have
// closed forms.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>

#include "autotp/base/cuda_runtime.h"
#include "autotp/base/device.h"
#include "autotp/comm/dist_env.h"
#include "autotp/comm/process_group.h"
#include "autotp/comm/topology.h"
#include "autotp/base/error.h"
#include "support/multiprocess.h"

namespace {

using autotp::Topology;

std::string user_error_message(const std::function<void()>& body) {
  try {
    body();
  } catch (const autotp::UserError& error) {
    return error.what();
  }
  return "(no UserError)";
}

// Sets environment variables for one test and restores the previous values.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::map<std::string, std::optional<std::string>>& values) {
    for (const auto& [name, value] : values) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      if (value) {
        setenv(name.c_str(), value->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        setenv(name.c_str(), value->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

const std::map<std::string, std::optional<std::string>> kNoDistEnv = {
    {"RANK", std::nullopt},          {"WORLD_SIZE", std::nullopt},
    {"LOCAL_RANK", std::nullopt},    {"LOCAL_WORLD_SIZE", std::nullopt},
    {"MASTER_ADDR", std::nullopt},   {"MASTER_PORT", std::nullopt},
    {"AUTOTP_THREADS", std::nullopt}};

std::map<std::string, std::optional<std::string>> dist_env_with(
    const std::map<std::string, std::optional<std::string>>& values) {
  auto all = kNoDistEnv;
  for (const auto& [name, value] : values) all[name] = value;
  return all;
}

}  // namespace

TEST(TopologyMapping, World4Tp2) {
  const std::vector<std::pair<int, int>> expected = {{0, 0}, {0, 1}, {1, 0}, {1, 1}};  // (dp, tp) by rank
  for (int rank = 0; rank < 4; ++rank) {
    const auto coords = Topology::coordinates(rank, 2);
    EXPECT_EQ(coords.dp_rank, expected[rank].first) << "rank " << rank;
    EXPECT_EQ(coords.tp_rank, expected[rank].second) << "rank " << rank;
  }
  EXPECT_EQ(Topology::tp_group_ranks(0, 4, 2), (std::vector<int>{0, 1}));
  EXPECT_EQ(Topology::tp_group_ranks(3, 4, 2), (std::vector<int>{2, 3}));
  EXPECT_EQ(Topology::dp_group_ranks(0, 4, 2), (std::vector<int>{0, 2}));
  EXPECT_EQ(Topology::dp_group_ranks(3, 4, 2), (std::vector<int>{1, 3}));
}

TEST(TopologyMapping, EveryLayoutCoversTheWorldOnce) {
  for (int world : {1, 2, 3, 4, 6, 8, 12}) {
    for (int tp = 1; tp <= world; ++tp) {
      if (world % tp != 0) continue;
      for (int rank = 0; rank < world; ++rank) {
        const auto coords = Topology::coordinates(rank, tp);
        EXPECT_EQ(coords.dp_rank * tp + coords.tp_rank, rank);
        const auto tp_ranks = Topology::tp_group_ranks(rank, world, tp);
        const auto dp_ranks = Topology::dp_group_ranks(rank, world, tp);
        ASSERT_EQ(static_cast<int>(tp_ranks.size()), tp);
        ASSERT_EQ(static_cast<int>(dp_ranks.size()), world / tp);
        // A rank sits at its own tp rank in the tp group and its dp rank in the dp group.
        EXPECT_EQ(tp_ranks[coords.tp_rank], rank);
        EXPECT_EQ(dp_ranks[coords.dp_rank], rank);
        for (int member : tp_ranks) EXPECT_EQ(Topology::coordinates(member, tp).dp_rank, coords.dp_rank);
        for (int member : dp_ranks) EXPECT_EQ(Topology::coordinates(member, tp).tp_rank, coords.tp_rank);
      }
    }
  }
  EXPECT_EQ(Topology::tp_group_ranks(5, 8, 4), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(Topology::dp_group_ranks(5, 8, 4), (std::vector<int>{1, 5}));
  EXPECT_EQ(Topology::dp_group_ranks(4, 6, 3), (std::vector<int>{1, 4}));
}

TEST(TopologyValidation, TpSizeMustDivideTheWorld) {
  EXPECT_EQ(user_error_message([] { Topology::validate(4, 3); }),
            "autotp_size 3 does not divide world size 4 (allowed: 1, 2, 4)");
  EXPECT_EQ(user_error_message([] { Topology::validate(4, 0); }),
            "autotp_size 0 does not divide world size 4 (allowed: 1, 2, 4)");
  EXPECT_EQ(user_error_message([] { Topology::validate(4, -2); }),
            "autotp_size -2 does not divide world size 4 (allowed: 1, 2, 4)");
  EXPECT_EQ(user_error_message([] { Topology::validate(6, 12); }),
            "autotp_size 12 does not divide world size 6 (allowed: 1, 2, 3, 6)");
  EXPECT_NO_THROW(Topology::validate(6, 3));
  EXPECT_NO_THROW(Topology::validate(1, 1));
}

TEST(TopologyValidation, CreateChecksBeforeAnyRendezvous) {
  autotp::DistEnv env;
  env.rank = 0;
  env.world_size = 4;
  env.master_port = 1;  // never contacted: validation comes first
  autotp::TopologyOptions options;
  options.tp_size = 3;
  EXPECT_EQ(user_error_message([&] { Topology::create(env, options); }),
            "autotp_size 3 does not divide world size 4 (allowed: 1, 2, 4)");
  options.tp_size = 2;
  env.master_port = 0;
  EXPECT_NE(user_error_message([&] { Topology::create(env, options); }).find("MASTER_PORT"),
            std::string::npos);
}

TEST(TopologySingle, NeedsNoStore) {
  for (const auto& topology : {Topology::single(), Topology::create(autotp::DistEnv{})}) {
    EXPECT_EQ(topology->world_size(), 1);
    EXPECT_EQ(topology->tp_size(), 1);
    EXPECT_EQ(topology->dp_size(), 1);
    EXPECT_EQ(topology->rank(), 0);
    EXPECT_EQ(topology->tp().size(), 1);
    EXPECT_EQ(topology->dp().size(), 1);
    EXPECT_EQ(topology->tp().name(), "tp");
    EXPECT_EQ(topology->dp().global_ranks(), std::vector<int>{0});
    torch::Tensor x = torch::arange(3, torch::kFloat32);
    topology->tp().all_reduce(x);
    topology->dp().all_reduce(x);
    topology->world().barrier();
    EXPECT_TRUE(torch::equal(x, torch::arange(3, torch::kFloat32)));
  }
  autotp::TopologyOptions options;
  options.tp_size = 2;
  EXPECT_THROW(Topology::create(autotp::DistEnv{}, options), autotp::UserError);
}

TEST(DistEnvParsing, NoVariablesIsRankZeroOfOne) {
  ScopedEnv env(kNoDistEnv);
  const auto dist = autotp::DistEnv::from_environment();
  EXPECT_EQ(dist.rank, 0);
  EXPECT_EQ(dist.world_size, 1);
  EXPECT_EQ(dist.local_rank, 0);
  EXPECT_EQ(dist.local_world_size, 1);
  EXPECT_EQ(dist.master_addr, "127.0.0.1");
  EXPECT_EQ(dist.master_port, 0);
  EXPECT_EQ(dist.threads, 0);
}

TEST(DistEnvParsing, ReadsTorchrunVariables) {
  ScopedEnv env(dist_env_with({{"RANK", "5"},
                               {"WORLD_SIZE", "8"},
                               {"LOCAL_RANK", "1"},
                               {"LOCAL_WORLD_SIZE", "4"},
                               {"MASTER_ADDR", "10.0.0.7"},
                               {"MASTER_PORT", "29511"},
                               {"AUTOTP_THREADS", "3"}}));
  const auto dist = autotp::DistEnv::from_environment();
  EXPECT_EQ(dist.rank, 5);
  EXPECT_EQ(dist.world_size, 8);
  EXPECT_EQ(dist.local_rank, 1);
  EXPECT_EQ(dist.local_world_size, 4);
  EXPECT_EQ(dist.master_addr, "10.0.0.7");
  EXPECT_EQ(dist.master_port, 29511);
  EXPECT_EQ(dist.threads, 3);
}

TEST(DistEnvParsing, LocalDefaultsFollowTheWorld) {
  ScopedEnv env(dist_env_with({{"RANK", "2"}, {"WORLD_SIZE", "3"}}));
  const auto dist = autotp::DistEnv::from_environment();
  EXPECT_EQ(dist.local_rank, 2);
  EXPECT_EQ(dist.local_world_size, 3);
}

TEST(DistEnvParsing, MalformedValuesNameTheVariable) {
  const std::vector<std::pair<std::map<std::string, std::optional<std::string>>, std::string>> cases = {
      {{{"RANK", "abc"}, {"WORLD_SIZE", "2"}}, "RANK='abc'"},
      {{{"RANK", "1x"}, {"WORLD_SIZE", "2"}}, "RANK='1x'"},
      {{{"RANK", "0"}, {"WORLD_SIZE", ""}}, "WORLD_SIZE=''"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK=-1"},
      {{{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK=2 is not below WORLD_SIZE=2"},
      {{{"RANK", "0"}}, "RANK is set but WORLD_SIZE is not"},
      {{{"WORLD_SIZE", "2"}}, "WORLD_SIZE is set but RANK is not"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "z"}}, "LOCAL_RANK='z'"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT=70000"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "port"}}, "MASTER_PORT='port'"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}}, "MASTER_ADDR"},
      {{{"AUTOTP_THREADS", "two"}}, "AUTOTP_THREADS='two'"},
  };
  for (const auto& [values, expected] : cases) {
    ScopedEnv env(dist_env_with(values));
    const std::string message = user_error_message([] { autotp::DistEnv::from_environment(); });
    EXPECT_NE(message.find(expected), std::string::npos) << "expected '" << expected << "' in: " << message;
  }
}

TEST(ProcessGroups, BackendNamesAndNcclAvailability) {
  EXPECT_EQ(autotp::parse_backend("gloo"), autotp::Backend::kGloo);
  EXPECT_EQ(autotp::parse_backend("nccl"), autotp::Backend::kNccl);
  EXPECT_EQ(user_error_message([] { autotp::parse_backend("mpi"); }),
            "unknown communication backend 'mpi' (allowed: gloo, nccl)");
  // NCCL comes with the CUDA library (test_cuda_runtime.cpp): available where it is
  // loaded; without a GPU asking for it is a clear error naming why
  // (tests/test_gpu_training.cpp covers the GPU side).
  EXPECT_EQ(autotp::nccl_available(), autotp::cuda_runtime() != nullptr);
  if (autotp::cuda_device_count() == 0) {
    const auto path =
        std::filesystem::temp_directory_path() / ("autotp_nccl_store_" + std::to_string(getpid()));
    auto store = autotp::create_file_store(path.string(), 1);
    const std::string message = user_error_message(
        [&] { autotp::create_process_group(autotp::Backend::kNccl, store, 0, 1, std::chrono::seconds(5)); });
    EXPECT_EQ(message, "backend nccl needs a GPU, and none is visible to this process (" +
                           autotp::cuda_unavailable_reason() + "); use backend gloo");
    std::filesystem::remove(path);
  }
}

namespace {

// Checks every group of a topology against closed forms: rank g contributes g + 1.
void check_mesh(Topology& topology, int world, int tp) {
  const int rank = topology.rank();
  const int dp = world / tp;
  const auto coords = Topology::coordinates(rank, tp);
  WORKER_CHECK(topology.world_size() == world && topology.tp_size() == tp && topology.dp_size() == dp,
               "sizes");
  WORKER_CHECK(topology.tp_rank() == coords.tp_rank && topology.dp_rank() == coords.dp_rank, "coordinates");
  WORKER_CHECK(topology.tp().rank() == coords.tp_rank && topology.tp().size() == tp, "tp comm rank/size");
  WORKER_CHECK(topology.dp().rank() == coords.dp_rank && topology.dp().size() == dp, "dp comm rank/size");
  WORKER_CHECK(topology.tp().global_ranks() == Topology::tp_group_ranks(rank, world, tp), "tp global ranks");
  WORKER_CHECK(topology.dp().global_ranks() == Topology::dp_group_ranks(rank, world, tp), "dp global ranks");

  // tp group of (dp d): ranks d*tp + t, sum of (g + 1) = tp (d tp + 1) + tp (tp - 1) / 2.
  torch::Tensor x = torch::full({3}, static_cast<double>(rank + 1), torch::kFloat64);
  topology.tp().all_reduce(x);
  const double tp_sum = tp * (coords.dp_rank * tp + 1.0) + tp * (tp - 1) / 2.0;
  autotp::test::worker_expect_equal(x, torch::full({3}, tp_sum, torch::kFloat64), "tp group all_reduce");

  // dp group of (tp t): ranks d*tp + t, sum = tp dp (dp - 1) / 2 + dp (t + 1).
  torch::Tensor y = torch::full({3}, static_cast<double>(rank + 1), torch::kFloat64);
  topology.dp().all_reduce(y);
  const double dp_sum = tp * dp * (dp - 1) / 2.0 + dp * (coords.tp_rank + 1.0);
  autotp::test::worker_expect_equal(y, torch::full({3}, dp_sum, torch::kFloat64), "dp group all_reduce");

  torch::Tensor z = torch::full({1}, static_cast<double>(rank + 1), torch::kFloat64);
  topology.world().all_reduce(z);
  autotp::test::worker_expect_equal(z, torch::full({1}, world * (world + 1) / 2.0, torch::kFloat64),
                                    "world all_reduce");

  // Gathers come back in group-rank order.
  auto mine = torch::full({1}, static_cast<int64_t>(rank), torch::kInt64);
  auto as_tensor = [](const std::vector<int>& ranks) {
    return torch::tensor(std::vector<int64_t>(ranks.begin(), ranks.end()), torch::kInt64);
  };
  autotp::test::worker_expect_equal(topology.tp().all_gather(mine), as_tensor(topology.tp().global_ranks()),
                                    "tp all_gather order");
  autotp::test::worker_expect_equal(topology.dp().all_gather(mine), as_tensor(topology.dp().global_ranks()),
                                    "dp all_gather order");
}

}  // namespace

AUTOTP_WORKER(mesh_sums) {
  const int tp = std::stoi(ctx.args.at(0));
  auto topology = ctx.topology(tp);
  check_mesh(*topology, ctx.env.world_size, tp);
  // A second topology over the same store (its own key prefix) works alongside.
  auto flat = ctx.topology(1);
  check_mesh(*flat, ctx.env.world_size, 1);
}

AUTOTP_WORKER(mesh_sums_file_store) {
  const std::string path = ctx.args.at(0);
  const int tp = std::stoi(ctx.args.at(1));
  autotp::TopologyOptions options;
  options.tp_size = tp;
  options.timeout = std::chrono::seconds(60);
  auto topology = Topology::create_with_store(autotp::create_file_store(path, ctx.env.world_size),
                                              ctx.env.rank, ctx.env.world_size, options);
  check_mesh(*topology, ctx.env.world_size, tp);
  topology->world().barrier();
}

class MeshTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(MeshTest, GroupSumsHaveClosedForms) {
  const auto [world, tp] = GetParam();
  auto result = autotp::test::run_workers("mesh_sums", world, {std::to_string(tp)});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

INSTANTIATE_TEST_SUITE_P(Layouts, MeshTest,
                         ::testing::Values(std::make_pair(4, 1), std::make_pair(4, 2), std::make_pair(4, 4),
                                           std::make_pair(2, 2), std::make_pair(3, 1)),
                         [](const ::testing::TestParamInfo<std::pair<int, int>>& info) {
                           return "world" + std::to_string(info.param.first) + "_tp" +
                                  std::to_string(info.param.second);
                         });

TEST(MeshFileStore, World4Tp2) {
  const auto path = std::filesystem::temp_directory_path() / ("autotp_filestore_" + std::to_string(getpid()));
  std::filesystem::remove(path);
  auto result = autotp::test::run_workers("mesh_sums_file_store", 4, {path.string(), "2"});
  std::filesystem::remove(path);
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}
