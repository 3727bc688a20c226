#include "autotp/base/proc_memory.h"

#include <fstream>
#include <limits>

namespace autotp {

std::optional<int64_t> smaps_rollup_bytes(pid_t pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps_rollup");
  std::string field;
  int64_t kib = 0;
  while (in >> field) {
    if (field == key) return in >> kib ? std::optional<int64_t>(kib * 1024) : std::nullopt;
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return std::nullopt;
}

}  // namespace autotp
