// The training data formats of engine/data (docs/data.md), through open_dataset
// as `autotp train --data` opens a file, and every example read back. The
// input's first byte picks the format and options, the rest is the file:
//   bits 0-1  .bin, .json (token arrays), .jsonl (records), .txt
//   bit 2     .bin element type uint32 (else uint16)
//   bits 3-5  seq_len: 0 (.json: from the file), 1, 2, 3, 7, 16, 64, 1000
//   bits 6-7  vocab_size: 259, 1000, 65536, 2^31 - 1
// .txt and .jsonl are also tokenized as `autotp tokenize` does.
#include "autotp/data/dataset.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace autotp;
  if (size == 0) return 0;
  static const char* const kExtensions[] = {".bin", ".json", ".jsonl", ".txt"};
  static const int64_t kSeqLens[] = {0, 1, 2, 3, 7, 16, 64, 1000};
  static const int64_t kVocabs[] = {259, 1000, 65536, 2147483647};
  const uint8_t selector = data[0];
  const std::string extension = kExtensions[selector & 3];
  const auto path = fuzz::scratch_dir() / ("data" + extension);
  fuzz::write_file(path, data + 1, size - 1);

  DataOptions options;
  options.bin_dtype = (selector & 4) ? "uint32" : "uint16";
  options.seq_len = kSeqLens[(selector >> 3) & 7];
  options.vocab_size = kVocabs[(selector >> 6) & 3];
  fuzz::expect_user_error_only(path.string(), [&] {
    auto dataset = open_dataset(path.string(), options);
    const int64_t n = dataset->size();
    if (n <= 0) fuzz::finding("empty dataset", dataset->describe());
    (void)dataset->describe();
    // Every example (the first and last 64 of a large file).
    for (int64_t i = 0; i < n; ++i) {
      if (i == 64 && n > 128) i = n - 64;
      Example e = dataset->get(i);
      const auto len = static_cast<size_t>(dataset->seq_len());
      if (e.input_ids.size() != len || e.labels.size() != len)
        fuzz::finding("example size", "example " + std::to_string(i) + " is not seq_len long");
      for (size_t t = 0; t < len; ++t) {
        if (e.input_ids[t] < 0 || e.input_ids[t] >= options.vocab_size)
          fuzz::finding("input id", "example " + std::to_string(i) + " has input id " + std::to_string(e.input_ids[t]));
        if (e.labels[t] != kIgnoreLabel && (e.labels[t] < 0 || e.labels[t] >= options.vocab_size))
          fuzz::finding("label", "example " + std::to_string(i) + " has label " + std::to_string(e.labels[t]));
      }
    }
  });
  if (extension == ".txt" || extension == ".jsonl") {
    fuzz::expect_user_error_only(path.string(), [&] {
      TokenizedText text = tokenize_documents(path.string(), options);
      (void)text;
    });
  }
  return 0;
}
