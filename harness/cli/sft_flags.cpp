#include "cli/sft_flags.h"

#include "autotp/data/data_tokenizer.h"

namespace autotp::cli {

void add_sft_flags(CLI::App& command, SftFlags& flags) {
  command.add_option("--prompt-template", flags.prompt_template,
                     "Instruction records: alpaca (stanford_alpaca's prompt), plain, or a JSON file with prompt_input "
                     "and prompt_no_input (default alpaca)");
  command.add_option("--chat-template", flags.chat_template,
                     "Chat records: a Jinja chat template file (.jinja, or .json with \"chat_template\") instead of "
                     "the model directory's");
  command.add_option("--chat-loss", flags.chat_loss,
                     "Chat records: assistant (learn the assistant turns and their end-of-turn tokens) or all "
                     "(every token, TRL's default) (default assistant)")
      ->check(CLI::IsMember({"assistant", "all"}));
}

SftOptions sft_options(const SftFlags& flags, const ModelSource& model, const std::string& tokenizer_choice) {
  SftOptions options;
  options.prompt_template = flags.prompt_template;
  options.chat_template_file = flags.chat_template;
  options.assistant_only_loss = flags.chat_loss == "assistant";
  if (tokenizer_choice != "auto" && tokenizer_choice != "bytes")
    options.chat_template_dir = tokenizer_choice;
  else if (model.dir)
    options.chat_template_dir = *model.dir;
  return options;
}

DataOptions data_options(const ModelSource& model, const std::string& data, int64_t seq_len,
                         const std::string& bin_dtype, const std::string& tokenizer_choice, const SftFlags& flags) {
  DataOptions options;
  options.seq_len = seq_len;
  options.vocab_size = model.config.vocab_size;
  options.bin_dtype = bin_dtype;
  options.tokenizer = choose_tokenizer(tokenizer_choice, model, data);
  options.sft = sft_options(flags, model, tokenizer_choice);
  return options;
}

}  // namespace autotp::cli
