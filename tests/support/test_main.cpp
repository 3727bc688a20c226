// GoogleTest main that doubles as a worker rank: `<test binary> --autotp-worker
// NAME ARGS...` runs the AUTOTP_WORKER named NAME (see multiprocess.h) instead
// of the tests; it exits 0 on success and 1 with the error on stderr otherwise.
// Ranks that run_workers starts come from the worker zygote (worker_zygote.h),
// forked here before anything else runs, and enter worker_main as an exec would.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "autotp/base/cuda_runtime.h"
#include "autotp/base/memory_counter.h"
#include "support/multiprocess.h"
#include "support/worker_zygote.h"

namespace {

int worker_main(int argc, char** argv) {
  autotp::install_memory_counter();  // as the CLI does: memory metrics are real in tests too
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s --autotp-worker NAME [ARGS...]\n", argv[0]);
    return 2;
  }
  return autotp::test::run_worker_main(argv[2], std::vector<std::string>(argv + 3, argv + argc));
}

}  // namespace

int main(int argc, char** argv) {
  // Before LibTorch is asked about CUDA (cuda_runtime.h), and before the zygote forks
  // (loading initialises no CUDA context). Nothing happens without a driver.
  autotp::cuda_runtime();
  if (argc >= 2 && std::string(argv[1]) == "--autotp-worker") return worker_main(argc, argv);
  autotp::test::start_worker_zygote(&worker_main);
  autotp::install_memory_counter();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
