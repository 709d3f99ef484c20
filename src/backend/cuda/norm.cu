// LayerNorm / RMSNorm kernels (launchers declared in norm.cuh; CPU twins in src/backend/cpu/norm.cpp and
// rmsnorm.cpp).
//
// Work split: a row of C <= kMaxWarpC gets one warp (several rows per block), a wider row gets a whole
// block. The row is cut into 16-byte chunks (4 f32 or 8 bf16/f16 elements); thread t of the row's group
// owns chunks t, t + G, t + 2G, ... (G = 32 or blockDim). Chunks are loaded with one 16-byte access when
// every pointer is 16-byte aligned and C is a multiple of the chunk, else element by element — the
// ownership and the per-thread summation order are the same either way, so the statistics depend on C
// alone: a recomputed forward, or the fused residual forward (which normalises the residual as stored),
// reproduces the unfused forward bit for bit wherever its buffers live.
//
// Forward: the row is read once (a and b once in the fused form) into an f32 shared-memory cache, each
// thread re-reading only the elements it wrote (so the cache needs no barrier); rows too wide for shared
// memory re-read global memory instead. Statistics are two-pass (mean, then centred variance) as on the CPU.
//
// Backward: dinp ACCUMULATES. Parameter gradients are deterministic without float atomics: the rows are cut
// into nblocks contiguous ranges (a function of N and C only); each CUDA block accumulates f32 column sums
// of its range (per warp in shared memory, warps combined in warp order; or per block, in shared memory or,
// when C is too wide, in the block's own slice of the partials buffer), writes them to an (nblocks, K, C)
// f32 scratch buffer, and a second kernel adds the partials of each column in block order (f64) into
// dweight / dbias, rounding old value + sum once, in the gradient's dtype.
#include "backend/cuda/norm.cuh"

#include <algorithm>
#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/vec_io.cuh"

namespace loom::cuda {

namespace {

constexpr int64_t kMaxWarpC = 1024;       // rows up to this width get one warp each
constexpr int kFwdWarpsPerBlock = 8;      // rows per block in the forward's warp mode
constexpr int64_t kWideBlockC = 4096;     // block mode: 512 threads above this width, else 256
constexpr size_t kStaticSmemSlack = 1024;  // room for the kernels' static shared memory
constexpr size_t kDefaultSmem = 48 * 1024 - kStaticSmemSlack;  // dynamic bytes usable without opt-in
// Backward parameter partials: at least this many rows per block, at most this many blocks and floats.
constexpr int64_t kMinRowsPerBlock = 8;
constexpr int64_t kMaxPartialBlocks = 1024;
constexpr int64_t kMinPartialBlocks = 64;
constexpr int64_t kMaxPartialFloats = int64_t(1) << 22;  // 16 MiB of scratch

template <bool kWarpRows>
__device__ __forceinline__ float group_sum(float v, float* red) {
  if constexpr (kWarpRows) {
    return warp_sum(v);
  } else {
    return block_sum(v, red);
  }
}

// ---- forward ----------------------------------------------------------------------------------------
// x: the row source (inp, or residual in the fused form, where a and b are given and residual is written
// first). cached: the dynamic shared memory holds one f32 row per group.
template <typename T, bool kWarpRows, bool kVec, bool kRms>
__global__ void norm_forward_kernel(T* out, float* mean, float* rstd, const T* x, T* residual, const T* a,
                                    const T* b, const T* weight, const T* bias, int64_t N, int64_t C, float eps,
                                    bool cached) {
  constexpr int V = kChunk<T>;
  extern __shared__ float smem[];
  __shared__ float red[32];
  const int G = kWarpRows ? 32 : int(blockDim.x);
  const int tid = kWarpRows ? int(threadIdx.x % 32) : int(threadIdx.x);
  const int groups = kWarpRows ? int(blockDim.x / 32) : 1;
  const int group = kWarpRows ? int(threadIdx.x / 32) : 0;
  float* cache = cached ? smem + int64_t(group) * C : nullptr;
  const int64_t nchunks = (C + V - 1) / V;
  const float inv_c = 1.0f / float(C);

  // The row chunk at c0 as f32: from the cache (written by this same thread) or from x.
  auto row_chunk = [&](int64_t off, int64_t c0, int n, float (&v)[V]) {
    if (cache) {
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = i < n ? cache[c0 + i] : 0.0f;
    } else {
      load_chunk<V, kVec>(x + off + c0, n, v);
    }
  };

  for (int64_t r = int64_t(blockIdx.x) * groups + group; r < N; r += int64_t(gridDim.x) * groups) {
    const int64_t off = r * C;
    float s1 = 0.0f;
    for (int64_t j = tid; j < nchunks; j += G) {
      const int64_t c0 = j * V;
      const int n = int(min(int64_t(V), C - c0));
      float v[V];
      if (a != nullptr) {
        float vb[V];
        load_chunk<V, kVec>(a + off + c0, n, v);
        load_chunk<V, kVec>(b + off + c0, n, vb);
#pragma unroll
        for (int i = 0; i < V; ++i) v[i] += vb[i];
        store_chunk<V, kVec>(residual + off + c0, n, v);
        // Normalise the residual as stored (rounded), as residual_forward + the norm would.
#pragma unroll
        for (int i = 0; i < V; ++i) v[i] = load(store<T>(v[i]));
      } else {
        load_chunk<V, kVec>(x + off + c0, n, v);
      }
      if (cache) {
#pragma unroll
        for (int i = 0; i < V; ++i)
          if (i < n) cache[c0 + i] = v[i];
      }
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (i < n) s1 += kRms ? v[i] * v[i] : v[i];
    }
    s1 = group_sum<kWarpRows>(s1, red);

    float m = 0.0f, s;
    if constexpr (kRms) {
      s = 1.0f / sqrtf(s1 / float(C) + eps);
    } else {
      m = s1 * inv_c;
      float s2 = 0.0f;
      for (int64_t j = tid; j < nchunks; j += G) {
        const int64_t c0 = j * V;
        const int n = int(min(int64_t(V), C - c0));
        float v[V];
        row_chunk(off, c0, n, v);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float d = v[i] - m;
          if (i < n) s2 += d * d;
        }
      }
      const float var = group_sum<kWarpRows>(s2, red) * inv_c;
      s = 1.0f / sqrtf(var + eps);
    }

    for (int64_t j = tid; j < nchunks; j += G) {
      const int64_t c0 = j * V;
      const int n = int(min(int64_t(V), C - c0));
      float v[V], w[V], o[V];
      row_chunk(off, c0, n, v);
      load_chunk<V, kVec>(weight + c0, n, w);
      if constexpr (kRms) {
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = v[i] * s * w[i];
      } else if (bias != nullptr) {
        float bb[V];
        load_chunk<V, kVec>(bias + c0, n, bb);
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = (v[i] - m) * s * w[i] + bb[i];
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = (v[i] - m) * s * w[i];
      }
      store_chunk<V, kVec>(out + off + c0, n, o);
    }
    if (tid == 0) {
      if (mean) mean[r] = m;
      if (rstd) rstd[r] = s;
    }
  }
}

// ---- backward ---------------------------------------------------------------------------------------
// Block blockIdx.x handles rows [blockIdx.x * rows_per_block, +rows_per_block). partials (nblocks, K, C) f32
// or null (no parameter gradients); K = 1 (RMSNorm: dweight) or 2 (LayerNorm: dweight, dbias).
template <typename T, bool kWarpRows, bool kVec, bool kRms>
__global__ void norm_backward_kernel(T* dinp, float* partials, const T* dout, const T* x, const T* weight,
                                     const float* mean, const float* rstd, int64_t N, int64_t C,
                                     int64_t rows_per_block, bool acc_in_smem) {
  constexpr int V = kChunk<T>;
  constexpr int K = kRms ? 1 : 2;
  extern __shared__ float smem[];
  __shared__ float red[32];
  const int G = kWarpRows ? 32 : int(blockDim.x);
  const int tid = kWarpRows ? int(threadIdx.x % 32) : int(threadIdx.x);
  const int groups = kWarpRows ? int(blockDim.x / 32) : 1;
  const int group = kWarpRows ? int(threadIdx.x / 32) : 0;
  const int64_t nchunks = (C + V - 1) / V;
  const float inv_c = 1.0f / float(C);
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(N, r0 + rows_per_block);
  float* const block_partial = partials ? partials + int64_t(blockIdx.x) * K * C : nullptr;

  // acc: this group's K x C column sums. Each thread only touches the columns of its own chunks.
  float* acc = nullptr;
  if (partials) {
    float* base = (kWarpRows || acc_in_smem) ? smem : block_partial;
    const int64_t total = (kWarpRows ? groups : 1) * K * C;
    for (int64_t c = threadIdx.x; c < total; c += blockDim.x) base[c] = 0.0f;
    __syncthreads();
    acc = base + (kWarpRows ? int64_t(group) * K * C : 0);
  }

  for (int64_t r = r0 + group; r < r1; r += groups) {
    const int64_t off = r * C;
    const float m = kRms ? 0.0f : mean[r];
    const float s = rstd[r];
    float g_mean = 0.0f, gn_mean = 0.0f;
    if (dinp) {
      float s1 = 0.0f, s2 = 0.0f;
      for (int64_t j = tid; j < nchunks; j += G) {
        const int64_t c0 = j * V;
        const int n = int(min(int64_t(V), C - c0));
        float xv[V], dy[V], w[V];
        load_chunk<V, kVec>(x + off + c0, n, xv);
        load_chunk<V, kVec>(dout + off + c0, n, dy);
        load_chunk<V, kVec>(weight + c0, n, w);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float wdy = w[i] * dy[i];
          if (i < n) {
            if constexpr (!kRms) s1 += wdy;
            s2 += wdy * ((xv[i] - m) * s);
          }
        }
      }
      if constexpr (!kRms) g_mean = group_sum<kWarpRows>(s1, red) * inv_c;
      gn_mean = group_sum<kWarpRows>(s2, red) * inv_c;
    }
    for (int64_t j = tid; j < nchunks; j += G) {
      const int64_t c0 = j * V;
      const int n = int(min(int64_t(V), C - c0));
      float xv[V], dy[V];
      load_chunk<V, kVec>(x + off + c0, n, xv);
      load_chunk<V, kVec>(dout + off + c0, n, dy);
      if (dinp) {
        float w[V], dx[V];
        load_chunk<V, kVec>(weight + c0, n, w);
        load_chunk<V, kVec>(dinp + off + c0, n, dx);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float norm = (xv[i] - m) * s;
          if constexpr (kRms) {
            dx[i] += (w[i] * dy[i] - norm * gn_mean) * s;
          } else {
            dx[i] += (w[i] * dy[i] - g_mean - norm * gn_mean) * s;
          }
        }
        store_chunk<V, kVec>(dinp + off + c0, n, dx);
      }
      if (acc) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          if (i < n) {
            acc[c0 + i] += dy[i] * ((xv[i] - m) * s);
            if constexpr (!kRms) acc[C + c0 + i] += dy[i];
          }
        }
      }
    }
  }

  if (partials && (kWarpRows || acc_in_smem)) {
    __syncthreads();
    const int64_t width = int64_t(K) * C;
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
      float t = smem[c];
      if constexpr (kWarpRows)
        for (int w = 1; w < groups; ++w) t += smem[int64_t(w) * width + c];
      block_partial[c] = t;
    }
  }
}

// grad[c] = round(grad[c] + Σ_blk partials[blk * stride + c]) with the sum in f64 (column_sum_fixed_order).
template <typename Gr>
__global__ void add_partials_kernel(Gr* grad, const float* partials, int64_t nblocks, int64_t stride, int64_t C) {
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const double sum = column_sum_fixed_order<double>(partials, nblocks, stride, c, C);
  if (threadIdx.y == 0 && c < C) grad[c] = store<Gr>(float(double(load(grad[c])) + sum));
}

// ---- host side --------------------------------------------------------------------------------------

// Lets `kernel` use `bytes` of dynamic shared memory; false when the device cannot give that much.
template <typename Kernel>
bool fit_smem(const CudaContext& ctx, Kernel kernel, size_t bytes) {
  if (bytes <= kDefaultSmem) return true;
  if (bytes + kStaticSmemSlack > size_t(ctx.props().sharedMemPerBlockOptin)) return false;
  LOOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  return true;
}

int block_threads(int64_t C) { return C > kWideBlockC ? 512 : 256; }

template <typename T>
const T* cp(TensorView t) { return t.defined() ? static_cast<const T*>(t.raw()) : nullptr; }
template <typename T>
T* mp(TensorView t) { return t.defined() ? static_cast<T*>(t.raw()) : nullptr; }

struct FwdArgs {
  TensorView out, mean, rstd, x, residual, a, b, weight, bias;
  float eps = 0;
  int64_t N = 0, C = 0;
  DType dt = DType::kF32;
};

// The forward of a call whose arguments the OpTable entry point has checked; x is the normalised row
// source (inp, or the fused op's residual).
FwdArgs forward_args(TensorView out, TensorView mean, TensorView rstd, TensorView x, TensorView weight,
                     TensorView bias, float eps) {
  FwdArgs f;
  f.dt = x.dtype();
  f.C = x.shape().cols();
  f.N = x.numel() / f.C;
  f.out = out;
  f.mean = mean;
  f.rstd = rstd;
  f.x = x;
  f.weight = weight;
  f.bias = bias;
  f.eps = eps;
  return f;
}

// The fused forward's residual = a + b: x is the residual, written as well as read.
void add_residual_inputs(FwdArgs& f, TensorView a, TensorView b) {
  f.residual = f.x;
  f.a = a;
  f.b = b;
}

template <typename T, bool kWarpRows, bool kVec, bool kRms>
void launch_forward(const CudaContext& ctx, const FwdArgs& f) {
  auto kernel = norm_forward_kernel<T, kWarpRows, kVec, kRms>;
  int threads;
  unsigned grid;
  size_t smem;
  if constexpr (kWarpRows) {
    threads = 32 * kFwdWarpsPerBlock;
    grid = unsigned(std::clamp<int64_t>((f.N + kFwdWarpsPerBlock - 1) / kFwdWarpsPerBlock, 1, kMaxGrid));
    smem = size_t(kFwdWarpsPerBlock) * size_t(f.C) * sizeof(float);
  } else {
    threads = block_threads(f.C);
    grid = unsigned(std::clamp<int64_t>(f.N, 1, kMaxGrid));
    smem = size_t(f.C) * sizeof(float);
  }
  const bool cached = fit_smem(ctx, kernel, smem);
  kernel<<<grid, threads, cached ? smem : 0, ctx.compute_stream()>>>(
      mp<T>(f.out), mp<float>(f.mean), mp<float>(f.rstd), cp<T>(f.x), mp<T>(f.residual), cp<T>(f.a), cp<T>(f.b),
      cp<T>(f.weight), cp<T>(f.bias), f.N, f.C, f.eps, cached);
  LOOM_CUDA_LAUNCH_CHECK();
}

template <bool kRms>
void run_forward(const CudaContext& ctx, const FwdArgs& f) {
  if (f.N == 0) return;
  dispatch_float(f.dt, "[norm] compute dtype", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = f.C % kChunk<T> == 0 && aligned16(f.out) && aligned16(f.x) && aligned16(f.residual) &&
                     aligned16(f.a) && aligned16(f.b) && aligned16(f.weight) && aligned16(f.bias);
    if (f.C <= kMaxWarpC) {
      if (vec) launch_forward<T, true, true, kRms>(ctx, f);
      else launch_forward<T, true, false, kRms>(ctx, f);
    } else {
      if (vec) launch_forward<T, false, true, kRms>(ctx, f);
      else launch_forward<T, false, false, kRms>(ctx, f);
    }
  });
}

struct BwdArgs {
  TensorView dinp, dweight, dbias, dout, inp, weight, mean, rstd;
  int64_t N = 0, C = 0;
  DType dt = DType::kF32;
};

BwdArgs backward_args(bool rms, TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                      TensorView inp, TensorView weight, TensorView mean, TensorView rstd) {
  BwdArgs g;
  g.dt = inp.dtype();
  g.C = inp.shape().cols();
  g.N = inp.numel() / g.C;
  g.dinp = dinp;
  g.dweight = dweight;
  g.dbias = dbias;
  g.dout = dout;
  g.inp = inp;
  g.weight = weight;
  g.mean = rms ? TensorView{} : mean;
  g.rstd = rstd;
  return g;
}

template <typename T, bool kWarpRows, bool kVec, bool kRms>
void launch_backward(const CudaContext& ctx, const BwdArgs& g, float* partials, int64_t rows_per_block,
                     int64_t nblocks) {
  constexpr int64_t K = kRms ? 1 : 2;
  auto kernel = norm_backward_kernel<T, kWarpRows, kVec, kRms>;
  int threads;
  size_t smem = 0;
  bool acc_in_smem = false;
  if constexpr (kWarpRows) {
    // 8 warps when their partials fit the default shared memory, else 4 (C <= kMaxWarpC: <= 32 KiB).
    const int warps = size_t(8 * K * g.C) * sizeof(float) <= kDefaultSmem ? 8 : 4;
    threads = 32 * warps;
    if (partials) smem = size_t(warps * K * g.C) * sizeof(float);
    acc_in_smem = partials != nullptr;
  } else {
    threads = block_threads(g.C);
    if (partials) {
      acc_in_smem = fit_smem(ctx, kernel, size_t(K * g.C) * sizeof(float));
      if (acc_in_smem) smem = size_t(K * g.C) * sizeof(float);
    }
  }
  kernel<<<unsigned(nblocks), threads, smem, ctx.compute_stream()>>>(
      mp<T>(g.dinp), partials, cp<T>(g.dout), cp<T>(g.inp), cp<T>(g.weight), cp<float>(g.mean), cp<float>(g.rstd),
      g.N, g.C, rows_per_block, acc_in_smem);
  LOOM_CUDA_LAUNCH_CHECK();
}

void add_partials(const CudaContext& ctx, TensorView grad, const float* partials, int64_t nblocks, int64_t stride,
                  int64_t C) {
  if (!grad.defined()) return;
  dispatch_float(grad.dtype(), "[norm] parameter gradient", [&](auto tag) {
    using Gr = decltype(tag);
    add_partials_kernel<Gr><<<unsigned((C + 31) / 32), dim3(32, kColumnSumLanes), 0, ctx.compute_stream()>>>(
        ptr<Gr>(grad), partials, nblocks, stride, C);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

template <bool kRms>
void run_backward(const CudaContext& ctx, const BwdArgs& g) {
  const bool params = g.dweight.defined() || g.dbias.defined();
  if (g.N == 0 || (!g.dinp.defined() && !params)) return;
  constexpr int64_t K = kRms ? 1 : 2;
  // The row split depends on N and C only, so the partials (and the gradients) do too.
  const int64_t max_blocks = std::clamp<int64_t>(kMaxPartialFloats / (K * g.C), kMinPartialBlocks, kMaxPartialBlocks);
  int64_t nblocks = std::min((g.N + kMinRowsPerBlock - 1) / kMinRowsPerBlock, max_blocks);
  const int64_t rows_per_block = (g.N + nblocks - 1) / nblocks;
  nblocks = (g.N + rows_per_block - 1) / rows_per_block;
  Tensor partial_buf;
  float* partials = nullptr;
  if (params) {
    partial_buf = scratch(ctx, Shape{nblocks * K * g.C}, DType::kF32);
    partials = partial_buf.data<float>();
  }
  dispatch_float(g.dt, "[norm] compute dtype", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = g.C % kChunk<T> == 0 && aligned16(g.dinp) && aligned16(g.dout) && aligned16(g.inp) &&
                     aligned16(g.weight);
    if (g.C <= kMaxWarpC) {
      if (vec) launch_backward<T, true, true, kRms>(ctx, g, partials, rows_per_block, nblocks);
      else launch_backward<T, true, false, kRms>(ctx, g, partials, rows_per_block, nblocks);
    } else {
      if (vec) launch_backward<T, false, true, kRms>(ctx, g, partials, rows_per_block, nblocks);
      else launch_backward<T, false, false, kRms>(ctx, g, partials, rows_per_block, nblocks);
    }
  });
  if (params) {
    add_partials(ctx, g.dweight, partials, nblocks, K * g.C, g.C);
    if constexpr (!kRms) add_partials(ctx, g.dbias, partials + g.C, nblocks, K * g.C, g.C);
  }
}

}  // namespace

void layernorm_forward(const CudaContext& ctx, TensorView out, TensorView mean, TensorView rstd, TensorView inp,
                       TensorView weight, TensorView bias, float eps) {
  run_forward<false>(ctx, forward_args(out, mean, rstd, inp, weight, bias, eps));
}

void residual_layernorm_forward(const CudaContext& ctx, TensorView residual, TensorView out, TensorView mean,
                                TensorView rstd, TensorView a, TensorView b, TensorView weight, TensorView bias,
                                float eps) {
  FwdArgs f = forward_args(out, mean, rstd, residual, weight, bias, eps);
  add_residual_inputs(f, a, b);
  run_forward<false>(ctx, f);
}

void layernorm_backward(const CudaContext& ctx, TensorView dinp, TensorView dweight, TensorView dbias,
                        TensorView dout, TensorView inp, TensorView weight, TensorView mean, TensorView rstd) {
  run_backward<false>(ctx, backward_args(false, dinp, dweight, dbias, dout, inp, weight, mean, rstd));
}

void rmsnorm_forward(const CudaContext& ctx, TensorView out, TensorView rstd, TensorView inp, TensorView weight,
                     float eps) {
  run_forward<true>(ctx, forward_args(out, {}, rstd, inp, weight, {}, eps));
}

void residual_rmsnorm_forward(const CudaContext& ctx, TensorView residual, TensorView out, TensorView rstd,
                              TensorView a, TensorView b, TensorView weight, float eps) {
  FwdArgs f = forward_args(out, {}, rstd, residual, weight, {}, eps);
  add_residual_inputs(f, a, b);
  run_forward<true>(ctx, f);
}

void rmsnorm_backward(const CudaContext& ctx, TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                      TensorView weight, TensorView rstd) {
  run_backward<true>(ctx, backward_args(true, dinp, dweight, {}, dout, inp, weight, {}, rstd));
}

}  // namespace loom::cuda
