// Shared by fuzz_dist_metadata.cpp and fuzz_dist_shard.cpp: a scratch step
// directory holding a copy of the tiny valid checkpoint in tests/fuzz/data/
// dist_checkpoint (tp 2, dp 2, ZeRO stage 2: metadata.json and four rank files),
// and reading a checkpoint the way `autotp export` / `train --resume` do.
#pragma once
#include <torch/torch.h>

#include "autotp/checkpoint/dist_checkpoint.h"
#include "fuzz_common.h"

namespace autotp::fuzz {

inline std::string read_template(const std::string& name) {
  std::ifstream in(std::filesystem::path(AUTOTP_FUZZ_DATA_DIR) / "dist_checkpoint" / name, std::ios::binary);
  if (!in.good()) finding("setup", "cannot read " + name + " of " AUTOTP_FUZZ_DATA_DIR "/dist_checkpoint");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The step directory, filled with the template's files once.
inline const std::filesystem::path& step_dir() {
  static const std::filesystem::path dir = [] {
    const auto d = scratch_dir() / "step_1";
    std::filesystem::create_directories(d);
    for (const char* name : {"metadata.json", "tp0_dp0.safetensors", "tp0_dp1.safetensors", "tp1_dp0.safetensors",
                             "tp1_dp1.safetensors"})
      write_file(d / name, read_template(name));
    return d;
  }();
  return dir;
}

// Opens the step directory and reads what export and resume read: the file
// checks, every tensor's full value of every state, every rank's rng_state.
inline void read_checkpoint(const std::filesystem::path& dir) {
  expect_user_error_only(dir.string(), [&] {
    const auto ckpt = io::SavedCheckpoint::open(dir.string());
    ckpt.verify();
    const auto& meta = ckpt.metadata();
    std::vector<std::string> states = {"master"};
    for (const auto& s : meta.optimizer_states) states.push_back("optimizer." + s);
    for (const auto& state : states)
      for (size_t i = 0; i < meta.tensors.size(); ++i) (void)ckpt.read_full(i, state);
    for (int rank = 0; rank < meta.tp * meta.dp; ++rank) (void)ckpt.read_rng_state(rank);
  });
}

}  // namespace autotp::fuzz
