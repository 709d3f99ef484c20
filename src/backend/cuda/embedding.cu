// Token + position embedding kernels (launchers declared in embedding.cuh; CPU twin in
// src/backend/cpu/embedding.cpp).
//
// Forward: a gather. Each thread writes one 16-byte chunk of an output row (4 f32 or 8 bf16/f16 elements;
// one vector access when every pointer is 16-byte aligned and C is a multiple of the chunk, else element
// by element), so neighbouring threads read neighbouring bytes of the same table row.
//
// Backward, deterministic without float atomics: the (id, flat token index) pairs are radix-sorted by id
// (cub::DeviceRadixSort is stable, so equal ids keep their token order); then the first entry of each run
// of equal ids owns that gradient row and, chunk by chunk, adds the run's dout rows to it in token order —
// an f32 accumulator started from the row's old value and rounded once, exactly the CPU's sum. No two
// threads write one element. dwpe without position_ids needs no sort: row t receives dout[b, t] for b in
// order. Bad ids are mapped to a sentinel key past the table, sorted to the end and skipped.
//
// Id checks: see embedding.cuh (device-side sticky flag, no host synchronisation in the ops).
#include "backend/cuda/embedding.cuh"

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/vec_io.cuh"

namespace loom::cuda {

namespace {

constexpr int kBadId = 1;  // flag bit: an out-of-range token or position id was seen

// Calls f(r, c0, n) for every chunk of `rows` rows of C elements of T: columns [c0, c0 + n) of row r, n < kChunk
// only at a row's end. Grid-stride over the flat chunk index, so neighbouring threads take neighbouring chunks.
template <typename T, typename F>
__device__ __forceinline__ void for_each_chunk(int64_t rows, int64_t C, F f) {
  constexpr int W = kChunk<T>;
  const int64_t nchunks = (C + W - 1) / W;
  const int64_t total = rows * nchunks;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / nchunks;
    const int64_t c0 = (idx - r * nchunks) * W;
    f(r, c0, int(min(int64_t(W), C - c0)));
  }
}

// out[i] = wte[tokens[i]] (+ wpe[pos]) for the BT rows i, one chunk per thread. pos = pos_ids[i] or i % seq.
template <typename T, bool kVec>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* wte, const T* wpe,
                                         const int32_t* pos_ids, int64_t BT, int64_t seq, int64_t C, int64_t V,
                                         int64_t maxpos, int* flag) {
  constexpr int W = kChunk<T>;
  for_each_chunk<T>(BT, C, [&](int64_t i, int64_t c0, int n) {
    const int64_t tok = tokens[i];
    bool ok = tok >= 0 && tok < V;
    int64_t pos = 0;
    if (wpe) {
      pos = pos_ids ? int64_t(pos_ids[i]) : i % seq;
      ok = ok && pos >= 0 && pos < maxpos;
    }
    T* orow = out + i * C + c0;
    if (!ok) {
      // A NaN row makes the loss NaN: the bad batch cannot pass unnoticed even if nobody reads the flag.
      if (c0 == 0) atomicOr(flag, kBadId);
      float v[W];
#pragma unroll
      for (int e = 0; e < W; ++e) v[e] = __int_as_float(0x7FC00000);
      store_chunk<W, kVec>(orow, n, v);
      return;
    }
    const T* trow = wte + tok * C + c0;
    if (wpe) {
      float te[W], pe[W];
      load_chunk<W, kVec>(trow, n, te);
      load_chunk<W, kVec>(wpe + pos * C + c0, n, pe);
#pragma unroll
      for (int e = 0; e < W; ++e) te[e] += pe[e];
      store_chunk<W, kVec>(orow, n, te);
    } else if constexpr (kVec) {  // a copy of the stored bits, as the CPU's
      *reinterpret_cast<uint4*>(orow) = *reinterpret_cast<const uint4*>(trow);
    } else {
      for (int e = 0; e < n; ++e) orow[e] = trow[e];
    }
  });
}

// keys[i] = ids[i] when in [0, limit), else limit (sorted last, skipped); vals[i] = i.
__global__ void sort_keys_kernel(uint32_t* keys, int32_t* vals, const int32_t* ids, int64_t BT, int64_t limit,
                                 int* flag) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < BT; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = ids[i];
    const bool ok = id >= 0 && id < limit;
    if (!ok) atomicOr(flag, kBadId);
    keys[i] = uint32_t(ok ? id : limit);
    vals[i] = int32_t(i);
  }
}

// grad[key] += Σ dout[rows[k]] over each run of equal keys in sorted order; the run's first entry owns it.
template <typename T, typename Gr, bool kVec>
__global__ void scatter_runs_kernel(Gr* grad, const T* dout, const uint32_t* keys, const int32_t* rows, int64_t BT,
                                    int64_t C, uint32_t limit) {
  constexpr int W = kChunk<T>;
  for_each_chunk<T>(BT, C, [&](int64_t i, int64_t c0, int n) {
    const uint32_t key = keys[i];
    if (key == limit || (i > 0 && keys[i - 1] == key)) return;
    Gr* grow = grad + int64_t(key) * C + c0;
    float acc[W];
    load_chunk<W, kVec>(grow, n, acc);
    for (int64_t k = i; k < BT && keys[k] == key; ++k) {
      float y[W];
      load_chunk<W, kVec>(dout + int64_t(rows[k]) * C + c0, n, y);
#pragma unroll
      for (int e = 0; e < W; ++e) acc[e] += y[e];
    }
    store_chunk<W, kVec>(grow, n, acc);
  });
}

// grad[t] += Σ_b dout[b, t] in b order (positions t, no position_ids).
template <typename T, typename Gr, bool kVec>
__global__ void scatter_positions_kernel(Gr* grad, const T* dout, int64_t B, int64_t seq, int64_t C) {
  constexpr int W = kChunk<T>;
  for_each_chunk<T>(seq, C, [&](int64_t t, int64_t c0, int n) {
    Gr* grow = grad + t * C + c0;
    float acc[W];
    load_chunk<W, kVec>(grow, n, acc);
    for (int64_t b = 0; b < B; ++b) {
      float y[W];
      load_chunk<W, kVec>(dout + (b * seq + t) * C + c0, n, y);
#pragma unroll
      for (int e = 0; e < W; ++e) acc[e] += y[e];
    }
    store_chunk<W, kVec>(grow, n, acc);
  });
}

// ---- host side --------------------------------------------------------------------------------------

// The sticky bad-id flag of a device: one int, allocated once and kept for the life of the process.
int* error_flag(const CudaContext& ctx) {
  static std::mutex mu;
  static std::unordered_map<int, int*> flags;
  std::lock_guard<std::mutex> lock(mu);
  int*& f = flags[ctx.index()];
  if (f == nullptr) {
    void* p = nullptr;
    LOOM_CUDA_CHECK(cudaMalloc(&p, sizeof(int)));
    LOOM_CUDA_CHECK(cudaMemsetAsync(p, 0, sizeof(int), ctx.compute_stream()));
    f = static_cast<int*>(p);
  }
  return f;
}

struct EmbShape {
  int64_t B = 0, T = 0, C = 0, V = 0, maxpos = 0;
};

// The shapes of a call whose arguments the OpTable entry point has checked (the id values are checked by the
// kernels). The kernels index tokens and table rows with 32-bit integers (the radix sort keys and rows are
// 32-bit), a limit of this backend only, so it is checked here.
EmbShape embedding_shape(const char* op, TensorView tokens, TensorView table, const char* table_name, TensorView pos,
                         const char* pos_name) {
  EmbShape s;
  s.V = table.size(0);
  s.C = table.size(1);
  s.T = tokens.shape().cols();
  s.B = s.T == 0 ? 0 : tokens.numel() / s.T;
  LOOM_CHECK(s.B * s.T <= std::numeric_limits<int32_t>::max(), "[", op, "] at most 2^31 - 1 tokens per call, got ",
             tokens.desc());
  LOOM_CHECK(s.V <= std::numeric_limits<int32_t>::max(), "[", op, "] at most 2^31 - 1 rows in ", table_name,
             ", got ", table.desc());
  if (pos.defined()) {
    s.maxpos = pos.size(0);
    LOOM_CHECK(s.maxpos <= std::numeric_limits<int32_t>::max(), "[", op, "] at most 2^31 - 1 rows in ", pos_name,
               ", got ", pos.desc());
  }
  return s;
}

// Sorted (key, row) pairs of ids (BT) with bad ids mapped to `limit`; returns the scratch tensors.
struct SortedIds {
  Tensor keys, rows;
};
SortedIds sort_ids(const CudaContext& ctx, const int32_t* ids, int64_t BT, int64_t limit) {
  cudaStream_t stream = ctx.compute_stream();
  Tensor keys_in = scratch(ctx, Shape{BT}, DType::kI32), rows_in = scratch(ctx, Shape{BT}, DType::kI32);
  SortedIds out{scratch(ctx, Shape{BT}, DType::kI32), scratch(ctx, Shape{BT}, DType::kI32)};
  uint32_t* kin = static_cast<uint32_t*>(keys_in.raw());
  uint32_t* kout = static_cast<uint32_t*>(out.keys.raw());
  int32_t* rin = rows_in.data<int32_t>();
  int32_t* rout = out.rows.data<int32_t>();
  sort_keys_kernel<<<grid_for(BT), kThreads, 0, stream>>>(kin, rin, ids, BT, limit, error_flag(ctx));
  LOOM_CUDA_LAUNCH_CHECK();
  // Only the bits that can be set (limit included) take part in the sort.
  const int end_bit = std::max(1, int(std::bit_width(uint64_t(limit))));
  const int n = int(BT);
  size_t temp_bytes = 0;
  LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, kin, kout, rin, rout, n, 0, end_bit, stream));
  Tensor temp = scratch(ctx, Shape{std::max<int64_t>(1, int64_t((temp_bytes + 7) / 8))}, DType::kI64);
  LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw(), temp_bytes, kin, kout, rin, rout, n, 0, end_bit, stream));
  return out;
}

// Calls f(Gr{}) with Gr the storage type of a gradient of dtype gdt (f32 or the compute dtype T).
template <typename T, typename F>
void with_grad_type(DType gdt, F&& f) {
  if (gdt == DType::kF32) f(float{});
  else f(T{});
}

template <typename T>
void scatter_ids(const CudaContext& ctx, TensorView grad, TensorView dout, const int32_t* ids, int64_t BT, int64_t C,
                 int64_t limit) {
  const SortedIds sorted = sort_ids(ctx, ids, BT, limit);
  const uint32_t* keys = static_cast<const uint32_t*>(sorted.keys.raw());
  const int32_t* rows = sorted.rows.data<int32_t>();
  const bool vec = C % kChunk<T> == 0 && aligned16(grad) && aligned16(dout);
  const int64_t work = BT * ((C + kChunk<T> - 1) / kChunk<T>);
  with_grad_type<T>(grad.dtype(), [&](auto gtag) {
    using Gr = decltype(gtag);
    auto kernel = vec ? scatter_runs_kernel<T, Gr, true> : scatter_runs_kernel<T, Gr, false>;
    kernel<<<grid_for(work), kThreads, 0, ctx.compute_stream()>>>(ptr<Gr>(grad), cptr<T>(dout), keys, rows, BT, C,
                                                                  uint32_t(limit));
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

template <typename T>
void scatter_positions(const CudaContext& ctx, TensorView grad, TensorView dout, int64_t B, int64_t seq, int64_t C) {
  const bool vec = C % kChunk<T> == 0 && aligned16(grad) && aligned16(dout);
  const int64_t work = seq * ((C + kChunk<T> - 1) / kChunk<T>);
  with_grad_type<T>(grad.dtype(), [&](auto gtag) {
    using Gr = decltype(gtag);
    auto kernel = vec ? scatter_positions_kernel<T, Gr, true> : scatter_positions_kernel<T, Gr, false>;
    kernel<<<grid_for(work), kThreads, 0, ctx.compute_stream()>>>(ptr<Gr>(grad), cptr<T>(dout), B, seq, C);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace

void embedding_forward(const CudaContext& ctx, TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                       TensorView position_ids) {
  const EmbShape s = embedding_shape("embedding_forward", tokens, wte, "wte", wpe, "wpe");
  const DType dt = wte.dtype();
  const int64_t BT = s.B * s.T;
  if (BT == 0 || s.C == 0) return;
  int* flag = error_flag(ctx);
  dispatch_float(dt, "[embedding_forward] wte", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = s.C % kChunk<T> == 0 && aligned16(out) && aligned16(wte) && aligned16(wpe);
    const int64_t work = BT * ((s.C + kChunk<T> - 1) / kChunk<T>);
    auto kernel = vec ? embedding_forward_kernel<T, true> : embedding_forward_kernel<T, false>;
    const int32_t* pid = (wpe.defined() && position_ids.defined()) ? cptr<int32_t>(position_ids) : nullptr;
    kernel<<<grid_for(work), kThreads, 0, ctx.compute_stream()>>>(ptr<T>(out), cptr<int32_t>(tokens), cptr<T>(wte),
                                                                  wpe.defined() ? cptr<T>(wpe) : nullptr, pid, BT, s.T,
                                                                  s.C, s.V, s.maxpos, flag);
    LOOM_CUDA_LAUNCH_CHECK();
  });
}

void embedding_backward(const CudaContext& ctx, TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                        TensorView position_ids) {
  const EmbShape s = embedding_shape("embedding_backward", tokens, dwte, "dwte", dwpe, "dwpe");
  const DType dt = dout.dtype();
  const int64_t BT = s.B * s.T;
  if (BT == 0 || s.C == 0) return;
  dispatch_float(dt, "[embedding_backward] dout", [&](auto tag) {
    using T = decltype(tag);
    scatter_ids<T>(ctx, dwte, dout, cptr<int32_t>(tokens), BT, s.C, s.V);
    if (!dwpe.defined()) return;
    if (position_ids.defined()) {
      scatter_ids<T>(ctx, dwpe, dout, cptr<int32_t>(position_ids), BT, s.C, s.maxpos);
    } else {
      scatter_positions<T>(ctx, dwpe, dout, s.B, s.T, s.C);
    }
  });
}

bool embedding_take_error(const CudaContext& ctx) {
  int* flag = error_flag(ctx);
  int host = 0;
  cudaStream_t stream = ctx.compute_stream();
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host != 0;
}

}  // namespace loom::cuda
