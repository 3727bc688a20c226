// End-to-end: `autotp scenario` on 2 local ranks. A small scenario runs every
// variant through the launcher; results.json carries every field (per-step
// loss and grad norm, step-time statistics, per-rank memory by kind with the
// analytic bytes, the comparison with the baseline, each check's outcome) and
// the report files exist. A failing check or a failing variant makes the exit
// code 1; --keep-going runs the variants after a failure; bad files exit 2.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "autotp/io/safetensors.h"
#include "autotp/base/device.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

using nlohmann::json;
using test::run_cli;

bool exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && st.st_size > 0;
}

class CliScenario : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("cliscenario");
    test::write_line_corpus(dir_ + "/corpus.txt", 40);
  }
  json scenario() const {
    return {{"name", "small"},
            {"model", "preset:llama-tiny"},
            {"data", "corpus.txt"},
            {"steps", 3},
            {"seq_len", 32},
            {"seed", 5},
            {"world_size", 2},
            // Every tensor partitioned at ZeRO-3 (llama-tiny's would all stay whole by default).
            {"config",
             {{"train_batch_size", 4},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
              {"zero_optimization", {{"stage3_param_persistence_threshold", 0}}}}},
            {"baseline", {{"name", "z3"}}},
            {"variants", json::array({{{"name", "tp2_z1"}, {"tp", 2}, {"zero_stage", 1}}})},
            {"checks",
             json::array({{{"type", "loss_agreement"}, {"max_rel_diff", 1e-5}},
                          {{"type", "model_states_analytic"}},
                          {{"type", "memory_ratio"}, {"variant", "tp2_z1"}, {"of", "z3"},
                           {"metric", "model_states.params"}, {"min", 0.9}, {"max", 1.1}}})}};
  }
  std::string write(const std::string& name, const json& j) const {
    io::write_text_file_atomic(dir_ + "/" + name, j.dump(2));
    return dir_ + "/" + name;
  }
  json results(const std::string& out) const { return json::parse(test::read_file(out + "/results.json")); }
  std::string dir_;
};

TEST_F(CliScenario, RunsEveryVariantAndWritesResultsAndReport) {
  std::string file = write("small.json", scenario());
  std::string out = dir_ + "/out";
  auto r = run_cli("scenario " + file + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("scenario: [2/2] tp2_z1 step 3/3"), std::string::npos) << r.output;
  json res = results(out);
  EXPECT_TRUE(res["passed"].get<bool>());
  EXPECT_EQ(res["scenario"]["world_size"], 2);
  ASSERT_EQ(res["variants"].size(), 2u);
  const json& b = res["variants"][0];
  const json& v = res["variants"][1];
  EXPECT_EQ(b["name"], "z3");
  EXPECT_TRUE(b["is_baseline"].get<bool>());
  EXPECT_EQ(v["baseline"], "z3");
  for (const json* x : {&b, &v}) {
    SCOPED_TRACE((*x)["name"].get<std::string>());
    EXPECT_EQ((*x)["status"], "ok");
    for (const char* key : {"loss", "grad_norm", "step_time_s", "tokens_per_s", "lr"}) ASSERT_EQ((*x)[key].size(), 3u) << key;
    EXPECT_GT((*x)["step_time"]["median_s"].get<double>(), 0);
    EXPECT_GE((*x)["step_time"]["p90_s"].get<double>(), (*x)["step_time"]["median_s"].get<double>());
    EXPECT_GT((*x)["tokens_per_s_median"].get<double>(), 0);
    const json& ranks = (*x)["memory"]["ranks"];
    ASSERT_EQ(ranks.size(), 2u);
    for (const auto& rank : ranks) {
      EXPECT_EQ(rank["model_states"], rank["analytic"]);  // fp32: params + grads + 2 Adam states
      EXPECT_GT(rank["model_states"]["total"].get<int64_t>(), 0);
      EXPECT_GE(rank["peak_allocated_bytes"].get<int64_t>(), rank["model_states"]["total"].get<int64_t>());
      EXPECT_GT(rank["activations_peak_bytes"].get<int64_t>(), 0);
      EXPECT_GT(rank["peak_rss_bytes"].get<int64_t>(), 0);
    }
    EXPECT_EQ((*x)["layout"]["train_batch_size"], 4);
  }
  EXPECT_EQ(v["layout"]["tp"], 2);
  EXPECT_EQ(v["layout"]["dp"], 1);
  EXPECT_EQ(v["layout"]["micro_batch"], 4);
  EXPECT_EQ(b["layout"]["micro_batch"], 2);
  // The baseline against itself: zero difference; tp 2 + ZeRO-1 trains the same model.
  for (const auto& d : b["comparison"]["loss_diff"]) EXPECT_EQ(d.get<double>(), 0.0);
  ASSERT_EQ(v["comparison"]["loss_diff"].size(), 3u);
  EXPECT_LT(v["comparison"]["max_loss_rel_diff"].get<double>(), 1e-5);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_DOUBLE_EQ(v["comparison"]["loss_diff"][i].get<double>(),
                     v["loss"][i].get<double>() - b["loss"][i].get<double>());
  auto max_total = [](const json& x) {
    return std::max(x["memory"]["ranks"][0]["model_states"]["total"].get<double>(),
                    x["memory"]["ranks"][1]["model_states"]["total"].get<double>());
  };
  EXPECT_DOUBLE_EQ(v["comparison"]["ratios"]["model_states.total"].get<double>(), max_total(v) / max_total(b));
  ASSERT_EQ(res["checks"].size(), 4u);  // three written + no_failed_runs
  for (const auto& c : res["checks"]) EXPECT_TRUE(c["passed"].get<bool>()) << c.dump();
  EXPECT_EQ(res["checks"][0]["results"][0]["variant"], "tp2_z1");
  for (const char* f : {"report.md", "loss.png", "memory.png", "time.png", "variants/tp2_z1/metrics.jsonl",
                        "variants/tp2_z1/config.json"})
    EXPECT_TRUE(exists(out + "/" + f)) << f;
  std::string report = test::read_file(out + "/report.md");
  EXPECT_NE(report.find("![loss](loss.png)"), std::string::npos);
  EXPECT_NE(report.find("| tp2_z1 | ok | 2 | 1 | 1 | fp32 |"), std::string::npos) << report;
  // Check labels are sentences: what the check asserts (the spec's words when it gives a description).
  EXPECT_NE(report.find("| every variant ran to the end (added by default) | PASS |"), std::string::npos) << report;
  EXPECT_EQ(report.find("ratio: ratio"), std::string::npos) << report;
  for (const auto& c : res["checks"])
    EXPECT_NE(c["description"].get<std::string>(), c["type"].get<std::string>()) << c.dump();
}

TEST_F(CliScenario, AFailingCheckOrVariantMakesTheExitCodeNonZero) {
  json s = scenario();
  // Two simulated layouts: Llama-2-7B on 8 A100s runs; cpu-local without its calibration
  // file fails when it runs (the file is read then, not when the scenario is parsed).
  s["variants"] = json::array({{{"name", "sim7b"}, {"kind", "simulate"}, {"model", "llama2-7b"},
                                {"cluster", "8xA100-80GB"}, {"gpus", 8}, {"tp", 2}, {"zero_stage", 1},
                                {"seq_len", 2048}},
                               {{"name", "sim"}, {"kind", "simulate"}, {"model", "preset:llama-tiny"},
                                {"cluster", "cpu-local"}, {"calibration", "no_such_calibration.json"}, {"gpus", 2},
                                {"tp", 1}, {"zero_stage", 1}, {"seq_len", 32}},
                               {{"name", "z1"}, {"zero_stage", 1}}});
  // z1 keeps whole parameters; the baseline (ZeRO-3, dp 2) half: the ratio is about 2, far above 0.5.
  s["checks"] = json::array({{{"type", "memory_ratio"}, {"variant", "z1"}, {"of", "z3"},
                              {"metric", "model_states.params"}, {"max", 0.5}},
                             {{"type", "loss_agreement"}, {"variants", {"z1"}}, {"max_rel_diff", 1e-5}}});
  std::string file = write("failing.json", s);
  auto r = run_cli("scenario " + file + " --out " + dir_ + "/keep --steps 2 --keep-going --no-report");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  json res = results(dir_ + "/keep");
  EXPECT_FALSE(res["passed"].get<bool>());
  ASSERT_EQ(res["variants"].size(), 4u);
  const json& sim7b = res["variants"][1];
  EXPECT_EQ(sim7b["kind"], "simulate");
  ASSERT_EQ(sim7b["status"], "ok") << sim7b.dump();
  EXPECT_EQ(sim7b["layout"]["world"], 8);
  EXPECT_EQ(sim7b["layout"]["dp"], 4);
  EXPECT_EQ(sim7b["layout"]["dtype"], "bf16");
  EXPECT_TRUE(sim7b["simulate"]["fits"].is_boolean());
  // The runner simulates in its own process; its "command" prints the same JSON.
  const std::string command = sim7b["command"].get<std::string>();
  const auto at = command.find(" simulate --model llama2-7b --cluster 8xA100-80GB --gpus 8 --tp 2 --zero 1 ");
  ASSERT_NE(at, std::string::npos) << command;
  auto cli = run_cli(command.substr(at + 1) + " 2>/dev/null");
  ASSERT_EQ(cli.exit_code, 0) << cli.output;
  EXPECT_EQ(json::parse(cli.output), sim7b["simulate"]);
  EXPECT_EQ(res["variants"][2]["name"], "sim");
  EXPECT_EQ(res["variants"][2]["status"], "failed");
  EXPECT_NE(res["variants"][2]["error"].get<std::string>().find("cluster cpu-local needs a calibration file"),
            std::string::npos)
      << res["variants"][2]["error"];
  EXPECT_EQ(res["variants"][3]["status"], "ok");  // --keep-going ran it after the failure
  EXPECT_EQ(res["variants"][3]["loss"].size(), 2u);
  const json& ratio = res["checks"][0];
  EXPECT_FALSE(ratio["passed"].get<bool>());
  EXPECT_NEAR(ratio["results"][0]["value"].get<double>(), 2.0, 0.01);
  EXPECT_TRUE(res["checks"][1]["passed"].get<bool>());
  EXPECT_FALSE(res["checks"][2]["passed"].get<bool>());  // no_failed_runs
  EXPECT_NE(r.output.find("check FAIL ratio"), std::string::npos) << r.output;

  // Without --keep-going the first failure stops the run; the rest is reported as not run.
  r = run_cli("scenario " + file + " --out " + dir_ + "/stop --steps 1 --no-report");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  res = results(dir_ + "/stop");
  EXPECT_EQ(res["variants"][1]["status"], "ok");
  EXPECT_EQ(res["variants"][2]["status"], "failed");
  EXPECT_EQ(res["variants"][3]["status"], "not_run");
  EXPECT_FALSE(res["checks"][0]["passed"].get<bool>());
}

TEST_F(CliScenario, BadScenarioExitsWithCode2) {
  json s = scenario();
  s["variants"][0]["tp"] = 3;
  auto r = run_cli("scenario " + write("bad.json", s) + " --out " + dir_ + "/bad");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("variant 'tp2_z1' (tp 3 ZeRO-1 fp32) cannot run on world 2"), std::string::npos)
      << r.output;
  s = scenario();
  s["backend"] = "nccl";
  r = run_cli("scenario " + write("nccl.json", s) + " --out " + dir_ + "/nccl");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("backend nccl needs device cuda"), std::string::npos) << r.output;
  s["device"] = "cuda";
  if (cuda_device_count() == 0) {
    r = run_cli("scenario " + write("nccl.json", s) + " --out " + dir_ + "/nccl");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("device cuda: no GPU is visible here"), std::string::npos) << r.output;
  }
  r = run_cli("scenario " + write("nccl.json", s) + " --list");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tp2_z1"), std::string::npos) << r.output;

  // A kind "simulate" variant is read by the simulated-layout reader: listed, or rejected naming file and key.
  s = scenario();
  s["variants"].push_back({{"name", "sim"}, {"kind", "simulate"}, {"model", "llama2-7b"}, {"cluster", "8xA100-80GB"},
                           {"gpus", 8}, {"tp", 2}, {"zero_stage", 1}, {"seq_len", 2048}});
  r = run_cli("scenario " + write("sim.json", s) + " --list");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("simulate llama2-7b on 8xA100-80GB: 8 GPUs tp 2 dp 4 ZeRO-1 bf16"), std::string::npos)
      << r.output;
  s["variants"][1]["zero_stag"] = 1;
  r = run_cli("scenario " + write("badsim.json", s) + " --list");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(dir_ + "/badsim.json: unknown key 'variants[1].zero_stag' in a kind \"simulate\" variant "
                                 "(did you mean 'variants[1].zero_stage'?)"),
            std::string::npos)
      << r.output;
  s["variants"][1].erase("zero_stag");
  s["variants"][1]["gpus"] = "8";
  r = run_cli("scenario " + write("badsim.json", s) + " --list");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(dir_ + "/badsim.json: variants[1].gpus must be an integer, got \"8\""), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace autotp
