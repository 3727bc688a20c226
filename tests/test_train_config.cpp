// The DeepSpeed-style training config: parsing, defaults, the batch triple for
// a world of dp x tp ranks, every rejection (naming the key and what is
// allowed), and the learning-rate schedules against closed-form values.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "autotp/optim/lr_schedule.h"
#include "autotp/base/error.h"
#include "autotp/runtime/train_config.h"

namespace autotp {
namespace {

using nlohmann::json;

// The UserError message from_json raises, or "(no error)".
std::string parse_error(const std::string& text) {
  try {
    TrainConfig::from_json(json::parse(text), "ds.json");
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

std::string resolve_error(TrainConfig config, int world) {
  try {
    config.resolve_batch(world);
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

::testing::AssertionResult contains_all(const std::string& message, const std::vector<std::string>& parts) {
  for (const auto& part : parts)
    if (message.find(part) == std::string::npos)
      return ::testing::AssertionFailure() << "'" << message << "' lacks '" << part << "'";
  return ::testing::AssertionSuccess();
}

const char* kFullConfig = R"({
  "train_batch_size": 32,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                           "weight_decay": 0.1, "adam_w_mode": false}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4,
                "warmup_num_steps": 100, "warmup_type": "linear", "total_num_steps": 1000}},
  "gradient_clipping": 1.0,
  "bf16": {"enabled": false},
  "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
           "hysteresis": 3, "min_loss_scale": 0.5},
  "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "stage3_gather_16bit_weights_on_model_save": true},
  "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [
      {"patterns": [".*\\.o_proj\\.weight$"], "partition_type": "row"},
      {"patterns": [".*qkv.*"], "partition_type": "column", "shape": [64, 32, 32]}]}},
  "activation_checkpointing": {"enabled": true, "layers": [0, 2]},
  "seed": 18446744073709551615,
  "steps_per_print": 5,
  "wall_clock_breakdown": true
})";

TEST(TrainConfigParse, FullDeepSpeedConfig) {
  auto c = TrainConfig::from_json(json::parse(kFullConfig), "ds.json");
  EXPECT_EQ(c.train_batch_size, 32);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_EQ(c.optimizer.type, "Adam");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_FALSE(c.optimizer.adam_w_mode);
  EXPECT_EQ(c.scheduler.type, "WarmupDecayLR");
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_min_lr, 1e-5);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 3e-4);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 100);
  EXPECT_EQ(c.scheduler.warmup_type, "linear");
  EXPECT_EQ(c.scheduler.total_num_steps, 1000);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_FALSE(c.bf16);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_DOUBLE_EQ(c.fp16.loss_scale, 0);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 3);
  EXPECT_DOUBLE_EQ(c.fp16.min_loss_scale, 0.5);
  EXPECT_EQ(c.zero.stage, 2);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_TRUE(c.zero.gather_16bit_weights_on_model_save);
  EXPECT_EQ(c.tensor_parallel.autotp_size, 2);
  ASSERT_EQ(c.tensor_parallel.layer_specs.size(), 2u);
  EXPECT_EQ(c.tensor_parallel.layer_specs[0].role, TpRole::kRow);
  EXPECT_EQ(c.tensor_parallel.layer_specs[1].shape, (std::vector<int64_t>{64, 32, 32}));
  EXPECT_TRUE(c.activation_checkpointing.enabled);
  EXPECT_EQ(c.activation_checkpointing.layers, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(c.seed, 18446744073709551615ull);
  EXPECT_EQ(c.steps_per_print, 5);
  EXPECT_TRUE(c.wall_clock_breakdown);
  EXPECT_EQ(c.raw, json::parse(kFullConfig));
}

TEST(TrainConfigParse, EmptyConfigGivesTheDefaults) {
  auto c = TrainConfig::from_json(json::object(), "");
  EXPECT_EQ(c.train_batch_size, 0);
  EXPECT_EQ(c.optimizer.type, "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_EQ(c.scheduler.type, "");
  EXPECT_FALSE(c.bf16);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  // overlap_comm unset: on when training on CUDA, off on CPU; an explicit value wins.
  EXPECT_FALSE(c.zero.overlap_comm.has_value());
  EXPECT_TRUE(c.zero.overlaps(/*cuda=*/true));
  EXPECT_FALSE(c.zero.overlaps(/*cuda=*/false));
  const auto on = TrainConfig::from_json(json::parse(R"({"zero_optimization": {"overlap_comm": true}})"), "");
  EXPECT_TRUE(on.zero.overlaps(false));
  EXPECT_EQ(on.to_json()["zero_optimization"]["overlap_comm"], true);
  EXPECT_FALSE(c.to_json()["zero_optimization"].contains("overlap_comm"));
  EXPECT_EQ(c.tensor_parallel.autotp_size, 1);
  EXPECT_TRUE(c.tensor_parallel.layer_specs.empty());
  EXPECT_FALSE(c.activation_checkpointing.enabled);
  EXPECT_EQ(c.seed, 42u);
  EXPECT_EQ(c.steps_per_print, 10);
}

TEST(TrainConfigParse, OptimizerTypesAreCaseInsensitive) {
  EXPECT_EQ(TrainConfig::from_json(json::parse(R"({"optimizer": {"type": "adamw"}})"), "").optimizer.type,
            "AdamW");
  EXPECT_EQ(TrainConfig::from_json(json::parse(R"({"optimizer": {"type": "ADAM"}})"), "").optimizer.type,
            "Adam");
  auto sgd = TrainConfig::from_json(
      json::parse(R"({"optimizer": {"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}}})"), "");
  EXPECT_EQ(sgd.optimizer.type, "SGD");
  EXPECT_DOUBLE_EQ(sgd.optimizer.momentum, 0.9);
  EXPECT_DOUBLE_EQ(sgd.optimizer.lr, 0.1);
  // DeepSpeed's Adam is AdamW unless adam_w_mode says otherwise.
  EXPECT_TRUE(
      TrainConfig::from_json(json::parse(R"({"optimizer": {"type": "Adam"}})"), "").optimizer.adam_w_mode);
  EXPECT_EQ(TrainConfig::from_json(json::parse(R"({"scheduler": {"type": "warmupcosinelr",
      "params": {"total_num_steps": 10, "warmup_num_steps": 2}}})"),
                                   "")
                .scheduler.type,
            "WarmupCosineLR");
}

TEST(TrainConfigParse, ToJsonRoundTripsEverySetting) {
  auto c = TrainConfig::from_json(json::parse(kFullConfig), "ds.json");
  json out = c.to_json();
  EXPECT_EQ(out["zero_optimization"]["gather_16bit_weights_on_model_save"], true);
  EXPECT_EQ(out["optimizer"]["params"]["betas"], json::parse("[0.8, 0.95]"));
  auto again = TrainConfig::from_json(out, "round trip");
  EXPECT_EQ(again.to_json(), out);
  // Unresolved batch sizes are left out (0 is not a valid value to write back).
  json defaults = TrainConfig::from_json(json::object(), "").to_json();
  EXPECT_FALSE(defaults.contains("train_batch_size"));
  EXPECT_FALSE(defaults.contains("scheduler"));
  EXPECT_EQ(TrainConfig::from_json(defaults, "").to_json(), defaults);
}

TEST(TrainConfigParse, FromFileReadsAndNamesTheFile) {
  std::string path = ::testing::TempDir() + "autotp_train_config_test.json";
  {
    std::ofstream out(path);
    out << R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})";
  }
  auto c = TrainConfig::from_file(path);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 2);
  {
    std::ofstream out(path);
    out << R"({"zero_optimization": {"stage": 3},})";
  }
  try {
    TrainConfig::from_file(path);
    FAIL() << "invalid JSON accepted";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains_all(e.what(), {path, "invalid JSON"}));
  }
  {
    std::ofstream out(path);
    out << R"({"zero_optimization": {"stage": 7}})";
  }
  try {
    TrainConfig::from_file(path);
    FAIL() << "stage 7 accepted";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains_all(e.what(), {path + ": zero_optimization.stage is 7"}));
  }
  std::remove(path.c_str());
  EXPECT_THROW(TrainConfig::from_file(path), UserError);
}

// ---- batch arithmetic -------------------------------------------------------

struct BatchCase {
  int64_t tbs, micro, gas;  // as given (0 = not given)
  int world, tp;
  int64_t want_tbs, want_micro, want_gas;
};

class ResolveBatch : public ::testing::TestWithParam<BatchCase> {};

TEST_P(ResolveBatch, FillsTheTripleWithDpEqualWorldOverTp) {
  const BatchCase& b = GetParam();
  TrainConfig c;
  c.train_batch_size = b.tbs;
  c.train_micro_batch_size_per_gpu = b.micro;
  c.gradient_accumulation_steps = b.gas;
  c.tensor_parallel.autotp_size = b.tp;
  c.resolve_batch(b.world);
  EXPECT_EQ(c.train_batch_size, b.want_tbs);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, b.want_micro);
  EXPECT_EQ(c.gradient_accumulation_steps, b.want_gas);
  EXPECT_EQ(c.train_batch_size,
            c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * (b.world / b.tp));
  c.resolve_batch(b.world);  // a second call only checks
  EXPECT_EQ(c.gradient_accumulation_steps, b.want_gas);
}

INSTANTIATE_TEST_SUITE_P(
    EveryCombination, ResolveBatch,
    ::testing::Values(BatchCase{16, 2, 2, 8, 2, 16, 2, 2},  // all three, dp 4
                      BatchCase{24, 3, 0, 4, 1, 24, 3, 2},  // tbs + micro -> gas, dp 4
                      BatchCase{8, 2, 0, 4, 2, 8, 2, 2},    // tbs + micro, dp 2 (not world 4: gas would be 1)
                      BatchCase{24, 0, 3, 6, 3, 24, 4, 3},  // tbs + gas -> micro, dp 2
                      BatchCase{0, 2, 5, 6, 2, 30, 2, 5},   // micro + gas -> tbs, dp 3
                      BatchCase{0, 3, 0, 5, 1, 15, 3, 1},   // micro alone -> gas 1, dp 5
                      BatchCase{0, 3, 0, 4, 4, 3, 3, 1},    // micro alone, pure tensor parallel: dp 1
                      BatchCase{14, 0, 0, 14, 7, 14, 7, 1},   // tbs alone -> gas 1, micro = tbs / dp 2
                      BatchCase{4, 0, 0, 1, 1, 4, 4, 1},      // one rank
                      BatchCase{21, 7, 0, 3, 1, 21, 7, 1}));  // non-power-of-two world

TEST(ResolveBatchErrors, ExplainTheArithmetic) {
  TrainConfig c;
  c.tensor_parallel.autotp_size = 2;
  c.train_batch_size = 10;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = 2;
  EXPECT_TRUE(contains_all(resolve_error(c, 4), {"train_batch_size 10 != train_micro_batch_size_per_gpu 2 * "
                                                 "gradient_accumulation_steps 2 * data-parallel size 2 "
                                                 "(world 4 / autotp_size 2) = 8"}));
  c.gradient_accumulation_steps = 0;
  c.train_micro_batch_size_per_gpu = 3;
  EXPECT_TRUE(contains_all(resolve_error(c, 4),
                           {"train_batch_size 10 is not a multiple of train_micro_batch_size_per_gpu 3 * "
                            "data-parallel size 2 (world 4 / autotp_size 2) = 6",
                            "gradient_accumulation_steps = 10 / 6"}));
  c.train_micro_batch_size_per_gpu = 0;
  c.gradient_accumulation_steps = 3;
  EXPECT_TRUE(contains_all(resolve_error(c, 4),
                           {"train_batch_size 10 is not a multiple of gradient_accumulation_steps 3 * "
                            "data-parallel size 2 (world 4 / autotp_size 2) = 6",
                            "train_micro_batch_size_per_gpu = 10 / 6"}));
  c.gradient_accumulation_steps = 0;
  c.train_batch_size = 5;
  EXPECT_TRUE(
      contains_all(resolve_error(c, 4), {"train_batch_size 5 is not a multiple of the data-parallel size 2 "
                                         "(world 4 / autotp_size 2)"}));
  c.train_batch_size = 0;
  c.gradient_accumulation_steps = 4;
  EXPECT_TRUE(contains_all(resolve_error(c, 4),
                           {"batch size is not set", "train_batch_size", "train_micro_batch_size_per_gpu"}));
  c.gradient_accumulation_steps = 0;
  EXPECT_TRUE(contains_all(resolve_error(c, 4), {"batch size is not set"}));
  c.train_micro_batch_size_per_gpu = 1;
  c.tensor_parallel.autotp_size = 3;
  EXPECT_TRUE(
      contains_all(resolve_error(c, 4), {"tensor_parallel.autotp_size 3 does not divide the world size 4"}));
}

// ---- rejections -------------------------------------------------------------

struct ErrorCase {
  const char* config;
  std::vector<std::string> parts;  // all must appear in the message
};

class ParseErrors : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(ParseErrors, NameTheKeyAndWhatIsAllowed) {
  std::string message = parse_error(GetParam().config);
  EXPECT_EQ(message.rfind("ds.json: ", 0), 0u) << message;
  EXPECT_TRUE(contains_all(message, GetParam().parts));
}

INSTANTIATE_TEST_SUITE_P(
    Every, ParseErrors,
    ::testing::Values(
        ErrorCase{R"({"zero_optimisation": {}})",
                  {"unknown key 'zero_optimisation' (did you mean 'zero_optimization'?)"}},
        ErrorCase{R"({"train_batch_sise": 8})", {"unknown key 'train_batch_sise'", "'train_batch_size'"}},
        ErrorCase{R"({"zero_optimization": {"stag": 1}})",
                  {"unknown key 'zero_optimization.stag' (did you mean 'zero_optimization.stage'?)"}},
        ErrorCase{R"({"optimizer": {"type": "AdamW", "params": {"betas1": 0.9}}})",
                  {"unknown key 'optimizer.params.betas1'", "did you mean 'optimizer.params.betas'"}},
        ErrorCase{R"({"fp16": {"enabled": true, "loss_scale_windows": 10}})",
                  {"'fp16.loss_scale_windows'", "did you mean 'fp16.loss_scale_window'"}},
        ErrorCase{R"({"tensor_parallel": {"tp_size": 2}})",
                  {"unknown key 'tensor_parallel.tp_size'", "autotp_size"}},
        ErrorCase{
            R"({"activation_checkpointing": {"partition_activations": true}})",
            {"unknown key 'activation_checkpointing.partition_activations'", "allowed: enabled, mode, layers"}},
        ErrorCase{R"({"something_else": 1})", {"unknown key 'something_else'", "allowed: train_batch_size"}},
        ErrorCase{R"({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}})",
                  {"unknown key 'optimizer.params.momentum' for optimizer type Adam",
                   "allowed: lr, betas, eps, weight_decay, adam_w_mode"}},
        ErrorCase{
            R"({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}})",
            {"unknown key 'optimizer.params.betas' for optimizer type SGD", "lr, momentum, weight_decay"}},
        ErrorCase{R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}})",
                  {"unknown key 'scheduler.params.total_num_steps' for scheduler type WarmupLR"}},
        ErrorCase{R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_ratio": 0.1}}})",
                  {"'scheduler.params.warmup_min_ratio' for scheduler type WarmupLR",
                   "did you mean 'scheduler.params.warmup_min_lr'"}},
        ErrorCase{R"({"zero_optimization": {"stage": 4}})",
                  {"zero_optimization.stage is 4 (allowed: 0, 1, 2, 3)"}},
        ErrorCase{R"({"zero_optimization": {"stage": "3"}})",
                  {"zero_optimization.stage must be an integer, got \"3\""}},
        ErrorCase{R"({"zero_optimization": {"stage": 1.5}})", {"zero_optimization.stage must be an integer"}},
        ErrorCase{R"({"zero_optimization": {"reduce_bucket_size": 0}})",
                  {"zero_optimization.reduce_bucket_size is 0", "integer >= 1"}},
        ErrorCase{R"({"zero_optimization": {"gather_16bit_weights_on_model_save": true,
                     "stage3_gather_16bit_weights_on_model_save": false}})",
                  {"zero_optimization.gather_16bit_weights_on_model_save", "disagree"}},
        ErrorCase{R"({"optimizer": {"params": {"lr": -0.001}}})",
                  {"optimizer.params.lr is -0.001 (allowed: a number >= 0)"}},
        ErrorCase{R"({"optimizer": {"params": {"lr": "1e-3"}}})", {"optimizer.params.lr must be a number"}},
        ErrorCase{R"({"optimizer": {"type": "Lamb"}})", {"optimizer.type is \"Lamb\"", "AdamW, Adam, SGD"}},
        ErrorCase{R"({"optimizer": {"params": {"betas": [0.9]}}})",
                  {"optimizer.params.betas is [0.9]", "two numbers in [0, 1)"}},
        ErrorCase{R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})",
                  {"optimizer.params.betas is [0.9,1.0]", "two numbers in [0, 1)"}},
        ErrorCase{R"({"optimizer": {"params": {"betas": [0.9, "x"]}}})",
                  {"optimizer.params.betas", "two numbers"}},
        ErrorCase{R"({"optimizer": {"params": {"betas": 0.9}}})", {"optimizer.params.betas is 0.9"}},
        ErrorCase{R"({"optimizer": {"params": {"eps": 0}}})", {"optimizer.params.eps is 0", "> 0"}},
        ErrorCase{R"({"optimizer": {"params": {"weight_decay": -1}}})",
                  {"optimizer.params.weight_decay is -1"}},
        ErrorCase{R"({"optimizer": {"type": "SGD", "params": {"momentum": 1.5}}})",
                  {"optimizer.params.momentum is 1.5", "[0, 1)"}},
        ErrorCase{R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})",
                  {"optimizer.params.adam_w_mode is false", "use type Adam"}},
        ErrorCase{R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})",
                  {"bf16.enabled and fp16.enabled are both true", "at most one"}},
        ErrorCase{R"({"bf16": true})", {"bf16 must be an object, got true"}},
        ErrorCase{R"({"bf16": {"enabled": 1}})", {"bf16.enabled must be true or false, got 1"}},
        ErrorCase{R"({"fp16": {"hysteresis": 0}})", {"fp16.hysteresis is 0", ">= 1"}},
        ErrorCase{R"({"fp16": {"loss_scale": -1}})", {"fp16.loss_scale is -1", "0 (dynamic)"}},
        ErrorCase{R"({"fp16": {"initial_scale_power": 99}})", {"fp16.initial_scale_power is 99", "[0, 64]"}},
        ErrorCase{R"({"fp16": {"min_loss_scale": 0}})", {"fp16.min_loss_scale is 0", "> 0"}},
        ErrorCase{R"({"tensor_parallel": {"autotp_size": -1}})",
                  {"tensor_parallel.autotp_size is -1 (allowed: an integer >= 1"}},
        ErrorCase{R"({"tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": ["x"],
                     "partition_type": "diagonal"}]}}})",
                  {"tensor_parallel.partition_config", "diagonal", "column, row, vocab, replicated"}},
        ErrorCase{R"({"scheduler": {"params": {}}})",
                  {"scheduler.type is required", "WarmupLR, WarmupDecayLR"}},
        ErrorCase{R"({"scheduler": {"type": "OneCycle"}})",
                  {"scheduler.type is \"OneCycle\"", "WarmupLR, WarmupDecayLR, WarmupCosineLR"}},
        ErrorCase{R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})",
                  {"scheduler.params.warmup_type is \"cosine\" (allowed: log, linear)"}},
        ErrorCase{R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": -1}}})",
                  {"scheduler.params.warmup_max_lr is -1", ">= 0"}},
        ErrorCase{R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}})",
                  {"scheduler.params.warmup_num_steps is -5"}},
        ErrorCase{R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}})",
                  {"scheduler.params.total_num_steps is required for scheduler type WarmupDecayLR"}},
        ErrorCase{R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}})",
                  {"scheduler.params.total_num_steps is 0", ">= 1"}},
        ErrorCase{R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10,
                     "warmup_num_steps": 10}}})",
                  {"scheduler.params.total_num_steps is 10", "max(2, warmup_num_steps) = 10"}},
        ErrorCase{R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10,
                     "cos_min_ratio": 2}}})",
                  {"scheduler.params.cos_min_ratio is 2", "[0, 1]"}},
        ErrorCase{R"({"activation_checkpointing": {"layers": [-1]}})",
                  {"activation_checkpointing.layers is [-1]"}},
        ErrorCase{R"({"activation_checkpointing": {"layers": [1, 1]}})",
                  {"activation_checkpointing.layers is [1,1]", "distinct"}},
        ErrorCase{R"({"train_batch_size": 0})", {"train_batch_size is 0", "leave it out to derive it"}},
        ErrorCase{R"({"train_micro_batch_size_per_gpu": -2})", {"train_micro_batch_size_per_gpu is -2"}},
        ErrorCase{R"({"gradient_clipping": -1})", {"gradient_clipping is -1"}},
        ErrorCase{R"({"seed": -1})", {"seed is -1", "[0, 2^64)"}},
        ErrorCase{R"({"steps_per_print": 0})", {"steps_per_print is 0"}},
        ErrorCase{R"({"wall_clock_breakdown": "yes"})", {"wall_clock_breakdown must be true or false"}},
        ErrorCase{R"([1, 2])", {"the config must be an object"}},
        // DeepSpeed's AutoTP keys autotp has no meaning for: each says what DeepSpeed does and what autotp offers.
        ErrorCase{R"({"tensor_parallel": {"injection_policy_tuple": ["LlamaDecoderLayer"]}})",
                  {"tensor_parallel.injection_policy_tuple", "partition_config.layer_specs"}},
        ErrorCase{R"({"tensor_parallel": {"kernel_inject": true}})", {"tensor_parallel.kernel_inject", "allowed: false"}},
        ErrorCase{R"({"tensor_parallel": {"preset_model": "bloom"}})",
                  {"tensor_parallel.preset_model is \"bloom\"", "does not train yet",
                   "allowed: llama, qwen2, mixtral, phi3"}},
        ErrorCase{R"({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}})",
                  {"tensor_parallel.tp.tp_size is 4", "allowed: 2"}},
        ErrorCase{R"({"tensor_parallel": {"tp": {"mpu": {}}}})", {"tensor_parallel.tp.mpu", "Python object"}},
        ErrorCase{R"({"tensor_parallel": {"dtype": "float16"}, "bf16": {"enabled": true}})",
                  {"tensor_parallel.dtype is \"float16\"", "bfloat16"}},
        ErrorCase{R"({"tensor_parallel": {"sequence_parallel": 1}})", {"tensor_parallel.sequence_parallel"}},
        ErrorCase{R"({"tensor_parallel": {"partition_config": {"use_default_specs": false}}})",
                  {"use_default_specs is false", "partition_type replicated"}},
        ErrorCase{R"({"tensor_parallel": {"partition_config": {"layer_specs": [
                      {"patterns": [".*o_proj.*"], "partition_type": "row", "partition_dim": 0}]}}})",
                  {"partition_dim is 0", "1 for row"}}));

// A DeepSpeed AutoTP training section with every key autotp can honour.
TEST(TrainConfig, AcceptsDeepSpeedAutoTpKeys) {
  auto c = TrainConfig::from_json(json::parse(R"({
    "bf16": {"enabled": true},
    "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": false, "dtype": "torch.bfloat16",
                        "tp": {"tp_size": 2, "tp_grain_size": 64}, "injection_policy_tuple": null,
                        "preset_model": "llama", "keep_module_on_host": true, "replace_with_kernel_inject": false,
                        "partition_config": {"use_default_specs": true, "layer_specs": [
                          {"patterns": [".*\\.o_proj\\.weight$"], "partition_type": "row", "partition_dim": 1}]}}})"),
                                  "ds.json");
  EXPECT_EQ(c.tensor_parallel.autotp_size, 2);
  ASSERT_EQ(c.tensor_parallel.layer_specs.size(), 1u);
  EXPECT_EQ(c.tensor_parallel.layer_specs[0].role, TpRole::kRow);
  EXPECT_EQ(c.tensor_parallel.dtype, "torch.bfloat16");
  EXPECT_FALSE(c.tensor_parallel.sequence_parallel);
  // sequence_parallel reaches the plan options and survives the round trip.
  auto sp = TrainConfig::from_json(json::parse(R"({"tensor_parallel": {"autotp_size": 2, "sequence_parallel": true}})"), "");
  EXPECT_TRUE(sp.tensor_parallel.plan_options().sequence_parallel);
  EXPECT_EQ(sp.tensor_parallel.plan_options().tp_size, 2);
  EXPECT_TRUE(TrainConfig::from_json(sp.to_json(), "").tensor_parallel.sequence_parallel);
  auto overlap = TrainConfig::from_json(json::parse(R"({"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": true}})"), "");
  EXPECT_TRUE(overlap.tensor_parallel.plan_options().overlap_comm);
  EXPECT_FALSE(overlap.tensor_parallel.plan_options().sequence_parallel);
  EXPECT_TRUE(TrainConfig::from_json(overlap.to_json(), "").tensor_parallel.overlap_comm);
  // autotp_size 0 is DeepSpeed's "off": one rank per tensor-parallel group.
  EXPECT_EQ(TrainConfig::from_json(json::parse(R"({"tensor_parallel": {"autotp_size": 0}})"), "").tensor_parallel.autotp_size,
            1);
  // The resolved config reads back the same.
  EXPECT_EQ(TrainConfig::from_json(c.to_json(), "").to_json(), c.to_json());
}

// ---- learning-rate schedules -----------------------------------------------
// learning_rate(step) is DeepSpeed's lr for iteration step - 1; step 0 gets the
// value set at construction. Expected values are the closed forms written out.

constexpr double kTol = 1e-15;

TEST(LearningRate, NoSchedulerIsTheBaseLr) {
  SchedulerConfig none;
  EXPECT_DOUBLE_EQ(learning_rate(none, 0.02, 0), 0.02);
  EXPECT_DOUBLE_EQ(learning_rate(none, 0.02, 12345), 0.02);
}

TEST(LearningRate, WarmupLrLog) {
  SchedulerConfig s;
  s.type = "WarmupLR";
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = 0.01;
  s.warmup_num_steps = 10;                            // log warmup: 0.01 * log(i + 1) / log(10)
  const double base = 123.0;                          // ignored by WarmupLR
  EXPECT_NEAR(learning_rate(s, base, 0), 0.0, kTol);  // first step: warmup_min_lr
  EXPECT_NEAR(learning_rate(s, base, 1), 0.0, kTol);  // iteration 0: log 1 = 0
  EXPECT_NEAR(learning_rate(s, base, 2), 0.0030102999566398118, kTol);  // 0.01 log 2 / log 10
  EXPECT_NEAR(learning_rate(s, base, 5), 0.006989700043360187, kTol);   // 0.01 log 5 / log 10
  EXPECT_NEAR(learning_rate(s, base, 10), 0.01, kTol);                  // iteration 9: end of warmup
  EXPECT_NEAR(learning_rate(s, base, 11), 0.01, kTol);
  EXPECT_NEAR(learning_rate(s, base, 100000), 0.01, kTol);
}

TEST(LearningRate, WarmupLengthBelowTwoActsAsTwo) {
  SchedulerConfig s;
  s.type = "WarmupLR";
  s.warmup_min_lr = 0.001;
  s.warmup_max_lr = 0.005;
  for (int64_t w : {0, 1, 2}) {
    s.warmup_num_steps = w;
    EXPECT_NEAR(learning_rate(s, 1.0, 0), 0.001, kTol);
    EXPECT_NEAR(learning_rate(s, 1.0, 1), 0.001, kTol);  // log 1 / log 2 = 0
    EXPECT_NEAR(learning_rate(s, 1.0, 2), 0.005, kTol);  // log 2 / log 2 = 1
  }
}

TEST(LearningRate, WarmupDecayLrLinear) {
  SchedulerConfig s;
  s.type = "WarmupDecayLR";
  s.warmup_min_lr = 0.001;
  s.warmup_max_lr = 0.01;
  s.warmup_num_steps = 4;
  s.warmup_type = "linear";  // 0.001 + 0.009 * i / 4, then 0.001 + 0.009 * (12 - i) / 8
  s.total_num_steps = 12;
  EXPECT_NEAR(learning_rate(s, 9.0, 0), 0.001, kTol);     // first step
  EXPECT_NEAR(learning_rate(s, 9.0, 1), 0.001, kTol);     // iteration 0
  EXPECT_NEAR(learning_rate(s, 9.0, 3), 0.0055, kTol);    // iteration 2: mid-warmup
  EXPECT_NEAR(learning_rate(s, 9.0, 4), 0.00775, kTol);   // iteration 3: last warmup iteration
  EXPECT_NEAR(learning_rate(s, 9.0, 5), 0.01, kTol);      // iteration 4: decay starts at (12 - 4) / 8 = 1
  EXPECT_NEAR(learning_rate(s, 9.0, 9), 0.0055, kTol);    // iteration 8: half-way down
  EXPECT_NEAR(learning_rate(s, 9.0, 11), 0.00325, kTol);  // last of 12 steps: iteration 10, 2 / 8
  EXPECT_NEAR(learning_rate(s, 9.0, 13), 0.001, kTol);    // iteration 12: back at warmup_min_lr
  EXPECT_NEAR(learning_rate(s, 9.0, 100), 0.001, kTol);   // clamped at 0 decay
}

TEST(LearningRate, WarmupCosineLrIsRelativeToTheOptimizerLr) {
  SchedulerConfig s;
  s.type = "WarmupCosineLR";
  s.warmup_num_steps = 5;
  s.warmup_type = "linear";  // ratio 0.1 + 0.9 * i / 5, then 0.01 + 0.99 * (1 + cos(pi (i - 4) / 10)) / 2
  s.warmup_min_ratio = 0.1;
  s.cos_min_ratio = 0.01;
  s.total_num_steps = 15;
  const double base = 0.1;
  EXPECT_NEAR(learning_rate(s, base, 0), 0.0, kTol);                    // first step: DeepSpeed sets 0
  EXPECT_NEAR(learning_rate(s, base, 1), 0.01, kTol);                   // iteration 0: warmup_min_ratio
  EXPECT_NEAR(learning_rate(s, base, 3), 0.046, kTol);                  // iteration 2: 0.1 (0.1 + 0.9 * 0.4)
  EXPECT_NEAR(learning_rate(s, base, 5), 0.082, kTol);                  // iteration 4: end of warmup
  EXPECT_NEAR(learning_rate(s, base, 6), 0.09757729755661011, kTol);    // iteration 5: cos(pi / 10)
  EXPECT_NEAR(learning_rate(s, base, 10), 0.0505, kTol);                // iteration 9: cos(pi / 2) = 0
  EXPECT_NEAR(learning_rate(s, base, 15), 0.001, kTol);                 // iteration 14: cos_min_ratio
  EXPECT_NEAR(learning_rate(s, base, 17), 0.010453658778440095, kTol);  // past the end: not clamped
  s.warmup_type = "log";
  EXPECT_NEAR(learning_rate(s, base, 3), 0.07143455750373869, kTol);  // 0.1 (0.1 + 0.9 log 3 / log 5)
}

TEST(LearningRate, IsTheScheduledLrOfThePreviousIteration) {
  SchedulerConfig s;
  s.type = "WarmupDecayLR";
  s.total_num_steps = 50;
  s.warmup_num_steps = 7;
  EXPECT_NEAR(scheduled_lr(s, 1.0, -1), s.warmup_min_lr, kTol);
  for (int64_t step = 0; step < 60; ++step)
    EXPECT_EQ(learning_rate(s, 1.0, step), scheduled_lr(s, 1.0, step - 1)) << step;
}

TEST(LearningRate, FromAParsedConfig) {
  auto c = TrainConfig::from_json(json::parse(R"({"optimizer": {"params": {"lr": 0.5}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 0,
                    "cos_min_ratio": 0}}})"),
                                  "");
  // W = max(2, 0) = 2; iteration 1 is the log warmup's end, iteration 19 the cosine's (ratio 0).
  EXPECT_NEAR(learning_rate(c.scheduler, c.optimizer.lr, 2), 0.5, kTol);
  EXPECT_NEAR(learning_rate(c.scheduler, c.optimizer.lr, 20), 0.0, kTol);
}

}  // namespace
}  // namespace autotp
