// The flags that say how instruction and chat records become training examples
// (`train`, `data preview`; docs/data.md): --prompt-template, --chat-template, --chat-loss;
// and the data options both commands build from their flags.
#pragma once
#include <CLI/CLI.hpp>

#include <string>

#include "autotp/data/dataset.h"
#include "autotp/data/sft_examples.h"
#include "autotp/model/presets.h"

namespace autotp::cli {

struct SftFlags {
  std::string prompt_template = PromptTemplate::kDefault;
  std::string chat_template;          // a file; "" = the model directory's
  std::string chat_loss = "assistant";  // assistant | all
};

void add_sft_flags(CLI::App& command, SftFlags& flags);

// The options for `model` and the --tokenizer choice: a chat template and its special
// tokens come from the tokenizer directory (--tokenizer DIR), else the model directory.
SftOptions sft_options(const SftFlags& flags, const ModelSource& model, const std::string& tokenizer_choice);

// How `train` and `data preview` read --data: the model's vocabulary, --seq-len,
// --bin-dtype, --tokenizer and the SFT flags.
DataOptions data_options(const ModelSource& model, const std::string& data, int64_t seq_len,
                         const std::string& bin_dtype, const std::string& tokenizer_choice, const SftFlags& flags);

}  // namespace autotp::cli
