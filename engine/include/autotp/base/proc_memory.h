// A process's memory as Linux's /proc/PID/smaps_rollup sums it over its mappings
// (Pss, AnonHugePages, ...): what the launcher samples for the peak it reports
// and what the heap tests check.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

namespace autotp {

// The field `key` (as the file spells it, e.g. "Pss:") in bytes; nullopt where
// /proc does not say (the process exited, or a kernel without smaps_rollup).
std::optional<int64_t> smaps_rollup_bytes(pid_t pid, const std::string& key);

}  // namespace autotp
