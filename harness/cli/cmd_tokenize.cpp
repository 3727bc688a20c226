// autotp tokenize: text (.txt, .jsonl text records) to a .bin token file, once,
// for runs that train on it many times (docs/data.md).
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <iostream>

#include "autotp/base/error.h"
#include "autotp/data/data_tokenizer.h"
#include "autotp/data/dataset.h"
#include "autotp/io/safetensors.h"
#include "autotp/model/presets.h"
#include "cli/cli.h"

namespace autotp::cli {

namespace {

struct TokenizeArgs {
  std::string model, data, out, tokenizer = "auto", dtype = "auto";
};

// The little-endian bytes of the tokens as `width`-byte integers (.bin's layout).
std::string token_bytes(const std::vector<uint32_t>& tokens, size_t width) {
  std::string bytes(tokens.size() * width, '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (width == 2) {
      const auto v = static_cast<uint16_t>(tokens[i]);
      std::memcpy(&bytes[i * 2], &v, 2);
    } else {
      std::memcpy(&bytes[i * 4], &tokens[i], 4);
    }
  }
  return bytes;
}

void run_tokenize(const TokenizeArgs& args) {
  const ModelSource source = resolve_model(args.model);
  DataOptions options;
  options.vocab_size = source.config.vocab_size;
  options.tokenizer = choose_tokenizer(args.tokenizer, source, args.data);
  const std::string dtype =
      args.dtype != "auto" ? args.dtype : (options.vocab_size <= 65536 ? "uint16" : "uint32");
  AUTOTP_USER_CHECK(dtype == "uint32" || options.vocab_size <= 65536,
                    "--dtype uint16 holds ids below 65536, but the model's vocab_size is {} (allowed: uint32, auto)",
                    options.vocab_size);
  // Progress at most every 2 s, so a large file shows it is moving.
  auto last = std::chrono::steady_clock::now();
  const auto start = last;
  TokenizedText text = tokenize_documents(args.data, options, [&](size_t done, size_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last < std::chrono::seconds(2)) return;
    last = now;
    const double seconds = std::chrono::duration<double>(now - start).count();
    std::cerr << fmt::format("tokenize: {:.0f}% ({:.1f} / {:.1f} MB, {:.2f} MB/s)\n",
                             total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0,
                             static_cast<double>(done) / 1e6, static_cast<double>(total) / 1e6,
                             static_cast<double>(done) / 1e6 / seconds);
  });
  io::write_text_file_atomic(args.out, token_bytes(text.tokens, dtype == "uint16" ? 2 : 4));
  std::cout << fmt::format(
      "tokenize: {} tokens from {} ({}): {:.2f} MB in {:.2f} s, {:.2f} MB/s on one thread\n"
      "tokenize: wrote {} ({}); train with --data {} --bin-dtype {}\n",
      text.tokens.size(), args.data, text.what, static_cast<double>(text.bytes) / 1e6, text.seconds,
      text.seconds > 0 ? static_cast<double>(text.bytes) / 1e6 / text.seconds : 0.0, args.out, dtype, args.out,
      dtype);
}

}  // namespace

void register_tokenize(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  auto* cmd = app.add_subcommand("tokenize", "Tokenize text once into a .bin token file (the ids a run would train on)");
  cmd->add_option("--model", args->model, "HF model directory (its tokenizer and vocab_size) or preset:NAME")
      ->required();
  cmd->add_option("--data", args->data, "Text: .txt (one document) or .jsonl with {\"text\"} records")->required();
  cmd->add_option("--out", args->out, "The .bin token file to write (little-endian, written atomically)")->required();
  cmd->add_option("--tokenizer", args->tokenizer,
                  "auto (the model directory's own; byte-level for presets), bytes, or a directory with "
                  "tokenizer.json / tokenizer.model (default auto)");
  cmd->add_option("--dtype", args->dtype, "Token type: auto (uint16 when the vocabulary fits), uint16 or uint32")
      ->check(CLI::IsMember({"auto", "uint16", "uint32"}));
  cmd->callback([args] { run_tokenize(*args); });
}

}  // namespace autotp::cli
