// Scalar conversions between f32 and the narrow float formats. One generic minifloat encoder covers
// f16 and both FP8 formats: it works in double (exact for every f32 input), rounds the significand
// with nearbyint (ties to even under the default rounding mode) and handles subnormals by scaling to
// units of the smallest subnormal, where the integer result is the bit pattern itself.
#include "loom/core/dtype.h"

#include <cmath>
#include <cstring>

#include "loom/core/check.h"

namespace loom {

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kF8E5M2: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU16: return 2;
  }
  LOOM_FAIL("unknown dtype ", int(dt));
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF8E4M3: return "fp8e4m3";
    case DType::kF8E5M2: return "fp8e5m2";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU16: return "u16";
  }
  return "?";
}

bool dtype_is_float(DType dt) {
  return dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16 || dt == DType::kF8E4M3 ||
         dt == DType::kF8E5M2;
}

namespace {

struct MiniFloat {
  int ebits, mbits, bias;
  bool has_inf;      // IEEE-style: all-ones exponent is inf/NaN
  uint32_t nan_bits; // pattern (without sign) used for NaN
  uint32_t max_bits; // pattern (without sign) of the largest finite value
};

constexpr MiniFloat kF16{5, 10, 15, true, 0x7E00, 0x7BFF};
constexpr MiniFloat kE4M3{4, 3, 7, false, 0x7F, 0x7E};
constexpr MiniFloat kE5M2{5, 2, 15, true, 0x7E, 0x7B};

double decode(const MiniFloat& f, uint32_t bits) {
  const uint32_t sign = bits >> (f.ebits + f.mbits);
  const uint32_t e = (bits >> f.mbits) & ((1u << f.ebits) - 1);
  const uint32_t m = bits & ((1u << f.mbits) - 1);
  const double s = sign ? -1.0 : 1.0;
  const uint32_t emax = (1u << f.ebits) - 1;
  if (f.has_inf && e == emax) return m == 0 ? s * INFINITY : NAN;
  if (!f.has_inf && (bits & ((1u << (f.ebits + f.mbits)) - 1)) == f.nan_bits) return NAN;
  if (e == 0) return s * std::ldexp(double(m), 1 - f.bias - f.mbits);
  return s * std::ldexp(1.0 + std::ldexp(double(m), -f.mbits), int(e) - f.bias);
}

// saturate: overflow goes to the largest finite value (FP8) instead of infinity (IEEE f16).
uint32_t encode(const MiniFloat& f, float xf, bool saturate) {
  const uint32_t sign_bit = 1u << (f.ebits + f.mbits);
  const uint32_t sign = std::signbit(xf) ? sign_bit : 0;
  if (std::isnan(xf)) return sign | f.nan_bits;
  const double a = std::fabs(double(xf));
  const uint32_t inf_bits = ((1u << f.ebits) - 1) << f.mbits;
  if (std::isinf(a)) return sign | (saturate || !f.has_inf ? f.max_bits : inf_bits);
  const int min_normal_exp = 1 - f.bias;
  if (a < std::ldexp(1.0, min_normal_exp)) {
    // Units of the smallest subnormal; q == 2^mbits lands exactly on the smallest normal pattern.
    const double q = std::nearbyint(std::ldexp(a, f.mbits - min_normal_exp));
    return sign | uint32_t(q);
  }
  int ex;
  std::frexp(a, &ex);
  int e = ex - 1;  // a = s * 2^e, s in [1, 2)
  double mant = std::nearbyint((std::ldexp(a, -e) - 1.0) * double(1u << f.mbits));
  if (mant == double(1u << f.mbits)) {
    mant = 0;
    ++e;
  }
  const int64_t biased = int64_t(e) + f.bias;
  const uint32_t bits = (uint32_t(biased) << f.mbits) | uint32_t(mant);
  const int64_t emax_field = f.has_inf ? (1 << f.ebits) - 2 : (1 << f.ebits) - 1;
  if (biased > emax_field || bits > f.max_bits) return sign | (saturate || !f.has_inf ? f.max_bits : inf_bits);
  return sign | bits;
}

}  // namespace

uint16_t f32_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return uint16_t((u >> 16) | 0x0040);  // quiet NaN, sign kept
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float bf16_to_f32(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float x) { return uint16_t(encode(kF16, x, false)); }
float f16_to_f32(uint16_t x) { return float(decode(kF16, x)); }
uint8_t f32_to_fp8_e4m3(float x) { return uint8_t(encode(kE4M3, x, true)); }
float fp8_e4m3_to_f32(uint8_t x) { return float(decode(kE4M3, x)); }
uint8_t f32_to_fp8_e5m2(float x) { return uint8_t(encode(kE5M2, x, true)); }
float fp8_e5m2_to_f32(uint8_t x) { return float(decode(kE5M2, x)); }

// Through memcpy: callers pass arrays at any byte offset (memory-mapped checkpoint data).
float load_as_f32(const void* base, DType dt, int64_t i) {
  const auto* p = static_cast<const uint8_t*>(base);
  switch (dt) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case DType::kBF16:
    case DType::kF16: {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      return dt == DType::kBF16 ? bf16_to_f32(v) : f16_to_f32(v);
    }
    case DType::kF8E4M3: return fp8_e4m3_to_f32(p[i]);
    case DType::kF8E5M2: return fp8_e5m2_to_f32(p[i]);
    default: LOOM_FAIL("load_as_f32: not a float dtype: ", dtype_name(dt));
  }
}

void store_from_f32(void* base, DType dt, int64_t i, float v) {
  auto* p = static_cast<uint8_t*>(base);
  switch (dt) {
    case DType::kF32: std::memcpy(p + 4 * i, &v, 4); return;
    case DType::kBF16:
    case DType::kF16: {
      const uint16_t b = dt == DType::kBF16 ? f32_to_bf16(v) : f32_to_f16(v);
      std::memcpy(p + 2 * i, &b, 2);
      return;
    }
    case DType::kF8E4M3: static_cast<uint8_t*>(base)[i] = f32_to_fp8_e4m3(v); return;
    case DType::kF8E5M2: static_cast<uint8_t*>(base)[i] = f32_to_fp8_e5m2(v); return;
    default: LOOM_FAIL("store_from_f32: not a float dtype: ", dtype_name(dt));
  }
}

double dtype_max(DType dt) {
  switch (dt) {
    case DType::kF32: return 3.4028234663852886e38;
    case DType::kBF16: return 3.3895313892515355e38;
    case DType::kF16: return 65504.0;
    case DType::kF8E4M3: return 448.0;
    case DType::kF8E5M2: return 57344.0;
    default: LOOM_FAIL("dtype_max of non-float dtype ", dtype_name(dt));
  }
}

}  // namespace loom
