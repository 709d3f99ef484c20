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

#include "backend/cuda/flash_tiles.cuh"
#include "backend/cuda/vec_io.cuh"

namespace loom::cuda::flash {

namespace {

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

bool eligible(const attn_detail::Problem& pb, std::initializer_list<TensorView> tensors) {
  const DType dt = pb.q.dtype();
  if (dt != DType::kBF16 && dt != DType::kF16) return false;
  if (pb.HS != 64 && pb.HS != 128) return false;
  if (pb.q.raw() != pb.kv.raw() || pb.Tq != pb.Tk || pb.kv_g != pb.NH / pb.NKV) return false;
  if (pb.q_pos || pb.k_pos || pb.q_seg || pb.k_seg || pb.window > 0 || pb.dropout_p > 0.0f) return false;
  if (pb.B > 65535 || pb.NH > 65535) return false;
  if (!aligned16(pb.q.raw()) || (pb.q.size(2) * 2) % 16 != 0) return false;
  for (TensorView t : tensors)
    if (t.dtype() != dt || !aligned16(t.raw())) return false;
  return true;
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

}  // namespace loom::cuda::flash
