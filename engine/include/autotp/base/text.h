// Small string helpers shared by the layers above (names of parameters and modules).
#pragma once
#include <cstdint>
#include <string>

namespace autotp {

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// FNV-1a, 64 bits: seeds per-name random streams (the same value on every rank and run).
inline uint64_t fnv1a64(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace autotp
