// The heap policy of `train` (harness/cli/malloc_policy.h): blocks below 32 MiB
// freed by a step stay for the next one; larger ones go back to the OS when freed
// (kept too, a 1 B ZeRO-3 rank's heap fragmented past what the machine holds),
// advised as transparent huge pages so that mapping them again faults per 2 MiB.
// Each test changes this process's malloc settings: ctest runs each in its own.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include <torch/torch.h>

#include "autotp/base/proc_memory.h"
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

// AnonHugePages of this process: anonymous memory mapped as transparent huge pages
// (-1 where /proc does not say).
int64_t huge_page_bytes() { return smaps_rollup_bytes(getpid(), "AnonHugePages:").value_or(-1); }

// The kernel's THP mode, the word in brackets ("always", "madvise", "never"), or "" without THP.
std::string thp_mode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(in, line);
  const auto open = line.find('['), close = line.find(']');
  if (open == std::string::npos || close == std::string::npos) return "";
  return line.substr(open + 1, close - open - 1);
}

// Huge-page bytes that a 96 MiB tensor from LibTorch's CPU allocator (the
// counting allocator, as in the CLI) holds once written.
int64_t huge_pages_of_a_large_tensor() {
  const int64_t before = huge_page_bytes();
  torch::Tensor t = torch::ones({24 << 20}, torch::kFloat32);
  return huge_page_bytes() - before;
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

TEST(MallocPolicy, LargeBlocksAreMappedAsHugePages) {
  if (test::kSanitizedBuild) GTEST_SKIP() << kSanitizedSkip;
  const std::string mode = thp_mode();
  if (mode != "madvise" && mode != "always")
    GTEST_SKIP() << "the kernel offers no transparent huge pages to advise (THP mode '" << mode << "')";
  ASSERT_GE(huge_page_bytes(), 0) << "no AnonHugePages in /proc/self/smaps_rollup";
  unsetenv("AUTOTP_RETAIN_MEMORY");
  retain_freed_memory();
  // 47 or 48 of its 2 MiB pages lie whole inside it. The kernel falls back to 4 KiB
  // pages where it has no free 2 MiB ones; a machine with memory to spare has them.
  EXPECT_GE(huge_pages_of_a_large_tensor(), 64 << 20);
}

TEST(MallocPolicy, ZeroLeavesLargeBlocksUnadvised) {
  if (test::kSanitizedBuild) GTEST_SKIP() << kSanitizedSkip;
  if (thp_mode() != "madvise")
    GTEST_SKIP() << "only THP mode 'madvise' maps just what is advised (here '" << thp_mode() << "')";
  setenv("AUTOTP_RETAIN_MEMORY", "0", 1);
  retain_freed_memory();
  EXPECT_EQ(huge_pages_of_a_large_tensor(), 0);
}

}  // namespace
}  // namespace autotp::cli
