// UTF-8 steps shared by the tokenizer models (their input is validated first).
#pragma once
#include <cstddef>

namespace autotp::tok {

// Bytes of the character a lead byte starts; a stray continuation byte counts as one.
inline size_t utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xE) return 3;
  if ((lead >> 3) == 0x1E) return 4;
  return 1;
}

}  // namespace autotp::tok
