// A rank file (tp0_dp0.safetensors) of a distributed checkpoint. The CRC-32 check
// would reject almost every mutation before the parser, so metadata.json (the
// template's) gets this input's CRC-32 and size written in first: the reader
// behind the check is what is fuzzed. Then SavedCheckpoint::open, verify and
// every read export / resume make.
#include <nlohmann/json.hpp>

#include "autotp/io/checksum.h"
#include "dist_checkpoint_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace autotp;
  static const nlohmann::json metadata = nlohmann::json::parse(fuzz::read_template("metadata.json"));
  const auto& dir = fuzz::step_dir();
  fuzz::write_file(dir / "tp0_dp0.safetensors", data, size);
  nlohmann::json fixed = metadata;
  for (auto& f : fixed["files"]) {
    if (f["name"] != "tp0_dp0.safetensors") continue;
    f["crc32"] = io::crc32_update(0, data, size);
    f["bytes"] = size;
  }
  fuzz::write_file(dir / "metadata.json", fixed.dump(1));
  fuzz::read_checkpoint(dir);
  return 0;
}
