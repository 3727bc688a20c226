#include "autotp/model/dropout_mask.h"

#include <cmath>
#include <limits>

#include "autotp/base/error.h"

namespace autotp {
namespace {

constexpr uint32_t kKeyStart = 0x6a09e667u;
constexpr uint32_t kFoldAdd = 0x9e3779b9u;
constexpr uint32_t kMul1 = 0x7feb352du;
constexpr uint32_t kMul2 = 0x846ca68bu;
constexpr int64_t kWord = 0xffffffffLL;

uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= kMul1;
  x ^= x >> 15;
  x *= kMul2;
  x ^= x >> 16;
  return x;
}

uint32_t fold(uint32_t h, uint32_t w) { return mix((h ^ w) + kFoldAdd); }

uint32_t key_word(const DropoutKey& key) {
  const auto step = static_cast<uint64_t>(key.step);  // two's complement, well defined
  const auto layer = static_cast<uint64_t>(key.layer);
  const uint32_t words[] = {static_cast<uint32_t>(key.seed),
                            static_cast<uint32_t>(key.seed >> 32),
                            static_cast<uint32_t>(step),
                            static_cast<uint32_t>(step >> 32),
                            static_cast<uint32_t>(layer),
                            static_cast<uint32_t>(layer >> 32),
                            static_cast<uint32_t>(static_cast<int>(key.site))};
  uint32_t k = kKeyStart;
  for (uint32_t w : words) k = fold(k, w);
  return k;
}

void check_probability(double p) {
  AUTOTP_USER_CHECK(p >= 0.0 && p < 1.0, "dropout probability must be in [0, 1), got {}", p);
}

// Hashes below this value are dropped; at most 2^32, so it fits int64 exactly.
int64_t drop_threshold(double p) { return std::llround(std::ldexp(p, 32)); }

// The local block's shape, after checking the ranges; sets *global_numel.
std::vector<int64_t> local_shape(const std::vector<DimRanges>& dims, int64_t* global_numel) {
  std::vector<int64_t> shape;
  int64_t numel = 1;
  for (size_t d = 0; d < dims.size(); ++d) {
    const DimRanges& dim = dims[d];
    TORCH_CHECK(dim.size >= 0, "dropout_mask: dim ", d, " has negative size ", dim.size);
    if (dim.size > 0)
      TORCH_CHECK(numel <= std::numeric_limits<int64_t>::max() / dim.size,
                  "dropout_mask: the global tensor has 2^63 elements or more");
    numel *= dim.size;
    if (dim.held.empty()) {
      shape.push_back(dim.size);
      continue;
    }
    int64_t length = 0;
    for (const Segment& s : dim.held) {
      TORCH_CHECK(s.start >= 0 && s.length >= 0 && s.start <= dim.size - s.length, "dropout_mask: segment [",
                  s.start, ", ", s.start + s.length, ") is outside dim ", d, " of size ", dim.size);
      length += s.length;
    }
    shape.push_back(length);
  }
  *global_numel = numel;
  return shape;
}

// Global indices held along one dim, on `device`.
torch::Tensor held_indices(const DimRanges& dim, const torch::Device& device) {
  auto options = torch::TensorOptions().dtype(torch::kInt64).device(device);
  if (dim.held.empty()) return torch::arange(dim.size, options);
  std::vector<torch::Tensor> parts;
  for (const Segment& s : dim.held) parts.push_back(torch::arange(s.start, s.start + s.length, options));
  return torch::cat(parts);
}

// x = (x * c) mod 2^32 for x in [0, 2^32), in int64 without overflow: c is split
// into 16-bit halves, so each product stays below 2^48.
void mul_word(torch::Tensor& x, uint32_t c, torch::Tensor& scratch) {
  torch::mul_out(scratch, x, static_cast<int64_t>(c >> 16));
  scratch.bitwise_and_(int64_t{0xffff}).__ilshift__(16);
  x.mul_(static_cast<int64_t>(c & 0xffffu)).add_(scratch).bitwise_and_(kWord);
}

void xor_shift(torch::Tensor& x, int shift, torch::Tensor& scratch) {
  torch::bitwise_right_shift_out(scratch, x, shift);
  x.bitwise_xor_(scratch);
}

// fold() over a tensor of words, in place; `w` a tensor of words or undefined for 0.
void fold_tensor(torch::Tensor& h, const torch::Tensor& w, torch::Tensor& scratch) {
  if (w.defined()) h.bitwise_xor_(w);
  h.add_(static_cast<int64_t>(kFoldAdd)).bitwise_and_(kWord);
  xor_shift(h, 16, scratch);
  mul_word(h, kMul1, scratch);
  xor_shift(h, 15, scratch);
  mul_word(h, kMul2, scratch);
  xor_shift(h, 16, scratch);
}

// The keep bits of the local block.
torch::Tensor keep_bits(const DropoutKey& key, double p, const std::vector<DimRanges>& dims,
                        const std::vector<int64_t>& shape, int64_t global_numel,
                        const torch::Device& device) {
  // Global flat index: broadcast per-dim index vectors times the global strides.
  auto state = torch::empty(shape, torch::TensorOptions().dtype(torch::kInt64).device(device));
  if (dims.empty()) state.fill_(0);
  int64_t stride = 1;
  for (size_t d = dims.size(); d-- > 0;) {
    std::vector<int64_t> view(dims.size(), 1);
    view[d] = shape[d];
    auto index = held_indices(dims[d], device).mul_(stride).view(view);
    if (d + 1 == dims.size()) {
      state.copy_(index);
    } else {
      state.add_(index);
    }
    stride *= dims[d].size;
  }
  torch::Tensor high;  // undefined while every index is below 2^32 (high word 0)
  if (global_numel - 1 > kWord) high = torch::bitwise_right_shift(state, 32);
  state.bitwise_and_(kWord);
  // h = fold(k, lo32(i)): k ^ lo32(i) is the state xor'ed with k.
  state.bitwise_xor_(static_cast<int64_t>(key_word(key)));
  auto scratch = torch::empty_like(state);
  fold_tensor(state, torch::Tensor(), scratch);
  fold_tensor(state, high, scratch);
  return state.ge(drop_threshold(p));
}

}  // namespace

torch::Tensor dropout_mask(const DropoutKey& key, double p, const std::vector<DimRanges>& dims,
                           const torch::TensorOptions& options) {
  check_probability(p);
  int64_t global_numel = 0;
  auto shape = local_shape(dims, &global_numel);
  auto out_options = options.requires_grad(false);
  if (p == 0.0) return torch::ones(shape, out_options);
  auto mask = torch::zeros(shape, out_options);
  if (mask.numel() == 0) return mask;
  return mask.masked_fill_(keep_bits(key, p, dims, shape, global_numel, mask.device()), 1.0 / (1.0 - p));
}

torch::Tensor apply_dropout(const torch::Tensor& x, const DropoutKey& key, double p,
                            const std::vector<DimRanges>& dims) {
  check_probability(p);
  int64_t global_numel = 0;
  auto shape = local_shape(dims, &global_numel);
  TORCH_CHECK(x.sizes() == torch::IntArrayRef(shape), "apply_dropout: x has shape ", x.sizes(),
              " but the held block is ", torch::IntArrayRef(shape));
  if (p == 0.0) return x;
  return x * dropout_mask(key, p, dims, x.options());
}

bool dropout_keeps(const DropoutKey& key, double p, uint64_t global_flat_index) {
  check_probability(p);
  const uint32_t h = fold(fold(key_word(key), static_cast<uint32_t>(global_flat_index)),
                          static_cast<uint32_t>(global_flat_index >> 32));
  return static_cast<int64_t>(h) >= drop_threshold(p);
}

DropoutSite adapter_dropout_site(const std::string& module_in_layer) {
  uint32_t h = 2166136261u;
  for (unsigned char c : module_in_layer) h = (h ^ c) * 16777619u;
  return static_cast<DropoutSite>(static_cast<int>(DropoutSite::kLoraInput) + 1 + static_cast<int>(h & 0xffffu));
}

}  // namespace autotp
