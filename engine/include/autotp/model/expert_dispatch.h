// Expert parallelism's token exchange for one sparse block. Each routing choice
// (token, slot) of this rank goes to the ep rank that holds its expert: the
// choices are ordered by expert (tokens ascending within one), the per-expert
// counts are exchanged first, then one all-to-all of variable sizes moves the
// hidden states. The local experts run on what arrived (every local expert runs,
// on no rows if none came, so its gradient is zero rather than missing); a
// second all-to-all brings the outputs back, and each token sums its weighted
// outputs in expert order, as the ep-1 loop does. Dropless: every choice is
// computed, so the result is ep 1's. Differentiable: the backward runs the two
// exchanges in reverse.
#pragma once
#include <torch/torch.h>

#include <functional>

#include "autotp/comm/comm.h"
#include "autotp/tp/expert_parallel.h"

namespace autotp {

// Runs local expert `local` (0-based within this rank's range) on `rows` [n, hidden].
using LocalExpert = std::function<torch::Tensor(int64_t local, const torch::Tensor& rows)>;

// x [tokens, hidden]; selected [tokens, k] (expert ids); weights [tokens, k] in x's
// dtype. Returns the weighted sum of the chosen experts' outputs [tokens, hidden].
torch::Tensor dispatch_to_experts(const torch::Tensor& x, const torch::Tensor& selected, const torch::Tensor& weights,
                                  const ExpertPlacement& placement, Comm& ep, const LocalExpert& run);

}  // namespace autotp
