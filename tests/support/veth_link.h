// Two network namespaces ("hosts" a and b) joined by one veth pair: a network
// link that a test can cut or slow down while ranks run on both sides.
//
//   side 0: namespace autotp-net-PID-N-a, device atpPIDnNa, 10.77.0.1/24
//   side 1: namespace autotp-net-PID-N-b, device atpPIDnNb, 10.77.0.2/24
//
// The veth ends are created directly inside the namespaces, so nothing appears
// in the host's namespace, and the addresses cannot collide with another test's
// pair (each pair sees only itself). Delay and loss come from tc qdiscs built
// into the kernel (tbf); netem is not assumed. Needs root (CAP_NET_ADMIN) and
// iproute2. The destructor kills every process left in the namespaces and
// deletes them (the veth pair goes with them), also when the test failed.
// Not thread-safe; one owner.
#pragma once
#include <sys/types.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace autotp::test {

class VethLink {
 public:
  // Why namespaces cannot be made here (not root, no `ip`, no CAP_NET_ADMIN), or nullopt.
  static std::optional<std::string> why_unavailable();

  // Creates both namespaces and the link (up, with addresses); throws on failure.
  VethLink();
  ~VethLink();
  VethLink(const VethLink&) = delete;
  VethLink& operator=(const VethLink&) = delete;

  const std::string& ns(int side) const { return ns_[side]; }
  const std::string& device(int side) const { return device_[side]; }
  const std::string& address(int side) const { return address_[side]; }

  // Both directions through tbf: `rate` such as "10mbit", burst 32kbit, latency
  // 400ms (packets queued longer are dropped: a slow link that also loses).
  void shape(const std::string& rate);
  // Takes the link down on `side`: nothing passes in either direction.
  void cut(int side);
  // cut() with the `ip` process started ahead of time (arm_cut), so the cut
  // lands within a fraction of a millisecond of the call (fire_cut).
  void arm_cut(int side);
  void fire_cut();
  // Processes still running inside the namespace of `side`.
  std::vector<pid_t> pids(int side) const;

 private:
  std::string ns_[2], device_[2], address_[2];
  bool created_[2] = {false, false};
  FILE* armed_ = nullptr;  // `ip -n NS -batch -` waiting for its command
  int armed_side_ = -1;
};

// Runs a shell command; throws with its output when it exits non-zero.
std::string run_command(const std::string& command);

}  // namespace autotp::test
