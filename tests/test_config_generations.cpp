// config.json of both transformers generations (4.57.6 and 5.25.0, as saved in
// tests/data/hf_models) reads into the same ModelConfig; transformers 5's
// rope_parameters, dtype and num_local_experts are read as transformers 5.25
// reads them, and what autotp does not implement is one clear error.
#include <gtest/gtest.h>

#include "autotp/arch/model_config.h"
#include "autotp/base/error.h"
#include "autotp/base/json_file.h"
#include "autotp/io/hf_writer.h"

namespace autotp {
namespace {

using nlohmann::json;

const std::string kFixtures = AUTOTP_SOURCE_DIR "/tests/data/hf_models/";

json fixture_config(const std::string& name) { return read_json_file(kFixtures + name + "/config.json", "config"); }

std::string error_of(const json& config) {
  try {
    ModelConfig::from_json(config, "dir/config.json");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

class ConfigGenerations : public ::testing::TestWithParam<std::string> {};

TEST_P(ConfigGenerations, BothGenerationsReadAlike) {
  const ModelConfig v4 = ModelConfig::from_json(fixture_config(GetParam() + "_v4"), "v4");
  const ModelConfig v5 = ModelConfig::from_json(fixture_config(GetParam() + "_v5"), "v5");
  EXPECT_EQ(v4.generation, 4);
  EXPECT_EQ(v5.generation, 5);
  EXPECT_EQ(v4.rope_theta, v5.rope_theta);
  EXPECT_EQ(v4.local_rope_theta, v5.local_rope_theta);
  EXPECT_EQ(v4.rope_scaling.type, v5.rope_scaling.type);
  EXPECT_EQ(v4.rope_scaling.factor, v5.rope_scaling.factor);
  EXPECT_EQ(v4.rope_scaling.original_max_positions, v5.rope_scaling.original_max_positions);
  EXPECT_EQ(v4.rope_scaling.short_factor, v5.rope_scaling.short_factor);
  EXPECT_EQ(v4.rope_scaling.long_factor, v5.rope_scaling.long_factor);
  EXPECT_EQ(v4.num_experts, v5.num_experts);
  EXPECT_EQ(v4.experts_per_token, v5.experts_per_token);
  EXPECT_EQ(v4.sparse_layers, v5.sparse_layers);
  EXPECT_EQ(v4.layer_sliding_window, v5.layer_sliding_window);
  EXPECT_EQ(v4.head_dim, v5.head_dim);
  EXPECT_EQ(v4.tie_word_embeddings, v5.tie_word_embeddings);
  EXPECT_EQ(v4.torch_dtype, "float32");
  EXPECT_EQ(v5.torch_dtype, "float32");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ConfigGenerations,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral",
                                           "qwen2_moe", "qwen3_moe", "gpt2"));

TEST(ConfigGenerations, Transformers5SettingsAreReadNotDefaulted) {
  // Qwen3-MoE: transformers 5 writes num_local_experts; num_experts' default would be 128.
  EXPECT_EQ(ModelConfig::from_json(fixture_config("qwen3_moe_v5"), "c").num_experts, 4);
  // Gemma 3: one rope_parameters entry per layer type.
  const ModelConfig gemma3 = ModelConfig::from_json(fixture_config("gemma3_v5"), "c");
  EXPECT_EQ(gemma3.rope_theta, 1000000.0);
  EXPECT_EQ(gemma3.rope_scaling.type, "linear");
  EXPECT_EQ(gemma3.rope_scaling.factor, 2.0);
  EXPECT_EQ(gemma3.local_rope_theta, 10000.0);
  const ModelConfig llama = ModelConfig::from_json(fixture_config("llama_v5"), "c");
  EXPECT_EQ(llama.rope_theta, 500000.0);
  EXPECT_EQ(llama.rope_scaling.type, "llama3");
  EXPECT_EQ(llama.rope_scaling.original_max_positions, 8);
}

TEST(ConfigGenerations, BothFormsAreReadAsTransformers5ReadsThem) {
  // Checked against transformers 5.25's AutoConfig: a non-empty rope_scaling replaces
  // rope_parameters, and rope_theta then comes from the top level (else the default).
  json config = fixture_config("llama_v5");
  config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 4.0}};
  ModelConfig c = ModelConfig::from_json(config, "c");
  EXPECT_EQ(c.rope_scaling.type, "linear");
  EXPECT_EQ(c.rope_scaling.factor, 4.0);
  EXPECT_EQ(c.rope_theta, 10000.0);
  // A top-level rope_theta beside rope_parameters' own: rope_parameters wins.
  config = fixture_config("llama_v5");
  config["rope_theta"] = 1234.0;
  EXPECT_EQ(ModelConfig::from_json(config, "c").rope_theta, 500000.0);
  // Gemma 3: rope_scaling's keys are merged into the full_attention entry.
  config = fixture_config("gemma3_v5");
  config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  c = ModelConfig::from_json(config, "c");
  EXPECT_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.rope_theta, 1000000.0);
  // dtype wins over torch_dtype.
  config = fixture_config("llama_v5");
  config["torch_dtype"] = "bfloat16";
  EXPECT_EQ(ModelConfig::from_json(config, "c").torch_dtype, "float32");
}

TEST(ConfigGenerations, UnsupportedRopeParametersNameTheKey) {
  json config = fixture_config("llama_v5");
  config["rope_parameters"]["rope_type"] = "dynamic_ntk_plus";
  EXPECT_NE(error_of(config).find("dir/config.json: rope_parameters type 'dynamic_ntk_plus' is not supported (allowed: "
                                  "default, linear, dynamic, yarn, llama3, longrope)"),
            std::string::npos)
      << error_of(config);
  config = fixture_config("llama_v5");
  config["rope_parameters"]["partial_rotary_factor"] = 0.5;
  EXPECT_NE(error_of(config).find("dir/config.json: rope_parameters.partial_rotary_factor 0.5 is not supported"),
            std::string::npos)
      << error_of(config);
  config = fixture_config("llama_v5");
  config["rope_parameters"]["factor"] = "eight";
  EXPECT_NE(error_of(config).find("rope_parameters.factor must be a number"), std::string::npos) << error_of(config);
  config = fixture_config("gemma3_v5");
  config["rope_parameters"]["sliding_attention"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  EXPECT_NE(error_of(config).find("rope_parameters.sliding_attention.rope_type 'linear' is not supported (allowed: "
                                  "default"),
            std::string::npos)
      << error_of(config);
  // Per layer type on another architecture: only when every layer type rotates alike.
  config = fixture_config("qwen2_moe_v5");
  const json flat = config["rope_parameters"];
  config["rope_parameters"] = {{"full_attention", flat}, {"sliding_attention", flat}};
  EXPECT_EQ(error_of(config), "");
  config["rope_parameters"]["sliding_attention"]["rope_theta"] = 10.0;
  EXPECT_NE(error_of(config).find("rope_parameters.sliding_attention differs from rope_parameters.full_attention"),
            std::string::npos)
      << error_of(config);
  config = fixture_config("qwen3_moe_v5");
  config["num_experts"] = 8;
  EXPECT_NE(error_of(config).find("num_experts 8 and num_local_experts 4 disagree"), std::string::npos)
      << error_of(config);
}

TEST(ConfigGenerations, ExportSetsTheDtypeKeyOfTheGeneration) {
  json config = {{"dtype", "float32"}};
  io::set_config_dtype(config, "bfloat16");
  EXPECT_EQ(config, json({{"dtype", "bfloat16"}}));
  config = {{"torch_dtype", "float32"}};
  io::set_config_dtype(config, "bfloat16");
  EXPECT_EQ(config, json({{"torch_dtype", "bfloat16"}}));
  config = {{"transformers_version", "5.25.0"}};
  io::set_config_dtype(config, "float16");
  EXPECT_EQ(config["dtype"], "float16");
  config = {{"transformers_version", "4.40.0"}};
  io::set_config_dtype(config, "float16");
  EXPECT_EQ(config["torch_dtype"], "float16");
}

}  // namespace
}  // namespace autotp
