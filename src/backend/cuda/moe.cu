// CUDA mixture-of-experts ops: token permutation into the expert-grouped order, the probability-weighted
// unpermutation, their backwards, and the grouped GEMM. CPU twin: src/backend/cpu/moe.cpp.
// Invariants:
//   - one thread owns one (token n, column c) element of every row it touches and walks the experts
//     e = 0..E-1 in order, so sums run in the CPU's order (f32, one rounding to the dtype) and no two
//     threads write the same element: no atomics, results independent of the launch shape;
//   - dprobs: one block per token; each <dout[n], inp[row]> is a block_sum of f32 per-thread partials
//     (fixed blockDim, fixed order), so it is deterministic but rounds differently from the CPU's f64 sum;
//   - row ids outside [0, M) are skipped (the bijection is the caller's guarantee; ops.h);
//   - grid-stride loops with int64 indices.
#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/matmul.cuh"
#include "backend/cuda/moe.cuh"

namespace loom::cuda {

namespace {

template <typename T>
__global__ void permute_forward_kernel(T* out, const T* inp, const int32_t* map, int64_t N, int64_t E, int64_t C,
                                       int64_t M) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C; i += stride) {
    const int64_t n = i / C, c = i - n * C;
    const T v = inp[i];
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r = map[n * E + e];
      if (r >= 0 && r < M) out[r * C + c] = v;
    }
  }
}

template <typename T>
__global__ void permute_backward_kernel(T* dinp, const T* dout, const int32_t* map, int64_t N, int64_t E, int64_t C,
                                        int64_t M) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C; i += stride) {
    const int64_t n = i / C, c = i - n * C;
    float acc = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r = map[n * E + e];
      if (r >= 0 && r < M) acc += load(dout[r * C + c]);
    }
    dinp[i] = store<T>(acc);
  }
}

template <typename T>
__global__ void unpermute_forward_kernel(T* out, const T* inp, const float* probs, const int32_t* map, int64_t N,
                                         int64_t E, int64_t C, int64_t M) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C; i += stride) {
    const int64_t n = i / C, c = i - n * C;
    float acc = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r = map[n * E + e];
      if (r >= 0 && r < M) acc += probs[n * E + e] * load(inp[r * C + c]);
    }
    out[i] = store<T>(acc);
  }
}

template <typename T>
__global__ void unpermute_backward_dinp_kernel(T* dinp, const T* dout, const float* probs, const int32_t* map,
                                               int64_t N, int64_t E, int64_t C, int64_t M) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C; i += stride) {
    const int64_t n = i / C, c = i - n * C;
    const float dy = load(dout[i]);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r = map[n * E + e];
      if (r >= 0 && r < M) dinp[r * C + c] = store<T>(probs[n * E + e] * dy);
    }
  }
}

// One block per token (grid-stride over tokens): dprobs[n, e] = <dout[n], inp[row]> or 0.
template <typename T>
__global__ void unpermute_backward_dprobs_kernel(float* dprobs, const T* dout, const T* inp, const int32_t* map,
                                                 int64_t N, int64_t E, int64_t C, int64_t M) {
  __shared__ float shared[32];
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r = map[n * E + e];
      if (r < 0 || r >= M) {
        if (threadIdx.x == 0) dprobs[n * E + e] = 0.0f;
        continue;
      }
      float part = 0.0f;
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) part += load(dout[n * C + c]) * load(inp[r * C + c]);
      const float dot = block_sum(part, shared);
      if (threadIdx.x == 0) dprobs[n * E + e] = dot;
    }
  }
}

struct PermDims {
  int64_t N, E, C, M;
};

PermDims dims(TensorView tokens, TensorView rows, TensorView row_id_map) {
  return {row_id_map.size(0), row_id_map.size(1), tokens.size(1), rows.size(0)};
}

}  // namespace

void moe_permute_forward(const CudaContext& ctx, TensorView out, TensorView inp, TensorView row_id_map) {
  const PermDims d = dims(inp, out, row_id_map);
  if (d.N * d.C == 0 || d.M == 0) return;
  dispatch_float(inp.dtype(), "[moe_permute_forward] inp", [&](auto tag) {
    using T = decltype(tag);
    permute_forward_kernel<T><<<grid_for(d.N * d.C), kThreads, 0, ctx.compute_stream()>>>(
        ptr<T>(out), cptr<T>(inp), cptr<int32_t>(row_id_map), d.N, d.E, d.C, d.M);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

void moe_permute_backward(const CudaContext& ctx, TensorView dinp, TensorView dout, TensorView row_id_map) {
  const PermDims d = dims(dinp, dout, row_id_map);
  if (d.N * d.C == 0) return;
  dispatch_float(dinp.dtype(), "[moe_permute_backward] dinp", [&](auto tag) {
    using T = decltype(tag);
    permute_backward_kernel<T><<<grid_for(d.N * d.C), kThreads, 0, ctx.compute_stream()>>>(
        ptr<T>(dinp), cptr<T>(dout), cptr<int32_t>(row_id_map), d.N, d.E, d.C, d.M);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

void moe_unpermute_forward(const CudaContext& ctx, TensorView out, TensorView inp, TensorView probs,
                           TensorView row_id_map) {
  const PermDims d = dims(out, inp, row_id_map);
  if (d.N * d.C == 0) return;
  dispatch_float(out.dtype(), "[moe_unpermute_forward] out", [&](auto tag) {
    using T = decltype(tag);
    unpermute_forward_kernel<T><<<grid_for(d.N * d.C), kThreads, 0, ctx.compute_stream()>>>(
        ptr<T>(out), cptr<T>(inp), cptr<float>(probs), cptr<int32_t>(row_id_map), d.N, d.E, d.C, d.M);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

void moe_unpermute_backward(const CudaContext& ctx, TensorView dinp, TensorView dprobs, TensorView dout,
                            TensorView inp, TensorView probs, TensorView row_id_map) {
  const PermDims d = dims(dout, dinp, row_id_map);
  if (d.N == 0) return;
  dispatch_float(dout.dtype(), "[moe_unpermute_backward] dout", [&](auto tag) {
    using T = decltype(tag);
    cudaStream_t st = ctx.compute_stream();
    if (d.C > 0 && d.M > 0) {
      unpermute_backward_dinp_kernel<T><<<grid_for(d.N * d.C), kThreads, 0, st>>>(
          ptr<T>(dinp), cptr<T>(dout), cptr<float>(probs), cptr<int32_t>(row_id_map), d.N, d.E, d.C, d.M);
      LOOM_CUDA_LAUNCH_CHECK();
    }
    if (dprobs.defined()) {
      unpermute_backward_dprobs_kernel<T><<<unsigned(std::min<int64_t>(d.N, kMaxGrid)), kThreads, 0, st>>>(
          ptr<float>(dprobs), cptr<T>(dout), cptr<T>(inp), cptr<int32_t>(row_id_map), d.N, d.E, d.C, d.M);
      LOOM_CUDA_LAUNCH_CHECK();
    }
  });
}

void grouped_matmul_forward(const CudaContext& ctx, TensorView out, TensorView inp, TensorView weight,
                            const std::vector<int64_t>& group_sizes) {
  const int64_t N = weight.size(1), K = weight.size(2);
  int64_t o = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    const int64_t m = group_sizes[g];
    if (m > 0)
      matmul_forward(ctx, out.slice_flat(o * N, {m, N}), inp.slice_flat(o * K, {m, K}),
                     weight.slice_flat(int64_t(g) * N * K, {N, K}), TensorView());
    o += m;
  }
}

void grouped_matmul_backward(const CudaContext& ctx, TensorView dinp, TensorView dweight, TensorView dout,
                             TensorView inp, TensorView weight, const std::vector<int64_t>& group_sizes,
                             GradWrite dweight_write) {
  const int64_t N = weight.size(1), K = weight.size(2);
  int64_t o = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    const int64_t m = group_sizes[g];
    const TensorView dw = dweight ? dweight.slice_flat(int64_t(g) * N * K, {N, K}) : TensorView();
    if (m > 0 || (dw && dweight_write == GradWrite::kOverwrite))  // an empty group's kOverwrite stores zeros
      matmul_backward(ctx, dinp && m > 0 ? dinp.slice_flat(o * K, {m, K}) : TensorView(), dw, TensorView(),
                      dout.slice_flat(o * N, {m, N}), inp.slice_flat(o * K, {m, K}),
                      weight.slice_flat(int64_t(g) * N * K, {N, K}), dweight_write);
    o += m;
  }
}

}  // namespace loom::cuda
