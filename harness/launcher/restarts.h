// Restarts (torchrun's --max-restarts) around launch_local: when a rank fails the
// launcher has already stopped the others; the whole world is then started again,
// with AUTOTP_RESTART_COUNT = 1, 2, ... in its environment (ranks of `train` read it
// and resume from the newest complete checkpoint under --save that this run wrote), at most
// max_restarts times. Failures that another attempt would only repeat are final:
// bad input (exit code 2), non-finite numbers (3), a rank that could not be
// started (127), and an interrupted launcher or a rank killed by SIGINT (Ctrl-C).
#pragma once
#include <functional>
#include <string>

#include "launcher/launcher.h"

namespace autotp::launcher {

inline constexpr const char* kRestartCountVariable = "AUTOTP_RESTART_COUNT";
// Nanoseconds since the epoch when the first attempt started (the same in every attempt).
inline constexpr const char* kRunStartVariable = "AUTOTP_RUN_START_NS";

struct RestartedLaunch {
  LaunchResult last;  // the final attempt's result
  int restarts = 0;   // attempts after the first
};

// True when a failed launch with this result is worth another attempt.
bool worth_restarting(const LaunchResult& result);

// Runs `options` and restarts it up to max_restarts times; `on_restart(n, failed)`
// (may be empty) is told before restart n (1-based) which attempt failed and why.
RestartedLaunch launch_with_restarts(LaunchOptions options, int max_restarts,
                                     const std::function<void(int, const LaunchResult&)>& on_restart = {});

}  // namespace autotp::launcher
