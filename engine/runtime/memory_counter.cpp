#include "autotp/runtime/memory_counter.h"

#include <c10/core/CPUAllocator.h>

#include <atomic>

namespace autotp {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_installed{false};

struct Allocation {
  c10::DataPtr inner;  // the base allocator's pointer, freed with it
  int64_t bytes;
};

void release(void* context) {
  auto* allocation = static_cast<Allocation*>(context);
  g_current.fetch_sub(allocation->bytes, std::memory_order_relaxed);
  delete allocation;
}

class CountingAllocator : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t bytes) const override {
    auto* allocation = new Allocation{base_->allocate(bytes), static_cast<int64_t>(bytes)};
    int64_t now = g_current.fetch_add(allocation->bytes, std::memory_order_relaxed) + allocation->bytes;
    int64_t peak = g_peak.load(std::memory_order_relaxed);
    while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    void* data = allocation->inner.get();
    return {data, allocation, &release, c10::Device(c10::DeviceType::CPU)};
  }

 private:
  c10::Allocator* base_;
};

}  // namespace

void install_memory_counter() {
  if (g_installed.exchange(true)) return;
  // Leaked on purpose: tensors may outlive every static destructor.
  static auto* counter = new CountingAllocator(c10::GetDefaultCPUAllocator());
  c10::SetCPUAllocator(counter, /*priority=*/100);
}

bool memory_counter_installed() { return g_installed.load(); }

MemoryCounts memory_counts() { return {g_current.load(), g_peak.load()}; }

void reset_memory_peak() { g_peak.store(g_current.load()); }

}  // namespace autotp
