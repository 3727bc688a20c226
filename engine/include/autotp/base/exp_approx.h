// exp(x) for float in a form compilers vectorize (no libm call, no branches): the
// fused CPU kernels' exponential (SwiGLU's sigmoid). Cody-Waite reduction by ln 2
// and a degree-6 polynomial: within 2 ulp of std::exp over [-87, 88]; underflows
// to 0 below and saturates at exp(88.3) above (no infinities); a NaN input gives
// NaN, as std::exp does, so that a diverged run still shows NaN losses.
#pragma once
#include <cstdint>
#include <cstring>

namespace autotp {

inline float exp_approx(float in) {
  float x = in < -87.3f ? -87.3f : (in > 88.3f ? 88.3f : in);
  x = in != in ? 0.0f : x;  // NaN: computed on 0 (no undefined int conversion), returned as NaN below
  // n = round(x / ln 2) by the 1.5 * 2^23 trick (round to nearest, no rounding instruction).
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  float r = x - n * 0.693359375f;  // ln 2 in two parts: r exact to float precision
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return in != in ? in : p * scale;
}

}  // namespace autotp
