// Dropout masks that do not depend on the parallel layout. An element's keep
// bit is a pure function of a key (seed, optimizer step, layer, site) and the
// element's global flat index in the logical tensor, never of a stateful RNG:
// any tensor-parallel size, any data-parallel / micro-batch split and a resumed
// run all draw the same bits. The functions are stateless and thread safe; CPU
// and CUDA give identical masks.
//
// The function (part of the checkpoint / resume contract: changing it changes
// every mask of a resumed run). All arithmetic is on uint32 words, mod 2^32:
//
//   mix(x):   x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16
//             (Chris Wellons' "lowbias32", a bijection of uint32)
//   fold(h, w) = mix((h ^ w) + 0x9e3779b9)
//   key word  k = 0x6a09e667, then k = fold(k, w) for w in
//             [lo32(seed), hi32(seed), lo32(step), hi32(step), lo32(layer), hi32(layer), site]
//             (step and layer as two's-complement 64-bit words; the embeddings' layer -1
//             gives 0xffffffff twice; site the DropoutSite value)
//   hash(i)   = fold(fold(k, lo32(i)), hi32(i))   for the global flat index i
//   dropped   iff hash(i) < T, T = llround(p * 2^32)   (an exact integer threshold)
//
// The global flat index is row-major over the global sizes of `dims`:
// i = sum_d i_d * prod_{e > d} size_e.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "autotp/tp/shard_spec.h"

namespace autotp {

// What a dropout mask is drawn for. LoRA's adapter inputs use
// adapter_dropout_site(module): kLoraInput + 1 + (FNV-1a 32 of the module's name
// inside its layer, e.g. "self_attn.q_proj", mod 2^16).
enum class DropoutSite : int { kEmbedding = 1, kAttentionProbs = 2, kAttentionOutput = 3, kMlpOutput = 4, kLoraInput = 0x10000 };
DropoutSite adapter_dropout_site(const std::string& module_in_layer);

struct DropoutKey {
  uint64_t seed = 0;  // the run's seed
  int64_t step = 0;   // optimizer step
  int64_t layer = 0;  // decoder layer (-1 for the embeddings)
  DropoutSite site = DropoutSite::kEmbedding;
};

// One dim of the global (logical) tensor: its size, and the global index ranges
// this rank holds along it, concatenated in order (empty = the whole dim).
// Dim 0 is the sample index within the optimizer step's global batch, so data-
// parallel ranks and gradient-accumulation micro-batches hold disjoint rows of
// one step-wide mask.
struct DimRanges {
  int64_t size = 0;           // global size of the dim
  std::vector<Segment> held;  // held global ranges, in local order; empty = [0, size)
};

// The scaled keep-mask of the local block: an element with global coordinates
// (i0, i1, ...) is 0 when dropped and 1 / (1 - p) (rounded to the dtype) when
// kept. Shape = the held lengths per dim; dtype and device from `options`.
// p must be in [0, 1) (UserError otherwise); p == 0 gives all ones.
// Memory: one int64 index/state tensor of the local block plus one int64
// scratch (and the high index words when the global tensor has 2^32 elements
// or more), then the bool keep bits and the mask.
torch::Tensor dropout_mask(const DropoutKey& key, double p, const std::vector<DimRanges>& dims,
                           const torch::TensorOptions& options);

// x * mask, x's shape = the local block; differentiable w.r.t. x (the mask is a
// constant, so the gradient is grad * mask). p == 0 returns x itself.
torch::Tensor apply_dropout(const torch::Tensor& x, const DropoutKey& key, double p,
                            const std::vector<DimRanges>& dims);

// The same draw for one element, in scalar code: the definition the tensor
// version is tested against. True when the element is kept.
bool dropout_keeps(const DropoutKey& key, double p, uint64_t global_flat_index);

}  // namespace autotp
