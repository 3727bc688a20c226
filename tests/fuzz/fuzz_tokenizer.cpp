// A tokenizer.json (HF tokenizers format), as Tokenizer::from_file reads a model
// directory's, then a few texts encoded with it.
#include "autotp/tokenizer/tokenizer.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace autotp;
  const auto path = fuzz::scratch_dir() / "tokenizer.json";
  fuzz::write_file(path, data, size);
  std::optional<tok::Tokenizer> tokenizer;
  fuzz::expect_user_error_only(path.string(), [&] { tokenizer.emplace(tok::Tokenizer::from_file(path.string())); });
  if (!tokenizer) return 0;
  for (const char* text : {"", "Hello world!", "  héllo\tWORLD 12345 <s> </s>", "a\nb\r\nc  d", "日本語のテキスト"}) {
    // An encoding error (text the tokenizer cannot take) need not name the file.
    fuzz::expect_user_error_only("", [&] {
      std::vector<int64_t> ids = tokenizer->encode(text);
      for (int64_t id : ids)
        if (id < 0 || id >= tokenizer->vocab_size())
          fuzz::finding("id out of range", "encode gave id " + std::to_string(id) + " outside [0, vocab_size " +
                                               std::to_string(tokenizer->vocab_size()) + ")");
    });
  }
  return 0;
}
