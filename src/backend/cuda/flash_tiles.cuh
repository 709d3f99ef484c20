// Device building blocks of the register-tiled flash attention (flash_attention.cu: forward and eligibility,
// flash_attention_bwd.cu: backward): the kernel argument struct, PTX wrappers (ldmatrix, mma.sync m16n8k16,
// cp.async), tile staging, the warp-level block products, the softmax of a score tile, row stores, and the
// host-side launch helpers. Included by those two files only, so its contents stay in each translation
// unit's anonymous namespace, exactly as if written there. The design is at the top of flash_attention.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/device_utils.cuh"

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

// ---- host-side launch helpers ------------------------------------------------------------------------------

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

}  // namespace
}  // namespace loom::cuda::flash
