// CUDA elementwise ops (src/backend/cuda/elementwise.cu, glu.cu, rope.cu, dropout.cu) against the CPU
// reference on identical inputs: residual add, GeLU, bias add / bias gradient, SwiGLU/GeGLU/ReGLU, RoPE and
// hidden dropout, in f32, bf16 and f16, on odd sizes (1, 5, 217, 1000003) and on views shifted by one element
// (so the scalar fallbacks run as well as the 16-byte paths). Checked:
//   - values within per-dtype tolerances; bias_backward with an f32 dbias bit-identical (it sums in the CPU's
//     order) and accumulating into a pre-filled dbias; runs repeated give the same bytes;
//   - aliasing allowed by ops.h: gelu_backward and dropout with dinp = dout, glu_backward with dinp = inp;
//   - dropout outputs BYTE-identical to the CPU (same Philox mask, same f32 scale) for p in {0, 0.1, 0.5}
//     and offsets that start inside a Philox block;
//   - rope with and without position ids, rotate_half and interleaved, partial rotary, MHA/GQA/MQA; a device
//     position id outside the tables leaves its row untouched without faulting;
//   - argument errors throw before any launch.
// Every test skips when no GPU is visible.
#include <gtest/gtest.h>

#if defined(LOOM_HAVE_CUDA)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/elementwise.cuh"
#include "cuda_test_util.h"
#include "loom/core/check.h"

namespace loom::test {
namespace {

const DType kDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const int64_t kSizes[] = {1, 5, 217, 1000003};

std::string label(DType dt, int64_t n, int64_t off) {
  return std::string(dtype_name(dt)) + " n=" + std::to_string(n) + " view offset " + std::to_string(off);
}

// A device copy of `host` placed `off` elements into a larger buffer: off = 1 misaligns the view (scalar
// fallback paths), off = 0 allows the vectorised ones.
struct DevBuf {
  Tensor storage;
  TensorView view;
};
DevBuf device_at(const Tensor& host, int64_t off) {
  DevBuf d;
  d.storage = Tensor::empty(Shape({host.numel() + off}), host.dtype(), cuda_ctx().device());
  d.view = d.storage.view().slice_flat(off, host.shape());
  cuda_ctx().copy(d.view, host);
  return d;
}

const cuda::CudaContext& ctx() { return cuda_ctx(); }

// ---- residual, GeLU ------------------------------------------------------------------------------------

TEST(CudaElementwise, ResidualMatchesCpu) {
  REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (int64_t n : kSizes)
      for (int64_t off : {0, 1}) {
        const Tensor a = random_host({n}, dt, 1), b = random_host({n}, dt, 2);
        Tensor ref = Tensor::empty({n}, dt);
        cpu_ref().residual_forward(ref, a, b);
        DevBuf da = device_at(a, off), db = device_at(b, off), dout = device_at(random_host({n}, dt, 3), off);
        cuda::residual_forward(ctx(), dout.view, da.view, db.view);
        expect_close(dout.view, ref, default_tol(dt), "residual " + label(dt, n, off));
      }
}

TEST(CudaElementwise, GeluForwardBackwardMatchCpu) {
  REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (int64_t n : kSizes)
      for (int64_t off : {0, 1}) {
        const Tensor x = random_host({n}, dt, 11, -6.0f, 6.0f), dy = random_host({n}, dt, 12);
        Tensor out_ref = Tensor::empty({n}, dt), dx_ref = Tensor::empty({n}, dt);
        cpu_ref().gelu_forward(out_ref, x);
        cpu_ref().gelu_backward(dx_ref, x, dy);
        DevBuf dx_in = device_at(x, off), dout = device_at(random_host({n}, dt, 13), off);
        cuda::gelu_forward(ctx(), dout.view, dx_in.view);
        expect_close(dout.view, out_ref, default_tol(dt), "gelu_forward " + label(dt, n, off));
        // Out of place, then in place (dinp = dout).
        DevBuf ddy = device_at(dy, off), ddx = device_at(random_host({n}, dt, 14), off);
        cuda::gelu_backward(ctx(), ddx.view, dx_in.view, ddy.view);
        expect_close(ddx.view, dx_ref, default_tol(dt), "gelu_backward " + label(dt, n, off));
        cuda::gelu_backward(ctx(), ddy.view, dx_in.view, ddy.view);
        expect_close(ddy.view, dx_ref, default_tol(dt), "gelu_backward in place " + label(dt, n, off));
      }
}

TEST(CudaElementwise, RejectsBadArguments) {
  REQUIRE_GPU();
  Tensor a = to_device(random_host({5}, DType::kF32, 1)), b = to_device(random_host({6}, DType::kF32, 2));
  Tensor h = random_host({5}, DType::kF32, 3);
  Tensor bf = to_device(random_host({5}, DType::kBF16, 4));
  EXPECT_THROW(cuda_ops().residual_forward(a, a, b), Error);   // element counts differ
  EXPECT_THROW(cuda_ops().residual_forward(a, a, bf), Error);  // dtypes differ
  EXPECT_THROW(cuda_ops().residual_forward(a, a, h), Error);   // host tensor
  EXPECT_THROW(cuda_ops().gelu_forward(a, TensorView()), Error);
  EXPECT_THROW(cuda_ops().bias_add_forward(a, to_device(random_host({3}, DType::kF32, 5))), Error);
  EXPECT_THROW(cuda_ops().bias_backward(to_device(random_host({2}, DType::kF32, 6)), a), Error);
  // A bf16 dbias for f32 dout, and a bf16 bias for an f16 out, are not allowed.
  EXPECT_THROW(cuda_ops().bias_backward(to_device(random_host({5}, DType::kBF16, 7)), a), Error);
  EXPECT_THROW(cuda_ops().bias_add_forward(to_device(random_host({5}, DType::kF16, 8)), bf), Error);
}

// ---- bias add and bias gradient -----------------------------------------------------------------------

struct DtPair {
  DType a, b;
};
const int64_t kBiasShapes[][2] = {{1, 1}, {5, 7}, {217, 24}, {64, 3}, {65, 3}, {1000, 5}, {4099, 33}, {3, 1000003}};

TEST(CudaElementwise, BiasAddMatchesCpu) {
  REQUIRE_GPU();
  // (out dtype, bias dtype) as the CPU accepts them.
  const DtPair combos[] = {{DType::kF32, DType::kF32},  {DType::kBF16, DType::kBF16}, {DType::kF16, DType::kF16},
                           {DType::kBF16, DType::kF32}, {DType::kF16, DType::kF32},   {DType::kF32, DType::kBF16},
                           {DType::kF32, DType::kF16}};
  for (const DtPair& dp : combos)
    for (const auto& s : kBiasShapes)
      for (int64_t off : {0, 1}) {
        const int64_t N = s[0], C = s[1];
        const Tensor out0 = random_host({N, C}, dp.a, 21), bias = random_host({C}, dp.b, 22);
        Tensor ref = host_clone(out0);
        cpu_ref().bias_add_forward(ref, bias);
        DevBuf dout = device_at(out0, off), dbias = device_at(bias, off);
        cuda::bias_add_forward(ctx(), dout.view, dbias.view);
        expect_close(dout.view, ref, default_tol(dp.a),
                     std::string("bias_add bias ") + dtype_name(dp.b) + " out " + label(dp.a, N * C, off) +
                         " C=" + std::to_string(C));
      }
}

TEST(CudaElementwise, BiasBackwardAccumulatesLikeCpu) {
  REQUIRE_GPU();
  // (dout dtype, dbias dtype): f32 main grads or grads in the compute dtype.
  const DtPair combos[] = {{DType::kF32, DType::kF32},  {DType::kBF16, DType::kF32}, {DType::kF16, DType::kF32},
                           {DType::kBF16, DType::kBF16}, {DType::kF16, DType::kF16}};
  for (const DtPair& dp : combos)
    for (const auto& s : kBiasShapes)
      for (int64_t off : {0, 1}) {
        const int64_t N = s[0], C = s[1];
        const std::string what = std::string("bias_backward dbias ") + dtype_name(dp.b) + " dout " +
                                 label(dp.a, N * C, off) + " C=" + std::to_string(C);
        const Tensor dy = random_host({N, C}, dp.a, 31), db0 = random_host({C}, dp.b, 32);  // db0: accumulate
        Tensor ref = host_clone(db0);
        cpu_ref().bias_backward(ref, dy);
        DevBuf ddy = device_at(dy, off), ddb = device_at(db0, off);
        cuda::bias_backward(ctx(), ddb.view, ddy.view);
        const Tensor got = to_host(ddb.view);
        if (dp.b == DType::kF32) {
          // 64-row f32 partials in row order, then f64 over the blocks: the CPU's order, so the same bits.
          EXPECT_TRUE(same_bytes(got, ref)) << what;
        }
        expect_close(got, ref, default_tol(dp.b), what);
        // Deterministic: the same start gives the same bytes.
        DevBuf again = device_at(db0, off);
        cuda::bias_backward(ctx(), again.view, ddy.view);
        EXPECT_TRUE(same_bytes(to_host(again.view), got)) << what << " (second run)";
      }
}

// ---- GLU -----------------------------------------------------------------------------------------------

const GluKind kKinds[] = {GluKind::kSwiGLU, GluKind::kGeGLU, GluKind::kReGLU};
std::string kind_name(GluKind k) {
  return k == GluKind::kSwiGLU ? "swiglu" : k == GluKind::kGeGLU ? "geglu" : "reglu";
}

TEST(CudaGlu, ForwardBackwardMatchCpu) {
  REQUIRE_GPU();
  const int64_t shapes[][2] = {{1, 1}, {5, 5}, {3, 217}, {4, 64}, {7, 24}, {1, 1000003}};
  for (GluKind k : kKinds)
    for (DType dt : kDtypes)
      for (const auto& s : shapes)
        for (int64_t off : {0, 1}) {
          const int64_t N = s[0], F = s[1];
          const std::string what = kind_name(k) + " " + dtype_name(dt) + " N=" + std::to_string(N) +
                                   " F=" + std::to_string(F) + " view offset " + std::to_string(off);
          const Tensor x = random_host({N, 2 * F}, dt, 41, -4.0f, 4.0f), dy = random_host({N, F}, dt, 42);
          Tensor out_ref = Tensor::empty({N, F}, dt), dx_ref = Tensor::empty({N, 2 * F}, dt);
          cpu_ref().glu_forward(out_ref, x, k);
          cpu_ref().glu_backward(dx_ref, x, dy, k);

          DevBuf dx = device_at(x, off), dout = device_at(random_host({N, F}, dt, 43), off);
          cuda::glu_forward(ctx(), dout.view, dx.view, k);
          expect_close(dout.view, out_ref, default_tol(dt), "glu_forward " + what);

          DevBuf ddy = device_at(dy, off), ddx = device_at(random_host({N, 2 * F}, dt, 44), off);
          cuda::glu_backward(ctx(), ddx.view, dx.view, ddy.view, k);
          expect_close(ddx.view, dx_ref, default_tol(dt), "glu_backward " + what);
          // In place: dinp is inp.
          cuda::glu_backward(ctx(), dx.view, dx.view, ddy.view, k);
          expect_close(dx.view, dx_ref, default_tol(dt), "glu_backward in place " + what);
        }
}

// GeGLU with up = 1 is gelu_forward bit for bit (one GeLU formula on the GPU too).
TEST(CudaGlu, GeGluWithUnitUpIsGelu) {
  REQUIRE_GPU();
  const int64_t N = 3, F = 217;
  for (DType dt : kDtypes) {
    Tensor x = random_host({N, 2 * F}, dt, 51, -6.0f, 6.0f), g = Tensor::empty({N, F}, dt);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < F; ++c) {
        host_set(x, r * 2 * F + F + c, 1.0f);
        host_set(g, r * F + c, host_get(x, r * 2 * F + c));
      }
    Tensor dx = to_device(x), dg = to_device(g);
    Tensor a = Tensor::empty({N, F}, dt, ctx().device()), b = Tensor::empty({N, F}, dt, ctx().device());
    cuda::glu_forward(ctx(), a, dx, GluKind::kGeGLU);
    cuda::gelu_forward(ctx(), b, dg);
    EXPECT_TRUE(same_bytes(to_host(a), to_host(b))) << dtype_name(dt);
  }
}

// The backward ops' `out` (the activation recomputed alongside the gradient) through the CUDA OpTable: out is
// the CUDA forward's bytes, dinp the plain backward's, both in place and not, and close to the CPU's.
TEST(CudaElementwise, BackwardWithOutIsTheForward) {
  REQUIRE_GPU();
  const int64_t N = 3, F = 1037;
  for (DType dt : kDtypes) {
    const Tensor x = random_host({N, 2 * F}, dt, 61, -6.0f, 6.0f), dy = random_host({N, F}, dt, 62);
    const Tensor xg = random_host({N, F}, dt, 63, -6.0f, 6.0f);
    // GeLU
    Tensor out_ref = Tensor::empty({N, F}, dt), dx_ref = Tensor::empty({N, F}, dt);
    cpu_ref().gelu_backward(dx_ref, xg, dy, out_ref);
    Tensor d_x = to_device(xg), d_dy = to_device(dy);
    Tensor fwd = Tensor::empty({N, F}, dt, ctx().device()), plain = Tensor::empty({N, F}, dt, ctx().device());
    Tensor out = Tensor::empty({N, F}, dt, ctx().device()), dx = Tensor::empty({N, F}, dt, ctx().device());
    cuda_ops().gelu_forward(fwd, d_x);
    cuda_ops().gelu_backward(plain, d_x, d_dy);
    cuda_ops().gelu_backward(dx, d_x, d_dy, out);
    EXPECT_TRUE(same_bytes(to_host(out), to_host(fwd))) << "gelu out " << dtype_name(dt);
    EXPECT_TRUE(same_bytes(to_host(dx), to_host(plain))) << "gelu dinp " << dtype_name(dt);
    expect_close(out, out_ref, default_tol(dt), std::string("gelu out vs CPU ") + dtype_name(dt));
    expect_close(dx, dx_ref, default_tol(dt), std::string("gelu dinp vs CPU ") + dtype_name(dt));
    Tensor out2 = Tensor::empty({N, F}, dt, ctx().device());
    cuda_ops().gelu_backward(d_dy, d_x, d_dy, out2);  // dinp = dout
    EXPECT_TRUE(same_bytes(to_host(out2), to_host(fwd))) << "gelu out (in place) " << dtype_name(dt);
    EXPECT_TRUE(same_bytes(to_host(d_dy), to_host(plain))) << "gelu dinp (in place) " << dtype_name(dt);
    // GLU, every kind, dinp = inp as the MLP runs it
    for (GluKind k : kKinds) {
      const std::string what = kind_name(k) + " " + dtype_name(dt);
      Tensor gout_ref = Tensor::empty({N, F}, dt), gdx_ref = Tensor::empty({N, 2 * F}, dt);
      cpu_ref().glu_backward(gdx_ref, x, dy, k, gout_ref);
      Tensor gx = to_device(x), gdy = to_device(dy);
      Tensor gfwd = Tensor::empty({N, F}, dt, ctx().device()), gplain = Tensor::empty({N, 2 * F}, dt, ctx().device());
      cuda_ops().glu_forward(gfwd, gx, k);
      cuda_ops().glu_backward(gplain, gx, gdy, k);
      Tensor gout = Tensor::empty({N, F}, dt, ctx().device());
      cuda_ops().glu_backward(gx, gx, gdy, k, gout);
      EXPECT_TRUE(same_bytes(to_host(gout), to_host(gfwd))) << "glu out " << what;
      EXPECT_TRUE(same_bytes(to_host(gx), to_host(gplain))) << "glu dinp " << what;
      expect_close(gout, gout_ref, default_tol(dt), "glu out vs CPU " + what);
      expect_close(gx, gdx_ref, default_tol(dt), "glu dinp vs CPU " + what);
    }
  }
}

TEST(CudaGlu, RejectsBadArguments) {
  REQUIRE_GPU();
  Tensor x = to_device(random_host({4, 6}, DType::kF32, 1));
  Tensor odd = to_device(random_host({4, 5}, DType::kF32, 2));
  Tensor out = to_device(random_host({4, 3}, DType::kF32, 3));
  Tensor wrong = to_device(random_host({4, 4}, DType::kF32, 4));
  Tensor out_bf = to_device(random_host({4, 3}, DType::kBF16, 5));
  EXPECT_THROW(cuda_ops().glu_forward(out, odd, GluKind::kSwiGLU), Error);
  EXPECT_THROW(cuda_ops().glu_forward(wrong, x, GluKind::kSwiGLU), Error);
  EXPECT_THROW(cuda_ops().glu_forward(out_bf, x, GluKind::kSwiGLU), Error);
  EXPECT_THROW(cuda_ops().glu_backward(wrong, x, out, GluKind::kReGLU), Error);
  EXPECT_THROW(cuda_ops().glu_backward(x, x, wrong, GluKind::kReGLU), Error);
}

// ---- RoPE ----------------------------------------------------------------------------------------------

struct RopeCase {
  int64_t B, T, NH, NKV, HS, rd;
  int64_t row() const { return NKV * (NH / NKV + 2) * HS; }
  AttentionParams attn() const {
    AttentionParams p;
    p.num_heads = NH;
    p.num_kv_heads = NKV;
    p.head_dim = HS;
    p.softmax_scale = 1.0f / std::sqrt(float(HS));
    return p;
  }
  std::string str() const {
    return "B" + std::to_string(B) + " T" + std::to_string(T) + " NH" + std::to_string(NH) + " NKV" +
           std::to_string(NKV) + " HS" + std::to_string(HS) + " rd" + std::to_string(rd);
  }
};

const RopeCase kRopeCases[] = {
    {2, 5, 3, 3, 8, 8},      // MHA, full rotary
    {1, 37, 4, 2, 10, 6},    // GQA, partial rotary, unaligned heads
    {2, 7, 3, 1, 5, 4},      // MQA, odd head size
    {1, 9, 8, 2, 64, 64},    // Llama-like heads (16-byte packs)
    {3, 4, 2, 1, 6, 2},      // a single pair
    {2, 17, 8, 2, 128, 64},  // GQA, partial rotary with packs
    {1, 5, 4, 4, 16, 16},    // small packable heads
};

// cos/sin (max_pos, rd/2) f32 from inv_freq = 1 / 10000^(2i/rd).
std::pair<Tensor, Tensor> rope_tables(int64_t max_pos, int64_t rd) {
  Tensor c = Tensor::empty({max_pos, rd / 2}, DType::kF32), s = Tensor::empty({max_pos, rd / 2}, DType::kF32);
  for (int64_t p = 0; p < max_pos; ++p)
    for (int64_t i = 0; i < rd / 2; ++i) {
      const double angle = double(p) / std::pow(10000.0, double(2 * i) / double(rd));
      c.data<float>()[p * rd / 2 + i] = float(std::cos(angle));
      s.data<float>()[p * rd / 2 + i] = float(std::sin(angle));
    }
  return {c, s};
}

// Positions that restart (documents) and revisit the table's last row.
Tensor reset_ids(int64_t B, int64_t T, int64_t max_pos) {
  Tensor t = Tensor::empty({B, T}, DType::kI32);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i)
      t.data<int32_t>()[b * T + i] = int32_t((i * (b + 2)) % 5 == 0 ? max_pos - 1 : i % 3);
  return t;
}

TEST(CudaRope, ForwardBackwardMatchCpu) {
  REQUIRE_GPU();
  for (const RopeCase& k : kRopeCases)
    for (bool interleaved : {false, true})
      for (bool with_ids : {false, true})
        for (DType dt : kDtypes) {
          const std::string what = k.str() + (interleaved ? " interleaved" : "") + (with_ids ? " ids " : " ") +
                                   dtype_name(dt);
          const int64_t max_pos = k.T + 3;
          const auto [cos_h, sin_h] = rope_tables(max_pos, k.rd);
          const Tensor cos_d = to_device(cos_h), sin_d = to_device(sin_h);
          const Tensor ids_h = with_ids ? reset_ids(k.B, k.T, max_pos) : Tensor();
          const Tensor ids_d = with_ids ? to_device(ids_h) : Tensor();
          const AttentionParams p = k.attn();
          RopeParams r;
          r.rotary_dim = k.rd;
          r.interleaved = interleaved;
          const Tensor x = random_host({k.B, k.T, k.row()}, dt, 61, -2.0f, 2.0f);

          Tensor fwd_ref = host_clone(x), bwd_ref = host_clone(x);
          cpu_ref().rope_forward(fwd_ref, cos_h, sin_h, p, r, ids_h);
          cpu_ref().rope_backward(bwd_ref, cos_h, sin_h, p, r, ids_h);

          Tensor fwd = to_device(x), bwd = to_device(x);
          cuda::rope_forward(ctx(), fwd, cos_d, sin_d, p, r, ids_d);
          cuda::rope_backward(ctx(), bwd, cos_d, sin_d, p, r, ids_d);
          expect_close(fwd, fwd_ref, default_tol(dt), "rope_forward " + what);
          expect_close(bwd, bwd_ref, default_tol(dt), "rope_backward " + what);
        }
}

// A device position id outside [0, max_positions) cannot be checked on the host: the kernel leaves that row
// alone (no out-of-bounds read, no fault) and rotates the others normally.
TEST(CudaRope, OutOfRangeDeviceIdSkipsRow) {
  REQUIRE_GPU();
  const RopeCase k{1, 4, 4, 2, 16, 16};
  const int64_t max_pos = 4;
  const auto [cos_h, sin_h] = rope_tables(max_pos, k.rd);
  const AttentionParams p = k.attn();
  RopeParams r;
  r.rotary_dim = k.rd;
  const Tensor x = random_host({k.B, k.T, k.row()}, DType::kF32, 71);
  Tensor bad = Tensor::empty({k.B, k.T}, DType::kI32), good = Tensor::empty({k.B, k.T}, DType::kI32);
  const int32_t bad_ids[] = {0, int32_t(max_pos), -1, 2};
  const int32_t good_ids[] = {0, 0, 0, 2};
  for (int i = 0; i < 4; ++i) {
    bad.data<int32_t>()[i] = bad_ids[i];
    good.data<int32_t>()[i] = good_ids[i];
  }
  Tensor ref = host_clone(x);
  cpu_ref().rope_forward(ref, cos_h, sin_h, p, r, good);
  for (int64_t t : {1, 2})  // the skipped rows keep their input
    for (int64_t c = 0; c < k.row(); ++c) ref.data<float>()[t * k.row() + c] = x.data<float>()[t * k.row() + c];
  Tensor got = to_device(x);
  cuda::rope_forward(ctx(), got, to_device(cos_h), to_device(sin_h), p, r, to_device(bad));
  const Tensor got_h = to_host(got);  // throws if the kernel faulted
  expect_close(got_h, ref, default_tol(DType::kF32), "rope with out-of-range ids");
  for (int64_t t : {1, 2}) {
    const Tensor row_got = got_h.slice_flat(t * k.row(), {k.row()}), row_in = x.slice_flat(t * k.row(), {k.row()});
    EXPECT_EQ(std::memcmp(row_got.raw(), row_in.raw(), size_t(row_in.nbytes())), 0) << "row " << t;
  }
}

TEST(CudaRope, RejectsBadArguments) {
  REQUIRE_GPU();
  const RopeCase k{1, 6, 2, 1, 8, 8};
  const auto [cos_h, sin_h] = rope_tables(4, k.rd);  // fewer positions than T
  const Tensor cos_d = to_device(cos_h), sin_d = to_device(sin_h);
  const AttentionParams p = k.attn();
  RopeParams r;
  r.rotary_dim = k.rd;
  Tensor x = to_device(random_host({k.B, k.T, k.row()}, DType::kF32, 81));
  EXPECT_THROW(cuda_ops().rope_forward(x, cos_d, sin_d, p, r, TensorView()), Error);  // T > max_positions
  const auto [cos6, sin6] = rope_tables(6, k.rd);
  const Tensor cos6_d = to_device(cos6), sin6_d = to_device(sin6);
  RopeParams odd = r;
  odd.rotary_dim = 5;
  EXPECT_THROW(cuda_ops().rope_forward(x, cos6_d, sin6_d, p, odd, TensorView()), Error);
  EXPECT_THROW(cuda_ops().rope_forward(x, cos6, sin6, p, r, TensorView()), Error);  // host tables
  Tensor ids_wrong = to_device(Tensor::zeros({k.B, k.T + 1}, DType::kI32));
  EXPECT_THROW(cuda_ops().rope_backward(x, cos6_d, sin6_d, p, r, ids_wrong), Error);
  Tensor x_wrong = to_device(random_host({k.B, k.T, k.row() + 1}, DType::kF32, 82));
  EXPECT_THROW(cuda_ops().rope_forward(x_wrong, cos6_d, sin6_d, p, r, TensorView()), Error);
}

// ---- dropout -------------------------------------------------------------------------------------------

TEST(CudaDropout, BitIdenticalToCpu) {
  REQUIRE_GPU();
  const uint64_t seed = 0x1234ABCDull, stream = 77;
  for (DType dt : kDtypes)
    for (int64_t n : kSizes) {
      const Tensor x = random_host({n}, dt, 91, -3.0f, 3.0f), filler = random_host({n}, dt, 92);
      for (float p : {0.0f, 0.1f, 0.5f})
        for (uint64_t offset : {uint64_t(0), uint64_t(2), uint64_t(7), uint64_t(1000001)})
          for (int64_t view_off : {0, 1}) {
            const std::string what = std::string("dropout p=") + std::to_string(p) + " offset " +
                                     std::to_string(offset) + " " + label(dt, n, view_off);
            Tensor fwd_ref = Tensor::empty({n}, dt), bwd_ref = Tensor::empty({n}, dt);
            cpu_ref().dropout_forward(fwd_ref, x, p, seed, stream, offset);
            cpu_ref().dropout_backward(bwd_ref, x, p, seed, stream, offset);

            DevBuf dx = device_at(x, view_off), dout = device_at(filler, view_off);
            cuda::dropout_forward(ctx(), dout.view, dx.view, p, seed, stream, offset);
            EXPECT_TRUE(same_bytes(to_host(dout.view), fwd_ref)) << "forward " << what;
            DevBuf ddx = device_at(filler, view_off);
            cuda::dropout_backward(ctx(), ddx.view, dx.view, p, seed, stream, offset);
            EXPECT_TRUE(same_bytes(to_host(ddx.view), bwd_ref)) << "backward " << what;
            // In place (dinp = dout).
            cuda::dropout_backward(ctx(), dx.view, dx.view, p, seed, stream, offset);
            EXPECT_TRUE(same_bytes(to_host(dx.view), bwd_ref)) << "backward in place " << what;
          }
    }
}

// A tensor drawn in two pieces at their offsets gets the whole tensor's mask.
TEST(CudaDropout, PiecesAtOffsetsMatchWhole) {
  REQUIRE_GPU();
  const int64_t n = 1001, cut = 333;  // the cut is inside a Philox block
  const Tensor x = random_host({n}, DType::kF32, 95);
  Tensor whole = to_device(x), pieces = to_device(x);
  cuda::dropout_forward(ctx(), whole, whole, 0.3f, 5, 6, 0);
  const TensorView a = pieces.view().slice_flat(0, {cut}), b = pieces.view().slice_flat(cut, {n - cut});
  cuda::dropout_forward(ctx(), a, a, 0.3f, 5, 6, 0);
  cuda::dropout_forward(ctx(), b, b, 0.3f, 5, 6, uint64_t(cut));
  EXPECT_TRUE(same_bytes(to_host(whole), to_host(pieces)));
}

TEST(CudaDropout, RejectsBadArguments) {
  REQUIRE_GPU();
  Tensor x = to_device(random_host({16}, DType::kF32, 1)), y = to_device(random_host({16}, DType::kF32, 2));
  Tensor bf = to_device(random_host({16}, DType::kBF16, 3)), short_y = to_device(random_host({15}, DType::kF32, 4));
  EXPECT_THROW(cuda_ops().dropout_forward(y, x, 1.0f, 1, 2, 0), Error);
  EXPECT_THROW(cuda_ops().dropout_forward(y, x, -0.1f, 1, 2, 0), Error);
  EXPECT_THROW(cuda_ops().dropout_forward(bf, x, 0.1f, 1, 2, 0), Error);
  EXPECT_THROW(cuda_ops().dropout_forward(short_y, x, 0.1f, 1, 2, 0), Error);
  // Partial overlap (out shifted by one element inside inp's buffer).
  Tensor big = to_device(random_host({17}, DType::kF32, 5));
  const TensorView in = big.view().slice_flat(0, {16}), out = big.view().slice_flat(1, {16});
  EXPECT_THROW(cuda_ops().dropout_backward(out, in, 0.1f, 1, 2, 0), Error);
  EXPECT_THROW(cuda_ops().dropout_forward(y, random_host({16}, DType::kF32, 6), 0.1f, 1, 2, 0), Error);  // host
}

}  // namespace
}  // namespace loom::test

#endif  // LOOM_HAVE_CUDA
