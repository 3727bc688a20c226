// A scenario file (scenarios/*.json), as `autotp scenario FILE` reads it:
// ScenarioSpec::from_file, which also opens the data file and validates every
// variant's config. The scenario's directory holds small data files to name:
// corpus.txt, tokens.json (token arrays) and tokens.bin (uint16).
#include "fuzz_common.h"
#include "scenario/scenario_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace autotp;
  static const std::filesystem::path dir = [] {
    const auto d = fuzz::scratch_dir() / "scenario";
    std::filesystem::create_directories(d / "data");
    std::string text;
    for (int i = 0; i < 40; ++i) text += "The quick brown fox jumps over the lazy dog. ";
    fuzz::write_file(d / "data" / "corpus.txt", text);
    fuzz::write_file(d / "data" / "tokens.json", "[[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1]]");
    std::vector<uint16_t> tokens(400);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i % 250);
    fuzz::write_file(d / "data" / "tokens.bin", tokens.data(), tokens.size() * sizeof(uint16_t));
    return d;
  }();
  const auto path = dir / "scenario.json";
  fuzz::write_file(path, data, size);
  fuzz::expect_user_error_only(path.string(), [&] {
    auto spec = scenario::ScenarioSpec::from_file(path.string());
    (void)spec;
  });
  return 0;
}
