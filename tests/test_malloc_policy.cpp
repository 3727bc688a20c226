// The heap policy of `train` (harness/cli/malloc_policy.h): blocks below 32 MiB
// freed by a step stay for the next one; larger ones go back to the OS when freed
// (kept too, a 1 B ZeRO-3 rank's heap fragmented past what the machine holds).
// Each test changes this process's malloc settings: ctest runs each in its own.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>

#include "cli/malloc_policy.h"
#include "support/sanitized_build.h"

namespace autotp::cli {
namespace {

int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

void* volatile g_escape;  // keeps the compiler from eliding the block (written, never read)

// Resident bytes that a block of `bytes`, written and freed, leaves behind.
int64_t left_after_free(size_t bytes) {
  const int64_t before = resident_bytes();
  auto* block = static_cast<char*>(std::malloc(bytes));
  std::memset(block, 1, bytes);
  g_escape = block;
  std::free(g_escape);
  return resident_bytes() - before;
}

// Under a sanitizer its allocator serves malloc and keeps freed blocks in quarantine:
// mallopt changes nothing there, and resident bytes say nothing of glibc's heap.
constexpr const char* kSanitizedSkip =
    "sanitizer build: its allocator replaces glibc's malloc, whose settings retain_freed_memory() sets";

TEST(MallocPolicy, SmallBlocksStayForTheNextStepLargeOnesGoBack) {
  if (test::kSanitizedBuild) GTEST_SKIP() << kSanitizedSkip;
  unsetenv("AUTOTP_RETAIN_MEMORY");
  retain_freed_memory();
  constexpr int64_t kMiB = 1 << 20;
  EXPECT_LT(left_after_free(96 * kMiB), 4 * kMiB) << "a 96 MiB block stayed resident after free";
  EXPECT_GT(left_after_free(24 * kMiB), 20 * kMiB) << "a 24 MiB block went back to the OS";
  // Reused, not grown: the second 24 MiB block takes the first one's pages.
  EXPECT_LT(left_after_free(24 * kMiB), 4 * kMiB);
}

TEST(MallocPolicy, ZeroKeepsGlibcsDefaults) {
  if (test::kSanitizedBuild) GTEST_SKIP() << kSanitizedSkip;
  setenv("AUTOTP_RETAIN_MEMORY", "0", 1);
  retain_freed_memory();
  // glibc maps a first block of 24 MiB (its threshold starts at 128 KiB) and unmaps it when freed.
  EXPECT_LT(left_after_free(24 * 1048576), 4 * 1048576);
}

}  // namespace
}  // namespace autotp::cli
