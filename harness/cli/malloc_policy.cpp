#include "cli/malloc_policy.h"

#include <malloc.h>

#include <cstdlib>
#include <string>

#include "autotp/base/huge_pages.h"

namespace autotp::cli {

// glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit; mallopt
// refuses more): blocks below it come from the heap, larger ones are mapped per use.
constexpr int kLargestHeapBlock = 32 << 20;

void retain_freed_memory() {
  const char* setting = std::getenv("AUTOTP_RETAIN_MEMORY");
  if (setting && std::string(setting) == "0") return;
  malloc_trim(0);  // what the one-off work before it freed goes back first
  mallopt(M_MMAP_THRESHOLD, kLargestHeapBlock);  // fixed: no longer moved by what is freed
  mallopt(M_TRIM_THRESHOLD, -1);  // largest value: never trim the top of the heap
  advise_huge_pages_from(kLargestHeapBlock);  // the blocks still mapped per use fault per 2 MiB
}

}  // namespace autotp::cli
