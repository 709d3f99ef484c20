// Device building blocks of the CUDA attention kernels (attention.cu): kernel argument structs, masks and
// dropout, tile staging (global -> shared, zero-padded head size), and the warp-level block products
// (WMMA tensor cores for 16-bit tiles, f32 FMA otherwise). Device code; included by attention.cu only, so
// its contents stay in that translation unit's anonymous namespace, exactly as if written there. The design
// of the kernels that use them is at the top of attention.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/device_utils.cuh"

namespace loom::cuda::attn_detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// ---- kernel arguments ---------------------------------------------------------------------------------

struct Geo {
  const void* q;
  const void* kv;
  int64_t q_stride, kv_stride, kv_g;  // elements per token row; query heads per group in kv's layout
  int64_t B, Tq, Tk, NH, G, HS;
  int HSP, ldE;  // padded head size; leading dim of the staged q/k/v/dO tiles (elements)
  int BQ, BK;    // query and key tile sizes
  float scale;
  bool causal;
  int64_t window;
  bool identity;  // positions are 0..T-1: tile skipping allowed
  const int32_t* q_pos;
  const int32_t* k_pos;
  const int32_t* q_seg;
  const int32_t* k_seg;
  bool dropout;
  uint64_t seed, stream, L;
  uint32_t threshold;
  float keep_scale;
  bool vec;  // 16-byte loads of 16-bit q/kv/dO rows are allowed

  __device__ int64_t q_col(int64_t h) const { return ((h / G) * (G + 2) + h % G) * HS; }
  __device__ int64_t k_col(int64_t g) const { return (g * (kv_g + 2) + kv_g) * HS; }
  __device__ int64_t v_col(int64_t g) const { return k_col(g) + HS; }
  __device__ int64_t qpos(int64_t i) const { return q_pos ? int64_t(q_pos[i]) : i; }
  __device__ int64_t kpos(int64_t j) const { return k_pos ? int64_t(k_pos[j]) : j; }
  __device__ bool visible(int64_t qp, int32_t qs, int64_t kp, int32_t ks) const {
    if (causal && kp > qp) return false;
    if (window > 0 && kp <= qp - window) return false;
    return !q_seg || qs == ks;
  }
  // Keys [begin, end) that queries [i0, i0 + nq) may see (whole-sequence op only).
  __device__ int64_t key_begin(int64_t i0) const {
    return identity && window > 0 ? (i0 - window + 1 > 0 ? i0 - window + 1 : 0) : 0;
  }
  __device__ int64_t key_end(int64_t i0, int64_t nq) const {
    return identity && causal ? (i0 + nq < Tk ? i0 + nq : Tk) : Tk;
  }
  // Queries [begin, end) that may see keys [j0, j0 + nk) (whole-sequence op only).
  __device__ int64_t query_begin(int64_t j0) const { return identity && causal ? j0 : 0; }
  __device__ int64_t query_end(int64_t j0, int64_t nk) const {
    return identity && window > 0 ? (j0 + nk - 1 + window < Tq ? j0 + nk - 1 + window : Tq) : Tq;
  }
  // True when the tile (queries [i0, i0+nq), keys [j0, j0+nk)) lies in different documents entirely
  // (non-decreasing segment ids: compare the ends). Uniform over the block.
  __device__ bool segments_disjoint(int64_t b, int64_t i0, int64_t nq, int64_t j0, int64_t nk) const {
    if (!identity || !q_seg) return false;
    const int32_t qf = q_seg[b * Tq + i0], ql = q_seg[b * Tq + i0 + nq - 1];
    const int32_t kf = k_seg[b * Tk + j0], kl = k_seg[b * Tk + j0 + nk - 1];
    return kl < qf || kf > ql;
  }
  __device__ uint64_t mask_row(int64_t b, int64_t h, int64_t qp) const {
    return (uint64_t(b * NH + h) * L + uint64_t(qp)) * L;
  }
};

// Dropout factor 1/(1-p) or 0 of mask index idx; consecutive indices share one Philox block, so a lane
// walking a row of keys draws one block per 4 entries.
struct DropoutRng {
  uint64_t block = ~uint64_t(0);
  Philox4 w{};
  __device__ float factor(const Geo& g, uint64_t idx) {
    const uint64_t blk = idx >> 2;
    if (blk != block) {
      w = philox4x32(g.seed, g.stream, blk);
      block = blk;
    }
    const uint32_t r = uint32_t(idx & 3);
    const uint32_t x = r == 0 ? w.w[0] : r == 1 ? w.w[1] : r == 2 ? w.w[2] : w.w[3];
    return x >= g.threshold ? g.keep_scale : 0.0f;
  }
};

// ---- shared-memory layouts (host and device agree on them) --------------------------------------------

struct Carve {
  size_t off = 0;
  __host__ __device__ size_t take(size_t bytes) {
    const size_t o = off;
    off = (off + bytes + 127) / 128 * 128;  // 128-byte aligned buffers (wmma needs 32)
    return o;
  }
};

__host__ __device__ inline int ld_tile(int hsp, int es) { return hsp + (es == 2 ? 8 : 1); }
__host__ __device__ inline int ld_f32(int n) { return n + 4; }
__host__ __device__ inline int ld_p(int n) { return n + 8; }

// Forward: Q (BQ x ldE), K, V (BK x ldE), S (BQ x ldS f32), P (BQ x ldP), O (BQ x ldO f32), key pos/seg.
struct FwdLayout {
  size_t q, k, v, s, p, o, kpos, kseg, bytes;
  __host__ __device__ FwdLayout(int BQ, int BK, int HSP, int es) {
    Carve c;
    const int ldE = ld_tile(HSP, es);
    q = c.take(size_t(BQ) * ldE * es);
    k = c.take(size_t(BK) * ldE * es);
    v = c.take(size_t(BK) * ldE * es);
    s = c.take(size_t(BQ) * ld_f32(BK) * 4);
    p = c.take(size_t(BQ) * ld_p(BK) * es);
    o = c.take(size_t(BQ) * ld_f32(HSP) * 4);
    kpos = c.take(size_t(BK) * 4);
    kseg = c.take(size_t(BK) * 4);
    bytes = c.off;
  }
};

// dK/dV: K, V (BK x ldE), Q, dO (BQ x ldE), S^T, dP^T (BK x ldS f32), (PZ)^T, dS^T (BK x ldP), dK, dV
// accumulators (BK x ldO f32), query pos/seg/lse/D (BQ).
struct DkdvLayout {
  size_t k, v, q, dout, st, dpt, pt, dst, dk, dv, qpos, qseg, lse, dd, bytes;
  __host__ __device__ DkdvLayout(int BQ, int BK, int HSP, int es) {
    Carve c;
    const int ldE = ld_tile(HSP, es);
    k = c.take(size_t(BK) * ldE * es);
    v = c.take(size_t(BK) * ldE * es);
    q = c.take(size_t(BQ) * ldE * es);
    dout = c.take(size_t(BQ) * ldE * es);
    st = c.take(size_t(BK) * ld_f32(BQ) * 4);
    dpt = c.take(size_t(BK) * ld_f32(BQ) * 4);
    pt = c.take(size_t(BK) * ld_p(BQ) * es);
    dst = c.take(size_t(BK) * ld_p(BQ) * es);
    dk = c.take(size_t(BK) * ld_f32(HSP) * 4);
    dv = c.take(size_t(BK) * ld_f32(HSP) * 4);
    qpos = c.take(size_t(BQ) * 4);
    qseg = c.take(size_t(BQ) * 4);
    lse = c.take(size_t(BQ) * 4);
    dd = c.take(size_t(BQ) * 4);
    bytes = c.off;
  }
};

// dQ: Q, dO (BQ x ldE), K, V (BK x ldE), S, dP (BQ x ldS f32), dS (BQ x ldP), dQ accumulator
// (BQ x ldO f32), key pos/seg (BK).
struct DqLayout {
  size_t q, dout, k, v, s, dp, ds, dq, kpos, kseg, bytes;
  __host__ __device__ DqLayout(int BQ, int BK, int HSP, int es) {
    Carve c;
    const int ldE = ld_tile(HSP, es);
    q = c.take(size_t(BQ) * ldE * es);
    dout = c.take(size_t(BQ) * ldE * es);
    k = c.take(size_t(BK) * ldE * es);
    v = c.take(size_t(BK) * ldE * es);
    s = c.take(size_t(BQ) * ld_f32(BK) * 4);
    dp = c.take(size_t(BQ) * ld_f32(BK) * 4);
    ds = c.take(size_t(BQ) * ld_p(BK) * es);
    dq = c.take(size_t(BQ) * ld_f32(HSP) * 4);
    kpos = c.take(size_t(BK) * 4);
    kseg = c.take(size_t(BK) * 4);
    bytes = c.off;
  }
};

// ---- element helpers ----------------------------------------------------------------------------------

template <typename E>
__device__ __forceinline__ E to_e(float x) {
  if constexpr (std::is_same_v<E, float>) return x;
  else return store<E>(x);
}
template <typename E>
__device__ __forceinline__ E zero_e() {
  if constexpr (std::is_same_v<E, float>) return 0.0f;
  else return E{0};
}
// A stored element widened (same type: copied bit for bit).
template <typename E, typename Src>
__device__ __forceinline__ E convert_e(Src x) {
  if constexpr (std::is_same_v<E, Src>) return x;
  else {
    static_assert(std::is_same_v<E, float>, "16-bit tiles are only staged from their own dtype");
    return load(x);
  }
}

// dst (nrows x HSP, leading dim ldd) = rows [0, nvalid) of src (rows ld elements apart, HS wide), zero
// elsewhere (padding columns and rows: the products then add exact zeros). All threads of the block.
template <typename E, typename Src>
__device__ void load_rows(E* dst, int ldd, const Src* src, int64_t ld, int64_t nvalid, int nrows, int HS, int HSP,
                          bool vec) {
  const int tid = threadIdx.x, nt = blockDim.x;
  if constexpr (std::is_same_v<E, Src> && sizeof(E) == 2) {
    if (vec) {  // HS % 8 == 0 and 16-byte aligned rows; ldd is a multiple of 8 elements
      const int cpr = HSP / 8;
      for (int e = tid; e < nrows * cpr; e += nt) {
        const int r = e / cpr, c = (e % cpr) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < nvalid && c < HS) v = *reinterpret_cast<const uint4*>(src + r * ld + c);
        *reinterpret_cast<uint4*>(dst + r * ldd + c) = v;
      }
      return;
    }
  }
  for (int e = tid; e < nrows * HSP; e += nt) {
    const int r = e / HSP, c = e % HSP;
    E v = zero_e<E>();
    if (r < nvalid && c < HS) v = convert_e<E>(src[r * ld + c]);
    dst[r * ldd + c] = v;
  }
}

__device__ void zero_f32(float* p, int rows, int cols, int ld) {
  for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) p[(e / cols) * ld + e % cols] = 0.0f;
}

// ---- the warp tile product ----------------------------------------------------------------------------

template <typename E>
struct Wmma;
template <>
struct Wmma<Bf16> {
  using type = __nv_bfloat16;
};
template <>
struct Wmma<F16> {
  using type = __half;
};

// One warp: C (16 x N, f32, leading dim ldc) = (accumulate ? C : 0) + A (16 x K, row-major, lda) * B, where
// B (K x N) is row-major with leading dim ldb, or (kBCol) the transpose of an N x K row-major matrix
// (B(k, n) = B[n*ldb + k]). N and K are multiples of 16. Callers __syncwarp() around it.
template <bool kBCol, typename E>
__device__ __forceinline__ void warp_mma(float* C, int ldc, const E* A, int lda, const E* B, int ldb, int N, int K,
                                         bool accumulate) {
  if constexpr (std::is_same_v<E, float>) {
    // Lanes own columns, all 16 rows each: A values are warp-wide broadcasts, B reads are conflict-free
    // (row-major: consecutive; transposed: ldb is odd for f32 tiles).
    const int lane = threadIdx.x % 32;
    for (int c0 = 0; c0 < N; c0 += 32) {
      const int c = c0 + lane;
      if (c >= N) continue;
      float acc[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) acc[r] = accumulate ? C[r * ldc + c] : 0.0f;
      for (int k = 0; k < K; ++k) {
        const float b = kBCol ? B[c * ldb + k] : B[k * ldb + c];
#pragma unroll
        for (int r = 0; r < 16; ++r) acc[r] = fmaf(A[r * lda + k], b, acc[r]);
      }
#pragma unroll
      for (int r = 0; r < 16; ++r) C[r * ldc + c] = acc[r];
    }
  } else {
    namespace w = nvcuda::wmma;
    using WT = typename Wmma<E>::type;
    const WT* a = reinterpret_cast<const WT*>(A);
    const WT* bm = reinterpret_cast<const WT*>(B);
    for (int n0 = 0; n0 < N; n0 += 16) {
      w::fragment<w::accumulator, 16, 16, 16, float> acc;
      if (accumulate) w::load_matrix_sync(acc, C + n0, unsigned(ldc), w::mem_row_major);
      else w::fill_fragment(acc, 0.0f);
      for (int k0 = 0; k0 < K; k0 += 16) {
        w::fragment<w::matrix_a, 16, 16, 16, WT, w::row_major> fa;
        w::load_matrix_sync(fa, a + k0, unsigned(lda));
        if constexpr (kBCol) {
          w::fragment<w::matrix_b, 16, 16, 16, WT, w::col_major> fb;
          w::load_matrix_sync(fb, bm + size_t(n0) * ldb + k0, unsigned(ldb));
          w::mma_sync(acc, fa, fb, acc);
        } else {
          w::fragment<w::matrix_b, 16, 16, 16, WT, w::row_major> fb;
          w::load_matrix_sync(fb, bm + size_t(k0) * ldb + n0, unsigned(ldb));
          w::mma_sync(acc, fa, fb, acc);
        }
      }
      w::store_matrix_sync(C + n0, acc, unsigned(ldc), w::mem_row_major);
    }
  }
}

// The element type of staged tiles: tensor cores when q/kv (and dout) are one 16-bit dtype, else f32.
template <typename T, typename TD = T>
using TileT = std::conditional_t<std::is_same_v<T, float> || std::is_same_v<TD, float>, float, T>;

}  // namespace
}  // namespace loom::cuda::attn_detail
