#include "autotp/base/log.h"

#include <spdlog/sinks/stdout_sinks.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace autotp {
namespace {

std::shared_ptr<spdlog::logger>& logger_slot() {
  static std::shared_ptr<spdlog::logger> logger;
  return logger;
}

std::shared_ptr<spdlog::logger> make_logger(const LogOptions& options) {
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("autotp", sink);
  logger->set_pattern(fmt::format("[rank {}] %^%l%$: %v", options.rank));
  bool all = options.all_ranks;
  if (const char* env = std::getenv("AUTOTP_LOG_ALL_RANKS")) all = all || std::strcmp(env, "1") == 0;
  auto level = options.level;
  if (const char* env = std::getenv("AUTOTP_LOG_LEVEL")) level = spdlog::level::from_str(env);
  // Ranks other than 0 keep warnings and errors so a failing rank is always heard.
  if (options.rank != 0 && !all && level < spdlog::level::warn) level = spdlog::level::warn;
  logger->set_level(level);
  logger->flush_on(spdlog::level::info);
  return logger;
}

}  // namespace

void init_logging(const LogOptions& options) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  logger_slot() = make_logger(options);
}

spdlog::logger& log() {
  auto& slot = logger_slot();
  if (!slot) init_logging();
  return *slot;
}

}  // namespace autotp
