// An HF config.json, as ModelConfig::from_file reads a model directory's.
#include "autotp/arch/model_config.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace autotp;
  const auto path = fuzz::scratch_dir() / "config.json";
  fuzz::write_file(path, data, size);
  fuzz::expect_user_error_only(path.string(), [&] { (void)ModelConfig::from_file(path.string()); });
  return 0;
}
