// How the process's C heap hands memory back to the OS. A training step frees
// and re-allocates the same large buffers every step (activations, optimizer
// and norm temporaries); glibc serves big blocks with mmap and unmaps them on
// free, so each step paid fresh page faults and zeroing for them (20% of a
// llama-small step on CPU). Meant for loops that repeat one allocation
// pattern (bench-step): a program whose buffers keep growing in size can
// fragment a never-trimmed heap badly (bench-comm's 8 B..256 MiB sweep did).
#pragma once

namespace autotp::cli {

// Serves allocations below 32 MiB from the heap and never trims it, so freed
// memory is reused by the next step (resident memory stays at the peak, as with a
// caching allocator); larger blocks stay mapped per use, as glibc maps them by
// default, and are advised as transparent huge pages (autotp/base/huge_pages.h)
// so that mapping them again costs a fault per 2 MiB, not per 4 KiB.
// AUTOTP_RETAIN_MEMORY=0 in the environment keeps glibc's defaults and 4 KiB pages.
// `train` calls it once the model is built and partitioned: it hands back what
// that freed first. Measured on the 2-core machine with llama-1b-32k, ZeRO-3,
// bf16, 4 ranks: with every block from the heap (mmap off) a rank grew past 6 GB
// and the kernel killed it, called before the model was built or after; with
// this, 19.90 GiB for the 4 ranks and the launcher (19.99 with glibc's defaults).
// Without the huge pages, ZeRO-3 gathers of tensors past 32 MiB faulted in at
// every use made llama-100m fp32 (2 ranks) 1.34x slower than with every block
// from the heap; with them it is level (docs/cli.md).
void retain_freed_memory();

}  // namespace autotp::cli
