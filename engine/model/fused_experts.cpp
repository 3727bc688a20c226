#include "autotp/model/fused_experts.h"

#include <fmt/ranges.h>

#include <regex>

#include "autotp/base/error.h"

namespace autotp {

std::string transformers5_module_name(const std::string& name) {
  const std::string from = ".block_sparse_moe.";
  const size_t at = name.find(from);
  if (at == std::string::npos) return "";
  return name.substr(0, at) + ".mlp." + name.substr(at + from.size());
}

std::optional<FusedExpertSlice> fused_expert_slice(const io::CheckpointReader& checkpoint, const std::string& name,
                                                   int64_t expert_intermediate_size) {
  static const std::regex expert(
      R"(^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$)");
  std::smatch m;
  if (!std::regex_match(name, m, expert)) return std::nullopt;
  const std::string proj = m[3];
  const bool down = proj == "w2" || proj == "down_proj";
  FusedExpertSlice slice;
  slice.fused_name = m[1].str() + ".mlp.experts." + (down ? "down_proj" : "gate_up_proj");
  if (!checkpoint.contains(slice.fused_name)) return std::nullopt;
  slice.expert = std::stoll(m[2]);
  if (!down) {
    slice.rows = expert_intermediate_size;
    slice.row_begin = proj == "w3" || proj == "up_proj" ? expert_intermediate_size : 0;
  }
  const auto& shape = checkpoint.info(slice.fused_name).shape;
  AUTOTP_USER_CHECK(shape.size() == 3 && slice.expert < shape[0] &&
                        (down || shape[1] == 2 * expert_intermediate_size),
                    "checkpoint tensor '{}' has shape [{}], which does not hold expert {} of intermediate size {} "
                    "(transformers 5's fused layout: [experts, 2 x intermediate, hidden] for gate_up_proj, "
                    "[experts, hidden, intermediate] for down_proj)",
                    slice.fused_name, fmt::join(shape, ", "), slice.expert, expert_intermediate_size);
  return slice;
}

torch::Tensor read_fused_expert(const io::CheckpointReader& checkpoint, const FusedExpertSlice& slice,
                                torch::ScalarType dtype) {
  torch::Tensor expert = checkpoint.read_slice(slice.fused_name, 0, slice.expert, 1, dtype).squeeze(0);
  if (slice.rows > 0) expert = expert.narrow(0, slice.row_begin, slice.rows);
  return expert.contiguous();
}

}  // namespace autotp
