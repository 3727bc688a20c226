// Shared by the fuzz targets (tests/fuzz/fuzz_*.cpp): a scratch directory per
// process, writing the input to a file there, and the outcome rule. A UserError
// (the documented error, exit 2) is an accepted outcome when its message names
// the file; any other exception escaping a reader is a finding and aborts, so
// libFuzzer records the input as a crash.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "autotp/base/error.h"

namespace autotp::fuzz {

// A directory private to this process, removed at exit.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::filesystem::path d = std::filesystem::path(base && *base ? base : "/tmp") /
                              ("autotp-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(scratch_dir(), ignored);
    });
    return d;
  }();
  return dir;
}

inline void write_file(const std::filesystem::path& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out.good()) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
}

inline void write_file(const std::filesystem::path& path, std::string_view text) {
  write_file(path, text.data(), text.size());
}

[[noreturn]] inline void finding(const char* kind, const std::string& message) {
  std::fprintf(stderr, "\n==== FUZZ FINDING: %s escaped the reader ====\n%s\n", kind, message.c_str());
  std::fflush(stderr);
  std::abort();
}

// Runs `read`; a UserError naming `must_name` (a file name; "" = any message)
// is fine, everything else aborts with the message.
template <typename Read>
void expect_user_error_only(const std::string& must_name, Read&& read) {
  try {
    read();
  } catch (const UserError& e) {
    const std::string message = e.what();
    if (!must_name.empty() && message.find(must_name) == std::string::npos)
      finding("UserError not naming the file", "expected the message to name '" + must_name + "': " + message);
  } catch (const std::exception& e) {
    finding(typeid(e).name(), e.what());
  } catch (...) {
    finding("unknown exception", "(not a std::exception)");
  }
}

}  // namespace autotp::fuzz
