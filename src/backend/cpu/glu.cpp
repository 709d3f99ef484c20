// Gated MLP activations (SwiGLU, GeGLU, ReGLU): out = act(gate) · up over rows [gate (F) | up (F)] of the fc1
// output, and the backward dinp = [dout · up · act'(gate) | dout · act(gate)] (overwrite).
// The activations are the vectorisable forms of fast_math.h: silu(g) = g · sigmoid(g); GeLU is the tanh
// approximation of gelu_forward/gelu_backward (the same fast_gelu* functions), so GeGLU with up = 1
// reproduces gelu_forward bit for bit; relu(g) = g < 0 ? 0 : g (NaN propagates, as in PyTorch), relu'(g) =
// g > 0. Every output element depends on one (gate, up, dout) triple only, so dinp may alias inp (each
// element's inputs are read before its outputs are written) and the results never depend on threads.
// Work is split into (row, chunk of kChunk columns) tasks, so a few very wide rows still spread over
// threads. Mixed precision: all tensors share one dtype (f32, bf16 or f16); a bf16/f16 chunk is widened into
// per-thread f32 scratch, run through the f32 code and narrowed once (RNE).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/lowp.h"

namespace loom::cpu {

namespace {

constexpr int64_t kParallelMin = int64_t(1) << 12;  // output elements; the activations cost ~20 flops each
constexpr int64_t kChunk = 1024;                    // columns per task: 4 KB per f32 scratch buffer (L1)

template <GluKind K>
inline float act(float g) {
  if constexpr (K == GluKind::kSwiGLU) {
    return g * fast_sigmoid(g);
  } else if constexpr (K == GluKind::kGeGLU) {
    return fast_gelu(g);
  } else {
    return g < 0.0f ? 0.0f : g;
  }
}

// act(g) and act'(g) together (they share the exponential).
template <GluKind K>
inline void act_and_grad(float g, float& a, float& da) {
  if constexpr (K == GluKind::kSwiGLU) {
    const SigmoidPair sg = fast_sigmoid_pair(g);
    a = g * sg.s;
    da = sg.s + g * sg.s * sg.one_minus_s;
  } else if constexpr (K == GluKind::kGeGLU) {
    fast_gelu_and_grad(g, a, da);
  } else {
    a = g < 0.0f ? 0.0f : g;
    da = g > 0.0f ? 1.0f : 0.0f;
  }
}

#if defined(__AVX512F__)
// act and act_and_grad 16 lanes at a time, the same bits (fast_math.h, simd16); ReGLU keeps the scalar form.
template <GluKind K>
inline __m512 act16(__m512 g) {
  if constexpr (K == GluKind::kSwiGLU) return simd16::silu(g);
  else return simd16::gelu(g);
}

template <GluKind K>
inline void act_and_grad16(__m512 g, __m512& a, __m512& da) {
  if constexpr (K == GluKind::kSwiGLU) simd16::silu_and_grad(g, a, da);
  else simd16::gelu_and_grad(g, a, da);
}
#endif

template <GluKind K>
void forward_chunk(float* out, const float* gate, const float* up, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (K != GluKind::kReGLU) {
    simd16::for_blocks(n, [&](int64_t i, __mmask16 m) {
      const __m512 a = act16<K>(_mm512_maskz_loadu_ps(m, gate + i));
      _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, up + i)));
    });
    return;
  }
#endif
  LOOM_SIMD_ACTIVATION
  for (int64_t i = 0; i < n; ++i) out[i] = act<K>(gate[i]) * up[i];
}

// dgate/dup may alias gate/up element for element. With kOut, out (never an input) also receives
// act(gate) · up, forward_chunk's bits (act_and_grad's act is act's: the same sigmoid and products).
template <GluKind K, bool kOut = false>
void backward_chunk(float* dgate, float* dup, const float* gate, const float* up, const float* dy, int64_t n,
                    float* out = nullptr) {
#if defined(__AVX512F__)
  if constexpr (K != GluKind::kReGLU) {
    simd16::for_blocks(n, [&](int64_t i, __mmask16 m) {  // all three loaded before either store (aliasing)
      const __m512 g = _mm512_maskz_loadu_ps(m, gate + i), u = _mm512_maskz_loadu_ps(m, up + i);
      const __m512 d = _mm512_maskz_loadu_ps(m, dy + i);
      __m512 a, da;
      act_and_grad16<K>(g, a, da);
      _mm512_mask_storeu_ps(dgate + i, m, _mm512_mul_ps(_mm512_mul_ps(d, u), da));
      _mm512_mask_storeu_ps(dup + i, m, _mm512_mul_ps(d, a));
      if constexpr (kOut) _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(a, u));
    });
    return;
  }
#endif
  LOOM_SIMD_ACTIVATION
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i], u = up[i], d = dy[i];
    float a, da;
    act_and_grad<K>(g, a, da);
    dgate[i] = d * u * da;
    dup[i] = d * a;
    if constexpr (kOut) out[i] = a * u;
  }
}

template <typename F>
void with_kind(GluKind kind, F&& f) {
  switch (kind) {
    case GluKind::kSwiGLU: f(std::integral_constant<GluKind, GluKind::kSwiGLU>{}); return;
    case GluKind::kGeGLU: f(std::integral_constant<GluKind, GluKind::kGeGLU>{}); return;
    case GluKind::kReGLU: f(std::integral_constant<GluKind, GluKind::kReGLU>{}); return;
  }
  LOOM_FAIL("[glu] unknown GluKind ", int(kind));
}

struct GluShape {
  int64_t N = 0, F = 0;
  DType dt = DType::kF32;
};

// inp (N, 2F) = [gate | up] (shapes and dtypes checked by the OpTable entry point).
GluShape glu_shape(const TensorView& inp) {
  GluShape s;
  s.dt = inp.dtype();
  s.F = inp.shape().cols() / 2;
  s.N = inp.numel() / (2 * s.F);
  return s;
}

// Runs task(r, c0, len) for every row r and chunk [c0, c0 + len) of the F columns.
template <typename Task>
void for_chunks(const GluShape& s, Task&& task) {
  const int64_t per_row = (s.F + kChunk - 1) / kChunk;
  const int64_t ntasks = s.N * per_row;
#pragma omp parallel for schedule(static) if (s.N * s.F > kParallelMin)
  for (int64_t t = 0; t < ntasks; ++t) {
    const int64_t r = t / per_row, c0 = (t % per_row) * kChunk;
    task(r, c0, std::min(kChunk, s.F - c0));
  }
}

// glu_backward, with kOut also writing `out` (act(gate) · up) from the same pass.
template <GluKind K, bool kOut>
void glu_backward_impl(TensorView dinp, TensorView inp, TensorView dout, TensorView out) {
  const GluShape s = glu_shape(inp);
  const int64_t F = s.F;
  if (s.dt == DType::kF32) {
    float* dx = dinp.data<float>();
    const float* x = inp.data<float>();
    const float* dy = dout.data<float>();
    float* o = kOut ? out.data<float>() : nullptr;
    for_chunks(s, [&](int64_t r, int64_t c0, int64_t len) {
      const float* row = x + r * 2 * F;
      float* drow = dx + r * 2 * F;
      backward_chunk<K, kOut>(drow + c0, drow + F + c0, row + c0, row + F + c0, dy + r * F + c0, len,
                              kOut ? o + r * F + c0 : nullptr);
    });
    return;
  }
  with_lowp(s.dt, [&](auto L) {
    using Lp = decltype(L);
    uint16_t* dx = static_cast<uint16_t*>(dinp.raw());
    const uint16_t* x = static_cast<const uint16_t*>(inp.raw());
    const uint16_t* dy = static_cast<const uint16_t*>(dout.raw());
    uint16_t* o = kOut ? static_cast<uint16_t*>(out.raw()) : nullptr;
    for_chunks(s, [&](int64_t r, int64_t c0, int64_t len) {
      float* g = thread_scratch(0, size_t(kChunk));
      float* u = thread_scratch(1, size_t(kChunk));
      float* d = thread_scratch(2, size_t(kChunk));
      float* a = kOut ? thread_scratch(3, size_t(kChunk)) : nullptr;
      const uint16_t* row = x + r * 2 * F;
      Lp::widen(g, row + c0, len);
      Lp::widen(u, row + F + c0, len);
      Lp::widen(d, dy + r * F + c0, len);
      backward_chunk<K, kOut>(g, u, g, u, d, len, a);  // in place: each element reads its inputs first
      uint16_t* drow = dx + r * 2 * F;
      Lp::narrow(drow + c0, g, len);
      Lp::narrow(drow + F + c0, u, len);
      if constexpr (kOut) Lp::narrow(o + r * F + c0, a, len);
    });
  });
}

}  // namespace

void CpuOps::do_glu_forward(TensorView out, TensorView inp, GluKind kind) const {
  const GluShape s = glu_shape(inp);
  const int64_t F = s.F;
  with_kind(kind, [&](auto k) {
    constexpr GluKind K = decltype(k)::value;
    if (s.dt == DType::kF32) {
      float* o = out.data<float>();
      const float* x = inp.data<float>();
      for_chunks(s, [&](int64_t r, int64_t c0, int64_t len) {
        const float* row = x + r * 2 * F;
        forward_chunk<K>(o + r * F + c0, row + c0, row + F + c0, len);
      });
      return;
    }
    with_lowp(s.dt, [&](auto L) {
      using Lp = decltype(L);
      uint16_t* o = static_cast<uint16_t*>(out.raw());
      const uint16_t* x = static_cast<const uint16_t*>(inp.raw());
      for_chunks(s, [&](int64_t r, int64_t c0, int64_t len) {
        float* g = thread_scratch(0, size_t(kChunk));
        float* u = thread_scratch(1, size_t(kChunk));
        float* of = thread_scratch(2, size_t(kChunk));
        const uint16_t* row = x + r * 2 * F;
        Lp::widen(g, row + c0, len);
        Lp::widen(u, row + F + c0, len);
        forward_chunk<K>(of, g, u, len);
        Lp::narrow(o + r * F + c0, of, len);
      });
    });
  });
}

void CpuOps::do_glu_backward(TensorView dinp, TensorView inp, TensorView dout, GluKind kind, TensorView out) const {
  with_kind(kind, [&](auto k) {
    constexpr GluKind K = decltype(k)::value;
    if (out.defined()) glu_backward_impl<K, true>(dinp, inp, dout, out);
    else glu_backward_impl<K, false>(dinp, inp, dout, out);
  });
}

}  // namespace loom::cpu
