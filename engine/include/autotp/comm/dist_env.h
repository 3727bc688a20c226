// The distributed environment of this process, as torchrun-style variables.
#pragma once
#include <string>

namespace autotp {

inline constexpr const char* kMasterListenFdVariable = "AUTOTP_MASTER_LISTEN_FD";

struct DistEnv {
  int rank = 0;                  // RANK
  int world_size = 1;            // WORLD_SIZE
  int local_rank = 0;            // LOCAL_RANK (defaults to rank)
  int local_world_size = 1;      // LOCAL_WORLD_SIZE (defaults to world_size)
  std::string master_addr = "127.0.0.1";  // MASTER_ADDR
  int master_port = 0;           // MASTER_PORT (0 = single process, no store needed)
  int threads = 0;               // AUTOTP_THREADS (0 = leave torch's default)
  // AUTOTP_MASTER_LISTEN_FD: an inherited socket already listening on MASTER_PORT,
  // which rank 0's TCPStore serves on instead of binding the port itself (set by
  // the local launcher; -1 = none).
  int master_listen_fd = -1;
  // How many times this world was started again after a failure: AUTOTP_RESTART_COUNT
  // (autotp's launcher, --max-restarts) or TORCHELASTIC_RESTART_COUNT (torchrun).
  int restart_count = 0;

  // Reads the variables; a process without RANK/WORLD_SIZE is rank 0 of 1.
  // Malformed values are a UserError naming the variable.
  static DistEnv from_environment();
};

}  // namespace autotp
