// The benchmark commands as a user runs them, on tiny sizes (never timed
// assertions): bench-comm checks every row and computes bus bandwidth with the
// exact nccl-tests factors; bench-step's counted communication equals the
// closed form (checked here against hand-derived numbers too) and reports the
// threads of every rank; bench-compare's exit codes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>

#include <nlohmann/json.hpp>

#include "autotp/io/safetensors.h"
#include "autotp/base/error.h"
#include "cli/bench_report.h"
#include "launcher/launcher.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

using nlohmann::json;
using test::run_cli;

json read_json(const std::string& path) { return json::parse(test::read_file(path)); }

TEST(BenchComm, BusBandwidthFactorsAreExact) {
  EXPECT_DOUBLE_EQ(cli::bus_bandwidth_factor("all_reduce", 2), 1.0);
  EXPECT_DOUBLE_EQ(cli::bus_bandwidth_factor("all_reduce", 3), 4.0 / 3.0);
  EXPECT_DOUBLE_EQ(cli::bus_bandwidth_factor("all_reduce", 4), 1.5);
  EXPECT_DOUBLE_EQ(cli::bus_bandwidth_factor("all_gather", 3), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(cli::bus_bandwidth_factor("reduce_scatter", 4), 0.75);
  EXPECT_DOUBLE_EQ(cli::bus_bandwidth_factor("broadcast", 3), 1.0);
  EXPECT_DOUBLE_EQ(cli::bus_bandwidth_factor("all_to_all", 4), 0.75);
  EXPECT_THROW(cli::bus_bandwidth_factor("all_to_one", 2), UserError);
}

class BenchCommWorld : public ::testing::TestWithParam<int> {};

TEST_P(BenchCommWorld, EveryRowVerifiedWithExactBusFactor) {
  const int n = GetParam();
  const std::string dir = test::make_temp_dir("bench-comm");
  auto result = run_cli(fmt::format(
      "bench-comm --nproc {} --min-bytes 8 --max-bytes 64KiB --factor 8 --iters 2 --warmup 1 --json {}/comm.json", n,
      dir));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const json report = read_json(dir + "/comm.json");
  EXPECT_EQ(report.at("context").at("world"), n);
  const json& rows = report.at("benchmarks");
  // 5 sizes (8 B .. 32 KiB by 8) x (5 ops x {comm, c10d} + all_reduce, all_gather,
  // reduce_scatter and all_to_all over comm-gloo: broadcast does not use shared memory).
  ASSERT_EQ(rows.size(), 5u * 14u);
  std::map<std::string, int> per_op;
  for (const auto& row : rows) {
    SCOPED_TRACE(row.dump());
    const std::string op = row.at("op");
    ++per_op[op];
    EXPECT_EQ(row.at("check"), "ok");
    EXPECT_EQ(row.at("wrong"), 0);
    const double expected_factor = op == "all_reduce"                                 ? 2.0 * (n - 1) / n
                                   : op == "all_gather" || op == "reduce_scatter" || op == "all_to_all" ? (n - 1.0) / n
                                                                                      : 1.0;
    EXPECT_DOUBLE_EQ(row.at("bus_factor").get<double>(), expected_factor);
    const double time = row.at("time_s").get<double>();
    ASSERT_GT(time, 0);
    EXPECT_DOUBLE_EQ(row.at("algbw_GBps").get<double>(), row.at("bytes").get<double>() / time / 1e9);
    EXPECT_DOUBLE_EQ(row.at("busbw_GBps").get<double>(), row.at("algbw_GBps").get<double>() * expected_factor);
    // Split collectives move whole elements, a multiple of the world per buffer.
    if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") {
      EXPECT_EQ(row.at("count").get<int64_t>() % n, 0);
    }
  }
  EXPECT_EQ(per_op["all_reduce"], 15);
  EXPECT_EQ(per_op["all_gather"], 15);
  EXPECT_EQ(per_op["reduce_scatter"], 15);
  EXPECT_EQ(per_op["broadcast"], 10);
  EXPECT_EQ(per_op["all_to_all"], 15);
  EXPECT_NE(result.output.find("busbw(GB/s)"), std::string::npos) << result.output;
}

INSTANTIATE_TEST_SUITE_P(Worlds, BenchCommWorld, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(BenchComm, BadInputIsAUserError) {
  auto one = run_cli("bench-comm --nproc 1");
  EXPECT_EQ(one.exit_code, 2) << one.output;
  EXPECT_NE(one.output.find("at least 2 ranks"), std::string::npos) << one.output;
  auto op = run_cli("bench-comm --nproc 2 --ops all_to_one");
  EXPECT_EQ(op.exit_code, 2) << op.output;
  EXPECT_NE(op.output.find("allowed: all_reduce"), std::string::npos) << op.output;
}

// One bench-step run on 2 ranks; returns its JSON row.
json bench_step(const std::string& flags) {
  const std::string dir = test::make_temp_dir("bench-step");
  auto result = run_cli("bench-step --model preset:llama-tiny --nproc 2 --micro-batch 2 --seq-len 16 --steps 2 "
                        "--warmup 1 --json " + dir + "/step.json " + flags);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  if (result.exit_code != 0) return json();
  EXPECT_NE(result.output.find("MFU"), std::string::npos) << result.output;
  return read_json(dir + "/step.json").at("benchmarks").at(0);
}

void expect_counted_equals_analytic(const json& row) {
  ASSERT_TRUE(row.is_object());
  EXPECT_TRUE(row.at("comm_volume_matches").get<bool>());
  EXPECT_EQ(row.at("comm_volume").at("counted"), row.at("comm_volume").at("analytic"));
}

// The threads the launcher gives 2 local ranks, as every rank reports them.
void expect_threads(const json& row) {
  const int expected = std::max(1, launcher::available_cores() / 2);
  EXPECT_EQ(row.at("threads_per_rank"), expected);
  EXPECT_FALSE(row.at("oversubscribed").get<bool>());
  for (const auto& rank : row.at("ranks")) {
    EXPECT_EQ(rank.at("torch_threads"), expected) << rank.dump();
    EXPECT_EQ(rank.at("OMP_NUM_THREADS"), expected) << rank.dump();
    EXPECT_EQ(rank.at("OPENBLAS_NUM_THREADS"), expected) << rank.dump();
    if (rank.at("blas_threads").get<int>() != 0) {
      EXPECT_EQ(rank.at("blas_threads"), expected) << rank.dump();
    }
  }
}

// llama-tiny (hidden 96, 2 layers, vocab 259 split 130/129) at tp 2: per
// micro-batch of N = 2 x 16 tokens, one activation is N x 96 x 4 = 12288 bytes.
TEST(BenchStep, TensorParallelVolumeMatchesHandCount) {
  const json row = bench_step("--tp 2 --zero 0 --gas 2");
  expect_counted_equals_analytic(row);
  expect_threads(row);
  const json& tp = row.at("comm_volume").at("counted").at("tp").at("all_reduce");
  // Per micro-batch: embedding 1 + 2 layers x 2 row linears x (forward + backward) 8
  // + cross-entropy 2 + LM-head input gradient 1 = 12; x 2 micro-batches + the batch hash.
  EXPECT_EQ(tp.at("calls"), 2 * 12 + 1);
  const int64_t activation = 2 * 16 * 96 * 4;
  const int64_t cross_entropy = 2 * 16 * 4 * 3;  // max [N] and [2, N] in fp32
  EXPECT_EQ(tp.at("bytes"), 2 * (10 * activation + cross_entropy) + 16);
  EXPECT_EQ(row.at("comm_volume").at("counted").at("world").at("all_reduce").at("calls"), 1);
  EXPECT_EQ(row.at("comm_volume").at("counted").at("dp").at("all_reduce").at("calls"), 0);
  EXPECT_GT(row.at("tokens_per_s").get<double>(), 0);
  EXPECT_GT(row.at("mfu").get<double>(), 0);
}

TEST(BenchStep, RecomputationRepeatsTheForwardCollectives) {
  const json row = bench_step("--tp 2 --zero 1 --activation-checkpointing");
  expect_counted_equals_analytic(row);
  // 1 + 2 layers x 2 row linears x (forward + recomputed forward + backward) + 3, plus the hash.
  EXPECT_EQ(row.at("comm_volume").at("counted").at("tp").at("all_reduce").at("calls"), 1 + 12 + 3 + 1);
}

// Sequence parallelism swaps each block's all-reduces for gathers and
// reduce-scatters; tp_overlap_comm cuts each layer's micro-batch in two pieces.
TEST(BenchStep, SequenceParallelAndOverlapCollectivesMatchHandCount) {
  const int64_t activation = 2 * 16 * 96 * 4;
  const json sp = bench_step("--tp 2 --zero 1 --sequence-parallel");
  expect_counted_equals_analytic(sp);
  const json& counted = sp.at("comm_volume").at("counted").at("tp");
  // all-gathers: embedding gradient 1 + 4 blocks x (entry forward, entry again, exit backward) 12
  // + LM head input forward and backward 2; reduce-scatters: the embedding output 1 + 4 blocks x
  // (exit, entry gradient) 8 + the head input's gradient 1.
  EXPECT_EQ(counted.at("all_gather").at("calls"), 15);
  EXPECT_EQ(counted.at("all_gather").at("bytes"), 15 * activation);
  EXPECT_EQ(counted.at("reduce_scatter").at("calls"), 10);
  EXPECT_EQ(counted.at("reduce_scatter").at("bytes"), 10 * activation);
  // all-reduces: the batch hash, the cross-entropy's two and the 5 norms'
  // gradients (summed over tp under sequence parallelism).
  EXPECT_EQ(counted.at("all_reduce").at("calls"), 3 + 5);
  // Overlapped: every block collective once per half of the micro-batch, the same bytes.
  const json overlapped = bench_step("--tp 2 --zero 1 --sequence-parallel --tp-overlap-comm");
  expect_counted_equals_analytic(overlapped);
  const json& halves = overlapped.at("comm_volume").at("counted").at("tp");
  EXPECT_EQ(halves.at("all_gather").at("calls"), 1 + 24 + 2);
  EXPECT_EQ(halves.at("all_gather").at("bytes"), 15 * activation);
  EXPECT_EQ(halves.at("reduce_scatter").at("calls"), 1 + 16 + 1);
  EXPECT_EQ(halves.at("reduce_scatter").at("bytes"), 10 * activation);
}

TEST(BenchStep, ZeroStagesOverDataParallelMatchTheFormula) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE(stage);
    const json row = bench_step(fmt::format("--tp 1 --zero {}", stage));
    expect_counted_equals_analytic(row);
    const json& dp = row.at("comm_volume").at("counted").at("dp");
    // Tokens and loss; the gradients go through reduce-scatters.
    EXPECT_EQ(dp.at("all_reduce").at("calls"), 2);
    // Stage 2: one reduce-scatter and one all-gather per unit (embeddings, 2
    // layers, head). Stage 3: llama-tiny's tensors are all below the default
    // persistence threshold (1e5 elements), so they form one whole unit:
    // reduced once, gathered once after the update.
    const int64_t per_unit = stage == 2 ? 4 : 1;
    EXPECT_EQ(dp.at("reduce_scatter").at("calls"), per_unit);
    EXPECT_EQ(dp.at("all_gather").at("calls"), per_unit);
  }
}

// bench-compare: 0 within the threshold, 1 below it or with a row missing, 2 for bad files.
class BenchCompare : public ::testing::Test {
 protected:
  std::string dir = test::make_temp_dir("bench-compare");
  std::string file(const std::string& name, const json& benchmarks) {
    const std::string path = dir + "/" + name;
    io::write_text_file_atomic(path, json({{"context", json::object()}, {"benchmarks", benchmarks}}).dump());
    return path;
  }
  static json rows(double tokens_per_s, double real_time_ms, double flops) {
    return json::array({{{"name", "step/a"}, {"tokens_per_s", tokens_per_s}, {"higher_is_better", "tokens_per_s"}},
                        {{"name", "BM_Latency"}, {"real_time", real_time_ms}, {"time_unit", "ms"}},
                        {{"name", "BM_Gemm/512/1/real_time"}, {"real_time", 1.0}, {"time_unit", "ms"},
                         {"FLOP/s", flops}}});
  }
};

TEST_F(BenchCompare, ExitCodes) {
  const std::string base = file("base.json", rows(100, 10, 1e11));
  auto same = run_cli("bench-compare " + base + " " + file("same.json", rows(95, 10.5, 0.95e11)));
  EXPECT_EQ(same.exit_code, 0) << same.output;
  auto slower = run_cli("bench-compare " + base + " " + file("slow.json", rows(80, 10, 1e11)));
  EXPECT_EQ(slower.exit_code, 1) << slower.output;
  EXPECT_NE(slower.output.find("REGRESSION"), std::string::npos) << slower.output;
  // Time is lower-is-better: 12 ms against 10 ms is a ratio of 0.833.
  const std::string late = file("late.json", rows(100, 12, 1e11));
  EXPECT_EQ(run_cli("bench-compare " + base + " " + late).exit_code, 1);
  EXPECT_EQ(run_cli("bench-compare " + base + " " + late + " --threshold 0.8").exit_code, 0);
  auto flops = run_cli("bench-compare " + base + " " + file("flops.json", rows(100, 10, 0.5e11)));
  EXPECT_EQ(flops.exit_code, 1) << flops.output;
  EXPECT_NE(flops.output.find("FLOP/s"), std::string::npos) << flops.output;
  json fewer = rows(100, 10, 1e11);
  fewer.erase(0);
  auto missing = run_cli("bench-compare " + base + " " + file("missing.json", fewer));
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("MISSING"), std::string::npos) << missing.output;
  // Faster is fine, whatever the threshold.
  EXPECT_EQ(run_cli("bench-compare " + base + " " + file("fast.json", rows(300, 1, 1e12)) + " --threshold 2").exit_code,
            0);
}

TEST_F(BenchCompare, BadFilesAndMerge) {
  const std::string base = file("base.json", rows(100, 10, 1e11));
  io::write_text_file_atomic(dir + "/broken.json", "{not json");
  auto broken = run_cli("bench-compare " + base + " " + dir + "/broken.json");
  EXPECT_EQ(broken.exit_code, 2) << broken.output;
  EXPECT_NE(broken.output.find("broken.json"), std::string::npos) << broken.output;
  io::write_text_file_atomic(dir + "/other.json", "{\"rows\": []}");
  EXPECT_EQ(run_cli("bench-compare " + base + " " + dir + "/other.json").exit_code, 2);
  EXPECT_EQ(run_cli("bench-compare " + base).exit_code, 2);

  const std::string extra = file("extra.json", json::array({{{"name", "comm/x"}, {"busbw_GBps", 1.0},
                                                              {"higher_is_better", "busbw_GBps"}}}));
  auto merged = run_cli("bench-compare --merge " + dir + "/suite.json " + base + " " + extra);
  ASSERT_EQ(merged.exit_code, 0) << merged.output;
  EXPECT_EQ(read_json(dir + "/suite.json").at("benchmarks").size(), 4u);
  EXPECT_EQ(run_cli("bench-compare " + dir + "/suite.json " + dir + "/suite.json").exit_code, 0);
  auto duplicate = run_cli("bench-compare --merge " + dir + "/dup.json " + base + " " + base);
  EXPECT_EQ(duplicate.exit_code, 2) << duplicate.output;
  EXPECT_NE(duplicate.output.find("appears in both"), std::string::npos) << duplicate.output;
}

}  // namespace
}  // namespace autotp
