// Error kinds. A UserError is bad input from the user (a file, a config key, a
// flag); the CLI prints its message alone and exits with code 2. A
// NonFiniteError is training that produced a NaN or an infinity (exit code 3:
// repeating the run repeats it, so restarts do not retry it). Anything else is a
// failure of the run (exit code 1).
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace autotp {

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& message) : std::runtime_error(message) {}
};

class NonFiniteError : public std::runtime_error {
 public:
  explicit NonFiniteError(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Args>
[[noreturn]] void throw_user_error(fmt::format_string<Args...> format, Args&&... args) {
  throw UserError(fmt::format(format, std::forward<Args>(args)...));
}

// Checks a condition on user input; throws UserError with the formatted message.
#define AUTOTP_USER_CHECK(cond, ...)                 \
  do {                                               \
    if (!(cond)) ::autotp::throw_user_error(__VA_ARGS__); \
  } while (0)

}  // namespace autotp
