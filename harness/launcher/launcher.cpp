#include "launcher/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "autotp/base/error.h"
#include "autotp/base/log.h"
#include "autotp/base/proc_memory.h"
#include "autotp/base/run_phase.h"
#include "autotp/comm/dist_env.h"

extern char** environ;

namespace autotp::launcher {
namespace {

constexpr size_t kTailLines = 40;
constexpr size_t kMaxLineBytes = 64 * 1024;  // a longer "line" is forwarded in pieces
constexpr int kPollMs = 20;                  // also how often exited ranks are reaped
constexpr int64_t kResidentSampleNs = 1'000'000'000;  // how often the run's resident set is looked at
// Pss walks a process's page tables (about 8 ms of CPU for a LibTorch rank,
// taken from a core the ranks train on): it is read when the resident sets'
// sum passes its high at the earlier readings by 1/64, and at least this often.
constexpr int64_t kProportionalSampleNs = 10'000'000'000;
constexpr const char* kErrorFileVariable = "AUTOTP_ERROR_FILE";
// Rank 0 finds the launcher's listening socket at this descriptor (see
// master_listen_fd in dist_env.h).
constexpr int kMasterListenFd = 3;

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

std::system_error errno_error(const std::string& what) {
  return std::system_error(errno, std::generic_category(), what);
}

// SIGINT / SIGTERM to the launcher are written to a self-pipe and forwarded
// to the ranks by the poll loop (only async-signal-safe work in the handler).
int signal_pipe_write = -1;
extern "C" void on_launcher_signal(int signo) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signo);
  if (signal_pipe_write >= 0) {
    const ssize_t ignored = write(signal_pipe_write, &byte, 1);
    (void)ignored;
  }
  errno = saved_errno;
}

class SignalForwarding {
 public:
  SignalForwarding() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) throw errno_error("launcher: pipe2");
    read_fd_ = fds[0];
    signal_pipe_write = fds[1];
    struct sigaction action {};
    action.sa_handler = on_launcher_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~SignalForwarding() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    close(signal_pipe_write);
    signal_pipe_write = -1;
    close(read_fd_);
  }
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

  int fd() const { return read_fd_; }

 private:
  int read_fd_ = -1;
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

struct Rank {
  pid_t pid = -1;
  int output_fd = -1;     // read end of the rank's stdout+stderr pipe
  bool running = false;   // spawned and not yet reaped
  bool signaled = false;  // the launcher sent it SIGTERM/SIGKILL/a forwarded signal
  int64_t signaled_ns = 0;
  int64_t exited_ns = 0;
  int exit_code = 0;
  int terminating_signal = 0;  // set when the rank died by a signal
  std::string partial_line;
  std::deque<std::string> tail;
  std::string error_file;
  std::string phase_file;           // the rank's published phase (base/run_phase.h)
  bool stopped_at_failure = false;  // in state T (SIGSTOP) when another rank's failure arrived
};

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// "SIGKILL" (or "signal 64" for one without a name).
std::string signal_name(int signo) {
  const char* abbreviation = sigabbrev_np(signo);
  return abbreviation ? fmt::format("SIG{}", abbreviation) : fmt::format("signal {}", signo);
}

// The process state letter of /proc/PID/stat ('T': stopped by a signal), 0 if gone.
char process_state(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  std::getline(in, stat);
  const auto paren = stat.rfind(')');  // the command name may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < stat.size() ? stat[paren + 2] : 0;
}

// What a rank recorded about its own failure (see record_rank_failure).
struct RecordedFailure {
  int64_t ns = 0;     // when
  int exit_code = 1;  // the code it was about to exit with
};
std::optional<RecordedFailure> recorded_failure(const std::string& path) {
  std::ifstream in(path);
  RecordedFailure recorded;
  if (!(in >> recorded.ns)) return std::nullopt;
  if (!(in >> recorded.exit_code)) recorded.exit_code = 1;
  return recorded;
}

// A process's proportional set size in bytes (shared pages divided among their
// sharers), 0 when /proc does not say (exited, or a kernel without smaps_rollup).
int64_t proportional_set_bytes(pid_t pid) { return smaps_rollup_bytes(pid, "Pss:").value_or(0); }

// A process's resident set in bytes from /proc/PID/statm (a counter the kernel
// keeps: no page-table walk), 0 when /proc does not say.
int64_t resident_set_bytes(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/statm", pid));
  int64_t size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return resident * sysconf(_SC_PAGESIZE);
}

// posix_spawn: the child runs no code of ours between fork and exec (LibTorch's
// thread pools would not survive a plain fork). Returns 0 or the error number.
int posix_spawn_rank(const RankSpawn& request, pid_t* pid) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, request.output_fd, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, request.output_fd, STDERR_FILENO);
  // dup2 clears close-on-exec on the copy (glibc also when the numbers are equal).
  if (request.listen_fd >= 0) posix_spawn_file_actions_adddup2(&actions, request.listen_fd, request.listen_target_fd);
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t defaults, mask;
  sigemptyset(&defaults);
  for (int signo : kRankDefaultSignals) sigaddset(&defaults, signo);
  sigemptyset(&mask);
  posix_spawnattr_setsigdefault(&attributes, &defaults);
  posix_spawnattr_setsigmask(&attributes, &mask);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);

  std::vector<char*> argv, envp;
  for (const auto& arg : request.argv) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  for (const auto& entry : request.environment) envp.push_back(const_cast<char*>(entry.c_str()));
  envp.push_back(nullptr);

  const int error = posix_spawnp(pid, argv[0], &actions, &attributes, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  return error;
}

class LocalLaunch {
 public:
  explicit LocalLaunch(const LaunchOptions& options) : options_(options), ranks_(options.nproc) {}

  ~LocalLaunch() { close_master_socket(); }

  LaunchResult run() {
    SignalForwarding signals;
    open_master_socket();  // first: the destructor closes it if make_error_dir throws
    make_error_dir();
    const auto environments = rank_environments();
    try {
      for (int r = 0; r < options_.nproc; ++r) {
        const bool started = spawn(r, environments[r]);
        if (r == 0) close_master_socket();  // rank 0 holds it now
        if (!started) break;
      }
    } catch (...) {
      // Leave no rank behind: stop the ones already started, then report.
      stop_all(SIGKILL);
      loop(signals.fd());
      remove_error_dir();
      throw;
    }
    loop(signals.fd());
    LaunchResult result = summarize();
    remove_error_dir();
    return result;
  }

 private:
  // A port picked by binding port 0 and closing can be taken before rank 0's store
  // binds it again (by any process's outgoing connection, as ephemeral ports come
  // from the same range). The launcher binds and listens itself and hands the socket
  // to rank 0, so the port is never free in between.
  void open_master_socket() {
    if (options_.nproc < 2 || options_.env.count("MASTER_PORT")) return;
    master_socket_ = listening_socket(&master_port_);
    // Above stdio, so the spawn's dup2 onto 0-2 cannot replace it (a launcher started
    // with a closed stdin gets fd 0 from socket()).
    if (master_socket_ <= STDERR_FILENO) {
      const int moved = fcntl(master_socket_, F_DUPFD_CLOEXEC, STDERR_FILENO + 1);
      const int saved_errno = errno;
      close(master_socket_);
      master_socket_ = -1;
      if (moved < 0) {
        errno = saved_errno;
        throw errno_error("launcher: fcntl F_DUPFD_CLOEXEC");
      }
      master_socket_ = moved;
    }
  }
  void close_master_socket() {
    if (master_socket_ >= 0) close(master_socket_);
    master_socket_ = -1;
  }

  void make_error_dir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = fmt::format("{}/autotp-launch-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(pattern.data()) == nullptr) throw errno_error("launcher: mkdtemp " + pattern);
    error_dir_ = pattern;
    for (int r = 0; r < options_.nproc; ++r) {
      ranks_[r].error_file = fmt::format("{}/rank{}.err", error_dir_, r);
      ranks_[r].phase_file = fmt::format("{}/rank{}.phase", error_dir_, r);
    }
  }
  void remove_error_dir() {
    for (const auto& rank : ranks_) {
      unlink(rank.error_file.c_str());
      unlink(rank.phase_file.c_str());
    }
    rmdir(error_dir_.c_str());
  }

  std::vector<std::vector<std::string>> rank_environments() const {
    std::map<std::string, std::string> base;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      const char* equals = std::strchr(*entry, '=');
      if (equals != nullptr) base[std::string(*entry, static_cast<size_t>(equals - *entry))] = equals + 1;
    }
    base.erase(kMasterListenFdVariable);  // a launcher started by a rank 0 must not pass its fd on
    const int threads = options_.threads_per_rank > 0 ? options_.threads_per_rank
                                                      : std::max(1, available_cores() / options_.nproc);
    base["MASTER_ADDR"] = "127.0.0.1";
    base["MASTER_PORT"] = options_.env.count("MASTER_PORT") ? options_.env.at("MASTER_PORT")
                          : master_socket_ >= 0      ? std::to_string(master_port_)
                                                     : std::to_string(free_port());
    base["OMP_NUM_THREADS"] = base["OPENBLAS_NUM_THREADS"] = base["AUTOTP_THREADS"] = std::to_string(threads);
    for (const auto& [key, value] : options_.env) base[key] = value;
    base["WORLD_SIZE"] = base["LOCAL_WORLD_SIZE"] = std::to_string(options_.nproc);

    std::vector<std::vector<std::string>> environments;
    for (int r = 0; r < options_.nproc; ++r) {
      auto env = base;
      env["RANK"] = env["LOCAL_RANK"] = std::to_string(r);
      env[kErrorFileVariable] = ranks_[r].error_file;
      env[kPhaseFileVariable] = ranks_[r].phase_file;
      if (r == 0 && master_socket_ >= 0) env[kMasterListenFdVariable] = std::to_string(kMasterListenFd);
      std::vector<std::string> entries;
      for (const auto& [key, value] : env) entries.push_back(key + "=" + value);
      environments.push_back(std::move(entries));
    }
    return environments;
  }

  bool spawn(int r, const std::vector<std::string>& environment) {
    Rank& rank = ranks_[r];
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) throw errno_error("launcher: pipe2");
    RankSpawn request{options_.argv, environment, fds[1], -1, -1};
    if (r == 0 && master_socket_ >= 0) {
      request.listen_fd = master_socket_;
      request.listen_target_fd = kMasterListenFd;
    }
    int error = 0;
    if (options_.spawner) {
      try {
        rank.pid = options_.spawner(request);
      } catch (const std::system_error& failure) {
        error = failure.code().value();
      }
    } else {
      error = posix_spawn_rank(request, &rank.pid);
    }
    close(fds[1]);
    if (error != 0) {
      close(fds[0]);
      spawn_failure_ =
          fmt::format("rank {} could not be started: {}: {}", r, options_.argv[0], std::strerror(error));
      spawn_failed_rank_ = r;
      stop_all(SIGTERM);
      return false;
    }
    fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
    rank.output_fd = fds[0];
    rank.running = true;
    return true;
  }

  void loop(int signal_fd) {
    int64_t all_exited_ns = 0;
    for (;;) {
      std::vector<pollfd> fds{{signal_fd, POLLIN, 0}};
      std::vector<int> owners{-1};
      for (int r = 0; r < options_.nproc; ++r) {
        if (ranks_[r].output_fd >= 0) {
          fds.push_back({ranks_[r].output_fd, POLLIN, 0});
          owners.push_back(r);
        }
      }
      const bool any_running =
          std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
      if (!any_running) {
        if (fds.size() == 1) break;
        // A rank's own children may hold its pipe open; do not wait for them long.
        if (all_exited_ns == 0) all_exited_ns = now_ns();
        if (now_ns() - all_exited_ns > 1'000'000'000) break;
      }
      if (poll(fds.data(), fds.size(), kPollMs) < 0 && errno != EINTR) throw errno_error("launcher: poll");
      if (fds[0].revents & POLLIN) forward_signals(signal_fd);
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents != 0) read_output(owners[i]);
      }
      reap();
      sample_resident_memory();
      if (kill_deadline_ns_ != 0 && !killed_ && now_ns() >= kill_deadline_ns_) {
        killed_ = true;
        stop_all(SIGKILL);
      }
    }
    for (int r = 0; r < options_.nproc; ++r) {
      if (ranks_[r].output_fd >= 0) finish_output(r);
    }
  }

  void forward_signals(int signal_fd) {
    unsigned char signo = 0;
    while (read(signal_fd, &signo, 1) == 1) {
      if (interrupted_by_ == 0) interrupted_by_ = signo;
      stop_all(signo);
    }
  }

  // Sends `signo` to every running rank; the first time, arms the SIGKILL deadline.
  void stop_all(int signo) {
    for (auto& rank : ranks_) {
      if (!rank.running) continue;
      // A stopped process does not act on SIGTERM until continued: it gets SIGKILL.
      kill(rank.pid, process_state(rank.pid) == 'T' ? SIGKILL : signo);
      if (!rank.signaled) {
        rank.signaled = true;
        rank.signaled_ns = now_ns();
      }
    }
    if (kill_deadline_ns_ == 0) {
      kill_deadline_ns_ = now_ns() + static_cast<int64_t>(std::max(0.0, options_.kill_grace_s) * 1e9);
    }
  }

  void sample_resident_memory() {
    const int64_t now = now_ns();
    if (now - last_sample_ns_ < kResidentSampleNs) return;
    last_sample_ns_ = now;
    int64_t resident = resident_set_bytes(getpid());
    for (const auto& rank : ranks_)
      if (rank.running) resident += resident_set_bytes(rank.pid);
    // The proportional sum only rises past its peak when some process's pages
    // grow (or stop being shared, which the periodic reading catches). A step's
    // allocations move the resident sum by a little each second: a rise under
    // 1/64 of the high waits for the periodic reading.
    if (resident <= resident_at_peak_check_ + resident_at_peak_check_ / 64 &&
        now - last_proportional_ns_ < kProportionalSampleNs)
      return;
    resident_at_peak_check_ = std::max(resident_at_peak_check_, resident);
    last_proportional_ns_ = now;
    int64_t total = proportional_set_bytes(getpid());
    for (const auto& rank : ranks_)
      if (rank.running) total += proportional_set_bytes(rank.pid);
    peak_resident_bytes_ = std::max(peak_resident_bytes_, total);
  }

  void reap() {
    for (auto& rank : ranks_) {
      if (!rank.running) continue;
      int status = 0;
      const pid_t pid = waitpid(rank.pid, &status, WNOHANG);
      if (pid != rank.pid) continue;
      rank.running = false;
      rank.exited_ns = now_ns();
      rank.exit_code = exit_code_of(status);
      if (WIFSIGNALED(status)) rank.terminating_signal = WTERMSIG(status);
      // Fail fast: one failed rank stops the world (its peers would otherwise
      // wait for it until their collective timeout).
      if (rank.exit_code != 0) {
        // A rank stopped by SIGSTOP never exits: its peers time out and fail
        // first. Whoever is stopped when the first failure arrives is the cause.
        if (!failure_seen_) {
          for (auto& other : ranks_)
            other.stopped_at_failure = other.running && process_state(other.pid) == 'T';
        }
        failure_seen_ = true;
        stop_all(SIGTERM);
      }
    }
  }

  void read_output(int r) {
    Rank& rank = ranks_[r];
    char buffer[16384];
    for (;;) {
      const ssize_t n = read(rank.output_fd, buffer, sizeof buffer);
      if (n > 0) {
        rank.partial_line.append(buffer, static_cast<size_t>(n));
        size_t start = 0, newline;
        while ((newline = rank.partial_line.find('\n', start)) != std::string::npos) {
          emit_line(r, rank.partial_line.substr(start, newline - start));
          start = newline + 1;
        }
        rank.partial_line.erase(0, start);
        if (rank.partial_line.size() > kMaxLineBytes) {
          emit_line(r, rank.partial_line);
          rank.partial_line.clear();
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      finish_output(r);  // EOF or a read error
      return;
    }
  }

  void finish_output(int r) {
    Rank& rank = ranks_[r];
    if (!rank.partial_line.empty()) emit_line(r, rank.partial_line);
    rank.partial_line.clear();
    close(rank.output_fd);
    rank.output_fd = -1;
  }

  void emit_line(int r, std::string line) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!options_.quiet) {
      std::string out = options_.prefix_output ? fmt::format("[rank {}] {}\n", r, line) : line + "\n";
      // One write per line keeps lines of different ranks from interleaving.
      for (size_t written = 0; written < out.size();) {
        const ssize_t n = write(STDERR_FILENO, out.data() + written, out.size() - written);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        written += static_cast<size_t>(n);
      }
    }
    Rank& rank = ranks_[r];
    rank.tail.push_back(std::move(line));
    if (rank.tail.size() > kTailLines) rank.tail.pop_front();
  }

  LaunchResult summarize() const {
    LaunchResult result;
    result.peak_resident_bytes = peak_resident_bytes_;
    // The cause, in this order: a rank that was stopped when the first failure
    // arrived (its peers timed out waiting for it), a rank killed by a signal the
    // launcher did not send (its peers' collectives break at once and may report
    // first), then the rank that recorded its failure first.
    std::pair<int, int64_t> first_failure{3, 0};
    for (int r = 0; r < options_.nproc; ++r) {
      const Rank& rank = ranks_[r];
      RankOutcome outcome;
      outcome.rank = r;
      outcome.exit_code = rank.pid > 0 ? rank.exit_code : 127;
      for (const auto& line : rank.tail) outcome.output_tail += line + "\n";
      if (rank.pid > 0 && rank.exit_code != 0) {
        // A rank failed on its own unless the launcher stopped it first. Peers of a
        // failed rank often fail by themselves too (their collectives break), so
        // the first failure is judged by the time each rank recorded it.
        const auto recorded = recorded_failure(rank.error_file);
        const bool recorded_first = recorded && recorded->ns < rank.signaled_ns;
        const bool own = rank.stopped_at_failure || !rank.signaled || recorded_first;
        outcome.killed_by_launcher = !own;
        // A rank that had recorded its error failed with the code it recorded, whatever
        // ended the process afterwards (the launcher's SIGTERM on its way out, an abort
        // in teardown): that code decides whether a restart can help.
        if (recorded && (!rank.signaled || recorded_first)) outcome.exit_code = recorded->exit_code;
        const int64_t failed_ns = recorded ? std::min(recorded->ns, rank.exited_ns) : rank.exited_ns;
        // Killed by a signal nobody here sent, without an error of its own: the cause.
        const int kind = rank.stopped_at_failure                                      ? 0
                         : rank.terminating_signal != 0 && !rank.signaled && !recorded ? 1
                                                                                       : 2;
        const std::pair<int, int64_t> failure{kind, failed_ns};
        if (own && (result.failed_rank < 0 || failure < first_failure)) {
          result.failed_rank = r;
          first_failure = failure;
        }
      }
      result.ranks.push_back(std::move(outcome));
    }
    result.interrupted = interrupted_by_ != 0;  // even when a rank's SIGINT was reaped first
    if (spawn_failed_rank_ >= 0) {
      result.failed_rank = spawn_failed_rank_;
      result.exit_code = 127;
      result.summary = result.error_line = spawn_failure_;
    } else if (result.failed_rank >= 0) {
      const RankOutcome& failed = result.ranks[result.failed_rank];
      const Rank& rank = ranks_[result.failed_rank];
      result.exit_code = failed.exit_code;
      result.failed_stopped = rank.stopped_at_failure;
      // Not when it had recorded its own error first (outcome's exit code is then that error's).
      const bool killed = rank.terminating_signal != 0 && failed.exit_code == 128 + rank.terminating_signal;
      result.failed_signal = rank.stopped_at_failure ? SIGSTOP : killed ? rank.terminating_signal : 0;
      if (const auto phase = read_published_phase(rank.phase_file)) {
        result.failed_phase = phase->phase;
        result.failed_step = phase->step;
      }
      const PublishedPhase phase{result.failed_phase, result.failed_step};
      const std::string during = result.failed_phase.empty() ? "" : " during " + phase.describe();
      const std::string others = options_.nproc > 1 ? "the other ranks were stopped" : "";
      if (rank.stopped_at_failure)
        result.error_line = fmt::format(
            "rank {} was stopped (process state T, e.g. SIGSTOP){} and its peers timed out waiting for it; it was "
            "killed with SIGKILL{}{}",
            failed.rank, during, others.empty() ? "" : " and ", others);
      else if (killed)
        result.error_line = fmt::format("rank {} was killed by {} (exit code {}){}{}{}", failed.rank,
                                        signal_name(rank.terminating_signal), failed.exit_code, during,
                                        others.empty() ? "" : "; ", others);
      else
        result.error_line = fmt::format("rank {} failed with exit code {}{}{}{}", failed.rank, failed.exit_code,
                                        during, others.empty() ? "" : "; ", others);
      result.summary = result.error_line + "\n";
      result.summary += failed.output_tail.empty() ? "(no output)"
                                                   : fmt::format("last output of rank {}:\n{}", failed.rank,
                                                                 failed.output_tail);
    } else if (interrupted_by_ != 0) {
      result.exit_code = 128 + interrupted_by_;
      result.summary = result.error_line = fmt::format("launcher interrupted by signal {} ({}); ranks stopped",
                                                       interrupted_by_, strsignal(interrupted_by_));
    }
    return result;
  }

  const LaunchOptions& options_;
  std::vector<Rank> ranks_;
  std::string error_dir_;
  int master_socket_ = -1, master_port_ = 0;
  int64_t kill_deadline_ns_ = 0;
  int64_t last_sample_ns_ = 0, peak_resident_bytes_ = 0;
  int64_t last_proportional_ns_ = 0, resident_at_peak_check_ = 0;  // when Pss was last read, and the Rss sum then
  bool killed_ = false;
  bool failure_seen_ = false;
  int interrupted_by_ = 0;
  int spawn_failed_rank_ = -1;
  std::string spawn_failure_;
};

}  // namespace

bool in_distributed_world() { return std::getenv("RANK") != nullptr && std::getenv("WORLD_SIZE") != nullptr; }

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

int free_port() {
  int port = 0;
  close(listening_socket(&port, false));
  return port;
}

int listening_socket(int* port, bool listening) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw errno_error("launcher: socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;  // the kernel picks an unused port
  socklen_t length = sizeof address;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const auto error = errno_error("launcher: bind 127.0.0.1:0");
    close(fd);
    throw error;
  }
  if (listening && listen(fd, SOMAXCONN) != 0) {
    const auto error = errno_error("launcher: listen 127.0.0.1:" + std::to_string(ntohs(address.sin_port)));
    close(fd);
    throw error;
  }
  *port = ntohs(address.sin_port);
  return fd;
}

LaunchResult launch_local(const LaunchOptions& options) {
  AUTOTP_USER_CHECK(options.nproc >= 1, "launcher: nproc must be at least 1, got {}", options.nproc);
  AUTOTP_USER_CHECK(!options.argv.empty(), "launcher: no program to run");
  log().debug("launching {} local ranks of {}", options.nproc, options.argv[0]);
  return LocalLaunch(options).run();
}

std::string self_executable() {
  std::vector<char> buffer(4096);
  const ssize_t n = readlink("/proc/self/exe", buffer.data(), buffer.size() - 1);
  if (n < 0) throw errno_error("self_executable: readlink /proc/self/exe");
  return std::string(buffer.data(), static_cast<size_t>(n));
}

void record_rank_failure(const std::string& message, int exit_code) {
  const char* path = std::getenv(kErrorFileVariable);
  if (path == nullptr || *path == '\0') return;
  std::ofstream out(path, std::ios::trunc);
  out << now_ns() << " " << exit_code << "\n" << message << "\n";
}

}  // namespace autotp::launcher
