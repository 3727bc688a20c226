// `autotp data preview`: the first examples of a data file exactly as training builds
// them (tokens, padding, and which tokens are learned), as marked text or as JSON.
#include <fmt/format.h>
#include <unistd.h>

#include <iostream>

#include "autotp/data/data_tokenizer.h"
#include "autotp/data/dataset.h"
#include "autotp/model/presets.h"
#include "cli/cli.h"
#include "cli/sft_flags.h"

namespace autotp::cli {
namespace {

struct PreviewArgs {
  std::string model, data, tokenizer = "auto", bin_dtype = "uint16";
  int64_t seq_len = 0, n = 3;
  bool json = false;
  SftFlags sft;
};

std::string token_display(const tok::TextTokenizer* tokenizer, int64_t id) {
  const std::string text = tokenizer ? tokenizer->token_text(id) : "";
  return text.empty() ? fmt::format("<id {}>", id) : text;
}

// The example as text: input tokens in order, then the last label; the learned tokens
// (those some label predicts) between markers.
std::string marked_text(const Example& e, const tok::TextTokenizer* tokenizer, bool tty) {
  const char* open = tty ? "\033[1;32m" : "\u00ab";  // «
  const char* close = tty ? "\033[0m" : "\u00bb";    // »
  std::string out;
  bool in_learned = false;
  const size_t n = e.input_ids.size();
  auto emit = [&](int64_t id, bool learned) {
    if (learned != in_learned) out += learned ? open : close;
    in_learned = learned;
    out += token_display(tokenizer, id);
  };
  for (size_t t = 0; t < n; ++t) {
    emit(e.input_ids[t], t > 0 && e.labels[t - 1] != kIgnoreLabel);
  }
  if (n > 0 && e.labels[n - 1] != kIgnoreLabel) emit(e.labels[n - 1], true);  // the window's last target
  if (in_learned) out += close;
  return out;
}

void run_preview(const PreviewArgs& args) {
  const ModelSource source = resolve_model(args.model);
  const DataOptions options = data_options(source, args.data, args.seq_len, args.bin_dtype, args.tokenizer, args.sft);
  const auto data = open_dataset(args.data, options);
  const int64_t count = std::min(args.n, data->size());
  const auto byte_level = options.tokenizer ? nullptr : tok::byte_level_tokenizer();
  const tok::TextTokenizer* tokenizer = options.tokenizer ? options.tokenizer.get()
                                        : holds_text(args.data) ? byte_level.get()
                                                                : nullptr;
  if (args.json) {
    nlohmann::json out = nlohmann::json::array();
    for (int64_t i = 0; i < count; ++i) {
      const Example e = data->get(i);
      out.push_back({{"input_ids", e.input_ids}, {"labels", e.labels}});
    }
    std::cout << out.dump() << "\n";
    return;
  }
  std::cout << data->describe() << "\n";
  const bool tty = isatty(STDOUT_FILENO);
  for (int64_t i = 0; i < count; ++i) {
    const Example e = data->get(i);
    int64_t learned = 0;
    for (size_t t = 0; t < e.labels.size(); ++t) learned += e.labels[t] != kIgnoreLabel;
    std::cout << fmt::format("\n--- example {} of {}: {} positions, {} learned tokens (marked {}{})\n", i,
                             data->size(), e.input_ids.size(), learned, tty ? "in green" : "\u00ab...",
                             tty ? "" : "\u00bb")
              << marked_text(e, tokenizer, tty) << "\n";
  }
}

}  // namespace

void register_data(CLI::App& app) {
  auto* data = app.add_subcommand("data", "Look at training data as the trainer builds it");
  data->require_subcommand(1);
  auto args = std::make_shared<PreviewArgs>();
  auto* cmd = data->add_subcommand("preview", "The first examples of a data file: tokens, padding, learned spans");
  cmd->add_option("--model", args->model, "HF model directory or preset:NAME (its tokenizer and chat template)")
      ->required();
  cmd->add_option("--data", args->data, "Data file, as train --data")->required();
  cmd->add_option("--n", args->n, "Examples to show (default 3)")->check(CLI::PositiveNumber);
  cmd->add_flag("--json", args->json, "A JSON array, one {input_ids, labels} object per example");
  cmd->add_option("--seq-len", args->seq_len, "Tokens per example, as train --seq-len");
  cmd->add_option("--tokenizer", args->tokenizer, "As train --tokenizer (default auto)");
  cmd->add_option("--bin-dtype", args->bin_dtype, "Token type of .bin data: uint16 or uint32 (default uint16)")
      ->check(CLI::IsMember({"uint16", "uint32"}));
  add_sft_flags(*cmd, args->sft);
  cmd->callback([args] { run_preview(*args); });
}

}  // namespace autotp::cli
