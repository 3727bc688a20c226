// Which tokenizer a run's text data goes through (train --tokenizer, the scenario
// key "tokenizer", tokenize --tokenizer; docs/data.md):
//   "auto"   the model directory's own (tokenizer.json, else tokenizer.model);
//            the byte-level tokenizer for presets
//   "bytes"  the byte-level tokenizer, whatever the model
//   DIR      the tokenizer files in DIR
// Never a silent fallback: a model directory without tokenizer files is a UserError
// once text has to be tokenized.
#pragma once
#include <memory>
#include <string>

#include "autotp/model/presets.h"
#include "autotp/tokenizer/text_tokenizer.h"

namespace autotp {

inline constexpr const char* kTokenizerChoices = "auto, bytes or a directory with tokenizer.json / tokenizer.model";

// Null for the byte-level tokenizer, and for token files (.json, .bin), which are
// ids already.
std::shared_ptr<const tok::TextTokenizer> choose_tokenizer(const std::string& choice, const ModelSource& model,
                                                           const std::string& data_path);

}  // namespace autotp
