// Elementwise CPU ops: residual add, GeLU (tanh form), bias add and bias gradient, scale, fill, dtype
// casts and the inf/NaN scan. Every loop is a flat contiguous pass the compiler vectorises; OpenMP splits
// large ones statically. The only reduction (bias_backward) splits work by channel, never by row, so each
// output element is summed in one fixed order whatever the thread count.
// Casts reproduce the core scalar conversions of loom/core/dtype.h bit for bit: bf16 and f16 encoders are
// branch-free integer versions of the same round-to-nearest-even (vectorisable); f16 and fp8 decoders are
// tables filled from the core decoders; fp8 encoders call the core directly (FP8 is not on a hot CPU path).
#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/fast_math.h"

namespace loom::cpu {

namespace {

constexpr int64_t kParallelMin = int64_t(1) << 15;  // elements; below this a thread team costs more than it saves

void expect_host(const TensorView& t, const char* op, const char* name) {
  LOOM_CHECK(t.defined(), "[", op, "] ", name, " is required");
  LOOM_CHECK(t.device().is_cpu(), "[", op, "] expected a host tensor for ", name, ", got ", t.desc());
}

void expect_f32(const TensorView& t, const char* op, const char* name) {
  expect_host(t, op, name);
  LOOM_CHECK(t.dtype() == DType::kF32, "[", op, "] expected f32 ", name, ", got ", t.desc());
}

void expect_numel(const TensorView& t, int64_t n, const char* op, const char* name) {
  LOOM_CHECK(t.numel() == n, "[", op, "] expected ", name, " with ", n, " elements, got ", t.desc());
}

// ---- scalar codecs --------------------------------------------------------------------------------

// f32 -> bf16, identical to loom::f32_to_bf16 (RNE; NaN quietened with its sign kept), branch-free.
inline uint16_t bf16_encode(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

inline float bf16_decode(uint16_t x) { return std::bit_cast<float>(uint32_t(x) << 16); }

// f32 -> f16, identical to loom::f32_to_f16 (RNE, overflow to inf, NaN -> sign | 0x7E00), branch-free.
inline uint16_t f16_encode(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal range: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even; a
  // mantissa carry moves into the exponent, which is what rounding up to the next binade means.
  const uint32_t normal = (a - 0x38000000u + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  // Subnormal range (|x| < 2^-14): the f16 bits are round(|x| * 2^24) = round(m * 2^(e - 126)).
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t ec = e < 125u ? e : 125u;  // keeps the shift in [1, 31] for lanes the select discards
  const uint32_t shift = 126u - ec < 31u ? 126u - ec : 31u;
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t sub = q + uint32_t(rem > half || (rem == half && (q & 1u)));
  uint32_t bits = a < 0x38800000u ? sub : normal;
  bits = a >= 0x477FF000u ? 0x7C00u : bits;  // >= 65520 rounds past the largest finite value
  bits = a > 0x7F800000u ? 0x7E00u : bits;
  return uint16_t(sign | bits);
}

template <size_t N, typename Decode>
std::array<float, N> make_table(Decode decode) {
  std::array<float, N> t{};
  for (size_t i = 0; i < N; ++i) t[i] = decode(uint32_t(i));
  return t;
}

const float* f16_table() {
  static const auto t = make_table<65536>([](uint32_t i) { return f16_to_f32(uint16_t(i)); });
  return t.data();
}
const float* e4m3_table() {
  static const auto t = make_table<256>([](uint32_t i) { return fp8_e4m3_to_f32(uint8_t(i)); });
  return t.data();
}
const float* e5m2_table() {
  static const auto t = make_table<256>([](uint32_t i) { return fp8_e5m2_to_f32(uint8_t(i)); });
  return t.data();
}

// Codec<D>: storage type T, decode (with an optional table fetched once per op) and encode.
template <DType D>
struct Codec;
template <>
struct Codec<DType::kF32> {
  using T = float;
  static const float* table() { return nullptr; }
  static float dec(T x, const float*) { return x; }
  static T enc(float x) { return x; }
};
template <>
struct Codec<DType::kBF16> {
  using T = uint16_t;
  static const float* table() { return nullptr; }
  static float dec(T x, const float*) { return bf16_decode(x); }
  static T enc(float x) { return bf16_encode(x); }
};
template <>
struct Codec<DType::kF16> {
  using T = uint16_t;
  static const float* table() { return f16_table(); }
  static float dec(T x, const float* tab) { return tab[x]; }
  static T enc(float x) { return f16_encode(x); }
};
template <>
struct Codec<DType::kF8E4M3> {
  using T = uint8_t;
  static const float* table() { return e4m3_table(); }
  static float dec(T x, const float* tab) { return tab[x]; }
  static T enc(float x) { return f32_to_fp8_e4m3(x); }
};
template <>
struct Codec<DType::kF8E5M2> {
  using T = uint8_t;
  static const float* table() { return e5m2_table(); }
  static float dec(T x, const float* tab) { return tab[x]; }
  static T enc(float x) { return f32_to_fp8_e5m2(x); }
};

// Calls fn(Codec<D>{}) for the float dtype dt.
template <typename Fn>
void with_codec(DType dt, const char* op, Fn&& fn) {
  switch (dt) {
    case DType::kF32: fn(Codec<DType::kF32>{}); return;
    case DType::kBF16: fn(Codec<DType::kBF16>{}); return;
    case DType::kF16: fn(Codec<DType::kF16>{}); return;
    case DType::kF8E4M3: fn(Codec<DType::kF8E4M3>{}); return;
    case DType::kF8E5M2: fn(Codec<DType::kF8E5M2>{}); return;
    default: LOOM_FAIL("[", op, "] expected a float dtype (f32, bf16, f16, fp8e4m3, fp8e5m2), got ", dtype_name(dt));
  }
}

template <typename T>
void fill_pattern(T* x, int64_t n, T value) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

// GeLU, tanh form, rewritten with 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation for large |x|.
constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;

// Column sums over a fixed split: rows in blocks of kReduceBlockRows (f32 partial sums in row order),
// blocks added in order in f64. Threads take channel ranges, so no element's order depends on them.
template <typename T>
void column_sums_accumulate(float* dbias, const T* dout, int64_t N, int64_t C) {
  constexpr int64_t kChunk = 64;  // channels per task: 4 cache lines of each row
  const int64_t nchunks = (C + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t c0 = ch * kChunk, w = std::min(kChunk, C - c0);
    double total[kChunk] = {};
    for (int64_t r0 = 0; r0 < N; r0 += kReduceBlockRows) {
      const int64_t r1 = std::min(N, r0 + kReduceBlockRows);
      float part[kChunk] = {};
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = dout + r * C + c0;
        for (int64_t c = 0; c < w; ++c) {
          if constexpr (std::is_same_v<T, float>)
            part[c] += row[c];
          else
            part[c] += bf16_decode(row[c]);
        }
      }
      for (int64_t c = 0; c < w; ++c) total[c] += double(part[c]);
    }
    for (int64_t c = 0; c < w; ++c) dbias[c0 + c] = float(double(dbias[c0 + c]) + total[c]);
  }
}

}  // namespace

void CpuOps::residual_forward(TensorView out, TensorView a, TensorView b) const {
  expect_f32(out, "residual_forward", "out");
  expect_f32(a, "residual_forward", "a");
  expect_f32(b, "residual_forward", "b");
  const int64_t n = out.numel();
  expect_numel(a, n, "residual_forward", "a");
  expect_numel(b, n, "residual_forward", "b");
  float* o = out.data<float>();
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) o[i] = pa[i] + pb[i];
}

void CpuOps::gelu_forward(TensorView out, TensorView inp) const {
  expect_f32(out, "gelu_forward", "out");
  expect_f32(inp, "gelu_forward", "inp");
  const int64_t n = out.numel();
  expect_numel(inp, n, "gelu_forward", "inp");
  float* o = out.data<float>();
  const float* x = inp.data<float>();
#pragma omp parallel for simd schedule(static) if (n > kParallelMin / 8)
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    const float u = kGeluK0 * (xi + kGeluK1 * xi * xi * xi);
    o[i] = xi * fast_sigmoid(2.0f * u);
  }
}

void CpuOps::gelu_backward(TensorView dinp, TensorView inp, TensorView dout) const {
  expect_f32(dinp, "gelu_backward", "dinp");
  expect_f32(inp, "gelu_backward", "inp");
  expect_f32(dout, "gelu_backward", "dout");
  const int64_t n = dinp.numel();
  expect_numel(inp, n, "gelu_backward", "inp");
  expect_numel(dout, n, "gelu_backward", "dout");
  float* dx = dinp.data<float>();
  const float* x = inp.data<float>();
  const float* dy = dout.data<float>();
  // d/dx [x s(2u)] = s + x * 2 s (1 - s) u'   with s = sigmoid(2u), 1 - s = e s, e = exp(-2u).
#pragma omp parallel for simd schedule(static) if (n > kParallelMin / 8)
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    const float u = kGeluK0 * (xi + kGeluK1 * xi * xi * xi);
    const float du = kGeluK0 * (1.0f + 3.0f * kGeluK1 * xi * xi);
    const float e = fast_exp(-2.0f * u);
    const float s = 1.0f / (1.0f + e);
    const float one_minus_s = e < INFINITY ? e * s : 1.0f;  // e = inf: s = 0 and e * s would be NaN
    dx[i] = (s + 2.0f * xi * s * one_minus_s * du) * dy[i];
  }
}

void CpuOps::bias_add_forward(TensorView out, TensorView bias) const {
  expect_f32(out, "bias_add_forward", "out");
  expect_f32(bias, "bias_add_forward", "bias");
  const int64_t C = bias.numel();
  LOOM_CHECK(C > 0 && out.numel() % C == 0, "[bias_add_forward] out ", out.desc(), " is not a multiple of bias ",
             bias.desc());
  const int64_t N = out.numel() / C;
  float* o = out.data<float>();
  const float* b = bias.data<float>();
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
  for (int64_t r = 0; r < N; ++r) {
    float* row = o + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) row[c] += b[c];
  }
}

void CpuOps::bias_backward(TensorView dbias, TensorView dout) const {
  expect_f32(dbias, "bias_backward", "dbias");
  expect_host(dout, "bias_backward", "dout");
  const int64_t C = dbias.numel();
  LOOM_CHECK(C > 0 && dout.numel() % C == 0, "[bias_backward] dout ", dout.desc(), " is not a multiple of dbias ",
             dbias.desc());
  const int64_t N = dout.numel() / C;
  if (dout.dtype() == DType::kF32) {
    column_sums_accumulate(dbias.data<float>(), dout.data<float>(), N, C);
  } else {
    LOOM_CHECK(dout.dtype() == DType::kBF16, "[bias_backward] expected f32 or bf16 dout, got ", dout.desc());
    column_sums_accumulate(dbias.data<float>(), dout.data<uint16_t>(), N, C);
  }
}

void CpuOps::scale_(TensorView x, float s) const {
  expect_host(x, "scale_", "x");
  const int64_t n = x.numel();
  with_codec(x.dtype(), "scale_", [&](auto codec) {
    using C = decltype(codec);
    using T = typename C::T;
    T* p = static_cast<T*>(x.raw());
    const float* tab = C::table();
#pragma omp parallel for schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) p[i] = C::enc(C::dec(p[i], tab) * s);
  });
}

void CpuOps::fill_(TensorView x, float value) const {
  expect_host(x, "fill_", "x");
  const int64_t n = x.numel();
  if (n == 0) return;
  switch (x.dtype()) {
    case DType::kI32: fill_pattern(x.data<int32_t>(), n, int32_t(value)); return;
    case DType::kI64: fill_pattern(x.data<int64_t>(), n, int64_t(value)); return;
    case DType::kU16: fill_pattern(static_cast<uint16_t*>(x.raw()), n, uint16_t(value)); return;
    default: break;
  }
  with_codec(x.dtype(), "fill_", [&](auto codec) {
    using C = decltype(codec);
    fill_pattern(static_cast<typename C::T*>(x.raw()), n, C::enc(value));
  });
}

void CpuOps::cast(TensorView out, TensorView inp) const {
  expect_host(out, "cast", "out");
  expect_host(inp, "cast", "inp");
  const int64_t n = inp.numel();
  expect_numel(out, n, "cast", "out");
  if (out.dtype() == inp.dtype()) {
    if (out.raw() != inp.raw() && n > 0) std::memcpy(out.raw(), inp.raw(), size_t(inp.nbytes()));
    return;
  }
  with_codec(inp.dtype(), "cast", [&](auto in_codec) {
    with_codec(out.dtype(), "cast", [&](auto out_codec) {
      using CI = decltype(in_codec);
      using CO = decltype(out_codec);
      const auto* src = static_cast<const typename CI::T*>(inp.raw());
      auto* dst = static_cast<typename CO::T*>(out.raw());
      const float* tab = CI::table();
#pragma omp parallel for schedule(static) if (n > kParallelMin)
      for (int64_t i = 0; i < n; ++i) dst[i] = CO::enc(CI::dec(src[i], tab));
    });
  });
}

bool CpuOps::has_inf_or_nan(TensorView x) const {
  expect_host(x, "has_inf_or_nan", "x");
  const int64_t n = x.numel();
  int bad = 0;
  with_codec(x.dtype(), "has_inf_or_nan", [&](auto codec) {
    using C = decltype(codec);
    const auto* p = static_cast<const typename C::T*>(x.raw());
    const float* tab = C::table();
#pragma omp parallel for schedule(static) reduction(| : bad) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i)
      bad |= int((std::bit_cast<uint32_t>(C::dec(p[i], tab)) & 0x7F800000u) == 0x7F800000u);
  });
  return bad != 0;
}

}  // namespace loom::cpu
