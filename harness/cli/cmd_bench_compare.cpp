// `autotp bench-compare BASE.json NEW.json [--threshold 0.9]`: the regression
// gate. Reads two benchmark files (Google Benchmark JSON or autotp's
// BenchReport JSON), matches rows by name, compares each row's headline
// number and exits 1 when one falls below threshold x baseline (or is
// missing). `--merge OUT.json IN.json...` joins files into one (tools/bench).
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "autotp/io/safetensors.h"
#include "autotp/base/error.h"
#include "autotp/base/json_file.h"
#include "cli/bench_report.h"
#include "cli/cli.h"

namespace autotp::cli {
namespace {

using nlohmann::json;

struct Headline {
  std::string metric;
  double value = 0;
  bool higher_is_better = true;
};

double seconds_per_unit(const std::string& unit) {
  if (unit == "ns") return 1e-9;
  if (unit == "us") return 1e-6;
  if (unit == "ms") return 1e-3;
  return 1.0;
}

// The number a row is judged by; none for rows that carry no comparable number
// (Google Benchmark's stddev / cv aggregates, failed runs).
std::optional<Headline> headline(const json& row, const std::string& file) {
  if (row.value("error_occurred", false)) return std::nullopt;
  const std::string aggregate = row.value("aggregate_name", "");
  if (aggregate == "stddev" || aggregate == "cv") return std::nullopt;
  auto number = [&](const std::string& key) {
    AUTOTP_USER_CHECK(row.contains(key) && row[key].is_number(), "{}: benchmark '{}' has no number '{}'", file,
                      row.value("name", "?"), key);
    return row[key].get<double>();
  };
  for (const char* kind : {"higher_is_better", "lower_is_better"}) {
    if (row.contains(kind)) {
      const std::string key = row[kind].get<std::string>();
      return Headline{key, number(key), std::string(kind) == "higher_is_better"};
    }
  }
  for (const char* counter : {"FLOP/s", "bytes/s", "bytes_per_second", "items_per_second"}) {
    if (row.contains(counter)) return Headline{counter, number(counter), true};
  }
  if (row.contains("real_time"))
    return Headline{"real_time_s", number("real_time") * seconds_per_unit(row.value("time_unit", "ns")), false};
  return std::nullopt;
}

json read_benchmarks(const std::string& path) {
  json file = read_json_file(path, "benchmark results");
  AUTOTP_USER_CHECK(file.is_object() && file.contains("benchmarks") && file["benchmarks"].is_array(),
                    "{}: not a benchmark file (expected an object with a \"benchmarks\" array)", path);
  for (const auto& row : file["benchmarks"])
    AUTOTP_USER_CHECK(row.is_object() && row.contains("name") && row["name"].is_string(),
                      "{}: every benchmark needs a \"name\" string", path);
  return file;
}

std::string format_value(double v) { return fmt::format("{:.4g}", v); }

int compare(const std::string& base_path, const std::string& new_path, double threshold) {
  const json base = read_benchmarks(base_path), next = read_benchmarks(new_path);
  std::map<std::string, const json*> by_name;
  for (const auto& row : next["benchmarks"]) by_name[row["name"].get<std::string>()] = &row;
  std::map<std::string, bool> seen;
  int regressions = 0, missing = 0, compared = 0;
  std::cout << fmt::format("{:<58} {:<18} {:>11} {:>11} {:>7}  {}\n", "benchmark", "metric", "base", "new",
                           "ratio", "status");
  for (const auto& row : base["benchmarks"]) {
    const std::string name = row["name"].get<std::string>();
    seen[name] = true;
    auto b = headline(row, base_path);
    if (!b) continue;
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      ++missing;
      std::cout << fmt::format("{:<58} {:<18} {:>11} {:>11} {:>7}  MISSING\n", name, b->metric,
                               format_value(b->value), "-", "-");
      continue;
    }
    auto n = headline(*it->second, new_path);
    AUTOTP_USER_CHECK(n && n->metric == b->metric, "{}: benchmark '{}' is not measured by '{}' as in {}", new_path,
                      name, b->metric, base_path);
    // Relative performance: > 1 is faster, whichever way the metric points.
    const double ratio = b->higher_is_better ? n->value / b->value : b->value / n->value;
    const bool regressed = !(ratio >= threshold);
    regressions += regressed;
    ++compared;
    std::cout << fmt::format("{:<58} {:<18} {:>11} {:>11} {:>7.3f}  {}\n", name, b->metric, format_value(b->value),
                             format_value(n->value), ratio, regressed ? "REGRESSION" : "ok");
  }
  for (const auto& row : next["benchmarks"]) {
    const std::string name = row["name"].get<std::string>();
    if (!seen.count(name) && headline(row, new_path))
      std::cout << fmt::format("{:<58} {:<18} {:>11} {:>11} {:>7}  new\n", name, headline(row, new_path)->metric, "-",
                               format_value(headline(row, new_path)->value), "-");
  }
  std::cout << fmt::format("# {} compared, {} below {} x baseline, {} missing\n", compared, regressions, threshold,
                           missing);
  return regressions + missing > 0 ? 1 : 0;
}

// One line per row with its headline number in readable units; collective
// rows only at 1 MiB and at the largest size (the whole table is in comm.json).
void summary(const std::string& path) {
  const json file = read_benchmarks(path);
  int64_t largest = 0;
  for (const auto& row : file["benchmarks"])
    if (row.contains("busbw_GBps")) largest = std::max<int64_t>(largest, row.value("bytes", int64_t{0}));
  std::cout << fmt::format("# {}: {} benchmark(s)\n", path, file["benchmarks"].size());
  for (const auto& row : file["benchmarks"]) {
    auto h = headline(row, path);
    if (!h) continue;
    std::string text;
    if (row.contains("busbw_GBps")) {
      const int64_t bytes = row.value("bytes", int64_t{0});
      if (bytes != largest && bytes != (1 << 20)) continue;
      text = fmt::format("busbw {:.3f} GB/s, algbw {:.3f} GB/s, {:.1f} us, check {}", row["busbw_GBps"].get<double>(),
                         row["algbw_GBps"].get<double>(), row["time_s"].get<double>() * 1e6,
                         row.value("check", "?"));
    } else if (row.contains("tokens_per_s")) {
      text = fmt::format("{:.0f} tokens/s, step {:.3f} s (p90 {:.3f}), comm {:.1f}%, MFU {:.1f}%, {} thread(s) x {} "
                         "rank(s){}, comm volume {}",
                         row["tokens_per_s"].get<double>(), row["step_time_median_s"].get<double>(),
                         row["step_time_p90_s"].get<double>(),
                         100 * row["comm_s"].get<double>() / row["step_time_median_s"].get<double>(),
                         100 * row["mfu"].get<double>(), row["threads_per_rank"].get<int>(), row["world"].get<int>(),
                         row["oversubscribed"].get<bool>() ? " OVERSUBSCRIBED" : "",
                         row["comm_volume_matches"].get<bool>() ? "= analytic" : "DIFFERS from analytic");
    } else if (h->metric == "FLOP/s") {
      text = fmt::format("{:.2f} GFLOP/s", h->value / 1e9);
    } else if (h->metric == "bytes/s" || h->metric == "bytes_per_second") {
      text = fmt::format("{:.2f} GB/s", h->value / 1e9);
    } else if (h->metric == "items_per_second") {
      text = fmt::format("{:.4g} items/s", h->value);
    } else {
      text = fmt::format("{} {:.4g}", h->metric, h->value);
    }
    std::cout << fmt::format("{:<58} {}\n", row["name"].get<std::string>(), text);
  }
}

void merge(const std::string& out, const std::vector<std::string>& inputs) {
  json merged = {{"context", {{"benchmark", "suite"}, {"parts", json::array()}}}, {"benchmarks", json::array()}};
  std::map<std::string, std::string> origin;
  for (const auto& path : inputs) {
    json file = read_benchmarks(path);
    merged["context"]["parts"].push_back(file.value("context", json::object()));
    for (const auto& row : file["benchmarks"]) {
      const std::string name = row["name"].get<std::string>();
      AUTOTP_USER_CHECK(!origin.count(name), "benchmark '{}' appears in both {} and {}", name, origin[name], path);
      origin[name] = path;
      merged["benchmarks"].push_back(row);
    }
  }
  io::write_text_file_atomic(out, merged.dump(2) + "\n");
}

}  // namespace

void register_bench_compare(CLI::App& app) {
  struct Args {
    std::vector<std::string> files;
    double threshold = 0.9;
    std::string merge;
    bool summary = false;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("bench-compare",
                                 "Compare two benchmark JSON files; exit 1 if one falls below threshold x baseline");
  cmd->add_option("files", args->files, "BASE.json NEW.json (with --merge: the files to join)")->required();
  cmd->add_option("--threshold", args->threshold, "Lowest allowed new/baseline performance ratio (default 0.9)")
      ->check(CLI::Range(0.0, 1e6));
  cmd->add_option("--merge", args->merge, "Instead of comparing, join the files' benchmarks into this file");
  cmd->add_flag("--summary", args->summary, "Instead of comparing, print each file's headline numbers");
  cmd->callback([args] {
    if (args->summary) {
      for (const auto& f : args->files) summary(f);
      return;
    }
    if (!args->merge.empty()) {
      merge(args->merge, args->files);
      return;
    }
    AUTOTP_USER_CHECK(args->files.size() == 2, "bench-compare takes BASE.json NEW.json, got {} file(s)",
                      args->files.size());
    const int code = compare(args->files[0], args->files[1], args->threshold);
    if (code != 0) exit_with(code);
  });
}

}  // namespace autotp::cli
