#include "autotp/data/batch.h"

namespace autotp {

Batch collate(const Dataset& data, const std::vector<int64_t>& indices) {
  TORCH_CHECK(!indices.empty(), "collate: no example indices");
  const auto rows = static_cast<int64_t>(indices.size());
  const int64_t seq_len = data.seq_len();
  Batch batch{torch::empty({rows, seq_len}, torch::kLong), torch::empty({rows, seq_len}, torch::kLong)};
  int64_t* inputs = batch.input_ids.data_ptr<int64_t>();
  int64_t* labels = batch.labels.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    const Example example = data.get(indices[static_cast<size_t>(row)]);
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(example.input_ids.size()) == seq_len &&
                              static_cast<int64_t>(example.labels.size()) == seq_len,
                          "collate: example ", indices[static_cast<size_t>(row)], " has ",
                          example.input_ids.size(), " inputs and ", example.labels.size(),
                          " labels, but the dataset's seq_len is ", seq_len);
    std::copy(example.input_ids.begin(), example.input_ids.end(), inputs + row * seq_len);
    std::copy(example.labels.begin(), example.labels.end(), labels + row * seq_len);
  }
  return batch;
}

namespace {

constexpr uint64_t kFnvOffset = 0xCBF29CE484222325ULL;
constexpr uint64_t kFnvPrime = 0x100000001B3ULL;

// Values go in as 8 little-endian bytes each, independent of the tensor's layout.
uint64_t fnv1a(uint64_t hash, int64_t value) {
  auto bits = static_cast<uint64_t>(value);
  for (int byte = 0; byte < 8; ++byte) {
    hash ^= (bits >> (8 * byte)) & 0xFF;
    hash *= kFnvPrime;
  }
  return hash;
}

uint64_t hash_tensor(uint64_t hash, const torch::Tensor& tensor) {
  const torch::Tensor values = tensor.to(torch::kLong).contiguous();
  hash = fnv1a(hash, values.dim());
  for (int64_t extent : values.sizes()) hash = fnv1a(hash, extent);
  const int64_t* data = values.data_ptr<int64_t>();
  for (int64_t i = 0; i < values.numel(); ++i) hash = fnv1a(hash, data[i]);
  return hash;
}

}  // namespace

uint64_t batch_hash(const Batch& batch) {
  return hash_tensor(hash_tensor(kFnvOffset, batch.input_ids), batch.labels);
}

}  // namespace autotp
