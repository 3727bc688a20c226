// SentencePieceModel (tokenizer.model files) against libsentencepiece itself: tiny
// BPE and unigram models trained at test time on tests/data/tokenizers/corpus_mixed.txt
// by sentencepiece's own trainer, then special ids, vocab size, byte fallback and
// id-for-id encoding compared with an independently loaded SentencePieceProcessor.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "autotp/base/error.h"
#include "autotp/tokenizer/sentencepiece_model.h"
#include "autotp/tokenizer/text_tokenizer.h"

#ifdef AUTOTP_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#endif

namespace autotp {
namespace {

namespace fs = std::filesystem;
using tok::SentencePieceModel;

std::string error_of(const std::string& path) {
  try {
    SentencePieceModel model(path);
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

#ifdef AUTOTP_HAVE_SENTENCEPIECE

const std::string kCorpus = std::string(AUTOTP_SOURCE_DIR) + "/tests/data/tokenizers/corpus_mixed.txt";
constexpr int kVocab = 500;  // 259 meta and byte pieces + ~200 characters at coverage 0.995 + merges

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::vector<int64_t> widen(const std::vector<int>& ids) { return std::vector<int64_t>(ids.begin(), ids.end()); }

// Trains the models once per process into a fresh directory, removed at the end.
class SentencePieceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string pattern = (fs::temp_directory_path() / "autotp-spm-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr) << std::strerror(errno);
    dir_ = pattern;
    train("bpe", "--model_type=bpe");
    train("unigram", "--model_type=unigram");
    train("custom", "--model_type=bpe --unk_id=2 --bos_id=-1 --eos_id=1 --pad_id=3");
  }
  static void TearDownTestSuite() {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  static void train(const std::string& name, const std::string& flags) {
    const std::string args = "--input=" + kCorpus + " --model_prefix=" + (fs::path(dir_) / name).string() +
                             " --vocab_size=" + std::to_string(kVocab) +
                             " --character_coverage=0.995 --byte_fallback=true --minloglevel=2 " + flags;
    const auto status = sentencepiece::SentencePieceTrainer::Train(args);
    ASSERT_TRUE(status.ok()) << status.ToString();
  }

  static std::string path(const std::string& name) { return (fs::path(dir_) / (name + ".model")).string(); }

  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string file = (fs::path(dir_) / name).string();
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return file;
  }

  static std::string dir_;
};
std::string SentencePieceTest::dir_;

TEST_F(SentencePieceTest, Available) { EXPECT_TRUE(SentencePieceModel::available()); }

TEST_F(SentencePieceTest, DefaultSpecialIdsAndVocabSize) {
  for (const char* name : {"bpe", "unigram"}) {
    SCOPED_TRACE(name);
    const SentencePieceModel model(path(name));
    EXPECT_EQ(model.vocab_size(), kVocab);
    EXPECT_EQ(model.unk_id(), 0);
    EXPECT_EQ(model.bos_id(), 1);
    EXPECT_EQ(model.eos_id(), 2);
    EXPECT_EQ(model.pad_id(), std::nullopt);
    EXPECT_EQ(model.piece_id("<unk>"), 0);
    EXPECT_EQ(model.piece_id("<s>"), 1);
    EXPECT_EQ(model.piece_id("</s>"), 2);
    // The byte pieces follow the three meta pieces in byte order.
    EXPECT_EQ(model.piece_id("<0x00>"), 3);
    EXPECT_EQ(model.piece_id("<0xEA>"), 3 + 0xEA);
    EXPECT_EQ(model.piece_id("<0xFF>"), 3 + 0xFF);
  }
}

TEST_F(SentencePieceTest, ExplicitSpecialIds) {
  const SentencePieceModel model(path("custom"));
  EXPECT_EQ(model.vocab_size(), kVocab);
  EXPECT_EQ(model.unk_id(), 2);
  EXPECT_EQ(model.bos_id(), std::nullopt);
  EXPECT_EQ(model.eos_id(), 1);
  EXPECT_EQ(model.pad_id(), 3);
  EXPECT_EQ(model.piece_id("<unk>"), 2);
  EXPECT_EQ(model.piece_id("</s>"), 1);
  EXPECT_EQ(model.piece_id("<pad>"), 3);
  EXPECT_EQ(model.piece_id("<s>"), std::nullopt);  // bos_id=-1: no such piece
}

TEST_F(SentencePieceTest, PieceIdOfUnknownPieceIsNullopt) {
  for (const char* name : {"bpe", "unigram", "custom"}) {
    SCOPED_TRACE(name);
    const SentencePieceModel model(path(name));
    EXPECT_EQ(model.piece_id("no-such-piece-xyz"), std::nullopt);
    EXPECT_EQ(model.piece_id(""), std::nullopt);
    EXPECT_EQ(model.piece_id("<0x100>"), std::nullopt);
    // Every id spells back to itself.
    sentencepiece::SentencePieceProcessor sp;
    ASSERT_TRUE(sp.Load(path(name)).ok());
    for (int id = 0; id < sp.GetPieceSize(); ++id) ASSERT_EQ(model.piece_id(sp.IdToPiece(id)), id) << id;
  }
}

TEST_F(SentencePieceTest, EncodeMatchesSentencePiece) {
  std::vector<std::string> texts = {"",
                                    " ",
                                    "Hello world",
                                    "  leading and   inner  spaces ",
                                    "tabs\tand\nnewlines\r\n",
                                    "The quick brown fox jumps over the lazy dog.",
                                    "ひらがなとカタカナと漢字",
                                    "emoji 🚀🦀 and flags 🇫🇷 and ZWJ 👨‍💻",
                                    "unseen: 가나다 Ѯ ₿ ﷺ",
                                    "ﬁ ligature, full-width １２３ (NFKC folds these)",
                                    "<s> </s> <unk> <pad> are plain text here"};
  std::istringstream corpus(read_file(kCorpus));
  for (std::string line; std::getline(corpus, line);) texts.push_back(line);
  ASSERT_GT(texts.size(), 1000u);
  for (const char* name : {"bpe", "unigram", "custom"}) {
    SCOPED_TRACE(name);
    const SentencePieceModel model(path(name));
    sentencepiece::SentencePieceProcessor sp;
    ASSERT_TRUE(sp.Load(path(name)).ok());
    for (const std::string& text : texts) {
      std::vector<int64_t> ids;
      model.encode(text, ids);
      ASSERT_EQ(ids, widen(sp.EncodeAsIds(text))) << text;
      for (int64_t id : ids) ASSERT_TRUE(id >= 0 && id < kVocab) << text;
    }
  }
}

TEST_F(SentencePieceTest, EncodeAppends) {
  const SentencePieceModel model(path("bpe"));
  std::vector<int64_t> alone;
  model.encode("Hello world", alone);
  ASSERT_FALSE(alone.empty());
  std::vector<int64_t> ids = {-7, 42};
  model.encode("Hello world", ids);
  std::vector<int64_t> expected = {-7, 42};
  expected.insert(expected.end(), alone.begin(), alone.end());
  EXPECT_EQ(ids, expected);
  // Nothing marks the start or end: no BOS/EOS.
  for (int64_t id : alone) {
    EXPECT_NE(id, 1);
    EXPECT_NE(id, 2);
  }
}

TEST_F(SentencePieceTest, ByteFallbackForUnseenCharacter) {
  // U+AC00 (가, UTF-8 EA B0 80) does not occur in the corpus, so no piece holds it.
  ASSERT_EQ(read_file(kCorpus).find("가"), std::string::npos);
  for (const char* name : {"bpe", "unigram"}) {
    SCOPED_TRACE(name);
    const SentencePieceModel model(path(name));
    std::vector<int64_t> ids;
    model.encode("가", ids);
    // The dummy prefix "▁" stays a piece; the character becomes its three bytes.
    ASSERT_TRUE(model.piece_id("\xE2\x96\x81").has_value());
    const std::vector<int64_t> expected = {*model.piece_id("\xE2\x96\x81"), *model.piece_id("<0xEA>"),
                                           *model.piece_id("<0xB0>"), *model.piece_id("<0x80>")};
    EXPECT_EQ(ids, expected);
    EXPECT_EQ(expected[1], 3 + 0xEA);
    EXPECT_EQ(expected[2], 3 + 0xB0);
    EXPECT_EQ(expected[3], 3 + 0x80);
  }
}

TEST_F(SentencePieceTest, MoveKeepsTheModel) {
  SentencePieceModel a(path("bpe"));
  std::vector<int64_t> before;
  a.encode("Hello world", before);
  SentencePieceModel b(std::move(a));
  std::vector<int64_t> moved;
  b.encode("Hello world", moved);
  EXPECT_EQ(moved, before);
  SentencePieceModel c(path("custom"));
  c = std::move(b);
  EXPECT_EQ(c.vocab_size(), kVocab);
  EXPECT_EQ(c.bos_id(), 1);  // the BPE model's, not custom's (none)
}

// A model directory with only tokenizer.model: the model's specials, BOS first (the
// sentencepiece-based HF tokenizers' add_bos_token default) unless
// tokenizer_config.json says otherwise.
TEST_F(SentencePieceTest, ModelDirectoryWithOnlyTokenizerModel) {
  const std::string model_dir = (fs::path(dir_) / "model_dir").string();
  fs::create_directories(model_dir);
  fs::copy_file(path("bpe"), model_dir + "/tokenizer.model", fs::copy_options::overwrite_existing);
  auto t = tok::load_model_tokenizer(model_dir);
  EXPECT_EQ(t->bos_id, 1);
  EXPECT_EQ(t->eos_id, 2);
  EXPECT_EQ(t->pad_id, 2);  // no pad piece: EOS pads
  EXPECT_TRUE(t->add_bos);
  EXPECT_EQ(t->vocab_size(), kVocab);
  std::vector<int64_t> via_dir, direct;
  t->encode("Hello world, ça va?", via_dir);
  SentencePieceModel(path("bpe")).encode("Hello world, ça va?", direct);
  EXPECT_EQ(via_dir, direct);
  EXPECT_NE(t->describe().find("tokenizer.model"), std::string::npos);
  write("model_dir/tokenizer_config.json", R"({"add_bos_token": false, "pad_token": "<unk>"})");
  t = tok::load_model_tokenizer(model_dir);
  EXPECT_FALSE(t->add_bos);
  EXPECT_EQ(t->pad_id, 0);
}

TEST_F(SentencePieceTest, BadFilesAreUserErrorsNamingThePath) {
  const std::string missing = (fs::path(dir_) / "missing.model").string();
  EXPECT_NE(error_of(missing).find(missing), std::string::npos) << error_of(missing);
  EXPECT_NE(error_of(missing).find("no such"), std::string::npos) << error_of(missing);

  // The corpus is not a protobuf; an empty file parses as an empty one (no pieces).
  const std::string empty = write("empty.model", "");
  const std::string garbage = write("garbage.model", std::string("\x0a\x05hello", 7));
  for (const std::string& file : {kCorpus, empty, garbage}) {
    const std::string message = error_of(file);
    EXPECT_NE(message.find(file), std::string::npos) << message;
    EXPECT_NE(message.find("not a SentencePiece model"), std::string::npos) << message;
  }

  // sentencepiece itself throws std::ios_base::failure on a directory.
  const std::string message = error_of(dir_);
  EXPECT_NE(message.find(dir_), std::string::npos) << message;
  EXPECT_NE(message.find("not a file"), std::string::npos) << message;
}

// libsentencepiece and libc10 both export FLAGS_minloglevel (a 32-byte flag object, a
// 4-byte int). In the CLI, which reaches libsentencepiece only through libautotp, it must
// still bind to its own (CMakeLists.txt names it first): bound to c10's, its constructor
// overwrites c10's flags and CAFFE_ENFORCE failures abort. This binary links
// libsentencepiece itself, so the check runs the CLI under the dynamic linker's trace.
TEST_F(SentencePieceTest, CliBindsSentencePieceFlagsToItself) {
  const char* cli = std::getenv("AUTOTP_CLI");
  if (!cli || !fs::exists(cli)) GTEST_SKIP() << "AUTOTP_CLI is not set (run the tests through ctest)";
  const fs::path trace_dir = fs::path(dir_) / "ld-trace";
  fs::create_directories(trace_dir);
  const std::string command = "LD_DEBUG=bindings LD_DEBUG_OUTPUT='" + (trace_dir / "ld").string() + "' '" +
                              std::string(cli) + "' --help >/dev/null 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::vector<std::string> bindings;  // lines "binding file <user> [0] to <definer> [0]: normal symbol ..."
  for (const auto& entry : fs::directory_iterator(trace_dir)) {
    std::istringstream trace(read_file(entry.path().string()));
    for (std::string line; std::getline(trace, line);) {
      if (line.find("`FLAGS_minloglevel'") != std::string::npos && line.find("binding file") != std::string::npos &&
          line.find("libsentencepiece", line.find("binding file")) < line.find(" to ")) {
        bindings.push_back(line);
      }
    }
  }
  ASSERT_FALSE(bindings.empty()) << "no trace of libsentencepiece's FLAGS_minloglevel: is the CLI linked with it?";
  for (const std::string& line : bindings) {
    EXPECT_NE(line.find("libsentencepiece", line.find(" to ")), std::string::npos) << line;
  }
}

#else  // built without libsentencepiece (or without its trainer)

TEST(SentencePiece, WithoutTheLibrary) {
  if (SentencePieceModel::available()) GTEST_SKIP() << "libsentencepiece_train missing: the model tests need it";
  const std::string message = error_of("/some/tokenizer.model");
  EXPECT_NE(message.find("/some/tokenizer.model"), std::string::npos) << message;
  EXPECT_NE(message.find("libsentencepiece-dev"), std::string::npos) << message;
  GTEST_SKIP() << "no libsentencepiece (install libsentencepiece-dev): checked only that loading says so";
}

#endif

}  // namespace
}  // namespace autotp
