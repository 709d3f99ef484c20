// CUDA attention core, FlashAttention-2 style: attention_forward / attention_backward, and the kernels the
// context-parallel block ops (attention_blocks.cu) share through attn_detail::forward / backward. The
// whole-sequence ops (attention_op.cu) first offer the problem to the register-tiled kernels of
// flash_attention.cu (16-bit, head size 64/128, no window/segments/dropout); these general kernels take
// everything else.
//
// Work layout (why it looks the way it does):
//   - Forward: one thread block per (query tile of BQ rows, head, batch row), BQ/16 warps; each warp owns
//     16 query rows end to end (scores, softmax, output accumulator), so after a key/value tile is staged in
//     shared memory the warps never wait for each other. Key tiles of BK keys: S = Q K^T, online softmax
//     (running max m and sum l per row in f32 registers, two lanes per row), O = alpha O + P V accumulated
//     in f32 in shared memory; lse = m + log(l). Only BQ x BK score tiles exist: memory is O(T).
//   - Backward (no float atomics, deterministic): D = rowsum(dO * O) (small kernel); a dK/dV kernel with
//     one block per (key tile, kv group, batch row) that walks the query tiles of every query head of the
//     group, recomputing P = exp(S - lse), and accumulates dV += (P Z)^T dO and dK += dS^T Q in shared
//     f32; a dQ kernel with one block per (query tile, head, batch row) that walks the key tiles, dQ += dS K.
//     Each output element is written by exactly one block, after a fixed-order sum.
//   - Products: every block product is a warp computing a 16 x N tile, C (f32, shared) [+]= A (16 x K) B.
//     bf16/f16 inputs use tensor cores (nvcuda::wmma 16x16x16, f32 accumulate); P and dS are rounded to the
//     input dtype for those products, as in every tensor-core flash attention. f32 inputs (and, in the block
//     backward, f32 dout) take the same code with a CUDA-core f32 FMA product (exactly the f32 arithmetic
//     of the CPU, up to summation order).
//   - Head size HS (any value up to 256) is zero-padded to HSP, a multiple of 16, in shared memory, so
//     the same kernels serve every HS; rows of 16-bit tiles are loaded with 16-byte vectors when HS is a
//     multiple of 8 and the tensors are 16-byte aligned, else element by element.
//   - Masks: key j is visible to query i iff (causal: kpos <= qpos), (window: qpos - window < kpos) and
//     (segments: equal ids). With positions 0..T-1 (the whole-sequence op) key tiles that are fully masked
//     are skipped (causal, window, and non-decreasing segment ids); block ops take explicit positions and
//     visit every tile (masked entries are exact zeros either way, so skipping never changes a result).
//   - A query row with no visible key gets out 0 and lse -inf; in backward such a row contributes nothing.
//   - Attention dropout: Z(b, h, i, j) = dropout_keep(seed, stream, ((b*NH + h)*L + qpos)*L + kpos) /
//     (1 - p), the CPU's mask bit for bit (L = T, or the block's seq_len). l sums the undropped
//     probabilities; O uses P Z. Backward: dV = (P Z)^T dO, dS = P (dP Z - D) scale.
//   - Tile sizes are chosen at run time: the largest of (64, 64), (64, 32), (32, 32), (16, 16) whose
//     shared memory fits the device (dynamic shared memory, opted in above 48 KiB).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/attention_tiles.cuh"
#include "backend/cuda/device_utils.cuh"
#include "loom/core/rng.h"

namespace loom::cuda {

namespace attn_detail {
namespace {

// Masks, tile staging and block products: attention_tiles.cuh.

// ---- forward ------------------------------------------------------------------------------------------

// grid (query tiles, NH, B), BQ/16 warps. out (B, Tq, NH*HS), lse (B, NH, Tq).
template <typename T, typename TO>
__global__ void attention_fwd_kernel(Geo g, TO* __restrict__ out, float* __restrict__ lse) {
  using E = TileT<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int BQ = g.BQ, BK = g.BK, HSP = g.HSP, ldE = g.ldE;
  const int ldS = ld_f32(BK), ldP = ld_p(BK), ldO = ld_f32(HSP);
  const FwdLayout lay(BQ, BK, HSP, int(sizeof(E)));
  E* Qs = reinterpret_cast<E*>(smem + lay.q);
  E* Ks = reinterpret_cast<E*>(smem + lay.k);
  E* Vs = reinterpret_cast<E*>(smem + lay.v);
  float* Ss = reinterpret_cast<float*>(smem + lay.s);
  E* Ps = reinterpret_cast<E*>(smem + lay.p);
  float* Os = reinterpret_cast<float*>(smem + lay.o);
  int32_t* kpos_s = reinterpret_cast<int32_t*>(smem + lay.kpos);
  int32_t* kseg_s = reinterpret_cast<int32_t*>(smem + lay.kseg);

  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = int64_t(blockIdx.x) * BQ;
  const int64_t nq = min(int64_t(BQ), g.Tq - i0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row0 = warp * 16;
  const int r = row0 + lane / 2, half = lane & 1;  // two lanes per query row, half the columns each
  const int64_t i = i0 + r;
  const bool row_ok = r < nq;
  const int64_t qp = row_ok ? g.qpos(i) : 0;
  const int32_t qs = row_ok && g.q_seg ? g.q_seg[b * g.Tq + i] : 0;
  const int64_t grp = h / g.G;

  const T* qsrc = static_cast<const T*>(g.q) + (b * g.Tq + i0) * g.q_stride + g.q_col(h);
  const T* kbase = static_cast<const T*>(g.kv) + b * g.Tk * g.kv_stride + g.k_col(grp);
  const T* vbase = static_cast<const T*>(g.kv) + b * g.Tk * g.kv_stride + g.v_col(grp);
  load_rows<E>(Qs, ldE, qsrc, g.q_stride, nq, BQ, int(g.HS), HSP, g.vec);
  zero_f32(Os, BQ, HSP, ldO);
  __syncthreads();  // Os rows are zeroed by other warps (read in the epilogue even with no key tile)

  float m = kNegInf, l = 0.0f;
  DropoutRng rng;
  const uint64_t mrow = g.dropout ? g.mask_row(b, h, qp) : 0;
  const int64_t kbeg = g.key_begin(i0), kend = g.key_end(i0, nq);
  const int cb = half * (BK / 2), ce = cb + BK / 2;
  for (int64_t j0 = kbeg; j0 < kend; j0 += BK) {
    const int64_t nk = min(int64_t(BK), kend - j0);
    if (g.segments_disjoint(b, i0, nq, j0, nk)) continue;  // uniform: every thread skips
    __syncthreads();  // the previous tile's K/V are no longer read
    load_rows<E>(Ks, ldE, kbase + j0 * g.kv_stride, g.kv_stride, nk, BK, int(g.HS), HSP, g.vec);
    load_rows<E>(Vs, ldE, vbase + j0 * g.kv_stride, g.kv_stride, nk, BK, int(g.HS), HSP, g.vec);
    for (int j = threadIdx.x; j < BK; j += blockDim.x) {
      kpos_s[j] = j < nk ? int32_t(g.kpos(j0 + j)) : 0;
      kseg_s[j] = j < nk && g.k_seg ? g.k_seg[b * g.Tk + j0 + j] : 0;
    }
    __syncthreads();

    warp_mma<true>(Ss + row0 * ldS, ldS, Qs + row0 * ldE, ldE, Ks, ldE, BK, HSP, false);  // S = Q K^T
    __syncwarp();
    float* srow = Ss + r * ldS;
    float mt = kNegInf;
    for (int c = cb; c < ce; ++c) {
      float s = kNegInf;
      if (row_ok && c < nk && g.visible(qp, qs, kpos_s[c], kseg_s[c])) s = srow[c] * g.scale;
      srow[c] = s;
      mt = fmaxf(mt, s);
    }
    mt = fmaxf(mt, __shfl_xor_sync(kFullMask, mt, 1));
    const float mn = fmaxf(m, mt);
    const float ms = mn == kNegInf ? 0.0f : mn;  // no visible key yet: everything stays 0
    const float alpha = expf(m - ms);
    float ls = 0.0f;
    E* prow = Ps + r * ldP;
    for (int c = cb; c < ce; ++c) {
      const float s = srow[c];
      float e = s == kNegInf ? 0.0f : expf(s - ms);
      ls += e;  // the normaliser sums the undropped probabilities
      if (g.dropout && e != 0.0f) e *= rng.factor(g, mrow + uint64_t(kpos_s[c]));
      prow[c] = to_e<E>(e);
    }
    ls += __shfl_xor_sync(kFullMask, ls, 1);
    l = l * alpha + ls;
    m = mn;
    float* orow = Os + r * ldO;
    for (int c = half * (HSP / 2); c < (half + 1) * (HSP / 2); ++c) orow[c] *= alpha;
    __syncwarp();
    warp_mma<false>(Os + row0 * ldO, ldO, Ps + row0 * ldP, ldP, Vs, ldE, HSP, BK, true);  // O += P V
    __syncwarp();
  }

  if (row_ok) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    TO* dst = out + (b * g.Tq + i) * (g.NH * g.HS) + h * g.HS;
    const float* orow = Os + r * ldO;
    for (int64_t c = half; c < g.HS; c += 2) dst[c] = store<TO>(orow[c] * inv);
    if (half == 0) lse[(b * g.NH + h) * g.Tq + i] = l > 0.0f ? m + logf(l) : kNegInf;
  }
}

// ---- backward -----------------------------------------------------------------------------------------

// D (B, NH, Tq) = rowsum(dout * out), one warp per (b, t, h) row.
template <typename TO, typename TD>
__global__ void attention_rowdot_kernel(float* __restrict__ D, const TO* __restrict__ out,
                                        const TD* __restrict__ dout, int64_t B, int64_t Tq, int64_t NH, int64_t HS) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = B * Tq * NH;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; w < rows; w += warps) {
    const TO* o = out + w * HS;
    const TD* d = dout + w * HS;
    float acc = 0.0f;
    for (int64_t c = lane; c < HS; c += 32) acc = fmaf(load(o[c]), load(d[c]), acc);
    acc = warp_sum(acc);
    if (lane == 0) {
      const int64_t h = w % NH, t = (w / NH) % Tq, b = w / (NH * Tq);
      D[(b * NH + h) * Tq + t] = acc;
    }
  }
}

// Stores an f32 gradient: overwrite (rounded once to TG) or accumulate into f32.
template <typename TG>
__device__ __forceinline__ void put_grad(TG* dst, float v, bool accumulate) {
  if (accumulate) *dst = store<TG>(load(*dst) + v);
  else *dst = store<TG>(v);
}

// grid (key tiles, NKV, B), BK/16 warps, each owning 16 keys. Walks every query tile of every query head of
// the group; dK, dV accumulate in shared f32 and are written once.
template <typename T, typename TD, typename TG>
__global__ void attention_dkdv_kernel(Geo g, const TD* __restrict__ dout, const float* __restrict__ lse,
                                      const float* __restrict__ D, TG* __restrict__ dkv, int64_t dkv_stride,
                                      int64_t dkv_g, bool accumulate) {
  using E = TileT<T, TD>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int BQ = g.BQ, BK = g.BK, HSP = g.HSP, ldE = g.ldE;
  const int ldS = ld_f32(BQ), ldP = ld_p(BQ), ldO = ld_f32(HSP);
  const DkdvLayout lay(BQ, BK, HSP, int(sizeof(E)));
  E* Ks = reinterpret_cast<E*>(smem + lay.k);
  E* Vs = reinterpret_cast<E*>(smem + lay.v);
  E* Qs = reinterpret_cast<E*>(smem + lay.q);
  E* dOs = reinterpret_cast<E*>(smem + lay.dout);
  float* St = reinterpret_cast<float*>(smem + lay.st);
  float* dPt = reinterpret_cast<float*>(smem + lay.dpt);
  E* Pt = reinterpret_cast<E*>(smem + lay.pt);
  E* dSt = reinterpret_cast<E*>(smem + lay.dst);
  float* dKa = reinterpret_cast<float*>(smem + lay.dk);
  float* dVa = reinterpret_cast<float*>(smem + lay.dv);
  int32_t* qpos_s = reinterpret_cast<int32_t*>(smem + lay.qpos);
  int32_t* qseg_s = reinterpret_cast<int32_t*>(smem + lay.qseg);
  float* lse_s = reinterpret_cast<float*>(smem + lay.lse);
  float* D_s = reinterpret_cast<float*>(smem + lay.dd);

  const int64_t b = blockIdx.z, grp = blockIdx.y, j0 = int64_t(blockIdx.x) * BK;
  const int64_t nk = min(int64_t(BK), g.Tk - j0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row0 = warp * 16;
  const int r = row0 + lane / 2, half = lane & 1;  // two lanes per key row
  const int64_t j = j0 + r;
  const bool key_ok = r < nk;
  const int64_t kp = key_ok ? g.kpos(j) : 0;
  const int32_t ks = key_ok && g.k_seg ? g.k_seg[b * g.Tk + j] : 0;

  const T* kvb = static_cast<const T*>(g.kv) + (b * g.Tk + j0) * g.kv_stride;
  load_rows<E>(Ks, ldE, kvb + g.k_col(grp), g.kv_stride, nk, BK, int(g.HS), HSP, g.vec);
  load_rows<E>(Vs, ldE, kvb + g.v_col(grp), g.kv_stride, nk, BK, int(g.HS), HSP, g.vec);
  zero_f32(dKa, BK, HSP, ldO);
  zero_f32(dVa, BK, HSP, ldO);
  __syncthreads();

  const int64_t qbeg = g.query_begin(j0), qend = g.query_end(j0, nk);
  const int64_t out_row = g.NH * g.HS;
  const int cb = half * (BQ / 2), ce = cb + BQ / 2;
  for (int64_t h = grp * g.G; h < (grp + 1) * g.G; ++h) {
    DropoutRng rng;
    for (int64_t i0 = qbeg; i0 < qend; i0 += BQ) {
      const int64_t nq = min(int64_t(BQ), qend - i0);
      if (g.segments_disjoint(b, i0, nq, j0, nk)) continue;  // uniform
      __syncthreads();  // the previous query tile is no longer read
      load_rows<E>(Qs, ldE, static_cast<const T*>(g.q) + (b * g.Tq + i0) * g.q_stride + g.q_col(h), g.q_stride, nq,
                   BQ, int(g.HS), HSP, g.vec);
      load_rows<E>(dOs, ldE, dout + (b * g.Tq + i0) * out_row + h * g.HS, out_row, nq, BQ, int(g.HS), HSP, g.vec);
      for (int c = threadIdx.x; c < BQ; c += blockDim.x) {
        const bool ok = c < nq;
        qpos_s[c] = ok ? int32_t(g.qpos(i0 + c)) : 0;
        qseg_s[c] = ok && g.q_seg ? g.q_seg[b * g.Tq + i0 + c] : 0;
        lse_s[c] = ok ? lse[(b * g.NH + h) * g.Tq + i0 + c] : kNegInf;  // -inf: the row sees nothing
        D_s[c] = ok ? D[(b * g.NH + h) * g.Tq + i0 + c] : 0.0f;
      }
      __syncthreads();

      warp_mma<true>(St + row0 * ldS, ldS, Ks + row0 * ldE, ldE, Qs, ldE, BQ, HSP, false);    // S^T = K Q^T
      warp_mma<true>(dPt + row0 * ldS, ldS, Vs + row0 * ldE, ldE, dOs, ldE, BQ, HSP, false);  // dP^T = V dO^T
      __syncwarp();
      const float* srow = St + r * ldS;
      const float* dprow = dPt + r * ldS;
      E* prow = Pt + r * ldP;
      E* dsrow = dSt + r * ldP;
      for (int c = cb; c < ce; ++c) {
        float pz = 0.0f, ds = 0.0f;
        const float L = lse_s[c];
        if (key_ok && L != kNegInf && g.visible(qpos_s[c], qseg_s[c], kp, ks)) {
          const float p = expf(srow[c] * g.scale - L);
          const float z = g.dropout ? rng.factor(g, g.mask_row(b, h, qpos_s[c]) + uint64_t(kp)) : 1.0f;
          ds = p * (dprow[c] * z - D_s[c]) * g.scale;
          pz = p * z;
        }
        prow[c] = to_e<E>(pz);
        dsrow[c] = to_e<E>(ds);
      }
      __syncwarp();
      warp_mma<false>(dVa + row0 * ldO, ldO, Pt + row0 * ldP, ldP, dOs, ldE, HSP, BQ, true);  // dV += (PZ)^T dO
      warp_mma<false>(dKa + row0 * ldO, ldO, dSt + row0 * ldP, ldP, Qs, ldE, HSP, BQ, true);  // dK += dS^T Q
      __syncwarp();
    }
  }

  if (key_ok) {
    TG* row = dkv + (b * g.Tk + j) * dkv_stride + (grp * (dkv_g + 2) + dkv_g) * g.HS;
    const float* a = dKa + r * ldO;
    const float* c = dVa + r * ldO;
    for (int64_t d = half; d < g.HS; d += 2) {
      put_grad(row + d, a[d], accumulate);
      put_grad(row + g.HS + d, c[d], accumulate);
    }
  }
}

// grid (query tiles, NH, B), BQ/16 warps, each owning 16 queries: dQ += dS K over the key tiles.
template <typename T, typename TD, typename TG>
__global__ void attention_dq_kernel(Geo g, const TD* __restrict__ dout, const float* __restrict__ lse,
                                    const float* __restrict__ D, TG* __restrict__ dq, int64_t dq_stride,
                                    bool dq_grouped, bool accumulate) {
  using E = TileT<T, TD>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int BQ = g.BQ, BK = g.BK, HSP = g.HSP, ldE = g.ldE;
  const int ldS = ld_f32(BK), ldP = ld_p(BK), ldO = ld_f32(HSP);
  const DqLayout lay(BQ, BK, HSP, int(sizeof(E)));
  E* Qs = reinterpret_cast<E*>(smem + lay.q);
  E* dOs = reinterpret_cast<E*>(smem + lay.dout);
  E* Ks = reinterpret_cast<E*>(smem + lay.k);
  E* Vs = reinterpret_cast<E*>(smem + lay.v);
  float* Ss = reinterpret_cast<float*>(smem + lay.s);
  float* dPs = reinterpret_cast<float*>(smem + lay.dp);
  E* dSs = reinterpret_cast<E*>(smem + lay.ds);
  float* dQa = reinterpret_cast<float*>(smem + lay.dq);
  int32_t* kpos_s = reinterpret_cast<int32_t*>(smem + lay.kpos);
  int32_t* kseg_s = reinterpret_cast<int32_t*>(smem + lay.kseg);

  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = int64_t(blockIdx.x) * BQ;
  const int64_t nq = min(int64_t(BQ), g.Tq - i0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row0 = warp * 16;
  const int r = row0 + lane / 2, half = lane & 1;
  const int64_t i = i0 + r;
  const bool row_ok = r < nq;
  const int64_t qp = row_ok ? g.qpos(i) : 0;
  const int32_t qs = row_ok && g.q_seg ? g.q_seg[b * g.Tq + i] : 0;
  const float L = row_ok ? lse[(b * g.NH + h) * g.Tq + i] : kNegInf;
  const float Di = row_ok ? D[(b * g.NH + h) * g.Tq + i] : 0.0f;
  const int64_t grp = h / g.G;
  const int64_t out_row = g.NH * g.HS;

  load_rows<E>(Qs, ldE, static_cast<const T*>(g.q) + (b * g.Tq + i0) * g.q_stride + g.q_col(h), g.q_stride, nq, BQ,
               int(g.HS), HSP, g.vec);
  load_rows<E>(dOs, ldE, dout + (b * g.Tq + i0) * out_row + h * g.HS, out_row, nq, BQ, int(g.HS), HSP, g.vec);
  zero_f32(dQa, BQ, HSP, ldO);
  __syncthreads();

  const T* kbase = static_cast<const T*>(g.kv) + b * g.Tk * g.kv_stride + g.k_col(grp);
  const T* vbase = static_cast<const T*>(g.kv) + b * g.Tk * g.kv_stride + g.v_col(grp);
  DropoutRng rng;
  const uint64_t mrow = g.dropout ? g.mask_row(b, h, qp) : 0;
  const bool live = row_ok && L != kNegInf;
  const int64_t kbeg = g.key_begin(i0), kend = g.key_end(i0, nq);
  const int cb = half * (BK / 2), ce = cb + BK / 2;
  for (int64_t j0 = kbeg; j0 < kend; j0 += BK) {
    const int64_t nk = min(int64_t(BK), kend - j0);
    if (g.segments_disjoint(b, i0, nq, j0, nk)) continue;  // uniform
    __syncthreads();
    load_rows<E>(Ks, ldE, kbase + j0 * g.kv_stride, g.kv_stride, nk, BK, int(g.HS), HSP, g.vec);
    load_rows<E>(Vs, ldE, vbase + j0 * g.kv_stride, g.kv_stride, nk, BK, int(g.HS), HSP, g.vec);
    for (int j = threadIdx.x; j < BK; j += blockDim.x) {
      kpos_s[j] = j < nk ? int32_t(g.kpos(j0 + j)) : 0;
      kseg_s[j] = j < nk && g.k_seg ? g.k_seg[b * g.Tk + j0 + j] : 0;
    }
    __syncthreads();

    warp_mma<true>(Ss + row0 * ldS, ldS, Qs + row0 * ldE, ldE, Ks, ldE, BK, HSP, false);    // S = Q K^T
    warp_mma<true>(dPs + row0 * ldS, ldS, dOs + row0 * ldE, ldE, Vs, ldE, BK, HSP, false);  // dP = dO V^T
    __syncwarp();
    const float* srow = Ss + r * ldS;
    const float* dprow = dPs + r * ldS;
    E* dsrow = dSs + r * ldP;
    for (int c = cb; c < ce; ++c) {
      float ds = 0.0f;
      if (live && c < nk && g.visible(qp, qs, kpos_s[c], kseg_s[c])) {
        const float p = expf(srow[c] * g.scale - L);
        const float z = g.dropout ? rng.factor(g, mrow + uint64_t(kpos_s[c])) : 1.0f;
        ds = p * (dprow[c] * z - Di) * g.scale;
      }
      dsrow[c] = to_e<E>(ds);
    }
    __syncwarp();
    warp_mma<false>(dQa + row0 * ldO, ldO, dSs + row0 * ldP, ldP, Ks, ldE, HSP, BK, true);  // dQ += dS K
    __syncwarp();
  }

  if (row_ok) {
    TG* row = dq + (b * g.Tq + i) * dq_stride + (dq_grouped ? g.q_col(h) : h * g.HS);
    const float* a = dQa + r * ldO;
    for (int64_t d = half; d < g.HS; d += 2) put_grad(row + d, a[d], accumulate);
  }
}

// ---- host side ----------------------------------------------------------------------------------------

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

Geo make_geo(const Problem& pb) {
  Geo g{};
  g.q = pb.q.raw();
  g.kv = pb.kv.raw();
  g.G = pb.NH / pb.NKV;
  g.q_stride = pb.NKV * (g.G + 2) * pb.HS;
  g.kv_g = pb.kv_g;
  g.kv_stride = pb.NKV * (pb.kv_g + 2) * pb.HS;
  g.B = pb.B;
  g.Tq = pb.Tq;
  g.Tk = pb.Tk;
  g.NH = pb.NH;
  g.HS = pb.HS;
  g.HSP = int((pb.HS + 15) / 16 * 16);
  g.scale = pb.scale;
  g.causal = pb.causal;
  g.window = pb.window;
  g.identity = pb.q_pos == nullptr;
  g.q_pos = pb.q_pos;
  g.k_pos = pb.k_pos;
  g.q_seg = pb.q_seg;
  g.k_seg = pb.k_seg;
  g.dropout = pb.dropout_p > 0.0f;
  if (g.dropout) {
    g.seed = pb.dropout_seed;
    g.stream = pb.dropout_stream;
    g.L = pb.mask_len;
    g.threshold = dropout_threshold(pb.dropout_p);
    g.keep_scale = 1.0f / (1.0f - pb.dropout_p);
  }
  return g;
}

// Sets the tile sizes (rows x cols of the score tile: BQ x BK, or BK x BQ for dK/dV) to the largest
// candidate whose shared memory fits; returns the bytes.
template <typename Layout>
size_t choose_tiles(const CudaContext& ctx, Geo& g, int es, bool keys_are_rows, const char* op) {
  static constexpr int kCand[][2] = {{64, 64}, {64, 32}, {32, 32}, {16, 16}};
  const size_t limit = ctx.props().sharedMemPerBlockOptin;
  for (const auto& c : kCand) {
    const int BQ = keys_are_rows ? c[1] : c[0], BK = keys_are_rows ? c[0] : c[1];
    const Layout lay(BQ, BK, g.HSP, es);
    if (lay.bytes <= limit) {
      g.BQ = BQ;
      g.BK = BK;
      g.ldE = ld_tile(g.HSP, es);
      return lay.bytes;
    }
  }
  LOOM_FAIL("[", op, "] head_dim ", g.HS, " needs more shared memory than the device's ", limit, " bytes");
}

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    LOOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

unsigned tiles(int64_t n, int tile) { return unsigned((n + tile - 1) / tile); }

template <typename T, typename TO>
void launch_forward(const CudaContext& ctx, Geo g, TensorView out, TensorView lse) {
  using E = TileT<T>;
  const size_t bytes = choose_tiles<FwdLayout>(ctx, g, int(sizeof(E)), false, "attention_forward");
  g.vec = sizeof(E) == 2 && g.HS % 8 == 0 && aligned16(g.q) && aligned16(g.kv);
  auto kernel = attention_fwd_kernel<T, TO>;
  set_smem(kernel, bytes);
  const dim3 grid(tiles(g.Tq, g.BQ), unsigned(g.NH), unsigned(g.B));
  kernel<<<grid, 32 * (g.BQ / 16), bytes, ctx.compute_stream()>>>(g, ptr<TO>(out), ptr<float>(lse));
  LOOM_CUDA_LAUNCH_CHECK();
}

template <typename T, typename TD, typename TG>
void launch_backward(const CudaContext& ctx, const Geo& g0, const Grads& gr, TensorView dout, TensorView out,
                     TensorView lse) {
  using E = TileT<T, TD>;
  const int es = int(sizeof(E));
  cudaStream_t st = ctx.compute_stream();
  Tensor D = scratch(ctx, Shape{g0.B, g0.NH, g0.Tq}, DType::kF32);
  row_dot(ctx, D, out, dout, g0.B, g0.Tq, g0.NH, g0.HS);
  const bool vec = es == 2 && g0.HS % 8 == 0 && aligned16(g0.q) && aligned16(g0.kv) && aligned16(dout.raw());
  if (g0.Tk > 0) {
    Geo g = g0;
    const size_t bytes = choose_tiles<DkdvLayout>(ctx, g, es, true, "attention_backward");
    g.vec = vec;
    auto kernel = attention_dkdv_kernel<T, TD, TG>;
    set_smem(kernel, bytes);
    const dim3 grid(tiles(g.Tk, g.BK), unsigned(g.NH / g.G), unsigned(g.B));
    kernel<<<grid, 32 * (g.BK / 16), bytes, st>>>(g, cptr<TD>(dout), cptr<float>(lse), cptr<float>(D),
                                                  ptr<TG>(gr.dkv), gr.dkv_stride, gr.dkv_g, gr.accumulate);
    LOOM_CUDA_LAUNCH_CHECK();
  }
  if (g0.Tk > 0 || !gr.accumulate) {  // with no keys dq gets 0: nothing to add, but an overwrite must zero it
    Geo g = g0;
    const size_t bytes = choose_tiles<DqLayout>(ctx, g, es, false, "attention_backward");
    g.vec = vec;
    auto kernel = attention_dq_kernel<T, TD, TG>;
    set_smem(kernel, bytes);
    const dim3 grid(tiles(g.Tq, g.BQ), unsigned(g.NH), unsigned(g.B));
    kernel<<<grid, 32 * (g.BQ / 16), bytes, st>>>(g, cptr<TD>(dout), cptr<float>(lse), cptr<float>(D),
                                                  ptr<TG>(gr.dq), gr.dq_stride, gr.dq_grouped, gr.accumulate);
    LOOM_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace

void row_dot(const CudaContext& ctx, TensorView D, TensorView out, TensorView dout, int64_t B, int64_t Tq,
             int64_t NH, int64_t HS) {
  const int64_t rows = B * Tq * NH;
  if (rows == 0) return;
  dispatch_float(out.dtype(), "[attention_backward] out", [&](auto to) {
    using TO = decltype(to);
    dispatch_float(dout.dtype(), "[attention_backward] dout", [&](auto td) {
      using TD = decltype(td);
      attention_rowdot_kernel<TO, TD><<<grid_for(rows * 32), kThreads, 0, ctx.compute_stream()>>>(
          ptr<float>(D), cptr<TO>(out), cptr<TD>(dout), B, Tq, NH, HS);
      LOOM_CUDA_LAUNCH_CHECK();
    });
  });
}

void forward(const CudaContext& ctx, const Problem& pb, TensorView out, TensorView lse) {
  if (pb.B == 0 || pb.Tq == 0) return;
  LOOM_CHECK(pb.B <= 65535 && pb.NH <= 65535, "[attention] expected batch and head counts <= 65535, got B = ",
             pb.B, ", NH = ", pb.NH);
  const Geo g = make_geo(pb);
  dispatch_float(pb.q.dtype(), "[attention] q", [&](auto t) {
    using T = decltype(t);
    if (out.dtype() == pb.q.dtype()) launch_forward<T, T>(ctx, g, out, lse);
    else if (out.dtype() == DType::kF32) launch_forward<T, float>(ctx, g, out, lse);
    else LOOM_FAIL("[attention] expected out f32 or ", dtype_name(pb.q.dtype()), ", got ", out.desc());
  });
}

void backward(const CudaContext& ctx, const Problem& pb, const Grads& gr, TensorView dout, TensorView out,
              TensorView lse) {
  // No queries: the whole-sequence op has nothing to write (T = 0), a block adds nothing.
  if (pb.B == 0 || pb.Tq == 0) return;
  LOOM_CHECK(pb.B <= 65535 && pb.NH <= 65535, "[attention] expected batch and head counts <= 65535, got B = ",
             pb.B, ", NH = ", pb.NH);
  const Geo g = make_geo(pb);
  dispatch_float(pb.q.dtype(), "[attention] q", [&](auto t) {
    using T = decltype(t);
    if (!gr.accumulate) {
      LOOM_CHECK(dout.dtype() == pb.q.dtype() && gr.dq.dtype() == pb.q.dtype(), "[attention] dtype mismatch");
      launch_backward<T, T, T>(ctx, g, gr, dout, out, lse);
    } else if (dout.dtype() == pb.q.dtype()) {
      launch_backward<T, T, float>(ctx, g, gr, dout, out, lse);
    } else {
      launch_backward<T, float, float>(ctx, g, gr, dout, out, lse);
    }
  });
}

}  // namespace attn_detail

}  // namespace loom::cuda
