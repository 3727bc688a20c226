// A DeepSpeed-style training config, as `autotp train --config` reads it:
// TrainConfig::from_file, resolve_batch for a few world sizes, and the
// round trip through to_json (what checkpoints store) read back again.
#include "autotp/runtime/train_config.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace autotp;
  const auto path = fuzz::scratch_dir() / "ds_config.json";
  fuzz::write_file(path, data, size);
  TrainConfig parsed;
  bool ok = false;
  fuzz::expect_user_error_only(path.string(), [&] {
    parsed = TrainConfig::from_file(path.string());
    ok = true;
  });
  if (!ok) return 0;
  for (int world : {1, 2, 3, 8}) {
    TrainConfig c = parsed;
    // resolve_batch's errors are about the world size, not the file.
    fuzz::expect_user_error_only("", [&] {
      c.resolve_batch(world);
      c.resolve_batch(world);  // a second call checks the filled triple
    });
  }
  try {
    (void)TrainConfig::from_json(parsed.to_json(), "round trip");
  } catch (const std::exception& e) {
    fuzz::finding("round trip", std::string("from_json(to_json()) of an accepted config failed: ") + e.what());
  }
  return 0;
}
