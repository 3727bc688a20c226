// One logger for the engine. Lines carry the rank ("[rank 1] ..."); by default
// only rank 0 prints info lines, every rank prints warnings and errors.
#pragma once
#include <spdlog/spdlog.h>

namespace autotp {

struct LogOptions {
  int rank = 0;                   // this process's global rank
  bool all_ranks = false;         // print info lines from every rank, not only rank 0
  spdlog::level::level_enum level = spdlog::level::info;
};

// Sets up the process-wide logger; safe to call more than once. Reads
// AUTOTP_LOG_ALL_RANKS=1 and AUTOTP_LOG_LEVEL=debug|info|warn|error from the environment.
void init_logging(const LogOptions& options = {});

// The engine's logger (stderr). init_logging need not have been called.
spdlog::logger& log();

}  // namespace autotp
