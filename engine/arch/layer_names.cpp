#include "autotp/arch/layer_names.h"

#include <regex>

namespace autotp {

DecoderLayerName decoder_layer_name(const std::string& name) {
  static const std::regex layer_name(R"((^|\.)(layers|h)\.([0-9]+)\.)");
  std::smatch match;
  if (!std::regex_search(name, match, layer_name)) return {};
  return {std::stoll(match[3].str()), match.suffix().str()};
}

int64_t decoder_layer_of(const std::string& name) { return decoder_layer_name(name).layer; }

}  // namespace autotp
