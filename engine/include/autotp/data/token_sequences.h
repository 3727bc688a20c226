// Token sequences stored as JSON: an array of equal-length arrays of token ids.
// Each sequence s predicts s[1:] from s[:-1].
#pragma once
#include <torch/torch.h>

#include <string>

namespace autotp {

// int64 [num_sequences, length]. UserError naming the file for: unreadable or
// invalid JSON, no sequences, a sequence shorter than 2, ragged lengths, a
// non-integer entry, or an id outside [0, vocab_size).
torch::Tensor read_token_sequences(const std::string& path, int64_t vocab_size);

}  // namespace autotp
