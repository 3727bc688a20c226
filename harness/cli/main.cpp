#include "autotp/base/cuda_runtime.h"
#include "cli/cli.h"

int main(int argc, char** argv) {
  autotp::cuda_runtime();  // before LibTorch is asked about CUDA (cuda_runtime.h); nothing without a driver
  return autotp::cli::run(argc, argv);
}
