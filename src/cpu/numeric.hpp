// Scalar number formats of the CPU reference backend: fp16 / bf16 storage
// conversions (round-to-nearest-even) and the fp8 e4m3 ("e4m3fn": bias 7,
// no infinities, 0x7F/0xFF = NaN, largest finite 448) conversion with
// saturation to the largest finite value, as used by the INT8_FP8 twin.
// Header-only so that the unit tests can check the very same code.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "sparge/sparge.h"

namespace sparge {
namespace cpu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// ---------------------------------------------------------------- fp16
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24 (exact in float)
    float v = std::ldexp(float(man), -24);
    return (h & 0x8000u) ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  return bits_float(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

inline uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {  // below 2^-14: half subnormal, quantum 2^-24
    const float m = std::nearbyint(bits_float(ax) * 16777216.0f);  // exact scaling
    return uint16_t(sign | uint16_t(m));  // m == 1024 is the smallest normal: same bits
  }
  const uint32_t man = ax & 0x7fffffu;
  uint32_t h = ((((ax >> 23) - 127u + 15u)) << 10) | (man >> 13);
  const uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may bump the exponent
  return uint16_t(sign | h);
}

// ---------------------------------------------------------------- bf16
inline float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t(((x >> 16) & 0x8000u) | 0x7fc0u);  // NaN
  const uint32_t r = x + 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(r >> 16);
}

// Rounds a float to the storage type `dt` and back.
inline float round_to(sparge_dtype_t dt, float f) {
  if (dt == SPARGE_DTYPE_FLOAT16) return half_to_float(float_to_half(f));
  if (dt == SPARGE_DTYPE_BFLOAT16) return bf16_to_float(float_to_bf16(f));
  return f;
}

inline float load_elem(const void* base, sparge_dtype_t dt, int64_t off) {
  switch (dt) {
    case SPARGE_DTYPE_FLOAT16: return half_to_float(static_cast<const uint16_t*>(base)[off]);
    case SPARGE_DTYPE_BFLOAT16: return bf16_to_float(static_cast<const uint16_t*>(base)[off]);
    default: return static_cast<const float*>(base)[off];
  }
}

inline void store_elem(void* base, sparge_dtype_t dt, int64_t off, float v) {
  switch (dt) {
    case SPARGE_DTYPE_FLOAT16: static_cast<uint16_t*>(base)[off] = float_to_half(v); break;
    case SPARGE_DTYPE_BFLOAT16: static_cast<uint16_t*>(base)[off] = float_to_bf16(v); break;
    default: static_cast<float*>(base)[off] = v; break;
  }
}

// ---------------------------------------------------------------- fp8 e4m3
// Round-to-nearest-even, saturating: |x| >= 448 (and +-inf) -> +-448; NaN -> NaN.
inline uint8_t float_to_e4m3(float x) {
  const uint8_t sign = (float_bits(x) & 0x80000000u) ? 0x80 : 0x00;
  if (std::isnan(x)) return uint8_t(sign | 0x7f);
  const float a = std::fabs(x);
  if (a >= 448.0f) return uint8_t(sign | 0x7e);
  if (a < 0.015625f) {  // below 2^-6: subnormal, quantum 2^-9
    const int m = int(std::nearbyint(a * 512.0f));  // 0..8; 8 encodes 2^-6 (exponent 1)
    return uint8_t(sign | m);
  }
  int e2 = 0;
  std::frexp(a, &e2);  // a = f * 2^e2, f in [0.5, 1)
  int E = e2 - 1;      // a = 1.xxx * 2^E, E in [-6, 8]
  int mant = int(std::nearbyint(std::ldexp(a, 3 - E)));  // 8..16, exact scaling
  if (mant == 16) {
    mant = 8;
    ++E;
  }
  return uint8_t(sign | ((E + 7) << 3) | (mant - 8));
}

inline float e4m3_to_float(uint8_t b) {
  const int e = (b >> 3) & 0xf, m = b & 7;
  float v;
  if (e == 15 && m == 7) v = std::nanf("");
  else if (e == 0) v = std::ldexp(float(m), -9);
  else v = std::ldexp(float(8 + m), e - 10);
  return (b & 0x80) ? -v : v;
}

// float(e4m3_satfinite(x))
inline float e4m3_round(float x) { return e4m3_to_float(float_to_e4m3(x)); }

}  // namespace cpu
}  // namespace sparge
