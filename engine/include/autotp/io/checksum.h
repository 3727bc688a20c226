// CRC-32 (IEEE 802.3 polynomial, the one of zlib / `crc32` / Python's
// zlib.crc32), for checkpoint file checksums. Thread safe.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace autotp::io {

// Continues `crc` (0 to start) over `size` bytes.
uint32_t crc32_update(uint32_t crc, const void* data, size_t size);
// CRC-32 and size of a whole file; UserError naming the file when it cannot be read.
struct FileChecksum {
  uint32_t crc32 = 0;
  uint64_t bytes = 0;
};
FileChecksum checksum_file(const std::string& path);

}  // namespace autotp::io
