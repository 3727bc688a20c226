#include "launcher/restarts.h"

namespace autotp::launcher {

bool worth_restarting(const LaunchResult& result) {
  if (result.exit_code == 0 || result.interrupted) return false;
  return result.exit_code != 2 && result.exit_code != 3 && result.exit_code != 127;
}

RestartedLaunch launch_with_restarts(LaunchOptions options, int max_restarts,
                                     const std::function<void(int, const LaunchResult&)>& on_restart) {
  RestartedLaunch run;
  for (;;) {
    options.env[kRestartCountVariable] = std::to_string(run.restarts);
    run.last = launch_local(options);
    if (run.restarts >= max_restarts || !worth_restarting(run.last)) return run;
    ++run.restarts;
    if (on_restart) on_restart(run.restarts, run.last);
  }
}

}  // namespace autotp::launcher
