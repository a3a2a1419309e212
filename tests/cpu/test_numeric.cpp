// Number formats of the CPU backend: fp8 e4m3 (satfinite, round-to-nearest-even)
// against a table of known codes, fp16/bf16 against independent conversions.
#include "catch_compat.hpp"

#include <cmath>
#include <limits>

#include "cpu/numeric.hpp"
#include "test_util.hpp"

using namespace sparge::cpu;
using namespace sparge_test;

TEST_CASE("e4m3: codes of known values", "[cpu][numeric]") {
  struct Row {
    float x;
    uint8_t code;
    float value;
  };
  const float sub = std::ldexp(1.0f, -9);  // smallest subnormal
  const Row table[] = {
      {0.0f, 0x00, 0.0f},
      {-0.0f, 0x80, -0.0f},
      {1.0f, 0x38, 1.0f},
      {-1.0f, 0xB8, -1.0f},
      {1.5f, 0x3C, 1.5f},
      {2.0f, 0x40, 2.0f},
      {448.0f, 0x7E, 448.0f},
      {-448.0f, 0xFE, -448.0f},
      {416.0f, 0x7D, 416.0f},
      {0.015625f, 0x08, 0.015625f},          // smallest normal 2^-6
      {sub, 0x01, sub},                      // smallest subnormal 2^-9
      {7 * sub, 0x07, 7 * sub},              // largest subnormal
      {1.0625f, 0x38, 1.0f},                 // tie 1.0 / 1.125 -> even (1.0)
      {1.1875f, 0x3A, 1.25f},                // tie 1.125 / 1.25 -> even (1.25)
      {1.05f, 0x38, 1.0f},                   // below the tie
      {-1.05f, 0xB8, -1.0f},
      {1.0626f, 0x39, 1.125f},               // just above the tie
      {0.5f * sub, 0x00, 0.0f},              // tie 0 / 2^-9 -> 0
      {0.51f * sub, 0x01, sub},
      {1.5f * sub, 0x02, 2 * sub},           // tie 1 / 2 quanta -> 2
      {2.5f * sub, 0x02, 2 * sub},           // tie 2 / 3 quanta -> 2
      {7.5f * sub, 0x08, 0.015625f},         // rounds up into the normal range
      {0.0146484375f, 0x08, 0.015625f},      // 7.5 * 2^-9 again, spelled out
      {240.0f, 0x77, 240.0f},
      {232.0f, 0x76, 224.0f},                // tie 224 / 240 -> even (224)
      {440.0f, 0x7E, 448.0f},                // tie 416 / 448 ... 432 is the tie; 440 -> 448
      {432.0f, 0x7E, 448.0f},                // tie 416 (odd code 0x7D) / 448 (0x7E) -> 448
      {449.0f, 0x7E, 448.0f},                // saturation
      {464.0f, 0x7E, 448.0f},
      {1e9f, 0x7E, 448.0f},
      {-1e9f, 0xFE, -448.0f},
      {std::numeric_limits<float>::infinity(), 0x7E, 448.0f},
      {-std::numeric_limits<float>::infinity(), 0xFE, -448.0f},
  };
  for (const Row& r : table) {
    INFO("x = " << r.x);
    CHECK(int(float_to_e4m3(r.x)) == int(r.code));
    CHECK(e4m3_to_float(r.code) == r.value);
    CHECK(std::signbit(e4m3_round(r.x)) == std::signbit(r.value));
  }
  CHECK(std::isnan(e4m3_to_float(0x7F)));
  CHECK(std::isnan(e4m3_to_float(0xFF)));
  CHECK((float_to_e4m3(std::nanf("")) & 0x7F) == 0x7F);
}

TEST_CASE("e4m3: every code round-trips and rounding matches a nearest-value search", "[cpu][numeric]") {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    const float v = e4m3_to_float(uint8_t(c));
    INFO("code " << c);
    CHECK(float_to_e4m3(v) == uint8_t(c));
  }
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-10.0f, 3.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::exp2(u(rng) * 1.0f) * ((rng() & 1) ? 1.0f : -1.0f) * (i % 7 == 0 ? 150.0f : 1.0f);
    INFO("x = " << x);
    REQUIRE(e4m3_round(x) == e4m3_reference(x));
  }
}

TEST_CASE("fp16 and bf16 conversions agree with independent implementations", "[cpu][numeric]") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = half_to_float(uint16_t(h)), b = f16_to_f32(uint16_t(h));
    const float c = bf16_to_float(uint16_t(h)), d = bf16_to_f32(uint16_t(h));
    REQUIRE(((std::isnan(a) && std::isnan(b)) || a == b));
    REQUIRE(((std::isnan(c) && std::isnan(d)) || c == d));
    if (!std::isnan(a)) REQUIRE(float_to_half(a) == uint16_t(h));
    if (!std::isnan(c)) REQUIRE(float_to_bf16(c) == uint16_t(h));
  }
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = uint32_t(rng());
    float f;
    std::memcpy(&f, &bits, 4);
    if (std::isnan(f)) continue;
    INFO("bits " << bits);
    REQUIRE(float_to_half(f) == f32_to_f16(f));
    REQUIRE(float_to_bf16(f) == f32_to_bf16(f));
  }
  // ties
  CHECK(float_to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);            // tie -> even
  CHECK(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);        // tie -> even (up)
  CHECK(float_to_half(65519.0f) == 0x7BFF);
  CHECK(float_to_half(65520.0f) == 0x7C00);
  CHECK(float_to_half(std::ldexp(1.0f, -25)) == 0x0000);                   // tie 0 / min subnormal
  CHECK(float_to_half(std::ldexp(3.0f, -25)) == 0x0002);
  CHECK(float_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);
  CHECK(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);
}
