// Transparent huge pages for large CPU blocks. glibc maps a block past its mmap
// threshold fresh at each allocation and unmaps it on free, so a step that
// allocates such blocks again every step (ZeRO-3's gathers of tensors past
// 32 MiB, the embedding's and the head's gradients, their reduce-scatter
// outputs) pays a page fault per 4 KiB of them each time. Advised as huge pages
// (THP in "madvise" mode, the usual Linux default) they fault once per 2 MiB;
// freed, they still go back to the OS, so resident memory is what it was.
#pragma once
#include <cstddef>
#include <cstdint>

namespace autotp {

// Blocks of at least `bytes` allocated from now on are advised (0, the default: none).
void advise_huge_pages_from(int64_t bytes);
// Called by the CPU allocator with each block it hands out; a no-op below the
// threshold, where the kernel offers no THP, or for a block too small to hold
// an aligned 2 MiB page.
void advise_huge_pages(void* data, size_t bytes);

}  // namespace autotp
