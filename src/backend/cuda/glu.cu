// CUDA gated MLP activations (SwiGLU, GeGLU, ReGLU) over rows [gate (F) | up (F)] of the fc1 output:
// out = act(gate) · up, and the backward dinp = [dout · up · act'(gate) | dout · act(gate)] (overwrite).
// CPU twin: src/backend/cpu/glu.cpp, whose formulas these are: silu(g) = g · sigmoid(g); GeGLU's GeLU is the
// tanh form written as x · sigmoid(2u) (activations.cuh's gelu(), the one gelu_forward uses, so GeGLU with
// up = 1 reproduces gelu_forward bit for bit); relu(g) = g < 0 ? 0 : g (NaN propagates), relu'(g) = g > 0.
// Invariants:
//   - one thread owns a pack of output columns of one row: it reads the gate, up (and dout) elements of
//     those columns before writing anything, and no other thread touches them, so dinp may be inp;
//   - 16-byte packs when every row start is aligned (pointers 16-byte aligned, F a multiple of the pack),
//     else one column per step; grid-stride loops with int64 indices;
//   - f32 arithmetic, one rounding to the dtype; results do not depend on the launch shape.
#include <cstdint>

#include "backend/cuda/activations.cuh"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/pack.cuh"

namespace loom::cuda {

namespace {

template <GluKind K>
__device__ __forceinline__ float act(float g) {
  if constexpr (K == GluKind::kSwiGLU) {
    return g / (1.0f + expf(-g));
  } else if constexpr (K == GluKind::kGeGLU) {
    return gelu(g);
  } else {
    return g < 0.0f ? 0.0f : g;
  }
}

// act(g) and act'(g) together (they share the exponential of sigmoid_pair, which avoids cancellation in 1 - s).
template <GluKind K>
__device__ __forceinline__ void act_and_grad(float g, float& a, float& da) {
  if constexpr (K == GluKind::kReGLU) {
    a = g < 0.0f ? 0.0f : g;
    da = g > 0.0f ? 1.0f : 0.0f;
  } else {
    const bool swish = K == GluKind::kSwiGLU;
    const float u = swish ? 0.0f : kGeluK0 * (g + kGeluK1 * g * g * g);
    const SigmoidPair sg = sigmoid_pair(swish ? g : 2.0f * u);
    const float s = sg.s, one_minus_s = sg.one_minus_s;
    a = g * s;
    if (swish) {
      da = s + g * s * one_minus_s;
    } else {
      const float du = kGeluK0 * (1.0f + 3.0f * kGeluK1 * g * g);
      da = s + 2.0f * g * s * one_minus_s * du;
    }
  }
}

// Work item i covers columns [c0, c0 + W) of row r, with (r, c0) from i and Fw = F / W packs per row.
template <typename T, GluKind K, int W>
__global__ void glu_forward_kernel(T* out, const T* inp, int64_t N, int64_t F) {
  const int64_t Fw = F / W, total = N * Fw;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t r = i / Fw, c0 = (i - r * Fw) * W;
    const T* row = inp + r * 2 * F;
    const Pack<T, W> g = load_pack<T, W>(row + c0);
    const Pack<T, W> u = load_pack<T, W>(row + F + c0);
    Pack<T, W> o;
#pragma unroll
    for (int j = 0; j < W; ++j) o.v[j] = store<T>(act<K>(load(g.v[j])) * load(u.v[j]));
    store_pack<T, W>(out + r * F + c0, o);
  }
}

template <typename T, GluKind K, int W>
__global__ void glu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t N, int64_t F) {
  const int64_t Fw = F / W, total = N * Fw;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t r = i / Fw, c0 = (i - r * Fw) * W;
    const T* row = inp + r * 2 * F;
    const Pack<T, W> g = load_pack<T, W>(row + c0);
    const Pack<T, W> u = load_pack<T, W>(row + F + c0);
    const Pack<T, W> d = load_pack<T, W>(dout + r * F + c0);
    Pack<T, W> dg, du;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      float a, da;
      act_and_grad<K>(load(g.v[j]), a, da);
      const float dy = load(d.v[j]);
      dg.v[j] = store<T>(dy * load(u.v[j]) * da);
      du.v[j] = store<T>(dy * a);
    }
    T* drow = dinp + r * 2 * F;
    store_pack<T, W>(drow + c0, dg);
    store_pack<T, W>(drow + F + c0, du);
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
GluShape glu_shape(TensorView inp) {
  GluShape s;
  s.dt = inp.dtype();
  s.F = inp.shape().cols() / 2;
  s.N = inp.numel() / (2 * s.F);
  return s;
}

}  // namespace

void glu_forward(const CudaContext& ctx, TensorView out, TensorView inp, GluKind kind) {
  const GluShape s = glu_shape(inp);
  if (s.N * s.F == 0) return;
  with_kind(kind, [&](auto k) {
    constexpr GluKind K = decltype(k)::value;
    dispatch_float(s.dt, "[glu_forward] inp", [&](auto tag) {
      using T = decltype(tag);
      constexpr int V = kVec<T>;
      cudaStream_t st = ctx.compute_stream();
      if (aligned16(out.raw()) && aligned16(inp.raw()) && s.F % V == 0) {
        glu_forward_kernel<T, K, V><<<grid_for(s.N * (s.F / V)), kThreads, 0, st>>>(ptr<T>(out), cptr<T>(inp), s.N,
                                                                                   s.F);
      } else {
        glu_forward_kernel<T, K, 1><<<grid_for(s.N * s.F), kThreads, 0, st>>>(ptr<T>(out), cptr<T>(inp), s.N, s.F);
      }
      LOOM_CUDA_LAUNCH_CHECK();
    });
  });
}

void glu_backward(const CudaContext& ctx, TensorView dinp, TensorView inp, TensorView dout, GluKind kind) {
  const GluShape s = glu_shape(inp);
  if (s.N * s.F == 0) return;
  with_kind(kind, [&](auto k) {
    constexpr GluKind K = decltype(k)::value;
    dispatch_float(s.dt, "[glu_backward] inp", [&](auto tag) {
      using T = decltype(tag);
      constexpr int V = kVec<T>;
      cudaStream_t st = ctx.compute_stream();
      if (aligned16(dinp.raw()) && aligned16(inp.raw()) && aligned16(dout.raw()) && s.F % V == 0) {
        glu_backward_kernel<T, K, V><<<grid_for(s.N * (s.F / V)), kThreads, 0, st>>>(ptr<T>(dinp), cptr<T>(inp),
                                                                                    cptr<T>(dout), s.N, s.F);
      } else {
        glu_backward_kernel<T, K, 1><<<grid_for(s.N * s.F), kThreads, 0, st>>>(ptr<T>(dinp), cptr<T>(inp),
                                                                              cptr<T>(dout), s.N, s.F);
      }
      LOOM_CUDA_LAUNCH_CHECK();
    });
  });
}

}  // namespace loom::cuda
