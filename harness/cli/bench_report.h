// BenchReport: the JSON every autotp benchmark command writes, in Google
// Benchmark's shape so that one comparer reads them all:
//   {"context": {"benchmark": NAME, "date", "host_name", "num_cpus", ...},
//    "benchmarks": [{"name": unique row name, ...numbers...,
//                    "higher_is_better": KEY | "lower_is_better": KEY}, ...]}
// The *_is_better key names the row's headline number (bench-compare uses it).
#pragma once
#include <nlohmann/json.hpp>

#include <string>

namespace autotp::cli {

class BenchReport {
 public:
  explicit BenchReport(const std::string& benchmark);
  void add(nlohmann::json row) { rows_.push_back(std::move(row)); }
  size_t size() const { return rows_.size(); }
  nlohmann::json& rows() { return rows_; }
  nlohmann::json to_json() const;
  void write(const std::string& path) const;  // atomically (temporary name + rename)

  nlohmann::json context;  // free-form facts about the run (world, threads, ...)

 private:
  nlohmann::json rows_ = nlohmann::json::array();
};

// Bus bandwidth factor of a collective over `world` ranks (nccl-tests):
// all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1.
double bus_bandwidth_factor(const std::string& op, int world);

}  // namespace autotp::cli
