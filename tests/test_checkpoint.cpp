// Distributed checkpoints on real Gloo ranks: save + resume on the same layout
// continues bit for bit (losses, grad norms, weights, optimizer states, data
// order) for tp {1, 2} x ZeRO {0..3} in fp32 and bf16; a rank killed at any
// point of a save leaves the previous checkpoint and `latest` intact and
// loadable; the format's pieces (CRC-32, metadata, reading any tensor back).
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>

#include "autotp/io/checksum.h"
#include "autotp/checkpoint/dist_checkpoint.h"
#include "autotp/model/presets.h"
#include "autotp/checkpoint/checkpointing.h"
#include "autotp/base/json_file.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"
#include "support/multiprocess.h"

namespace autotp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kSeqLen = 16;

json train_config(int tp, int stage, bool bf16) {
  return {{"train_micro_batch_size_per_gpu", 2},
          {"gradient_accumulation_steps", 2},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-3}, {"weight_decay", 0.1}}}}},
          {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 4}, {"warmup_max_lr", 2e-3}}}}},
          {"gradient_clipping", 1.0},
          {"bf16", {{"enabled", bf16}}},
          {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 3000}}},
          {"tensor_parallel", {{"autotp_size", tp}}}};
}

// A .json token file of `n` random sequences (one extra token: inputs and labels).
std::string write_token_file(const std::string& dir, int64_t n, int64_t vocab) {
  torch::manual_seed(11);
  auto ids = torch::randint(0, vocab, {n, kSeqLen + 1}, torch::kLong);
  json rows = json::array();
  for (int64_t i = 0; i < n; ++i) {
    json row = json::array();
    for (int64_t j = 0; j <= kSeqLen; ++j) row.push_back(ids[i][j].item<int64_t>());
    rows.push_back(row);
  }
  const std::string path = dir + "/tokens.json";
  std::ofstream(path) << rows.dump();
  return path;
}

std::unique_ptr<Trainer> make_trainer(const std::shared_ptr<Topology>& topo, int stage, bool bf16,
                                      const std::string& data_path, uint64_t weight_seed) {
  auto config = TrainConfig::from_json(train_config(topo->tp_size(), stage, bf16), "test");
  config.resolve_batch(topo->world_size());
  auto model = test::sharded_preset("llama-tiny", *topo, training_dtype(config), weight_seed);
  DataOptions data_options;
  data_options.vocab_size = model->config().vocab_size;
  std::shared_ptr<Dataset> data = open_dataset(data_path, data_options);
  return std::make_unique<Trainer>(config, topo, std::move(model), data, /*shuffle=*/true);
}

// A runs 6 steps; B runs 3 and saves; C starts from other weights, loads and runs 3.
// C must repeat A's steps 4-6 exactly and end with A's weights and optimizer states.
AUTOTP_WORKER(resume_exact) {
  const std::string root = ctx.args.at(0), data = ctx.args.at(1);
  const int tp = std::stoi(ctx.args.at(2));
  const bool bf16 = ctx.args.at(3) == "bf16";
  for (int stage = 0; stage <= 3; ++stage) {
    auto topo = ctx.topology(tp);
    auto a = make_trainer(topo, stage, bf16, data, 0);
    std::vector<StepMetrics> want;
    for (int s = 0; s < 6; ++s) want.push_back(a->train_step());  // 6 steps cross an epoch: 20 examples, 8 a step
    auto b = make_trainer(topo, stage, bf16, data, 0);
    for (int s = 0; s < 3; ++s) b->train_step();
    const std::string dir = root + "/stage" + std::to_string(stage);
    save_checkpoint(*b, dir);
    auto c = make_trainer(topo, stage, bf16, data, /*other weights*/ 99);
    WORKER_CHECK(load_checkpoint(*c, dir) == 3, "resumed at the wrong step");
    for (int s = 3; s < 6; ++s) {
      auto got = c->train_step();
      WORKER_CHECK(got.step == want[s].step, "step number ", got.step, " vs ", want[s].step);
      WORKER_CHECK(got.loss == want[s].loss, "stage ", stage, " step ", s + 1, ": loss ", got.loss,
                   " after resume vs ", want[s].loss, " uninterrupted");
      WORKER_CHECK(got.grad_norm == want[s].grad_norm, "stage ", stage, " step ", s + 1, ": grad norm ",
                   got.grad_norm, " vs ", want[s].grad_norm);
      WORKER_CHECK(got.lr == want[s].lr, "lr ", got.lr, " vs ", want[s].lr);
    }
    auto pa = a->optimizer().partition_state(), pc = c->optimizer().partition_state();
    test::worker_expect_equal(pc.params, pa.params, "parameter partition");
    if (bf16) test::worker_expect_equal(pc.master_weights, pa.master_weights, "master weights");
    for (size_t k = 0; k < pa.optimizer.size(); ++k)
      test::worker_expect_equal(pc.optimizer[k].second, pa.optimizer[k].second, pa.optimizer[k].first);
    WORKER_CHECK(pc.optimizer_steps == pa.optimizer_steps, "optimizer steps");
    if (topo->rank() == 0)
      std::fprintf(stderr, "tp %d stage %d %s: steps 4-6 after resume equal the uninterrupted run bit for bit\n", tp,
                   stage, bf16 ? "bf16" : "fp32");
  }
}

struct ResumeCase {
  int tp;
  std::string dtype;
};

void PrintTo(const ResumeCase& c, std::ostream* os) { *os << "tp" << c.tp << "_" << c.dtype; }

class ResumeExact : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(ResumeExact, ContinuesBitForBitAtEveryStage) {
  const auto& c = GetParam();
  const std::string dir = test::make_temp_dir("resume");
  const std::string data = write_token_file(dir, 20, 259);
  auto result = test::run_workers("resume_exact", 4, {dir, data, std::to_string(c.tp), c.dtype});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ResumeExact,
                         ::testing::Values(ResumeCase{1, "fp32"}, ResumeCase{2, "fp32"}, ResumeCase{1, "bf16"},
                                           ResumeCase{2, "bf16"}),
                         [](const auto& info) { return "tp" + std::to_string(info.param.tp) + "_" + info.param.dtype; });

// Format 1 (before ZeRO cut the flat buffer unit by unit: one contiguous
// partition per rank) still loads. B trains 3 steps at dp 2 and saves; rank 0
// rewrites the files as format 1 laid them out (parameters back to back in
// model order, padded once, split in dp contiguous halves); C loads them and
// repeats A's steps 4-6 bit for bit.
AUTOTP_WORKER(resume_format1) {
  const std::string root = ctx.args.at(0), data = ctx.args.at(1);
  const int stage = std::stoi(ctx.args.at(2));
  auto topo = ctx.topology(1);
  auto a = make_trainer(topo, stage, false, data, 0);
  std::vector<StepMetrics> want;
  for (int s = 0; s < 6; ++s) want.push_back(a->train_step());
  auto b = make_trainer(topo, stage, false, data, 0);
  for (int s = 0; s < 3; ++s) b->train_step();
  const std::string step_dir = save_checkpoint(*b, root);
  if (topo->rank() == 0) {
    auto ckpt = io::SavedCheckpoint::open(step_dir);
    const auto& meta = ckpt.metadata();
    int64_t total = 0;
    for (const auto& t : meta.tensors) total += t.spec.local_numel(0);
    const int dp = meta.dp;
    const int64_t part = (total + dp - 1) / dp;
    std::vector<std::string> states = {"params"};
    for (const auto& name : meta.optimizer_states) states.push_back("optimizer." + name);
    std::map<std::string, torch::Tensor> flat;
    for (const auto& state : states) {
      auto values = torch::zeros({part * dp}, torch::kFloat32);
      int64_t offset = 0;
      for (size_t i = 0; i < meta.tensors.size(); ++i) {
        auto local = ckpt.read_local(i, 0, state == "params" ? "master" : state).reshape({-1});
        values.narrow(0, offset, local.numel()).copy_(local);
        offset += local.numel();
      }
      flat[state] = values;
    }
    json j = meta.to_json();
    j["version"] = 1;
    for (auto& t : j["tensors"]) t.erase("unit");
    j["files"] = json::array();
    for (int d = 0; d < dp; ++d) {
      io::NamedTensors tensors;
      for (const auto& state : states) tensors.emplace_back(state, flat[state].narrow(0, d * part, part).clone());
      tensors.emplace_back("rng_state", ckpt.read_rng_state(d));
      const std::string name = io::rank_file_name(0, d);
      io::write_safetensors(step_dir + "/" + name, tensors);
      const auto sum = io::checksum_file(step_dir + "/" + name);
      j["files"].push_back({{"name", name}, {"tp_rank", 0}, {"dp_rank", d}, {"crc32", sum.crc32}, {"bytes", sum.bytes}});
    }
    std::ofstream(step_dir + "/" + io::kCheckpointMetadataFile) << j.dump(2);
  }
  topo->world().barrier();
  auto c = make_trainer(topo, stage, false, data, /*other weights*/ 99);
  WORKER_CHECK(load_checkpoint(*c, root) == 3, "resumed at the wrong step");
  for (int s = 3; s < 6; ++s) {
    auto got = c->train_step();
    WORKER_CHECK(got.loss == want[s].loss, "stage ", stage, " step ", s + 1, ": loss ", got.loss,
                 " after a format-1 resume vs ", want[s].loss, " uninterrupted");
    WORKER_CHECK(got.grad_norm == want[s].grad_norm, "grad norm ", got.grad_norm, " vs ", want[s].grad_norm);
  }
}

TEST(ResumeFormat1, ContiguousPartitionsStillLoad) {
  for (int stage : {1, 3}) {
    const std::string dir = test::make_temp_dir("format1");
    const std::string data = write_token_file(dir, 20, 259);
    auto result = test::run_workers("resume_format1", 2, {dir + "/ckpt", data, std::to_string(stage)});
    ASSERT_EQ(result.exit_code, 0) << "stage " << stage << ": " << result.summary;
  }
}

// Saves step 1, then dies (SIGKILL on one rank) during the save of step 2.
AUTOTP_WORKER(kill_during_save) {
  const std::string root = ctx.args.at(0), data = ctx.args.at(1);
  const auto phase = static_cast<SavePhase>(std::stoi(ctx.args.at(2)));
  const int victim = std::stoi(ctx.args.at(3));
  auto topo = ctx.topology(2);
  auto trainer = make_trainer(topo, 2, false, data, 0);
  trainer->train_step();
  save_checkpoint(*trainer, root);
  trainer->train_step();
  SaveOptions options;
  options.fault_hook = [&](SavePhase p) {
    if (p == phase && topo->rank() == victim) std::raise(SIGKILL);
  };
  save_checkpoint(*trainer, root, options);
  WORKER_CHECK(false, "the save should have been killed");
}

// Loads `latest` after the kill: it must be step 1, and step 2 from it must equal a fresh run's step 2.
AUTOTP_WORKER(resume_after_kill) {
  const std::string root = ctx.args.at(0), data = ctx.args.at(1);
  auto topo = ctx.topology(2);
  auto fresh = make_trainer(topo, 2, false, data, 0);
  fresh->train_step();
  const double want = fresh->train_step().loss;
  auto resumed = make_trainer(topo, 2, false, data, 5);
  WORKER_CHECK(load_checkpoint(*resumed, root) == 1, "latest is not step 1");
  const double got = resumed->train_step().loss;
  WORKER_CHECK(got == want, "step 2 after resume: loss ", got, " vs ", want);
}

struct KillCase {
  SavePhase phase;
  int victim;
  std::string name;
};

void PrintTo(const KillCase& c, std::ostream* os) { *os << c.name; }

class KillDuringSave : public ::testing::TestWithParam<KillCase> {};

TEST_P(KillDuringSave, PreviousCheckpointStaysIntact) {
  const auto& c = GetParam();
  const std::string dir = test::make_temp_dir("kill");
  const std::string data = write_token_file(dir, 40, 259);
  const std::string root = dir + "/ckpt";
  auto killed = test::run_workers("kill_during_save", 4,
                                  {root, data, std::to_string(static_cast<int>(c.phase)), std::to_string(c.victim)});
  ASSERT_NE(killed.exit_code, 0) << "the victim rank was not killed";
  EXPECT_EQ(test::read_file(root + "/latest"), "step_1\n");
  auto ckpt = io::SavedCheckpoint::open(root);
  EXPECT_EQ(ckpt.metadata().step, 1);
  EXPECT_NO_THROW(ckpt.verify());
  auto resumed = test::run_workers("resume_after_kill", 4, {root, data});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.summary;
  // The interrupted save never shows up as a complete step, and the next save clears its remains.
  if (c.phase != SavePhase::kRenamed) {
    EXPECT_FALSE(fs::exists(root + "/step_2/metadata.json"));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Phases, KillDuringSave,
    ::testing::Values(KillCase{SavePhase::kRankFilePartlyWritten, 3, "rank3_mid_file"},
                      KillCase{SavePhase::kRankFilePartlyWritten, 0, "rank0_mid_file"},
                      KillCase{SavePhase::kRankFileWritten, 1, "rank1_after_its_file"},
                      KillCase{SavePhase::kMetadataWritten, 0, "rank0_after_metadata"},
                      KillCase{SavePhase::kRenamed, 0, "rank0_before_latest"}),
    [](const auto& info) { return info.param.name; });

// A checkpoint never holds a non-finite value: rank 1 poisons one weight after step 2,
// and the save of step 2 is refused on every rank before anything is written.
AUTOTP_WORKER(refuse_non_finite_save) {
  const std::string root = ctx.args.at(0), data = ctx.args.at(1);
  auto topo = ctx.topology(2);
  auto trainer = make_trainer(topo, 2, false, data, 0);
  trainer->train_step();
  save_checkpoint(*trainer, root);
  trainer->train_step();
  if (topo->rank() == 1) trainer->model().parameters()[0].tensor.data_ptr<float>()[0] = std::nanf("");
  try {
    save_checkpoint(*trainer, root);
    WORKER_CHECK(false, "a checkpoint with a NaN weight was written");
  } catch (const NonFiniteError& e) {
    const std::string message = e.what();
    WORKER_CHECK(message.find("checkpoint of step 2 not written: rank 1 holds non-finite") != std::string::npos,
                 message);
  }
  WORKER_CHECK(!fs::exists(root + "/.step_2.partial") && !fs::exists(root + "/step_2"), "step 2 left files");
  WORKER_CHECK(test::read_file(root + "/latest") == "step_1\n", "latest moved");
}

TEST(SaveNonFinite, IsRefusedOnEveryRankBeforeAnythingIsWritten) {
  const std::string dir = test::make_temp_dir("nonfinite");
  const std::string data = write_token_file(dir, 20, 259);
  auto result = test::run_workers("refuse_non_finite_save", 2, {dir + "/ckpt", data});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

TEST(Checksum, Crc32MatchesTheStandardCheckValue) {
  // The CRC-32/ISO-HDLC check value of "123456789" (as zlib.crc32 gives it).
  const std::string text = "123456789";
  EXPECT_EQ(io::crc32_update(0, text.data(), text.size()), 0xCBF43926u);
  // Incremental over odd-sized pieces equals one pass.
  const uint32_t first = io::crc32_update(0, text.data(), 5);
  EXPECT_EQ(io::crc32_update(first, text.data() + 5, 4), 0xCBF43926u);
  EXPECT_EQ(io::crc32_update(0, "", 0), 0u);
}

TEST(SafetensorsWriter, StreamsTheSameBytesAsWriteSafetensors) {
  const std::string dir = test::make_temp_dir("writer");
  auto a = torch::arange(12, torch::kFloat32).view({3, 4});
  auto b = torch::arange(5, torch::kLong);
  io::write_safetensors(dir + "/whole.safetensors", {{"a", a}, {"b", b}});
  io::SafetensorsWriter writer(dir + "/stream.safetensors",
                               {{"a", torch::kFloat32, {3, 4}}, {"b", torch::kLong, {5}}});
  std::vector<uint64_t> progress;
  writer.set_progress_hook([&](uint64_t bytes) { progress.push_back(bytes); });
  writer.write(a);
  EXPECT_FALSE(fs::exists(dir + "/stream.safetensors")) << "visible before commit";
  writer.write(b.to(torch::kInt32));  // converted to the header's dtype
  const uint32_t crc = writer.commit();
  EXPECT_EQ(test::read_file(dir + "/whole.safetensors"), test::read_file(dir + "/stream.safetensors"));
  EXPECT_EQ(crc, io::checksum_file(dir + "/stream.safetensors").crc32);
  ASSERT_EQ(progress.size(), 2u);
  EXPECT_EQ(progress[1] - progress[0], 5u * 8u);
  EXPECT_EQ(progress[1], fs::file_size(dir + "/stream.safetensors"));
}

TEST(SafetensorsWriter, AnUncommittedWriterLeavesNothing) {
  const std::string dir = test::make_temp_dir("writer");
  {
    io::SafetensorsWriter writer(dir + "/x.safetensors", {{"a", torch::kFloat32, {2}}, {"b", torch::kFloat32, {2}}});
    writer.write(torch::ones({2}));
  }
  EXPECT_TRUE(fs::is_empty(dir));
}

}  // namespace
}  // namespace autotp
