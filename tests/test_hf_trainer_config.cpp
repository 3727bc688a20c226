// HF-Trainer DeepSpeed configs: "auto" values filled as transformers' DeepSpeed
// integration fills them, contradictions and unfillable "auto"s refused.
#include <gtest/gtest.h>

#include "autotp/base/error.h"
#include "autotp/base/json_file.h"
#include "autotp/runtime/hf_trainer_config.h"
#include "autotp/runtime/train_config.h"

namespace autotp {
namespace {

using nlohmann::json;

const std::string kAlpaca = AUTOTP_SOURCE_DIR "/tests/data/deepspeed/stanford_alpaca_default_offload_opt_param.json";

// stanford_alpaca's README command line (train.py with --deepspeed), plus --max_steps.
HfTrainingArguments alpaca_command_line() {
  HfTrainingArguments a;
  a.per_device_train_batch_size = 4;
  a.gradient_accumulation_steps = 8;
  a.learning_rate = 2e-5;
  a.weight_decay = 0.0;
  a.warmup_ratio = 0.03;
  a.bf16 = true;
  a.max_steps = 100;
  a.max_steps_from_hf_flag = true;
  return a;
}

std::string error_of(const json& config, const HfTrainingArguments& args, const HfResolveContext& context = {}) {
  try {
    resolve_hf_trainer_config(config, args, context, "ds.json");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(HfTrainerConfig, StanfordAlpacaAtTp2ResolvesAsTheHfTrainer) {
  json config = read_json_file(kAlpaca, "config");
  config["tensor_parallel"] = {{"autotp_size", 2}};
  HfResolveContext context;
  context.world_size = 4;    // 2 data-parallel ranks
  context.hidden_size = 4096;  // Llama-2-7B
  const auto resolved = resolve_hf_trainer_config(config, alpaca_command_line(), context, kAlpaca);
  const json& c = resolved.config;
  EXPECT_EQ(c["train_micro_batch_size_per_gpu"], 4);
  EXPECT_EQ(c["gradient_accumulation_steps"], 8);
  EXPECT_EQ(c["train_batch_size"], 4 * 8 * 2);  // data-parallel ranks, not the world (DeepSpeed #7298)
  EXPECT_EQ(c["gradient_clipping"], 1.0);
  EXPECT_EQ(c["optimizer"]["params"]["lr"], 2e-5);
  EXPECT_EQ(c["optimizer"]["params"]["betas"], json({0.9, 0.999}));
  EXPECT_EQ(c["optimizer"]["params"]["eps"], 1e-8);
  EXPECT_EQ(c["optimizer"]["params"]["weight_decay"], 0.0);
  EXPECT_EQ(c["scheduler"]["params"]["warmup_min_lr"], 0);
  EXPECT_EQ(c["scheduler"]["params"]["warmup_max_lr"], 2e-5);
  EXPECT_EQ(c["scheduler"]["params"]["total_num_steps"], 100);
  EXPECT_EQ(c["scheduler"]["params"]["warmup_num_steps"], 3);  // ceil(100 x 0.03)
  EXPECT_EQ(c["bf16"]["enabled"], true);
  EXPECT_EQ(c["zero_optimization"]["reduce_bucket_size"], 4096 * 4096);
  EXPECT_EQ(c["zero_optimization"]["stage3_prefetch_bucket_size"], 15099494);  // int(0.9 x 4096^2)
  EXPECT_EQ(c["zero_optimization"]["stage3_param_persistence_threshold"], 40960);
  // The keys without "auto" are untouched, and the result is a config TrainConfig reads.
  EXPECT_EQ(c["zero_optimization"]["sub_group_size"], 1e9);
  EXPECT_EQ(c["steps_per_print"], 5);
  EXPECT_EQ(resolved.filled.size(), 16u);
  TrainConfig train = TrainConfig::from_json(c, kAlpaca);
  train.resolve_batch(4);
  EXPECT_EQ(train.zero.stage, 3);
  EXPECT_EQ(train.zero.offload_optimizer_device, "cpu");
  EXPECT_EQ(train.zero.offload_param_device, "cpu");
  EXPECT_EQ(train.zero.stage3_max_live_parameters, 1000000000);
  EXPECT_TRUE(train.bf16);
  EXPECT_EQ(train.scheduler.type, "WarmupDecayLR");
  EXPECT_EQ(train.scheduler.warmup_num_steps, 3);
}

TEST(HfTrainerConfig, AutoTakesTrainingArgumentsDefaultsWithoutFlags) {
  const json config = read_json_file(kAlpaca, "config");
  HfTrainingArguments args;
  args.max_steps = 10;  // autotp's --steps: fills total_num_steps, never compared
  HfResolveContext context;
  context.world_size = 2;
  context.hidden_size = 64;
  const json c = resolve_hf_trainer_config(config, args, context, "ds.json").config;
  EXPECT_EQ(c["train_micro_batch_size_per_gpu"], 8);
  EXPECT_EQ(c["gradient_accumulation_steps"], 1);
  EXPECT_EQ(c["train_batch_size"], 16);
  EXPECT_EQ(c["optimizer"]["params"]["lr"], 5e-5);
  EXPECT_EQ(c["bf16"]["enabled"], false);
  EXPECT_EQ(c["scheduler"]["params"]["warmup_num_steps"], 1);  // max(1, 0), as transformers 5
  EXPECT_EQ(c["zero_optimization"]["reduce_bucket_size"], 64 * 64);
}

TEST(HfTrainerConfig, WarmupStepsBelowOneAreARatioAsInTransformers5) {
  const json config = {{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", "auto"}}}}},
                       {"train_batch_size", 8}};
  HfTrainingArguments args;
  args.max_steps = 50;
  args.warmup_steps = 0.1;
  EXPECT_EQ(resolve_hf_trainer_config(config, args, {}, "ds.json").config["scheduler"]["params"]["warmup_num_steps"], 5);
  args.warmup_steps = 7;
  EXPECT_EQ(resolve_hf_trainer_config(config, args, {}, "ds.json").config["scheduler"]["params"]["warmup_num_steps"], 7);
}

TEST(HfTrainerConfig, WarmupNumbersAreComparedOnlyWithAWarmupTheFlagsDetermine) {
  const json config = {{"train_batch_size", 8},
                       {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 30}}}}}};
  HfTrainingArguments args;
  args.warmup_ratio = 0.03;  // a ratio, and no step count to apply it to
  EXPECT_EQ(error_of(config, args), "");
  const json zero = {{"train_batch_size", 8}, {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 0}}}}}};
  args = {};
  args.warmup_steps = 0;  // equal to the config's 0: the floor of 1 is for filling "auto" only
  EXPECT_EQ(error_of(zero, args), "");
  args.warmup_steps = 5;
  EXPECT_NE(error_of(zero, args).find("scheduler.params.warmup_num_steps is 0 but --warmup_steps / --warmup_ratio is 5"),
            std::string::npos);
}

TEST(HfTrainerConfig, NumbersThatContradictAFlagAreOneErrorListingEach) {
  const json config = {{"train_micro_batch_size_per_gpu", 2},
                       {"gradient_clipping", 0.5},
                       {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                       {"scheduler", {{"type", "WarmupDecayLR"}, {"params", {{"total_num_steps", 40}}}}}};
  HfTrainingArguments args;
  args.learning_rate = 2e-5;
  args.per_device_train_batch_size = 4;
  args.max_steps = 20;
  args.max_steps_from_hf_flag = true;
  const std::string error = error_of(config, args);
  EXPECT_NE(error.find("ds.json: 3 values of the config contradict the command line"), std::string::npos) << error;
  EXPECT_NE(error.find("train_micro_batch_size_per_gpu is 2 but --per_device_train_batch_size is 4"), std::string::npos)
      << error;
  EXPECT_NE(error.find("optimizer.params.lr is 0.001 but --learning_rate is 2e-05"), std::string::npos) << error;
  EXPECT_NE(error.find("scheduler.params.total_num_steps is 40 but --max_steps is 20"), std::string::npos) << error;
  // Without the flags the config's own numbers stand (the clipping was never contradicted).
  EXPECT_EQ(error_of(config, {}), "");
  // autotp's --steps trains a part of a longer schedule: not a contradiction.
  args = {};
  args.max_steps = 20;
  EXPECT_EQ(error_of(config, args), "");
}

TEST(HfTrainerConfig, AnAutoNothingFillsNamesTheKeyAndTheFlag) {
  json config = {{"train_batch_size", 8}, {"steps_per_print", "auto"}};
  std::string error = error_of(config, {});
  EXPECT_NE(error.find("ds.json: steps_per_print is \"auto\", which the HF Trainer does not fill"), std::string::npos)
      << error;
  config = {{"train_batch_size", 8},
            {"scheduler", {{"type", "WarmupDecayLR"}, {"params", {{"total_num_steps", "auto"}}}}}};
  error = error_of(config, {});
  EXPECT_NE(error.find("scheduler.params.total_num_steps is \"auto\" and the number of steps is not given (give "
                       "--max_steps or --steps)"),
            std::string::npos)
      << error;
}

TEST(HfTrainerConfig, FlagsSetKeysTheConfigLacks) {
  const json config = {{"zero_optimization", {{"stage", 1}}}};
  HfTrainingArguments args;
  args.per_device_train_batch_size = 2;
  args.learning_rate = 3e-4;
  args.bf16 = true;
  const json c = resolve_hf_trainer_config(config, args, {}, "ds.json").config;
  EXPECT_EQ(c["train_micro_batch_size_per_gpu"], 2);
  EXPECT_EQ(c["optimizer"]["type"], "AdamW");  // the HF Trainer's own optimizer
  EXPECT_EQ(c["optimizer"]["params"]["lr"], 3e-4);
  EXPECT_EQ(c["bf16"]["enabled"], true);
  // A flag cannot go under a section that is not an object: one clear error.
  HfTrainingArguments lr;
  lr.learning_rate = 1e-4;
  EXPECT_NE(error_of({{"optimizer", "adam"}, {"train_batch_size", 8}}, lr)
                .find("ds.json: cannot set optimizer.params.lr from the command line"),
            std::string::npos);
  // No flag, no auto: unchanged.
  EXPECT_EQ(resolve_hf_trainer_config(config, {}, {}, "ds.json").config, config);
}

TEST(HfTrainerConfig, OffloadToNvmeIsRefusedNamingWhatToUse) {
  json config = read_json_file(kAlpaca, "config");
  config["zero_optimization"]["offload_param"]["device"] = "nvme";
  HfTrainingArguments args;
  args.max_steps = 10;
  const json resolved = resolve_hf_trainer_config(config, args, {1, 64}, "ds.json").config;
  try {
    TrainConfig::from_json(resolved, "ds.json");
    FAIL() << "nvme accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("ds.json: zero_optimization.offload_param.device is \"nvme\" (allowed: cpu or "
                                         "none: offloading to NVMe is not supported; use \"device\": \"cpu\")"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace autotp
