#include "support/veth_link.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <sstream>
#include <stdexcept>

namespace autotp::test {
namespace {

struct CommandResult {
  int exit_code = -1;
  std::string output;
};

CommandResult try_command(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return {};
  CommandResult result;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

// Unique per process and per link within it, so parallel tests never share a name.
std::string unique_tag() {
  static std::atomic<int> counter{0};
  return std::to_string(::getpid()) + "n" + std::to_string(counter++);
}

}  // namespace

std::string run_command(const std::string& command) {
  auto result = try_command(command);
  if (result.exit_code != 0)
    throw std::runtime_error("`" + command + "` exited " + std::to_string(result.exit_code) + ": " +
                             result.output);
  return result.output;
}

std::optional<std::string> VethLink::why_unavailable() {
  if (::geteuid() != 0) return "network namespaces need root (CAP_NET_ADMIN)";
  if (try_command("command -v ip && command -v tc").exit_code != 0)
    return "`ip` or `tc` (iproute2) is not installed";
  const std::string probe = "autotp-net-probe-" + unique_tag();
  auto added = try_command("ip netns add " + probe);
  if (added.exit_code != 0) return "cannot create a network namespace: " + added.output;
  try_command("ip netns del " + probe);
  return std::nullopt;
}

VethLink::VethLink() {
  const std::string tag = unique_tag();
  const char sides[2] = {'a', 'b'};
  for (int side = 0; side < 2; ++side) {
    ns_[side] = "autotp-net-" + tag + "-" + sides[side];
    device_[side] = "atp" + tag + sides[side];  // interface names: at most 15 characters
    address_[side] = "10.77.0." + std::to_string(side + 1);
  }
  if (device_[0].size() > 15) throw std::runtime_error("VethLink: device name too long: " + device_[0]);
  for (int side = 0; side < 2; ++side) {
    run_command("ip netns add " + ns_[side]);
    created_[side] = true;
  }
  run_command("ip link add " + device_[0] + " netns " + ns_[0] + " type veth peer name " + device_[1] +
              " netns " + ns_[1]);
  for (int side = 0; side < 2; ++side) {
    run_command("ip -n " + ns_[side] + " addr add " + address_[side] + "/24 dev " + device_[side]);
    run_command("ip -n " + ns_[side] + " link set lo up");
    run_command("ip -n " + ns_[side] + " link set " + device_[side] + " up");
  }
}

VethLink::~VethLink() {
  if (armed_) pclose(armed_);
  for (int side = 0; side < 2; ++side) {
    if (!created_[side]) continue;
    for (pid_t pid : pids(side)) ::kill(pid, SIGKILL);
    try_command("ip netns del " + ns_[side]);  // takes its veth end, and so the pair, with it
  }
}

void VethLink::shape(const std::string& rate) {
  for (int side = 0; side < 2; ++side)
    run_command("tc -n " + ns_[side] + " qdisc replace dev " + device_[side] + " root tbf rate " + rate +
                " burst 32kbit latency 400ms");
}

void VethLink::cut(int side) { run_command("ip -n " + ns_[side] + " link set " + device_[side] + " down"); }

void VethLink::arm_cut(int side) {
  if (armed_) throw std::logic_error("VethLink::arm_cut: already armed");
  // "e": close-on-exec, so ranks started later do not hold the pipe open (ip would
  // then never see its end, and fire_cut would wait for the ranks).
  armed_ = popen(("ip -n " + ns_[side] + " -batch -").c_str(), "we");
  if (!armed_) throw std::runtime_error("VethLink::arm_cut: cannot start ip -batch");
  armed_side_ = side;
}

void VethLink::fire_cut() {
  if (!armed_) throw std::logic_error("VethLink::fire_cut: not armed");
  std::fputs(("link set " + device_[armed_side_] + " down\n").c_str(), armed_);
  std::fflush(armed_);
  const int status = pclose(armed_);
  armed_ = nullptr;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("VethLink::fire_cut: ip -batch failed on " + device_[armed_side_]);
}

std::vector<pid_t> VethLink::pids(int side) const {
  std::istringstream text(try_command("ip netns pids " + ns_[side]).output);
  std::vector<pid_t> pids;
  for (pid_t pid; text >> pid;) pids.push_back(pid);
  return pids;
}

}  // namespace autotp::test
