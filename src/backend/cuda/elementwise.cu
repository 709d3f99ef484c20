// CUDA elementwise ops: residual add, GeLU forward/backward, bias add and the bias gradient (launchers in
// elementwise.cuh; CPU twins in src/backend/cpu/elementwise.cpp).
// Invariants:
//   - arithmetic in f32, each result rounded once to the output dtype (device_utils.cuh codecs = the CPU's);
//   - memory-bound maps move 16 bytes per thread per step when every pointer is 16-byte aligned (the tail
//     past the last full vector is done by the same kernel, scalar); otherwise a scalar grid-stride loop;
//   - an output may be the same buffer as an input (gelu_backward's dinp = dout): every thread reads all of
//     its elements before writing them, and no two threads touch the same element, so no __restrict__;
//   - GeLU is the CPU's formula, x · sigmoid(2u) = 0.5 x (1 + tanh(u)), with the accurate expf: it avoids
//     the cancellation of 1 + tanh(u) for large negative x and stays within f32 rounding of the CPU (the
//     math is in activations.cuh, shared with glu.cu's GeGLU);
//   - bias_backward sums each column in the CPU's order (f32 partials over blocks of cpu::kReduceBlockRows
//     rows, in row order, written to scratch; then f64 over the blocks in block order by one thread per
//     column), so it is deterministic without atomics and, for f32, bit-identical to the CPU.
#include <cstdint>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/activations.cuh"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/pack.cuh"

namespace loom::cuda {

namespace {

// ---- math ----------------------------------------------------------------------------------------------
struct AddFn {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct GeluFn {
  __device__ float operator()(float x) const { return gelu(x); }
};
struct GeluGradFn {
  __device__ float operator()(float x, float dy) const {
    const float u = kGeluK0 * (x + kGeluK1 * x * x * x);
    const float du = kGeluK0 * (1.0f + 3.0f * kGeluK1 * x * x);
    const SigmoidPair sg = sigmoid_pair(2.0f * u);
    return (sg.s + 2.0f * x * sg.s * sg.one_minus_s * du) * dy;
  }
};

// ---- kernels -------------------------------------------------------------------------------------------
template <int NIn, typename Fn, typename T>
__device__ __forceinline__ float call(const Fn& fn, T a, T b) {
  if constexpr (NIn == 1) return fn(load(a));
  else return fn(load(a), load(b));
}

// out[i] = fn(a[i]) or fn(a[i], b[i]); `vec`: all pointers 16-byte aligned (b ignored when NIn == 1).
template <typename T, int NIn, typename Fn>
__global__ void map_kernel(T* out, const T* a, const T* b, int64_t n, bool vec, Fn fn) {
  constexpr int V = kVec<T>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nv = vec ? n / V : 0;
  for (int64_t i = tid; i < nv; i += stride) {
    const Pack<T, V> pa = load_pack<T, V>(a + i * V);
    Pack<T, V> pb{};
    if constexpr (NIn == 2) pb = load_pack<T, V>(b + i * V);
    Pack<T, V> po;
#pragma unroll
    for (int j = 0; j < V; ++j) po.v[j] = store<T>(call<NIn>(fn, pa.v[j], pb.v[j]));
    store_pack<T, V>(out + i * V, po);
  }
  for (int64_t i = nv * V + tid; i < n; i += stride) {
    const T x = a[i];
    const T y = NIn == 2 ? b[i] : T{};
    out[i] = store<T>(call<NIn>(fn, x, y));
  }
}

// out (N, C) += bias (C), n = N * C. `vec`: out 16-byte aligned and C a multiple of the pack, so a pack never
// crosses a row.
template <typename T, typename TB>
__global__ void bias_add_kernel(T* out, const TB* bias, int64_t n, int64_t C, bool vec) {
  constexpr int V = kVec<T>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    const int64_t nv = n / V;
    for (int64_t i = tid; i < nv; i += stride) {
      const int64_t c0 = (i * V) % C;
      Pack<T, V> p = load_pack<T, V>(out + i * V);
#pragma unroll
      for (int j = 0; j < V; ++j) p.v[j] = store<T>(load(p.v[j]) + load(bias[c0 + j]));
      store_pack<T, V>(out + i * V, p);
    }
    return;
  }
  for (int64_t i = tid; i < n; i += stride) out[i] = store<T>(load(out[i]) + load(bias[i % C]));
}

constexpr int64_t kRows = cpu::kReduceBlockRows;

// part (nblk, C) f32: part[rb, c] = sum of dout[r, c] over the rows r of block rb, in row order from 0.0f.
// Consecutive threads take consecutive columns, so each row's loads are coalesced.
template <typename T>
__global__ void colsum_partials_kernel(float* part, const T* dout, int64_t N, int64_t C, int64_t nblk) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < nblk * C; g += stride) {
    const int64_t c = g % C, rb = g / C;
    const int64_t r0 = rb * kRows, r1 = min(N, r0 + kRows);
    const T* col = dout + c;
    float s = 0.0f;
#pragma unroll 8
    for (int64_t r = r0; r < r1; ++r) s += load(col[r * C]);
    part[g] = s;
  }
}

// dbias[c] = round(dbias[c] + sum over blocks of part[rb, c]) with the block sum and the add in f64.
template <typename TD>
__global__ void colsum_finish_kernel(TD* dbias, const float* part, int64_t C, int64_t nblk) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < C; c += stride) {
    double total = 0.0;
    for (int64_t rb = 0; rb < nblk; ++rb) total += double(part[rb * C + c]);
    dbias[c] = store<TD>(float(double(load(dbias[c])) + total));
  }
}

// ---- host helpers --------------------------------------------------------------------------------------
template <int NIn, typename Fn>
void launch_map(const CudaContext& ctx, DType dt, TensorView out, TensorView a, TensorView b, Fn fn,
                const char* what) {
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_float(dt, what, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = aligned16(out.raw()) && aligned16(a.raw()) && (NIn == 1 || aligned16(b.raw()));
    const int64_t work = vec ? (n + kVec<T> - 1) / kVec<T> : n;
    map_kernel<T, NIn><<<grid_for(work), kThreads, 0, ctx.compute_stream()>>>(
        ptr<T>(out), cptr<T>(a), NIn == 2 ? cptr<T>(b) : nullptr, n, vec, fn);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace

void residual_forward(const CudaContext& ctx, TensorView out, TensorView a, TensorView b) {
  launch_map<2>(ctx, out.dtype(), out, a, b, AddFn{}, "[residual_forward] out");
}

void gelu_forward(const CudaContext& ctx, TensorView out, TensorView inp) {
  launch_map<1>(ctx, out.dtype(), out, inp, TensorView(), GeluFn{}, "[gelu_forward] out");
}

void gelu_backward(const CudaContext& ctx, TensorView dinp, TensorView inp, TensorView dout) {
  launch_map<2>(ctx, dinp.dtype(), dinp, inp, dout, GeluGradFn{}, "[gelu_backward] dinp");
}

void bias_add_forward(const CudaContext& ctx, TensorView out, TensorView bias) {
  const DType dt = out.dtype();
  const int64_t C = bias.numel();
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_float(dt, "[bias_add_forward] out", [&](auto otag) {
    using T = decltype(otag);
    dispatch_float(bias.dtype(), "[bias_add_forward] bias", [&](auto btag) {
      using TB = decltype(btag);
      const bool vec = aligned16(out.raw()) && C % kVec<T> == 0;
      const int64_t work = vec ? n / kVec<T> : n;
      bias_add_kernel<T, TB><<<grid_for(work), kThreads, 0, ctx.compute_stream()>>>(ptr<T>(out), cptr<TB>(bias), n,
                                                                                    C, vec);
      LOOM_CUDA_LAUNCH_CHECK();
    });
  });
}

void bias_backward(const CudaContext& ctx, TensorView dbias, TensorView dout) {
  const DType dt = dout.dtype();
  const int64_t C = dbias.numel();
  const int64_t N = dout.numel() / C;
  if (N == 0) return;  // the CPU adds an f64 zero: dbias keeps its value
  const int64_t nblk = (N + kRows - 1) / kRows;
  Tensor part = scratch(ctx, Shape({nblk, C}), DType::kF32);  // (nblk, C)
  cudaStream_t s = ctx.compute_stream();
  dispatch_float(dt, "[bias_backward] dout", [&](auto tag) {
    using T = decltype(tag);
    colsum_partials_kernel<T><<<grid_for(nblk * C), kThreads, 0, s>>>(part.data<float>(), cptr<T>(dout), N, C, nblk);
    LOOM_CUDA_LAUNCH_CHECK();
  });
  dispatch_float(dbias.dtype(), "[bias_backward] dbias", [&](auto tag) {
    using TD = decltype(tag);
    colsum_finish_kernel<TD><<<grid_for(C), kThreads, 0, s>>>(ptr<TD>(dbias), part.data<float>(), C, nblk);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace loom::cuda
