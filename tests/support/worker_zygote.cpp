#include "support/worker_zygote.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include "support/sanitized_build.h"

namespace autotp::test {
namespace {

// A request: int32 listen_target_fd, uint32 argc, uint32 envc, then argc + envc
// NUL-terminated strings; the output descriptor (and the listening one, if any)
// ride along as SCM_RIGHTS. The reply is an int32: the rank's pid or -errno.
constexpr size_t kMaxRequestBytes = 1 << 20;
constexpr int kMovedFdFloor = 64;  // received descriptors move above every target first

int g_server = -1;  // the test process's end of the socket pair; -1 when no server runs
std::mutex g_mutex;

int thread_count() {
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return -1;
  int count = 0;
  while (const dirent* entry = readdir(tasks))
    if (entry->d_name[0] != '.') ++count;
  closedir(tasks);
  return count;
}

struct Request {
  int listen_target_fd = -1;
  std::vector<std::string> argv;
  std::vector<std::string> environment;
};

bool parse(const char* data, size_t size, Request* request) {
  int32_t target = 0;
  uint32_t argc = 0, envc = 0;
  if (size < sizeof target + sizeof argc + sizeof envc) return false;
  std::memcpy(&target, data, sizeof target);
  std::memcpy(&argc, data + sizeof target, sizeof argc);
  std::memcpy(&envc, data + sizeof target + sizeof argc, sizeof envc);
  size_t at = sizeof target + sizeof argc + sizeof envc;
  request->listen_target_fd = target;
  for (uint32_t i = 0; i < argc + envc; ++i) {
    const void* end = std::memchr(data + at, '\0', size - at);
    if (end == nullptr) return false;
    const size_t length = static_cast<const char*>(end) - (data + at);
    (i < argc ? request->argv : request->environment).emplace_back(data + at, length);
    at += length + 1;
  }
  return argc > 0 && at == size;
}

// The rank: descriptors, signals and environment as posix_spawn and exec leave
// them (launcher.cpp's posix_spawn_rank), then the worker entry as main runs it.
[[noreturn]] void become_rank(const Request& request, int output_fd, int listen_fd, WorkerEntry entry) {
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0 || dup2(null_fd, STDIN_FILENO) < 0 || dup2(output_fd, STDOUT_FILENO) < 0 ||
      dup2(output_fd, STDERR_FILENO) < 0 || (listen_fd >= 0 && dup2(listen_fd, request.listen_target_fd) < 0))
    _exit(127);
  const unsigned first_closed = listen_fd >= 0 ? static_cast<unsigned>(request.listen_target_fd) + 1 : 3;
  if (syscall(SYS_close_range, first_closed, ~0U, 0) != 0)
    for (int fd = static_cast<int>(first_closed); fd < 1024; ++fd) close(fd);

  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  for (int signo : launcher::kRankDefaultSignals) sigaction(signo, &default_action, nullptr);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);

  clearenv();
  for (const auto& entry : request.environment) putenv(strdup(entry.c_str()));
  std::vector<char*> argv;
  for (const auto& arg : request.argv) argv.push_back(strdup(arg.c_str()));
  argv.push_back(nullptr);
  std::exit(entry(static_cast<int>(request.argv.size()), argv.data()));
}

[[noreturn]] void serve(int socket_fd, WorkerEntry entry) {
  std::vector<char> buffer(kMaxRequestBytes);
  for (;;) {
    iovec io{buffer.data(), buffer.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
    msghdr message{};
    message.msg_iov = &io;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof control;
    const ssize_t received = recvmsg(socket_fd, &message, MSG_CMSG_CLOEXEC);
    if (received == 0) _exit(0);  // the test process is gone
    if (received < 0) {
      if (errno == EINTR) continue;
      _exit(1);
    }
    std::vector<int> fds;
    for (cmsghdr* c = CMSG_FIRSTHDR(&message); c != nullptr; c = CMSG_NXTHDR(&message, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        fds.push_back(fd);
      }
    }
    // Above every number the rank's dup2s write, so none overwrites another's source.
    for (int& fd : fds) {
      const int moved = fcntl(fd, F_DUPFD_CLOEXEC, kMovedFdFloor);
      close(fd);
      fd = moved;
    }
    Request request;
    int32_t reply = -EINVAL;
    const bool complete = (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) == 0;
    if (complete && parse(buffer.data(), static_cast<size_t>(received), &request) && !fds.empty() &&
        fds[0] >= 0 && (request.listen_target_fd < 0) == (fds.size() < 2) &&
        (fds.size() < 2 || fds[1] >= 0)) {
      // CLONE_PARENT: the rank is the test process's child, not this server's.
      const long pid = syscall(SYS_clone, CLONE_PARENT | SIGCHLD, nullptr, nullptr, nullptr, 0);
      if (pid == 0) {
        close(socket_fd);
        become_rank(request, fds[0], fds.size() > 1 ? fds[1] : -1, entry);
      }
      reply = pid > 0 ? static_cast<int32_t>(pid) : -errno;
    } else if (!complete) {
      reply = -E2BIG;
    }
    for (int fd : fds)
      if (fd >= 0) close(fd);
    if (send(socket_fd, &reply, sizeof reply, MSG_NOSIGNAL) != sizeof reply) _exit(1);
  }
}

pid_t spawn_rank(const launcher::RankSpawn& spawn) {
  std::string data(3 * sizeof(int32_t), '\0');
  const int32_t target = spawn.listen_fd >= 0 ? spawn.listen_target_fd : -1;
  const uint32_t argc = static_cast<uint32_t>(spawn.argv.size()),
                 envc = static_cast<uint32_t>(spawn.environment.size());
  std::memcpy(data.data(), &target, sizeof target);
  std::memcpy(data.data() + sizeof target, &argc, sizeof argc);
  std::memcpy(data.data() + sizeof target + sizeof argc, &envc, sizeof envc);
  for (const auto* strings : {&spawn.argv, &spawn.environment})
    for (const auto& s : *strings) data.append(s.c_str(), s.size() + 1);
  if (data.size() > kMaxRequestBytes)
    throw std::system_error(E2BIG, std::generic_category(), "worker zygote request");

  std::vector<int> fds{spawn.output_fd};
  if (spawn.listen_fd >= 0) fds.push_back(spawn.listen_fd);
  iovec io{data.data(), data.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
  cmsghdr* c = CMSG_FIRSTHDR(&message);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
  std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));

  std::lock_guard<std::mutex> lock(g_mutex);
  if (sendmsg(g_server, &message, MSG_NOSIGNAL) != static_cast<ssize_t>(data.size()))
    throw std::system_error(errno ? errno : EPIPE, std::generic_category(), "worker zygote: send");
  int32_t reply = 0;
  ssize_t got;
  do got = recv(g_server, &reply, sizeof reply, 0);
  while (got < 0 && errno == EINTR);
  if (got != sizeof reply) throw std::system_error(EPIPE, std::generic_category(), "worker zygote: no reply");
  if (reply < 0) throw std::system_error(-reply, std::generic_category(), "worker zygote: clone");
  return static_cast<pid_t>(reply);
}

}  // namespace

void start_worker_zygote(WorkerEntry entry) {
  if (kSanitizedBuild) return;
  if (const char* setting = std::getenv("AUTOTP_TEST_ZYGOTE")) {
    const std::string value = setting;
    if (value == "0") return;
    if (value != "1") {
      std::fprintf(stderr,
                   "AUTOTP_TEST_ZYGOTE=%s: allowed values are 0 (an exec per rank) and 1 (the default)\n",
                   setting);
      std::exit(2);
    }
  }
  if (thread_count() != 1) return;  // a fork would lose the other threads
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) return;
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(pair[0]);
    close(pair[1]);
    return;
  }
  if (pid == 0) {
    close(pair[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(0);
    signal(SIGINT, SIG_IGN);  // Ctrl-C reaches the test process, which ends this server by closing the socket
    const int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null_fd >= 0) {
      dup2(null_fd, STDIN_FILENO);
      dup2(null_fd, STDOUT_FILENO);
      close(null_fd);
    }
    serve(pair[1], entry);
  }
  close(pair[1]);
  g_server = pair[0];
}

launcher::RankSpawner worker_zygote_spawner() {
  if (g_server < 0) return {};
  return spawn_rank;
}

}  // namespace autotp::test
