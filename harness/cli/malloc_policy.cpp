#include "cli/malloc_policy.h"

#include <malloc.h>

#include <cstdlib>
#include <string>

namespace autotp::cli {

void retain_freed_memory() {
  const char* setting = std::getenv("AUTOTP_RETAIN_MEMORY");
  if (setting && std::string(setting) == "0") return;
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, -1);  // largest value: never trim the top of the heap
}

}  // namespace autotp::cli
