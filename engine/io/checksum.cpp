#include "autotp/io/checksum.h"

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include "autotp/base/error.h"

namespace autotp::io {
namespace {

// Slicing-by-4 tables: table[0] is the classic byte table, table[k] advances k more bytes.
std::array<std::array<uint32_t, 256>, 4> make_tables() {
  std::array<std::array<uint32_t, 256>, 4> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int k = 1; k < 4; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  return t;
}

const std::array<std::array<uint32_t, 256>, 4>& tables() {
  static const auto t = make_tables();
  return t;
}

}  // namespace

uint32_t crc32_update(uint32_t crc, const void* data, size_t size) {
  const auto& t = tables();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (size >= 4) {
    uint32_t word;
    std::memcpy(&word, p, 4);  // little-endian host assumed, as everywhere in io/
    c ^= word;
    c = t[3][c & 0xFF] ^ t[2][(c >> 8) & 0xFF] ^ t[1][(c >> 16) & 0xFF] ^ t[0][c >> 24];
    p += 4;
    size -= 4;
  }
  while (size-- > 0) c = t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return ~c;
}

FileChecksum checksum_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  AUTOTP_USER_CHECK(in.good(), "{}: cannot open: {}", path, std::strerror(errno));
  FileChecksum sum;
  // Not zero-filled: every byte used is read first (a zeroed 1 MiB per file dominated checks of small files).
  constexpr size_t kChunk = 1 << 20;
  std::unique_ptr<char[]> buffer(new char[kChunk]);
  while (in) {
    in.read(buffer.get(), static_cast<std::streamsize>(kChunk));
    const auto got = static_cast<size_t>(in.gcount());
    sum.crc32 = crc32_update(sum.crc32, buffer.get(), got);
    sum.bytes += got;
  }
  AUTOTP_USER_CHECK(in.eof(), "{}: read failed", path);
  return sum;
}

}  // namespace autotp::io
