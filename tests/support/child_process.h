// A child process started by exec (posix_spawnp, never a bare fork) whose
// stdout and stderr go to a log file, with the moment it exited. Tests that
// start ranks themselves (inside network namespaces, torchrun-style) use it.
// The destructor kills (SIGKILL) and reaps a child still running, so a failing
// test leaves no process behind. Not thread-safe; one owner.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace autotp::test {

class ChildProcess {
 public:
  using Clock = std::chrono::steady_clock;

  // Starts argv[0] (looked up in PATH) with argv; output (both streams) to `log_path`.
  ChildProcess(const std::vector<std::string>& argv, std::string log_path);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  // Reaps the child if it has exited; true once it has.
  bool poll();
  // Waits until the child exits or `deadline` passes; true when it exited.
  bool wait_until(Clock::time_point deadline);
  bool exited() const { return exit_code_.has_value(); }
  // Exit status, or 128 + signal number when a signal ended it (only once exited).
  int exit_code() const { return exit_code_.value(); }
  // When poll() saw it gone (resolution: the caller's polling interval).
  Clock::time_point exited_at() const { return exited_at_; }
  // Everything it wrote so far.
  std::string output() const;

 private:
  pid_t pid_ = -1;
  std::string log_path_;
  std::optional<int> exit_code_;
  Clock::time_point exited_at_;
};

}  // namespace autotp::test
