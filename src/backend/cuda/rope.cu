// CUDA rotary position embedding on the q and k heads of a grouped qkv tensor, in place (forward), and its
// transpose on dq and dk (backward). CPU twin: src/backend/cpu/rope.cpp, whose layout and formulas these are:
// row (b, t) rotates by the angles of position p = position_ids[b, t] (or t); channel pairs (c, c + rd/2)
// (rotate_half) or (2c, 2c + 1) (interleaved), both with frequency index c:
//   forward   y1 = x1 cos − x2 sin,  y2 = x2 cos + x1 sin
//   backward  the same with sin negated (exact), i.e. the rotation by −angle.
// The G = NH/NKV query heads of a group are followed by its key head, so the rotated heads of group g are the
// G + 1 consecutive heads starting at head g·(G + 2); the v heads and channels [rd, HS) are never touched.
// Invariants:
//   - a thread owns W pairs of one head of one row: it reads both halves before writing either, and no other
//     thread touches them (in-place safe, launch-shape independent);
//   - W pairs move as 16-byte packs when the pointer, HS and rd/2 allow it, else W = 1;
//   - position ids live on the device: the host cannot check them without a copy and a sync, so the data
//     loader guarantees 0 <= id < max_positions, and the kernel skips (leaves untouched) a row whose id is out
//     of range rather than read outside the tables. Without ids, T <= max_positions is checked on the host.
#include <cstdint>
#include <utility>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/pack.cuh"

namespace loom::cuda {

namespace {

struct RopeGeometry {
  int64_t B = 0, T = 0, NKV = 0, G = 0, HS = 0;
  int64_t half = 0;  // rotary_dim / 2: pairs per head
  int64_t row = 0;   // NKV * (G + 2) * HS: elements per (b, t) row
  int64_t max_pos = 0;
  bool interleaved = false;
  DType dt = DType::kF32;
};

// Work item v: pairs [j·W, j·W + W) of rotated head h of row bt, v = (bt · heads + h) · (half / W) + j.
template <typename T, bool Interleaved, int W>
__global__ void rope_kernel(T* qkv, const float* cos, const float* sin, const int32_t* ids, RopeGeometry g,
                            float sign) {
  const int64_t per_head = g.half / W, heads = g.NKV * (g.G + 1);
  const int64_t total = g.B * g.T * heads * per_head;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < total; v += stride) {
    const int64_t rest = v / per_head, j = v - rest * per_head;
    const int64_t bt = rest / heads, h = rest - bt * heads;
    const int64_t p = ids ? int64_t(ids[bt]) : bt % g.T;
    if (p < 0 || p >= g.max_pos) continue;  // out-of-range device id: leave the row alone (see the header)
    const int64_t i0 = j * W;
    const float* c = cos + p * g.half + i0;
    const float* s = sin + p * g.half + i0;
    T* x = qkv + bt * g.row + ((h / (g.G + 1)) * (g.G + 2) + h % (g.G + 1)) * g.HS;
    if constexpr (Interleaved) {
      Pack<T, 2 * W> a = load_pack<T, 2 * W>(x + 2 * i0);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float x1 = load(a.v[2 * k]), x2 = load(a.v[2 * k + 1]), sn = sign * s[k];
        a.v[2 * k] = store<T>(x1 * c[k] - x2 * sn);
        a.v[2 * k + 1] = store<T>(x2 * c[k] + x1 * sn);
      }
      store_pack<T, 2 * W>(x + 2 * i0, a);
    } else {
      Pack<T, W> a = load_pack<T, W>(x + i0);
      Pack<T, W> b = load_pack<T, W>(x + g.half + i0);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float x1 = load(a.v[k]), x2 = load(b.v[k]), sn = sign * s[k];
        a.v[k] = store<T>(x1 * c[k] - x2 * sn);
        b.v[k] = store<T>(x2 * c[k] + x1 * sn);
      }
      store_pack<T, W>(x + i0, a);
      store_pack<T, W>(x + g.half + i0, b);
    }
  }
}

// The geometry of a call whose arguments the OpTable entry point has checked. Device position ids are not
// range-checked (that needs a copy and a sync): the kernel leaves a row with an out-of-range id untouched.
RopeGeometry make_geometry(TensorView qkv, TensorView cos, const AttentionParams& p, const RopeParams& r) {
  RopeGeometry g;
  g.B = qkv.size(0);
  g.T = qkv.size(1);
  g.NKV = p.num_kv_heads;
  g.G = p.num_heads / p.num_kv_heads;
  g.HS = p.head_dim;
  g.half = r.rotary_dim / 2;
  g.row = g.NKV * (g.G + 2) * g.HS;
  g.interleaved = r.interleaved;
  g.dt = qkv.dtype();
  g.max_pos = cos.size(0);
  return g;
}

template <typename T, bool Interleaved, int W>
void launch(const CudaContext& ctx, const RopeGeometry& g, TensorView qkv, TensorView cos, TensorView sin,
            TensorView ids, float sign) {
  const int64_t total = g.B * g.T * g.NKV * (g.G + 1) * (g.half / W);
  rope_kernel<T, Interleaved, W><<<grid_for(total), kThreads, 0, ctx.compute_stream()>>>(
      ptr<T>(qkv), cptr<float>(cos), cptr<float>(sin), ids.defined() ? cptr<int32_t>(ids) : nullptr, g, sign);
  LOOM_CUDA_LAUNCH_CHECK();
}

void run(const CudaContext& ctx, const char* op, TensorView qkv, TensorView cos, TensorView sin,
         const AttentionParams& p, const RopeParams& r, TensorView position_ids, float sign) {
  const RopeGeometry g = make_geometry(qkv, cos, p, r);
  if (g.B * g.T == 0) return;
  const bool base_aligned = reinterpret_cast<uintptr_t>(qkv.raw()) % 16 == 0;
  dispatch_float(g.dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    if (g.interleaved) {
      // W pairs = 2W contiguous elements = one 16-byte pack; every head start must be pack-aligned.
      constexpr int W = V / 2;
      if (base_aligned && g.HS % V == 0 && g.half % W == 0)
        launch<T, true, W>(ctx, g, qkv, cos, sin, position_ids, sign);
      else
        launch<T, true, 1>(ctx, g, qkv, cos, sin, position_ids, sign);
    } else {
      // W pairs = one 16-byte pack in each half; head starts and the second half (offset rd/2) pack-aligned.
      if (base_aligned && g.HS % V == 0 && g.half % V == 0)
        launch<T, false, V>(ctx, g, qkv, cos, sin, position_ids, sign);
      else
        launch<T, false, 1>(ctx, g, qkv, cos, sin, position_ids, sign);
    }
  });
}

}  // namespace

void rope_forward(const CudaContext& ctx, TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p,
                  const RopeParams& r, TensorView position_ids) {
  run(ctx, "rope_forward", qkv, cos, sin, p, r, position_ids, 1.0f);
}

void rope_backward(const CudaContext& ctx, TensorView dqkv, TensorView cos, TensorView sin, const AttentionParams& p,
                   const RopeParams& r, TensorView position_ids) {
  run(ctx, "rope_backward", dqkv, cos, sin, p, r, position_ids, -1.0f);
}

}  // namespace loom::cuda
