#include "autotp/data/data_tokenizer.h"

#include <filesystem>

#include "autotp/base/error.h"
#include "autotp/data/dataset.h"

namespace autotp {

std::shared_ptr<const tok::TextTokenizer> choose_tokenizer(const std::string& choice, const ModelSource& model,
                                                           const std::string& data_path) {
  if (choice == "bytes") return nullptr;
  if (choice == "auto") return model.dir && holds_text(data_path) ? tok::load_model_tokenizer(*model.dir) : nullptr;
  AUTOTP_USER_CHECK(std::filesystem::is_directory(choice), "--tokenizer {}: not a directory (allowed: {})", choice,
                    kTokenizerChoices);
  return holds_text(data_path) ? tok::load_model_tokenizer(choice) : nullptr;
}

}  // namespace autotp
