#include "cli/blas_threads.h"

#include <dlfcn.h>

namespace autotp::cli {

// Looked up at run time: libblas.so.3 may be OpenBLAS or another implementation.
int blas_threads() {
  using Get = int (*)();
  auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get ? get() : 0;
}

void set_blas_threads(int threads) {
  using Set = void (*)(int);
  auto set = reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set && threads > 0) set(threads);
}

}  // namespace autotp::cli
