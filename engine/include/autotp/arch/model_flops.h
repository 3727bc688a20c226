// Model FLOPs of one token's forward + backward, the numerator of every MFU
// (bench-step, the simulator): 6 x the weights of every matmul (the LM head
// included, tied or not) plus 12 x layers x heads x head_dim x seq for the
// attention products QK^T and PV over the whole sequence (PaLM's definition,
// computed unmasked). Recomputation is not counted.
#pragma once
#include <cstdint>

#include "autotp/arch/model_config.h"

namespace autotp {

double model_flops_per_token(const ModelConfig& config, int64_t seq_len);

}  // namespace autotp
