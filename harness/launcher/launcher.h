// Local launcher: starts N ranks of a command by exec (never a fork of the
// launcher itself, whose LibTorch thread pools would not survive it; a caller may
// pass a spawner that starts them otherwise), sets the torchrun-style environment,
// forwards their output, and fails fast when one rank fails.
#pragma once
#include <signal.h>
#include <sys/types.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace autotp::launcher {

// One rank's process as the launcher wants it started: argv, its whole environment,
// the descriptor its stdout and stderr go to (stdin is /dev/null), and a descriptor
// (or -1) it must find at number listen_target_fd.
struct RankSpawn {
  std::vector<std::string> argv;
  std::vector<std::string> environment;  // "KEY=value" entries
  int output_fd = -1;
  int listen_fd = -1;
  int listen_target_fd = -1;
};

// Signals a rank starts with at their default action (the launcher may ignore or
// catch them itself), with none blocked.
inline constexpr int kRankDefaultSignals[] = {SIGINT, SIGTERM, SIGPIPE, SIGHUP, SIGQUIT, SIGCHLD};

// Starts a rank as a child of the calling process (the launcher waits for it and
// signals it) and returns its pid; throws std::system_error when it cannot.
using RankSpawner = std::function<pid_t(const RankSpawn&)>;

struct LaunchOptions {
  int nproc = 1;                           // number of local ranks to start
  std::vector<std::string> argv;           // program and arguments each rank runs (argv[0] = path)
  std::map<std::string, std::string> env;  // extra environment for every rank
  int threads_per_rank = 0;                // 0 = max(1, cores / nproc)
  double kill_grace_s = 2.0;               // after a failure: SIGTERM, then SIGKILL after this
  bool prefix_output = false;              // prefix forwarded lines with "[rank N] "
  bool quiet = false;                      // do not forward rank output (still kept for the tail)
  RankSpawner spawner;                     // empty: posix_spawn of argv (an exec per rank)
};

struct RankOutcome {
  int rank = 0;
  int exit_code = 0;                // exit status, or 128 + signal
  bool killed_by_launcher = false;  // stopped by the launcher (another rank failed, or it was interrupted)
  std::string output_tail;          // last lines of its stderr/stdout
};

struct LaunchResult {
  int exit_code = 0;     // 0 when every rank succeeded, else the first failure's code
  int failed_rank = -1;  // first rank that failed on its own, -1 if none
  bool interrupted = false;  // the launcher got SIGINT / SIGTERM and stopped the ranks
  std::vector<RankOutcome> ranks;
  std::string summary;  // error_line, then the tail of the failed rank's output
  // The one line that says why the run failed: the rank, how (exit code, signal,
  // stopped) and its published phase, e.g. "rank 2 was killed by SIGKILL (exit
  // code 137) during backward of step 3; the other ranks were stopped". Empty on success.
  std::string error_line;
  std::string failed_phase;     // the failed rank's last published phase ("" if none; base/run_phase.h)
  int64_t failed_step = -1;     // and its step (-1: none)
  int failed_signal = 0;        // the signal that ended it (SIGSTOP when it was stopped), 0 if it exited
  bool failed_stopped = false;  // it was stopped (state T) and its peers timed out; the launcher killed it
  // Peak of the launcher's and the ranks' proportional set sizes summed (Pss of
  // /proc/PID/smaps_rollup, read when the resident sets' sum passes its earlier
  // high by 1/64 and every 10 s): the machine memory the run held,
  // with the pages the processes share (LibTorch's code) counted once. 0 where the
  // kernel does not report it. A sum of the ranks' own peaks counts those pages
  // once per rank (about 0.19 GiB each for this CUDA build of LibTorch).
  int64_t peak_resident_bytes = 0;
};

// True when RANK and WORLD_SIZE are in the environment (torchrun, SLURM wrappers,
// or a rank started by launch_local): the process then joins that world.
bool in_distributed_world();

// Picks a free TCP port on 127.0.0.1 (free when it returns: another process may
// take it before it is bound again).
int free_port();

// A close-on-exec TCP socket bound to a free port of 127.0.0.1 (written to *port),
// listening unless `listening` is false. The caller closes it.
int listening_socket(int* port, bool listening = true);

// Starts the ranks with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR=127.0.0.1, MASTER_PORT and
// AUTOTP_MASTER_LISTEN_FD (rank 0 gets the launcher's socket listening on that
// port, so no other process can take it; unless MASTER_PORT is set in env) and
// OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / AUTOTP_THREADS = threads_per_rank; waits for all.
// When a rank exits non-zero the others get SIGTERM (then SIGKILL) and the
// result names the failing rank with the tail of its output. SIGINT/SIGTERM to
// the launcher are forwarded to the ranks while it runs (one launch_local at a
// time per process: it installs the handlers for its duration).
LaunchResult launch_local(const LaunchOptions& options);

// Path of the running executable (/proc/self/exe resolved).
std::string self_executable();

// CPUs this process may run on (its affinity mask); the default threads_per_rank
// is max(1, available_cores() / nproc).
int available_cores();

// Called by a rank that is about to exit with an error: writes the time, the
// exit code and the message to the file named by AUTOTP_ERROR_FILE (set by launch_local), so
// the launcher can tell the rank that failed first from peers whose collectives
// broke because of it. Does nothing outside a launch_local world.
void record_rank_failure(const std::string& message, int exit_code = 1);

}  // namespace autotp::launcher
