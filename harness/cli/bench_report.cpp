#include "cli/bench_report.h"

#include <unistd.h>

#include <ctime>
#include <thread>

#include "autotp/io/safetensors.h"

namespace autotp::cli {

BenchReport::BenchReport(const std::string& benchmark) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  char date[64] = {};
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  context = {{"benchmark", benchmark},
             {"date", date},
             {"host_name", host},
             {"num_cpus", static_cast<int>(std::thread::hardware_concurrency())}};
}

nlohmann::json BenchReport::to_json() const { return {{"context", context}, {"benchmarks", rows_}}; }

void BenchReport::write(const std::string& path) const { io::write_text_file_atomic(path, to_json().dump(2) + "\n"); }

}  // namespace autotp::cli
