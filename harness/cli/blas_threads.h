// The BLAS library's own thread pool. OpenBLAS reads OPENBLAS_NUM_THREADS at
// load time and ignores at::set_num_threads, so a process that picks its thread
// count later (a single rank given --threads) must tell OpenBLAS itself.
#pragma once

namespace autotp::cli {

// Threads of OpenBLAS's pool, or 0 when the BLAS in use is not OpenBLAS.
int blas_threads();
// Sets OpenBLAS's pool size (no-op for another BLAS).
void set_blas_threads(int threads);

}  // namespace autotp::cli
