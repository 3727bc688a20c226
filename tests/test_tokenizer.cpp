// HF tokenizer.json in C++: closed-form cases of each piece on hand-made
// tokenizers (merge order, byte fallback, unk fusing, ignore_merges, Unigram's Viterbi,
// WordPiece, BERT's normalizer, added tokens, pre-tokenizers, the post-processor), and
// id-for-id equality with HF's `tokenizers` library on the shipped fixtures
// (tests/data/tokenizers, made by make_fixtures.py there).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "autotp/base/error.h"
#include "autotp/tokenizer/tokenizer.h"
#include "support/checks.h"

namespace autotp {
namespace {

using nlohmann::json;
using tok::Tokenizer;

json bpe_model(const json& vocab, const json& merges, const json& extra = json::object()) {
  json model = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"dropout", nullptr}};
  model.update(extra);
  return model;
}

Tokenizer make(const json& model, const json& rest = json::object()) {
  json j = {{"version", "1.0"}, {"model", model}};
  j.update(rest);
  return Tokenizer::from_json(j, "tokenizer.json");
}

using Ids = std::vector<int64_t>;

TEST(BpeModel, MergesApplyByRankLeftmostFirst) {
  const json vocab = {{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"bc", 4}, {"abc", 5}};
  // (b, c) outranks (a, b): "abc" -> a + bc -> abc.
  EXPECT_EQ(make(bpe_model(vocab, {"b c", "a b", "a bc"})).encode("abc"), Ids({5}));
  // (a, b) first and no (ab, c): ab + c. Pairs as arrays, as tokenizers >= 0.20 writes them.
  EXPECT_EQ(make(bpe_model(vocab, json::array({json::array({"a", "b"}), json::array({"b", "c"})}))).encode("abc"),
            Ids({3, 2}));
  // Equal pairs merge leftmost first: "bcbc" -> bc bc.
  EXPECT_EQ(make(bpe_model(vocab, {"b c"})).encode("bcbc"), Ids({4, 4}));
  // ignore_merges: a word that is a token is taken whole even where merges would not get there.
  EXPECT_EQ(make(bpe_model(vocab, {"a b"}, {{"ignore_merges", true}})).encode("abc"), Ids({5}));
  EXPECT_EQ(make(bpe_model(vocab, {"a b"})).encode("abc"), Ids({3, 2}));
}

TEST(BpeModel, ByteFallbackAndUnknowns) {
  json vocab = {{"<unk>", 0}, {"a", 1}};
  for (int b = 0; b < 256; ++b) vocab[fmt::format("<0x{:02X}>", b)] = 2 + b;
  // é is C3 A9: its bytes' tokens.
  EXPECT_EQ(make(bpe_model(vocab, json::array(), {{"byte_fallback", true}, {"unk_token", "<unk>"}})).encode("aé"),
            Ids({1, 2 + 0xC3, 2 + 0xA9}));
  const json small = {{"<unk>", 0}, {"a", 1}};
  EXPECT_EQ(make(bpe_model(small, json::array(), {{"unk_token", "<unk>"}})).encode("xya"), Ids({0, 0, 1}));
  EXPECT_EQ(make(bpe_model(small, json::array(), {{"unk_token", "<unk>"}, {"fuse_unk", true}})).encode("xya"),
            Ids({0, 1}));
  // An open unknown goes after byte-fallback tokens, as HF orders them: x has no
  // bytes here (only C3 and A9 do), é has.
  json partial = {{"<unk>", 0}, {"a", 1}, {"<0xC3>", 2}, {"<0xA9>", 3}};
  EXPECT_EQ(make(bpe_model(partial, json::array(), {{"byte_fallback", true}, {"unk_token", "<unk>"}, {"fuse_unk", true}}))
                .encode("x\u00e9ya"),
            Ids({2, 3, 0, 1}));
  // Without an unk_token HF drops what it cannot encode.
  EXPECT_EQ(make(bpe_model(small, json::array())).encode("xay"), Ids({1}));
}

// A Unigram vocab: [[piece, score], ...] in id order.
json pieces(const std::vector<std::pair<std::string, double>>& list) {
  json out = json::array();
  for (const auto& [piece, score] : list) out.push_back(json::array({piece, score}));
  return out;
}

json unigram_model(const json& vocab, const json& extra = json::object()) {
  json model = {{"type", "Unigram"}, {"unk_id", 0}, {"vocab", vocab}, {"byte_fallback", false}};
  model.update(extra);
  return model;
}

TEST(UnigramModel, ViterbiTakesTheBestSumNotTheLongestPiece) {
  // ids: <unk> 0, a 1, b 2, c 3, ab 4, bc 5, abc 6.
  const json vocab = pieces({{"<unk>", 0}, {"a", -1}, {"b", -1}, {"c", -1}, {"ab", -1.5}, {"bc", -3}, {"abc", -4}});
  auto t = make(unigram_model(vocab));
  // "abc": a+b+c -3, ab+c -2.5, a+bc -4, abc -4: ab + c.
  EXPECT_EQ(t.encode("abc"), Ids({4, 3}));
  // "bc": b+c -2 beats bc -3.
  EXPECT_EQ(t.encode("bc"), Ids({2, 3}));
  // "cab": c + ab (-2.5) beats c+a+b (-3).
  EXPECT_EQ(t.encode("cab"), Ids({3, 4}));
  // With abc at -2 it wins over ab+c (-2.5).
  json better = vocab;
  better[6][1] = -2.0;
  EXPECT_EQ(make(unigram_model(better)).encode("abc"), Ids({6}));
}

TEST(UnigramModel, UnknownsFuseAndFallBackToBytes) {
  // ids: <unk> 0, a 1, xy 2 (min score -20, so an unknown character scores -30).
  const json vocab = pieces({{"<unk>", 0}, {"a", -1}, {"xy", -20}});
  auto t = make(unigram_model(vocab));
  EXPECT_EQ(t.encode("xy"), Ids({2}));         // -20 beats unk x + unk y (-60)
  EXPECT_EQ(t.encode("zxa"), Ids({0, 1}));     // z and x have no piece: one fused unk
  EXPECT_EQ(t.encode("a\xC3\xA9q"), Ids({1, 0}));  // é and q fuse too (whole characters)
  // byte_fallback: a fused unk becomes its UTF-8 bytes, <0xXX> ids 3 + byte here.
  json bytes = vocab;
  for (int b = 0; b < 256; ++b) bytes.push_back(json::array({fmt::format("<0x{:02X}>", b), 0.0}));
  auto f = make(unigram_model(bytes, {{"byte_fallback", true}}));
  EXPECT_EQ(f.encode("\xC3\xA9za"), Ids({3 + 0xC3, 3 + 0xA9, 3 + 'z', 1}));
  // Byte pieces are ordinary pieces in the lattice: the text "<0x41>" is that piece, as in HF.
  EXPECT_EQ(f.encode("<0x41>"), Ids({3 + 0x41}));
  // Without unk_id an unknown character is an error.
  const std::string none = test::user_error_of([&] { make(unigram_model(vocab, {{"unk_id", nullptr}})).encode("z"); });
  EXPECT_NE(none.find("no unk_id"), std::string::npos) << none;
  EXPECT_NE(test::user_error_of([&] { make(unigram_model(vocab, {{"unk_id", 3}})); }).find("unk_id 3"), std::string::npos);
}

json wordpiece_model(const json& vocab, const json& extra = json::object()) {
  json model = {{"type", "WordPiece"}, {"unk_token", "[UNK]"}, {"continuing_subword_prefix", "##"},
                {"max_input_chars_per_word", 100}, {"vocab", vocab}};
  model.update(extra);
  return model;
}

TEST(WordPieceModel, LongestMatchFirstAndWholeWordUnk) {
  const json vocab = {{"[UNK]", 0}, {"un", 1}, {"##aff", 2}, {"##able", 3}, {"u", 4},
                      {"##n", 5},   {"##a", 6}, {"n", 7},     {"##\xC3\xA9", 8}};
  auto t = make(wordpiece_model(vocab));
  EXPECT_EQ(t.encode("unaffable"), Ids({1, 2, 3}));  // un, not u + ##n
  EXPECT_EQ(t.encode("unaffablex"), Ids({0}));       // ##x matches nothing: the whole word is [UNK]
  EXPECT_EQ(t.encode("n\xC3\xA9"), Ids({7, 8}));     // shrinks by whole characters: n + ##é
  EXPECT_EQ(make(wordpiece_model(vocab, {{"max_input_chars_per_word", 5}})).encode("unaff"), Ids({1, 2}));
  EXPECT_EQ(make(wordpiece_model(vocab, {{"max_input_chars_per_word", 5}})).encode("unaffa"), Ids({0}));
}

TEST(Tokenizer, BertNormalizerAndPreTokenizer) {
  const json vocab = {{"[UNK]", 0}, {"hello", 1}, {",", 2}, {"world", 3}, {"\xE4\xB8\xAD", 4}, {"\xE6\x96\x87", 5},
                      {"!", 6},     {"i", 7},     {"i\xCC\x87", 8},     {"\xCE\xBF\xCF\x83", 9}};
  json normalizer = {{"type", "BertNormalizer"}, {"clean_text", true}, {"handle_chinese_chars", true},
                     {"strip_accents", nullptr}, {"lowercase", true}};
  const json pre = {{"type", "BertPreTokenizer"}};
  auto t = make(wordpiece_model(vocab), {{"normalizer", normalizer}, {"pre_tokenizer", pre}});
  // é loses its accent (NFD, drop Mn), \t is a space, U+200B (Cf) goes, each CJK character is a word,
  // punctuation is split off.
  EXPECT_EQ(t.encode("H\xC3\xA9llo,\tWORLD\xE2\x80\x8B\xE4\xB8\xAD\xE6\x96\x87!"), Ids({1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(t.encode("\xC4\xB0"), Ids({7}));  // U+0130: NFD I + U+0307, the mark dropped, then i
  // Without strip_accents: lowercase per character as Rust's char::to_lowercase: U+0130 -> i + U+0307,
  // and a final capital sigma -> σ (no final-sigma rule).
  normalizer["strip_accents"] = false;
  auto keep = make(wordpiece_model(vocab), {{"normalizer", normalizer}, {"pre_tokenizer", pre}});
  EXPECT_EQ(keep.encode("\xC4\xB0"), Ids({8}));
  EXPECT_EQ(keep.encode("\xCE\x9F\xCE\xA3"), Ids({9}));  // ΟΣ -> οσ
}

TEST(Tokenizer, ByteLevelMapsBytesAndSplitsLikeGpt2) {
  // GPT-2's byte map: space (0x20) -> U+0120 'Ġ', newline -> U+010A 'Ċ', printable ASCII to itself.
  json vocab = {{"h", 0}, {"i", 1}, {"\xC4\xA0", 2}, {"\xC4\x8A", 3}, {"\xC4\xA0h", 4}, {"'", 5}, {"s", 6}};
  const json pre = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  auto t = make(bpe_model(vocab, {"\xC4\xA0 h"}), {{"pre_tokenizer", pre}});
  // "hi hi\n's": words "hi", " hi", "\n", "'s" (GPT-2's pattern splits the contraction off).
  EXPECT_EQ(t.encode("hi hi\n's"), Ids({0, 1, 4, 1, 3, 5, 6}));
  json prefixed = pre;
  prefixed["add_prefix_space"] = true;
  EXPECT_EQ(make(bpe_model(vocab, {"\xC4\xA0 h"}), {{"pre_tokenizer", prefixed}}).encode("hi"), Ids({4, 1}));
}

TEST(Tokenizer, AddedTokensSplitFirstAndTemplateAddsBos) {
  const json vocab = {{"a", 0}, {"b", 1}, {" ", 2}};
  const json added = json::array({{{"id", 10}, {"content", "<s>"}, {"special", true}},
                                  {{"id", 11}, {"content", "<|x|>"}, {"special", true}, {"lstrip", true}},
                                  {{"id", 12}, {"content", "<|x|>y"}, {"special", false}}});
  const json post = {{"type", "TemplateProcessing"},
                     {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                             {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                     {"pair", json::array()},
                     {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {10}}, {"tokens", {"<s>"}}}}}}};
  auto t = make(bpe_model(vocab, json::array()), {{"added_tokens", added}, {"post_processor", post}});
  EXPECT_EQ(t.encode("ab"), Ids({10, 0, 1}));
  EXPECT_EQ(t.encode("ab", false), Ids({0, 1}));
  // Longest match wins; lstrip takes the spaces before it.
  EXPECT_EQ(t.encode("a <|x|>b<|x|>y<s>", false), Ids({0, 11, 1, 12, 10}));
  EXPECT_EQ(t.vocab_size(), 13);
  EXPECT_EQ(t.token_id("<|x|>"), 11);
  EXPECT_EQ(t.token_id("b"), 1);
  EXPECT_FALSE(t.token_id("zz").has_value());
}

TEST(Tokenizer, NormalizersAndMetaspace) {
  const std::string ws = "\xE2\x96\x81";  // U+2581
  const json vocab = {{ws, 0}, {"a", 1}, {"b", 2}, {ws + "a", 3}, {"<s>", 4}};
  const json merges = json::array({ws + " a"});
  // Llama-2's normalizer: prepend ▁ and turn spaces into ▁, per piece between added tokens.
  const json llama2 = {{"type", "Sequence"},
                       {"normalizers", json::array({{{"type", "Prepend"}, {"prepend", ws}},
                                                    {{"type", "Replace"},
                                                     {"pattern", {{"String", " "}}},
                                                     {"content", ws}}})}};
  const json added = json::array({{{"id", 4}, {"content", "<s>"}, {"special", true}}});
  auto t = make(bpe_model(vocab, merges), {{"normalizer", llama2}, {"added_tokens", added}});
  EXPECT_EQ(t.encode("a b"), Ids({3, 0, 2}));
  EXPECT_EQ(t.encode("b<s>a"), Ids({0, 2, 4, 3}));
  // Metaspace: "first" prepends only to the piece at the start of the text; split cuts before each ▁.
  const json meta = {{"type", "Metaspace"}, {"replacement", ws}, {"prepend_scheme", "first"}, {"split", true}};
  auto m = make(bpe_model(vocab, merges), {{"pre_tokenizer", meta}, {"added_tokens", added}});
  EXPECT_EQ(m.encode("a a"), Ids({3, 3}));
  EXPECT_EQ(m.encode("b<s>a"), Ids({0, 2, 4, 1}));
  json always = meta;
  always["prepend_scheme"] = "always";
  EXPECT_EQ(make(bpe_model(vocab, merges), {{"pre_tokenizer", always}, {"added_tokens", added}}).encode("b<s>a"),
            Ids({0, 2, 4, 3}));
}

TEST(Tokenizer, SplitBehaviours) {
  const json vocab = {{"a", 0}, {"b", 1}, {"-", 2}, {"a-", 3}, {"-b", 4}};
  auto with = [&](const std::string& behavior, bool invert = false) {
    const json pre = {{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}, {"invert", invert}};
    return make(bpe_model(vocab, {"a -", "- b"}), {{"pre_tokenizer", pre}}).encode("a-b");
  };
  EXPECT_EQ(with("Isolated"), Ids({0, 2, 1}));
  EXPECT_EQ(with("Removed"), Ids({0, 1}));
  EXPECT_EQ(with("MergedWithPrevious"), Ids({3, 1}));
  EXPECT_EQ(with("MergedWithNext"), Ids({0, 4}));
  const std::string contiguous = test::user_error_of([&] { with("Contiguous"); });
  EXPECT_NE(contiguous.find("split behavior 'Contiguous' is not supported"), std::string::npos) << contiguous;
}

TEST(Tokenizer, UnsupportedPartsAreNamed) {
  const json model = bpe_model({{"a", 0}}, json::array());
  EXPECT_NE(test::user_error_of([&] { make(model, {{"normalizer", {{"type", "NmtNormalizer"}}}}); }).find("normalizer 'Nmt"),
            std::string::npos);
  EXPECT_NE(test::user_error_of([&] { make(model, {{"pre_tokenizer", {{"type", "Digits"}}}}); }).find("pre-tokenizer 'Digits'"),
            std::string::npos);
  EXPECT_NE(test::user_error_of([&] { make({{"type", "WordLevel"}, {"vocab", json::object()}}); }).find("'WordLevel'"),
            std::string::npos);
  EXPECT_NE(test::user_error_of([&] { make(bpe_model({{"a", 0}}, {"a b"})); }).find("merge 'a b'"), std::string::npos);
  // RFC 3629: truncated, overlong, surrogate and above U+10FFFF are all refused.
  for (const char* bad : {"\xC3", "\xC0\x80", "\xE0\x80\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\xF5\x80\x80\x80"})
    EXPECT_NE(test::user_error_of([&] { make(model).encode(std::string("a") + bad); }).find("not valid UTF-8 (byte 1 of"),
              std::string::npos)
        << json(std::string(bad)).dump();
  EXPECT_EQ(make(model).encode("a\xF4\x8F\xBF\xBF", false).size(), 1u);  // U+10FFFF is valid (and unknown: dropped)
  // A malformed file: a missing key or a wrong type names the file, never a crash.
  for (const json& normalizer : {json{{"type", "Prepend"}}, json{{"type", "Sequence"}}, json{{"type", "Prepend"}, {"prepend", 5}}})
    EXPECT_NE(test::user_error_of([&] { make(model, {{"normalizer", normalizer}}); }).find("tokenizer.json: not a tokenizer.json"),
              std::string::npos)
        << normalizer.dump();
  EXPECT_NE(test::user_error_of([&] { make(model, {{"added_tokens", {{{"content", "<x>"}}}}}); }).find("tokenizer.json: not a"),
            std::string::npos);
  EXPECT_NE(test::user_error_of([&] { make(bpe_model({{"a", -7}}, json::array())); }).find("allowed: an integer id"),
            std::string::npos);
  EXPECT_NE(test::user_error_of([&] { make(model, {{"added_tokens", {{{"content", "<x>"}, {"id", -1}}}}}); }).find("has id -1"),
            std::string::npos);
  const json bad_regex = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  EXPECT_NE(test::user_error_of([&] { make(model, {{"pre_tokenizer", bad_regex}}); }).find("does not compile"),
            std::string::npos);
}

TEST(Tokenizer, UnicodeNormalFormsAndLowercase) {
  // é precomposed (U+00E9) and decomposed (e + U+0301) are one token after NFC.
  const json model = bpe_model({{"\u00e9", 0}, {"e", 1}, {"\u0301", 2}, {"f", 3}, {"i", 4}, {"\u00e0", 5}, {"b", 6}},
                               json::array());
  EXPECT_EQ(make(model, {{"normalizer", {{"type", "NFC"}}}}).encode("e\u0301\u00e9"), Ids({0, 0}));
  EXPECT_EQ(make(model, {{"normalizer", {{"type", "NFD"}}}}).encode("\u00e9"), Ids({1, 2}));
  EXPECT_EQ(make(model, {{"normalizer", {{"type", "NFKC"}}}}).encode("\ufb01"), Ids({3, 4}));  // the fi ligature
  EXPECT_EQ(make(model, {{"normalizer", {{"type", "NFKD"}}}}).encode("\u00e9"), Ids({1, 2}));
  EXPECT_EQ(make(model, {{"normalizer", {{"type", "Lowercase"}}}}).encode("\u00c0B"), Ids({5, 6}));
}

TEST(Tokenizer, StripsAndAddedTokenSpacesAreUnicodeWhiteSpace) {
  const json model = bpe_model({{"a", 0}, {"<x>", 1}}, json::array());
  // U+00A0 and U+3000 are White_Space, as Rust's char::is_whitespace says.
  EXPECT_EQ(make(model, {{"normalizer", {{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}}}})
                .encode("\u00a0a\u3000"),
            Ids({0}));
  const json added = {{"added_tokens", {{{"content", "<x>"}, {"id", 1}, {"lstrip", true}, {"rstrip", true}}}}};
  EXPECT_EQ(make(model, added).encode("a\u00a0<x>\u3000 a"), Ids({0, 1, 0}));
}

// The fixtures: tokenizer.json files trained with HF's tokenizers library and the
// ids it gives for a set of strings (expected.jsonl).
const std::string kFixtures = AUTOTP_SOURCE_DIR "/tests/data/tokenizers";

class TokenizerFixture : public ::testing::TestWithParam<std::string> {};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// FNV-1a 64 over the ids as consecutive little-endian uint32 (corpus_summary.json).
std::string fnv1a64_hex(const Ids& ids) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (int64_t id : ids)
    for (int b = 0; b < 4; ++b) {
      hash ^= (static_cast<uint64_t>(id) >> (8 * b)) & 0xff;
      hash *= 0x100000001b3ULL;
    }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
  return hex;
}

TEST_P(TokenizerFixture, IdsEqualHfTokenizers) {
  const std::string dir = kFixtures + "/" + GetParam();
  ASSERT_TRUE(std::filesystem::exists(dir + "/tokenizer.json")) << "missing fixture " << dir;
  const Tokenizer t = Tokenizer::from_file(dir + "/tokenizer.json");
  std::ifstream in(dir + "/expected.jsonl");
  std::string line;
  int cases = 0;
  while (std::getline(in, line)) {
    const json c = json::parse(line);
    const std::string text = c["text"];
    EXPECT_EQ(t.encode(text, true), c["ids"].get<Ids>()) << GetParam() << ": " << json(text).dump();
    EXPECT_EQ(t.encode(text, false), c["ids_no_special"].get<Ids>()) << GetParam() << ": " << json(text).dump();
    ++cases;
  }
  EXPECT_GT(cases, 20);
}

// The whole 200 KB mixed corpus as one string: count, hash and the first ids.
TEST_P(TokenizerFixture, CorpusEqualsHfTokenizers) {
  const std::string dir = kFixtures + "/" + GetParam();
  const Tokenizer t = Tokenizer::from_file(dir + "/tokenizer.json");
  const json summary = json::parse(read_file(dir + "/corpus_summary.json"));
  const std::string corpus = read_file(kFixtures + "/" + summary["corpus"].get<std::string>());
  ASSERT_EQ(corpus.size(), summary["corpus_bytes"].get<size_t>());
  const Ids ids = t.encode(corpus, false);
  const Ids first = summary["first_ids"].get<Ids>();
  ASSERT_GE(ids.size(), first.size());
  EXPECT_EQ(Ids(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(first.size())), first);
  EXPECT_EQ(static_cast<int64_t>(ids.size()), summary["count"].get<int64_t>());
  EXPECT_EQ(fnv1a64_hex(ids), summary["fnv1a64"].get<std::string>());
}

INSTANTIATE_TEST_SUITE_P(Families, TokenizerFixture,
                         ::testing::Values("gpt2_bpe", "llama3_bpe", "llama2_spm_bpe", "mistral_spm_metaspace",
                                           "unigram", "wordpiece"));

}  // namespace
}  // namespace autotp
