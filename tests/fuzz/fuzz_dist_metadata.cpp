// metadata.json of a distributed checkpoint step directory (the other files
// are the valid ones of tests/fuzz/data/dist_checkpoint), through
// SavedCheckpoint::open, verify and every read export / resume make.
#include "dist_checkpoint_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace autotp;
  const auto& dir = fuzz::step_dir();
  fuzz::write_file(dir / "metadata.json", data, size);
  fuzz::read_checkpoint(dir);
  return 0;
}
