// A counting CPU allocator: wraps LibTorch's default CPU allocator and keeps
// the bytes currently allocated and the peak since the last reset. Installed
// process-wide by install_memory_counter(); thread safe (atomics).
#pragma once
#include <cstdint>

namespace autotp {

// Kinds of transient bytes the engine marks as it allocates them (ZeroOptimizer:
// stage-3 units gathered for use, gradients copied into reduction buckets), so a
// peak can be broken down by kind.
enum class MemoryTag { kGatheredParams = 0, kGradientBuckets = 1 };
constexpr int kMemoryTags = 2;

struct MemoryCounts {
  int64_t current = 0;  // bytes of live CPU tensors
  int64_t peak = 0;     // highest `current` since the last reset_peak()
  int64_t tags_at_peak[kMemoryTags] = {};  // each tag's bytes at the moment of `peak`
};

// Installs the counter as LibTorch's CPU allocator (idempotent). Tensors
// allocated before it are not counted.
void install_memory_counter();
bool memory_counter_installed();
MemoryCounts memory_counts();
// Starts a new peak window at the current value.
void reset_memory_peak();
// Adds (or with a negative count removes) tagged bytes; call around the
// allocation and release of what they describe. Cheap; works without the counter too.
void memory_tag_add(MemoryTag tag, int64_t bytes);

}  // namespace autotp
