// Backward kernels of the register-tiled flash attention (design at the top of flash_attention.cu; building
// blocks in flash_tiles.cuh): Dv = rowsum(dO * O) by the general attention's row-dot launcher, then a dK/dV
// kernel per (64-key tile, kv group, batch row) and a dQ kernel per (64-query tile, head, batch row), each
// output row written once after a fixed-order sum (deterministic, no float atomics).
#include "backend/cuda/flash_attention.cuh"

#include "backend/cuda/flash_tiles.cuh"
#include "backend/cuda/vec_io.cuh"

namespace loom::cuda::flash {

namespace {

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

}  // namespace

void backward(const CudaContext& ctx, const attn_detail::Problem& pb, TensorView dqkv, TensorView dout,
              TensorView out, TensorView lse) {
  if (pb.B == 0 || pb.Tq == 0) return;
  const cudaStream_t st = ctx.compute_stream();
  Tensor dvec = scratch(ctx, Shape{pb.B, pb.NH, pb.Tq}, DType::kF32);
  Args a = make_args(pb);
  a.out = static_cast<uint16_t*>(dqkv.raw());
  a.dout = static_cast<const uint16_t*>(dout.raw());
  a.lse = static_cast<float*>(lse.raw());
  a.dvec = static_cast<const float*>(dvec.raw());
  const bool bf16 = pb.q.dtype() == DType::kBF16;
  const int D = int(pb.HS);
  attn_detail::row_dot(ctx, dvec, out, dout, pb.B, pb.Tq, pb.NH, pb.HS);
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
