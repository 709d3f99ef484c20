// Register-tiled flash attention for 16-bit q/k/v (launchers in flash_attention.cuh), FlashAttention-2's
// work split with Loom's determinism rule (no float atomics):
//   - forward: one block of 4 warps per (64-query tile, head, batch row); each warp owns 16 query rows.
//     Q fragments stay in registers; key/value tiles of 64 rows stream through shared memory, two stages
//     deep (cp.async); S = Q K^T, the online softmax (running max and sum per row, exp2 of log2-scaled
//     scores) and O += P V all live in registers (mma.sync m16n8k16, f32 accumulate); P is rounded to the
//     input dtype for the P V product, as every tensor-core flash attention does. Causal query tiles run
//     longest first (reversed tile order) so the last wave is short.
//   - backward: Dv = rowsum(dO * O) (one warp per row); a dK/dV kernel, one block per (64-key tile, kv
//     group, batch row), each warp owning 16 keys, walks every query tile of every head of its group:
//     S^T = K Q^T, P^T = exp(S^T - lse), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - Dv),
//     dK += dS^T Q; a dQ kernel, one block per (64-query tile, head, batch row), walks the key tiles:
//     dQ += dS K. Every output row is written once by one warp, after a fixed-order sum: deterministic.
//   - tiles are 64 x (HS + 8) elements in shared memory: the 16-byte pad per row makes the ldmatrix row
//     addresses of a warp hit distinct banks.
// Matrix-fragment layouts (PTX ISA, mma.m16n8k16): A (16 x 16, row): a0 = (g, 2c..2c+1), a1 = (g+8, ..),
// a2 = (g, 2c+8..), a3 = (g+8, 2c+8..); B (16 x 8, col): b0 = (k 2c..2c+1, n g), b1 = (k 2c+8.., n g);
// C (16 x 8): c0,c1 = (g, 2c..2c+1), c2,c3 = (g+8, ..), with g = lane / 4 and c = lane % 4. A C tile pair
// (two n-tiles of 8) is therefore the A fragment of the next product without any shuffle.
#include "backend/cuda/flash_attention.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/vec_io.cuh"

namespace loom::cuda::flash {

namespace {

constexpr int kTile = 64;     // query and key tile rows
constexpr int kWarps = 4;     // 16 rows each
constexpr int kBlock = 32 * kWarps;
constexpr int kPad = 8;       // elements added to each shared row
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Args {
  const uint16_t* qkv;  // (B, T, stride) packed: per kv group g, G query heads then K then V (HS each)
  uint16_t* out;        // forward: (B, T, NH*HS); backward: dqkv, same layout as qkv
  const uint16_t* dout; // (B, T, NH*HS)
  float* lse;           // (B, NH, T)
  const float* dvec;    // backward: (B, NH, T) rowsum(dO * O)
  int64_t T, NH, G, stride;
  float scale;
  bool causal;
};

template <int D>
__device__ __forceinline__ int64_t q_col(const Args& a, int64_t h) {
  return ((h / a.G) * (a.G + 2) + h % a.G) * D;
}
template <int D>
__device__ __forceinline__ int64_t k_col(const Args& a, int64_t g) {
  return (g * (a.G + 2) + a.G) * D;
}

// ---- PTX wrappers ---------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

template <bool kBf16>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two f32 values rounded (RNE) to the 16-bit dtype, lo in the low half.
template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kBf16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}
template <bool kBf16>
__device__ __forceinline__ float to_f32(uint16_t b) {
  if constexpr (kBf16) return __uint_as_float(uint32_t(b) << 16);
  else return __half2float(__ushort_as_half(b));
}

// 16 bytes global -> shared, zero-filled when !valid (src-size 0 reads nothing).
__device__ __forceinline__ void cp_async16(uint16_t* dst, const uint16_t* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// A 64-row tile of D columns starting at row r0 of a (rows x stride) matrix whose column 0 is `col0`;
// rows at or past `rows` are zeros.
template <int D>
__device__ __forceinline__ void load_tile(uint16_t* s, const uint16_t* col0, int64_t stride, int64_t r0,
                                          int64_t rows) {
  constexpr int kChunks = D / 8, LD = D + kPad;
  for (int c = threadIdx.x; c < kTile * kChunks; c += kBlock) {
    const int r = c / kChunks, k = (c % kChunks) * 8;
    const bool valid = r0 + r < rows;
    cp_async16(s + r * LD + k, valid ? col0 + (r0 + r) * stride + k : col0, valid);
  }
}

// Key/value streaming of the forward and dQ kernels: starts loading tile t + 1 into the other stage (when
// there is one), then waits until tile t (stage t & 1) has landed and every thread sees it.
template <int D>
__device__ __forceinline__ void next_kv_stage(uint16_t* Ks, uint16_t* Vs, const uint16_t* kg, const uint16_t* vg,
                                              int64_t stride, int t, int ntiles, int64_t T) {
  constexpr int LD = D + kPad;
  const int st = t & 1;
  if (t + 1 < ntiles) {
    load_tile<D>(Ks + (st ^ 1) * kTile * LD, kg, stride, int64_t(t + 1) * kTile, T);
    load_tile<D>(Vs + (st ^ 1) * kTile * LD, vg, stride, int64_t(t + 1) * kTile, T);
    cp_commit();
    cp_wait<1>();
  } else {
    cp_wait<0>();
  }
  __syncthreads();
}

// A fragments of this warp's 16 rows (row0 .. row0+15) of a tile, for every 16-column chunk.
template <int D>
__device__ __forceinline__ void load_a_frags(uint32_t (&f)[D / 16][4], const uint16_t* s, int row0) {
  constexpr int LD = D + kPad;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) ldsm_x4(f[kc], s + (row0 + lane % 16) * LD + kc * 16 + (lane / 16) * 8);
}

// acc (16 x 64, 8 n-tiles) = A (16 x D, register fragments) . Bt^T, with Bt a 64 x D tile whose rows are the
// n index (keys for S = Q K^T): B fragments by plain ldmatrix of Bt's rows.
template <int D, bool kBf16>
__device__ __forceinline__ void gemm_rows(float (&acc)[8][4], const uint32_t (&a)[D / 16][4], const uint16_t* bt) {
  constexpr int LD = D + kPad;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < D / 16; kc += 2) {
      uint32_t r[4];
      ldsm_x4(r, bt + (nt * 8 + lane % 8) * LD + kc * 16 + (lane / 8) * 8);
      mma<kBf16>(acc[nt], a[kc], r[0], r[1]);
      mma<kBf16>(acc[nt], a[kc + 1], r[2], r[3]);
    }
  }
}

// Same, with the A operand read from shared memory (16 rows from row0 of `as`) chunk by chunk: for the
// dK/dV kernel, whose K and V fragments would not fit in registers next to its accumulators.
template <int D, bool kBf16>
__device__ __forceinline__ void gemm_rows_smem(float (&acc)[8][4], const uint16_t* as, int row0, const uint16_t* bt) {
  constexpr int LD = D + kPad;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
  for (int kc = 0; kc < D / 16; kc += 2) {
    uint32_t a0[4], a1[4];
    ldsm_x4(a0, as + (row0 + lane % 16) * LD + kc * 16 + (lane / 16) * 8);
    ldsm_x4(a1, as + (row0 + lane % 16) * LD + (kc + 1) * 16 + (lane / 16) * 8);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      uint32_t r[4];
      ldsm_x4(r, bt + (nt * 8 + lane % 8) * LD + kc * 16 + (lane / 8) * 8);
      mma<kBf16>(acc[nt], a0, r[0], r[1]);
      mma<kBf16>(acc[nt], a1, r[2], r[3]);
    }
  }
}

// out (16 x D, D/8 n-tiles) += P (16 x 64, the f32 C tiles of a previous product, rounded here) . Bm, with Bm
// a 64 x D row-major tile (rows = the k index: keys for P V): B fragments by transposing ldmatrix.
template <int D, bool kBf16>
__device__ __forceinline__ void gemm_p_tile(float (&out)[D / 8][4], const float (&p)[8][4], const uint16_t* bm) {
  constexpr int LD = D + kPad;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kc = 0; kc < 4; ++kc) {
    const uint32_t a[4] = {pack2<kBf16>(p[2 * kc][0], p[2 * kc][1]), pack2<kBf16>(p[2 * kc][2], p[2 * kc][3]),
                           pack2<kBf16>(p[2 * kc + 1][0], p[2 * kc + 1][1]),
                           pack2<kBf16>(p[2 * kc + 1][2], p[2 * kc + 1][3])};
#pragma unroll
    for (int dn = 0; dn < D / 8; dn += 2) {
      uint32_t r[4];
      ldsm_x4_t(r, bm + (kc * 16 + lane % 8 + ((lane >> 3) & 1) * 8) * LD + dn * 8 + (lane >> 4) * 8);
      mma<kBf16>(out[dn], a, r[0], r[1]);
      mma<kBf16>(out[dn + 1], a, r[2], r[3]);
    }
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
  return v + __shfl_xor_sync(0xFFFFFFFFu, v, 2);
}

// Writes this warp's 16 x D f32 tile, times `mul`, rounded, to rows row_lo (c0,c1) and row_lo + 8 (c2,c3)
// of a (rows x stride) matrix at column col0; rows at or past `rows` are skipped.
template <int D, bool kBf16>
__device__ __forceinline__ void store_rows(uint16_t* col0, int64_t stride, int64_t row_lo, int64_t rows,
                                           const float (&acc)[D / 8][4], float mul_lo, float mul_hi) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row_lo + half * 8;
    if (row >= rows) continue;
    uint16_t* dst = col0 + row * stride + (lane % 4) * 2;
    const float m = half ? mul_hi : mul_lo;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      *reinterpret_cast<uint32_t*>(dst + dn * 8) = pack2<kBf16>(acc[dn][2 * half] * m, acc[dn][2 * half + 1] * m);
  }
}

// ---- forward ----------------------------------------------------------------------------------------------

// grid (query tiles, NH, B).
template <int D, bool kBf16>
__global__ void __launch_bounds__(kBlock) flash_fwd_kernel(Args a) {
  constexpr int LD = D + kPad;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* Ks = Qs + kTile * LD;       // 2 stages
  uint16_t* Vs = Ks + 2 * kTile * LD;   // 2 stages
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t T = a.T, b = blockIdx.z, h = blockIdx.y;
  const int64_t qt = a.causal ? int64_t(gridDim.x) - 1 - blockIdx.x : blockIdx.x;
  const int64_t i0 = qt * kTile;
  const uint16_t* base = a.qkv + b * T * a.stride;
  const uint16_t* qg = base + q_col<D>(a, h);
  const uint16_t* kg = base + k_col<D>(a, h / a.G);
  const uint16_t* vg = kg + D;
  const int64_t kend = a.causal ? min(T, i0 + kTile) : T;
  const int ntiles = int((kend + kTile - 1) / kTile);

  load_tile<D>(Qs, qg, a.stride, i0, T);
  load_tile<D>(Ks, kg, a.stride, 0, T);
  load_tile<D>(Vs, vg, a.stride, 0, T);
  cp_commit();

  const int64_t row_lo = i0 + warp * 16 + lane / 4, row_hi = row_lo + 8;
  const float sl2 = a.scale * kLog2e;
  uint32_t qf[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;

  for (int t = 0; t < ntiles; ++t) {
    const int st = t & 1;
    next_kv_stage<D>(Ks, Vs, kg, vg, a.stride, t, ntiles, T);
    if (t == 0) load_a_frags<D>(qf, Qs, warp * 16);
    const uint16_t* Kt = Ks + st * kTile * LD;
    const uint16_t* Vt = Vs + st * kTile * LD;
    const int64_t j0 = int64_t(t) * kTile;

    float s[8][4];
    gemm_rows<D, kBf16>(s, qf, Kt);
    const bool edge = (a.causal && j0 + kTile - 1 > i0) || j0 + kTile > T;
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float v = s[nt][c] * sl2;
        if (edge) {
          const int64_t j = j0 + nt * 8 + (lane % 4) * 2 + (c & 1);
          const int64_t row = c < 2 ? row_lo : row_hi;
          if (j >= T || (a.causal && j > row)) v = -INFINITY;
        }
        s[nt][c] = v;
      }
      mx_lo = fmaxf(mx_lo, fmaxf(s[nt][0], s[nt][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[nt][2], s[nt][3]));
    }
    const float mn_lo = fmaxf(m_lo, quad_max(mx_lo)), mn_hi = fmaxf(m_hi, quad_max(mx_hi));
    // A row with nothing visible yet keeps max -inf: subtract 0 instead, so exp2 gives 0, not NaN.
    const float sub_lo = mn_lo == -INFINITY ? 0.0f : mn_lo, sub_hi = mn_hi == -INFINITY ? 0.0f : mn_hi;
    const float al_lo = exp2f(m_lo - sub_lo), al_hi = exp2f(m_hi - sub_hi);
    m_lo = mn_lo;
    m_hi = mn_hi;
    float rs_lo = 0.0f, rs_hi = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - sub_lo);
      s[nt][1] = exp2f(s[nt][1] - sub_lo);
      s[nt][2] = exp2f(s[nt][2] - sub_hi);
      s[nt][3] = exp2f(s[nt][3] - sub_hi);
      rs_lo += s[nt][0] + s[nt][1];
      rs_hi += s[nt][2] + s[nt][3];
    }
    l_lo = l_lo * al_lo + rs_lo;
    l_hi = l_hi * al_hi + rs_hi;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      o[dn][0] *= al_lo;
      o[dn][1] *= al_lo;
      o[dn][2] *= al_hi;
      o[dn][3] *= al_hi;
    }
    gemm_p_tile<D, kBf16>(o, s, Vt);
    __syncthreads();  // the stage just read is the next iteration's load target
  }

  l_lo = quad_sum(l_lo);
  l_hi = quad_sum(l_hi);
  const int64_t ostride = a.NH * D;
  store_rows<D, kBf16>(a.out + b * T * ostride + h * D, ostride, row_lo, T, o, l_lo > 0.0f ? 1.0f / l_lo : 0.0f,
                       l_hi > 0.0f ? 1.0f / l_hi : 0.0f);
  if (lane % 4 == 0) {
    float* lse = a.lse + (b * a.NH + h) * T;
    if (row_lo < T) lse[row_lo] = l_lo > 0.0f ? (m_lo + log2f(l_lo)) * kLn2 : -INFINITY;
    if (row_hi < T) lse[row_hi] = l_hi > 0.0f ? (m_hi + log2f(l_hi)) * kLn2 : -INFINITY;
  }
}

// ---- backward ---------------------------------------------------------------------------------------------

// dvec[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] (f32, fixed order: lane-strided, then the warp tree).
template <bool kBf16>
__global__ void flash_rowdot_kernel(float* __restrict__ dvec, const uint16_t* __restrict__ out,
                                    const uint16_t* __restrict__ dout, int64_t B, int64_t T, int64_t NH, int D) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= B * T * NH) return;
  const int64_t h = w % NH, bt = w / NH;  // bt = b * T + i
  const uint16_t* o = out + bt * NH * D + h * D;
  const uint16_t* g = dout + bt * NH * D + h * D;
  float s = 0.0f;
  for (int d = lane; d < D; d += 32) s += to_f32<kBf16>(o[d]) * to_f32<kBf16>(g[d]);
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, off);
  if (lane == 0) dvec[(bt / T * NH + h) * T + bt % T] = s;
}

// P (or P^T) of one 16 x 64 score tile in place: exp(s * scale - lse) in the log2 domain, 0 where masked.
// Rows of the tile are `rows_lo/hi` (the warp's two rows), columns j0 + 8 nt + 2c (+1); transposed: rows are
// keys and columns queries (causal: key > query is masked).
template <bool kTransposed>
__device__ __forceinline__ void softmax_tile(float (&s)[8][4], float sl2, const float* lse2_cols, float lse2_lo,
                                             float lse2_hi, int64_t r_lo, int64_t j0, int64_t T, bool causal,
                                             bool edge) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int jc = nt * 8 + (lane % 4) * 2 + (c & 1);
      const int64_t j = j0 + jc, r = r_lo + (c < 2 ? 0 : 8);
      const float lse2 = kTransposed ? lse2_cols[jc] : (c < 2 ? lse2_lo : lse2_hi);
      float p = exp2f(s[nt][c] * sl2 - lse2);
      if (edge) {
        const int64_t q = kTransposed ? j : r, k = kTransposed ? r : j;
        if (j >= T || (causal && k > q)) p = 0.0f;
      }
      s[nt][c] = p;
    }
  }
}

// dS = P * (dP - Dv) in place in dp (P in p), Dv per query: rows (dQ kernel) or columns (dK/dV kernel).
template <bool kTransposed>
__device__ __forceinline__ void dsoftmax_tile(float (&dp)[8][4], const float (&p)[8][4], const float* dv_cols,
                                              float dv_lo, float dv_hi) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float dv = kTransposed ? dv_cols[nt * 8 + (lane % 4) * 2 + (c & 1)] : (c < 2 ? dv_lo : dv_hi);
      dp[nt][c] = p[nt][c] * (dp[nt][c] - dv);
    }
}

// grid (key tiles, NKV, B). Shared: K, V (64 x LD), then 2 stages of Q, dO (64 x LD) and lse2, Dv (64 f32).
template <int D, bool kBf16>
__global__ void __launch_bounds__(kBlock) flash_dkdv_kernel(Args a) {
  constexpr int LD = D + kPad;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* Vs = Ks + kTile * LD;
  uint16_t* Qs = Vs + kTile * LD;        // 2 stages
  uint16_t* Gs = Qs + 2 * kTile * LD;    // dO, 2 stages
  float* Ls = reinterpret_cast<float*>(Gs + 2 * kTile * LD);  // lse2, 2 stages
  float* Ds = Ls + 2 * kTile;                                  // Dv, 2 stages
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t T = a.T, b = blockIdx.z, grp = blockIdx.y, j0 = int64_t(blockIdx.x) * kTile;
  const uint16_t* base = a.qkv + b * T * a.stride;
  const uint16_t* kg = base + k_col<D>(a, grp);
  const uint16_t* vg = kg + D;
  const int64_t ostride = a.NH * D;
  const uint16_t* gbase = a.dout + b * T * ostride;
  const int64_t qt0 = a.causal ? j0 / kTile : 0, nqt = (T + kTile - 1) / kTile;
  const int64_t steps = a.G * (nqt - qt0);  // (head, query tile) pairs, head-major

  load_tile<D>(Ks, kg, a.stride, j0, T);
  load_tile<D>(Vs, vg, a.stride, j0, T);
  auto stage_in = [&](int64_t step, int st) {
    const int64_t h = grp * a.G + step / (nqt - qt0), i0 = (qt0 + step % (nqt - qt0)) * kTile;
    load_tile<D>(Qs + st * kTile * LD, base + q_col<D>(a, h), a.stride, i0, T);
    load_tile<D>(Gs + st * kTile * LD, gbase + h * D, ostride, i0, T);
    for (int r = threadIdx.x; r < kTile; r += kBlock) {
      const bool ok = i0 + r < T;
      const int64_t idx = (b * a.NH + h) * T + i0 + r;
      Ls[st * kTile + r] = ok ? a.lse[idx] * kLog2e : INFINITY;  // +inf: P = 0 on padding rows
      Ds[st * kTile + r] = ok ? a.dvec[idx] : 0.0f;
    }
  };
  stage_in(0, 0);
  cp_commit();

  const float sl2 = a.scale * kLog2e;
  const int64_t key_lo = j0 + warp * 16 + lane / 4;
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk[dn][c] = dv[dn][c] = 0.0f;

  for (int64_t step = 0; step < steps; ++step) {
    const int st = int(step & 1);
    if (step + 1 < steps) {
      stage_in(step + 1, st ^ 1);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const uint16_t* Qt = Qs + st * kTile * LD;
    const uint16_t* Gt = Gs + st * kTile * LD;
    const int64_t i0 = (qt0 + step % (nqt - qt0)) * kTile;
    const bool edge = (a.causal && j0 + kTile - 1 > i0) || i0 + kTile > T;

    float p[8][4];  // P^T: 16 keys x 64 queries
    gemm_rows_smem<D, kBf16>(p, Ks, warp * 16, Qt);
    softmax_tile<true>(p, sl2, Ls + st * kTile, 0.0f, 0.0f, key_lo, i0, T, a.causal, edge);
    gemm_p_tile<D, kBf16>(dv, p, Gt);  // dV += P^T dO
    float ds[8][4];  // dP^T = V dO^T, then dS^T
    gemm_rows_smem<D, kBf16>(ds, Vs, warp * 16, Gt);
    dsoftmax_tile<true>(ds, p, Ds + st * kTile, 0.0f, 0.0f);
    gemm_p_tile<D, kBf16>(dk, ds, Qt);  // dK += dS^T Q
    __syncthreads();
  }

  uint16_t* dbase = a.out + b * T * a.stride;
  uint16_t* dkg = dbase + k_col<D>(a, grp);
  store_rows<D, kBf16>(dkg, a.stride, key_lo, T, dk, a.scale, a.scale);
  store_rows<D, kBf16>(dkg + D, a.stride, key_lo, T, dv, 1.0f, 1.0f);
}

// grid (query tiles, NH, B). Shared: Q, dO (64 x LD), then 2 stages of K, V.
template <int D, bool kBf16>
__global__ void __launch_bounds__(kBlock) flash_dq_kernel(Args a) {
  constexpr int LD = D + kPad;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* Gs = Qs + kTile * LD;
  uint16_t* Ks = Gs + kTile * LD;       // 2 stages
  uint16_t* Vs = Ks + 2 * kTile * LD;   // 2 stages
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t T = a.T, b = blockIdx.z, h = blockIdx.y;
  const int64_t qt = a.causal ? int64_t(gridDim.x) - 1 - blockIdx.x : blockIdx.x;
  const int64_t i0 = qt * kTile;
  const uint16_t* base = a.qkv + b * T * a.stride;
  const uint16_t* kg = base + k_col<D>(a, h / a.G);
  const uint16_t* vg = kg + D;
  const int64_t ostride = a.NH * D;
  const int64_t kend = a.causal ? min(T, i0 + kTile) : T;
  const int ntiles = int((kend + kTile - 1) / kTile);

  load_tile<D>(Qs, base + q_col<D>(a, h), a.stride, i0, T);
  load_tile<D>(Gs, a.dout + b * T * ostride + h * D, ostride, i0, T);
  load_tile<D>(Ks, kg, a.stride, 0, T);
  load_tile<D>(Vs, vg, a.stride, 0, T);
  cp_commit();

  const int64_t row_lo = i0 + warp * 16 + lane / 4, row_hi = row_lo + 8;
  const int64_t lrow = (b * a.NH + h) * T;
  const float lse2_lo = row_lo < T ? a.lse[lrow + row_lo] * kLog2e : INFINITY;
  const float lse2_hi = row_hi < T ? a.lse[lrow + row_hi] * kLog2e : INFINITY;
  const float dv_lo = row_lo < T ? a.dvec[lrow + row_lo] : 0.0f;
  const float dv_hi = row_hi < T ? a.dvec[lrow + row_hi] : 0.0f;
  const float sl2 = a.scale * kLog2e;
  uint32_t qf[D / 16][4], gf[D / 16][4];
  float dq[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) dq[dn][0] = dq[dn][1] = dq[dn][2] = dq[dn][3] = 0.0f;

  for (int t = 0; t < ntiles; ++t) {
    const int st = t & 1;
    next_kv_stage<D>(Ks, Vs, kg, vg, a.stride, t, ntiles, T);
    if (t == 0) {
      load_a_frags<D>(qf, Qs, warp * 16);
      load_a_frags<D>(gf, Gs, warp * 16);
    }
    const uint16_t* Kt = Ks + st * kTile * LD;
    const uint16_t* Vt = Vs + st * kTile * LD;
    const int64_t j0 = int64_t(t) * kTile;
    const bool edge = (a.causal && j0 + kTile - 1 > i0) || j0 + kTile > T;

    float p[8][4];
    gemm_rows<D, kBf16>(p, qf, Kt);
    softmax_tile<false>(p, sl2, nullptr, lse2_lo, lse2_hi, row_lo, j0, T, a.causal, edge);
    float ds[8][4];
    gemm_rows<D, kBf16>(ds, gf, Vt);  // dP = dO V^T
    dsoftmax_tile<false>(ds, p, nullptr, dv_lo, dv_hi);
    gemm_p_tile<D, kBf16>(dq, ds, Kt);  // dQ += dS K
    __syncthreads();
  }
  store_rows<D, kBf16>(a.out + b * T * a.stride + q_col<D>(a, h), a.stride, row_lo, T, dq, a.scale, a.scale);
}

// ---- launchers --------------------------------------------------------------------------------------------

size_t fwd_smem(int D) { return size_t(5) * kTile * (D + kPad) * 2; }
size_t dq_smem(int D) { return size_t(6) * kTile * (D + kPad) * 2; }
size_t dkdv_smem(int D) { return size_t(6) * kTile * (D + kPad) * 2 + size_t(4) * kTile * 4; }

template <typename Kernel>
void prepare(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    LOOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

Args make_args(const attn_detail::Problem& pb) {
  Args a{};
  a.qkv = static_cast<const uint16_t*>(pb.q.raw());
  a.T = pb.Tq;
  a.NH = pb.NH;
  a.G = pb.NH / pb.NKV;
  a.stride = pb.q.size(2);
  a.scale = pb.scale;
  a.causal = pb.causal;
  return a;
}

template <int D, bool kBf16>
void run_forward(const CudaContext& ctx, Args a, const attn_detail::Problem& pb) {
  auto kernel = flash_fwd_kernel<D, kBf16>;
  const size_t bytes = fwd_smem(D);
  prepare(kernel, bytes);
  const dim3 grid(unsigned((pb.Tq + kTile - 1) / kTile), unsigned(pb.NH), unsigned(pb.B));
  kernel<<<grid, kBlock, bytes, ctx.compute_stream()>>>(a);
  LOOM_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool eligible(const attn_detail::Problem& pb, TensorView out) {
  const DType dt = pb.q.dtype();
  if (dt != DType::kBF16 && dt != DType::kF16) return false;
  if (out.dtype() != dt) return false;
  if (pb.HS != 64 && pb.HS != 128) return false;
  if (pb.q.raw() != pb.kv.raw() || pb.Tq != pb.Tk || pb.kv_g != pb.NH / pb.NKV) return false;
  if (pb.q_pos || pb.k_pos || pb.q_seg || pb.k_seg || pb.window > 0 || pb.dropout_p > 0.0f) return false;
  if (pb.B > 65535 || pb.NH > 65535) return false;
  return aligned16(pb.q.raw()) && aligned16(out.raw()) && (pb.q.size(2) * 2) % 16 == 0;
}

void forward(const CudaContext& ctx, const attn_detail::Problem& pb, TensorView out, TensorView lse) {
  if (pb.B == 0 || pb.Tq == 0) return;
  Args a = make_args(pb);
  a.out = static_cast<uint16_t*>(out.raw());
  a.lse = static_cast<float*>(lse.raw());
  const bool bf16 = pb.q.dtype() == DType::kBF16;
  if (pb.HS == 64) bf16 ? run_forward<64, true>(ctx, a, pb) : run_forward<64, false>(ctx, a, pb);
  else bf16 ? run_forward<128, true>(ctx, a, pb) : run_forward<128, false>(ctx, a, pb);
}

void backward(const CudaContext& ctx, const attn_detail::Problem& pb, TensorView dqkv, TensorView dout,
              TensorView out, TensorView lse) {
  if (pb.B == 0 || pb.Tq == 0) return;
  LOOM_CHECK(aligned16(dqkv.raw()) && aligned16(dout.raw()), "[attention_backward] flash path needs 16-byte aligned "
             "dqkv and dout");
  const cudaStream_t st = ctx.compute_stream();
  Tensor dvec = scratch(ctx, Shape{pb.B, pb.NH, pb.Tq}, DType::kF32);
  Args a = make_args(pb);
  a.out = static_cast<uint16_t*>(dqkv.raw());
  a.dout = static_cast<const uint16_t*>(dout.raw());
  a.lse = static_cast<float*>(lse.raw());
  a.dvec = static_cast<const float*>(dvec.raw());
  const bool bf16 = pb.q.dtype() == DType::kBF16;
  const int D = int(pb.HS);
  const int64_t rows = pb.B * pb.Tq * pb.NH;
  const unsigned rgrid = unsigned((rows * 32 + 255) / 256);
  const auto* o = static_cast<const uint16_t*>(out.raw());
  if (bf16)
    flash_rowdot_kernel<true><<<rgrid, 256, 0, st>>>(static_cast<float*>(dvec.raw()), o, a.dout, pb.B, pb.Tq, pb.NH, D);
  else
    flash_rowdot_kernel<false><<<rgrid, 256, 0, st>>>(static_cast<float*>(dvec.raw()), o, a.dout, pb.B, pb.Tq, pb.NH,
                                                      D);
  LOOM_CUDA_LAUNCH_CHECK();
  const unsigned qtiles = unsigned((pb.Tq + kTile - 1) / kTile);
  auto launch = [&](auto dkdv, auto dq) {
    prepare(dkdv, dkdv_smem(D));
    prepare(dq, dq_smem(D));
    dkdv<<<dim3(qtiles, unsigned(pb.NKV), unsigned(pb.B)), kBlock, dkdv_smem(D), st>>>(a);
    LOOM_CUDA_LAUNCH_CHECK();
    dq<<<dim3(qtiles, unsigned(pb.NH), unsigned(pb.B)), kBlock, dq_smem(D), st>>>(a);
    LOOM_CUDA_LAUNCH_CHECK();
  };
  if (D == 64) {
    if (bf16) launch(flash_dkdv_kernel<64, true>, flash_dq_kernel<64, true>);
    else launch(flash_dkdv_kernel<64, false>, flash_dq_kernel<64, false>);
  } else {
    if (bf16) launch(flash_dkdv_kernel<128, true>, flash_dq_kernel<128, true>);
    else launch(flash_dkdv_kernel<128, false>, flash_dq_kernel<128, false>);
  }
}

}  // namespace loom::cuda::flash
