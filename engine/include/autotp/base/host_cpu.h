// The host's CPU time as the kernel counts it (/proc/stat, all CPUs): how much
// the processes here ran, and how much a hypervisor took from this virtual
// machine while it wanted to run ("steal"). On a shared VM the steal changes
// from minute to minute and stretches every step; step metrics and the
// simulator's calibration record it so that a prediction and a measurement
// taken at different moments can be compared at the same steal.
#pragma once

namespace autotp {

struct HostCpuTimes {
  double busy_s = 0;   // user + nice + system + irq + softirq, summed over CPUs
  double steal_s = 0;  // runnable but not running: taken by the host
};

// Now; zeros where /proc/stat cannot be read (not Linux).
HostCpuTimes host_cpu_times();

// steal / (busy + steal) between two readings: the share of the CPU time this
// machine wanted that the host took. 0 when nothing ran.
double steal_fraction(const HostCpuTimes& from, const HostCpuTimes& to);

}  // namespace autotp
