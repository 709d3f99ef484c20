// Fused softmax cross-entropy on the GPU: one block per row (rows beyond the grid loop), dlogits written in
// place over the logits, so no second N x Vp buffer exists.
//
// Per row of V real columns (padding [V, Vp) is never read):
//   pass 1: each thread keeps an online (max m, sum s of exp(x - m)) over its chunks — W = 16 / sizeof(T)
//           consecutive columns, chunk c to thread c mod blockDim — rescaling s once per chunk when the
//           max grows; the block merges the pairs with a fixed xor-butterfly whose merge is commutative to
//           the bit (explicitly rounded products, no FMA), so every thread ends with the same (M, S);
//   loss  = M + log(S) - x[target], in f64 from the f32 (M, S) (the CPU sums in f64 too);
//   pass 2: (backward only) dlogits_j = exp(x_j - M) * (coef / S), minus coef at the target, stored in the
//           logits' dtype (RNE); padding columns get 0. The second read of the row mostly hits L2.
// A chunk is read with one 16-byte load when every row is 16-byte aligned (base and row pitch) and with W
// scalar loads otherwise, in the same order, so results do not depend on alignment; the block width is a
// function of V and the dtype only. No atomics touch a result: output bits are fixed run to run.
//
// Targets are checked by a small kernel before the main one (the CPU raises "before any work"): it records
// the first offending row with an integer atomicMin (order-independent), one 8-byte copy comes back to a
// pinned slot, and the launcher throws the CPU's message when a row is bad. That is the op's only host sync.
#include "backend/cuda/cross_entropy.cuh"

#include <climits>
#include <cmath>
#include <cstring>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/host_readback.cuh"

namespace loom::cuda {

namespace {

constexpr int kCeMaxThreads = 1024;
constexpr int64_t kCeMaxGrid = int64_t(1) << 30;
constexpr unsigned long long kNoBadRow = ~0ull;

__global__ void ce_check_targets_kernel(const int32_t* __restrict__ targets, const float* __restrict__ mask,
                                        int64_t N, int64_t V, unsigned long long* __restrict__ bad_row) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    const bool masked_out = mask != nullptr && mask[n] == 0.0f;
    const int32_t t = targets[n];
    if (!masked_out && (t < 0 || int64_t(t) >= V)) atomicMin(bad_row, (unsigned long long)n);
  }
}

// Merges (m2, s2) into (m, s): the same bits whichever side is which, so butterfly partners agree.
__device__ __forceinline__ void merge_max_sum(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;  // both empty (or all -inf): nothing to add, and no inf - inf
  s = __fadd_rn(__fmul_rn(s, expf(m - mn)), __fmul_rn(s2, expf(m2 - mn)));
  m = mn;
}

// Block-wide merge; every thread returns with the same (m, s). sm_m/sm_s hold 32 floats each; the first
// barrier keeps a previous call's readers ahead of this call's writers.
__device__ __forceinline__ void block_max_sum(float& m, float& s, float* sm_m, float* sm_s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o);
    const float s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
    merge_max_sum(m, s, m2, s2);
  }
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32, nw = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) {
    sm_m[wid] = m;
    sm_s[wid] = s;
  }
  __syncthreads();
  m = lane < nw ? sm_m[lane] : -INFINITY;
  s = lane < nw ? sm_s[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o);
    const float s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
    merge_max_sum(m, s, m2, s2);
  }
}

// W columns starting at column c*W of row x, as f32 (count valid ones; the rest are -inf).
template <typename T, int W>
__device__ __forceinline__ void load_cols(const T* x, int64_t c, int64_t V, bool vec, float (&v)[W], int& count) {
  if (vec && (c + 1) * W <= V) {
    const uint4 raw = *(reinterpret_cast<const uint4*>(x) + c);
    T e[W];
    memcpy(&e, &raw, 16);
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = load(e[j]);
    count = W;
    return;
  }
  count = int(min(int64_t(W), V - c * W));
#pragma unroll
  for (int j = 0; j < W; ++j) v[j] = j < count ? load(x[c * W + j]) : -INFINITY;
}

template <typename T>
__global__ void __launch_bounds__(kCeMaxThreads)
    ce_forward_backward_kernel(T* __restrict__ logits, const int32_t* __restrict__ targets,
                               const float* __restrict__ mask, float* __restrict__ losses, int64_t N, int64_t V,
                               int64_t Vp, bool vec, bool backward, float dlogits_scale) {
  constexpr int W = int(16 / sizeof(T));
  __shared__ float sm_m[32], sm_s[32];
  const int64_t chunks = (V + W - 1) / W;
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    T* x = logits + row * Vp;
    const int32_t t = targets[row];
    const bool valid = t >= 0 && int64_t(t) < V;  // an invalid target was checked to be masked out
    const float coef = valid ? dlogits_scale * (mask != nullptr ? mask[row] : 1.0f) : 0.0f;
    float M = -INFINITY, S = 0.0f;
    if (valid) {
      // Read by the thread that writes the loss, before the barriers that precede any write to the row.
      const float x_t = threadIdx.x == 0 ? load(x[t]) : 0.0f;
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[W];
        int count;
        load_cols<T, W>(x, c, V, vec, v, count);
        float cm = -INFINITY;
#pragma unroll
        for (int j = 0; j < W; ++j) cm = fmaxf(cm, v[j]);
        if (cm == -INFINITY) continue;  // nothing to add (and no -inf - -inf)
        if (cm > M) {
          S = __fmul_rn(S, expf(M - cm));
          M = cm;
        }
        float e = 0.0f;
#pragma unroll
        for (int j = 0; j < W; ++j) e += expf(v[j] - M);  // -inf padding lanes add 0
        S += e;
      }
      block_max_sum(M, S, sm_m, sm_s);
      if (threadIdx.x == 0) losses[row] = float(double(M) + log(double(S)) - double(x_t));
    } else if (threadIdx.x == 0) {
      losses[row] = 0.0f;
    }
    if (!backward) continue;
    // The whole row [0, Vp) in chunks of W: real columns get the gradient, padding 0.
    const int64_t all_chunks = (Vp + W - 1) / W;
    const float inv = coef != 0.0f ? float(double(coef) / double(S)) : 0.0f;
    for (int64_t c = threadIdx.x; c < all_chunks; c += blockDim.x) {
      const int64_t j0 = c * W;
      float d[W];
      if (coef == 0.0f) {
#pragma unroll
        for (int j = 0; j < W; ++j) d[j] = 0.0f;
      } else {
        float v[W];
        int count;
        load_cols<T, W>(x, c, V, vec && (c + 1) * W <= V, v, count);
#pragma unroll
        for (int j = 0; j < W; ++j) {
          float g = j < count ? __fmul_rn(expf(v[j] - M), inv) : 0.0f;
          if (j0 + j == t) g = __fsub_rn(g, coef);
          d[j] = g;
        }
      }
      if (vec) {  // Vp is a multiple of W here, so every chunk of the row is whole
        T e[W];
#pragma unroll
        for (int j = 0; j < W; ++j) e[j] = store<T>(d[j]);
        uint4 raw;
        memcpy(&raw, &e, 16);
        *(reinterpret_cast<uint4*>(x) + c) = raw;
      } else {
        const int n_here = int(min(int64_t(W), Vp - j0));
#pragma unroll
        for (int j = 0; j < W; ++j)
          if (j < n_here) x[j0 + j] = store<T>(d[j]);
      }
    }
  }
}

// Threads per row: enough for one chunk each up to 1024, a multiple of 32 (a function of V and W only).
int ce_threads(int64_t V, int W) {
  const int64_t chunks = (V + W - 1) / W;
  return int(std::clamp<int64_t>((chunks + 31) / 32 * 32, 32, kCeMaxThreads));
}

}  // namespace

void cross_entropy_forward_backward(const CudaContext& ctx, TensorView losses, TensorView logits,
                                    TensorView targets, int64_t vocab_size, TensorView loss_mask,
                                    float dlogits_scale) {
  const char* op = "cross_entropy_forward_backward";
  const int64_t Vp = logits.shape().cols();
  const int64_t V = vocab_size;
  const int64_t N = logits.numel() / Vp;
  const float* mask = loss_mask.defined() ? cptr<float>(loss_mask) : nullptr;
  if (N == 0) return;
  const cudaStream_t stream = ctx.compute_stream();
  const int32_t* tgt = cptr<int32_t>(targets);

  // Target check first; the logits are untouched if it fails. Shapes and dtypes were checked by the OpTable
  // entry point; the target values live on the device, so this backend checks them here (one sync).
  {
    Tensor bad = scratch(ctx, {1}, DType::kI64);
    auto* bad_row = static_cast<unsigned long long*>(bad.raw());
    LOOM_CUDA_CHECK(cudaMemsetAsync(bad_row, 0xFF, sizeof(unsigned long long), stream));
    ce_check_targets_kernel<<<grid_for(N), kThreads, 0, stream>>>(tgt, mask, N, V, bad_row);
    LOOM_CUDA_LAUNCH_CHECK();
    unsigned long long row = 0;
    std::memcpy(&row, read_back(ctx, bad_row, sizeof(row)), sizeof(row));
    if (row != kNoBadRow) {
      int32_t t = 0;  // the error path may sync again to name the offending value
      std::memcpy(&t, read_back(ctx, tgt + row, sizeof(int32_t)), sizeof(int32_t));
      LOOM_FAIL("[", op, "] target ", t, " of row ", row, " is outside the vocabulary [0, ", V,
                ") and the row is not masked out");
    }
  }

  const bool backward = dlogits_scale != 0.0f;
  const unsigned grid = unsigned(std::min<int64_t>(N, kCeMaxGrid));
  dispatch_float(logits.dtype(), "[cross_entropy_forward_backward] logits", [&](auto tag) {
    using T = decltype(tag);
    constexpr int W = int(16 / sizeof(T));
    // Vectorised only when every row starts 16-byte aligned (then Vp is a multiple of W).
    const bool vec = reinterpret_cast<uintptr_t>(logits.raw()) % 16 == 0 && (Vp * int64_t(sizeof(T))) % 16 == 0;
    ce_forward_backward_kernel<T><<<grid, ce_threads(V, W), 0, stream>>>(
        ptr<T>(logits), tgt, mask, ptr<float>(losses), N, V, Vp, vec, backward, dlogits_scale);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace loom::cuda
