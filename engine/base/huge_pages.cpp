#include "autotp/base/huge_pages.h"

#include <sys/mman.h>

#include <atomic>

namespace autotp {
namespace {
std::atomic<int64_t> g_threshold{0};
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;  // x86-64 and arm64 (4 KiB base pages) PMD size
}  // namespace

void advise_huge_pages_from(int64_t bytes) { g_threshold.store(bytes, std::memory_order_relaxed); }

void advise_huge_pages(void* data, size_t bytes) {
  const int64_t threshold = g_threshold.load(std::memory_order_relaxed);
  if (threshold <= 0 || static_cast<int64_t>(bytes) < threshold || data == nullptr) return;
  // Only whole huge pages inside the block: advising past its ends would touch a neighbour.
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  // Advice only: where THP is off (or "never") the call fails and the block keeps 4 KiB pages.
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace autotp
