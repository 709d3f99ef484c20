// Elementwise CPU ops: residual add, GeLU (tanh form), bias add and bias gradient, scale, fill, dtype
// casts and the inf/NaN scan. Every loop is a flat contiguous pass the compiler vectorises; OpenMP splits
// large ones statically. The only reduction (bias_backward) sums fixed row blocks into partials and adds
// them in block order (the norms' reduction, norm_common.h), so each output element is summed in one fixed
// order whatever the thread count.
// Mixed precision: tensors may be f32, bf16 or f16 (one compute dtype per call; dbias f32 or the dtype of
// dout). The f32 code is the reference; a bf16/f16 call widens blocks of kLowpBlock elements (or rows)
// into per-thread f32 scratch, runs the same per-element f32 code and narrows with RNE, so its result is
// exactly the f32 op on the widened inputs, rounded once. Gradients kept in bf16/f16 accumulate in f32
// and are rounded once per call.
// Casts reproduce the core scalar conversions of loom/core/dtype.h bit for bit: f32/bf16/f16 go through
// the vector codecs of lowp.h; fp8 decoders are tables filled from the core decoders and fp8 encoders call
// the core directly (FP8 is not on a hot CPU path).
#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/lowp.h"
#include "backend/cpu/norm_common.h"

namespace loom::cpu {

namespace {

constexpr int64_t kParallelMin = int64_t(1) << 15;  // elements; below this a thread team costs more than it saves

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

const uint16_t* u16(const TensorView& t) { return static_cast<const uint16_t*>(t.raw()); }

// Elements per thread task of the bf16/f16 paths, and per block converted at once on the stack (a few
// vectors: enough independent work to hide the kernel's latency, small enough to stay in L1).
constexpr int64_t kLowpChunk = 1024;
constexpr int64_t kLowpBlock = 128;

// Runs kernel(out..., in..., len) over n low-precision elements, 16 at a time: the inputs are widened into
// stack vectors, each f32 result narrowed into its output, so the conversions stay in registers/L1 and fuse
// with the kernel (a full block calls it with the constant 16, which compiles to straight-line SIMD code).
// Threads take chunks of kLowpChunk elements. An output may alias an input (each block's inputs are widened
// before its outputs are narrowed); the outputs are distinct.
template <typename L, size_t NOut, size_t NIn, typename Kernel>
void lowp_map_n(L, std::array<uint16_t*, NOut> out, std::array<const uint16_t*, NIn> in, int64_t n,
                int64_t parallel_min, Kernel&& kernel) {
  const int64_t nchunks = (n + kLowpChunk - 1) / kLowpChunk;
#pragma omp parallel for schedule(static) if (n > parallel_min)
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t i1 = std::min(n, (ch + 1) * kLowpChunk);
    alignas(64) float f[NIn][kLowpBlock];
    alignas(64) float o[NOut][kLowpBlock];
    std::array<const float*, NIn> fp;
    std::array<float*, NOut> op;
    for (size_t k = 0; k < NIn; ++k) fp[k] = f[k];
    for (size_t k = 0; k < NOut; ++k) op[k] = o[k];
    for (int64_t i = ch * kLowpChunk; i < i1; i += kLowpBlock) {
      const int64_t len = std::min(kLowpBlock, i1 - i);
      for (size_t k = 0; k < NIn; ++k) L::widen(f[k], in[k] + i, len);
      std::apply(
          [&](auto... outs) {
            std::apply(
                [&](auto... ins) {
                  if (len == kLowpBlock) kernel(outs..., ins..., kLowpBlock);
                  else kernel(outs..., ins..., len);
                },
                fp);
          },
          op);
      for (size_t k = 0; k < NOut; ++k) L::narrow(out[k] + i, o[k], len);
    }
  }
}

// One output: kernel(out, in..., len).
template <typename L, size_t NIn, typename Kernel>
void lowp_map(L, uint16_t* out, std::array<const uint16_t*, NIn> in, int64_t n, int64_t parallel_min,
              Kernel&& kernel) {
  lowp_map_n(L{}, std::array<uint16_t*, 1>{out}, in, n, parallel_min, kernel);
}

// f32 elementwise ops in chunks of kLowpChunk elements (the bf16/f16 path's split): kernel(out + i, i, len)
// for every chunk [i, i + len), chunks spread over threads when n > parallel_min.
template <typename Kernel>
void f32_map(float* out, int64_t n, int64_t parallel_min, Kernel&& kernel) {
  const int64_t nchunks = (n + kLowpChunk - 1) / kLowpChunk;
#pragma omp parallel for schedule(static) if (n > parallel_min)
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t i = ch * kLowpChunk;
    kernel(out + i, i, std::min(kLowpChunk, n - i));
  }
}

// GeLU's backward over one block: dx = gelu'(x) · dy, and with kOut also a = gelu(x), from the same exponential
// (the bits of fast_gelu / simd16::gelu: the same sigmoid, the same products). dx may be dy.
template <bool kOut>
inline void gelu_backward_block(float* dx, float* a, const float* x, const float* dy, int64_t len) {
#if defined(__AVX512F__)
  simd16::for_blocks(len, [&](int64_t i, __mmask16 m) {
    __m512 av, da;
    simd16::gelu_and_grad(_mm512_maskz_loadu_ps(m, x + i), av, da);
    _mm512_mask_storeu_ps(dx + i, m, _mm512_mul_ps(da, _mm512_maskz_loadu_ps(m, dy + i)));
    if constexpr (kOut) _mm512_mask_storeu_ps(a + i, m, av);
  });
#else
  LOOM_SIMD_ACTIVATION
  for (int64_t i = 0; i < len; ++i) {
    float ai, da;
    fast_gelu_and_grad(x[i], ai, da);
    dx[i] = da * dy[i];
    if constexpr (kOut) a[i] = ai;
  }
#endif
}

}  // namespace

void CpuOps::do_residual_forward(TensorView out, TensorView a, TensorView b) const {
  const DType dt = out.dtype();
  const int64_t n = out.numel();
  if (dt == DType::kF32) {
    float* o = out.data<float>();
    const float* pa = a.data<float>();
    const float* pb = b.data<float>();
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) o[i] = pa[i] + pb[i];
    return;
  }
  with_lowp(dt, [&](auto L) {
    lowp_map(L, static_cast<uint16_t*>(out.raw()),
             std::array<const uint16_t*, 2>{u16(a), u16(b)},
             n, kParallelMin / 2, [](float* o, const float* pa, const float* pb, int64_t len) {
#pragma omp simd
               for (int64_t i = 0; i < len; ++i) o[i] = pa[i] + pb[i];
             });
  });
}

void CpuOps::do_gelu_forward(TensorView out, TensorView inp) const {
  const DType dt = out.dtype();
  const int64_t n = out.numel();
  auto kernel = [](float* o, const float* x, int64_t len) {
#if defined(__AVX512F__)
    simd16::for_blocks(len, [&](int64_t i, __mmask16 m) {
      _mm512_mask_storeu_ps(o + i, m, simd16::gelu(_mm512_maskz_loadu_ps(m, x + i)));
    });
#else
    LOOM_SIMD_ACTIVATION
    for (int64_t i = 0; i < len; ++i) o[i] = fast_gelu(x[i]);
#endif
  };
  if (dt == DType::kF32) {
    f32_map(out.data<float>(), n, kParallelMin / 8, [&](float* o, int64_t i, int64_t len) {
      kernel(o, inp.data<float>() + i, len);
    });
    return;
  }
  with_lowp(dt, [&](auto L) {
    lowp_map(L, static_cast<uint16_t*>(out.raw()), std::array<const uint16_t*, 1>{u16(inp)}, n, kParallelMin / 8,
             kernel);
  });
}

void CpuOps::do_gelu_backward(TensorView dinp, TensorView inp, TensorView dout, TensorView out) const {
  const DType dt = dinp.dtype();
  const int64_t n = dinp.numel();
  // With out: the recomputed activation from the same pass (one exponential per element, not two).
  if (dt == DType::kF32) {
    f32_map(dinp.data<float>(), n, kParallelMin / 8, [&](float* dx, int64_t i, int64_t len) {
      const float* x = inp.data<float>() + i;
      const float* dy = dout.data<float>() + i;
      if (out) gelu_backward_block<true>(dx, out.data<float>() + i, x, dy, len);
      else gelu_backward_block<false>(dx, nullptr, x, dy, len);
    });
    return;
  }
  with_lowp(dt, [&](auto L) {
    const std::array<const uint16_t*, 2> in{u16(inp), u16(dout)};
    auto* dx = static_cast<uint16_t*>(dinp.raw());
    if (out) {
      lowp_map_n(L, std::array<uint16_t*, 2>{dx, static_cast<uint16_t*>(out.raw())}, in, n, kParallelMin / 8,
                 [](float* d, float* a, const float* x, const float* dy, int64_t len) {
                   gelu_backward_block<true>(d, a, x, dy, len);
                 });
    } else {
      lowp_map(L, dx, in, n, kParallelMin / 8, [](float* d, const float* x, const float* dy, int64_t len) {
        gelu_backward_block<false>(d, nullptr, x, dy, len);
      });
    }
  });
}

void CpuOps::do_bias_add_forward(TensorView out, TensorView bias) const {
  // The sum is f32 whatever the bias dtype (out's, f32, or bf16/f16 for an f32 out), rounded once to out's.
  const DType dt = out.dtype();
  const int64_t C = bias.numel();
  const int64_t N = out.numel() / C;
  std::vector<float> bias_buf;
  const float* b = bias.dtype() == DType::kF32 ? bias.data<float>() : nullptr;
  if (!b) {
    bias_buf.resize(static_cast<size_t>(C));
    widen(bias_buf.data(), bias.raw(), bias.dtype(), C);
    b = bias_buf.data();
  }
  if (dt == DType::kF32) {
    float* o = out.data<float>();
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
    for (int64_t r = 0; r < N; ++r) {
      float* row = o + r * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) row[c] += b[c];
    }
    return;
  }
  with_lowp(dt, [&](auto L) {
    using Lp = decltype(L);
    uint16_t* o = static_cast<uint16_t*>(out.raw());
#pragma omp parallel for schedule(static) if (N * C > kParallelMin)
    for (int64_t r = 0; r < N; ++r) {
      for (int64_t c0 = 0; c0 < C; c0 += kLowpChunk) {
        const int64_t len = std::min(kLowpChunk, C - c0);
        float* row = thread_scratch(0, size_t(kLowpChunk));
        Lp::widen(row, o + r * C + c0, len);
#pragma omp simd
        for (int64_t c = 0; c < len; ++c) row[c] += b[c0 + c];
        Lp::narrow(o + r * C + c0, row, len);
      }
    }
  });
}

// dbias += the column sums of dout, with the parameter-gradient reduction of the norms (norm_common.h): rows
// in blocks of kReduceBlockRows, each block's f32 partials in row order, the blocks added in order in f64
// and the gradient rounded once. Threads take whole row blocks, so each reads contiguous memory (a split by
// channel ranges read every row in short strided spans, at a third of the bandwidth when dout is not in
// cache); no channel's order depends on the thread count.
void CpuOps::do_bias_backward(TensorView dbias, TensorView dout) const {
  const DType dt = dout.dtype();
  const int64_t C = dbias.numel();
  const int64_t N = dout.numel() / C;
  const int64_t nblocks = norm_common::num_blocks(N);
  float* partials = norm_common::partial_scratch(size_t(nblocks * C));
  const void* dy = dout.raw();
  norm_common::for_row_blocks(N, C, partials, C, [&](int64_t r, float* p) {
    const float* x;
    if (dt == DType::kF32) {
      x = static_cast<const float*>(dy) + r * C;
    } else {  // bf16/f16: the row widened (exactly), as the norms do
      float* w = thread_scratch(0, size_t(C));
      widen(w, elem_ptr(dy, dt, r * C), dt, C);
      x = w;
    }
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) p[c] += x[c];
  });
  norm_common::add_block_partials<1>(partials, nblocks, C, {norm_common::grad_out(dbias)});
}

void CpuOps::do_scale_(TensorView x, float s) const {
  const int64_t n = x.numel();
  if (is_lowp(x.dtype())) {
    with_lowp(x.dtype(), [&](auto L) {
      uint16_t* p = static_cast<uint16_t*>(x.raw());
      lowp_map(L, p, std::array<const uint16_t*, 1>{p}, n, kParallelMin, [s](float* o, const float* v, int64_t len) {
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) o[i] = v[i] * s;
      });
    });
    return;
  }
  with_codec(x.dtype(), "scale_", [&](auto codec) {
    using C = decltype(codec);
    using T = typename C::T;
    T* p = static_cast<T*>(x.raw());
    const float* tab = C::table();
#pragma omp parallel for schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) p[i] = C::enc(C::dec(p[i], tab) * s);
  });
}

void CpuOps::do_fill_(TensorView x, float value) const {
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

void CpuOps::do_cast(TensorView out, TensorView inp) const {
  const int64_t n = inp.numel();
  if (out.dtype() == inp.dtype()) {
    if (out.raw() != inp.raw() && n > 0) std::memcpy(out.raw(), inp.raw(), size_t(inp.nbytes()));
    return;
  }
  if (is_compute_dtype(inp.dtype()) && is_compute_dtype(out.dtype())) {
    // f32 <-> bf16 <-> f16 through the vector codecs, chunk by chunk (one of the two is low precision).
    const DType di = inp.dtype(), dout = out.dtype();
    const int64_t nchunks = (n + kLowpChunk - 1) / kLowpChunk;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      const int64_t i0 = ch * kLowpChunk, len = std::min(kLowpChunk, n - i0);
      void* dst = elem_ptr(out.raw(), dout, i0);
      const void* src = elem_ptr(inp.raw(), di, i0);
      if (di == DType::kF32) {
        narrow(dst, dout, static_cast<const float*>(src), len);
      } else if (dout == DType::kF32) {
        widen(static_cast<float*>(dst), src, di, len);
      } else {
        float* buf = thread_scratch(0, size_t(kLowpChunk));
        widen(buf, src, di, len);
        narrow(dst, dout, buf, len);
      }
    }
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

bool CpuOps::do_has_inf_or_nan(TensorView x) const {
  const int64_t n = x.numel();
  int bad = 0;
  if (is_lowp(x.dtype())) {
    // An all-ones exponent field is inf or NaN: bf16 0x7F80, f16 0x7C00.
    const uint16_t exp_mask = x.dtype() == DType::kBF16 ? 0x7F80u : 0x7C00u;
    const uint16_t* p = static_cast<const uint16_t*>(x.raw());
#pragma omp parallel for simd schedule(static) reduction(| : bad) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) bad |= int((p[i] & exp_mask) == exp_mask);
    return bad != 0;
  }
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
