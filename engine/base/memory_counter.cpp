#include "autotp/base/memory_counter.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#include "autotp/base/huge_pages.h"

namespace autotp {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_installed{false};
std::atomic<int64_t> g_tags[kMemoryTags];
int64_t g_tags_at_peak[kMemoryTags];  // under g_mutex

// LibTorch's raw_allocate needs the DataPtr's context to be the data pointer,
// so sizes live in a side table instead of a wrapper context.
std::mutex g_mutex;
std::unordered_map<void*, int64_t>& sizes() {
  static auto* table = new std::unordered_map<void*, int64_t>();  // leaked: outlives static destructors
  return *table;
}

void release(void* data) {
  if (!data) return;
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = sizes().find(data);
    if (it != sizes().end()) {
      bytes = it->second;
      sizes().erase(it);
    }
  }
  g_current.fetch_sub(bytes, std::memory_order_relaxed);
  c10::free_cpu(data);
}

class CountingAllocator : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    void* data = c10::alloc_cpu(bytes);
    advise_huge_pages(data, bytes);  // before its pages are first touched
    std::lock_guard<std::mutex> lock(g_mutex);
    sizes()[data] = static_cast<int64_t>(bytes);
    const int64_t now = g_current.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed) + bytes;
    if (now > g_peak.load(std::memory_order_relaxed)) {
      g_peak.store(now, std::memory_order_relaxed);
      for (int t = 0; t < kMemoryTags; ++t) g_tags_at_peak[t] = g_tags[t].load(std::memory_order_relaxed);
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

void install_memory_counter() {
  if (g_installed.exchange(true)) return;
  // Leaked on purpose: tensors may outlive every static destructor.
  static auto* counter = new CountingAllocator();
  c10::SetCPUAllocator(counter, /*priority=*/100);
}

bool memory_counter_installed() { return g_installed.load(); }

MemoryCounts memory_counts() {
  std::lock_guard<std::mutex> lock(g_mutex);
  MemoryCounts counts{g_current.load(), g_peak.load()};
  for (int t = 0; t < kMemoryTags; ++t) counts.tags_at_peak[t] = g_tags_at_peak[t];
  return counts;
}

void reset_memory_peak() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_peak.store(g_current.load());
  for (int t = 0; t < kMemoryTags; ++t) g_tags_at_peak[t] = g_tags[t].load();
}

void memory_tag_add(MemoryTag tag, int64_t bytes) {
  g_tags[static_cast<int>(tag)].fetch_add(bytes, std::memory_order_relaxed);
}

}  // namespace autotp
