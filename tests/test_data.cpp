// Data pipeline: every file format down to exact token ids and label masks,
// one test per kind of bad file, the distributed sampler's layout and order,
// collate and the batch fingerprint.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <set>

#include "autotp/data/batch.h"
#include "autotp/data/dataset.h"
#include "autotp/data/sampler.h"
#include "autotp/base/error.h"

namespace autotp {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int64_t>;
constexpr int64_t X = kIgnoreLabel;
constexpr int64_t BOS = 256, EOS = 257, PAD = 257;

// Runs `action`, expects a UserError, and checks its message holds every part.
template <typename Action>
void expect_user_error(Action&& action, std::initializer_list<std::string> parts) {
  try {
    action();
  } catch (const UserError& e) {
    const std::string message = e.what();
    for (const auto& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a UserError, got: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected a UserError, nothing was thrown";
}

// A fresh directory per test, removed afterwards.
class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "autotp-data-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr) << std::strerror(errno);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string path = (fs::path(dir_) / name).string();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path;
  }
  template <typename T>
  std::string write_tokens(const std::string& name, const std::vector<T>& tokens) const {
    return write(name, std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(T)));
  }

  // Instruction records in the plain template: their masks are easy to spell out byte by byte.
  static DataOptions options(int64_t seq_len, int64_t vocab_size = 259) {
    DataOptions o;
    o.sft.prompt_template = "plain";
    o.seq_len = seq_len;
    o.vocab_size = vocab_size;
    return o;
  }

  std::string dir_;
};

void expect_example(const Dataset& data, int64_t index, const Ids& inputs, const Ids& labels) {
  const Example example = data.get(index);
  EXPECT_EQ(example.input_ids, inputs) << "example " << index;
  EXPECT_EQ(example.labels, labels) << "example " << index;
}

// ---------------------------------------------------------------- .txt

TEST_F(DataTest, TextIsBosBytesEos) {
  auto data = open_dataset(write("hi.txt", "hi"), options(3));
  ASSERT_EQ(data->size(), 1);
  EXPECT_EQ(data->seq_len(), 3);
  expect_example(*data, 0, {BOS, 'h', 'i'}, {'h', 'i', EOS});
}

TEST_F(DataTest, TextPacksConsecutiveChunksOfSeqLenPlusOne) {
  // 8 tokens: BOS a b c d e f EOS -> two full chunks of 4, no padding.
  auto data = open_dataset(write("a.txt", "abcdef"), options(3));
  ASSERT_EQ(data->size(), 2);
  expect_example(*data, 0, {BOS, 'a', 'b'}, {'a', 'b', 'c'});
  expect_example(*data, 1, {'d', 'e', 'f'}, {'e', 'f', EOS});
}

TEST_F(DataTest, TextPadsTheLastChunkAndIgnoresItsPaddedLabels) {
  // 7 tokens, chunks of 5: [BOS a b c d] [e EOS] -> the second padded by 3.
  auto data = open_dataset(write("a.txt", "abcde"), options(4));
  ASSERT_EQ(data->size(), 2);
  expect_example(*data, 0, {BOS, 'a', 'b', 'c'}, {'a', 'b', 'c', 'd'});
  expect_example(*data, 1, {'e', EOS, PAD, PAD}, {EOS, X, X, X});
  EXPECT_NE(data->describe().find("padded"), std::string::npos) << data->describe();
}

TEST_F(DataTest, TextDropsATrailingSingleTokenChunk) {
  // 9 tokens, chunks of 4: the ninth (EOS) alone would have no target.
  auto data = open_dataset(write("a.txt", "abcdefg"), options(3));
  ASSERT_EQ(data->size(), 2);
  expect_example(*data, 1, {'d', 'e', 'f'}, {'e', 'f', 'g'});
}

TEST_F(DataTest, TextIsRawBytes) {
  auto data = open_dataset(write("u.txt", "\xc3\xa9\n"), options(4));
  expect_example(*data, 0, {BOS, 0xc3, 0xa9, '\n'}, {0xc3, 0xa9, '\n', EOS});
}

TEST_F(DataTest, TextErrors) {
  const std::string empty = write("empty.txt", "");
  expect_user_error([&] { open_dataset(empty, options(4)); }, {empty, "empty"});
  const std::string text = write("t.txt", "hello");
  expect_user_error([&] { open_dataset(text, options(0)); }, {text, "seq_len"});
  expect_user_error([&] { open_dataset(text, options(4, 257)); }, {text, "258", "257"});
  DataOptions big_pad = options(4);
  big_pad.pad_id = 300;
  expect_user_error([&] { open_dataset(text, big_pad); }, {text, "301"});
  expect_user_error([&] { open_dataset(text, options(4, 0)); }, {text, "vocab_size"});
  const std::string missing = (fs::path(dir_) / "missing.txt").string();
  expect_user_error([&] { open_dataset(missing, options(4)); }, {missing});
  const std::string csv = write("data.csv", "1,2,3");
  expect_user_error([&] { open_dataset(csv, options(4)); }, {csv, ".csv"});
}

// ---------------------------------------------------------------- .jsonl

TEST_F(DataTest, JsonlTextRecordsAreConcatenatedAndPacked) {
  const std::string path = write("t.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"bc\", \"id\": 7}\n");
  auto data = open_dataset(path, options(3));
  // BOS a EOS BOS b c EOS -> [BOS a EOS BOS] [b c EOS]
  ASSERT_EQ(data->size(), 2);
  expect_example(*data, 0, {BOS, 'a', EOS}, {'a', EOS, BOS});
  expect_example(*data, 1, {'b', 'c', EOS}, {'c', EOS, X});
  EXPECT_NE(data->describe().find("2 text records"), std::string::npos) << data->describe();
}

TEST_F(DataTest, JsonlInstructionMasksThePrompt) {
  const std::string path = write("i.jsonl",
                                 "{\"instruction\": \"I\", \"input\": \"x\", \"output\": \"O\"}\n"
                                 "{\"instruction\": \"I\", \"output\": \"OK\"}\n"
                                 "{\"instruction\": \"I\", \"input\": \"\", \"output\": \"O\"}\n"
                                 "{\"instruction\": \"I\", \"input\": null, \"output\": \"O\"}\n");
  auto data = open_dataset(path, options(8));
  ASSERT_EQ(data->size(), 4);
  // BOS "I\nx\n" | "O" EOS: labels learn only O and EOS; padded positions ignored.
  expect_example(*data, 0, {BOS, 'I', '\n', 'x', '\n', 'O', EOS, PAD}, {X, X, X, X, 'O', EOS, X, X});
  // No input: prompt is "I\n".
  expect_example(*data, 1, {BOS, 'I', '\n', 'O', 'K', EOS, PAD, PAD}, {X, X, 'O', 'K', EOS, X, X, X});
  // An empty or null input is the same as none.
  expect_example(*data, 2, {BOS, 'I', '\n', 'O', EOS, PAD, PAD, PAD}, {X, X, 'O', EOS, X, X, X, X});
  expect_example(*data, 3, {BOS, 'I', '\n', 'O', EOS, PAD, PAD, PAD}, {X, X, 'O', EOS, X, X, X, X});
}

TEST_F(DataTest, JsonlInstructionTruncatesAndSkipsRecordsWithNoOutputLeft) {
  const std::string path = write("i.jsonl",
                                 "{\"instruction\": \"I\", \"input\": \"x\", \"output\": \"OK\"}\n"
                                 "{\"instruction\": \"a long prompt\", \"output\": \"O\"}\n");
  auto data = open_dataset(path, options(5));
  // BOS I \n x \n O K EOS cut to 6 tokens; the second record's prompt fills the window.
  ASSERT_EQ(data->size(), 1);
  expect_example(*data, 0, {BOS, 'I', '\n', 'x', '\n'}, {X, X, X, X, 'O'});
  EXPECT_NE(data->describe().find("1 of them truncated; 1 records skipped"), std::string::npos)
      << data->describe();
  expect_user_error([&] { open_dataset(path, options(2)); }, {path, "seq_len 2"});
}

TEST_F(DataTest, JsonlErrorsNameTheLine) {
  const std::string bad_json = write("bad.jsonl", "{\"text\": \"a\"}\n{\"text\": \"a\"\n");
  expect_user_error([&] { open_dataset(bad_json, options(4)); }, {bad_json, "line 2", "invalid JSON"});
  const std::string no_field = write("nofield.jsonl", "{\"text\": \"a\"}\n\n{\"content\": \"b\"}\n");
  expect_user_error([&] { open_dataset(no_field, options(4)); }, {no_field, "line 3", "\"text\""});
  const std::string mixed =
      write("mixed.jsonl", "{\"text\": \"a\"}\n{\"instruction\": \"q\", \"output\": \"a\"}\n");
  expect_user_error([&] { open_dataset(mixed, options(4)); }, {mixed, "line 2", "line 1", "one kind"});
  const std::string no_output = write("noout.jsonl", "{\"instruction\": \"q\"}\n");
  expect_user_error([&] { open_dataset(no_output, options(4)); }, {no_output, "line 1", "\"output\""});
  const std::string not_string = write("num.jsonl", "{\"text\": 5}\n");
  expect_user_error([&] { open_dataset(not_string, options(4)); }, {not_string, "line 1", "string"});
  const std::string bad_input =
      write("input.jsonl", "{\"instruction\": \"q\", \"input\": [1], \"output\": \"a\"}\n");
  expect_user_error([&] { open_dataset(bad_input, options(4)); }, {bad_input, "line 1", "\"input\""});
  const std::string not_object = write("arr.jsonl", "[1, 2]\n");
  expect_user_error([&] { open_dataset(not_object, options(4)); }, {not_object, "line 1", "object"});
  const std::string both =
      write("both.jsonl", "{\"text\": \"a\", \"instruction\": \"b\", \"output\": \"c\"}\n");
  expect_user_error([&] { open_dataset(both, options(4)); }, {both, "line 1", "not several"});
  const std::string blank = write("blank.jsonl", "\n  \n");
  expect_user_error([&] { open_dataset(blank, options(4)); }, {blank, "no records"});
  const std::string text = write("ok.jsonl", "{\"text\": \"a\"}\n");
  expect_user_error([&] { open_dataset(text, options(0)); }, {text, "seq_len"});
  expect_user_error([&] { open_dataset(text, options(4, 100)); }, {text, "258"});
}

// ---------------------------------------------------------------- .json

TEST_F(DataTest, JsonTokenArraysAreOneExampleEach) {
  const std::string path = write("t.json", "[[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 1, 2]]");
  auto data = open_dataset(path, options(0, 10));
  ASSERT_EQ(data->size(), 3);
  EXPECT_EQ(data->seq_len(), 3);
  expect_example(*data, 0, {1, 2, 3}, {2, 3, 4});
  expect_example(*data, 2, {9, 0, 1}, {0, 1, 2});
  EXPECT_EQ(open_dataset(path, options(3, 10))->size(), 3);
  expect_user_error([&] { open_dataset(path, options(2, 10)); }, {path, "seq_len 3", "seq_len 2"});
  expect_user_error([&] { open_dataset(path, options(0, 9)); }, {path, "sequence 2", "9"});
  const std::string ragged = write("r.json", "[[1, 2, 3], [4, 5]]");
  expect_user_error([&] { open_dataset(ragged, options(0, 10)); }, {ragged, "sequence 1"});
}

// ---------------------------------------------------------------- .bin

TEST_F(DataTest, BinUint16IsPackedWithoutSpecials) {
  const std::string path = write_tokens<uint16_t>("t.bin", {1, 2, 3, 4, 5, 6, 7, 300, 9, 60000});
  auto data = open_dataset(path, options(3, 65536));
  // chunks of 4: [1 2 3 4] [5 6 7 300] [9 60000] (padded)
  ASSERT_EQ(data->size(), 3);
  expect_example(*data, 0, {1, 2, 3}, {2, 3, 4});
  expect_example(*data, 1, {5, 6, 7}, {6, 7, 300});
  expect_example(*data, 2, {9, 60000, PAD}, {60000, X, X});
}

TEST_F(DataTest, BinUint32) {
  const std::string path = write_tokens<uint32_t>("t.bin", {70000, 1, 99999, 2, 3, 4});
  DataOptions o = options(2, 100000);
  o.bin_dtype = "uint32";
  auto data = open_dataset(path, o);
  ASSERT_EQ(data->size(), 2);
  expect_example(*data, 0, {70000, 1}, {1, 99999});
  expect_example(*data, 1, {2, 3}, {3, 4});
}

TEST_F(DataTest, BinErrors) {
  const std::string path = write_tokens<uint16_t>("t.bin", {1, 2, 3, 500, 5});
  expect_user_error([&] { open_dataset(path, options(2, 400)); }, {path, "token 3", "500", "400"});
  DataOptions wrong_dtype = options(2, 400);
  wrong_dtype.bin_dtype = "uint32";  // 10 bytes is not a whole number of uint32
  expect_user_error([&] { open_dataset(path, wrong_dtype); }, {path, "10 bytes", "uint32"});
  wrong_dtype.bin_dtype = "int8";
  expect_user_error([&] { open_dataset(path, wrong_dtype); }, {path, "int8"});
  const std::string empty = write("e.bin", "");
  expect_user_error([&] { open_dataset(empty, options(2, 400)); }, {empty, "empty"});
  const std::string one = write_tokens<uint16_t>("one.bin", {7});
  expect_user_error([&] { open_dataset(one, options(2, 400)); }, {one, "1 token"});
  expect_user_error([&] { open_dataset(path, options(0, 1000)); }, {path, "seq_len"});
  // pad_id only matters when the last example needs padding.
  const std::string small = write_tokens<uint16_t>("s.bin", {1, 2, 3, 4, 5});
  expect_user_error([&] { open_dataset(small, options(2, 100)); }, {small, "pad_id 257"});
  EXPECT_EQ(open_dataset(small, options(4, 100))->size(), 1);
}

// ---------------------------------------------------------------- sampler

using Step = std::vector<std::vector<int64_t>>;

TEST(DistributedSamplerTest, NoShuffleWalksTheDataInOrder) {
  DistributedSampler sampler(10, 2, 1, 1, 0, 0, false);
  EXPECT_EQ(sampler.global_batch(), 2);
  EXPECT_EQ(sampler.steps_per_epoch(), 5);
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    for (int64_t k = 0; k < 5; ++k) EXPECT_EQ(sampler.next_step(), (Step{{2 * k, 2 * k + 1}}));
  }
  EXPECT_EQ(sampler.state().epoch, 2);
}

class SamplerLayoutTest : public ::testing::TestWithParam<std::tuple<int, int64_t, bool>> {};

// Over all dp ranks, every step's micro-batches tile the global batch exactly,
// in the documented positions.
TEST_P(SamplerLayoutTest, RanksTileTheGlobalBatch) {
  const auto [dp, gas, shuffle] = GetParam();
  const int64_t micro = 2, size = 29, seed = 5;
  std::vector<DistributedSampler> samplers;
  for (int r = 0; r < dp; ++r) samplers.emplace_back(size, micro, gas, dp, r, seed, shuffle);
  const int64_t global = micro * gas * dp;
  const int64_t steps = size / global;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    const std::vector<int64_t> order = epoch_order(size, seed, epoch, shuffle);
    std::set<int64_t> seen_this_epoch;
    for (int64_t k = 0; k < steps; ++k) {
      std::vector<int64_t> all;
      for (int r = 0; r < dp; ++r) {
        const Step step = samplers[static_cast<size_t>(r)].next_step();
        ASSERT_EQ(static_cast<int64_t>(step.size()), gas);
        for (int64_t j = 0; j < gas; ++j) {
          ASSERT_EQ(static_cast<int64_t>(step[static_cast<size_t>(j)].size()), micro);
          for (int64_t i = 0; i < micro; ++i) {
            const int64_t position = k * global + (j * dp + r) * micro + i;
            EXPECT_EQ(step[static_cast<size_t>(j)][static_cast<size_t>(i)],
                      order[static_cast<size_t>(position)]);
          }
          all.insert(all.end(), step[static_cast<size_t>(j)].begin(), step[static_cast<size_t>(j)].end());
        }
      }
      std::vector<int64_t> expected(order.begin() + k * global, order.begin() + (k + 1) * global);
      std::sort(all.begin(), all.end());
      std::sort(expected.begin(), expected.end());
      EXPECT_EQ(all, expected) << "epoch " << epoch << " step " << k;
      seen_this_epoch.insert(all.begin(), all.end());
      if (!shuffle) {
        EXPECT_EQ(all.front(), k * global);
      }
    }
    // No example twice in an epoch; exactly the drop_last remainder is unused.
    EXPECT_EQ(static_cast<int64_t>(seen_this_epoch.size()), steps * global);
    for (const auto& sampler : samplers) EXPECT_EQ(sampler.state().epoch, epoch + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(DpGasShuffle, SamplerLayoutTest,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values(int64_t{1}, int64_t{2}), ::testing::Bool()));

TEST(DistributedSamplerTest, ShuffleIsAPermutationDeterminedBySeedAndEpoch) {
  const std::vector<int64_t> order = epoch_order(100, 42, 0, true);
  std::vector<int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, epoch_order(100, 42, 0, false));
  EXPECT_EQ(order, epoch_order(100, 42, 0, true));
  EXPECT_NE(order, epoch_order(100, 43, 0, true));
  EXPECT_NE(order, epoch_order(100, 42, 1, true));
  EXPECT_NE(order, sorted);
  // Pinned: the order is part of the checkpoint contract (resume on another build or machine).
  EXPECT_EQ(epoch_order(10, 42, 0, true), (std::vector<int64_t>{0, 5, 3, 6, 1, 2, 4, 9, 8, 7}));

  DistributedSampler a(100, 4, 2, 1, 0, 42, true), b(100, 4, 2, 1, 0, 42, true), c(100, 4, 2, 1, 0, 7, true);
  bool any_difference = false;
  for (int step = 0; step < 30; ++step) {  // crosses two epoch boundaries
    const Step from_a = a.next_step();
    EXPECT_EQ(from_a, b.next_step());
    any_difference |= from_a != c.next_step();
  }
  EXPECT_TRUE(any_difference);
}

TEST(DistributedSamplerTest, DropsTheEpochRemainderAndRollsOver) {
  DistributedSampler sampler(11, 2, 2, 1, 0, 0, false);  // global batch 4: 2 steps, 3 examples dropped
  EXPECT_EQ(sampler.steps_per_epoch(), 2);
  EXPECT_EQ(sampler.next_step(), (Step{{0, 1}, {2, 3}}));
  EXPECT_EQ(sampler.state().offset, 4);
  EXPECT_EQ(sampler.next_step(), (Step{{4, 5}, {6, 7}}));
  EXPECT_EQ(sampler.state().epoch, 1);  // rolled over right away: 3 left < 4
  EXPECT_EQ(sampler.state().offset, 0);
  EXPECT_EQ(sampler.next_step(), (Step{{0, 1}, {2, 3}}));
}

TEST(DistributedSamplerTest, RestoredStateContinuesIdentically) {
  for (bool shuffle : {false, true}) {
    DistributedSampler original(23, 2, 2, 2, 1, 9, shuffle);
    for (int step = 0; step < 7; ++step) original.next_step();
    const SamplerState saved = original.state();
    DistributedSampler resumed(23, 2, 2, 2, 1, 9, shuffle);
    resumed.set_state(saved);
    for (int step = 0; step < 20; ++step) EXPECT_EQ(resumed.next_step(), original.next_step()) << step;
  }
  DistributedSampler sampler(23, 2, 2, 2, 0, 9, false);
  sampler.set_state({3, 20});  // 3 left < 8: the next epoch begins
  EXPECT_EQ(sampler.state().epoch, 4);
  EXPECT_EQ(sampler.state().offset, 0);
  sampler.set_state({0, 6});  // another batch size's offset: the order continues from example 6
  EXPECT_EQ(sampler.next_step(), (Step{{6, 7}, {10, 11}}));
  expect_user_error([&] { sampler.set_state({0, 24}); }, {"offset 24", "23 examples"});
  expect_user_error([&] { sampler.set_state({-1, 0}); }, {"epoch -1"});
}

TEST(DistributedSamplerTest, DatasetSmallerThanAGlobalBatchIsAnError) {
  expect_user_error([] { DistributedSampler(11, 2, 3, 2, 0, 0, false); },
                    {"11 examples", "global batch of 12", "micro batch 2", "accumulation 3", "size 2"});
  expect_user_error([] { DistributedSampler(11, 0, 1, 1, 0, 0, false); }, {"micro batch", "0"});
  expect_user_error([] { DistributedSampler(11, 1, 0, 1, 0, 0, false); }, {"accumulation", "0"});
  EXPECT_THROW(DistributedSampler(11, 1, 1, 2, 2, 0, false), c10::Error);
}

// ---------------------------------------------------------------- collate, batch_hash

TEST_F(DataTest, CollateStacksExamples) {
  auto data = open_dataset(write("a.txt", "abcdefghijklmnop"), options(4));
  const Batch batch = collate(*data, {3, 0, 2});
  EXPECT_EQ(batch.input_ids.sizes(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(batch.labels.sizes(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(batch.input_ids.scalar_type(), torch::kLong);
  EXPECT_EQ(batch.labels.scalar_type(), torch::kLong);
  const std::vector<int64_t> order{3, 0, 2};
  for (int64_t row = 0; row < 3; ++row) {
    const Example example = data->get(order[static_cast<size_t>(row)]);
    for (int64_t t = 0; t < 4; ++t) {
      EXPECT_EQ(batch.input_ids[row][t].item<int64_t>(), example.input_ids[static_cast<size_t>(t)]);
      EXPECT_EQ(batch.labels[row][t].item<int64_t>(), example.labels[static_cast<size_t>(t)]);
    }
  }
  EXPECT_EQ(batch.labels[0][3].item<int64_t>(), X);  // example 3 is the padded one
  EXPECT_THROW(collate(*data, {}), c10::Error);
  EXPECT_THROW(collate(*data, {4}), c10::Error);
}

TEST_F(DataTest, BatchHashSeesEveryToken) {
  auto data = open_dataset(write("a.txt", "abcdefghijklmnop"), options(4));
  const Batch batch = collate(*data, {0, 1});
  const uint64_t hash = batch_hash(batch);
  EXPECT_EQ(hash, batch_hash(collate(*data, {0, 1})));
  EXPECT_NE(hash, batch_hash(collate(*data, {1, 0})));
  Batch changed{batch.input_ids.clone(), batch.labels.clone()};
  changed.input_ids[1][2] += 1;
  EXPECT_NE(hash, batch_hash(changed));
  changed = Batch{batch.input_ids.clone(), batch.labels.clone()};
  changed.labels[0][0] = X;
  EXPECT_NE(hash, batch_hash(changed));
  // Same values, another shape.
  EXPECT_NE(hash, batch_hash(Batch{batch.input_ids.reshape({1, 8}), batch.labels.reshape({1, 8})}));
}

}  // namespace
}  // namespace autotp
