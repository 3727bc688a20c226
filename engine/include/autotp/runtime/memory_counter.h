// A counting CPU allocator: wraps LibTorch's default CPU allocator and keeps
// the bytes currently allocated and the peak since the last reset. Installed
// process-wide by install_memory_counter(); thread safe (atomics).
#pragma once
#include <cstdint>

namespace autotp {

struct MemoryCounts {
  int64_t current = 0;  // bytes of live CPU tensors
  int64_t peak = 0;     // highest `current` since the last reset_peak()
};

// Installs the counter as LibTorch's CPU allocator (idempotent). Tensors
// allocated before it are not counted.
void install_memory_counter();
bool memory_counter_installed();
MemoryCounts memory_counts();
// Starts a new peak window at the current value.
void reset_memory_peak();

}  // namespace autotp
