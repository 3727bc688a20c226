// End-to-end checkpoints through the CLI, as a user runs them: resume onto
// another tp/dp/stage (online and through `autotp reshard`) continues the
// uninterrupted run's losses; the HF export of every tp/stage equals the tp 1
// export of the same training and evaluates to the same loss at any tp;
// 16-bit weights on save; sharded export; every corrupt-checkpoint case is
// exit code 2 with the file named and nothing changed.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "autotp/io/checksum.h"
#include "autotp/io/safetensors.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"
#include "support/reference_models.h"

namespace autotp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::run_cli;

std::string write(const std::string& path, const std::string& text) {
  io::write_text_file_atomic(path, text);
  return path;
}

json ds_config(int tp, int stage, const std::string& optimizer = "AdamW", bool sequence_parallel = false) {
  json params = {{"lr", 1e-3}, {"weight_decay", 0.01}};
  if (optimizer != "SGD") params["eps"] = 1e-6;
  if (optimizer == "SGD") params = {{"lr", 0.05}, {"momentum", 0.9}, {"weight_decay", 0.01}};
  return {{"train_batch_size", 8},
          {"gradient_accumulation_steps", 2},
          {"optimizer", {{"type", optimizer}, {"params", params}}},
          {"gradient_clipping", 1.0},
          {"zero_optimization", {{"stage", stage}}},
          {"tensor_parallel", {{"autotp_size", tp}, {"sequence_parallel", sequence_parallel}}}};
}

// Every file under `dir` with its CRC-32: a fingerprint to show nothing changed.
std::map<std::string, uint32_t> fingerprint(const std::string& dir) {
  std::map<std::string, uint32_t> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[e.path().string()] = io::checksum_file(e.path().string()).crc32;
  return files;
}

class CliCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("clickpt");
    std::string text;
    for (int i = 0; i < 40; ++i) text += "Line " + std::to_string(i) + ": pack my box with five dozen liquor jugs.\n";
    data_ = write(dir_ + "/corpus.txt", text);  // ~1.8 KB: 56 examples of 32 tokens, 7 steps an epoch
    json tokens = json::array();
    for (int s = 0; s < 4; ++s) {
      json seq = json::array();
      for (int t = 0; t < 25; ++t) seq.push_back((s * 37 + t * 11 + t * t) % 259);
      tokens.push_back(seq);
    }
    tokens_ = write(dir_ + "/eval_tokens.json", tokens.dump());
  }
  std::string config(const std::string& name, const json& c) { return write(dir_ + "/" + name + ".json", c.dump()); }
  // `autotp train` on `world` ranks; extra flags appended. The corpus is byte-level
  // text for the model directories too (they carry no tokenizer files).
  test::CliResult train(const std::string& cfg, int world, int steps, const std::string& extra,
                        const std::string& model = "preset:llama-tiny") {
    return run_cli("train --config " + cfg + " --model " + model + " --data " + data_ +
                   " --tokenizer bytes --seq-len 32 --steps " +
                   std::to_string(steps) + " --nproc " + std::to_string(world) + " " + extra);
  }
  double eval_loss(const std::string& model, int tp) {
    const std::string out = dir_ + "/eval_" + std::to_string(tp) + ".json";
    auto r = run_cli("eval --model " + model + " --tokens " + tokens_ + " --out " + out + " --nproc " +
                     std::to_string(tp) + " --tp " + std::to_string(tp));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return json::parse(test::read_file(out)).at("loss").get<double>();
  }
  std::string dir_, data_, tokens_;
};

struct ReshardCase {
  int src_tp, src_world, src_stage, dst_tp, dst_world, dst_stage;
  bool offline;  // through `autotp reshard` instead of resuming the original directly
  bool src_sp = false, dst_sp = false;  // sequence parallelism on either side (same weight layout)
  std::string name() const {
    return "tp" + std::to_string(src_tp) + "dp" + std::to_string(src_world / src_tp) + "z" +
           std::to_string(src_stage) + (src_sp ? "sp" : "") + "_to_tp" + std::to_string(dst_tp) + "dp" +
           std::to_string(dst_world / dst_tp) + "z" + std::to_string(dst_stage) + (dst_sp ? "sp" : "") +
           (offline ? "_offline" : "");
  }
};

void PrintTo(const ReshardCase& c, std::ostream* os) { *os << c.name(); }

class CliReshard : public CliCheckpoint, public ::testing::WithParamInterface<ReshardCase> {};

TEST_P(CliReshard, ContinuedLossesMatchTheUninterruptedRun) {
  const auto& c = GetParam();
  const std::string src = config("src", ds_config(c.src_tp, c.src_stage, "AdamW", c.src_sp));
  const std::string dst = config("dst", ds_config(c.dst_tp, c.dst_stage, "AdamW", c.dst_sp));
  auto full = train(src, c.src_world, 6, "--metrics " + dir_ + "/full.jsonl");
  ASSERT_EQ(full.exit_code, 0) << full.output;
  auto first = train(src, c.src_world, 3, "--save " + dir_ + "/ckpt");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  std::string resume_from = dir_ + "/ckpt";
  if (c.offline) {
    auto r = run_cli("reshard --checkpoint " + resume_from + " --tp " + std::to_string(c.dst_tp) + " --dp " +
                     std::to_string(c.dst_world / c.dst_tp) + " --stage " + std::to_string(c.dst_stage) + " --out " +
                     dir_ + "/resharded");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    resume_from = dir_ + "/resharded";
    EXPECT_EQ(json::parse(test::read_file(resume_from + "/step_3/metadata.json"))["topology"]["tp"], c.dst_tp);
  }
  auto second = train(dst, c.dst_world, 6, "--resume " + resume_from + " --metrics " + dir_ + "/resumed.jsonl");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  auto want = test::read_json_lines(dir_ + "/full.jsonl"), got = test::read_json_lines(dir_ + "/resumed.jsonl");
  ASSERT_EQ(want.size(), 6u);
  ASSERT_EQ(got.size(), 3u);
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const json& w = want[i + 3];
    EXPECT_EQ(got[i]["step"], w["step"]);
    EXPECT_EQ(got[i]["layout"]["tp"], c.dst_tp);
    for (const char* key : {"loss", "grad_norm"}) {
      const double rel = std::abs(got[i][key].get<double>() - w[key].get<double>()) / w[key].get<double>();
      EXPECT_LT(rel, 1e-5) << key << " at step " << w["step"] << ": " << got[i][key] << " vs " << w[key];
      worst = std::max(worst, rel);
    }
  }
  std::fprintf(stderr, "%s: worst relative loss/grad-norm difference %.2g\n", c.name().c_str(), worst);
}

INSTANTIATE_TEST_SUITE_P(Layouts, CliReshard,
                         ::testing::Values(ReshardCase{2, 2, 1, 1, 2, 1, false}, ReshardCase{4, 4, 1, 2, 4, 1, false},
                                           ReshardCase{2, 4, 1, 4, 4, 3, false}, ReshardCase{3, 3, 0, 2, 2, 0, false},
                                           ReshardCase{4, 4, 2, 2, 4, 1, true},
                                           // 32 tokens: 11 + 11 + 10 at tp 3
                                           ReshardCase{3, 3, 2, 2, 2, 0, false, true, false},
                                           ReshardCase{2, 4, 1, 4, 4, 3, true, false, true}),
                         [](const auto& info) { return info.param.name(); });

std::map<std::string, torch::Tensor> read_model(const std::string& dir) {
  auto reader = io::CheckpointReader::open(dir);
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& name : reader.names()) tensors[name] = reader.read(name);
  return tensors;
}

struct ExportCase {
  std::string preset;
  int tp, world, stage;
};

void PrintTo(const ExportCase& c, std::ostream* os) {
  *os << c.preset << " tp " << c.tp << " world " << c.world << " stage " << c.stage;
}

class CliExport : public CliCheckpoint, public ::testing::WithParamInterface<ExportCase> {};

TEST_P(CliExport, EqualsTheTp1ExportAndEvaluatesAlike) {
  const auto& c = GetParam();
  const std::string model = "preset:" + c.preset;
  // SGD: Adam would turn the exactly-zero gradient of GPT-2's key bias into roundoff-driven
  // steps that no two layouts agree on (see test_train_parity.cpp); export is what is tested here.
  auto ref = train(config("ref", ds_config(1, 0, "SGD")), 1, 3, "--export-hf " + dir_ + "/ref", model);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  auto run = train(config("run", ds_config(c.tp, c.stage, "SGD")), c.world, 3,
                   "--save " + dir_ + "/ckpt --export-hf " + dir_ + "/live", model);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  auto offline = run_cli("export --checkpoint " + dir_ + "/ckpt --out " + dir_ + "/offline");
  ASSERT_EQ(offline.exit_code, 0) << offline.output;

  // The names are HF's (what `autotp init` writes: tied heads not stored), in fp32 like the training.
  auto init = run_cli("init --model " + model + " --out " + dir_ + "/init");
  ASSERT_EQ(init.exit_code, 0) << init.output;
  auto want = read_model(dir_ + "/ref"), live = read_model(dir_ + "/live"), off = read_model(dir_ + "/offline");
  auto names = [](const std::map<std::string, torch::Tensor>& m) {
    std::vector<std::string> n;
    for (const auto& e : m) n.push_back(e.first);
    return n;
  };
  EXPECT_EQ(names(live), names(read_model(dir_ + "/init")));
  ASSERT_EQ(names(live), names(want));
  double worst = 0;
  for (const auto& [name, tensor] : want) {
    EXPECT_EQ(live[name].scalar_type(), torch::kFloat32) << name;
    EXPECT_TRUE(torch::equal(live[name], off[name])) << name << ": live and offline exports differ";
    const double rel = (live[name] - tensor).norm().item<double>() / tensor.norm().item<double>();
    EXPECT_LT(rel, 1e-6) << name << ": export at tp " << c.tp << " vs tp 1";
    worst = std::max(worst, rel);
  }
  EXPECT_EQ(json::parse(test::read_file(dir_ + "/live/config.json"))["torch_dtype"], "float32");
  const double loss_ref = eval_loss(dir_ + "/ref", 1);
  const double loss_live = eval_loss(dir_ + "/live", 2);
  EXPECT_NEAR(loss_live, loss_ref, 1e-6 * loss_ref);
  std::fprintf(stderr, "%s tp %d stage %d: export vs tp 1 worst relative L2 %.2g; eval loss %.7f vs %.7f\n",
               c.preset.c_str(), c.tp, c.stage, worst, loss_live, loss_ref);
}

INSTANTIATE_TEST_SUITE_P(Layouts, CliExport,
                         ::testing::Values(ExportCase{"llama-tiny", 2, 2, 0}, ExportCase{"llama-tiny", 2, 4, 1},
                                           ExportCase{"llama-tiny", 2, 4, 2}, ExportCase{"llama-tiny", 4, 4, 3},
                                           ExportCase{"llama-tiny", 3, 3, 1}, ExportCase{"gpt2-tiny", 2, 4, 3},
                                           ExportCase{"llama-tiny-tied", 4, 4, 1}, ExportCase{"qwen3-tiny", 3, 3, 2},
                                           ExportCase{"phi3-tiny", 4, 4, 3}, ExportCase{"gemma2-tiny", 2, 4, 1},
                                           ExportCase{"mixtral-tiny", 3, 3, 3}, ExportCase{"qwen2-moe-tiny", 4, 4, 2}),
                         [](const auto& info) {
                           std::string p = info.param.preset;
                           for (auto& ch : p)
                             if (ch == '-') ch = '_';
                           return p + "_tp" + std::to_string(info.param.tp) + "_w" + std::to_string(info.param.world) +
                                  "_z" + std::to_string(info.param.stage);
                         });

TEST_F(CliCheckpoint, Gather16BitWeightsOnSaveWritesABf16Model) {
  json c = ds_config(2, 3);
  c["zero_optimization"]["gather_16bit_weights_on_model_save"] = true;
  auto r = train(config("g16", c), 2, 2, "--save " + dir_ + "/ckpt --save-every 1 --export-hf " + dir_ + "/fp32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* step : {"step_1", "step_2"})
    EXPECT_EQ(json::parse(test::read_file(dir_ + "/ckpt/" + step + "/hf_model/config.json"))["torch_dtype"],
              "bfloat16")
        << step;
  auto bf16 = read_model(dir_ + "/ckpt/step_2/hf_model"), fp32 = read_model(dir_ + "/fp32");
  for (const auto& [name, t] : fp32) {
    EXPECT_EQ(bf16[name].scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(bf16[name], t.to(torch::kBFloat16))) << name;
  }
  EXPECT_NEAR(eval_loss(dir_ + "/ckpt/step_2/hf_model", 1), eval_loss(dir_ + "/fp32", 1), 2e-2);
}

TEST_F(CliCheckpoint, ShardedExportLoadsBackWithTheSameLoss) {
  auto r = train(config("z1", ds_config(2, 1)), 2, 1, "--save " + dir_ + "/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(run_cli("export --checkpoint " + dir_ + "/ckpt --out " + dir_ + "/one").exit_code, 0);
  auto sharded = run_cli("export --checkpoint " + dir_ + "/ckpt --out " + dir_ + "/sharded --max-shard-size 200KB");
  ASSERT_EQ(sharded.exit_code, 0) << sharded.output;
  auto index = json::parse(test::read_file(dir_ + "/sharded/model.safetensors.index.json"));
  std::set<std::string> shards;
  for (const auto& [name, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  EXPECT_GT(shards.size(), 3u);
  EXPECT_FALSE(fs::exists(dir_ + "/sharded/model.safetensors"));
  EXPECT_EQ(eval_loss(dir_ + "/sharded", 2), eval_loss(dir_ + "/one", 2));
  auto bf16 = run_cli("export --checkpoint " + dir_ + "/ckpt --out " + dir_ + "/bf16 --dtype bf16");
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  EXPECT_EQ(json::parse(test::read_file(dir_ + "/bf16/config.json"))["torch_dtype"], "bfloat16");
}

TEST_F(CliCheckpoint, CorruptCheckpointsExitWith2NamingTheFileAndChangeNothing) {
  auto r = train(config("z1", ds_config(2, 1)), 2, 2, "--save " + dir_ + "/good");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string resume_cfg = config("resume", ds_config(2, 1));
  auto copy_of_good = [&](const std::string& name) {
    const std::string to = dir_ + "/" + name;
    fs::copy(dir_ + "/good", to, fs::copy_options::recursive);
    return to;
  };
  // llama-tiny with a narrower MLP: same tensor names, other shapes.
  json narrow = test::preset_config("llama-tiny", {{"intermediate_size", 100}});
  const std::string narrow_model =
      test::write_model_dir(dir_ + "/narrow_model", narrow, test::reference_random_weights(narrow, 3));
  struct Case {
    std::string name, expected[2], model = "preset:llama-tiny", cfg;
    std::function<void(const std::string&)> damage;
  };
  std::vector<Case> cases = {
      {"missing", {"tp1_dp0.safetensors", "missing"}, "preset:llama-tiny", resume_cfg,
       [](const std::string& d) { fs::remove(d + "/step_2/tp1_dp0.safetensors"); }},
      {"flipped", {"tp0_dp0.safetensors", "CRC-32"}, "preset:llama-tiny", resume_cfg,
       [](const std::string& d) {
         const std::string f = d + "/step_2/tp0_dp0.safetensors";
         std::string bytes = test::read_file(f);
         bytes[bytes.size() - 100] ^= 0x40;
         write(f, bytes);
       }},
      {"truncated", {"tp1_dp0.safetensors", "truncated"}, "preset:llama-tiny", resume_cfg,
       [](const std::string& d) { fs::resize_file(d + "/step_2/tp1_dp0.safetensors", 5000); }},
      {"other_model", {"metadata.json", "has no tensor"}, "preset:gpt2-tiny", resume_cfg,
       [](const std::string&) {}},
      {"tied_model", {"metadata.json", "tensors"}, "preset:llama-tiny-tied", resume_cfg,
       [](const std::string&) {}},
      {"other_shape", {"metadata.json", "has shape"}, narrow_model, resume_cfg, [](const std::string&) {}},
      {"other_optimizer", {"metadata.json", "optimizer states"}, "preset:llama-tiny",
       config("sgd", ds_config(2, 1, "SGD")), [](const std::string&) {}},
      {"bad_latest", {"latest", "does not exist"}, "preset:llama-tiny", resume_cfg,
       [](const std::string& d) { write(d + "/latest", "step_9\n"); }},
      {"no_metadata", {"metadata.json", "incomplete"}, "preset:llama-tiny", resume_cfg,
       [](const std::string& d) { fs::remove(d + "/step_2/metadata.json"); }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string ckpt = copy_of_good(c.name);
    c.damage(ckpt);
    const auto before = fingerprint(ckpt);
    const std::string save = dir_ + "/" + c.name + "_new";
    auto bad = train(c.cfg, 2, 4, "--resume " + ckpt + " --save " + save, c.model);
    EXPECT_EQ(bad.exit_code, 2) << bad.output;
    for (const auto& expected : c.expected)
      EXPECT_NE(bad.output.find(expected), std::string::npos) << "missing '" << expected << "'\n" << bad.output;
    EXPECT_EQ(fingerprint(ckpt), before) << "the checkpoint changed";
    EXPECT_FALSE(fs::exists(save + "/latest")) << "a failed resume saved something";
  }
  // The offline commands check the same way.
  const std::string broken = dir_ + "/flipped";
  auto exported = run_cli("export --checkpoint " + broken + " --out " + dir_ + "/never");
  EXPECT_EQ(exported.exit_code, 2) << exported.output;
  EXPECT_NE(exported.output.find("CRC-32"), std::string::npos) << exported.output;
  EXPECT_FALSE(fs::exists(dir_ + "/never"));
  auto resharded = run_cli("reshard --checkpoint " + broken + " --tp 1 --dp 2 --out " + dir_ + "/never2");
  EXPECT_EQ(resharded.exit_code, 2) << resharded.output;
  EXPECT_FALSE(fs::exists(dir_ + "/never2/latest"));
  auto too_wide = run_cli("reshard --checkpoint " + dir_ + "/good --tp 7 --dp 1 --out " + dir_ + "/never3");
  EXPECT_EQ(too_wide.exit_code, 2) << too_wide.output;
  auto nowhere = run_cli("export --checkpoint " + dir_ + "/nowhere --out " + dir_ + "/never4");
  EXPECT_EQ(nowhere.exit_code, 2) << nowhere.output;
  EXPECT_NE(nowhere.output.find(dir_ + "/nowhere"), std::string::npos) << nowhere.output;
}

}  // namespace
}  // namespace autotp
