#include "autotp/comm/dist_env.h"

#include <charconv>
#include <cstdlib>
#include <limits>
#include <optional>

#include "autotp/base/error.h"

namespace autotp {
namespace {

// The whole value must be a decimal integer in [min_value, max_value]; "4x",
// "" or " 4" are rejected rather than half-parsed.
std::optional<int> read_int(const char* name, int min_value, int max_value) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return std::nullopt;
  std::string value(raw);
  int parsed = 0;
  auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), parsed);
  if (error != std::errc() || end != value.data() + value.size()) {
    throw_user_error("environment variable {}='{}' is not an integer", name, value);
  }
  if (parsed < min_value || parsed > max_value) {
    throw_user_error("environment variable {}={} is out of range [{}, {}]", name, parsed, min_value,
                     max_value);
  }
  return parsed;
}

constexpr int kMaxInt = std::numeric_limits<int>::max();

}  // namespace

DistEnv DistEnv::from_environment() {
  DistEnv env;
  auto rank = read_int("RANK", 0, kMaxInt);
  auto world_size = read_int("WORLD_SIZE", 1, kMaxInt);
  if (rank.has_value() != world_size.has_value()) {
    throw_user_error("environment variable {} is set but {} is not; set both or neither",
                     rank ? "RANK" : "WORLD_SIZE", rank ? "WORLD_SIZE" : "RANK");
  }
  if (rank) {
    AUTOTP_USER_CHECK(*rank < *world_size, "environment variable RANK={} is not below WORLD_SIZE={}", *rank,
                      *world_size);
    env.rank = *rank;
    env.world_size = *world_size;
  }
  env.local_rank = read_int("LOCAL_RANK", 0, kMaxInt).value_or(env.rank);
  env.local_world_size = read_int("LOCAL_WORLD_SIZE", 1, kMaxInt).value_or(env.world_size);
  AUTOTP_USER_CHECK(env.local_rank < env.local_world_size,
                    "environment variable LOCAL_RANK={} is not below LOCAL_WORLD_SIZE={}", env.local_rank,
                    env.local_world_size);
  if (const char* addr = std::getenv("MASTER_ADDR")) {
    AUTOTP_USER_CHECK(*addr != '\0', "environment variable MASTER_ADDR is empty");
    env.master_addr = addr;
  }
  env.master_port = read_int("MASTER_PORT", 0, 65535).value_or(0);
  env.threads = read_int("AUTOTP_THREADS", 0, 4096).value_or(0);
  env.restart_count =
      read_int("AUTOTP_RESTART_COUNT", 0, kMaxInt).value_or(read_int("TORCHELASTIC_RESTART_COUNT", 0, kMaxInt).value_or(0));
  // Only rank 0 serves the store; another rank ignores an inherited variable.
  if (env.rank == 0) env.master_listen_fd = read_int(kMasterListenFdVariable, 0, kMaxInt).value_or(-1);
  return env;
}

}  // namespace autotp
