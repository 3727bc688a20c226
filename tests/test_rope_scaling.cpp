// Rotary inverse frequencies for every rope_scaling type HF defines for the
// Llama family and Phi-3 (longrope), against closed-form values and the
// double-precision reference of tests/support (written from the formulas, not
// from the engine's code).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autotp/arch/model_config.h"
#include "autotp/arch/rope_scaling.h"
#include "autotp/base/error.h"
#include "support/reference_models.h"

namespace autotp {
namespace {

using nlohmann::json;

std::vector<double> values(const torch::Tensor& t) {
  auto d = t.to(torch::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

double plain(double theta, int64_t i, int64_t dim) { return std::pow(theta, -2.0 * i / dim); }

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rel, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], rel * std::abs(want[i])) << what << " frequency " << i;
}

RotaryFrequencies frequencies(const json& rope_scaling, double theta, int64_t dim, int64_t max_positions,
                              int64_t seq, const RopeScalingContext& context = {}) {
  return rotary_frequencies(RopeScaling::from_json(rope_scaling, "config.json", context), theta, dim,
                            max_positions, seq);
}

// The UserError's message reading `rope_scaling`, or "no error".
std::string error_message(const json& rope_scaling, const RopeScalingContext& context = {}) {
  try {
    RopeScaling::from_json(rope_scaling, "cfg/config.json", context);
  } catch (const UserError& e) {
    return std::string(e.what());
  }
  return std::string("no error");
}

RopeScalingContext top_level_context(int64_t original_max_positions) {
  RopeScalingContext context;
  context.original_max_position_embeddings = original_max_positions;
  return context;
}

TEST(RopeScaling, DefaultAndLinearAreTheClosedForm) {
  auto none = frequencies(nullptr, 10000.0, 128, 4096, 16);
  auto linear = frequencies({{"type", "linear"}, {"factor", 4.0}}, 10000.0, 128, 4096, 16);
  std::vector<double> want, quarter;
  for (int64_t i = 0; i < 64; ++i) {
    want.push_back(plain(10000.0, i, 128));
    quarter.push_back(plain(10000.0, i, 128) / 4);
  }
  expect_close(values(none.inv_freq), want, 1e-6, "default");
  expect_close(values(linear.inv_freq), quarter, 1e-6, "linear");
  EXPECT_EQ(none.attention_factor, 1.0);
  EXPECT_EQ(linear.attention_factor, 1.0);
}

// Llama 3.1 8B's rope_scaling: short wavelengths stay, long ones are divided by
// the factor, the band between is blended.
TEST(RopeScaling, Llama3KeepsShortWavelengthsAndDividesLongOnes) {
  const json rs = {{"rope_type", "llama3"},
                   {"factor", 8.0},
                   {"low_freq_factor", 1.0},
                   {"high_freq_factor", 4.0},
                   {"original_max_position_embeddings", 8192}};
  auto f = values(frequencies(rs, 500000.0, 128, 131072, 64).inv_freq);
  const double pi = std::acos(-1.0);
  int kept = 0, divided = 0, blended = 0;
  for (int64_t i = 0; i < 64; ++i) {
    const double p = plain(500000.0, i, 128), wavelen = 2 * pi / p;
    double want = p;
    if (wavelen > 8192) {
      want = p / 8, ++divided;
    } else if (wavelen >= 2048) {
      const double smooth = (8192 / wavelen - 1) / 3;
      want = (1 - smooth) * p / 8 + smooth * p, ++blended;
    } else {
      ++kept;
    }
    EXPECT_NEAR(f[i], want, 1e-6 * want) << "frequency " << i;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
  expect_close(f, test::reference_rope(rs, 500000.0, 128, 131072, 64).inv_freq, 1e-6, "reference");
}

TEST(RopeScaling, DynamicChangesTheBaseOnlyBeyondTheContext) {
  const json rs = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  auto within = values(frequencies(rs, 10000.0, 64, 1024, 1024).inv_freq);
  auto beyond = values(frequencies(rs, 10000.0, 64, 1024, 2048).inv_freq);
  // seq 2048 = 2 x 1024 at factor 2: base x (2 x 2 - 1)^(64 / 62).
  const double base = 10000.0 * std::pow(3.0, 64.0 / 62.0);
  for (int64_t i = 0; i < 32; ++i) {
    EXPECT_NEAR(within[i], plain(10000.0, i, 64), 1e-6 * plain(10000.0, i, 64));
    EXPECT_NEAR(beyond[i], plain(base, i, 64), 1e-5 * plain(base, i, 64));
  }
}

TEST(RopeScaling, YarnRampsBetweenTheCorrectionDimensions) {
  const json rs = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 4096}};
  auto r = frequencies(rs, 10000.0, 128, 16384, 32);
  EXPECT_NEAR(r.attention_factor, 0.1 * std::log(4.0) + 1, 1e-12);
  auto f = values(r.inv_freq);
  // Fast dimensions extrapolate (unchanged), slow ones interpolate (divided by the factor).
  EXPECT_NEAR(f[0], 1.0, 1e-6);
  EXPECT_NEAR(f[63], plain(10000.0, 63, 128) / 4, 1e-6 * f[63]);
  expect_close(f, test::reference_rope(rs, 10000.0, 128, 16384, 32).inv_freq, 1e-6, "reference");
  // mscale / mscale_all_dim (DeepSeek-style) and an explicit attention factor.
  auto ratio = frequencies({{"type", "yarn"}, {"factor", 4.0}, {"mscale", 0.707}, {"mscale_all_dim", 1.0}},
                           10000.0, 128, 4096, 32);
  EXPECT_NEAR(ratio.attention_factor, (0.1 * 0.707 * std::log(4.0) + 1) / (0.1 * std::log(4.0) + 1), 1e-12);
  EXPECT_EQ(frequencies({{"type", "yarn"}, {"factor", 4.0}, {"attention_factor", 1.5}}, 1e4, 128, 4096, 8)
                .attention_factor,
            1.5);
}

// Phi-3's longrope: one divisor per frequency, short_factor for sequences up to
// the pre-training context and long_factor beyond it.
TEST(RopeScaling, LongropeDividesByTheShortFactorsUpToTheContextAndByTheLongOnesBeyond) {
  const std::vector<double> short_factor = {1.0, 1.25, 2.5, 4.0}, long_factor = {1.5, 3.0, 7.0, 16.0};
  const json rs = {{"rope_type", "longrope"},
                   {"short_factor", short_factor},
                   {"long_factor", long_factor},
                   {"original_max_position_embeddings", 32}};
  auto closed_form = [](const std::vector<double>& divisors) {
    std::vector<double> want;
    for (int64_t i = 0; i < 4; ++i) want.push_back(1 / (divisors[i] * std::pow(10000.0, 2.0 * i / 8)));
    return want;
  };
  const auto short_want = closed_form(short_factor), long_want = closed_form(long_factor);
  expect_close(values(frequencies(rs, 10000.0, 8, 128, 1).inv_freq), short_want, 1e-6, "seq 1");
  expect_close(values(frequencies(rs, 10000.0, 8, 128, 32).inv_freq), short_want, 1e-6, "seq 32 = context");
  expect_close(values(frequencies(rs, 10000.0, 8, 128, 33).inv_freq), long_want, 1e-6, "seq 33");
  // The top-level key (Phi3Config's place for it) wins over rope_scaling's.
  const RopeScaling phi3 = RopeScaling::from_json(rs, "config.json", top_level_context(64));
  EXPECT_EQ(phi3.original_max_positions, 64);
  expect_close(values(rotary_frequencies(phi3, 10000.0, 8, 128, 64).inv_freq), short_want, 1e-6, "seq 64");
  expect_close(values(rotary_frequencies(phi3, 10000.0, 8, 128, 65).inv_freq), long_want, 1e-6, "seq 65");
  // Neither: the context is max_position_embeddings.
  json no_context = rs;
  no_context.erase("original_max_position_embeddings");
  expect_close(values(frequencies(no_context, 10000.0, 8, 128, 128).inv_freq), short_want, 1e-6, "seq 128");
  expect_close(values(frequencies(no_context, 10000.0, 8, 128, 129).inv_freq), long_want, 1e-6, "seq 129");
}

TEST(RopeScaling, LongropeAttentionFactorGrowsWithTheLogOfTheExtension) {
  const json rs = {{"rope_type", "longrope"}, {"short_factor", {1.0, 1.0}}, {"long_factor", {2.0, 2.0}}};
  auto attention = [&](const json& extra, int64_t max_positions, int64_t seq,
                       const RopeScalingContext& context) {
    json r = rs;
    r.update(extra);
    return frequencies(r, 10000.0, 4, max_positions, seq, context).attention_factor;
  };
  // Phi-3-mini-128k: no factor, so 131072 / 4096 = 32 = 2^5 over a context of 2^12.
  const double phi3 = std::sqrt(1 + 5.0 / 12.0);
  EXPECT_NEAR(attention(json::object(), 131072, 16, top_level_context(4096)), phi3, 1e-12);
  EXPECT_NEAR(attention(json::object(), 131072, 8192, top_level_context(4096)), phi3, 1e-12);  // long factors
  EXPECT_NEAR(attention({{"original_max_position_embeddings", 4096}}, 131072, 16, {}), phi3, 1e-12);
  // A given factor wins over the ratio (transformers 5).
  EXPECT_NEAR(attention({{"factor", 2.0}}, 131072, 16, top_level_context(4096)),
              std::sqrt(1 + std::log(2.0) / std::log(4096.0)), 1e-12);
  // factor <= 1: no scaling.
  EXPECT_EQ(attention(json::object(), 4096, 16, {}), 1.0);  // context = max_position_embeddings
  EXPECT_EQ(attention({{"factor", 1.0}}, 131072, 16, top_level_context(4096)), 1.0);
  EXPECT_EQ(attention({{"factor", 0.5}}, 131072, 16, top_level_context(4096)), 1.0);
  EXPECT_EQ(attention({{"attention_factor", 1.5}}, 131072, 16, top_level_context(4096)), 1.5);
}

TEST(RopeScaling, LongropeConfigErrorsNameTheKey) {
  const json three = {1.0, 1.0, 1.0}, four = {1.0, 1.0, 1.0, 1.0};
  RopeScalingContext head_dim_8;
  head_dim_8.head_dim = 8;
  const std::string wrong_length =
      error_message({{"rope_type", "longrope"}, {"short_factor", four}, {"long_factor", three}}, head_dim_8);
  EXPECT_NE(
      wrong_length.find("cfg/config.json: rope_scaling.long_factor has 3 values (expected head_dim / 2 = 4)"),
      std::string::npos)
      << wrong_length;
  // Read without the head_dim, the tables check it.
  const RopeScaling unchecked = RopeScaling::from_json(
      {{"rope_type", "longrope"}, {"short_factor", three}, {"long_factor", four}}, "c");
  try {
    rotary_frequencies(unchecked, 10000.0, 8, 64, 16);
    ADD_FAILURE() << "no error for a short_factor of 3 values at head_dim 8";
  } catch (const UserError& e) {
    EXPECT_NE(
        std::string(e.what()).find("rope_scaling.short_factor has 3 values (expected head_dim / 2 = 4)"),
        std::string::npos)
        << e.what();
  }
  EXPECT_NE(error_message({{"rope_type", "longrope"}, {"long_factor", four}}, head_dim_8)
                .find("cfg/config.json: rope_scaling.short_factor is missing"),
            std::string::npos);
  EXPECT_NE(error_message({{"rope_type", "longrope"}, {"short_factor", "1"}, {"long_factor", four}})
                .find("rope_scaling.short_factor is \"1\" (allowed: a list of numbers > 0)"),
            std::string::npos);
  EXPECT_NE(
      error_message({{"rope_type", "longrope"}, {"short_factor", {1.0, 0.0}}, {"long_factor", {1.0, 1.0}}})
          .find("rope_scaling.short_factor is [1.0,0.0] (allowed: a list of numbers > 0)"),
      std::string::npos);
  EXPECT_NE(error_message(
                {{"rope_type", "longrope"}, {"short_factor", four}, {"long_factor", four}, {"beta_fast", 32}})
                .find("beta_fast"),
            std::string::npos);
  EXPECT_NE(
      error_message({{"rope_type", "longrope"}, {"short_factor", four}, {"long_factor", four}, {"factor", 0}})
          .find("rope_scaling.factor is 0"),
      std::string::npos);
  EXPECT_NE(error_message({{"rope_type", "longrope"}, {"short_factor", four}, {"long_factor", four}},
                          top_level_context(0))
                .find("original_max_position_embeddings is 0"),
            std::string::npos);
  EXPECT_EQ(
      error_message({{"rope_type", "longrope"}, {"short_factor", four}, {"long_factor", four}}, head_dim_8),
      "no error");
  // llama3 may take its context from the top level too.
  EXPECT_EQ(
      error_message(
          {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}},
          top_level_context(8192)),
      "no error");
}

TEST(RopeScaling, BadConfigsNameTheKey) {
  const auto message = [](const json& rs) { return error_message(rs); };
  EXPECT_NE(message({{"type", "su"}, {"factor", 2.0}})
                .find("'su' is not supported (allowed: default, linear, dynamic, yarn, llama3, longrope)"),
            std::string::npos);
  EXPECT_NE(message({{"rope_type", "linear"}, {"factor", 2.0}, {"fator", 1}}).find("fator"), std::string::npos);
  EXPECT_NE(message({{"rope_type", "llama3"}, {"factor", 8.0}}).find("rope_scaling.low_freq_factor is missing"),
            std::string::npos);
  EXPECT_NE(message({{"rope_type", "linear"}}).find("rope_scaling.factor is missing"), std::string::npos);
  EXPECT_NE(message({{"rope_type", "yarn"}, {"factor", 0.5}}).find("factor"), std::string::npos);
  EXPECT_NE(message({{"rope_type", "linear"}, {"factor", 2.0}}).find("no error"), std::string::npos);
  // A model config carries it through.
  json config = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 10}, {"hidden_size", 8},
                 {"intermediate_size", 8}, {"num_hidden_layers", 1}, {"num_attention_heads", 2},
                 {"rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}}};
  EXPECT_EQ(ModelConfig::from_json(config, "config.json").rope_scaling.type, "linear");
}

}  // namespace
}  // namespace autotp
