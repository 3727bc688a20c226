#include "autotp/base/host_cpu.h"

#include <unistd.h>

#include <fstream>
#include <string>

namespace autotp {

HostCpuTimes host_cpu_times() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  // cpu user nice system idle iowait irq softirq steal (USER_HZ ticks)
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  if (!(in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq) || cpu != "cpu") return {};
  if (!(in >> steal)) steal = 0;  // kernels before 2.6.11
  const double tick = 1.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
  return {(user + nice + system + irq + softirq) * tick, steal * tick};
}

double steal_fraction(const HostCpuTimes& from, const HostCpuTimes& to) {
  const double busy = to.busy_s - from.busy_s, steal = to.steal_s - from.steal_s;
  return busy + steal > 0 && steal > 0 ? steal / (busy + steal) : 0;
}

}  // namespace autotp
