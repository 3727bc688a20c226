// Where a parameter name sits in the architecture (arch/layer_names.h): the one
// rule ZeRO's units, the tp step traffic and the simulator read decoder layers by.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "autotp/arch/layer_names.h"
#include "autotp/arch/param_layout.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

TEST(DecoderLayerName, LayerIndexAndTheNameWithinTheLayer) {
  auto expect = [](const std::string& name, int64_t layer, const std::string& within) {
    SCOPED_TRACE(name);
    const DecoderLayerName n = decoder_layer_name(name);
    EXPECT_EQ(n.layer, layer);
    EXPECT_EQ(n.within, within);
    EXPECT_EQ(decoder_layer_of(name), layer);
  };
  expect("model.layers.3.self_attn.q_proj.weight", 3, "self_attn.q_proj.weight");
  expect("transformer.h.11.attn.c_attn.weight", 11, "attn.c_attn.weight");
  expect("transformer.h.0.ln_1.bias", 0, "ln_1.bias");
  // A checkpoint saved from the base model: no prefix.
  expect("layers.7.mlp.down_proj.weight", 7, "mlp.down_proj.weight");
  expect("h.2.mlp.c_fc.weight", 2, "mlp.c_fc.weight");
  // The first layer component decides.
  expect("model.layers.1.h.0.mlp.weight", 1, "h.0.mlp.weight");
  // Outside the decoder layers.
  expect("model.norm.weight", -1, "");
  expect("model.embed_tokens.weight", -1, "");
  expect("lm_head.weight", -1, "");
  expect("transformer.wte.weight", -1, "");
  expect("transformer.ln_f.weight", -1, "");
  // Not a layer component: no dot before it, no index, or no dot after the index.
  expect("model.xlayers.3.mlp.weight", -1, "");
  expect("model.layers.x.mlp.weight", -1, "");
  expect("model.layers.3", -1, "");
}

TEST(DecoderLayerName, EveryParameterOfEveryArchitecture) {
  for (const std::string preset : {"llama-tiny", "qwen2-tiny", "mistral-tiny", "gpt2-tiny"}) {
    SCOPED_TRACE(preset);
    const auto config = ModelConfig::from_json(test::preset_config(preset), "preset:" + preset);
    const std::string layers = config.family == ModelFamily::kGpt2 ? "transformer.h" : "model.layers";
    std::vector<int64_t> per_layer(config.num_layers, 0);
    int64_t outside = 0;
    for (const auto& d : describe_parameters(config)) {
      const DecoderLayerName n = decoder_layer_name(d.name);
      if (n.layer < 0) {
        ++outside;
        EXPECT_EQ(d.name.rfind(layers + ".", 0), std::string::npos) << d.name;
        continue;
      }
      ASSERT_LT(n.layer, config.num_layers) << d.name;
      ++per_layer[n.layer];
      EXPECT_EQ(fmt::format("{}.{}.{}", layers, n.layer, n.within), d.name);
    }
    EXPECT_GT(outside, 0);
    for (int64_t count : per_layer) EXPECT_EQ(count, per_layer[0]);  // every layer has the same parameters
    EXPECT_GT(per_layer[0], 0);
  }
}

}  // namespace
}  // namespace autotp
