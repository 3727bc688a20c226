#include "launcher/restarts.h"

#include <chrono>
#include <csignal>

namespace autotp::launcher {

bool worth_restarting(const LaunchResult& result) {
  if (result.exit_code == 0 || result.interrupted) return false;
  // 130: a rank killed by SIGINT, i.e. Ctrl-C reached the ranks before the launcher saw it.
  return result.exit_code != 2 && result.exit_code != 3 && result.exit_code != 127 && result.exit_code != 128 + SIGINT;
}

RestartedLaunch launch_with_restarts(LaunchOptions options, int max_restarts,
                                     const std::function<void(int, const LaunchResult&)>& on_restart) {
  RestartedLaunch run;
  // Every attempt's ranks learn when the run began: a restart resumes only from a
  // checkpoint written since then, never from an older run's under the same --save.
  const auto start = std::chrono::system_clock::now().time_since_epoch();
  options.env[kRunStartVariable] =
      std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(start).count());
  for (;;) {
    options.env[kRestartCountVariable] = std::to_string(run.restarts);
    run.last = launch_local(options);
    if (run.restarts >= max_restarts || !worth_restarting(run.last)) return run;
    ++run.restarts;
    if (on_restart) on_restart(run.restarts, run.last);
  }
}

}  // namespace autotp::launcher
