// CUDA matmul (cuBLASLt) against the CPU reference: forward and backward on odd shapes (M, N, K in
// {1, 5, 17, 64, 217}), every input dtype (f32, bf16, f16) with outputs in the compute dtype or f32, biases in
// either, dweight/dbias f32 main grads or the compute dtype; overwrite vs accumulate (outputs the op overwrites
// start as NaN on the GPU, accumulated ones start from the same random values on both sides; a dweight stored
// with GradWrite::kOverwrite starts as NaN on both); empty optional
// arguments; zero-sized dimensions; flattened leading dims; unaligned views; determinism; argument errors.
// Skips without a visible GPU.
#include <gtest/gtest.h>

#if defined(LOOM_HAVE_CUDA)
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/matmul.cuh"
#include "cuda_test_util.h"

namespace loom::test {
namespace {

struct Mnk {
  int64_t M, N, K;
};

// Every size of the set appears in every position; the last two reach the tensor-core tile sizes.
const std::vector<Mnk> kShapes = {{1, 1, 1},      {5, 17, 64},   {217, 5, 17},   {17, 217, 5},
                                  {64, 64, 217},  {1, 217, 64},  {217, 1, 5},    {5, 64, 1},
                                  {64, 1, 217},   {217, 217, 217}, {256, 384, 128}};

const DType kComputeDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// f32 results differ from the CPU's only by the order of f32 additions; 16-bit ones may round one ulp apart.
float tol_for(DType dt) { return dt == DType::kF32 ? 1e-4f : default_tol(dt); }

std::string shape_str(const Mnk& s) {
  return "M=" + std::to_string(s.M) + " N=" + std::to_string(s.N) + " K=" + std::to_string(s.K);
}

// A host tensor full of NaN, and the same on the device: an output the op must overwrite completely.
Tensor nan_host(Shape s, DType dt) {
  Tensor h = Tensor::empty(s, dt);
  for (int64_t i = 0; i < h.numel(); ++i) host_set(h, i, NAN);
  return h;
}
Tensor nan_device(Shape s, DType dt) { return to_device(nan_host(s, dt)); }

// The out dtypes for a compute dtype: itself, and f32 when different.
std::vector<DType> out_dtypes(DType cd) {
  if (cd == DType::kF32) return {DType::kF32};
  return {cd, DType::kF32};
}

TEST(CudaMatmul, ForwardMatchesCpu) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  uint64_t seed = 100;
  for (DType cd : kComputeDtypes)
    for (DType od : out_dtypes(cd))
      for (int bias_mode = 0; bias_mode < 3; ++bias_mode) {  // none, compute dtype, f32
        if (bias_mode == 2 && cd == DType::kF32) continue;
        const DType bd = bias_mode == 1 ? cd : DType::kF32;
        for (const Mnk& s : kShapes) {
          const std::string what = std::string("forward ") + dtype_name(cd) + " -> " + dtype_name(od) +
                                    (bias_mode ? std::string(" bias ") + dtype_name(bd) : std::string(" no bias")) +
                                    " " + shape_str(s);
          Tensor inp = random_host({s.M, s.K}, cd, seed++);
          Tensor w = random_host({s.N, s.K}, cd, seed++);
          Tensor bias = bias_mode ? random_host({s.N}, bd, seed++) : Tensor();
          Tensor ref = Tensor::empty({s.M, s.N}, od);
          cpu_ref().matmul_forward(ref, inp, w, bias);
          Tensor d_inp = to_device(inp), d_w = to_device(w);
          Tensor d_bias = bias_mode ? to_device(bias) : Tensor();
          Tensor d_out = nan_device({s.M, s.N}, od);
          cuda::matmul_forward(ctx, d_out, d_inp, d_w, d_bias);
          expect_close(d_out, ref, tol_for(od), what);
        }
      }
}

TEST(CudaMatmul, BackwardMatchesCpu) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  uint64_t seed = 5000;
  for (DType cd : kComputeDtypes)
    for (DType dinp_dt : out_dtypes(cd))
      for (DType grad_dt : out_dtypes(cd))  // dweight and dbias: the compute dtype or f32 main grads
        for (const Mnk& s : kShapes) {
          const std::string what = std::string("backward ") + dtype_name(cd) + " dinp " + dtype_name(dinp_dt) +
                                   " grads " + dtype_name(grad_dt) + " " + shape_str(s);
          Tensor dout = random_host({s.M, s.N}, cd, seed++);
          Tensor inp = random_host({s.M, s.K}, cd, seed++);
          Tensor w = random_host({s.N, s.K}, cd, seed++);
          Tensor dw0 = random_host({s.N, s.K}, grad_dt, seed++);
          Tensor db0 = random_host({s.N}, grad_dt, seed++);
          Tensor dinp_ref = Tensor::empty({s.M, s.K}, dinp_dt);
          Tensor dw_ref = host_clone(dw0), db_ref = host_clone(db0);
          cpu_ref().matmul_backward(dinp_ref, dw_ref, db_ref, dout, inp, w);

          Tensor d_dinp = nan_device({s.M, s.K}, dinp_dt);
          Tensor d_dw = to_device(dw0), d_db = to_device(db0);
          cuda::matmul_backward(ctx, d_dinp, d_dw, d_db, to_device(dout), to_device(inp), to_device(w));
          expect_close(d_dinp, dinp_ref, tol_for(dinp_dt), what + " dinp");
          expect_close(d_dw, dw_ref, tol_for(grad_dt), what + " dweight");
          expect_close(d_db, db_ref, tol_for(grad_dt), what + " dbias");
        }
}

// Parameter gradients add up over calls (micro-batches); dinp does not.
TEST(CudaMatmul, BackwardAccumulatesAcrossCalls) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t M = 17, N = 64, K = 5;
  for (DType cd : {DType::kF32, DType::kBF16}) {
    Tensor dout = random_host({M, N}, cd, 1), inp = random_host({M, K}, cd, 2), w = random_host({N, K}, cd, 3);
    Tensor dw_ref = random_host({N, K}, DType::kF32, 4), db_ref = random_host({N}, DType::kF32, 5);
    Tensor dinp_ref = Tensor::empty({M, K}, cd);
    Tensor d_dw = to_device(dw_ref), d_db = to_device(db_ref), d_dinp = nan_device({M, K}, cd);
    Tensor d_dout = to_device(dout), d_inp = to_device(inp), d_w = to_device(w);
    for (int call = 0; call < 2; ++call) {
      cpu_ref().matmul_backward(dinp_ref, dw_ref, db_ref, dout, inp, w);
      cuda::matmul_backward(ctx, d_dinp, d_dw, d_db, d_dout, d_inp, d_w);
    }
    const std::string what = std::string("two backward calls ") + dtype_name(cd);
    expect_close(d_dinp, dinp_ref, tol_for(cd), what + " dinp");
    expect_close(d_dw, dw_ref, 1e-4f, what + " dweight");
    expect_close(d_db, db_ref, 1e-4f, what + " dbias");
  }
}

// GradWrite::kOverwrite stores dweight (beta 0: the NaN it starts as must not show) as the CPU does; over no
// rows it stores zeros; dbias still accumulates.
TEST(CudaMatmul, BackwardOverwritesTheWeightGradient) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  uint64_t seed = 9000;
  for (DType cd : kComputeDtypes)
    for (DType grad_dt : out_dtypes(cd))
      for (const Mnk& s : {Mnk{17, 64, 5}, Mnk{217, 217, 217}, Mnk{0, 5, 17}}) {
        const std::string what = std::string("overwrite ") + dtype_name(cd) + " grads " + dtype_name(grad_dt) + " " +
                                 shape_str(s);
        Tensor dout = random_host({s.M, s.N}, cd, seed++), inp = random_host({s.M, s.K}, cd, seed++);
        Tensor w = random_host({s.N, s.K}, cd, seed++), db0 = random_host({s.N}, grad_dt, seed++);
        Tensor dw_ref = nan_host({s.N, s.K}, grad_dt), db_ref = host_clone(db0);
        cpu_ref().matmul_backward(TensorView(), dw_ref, db_ref, dout, inp, w, GradWrite::kOverwrite);
        Tensor d_dw = nan_device({s.N, s.K}, grad_dt), d_db = to_device(db0);
        cuda::matmul_backward(ctx, TensorView(), d_dw, d_db, to_device(dout), to_device(inp), to_device(w),
                              GradWrite::kOverwrite);
        expect_close(d_dw, dw_ref, tol_for(grad_dt), what + " dweight");
        expect_close(d_db, db_ref, tol_for(grad_dt), what + " dbias");
      }
}

// Each output of the backward is optional; absent ones are skipped and the others still computed.
TEST(CudaMatmul, BackwardOptionalOutputs) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t M = 5, N = 17, K = 64;
  const DType cd = DType::kBF16;
  Tensor dout = random_host({M, N}, cd, 11), inp = random_host({M, K}, cd, 12), w = random_host({N, K}, cd, 13);
  Tensor d_dout = to_device(dout), d_inp = to_device(inp), d_w = to_device(w);
  for (int mask = 0; mask < 8; ++mask) {
    const bool want_dinp = mask & 1, want_dw = mask & 2, want_db = mask & 4;
    Tensor dinp_ref = Tensor::empty({M, K}, DType::kF32);
    Tensor dw_ref = random_host({N, K}, DType::kF32, 20), db_ref = random_host({N}, DType::kF32, 21);
    Tensor d_dinp = nan_device({M, K}, DType::kF32), d_dw = to_device(dw_ref), d_db = to_device(db_ref);
    cpu_ref().matmul_backward(want_dinp ? TensorView(dinp_ref) : TensorView(), want_dw ? TensorView(dw_ref) : TensorView(),
                              want_db ? TensorView(db_ref) : TensorView(), dout, inp, w);
    // inp is needed only for dweight: pass none when dweight is absent.
    cuda::matmul_backward(ctx, want_dinp ? TensorView(d_dinp) : TensorView(), want_dw ? TensorView(d_dw) : TensorView(),
                          want_db ? TensorView(d_db) : TensorView(), d_dout, want_dw ? TensorView(d_inp) : TensorView(),
                          d_w);
    const std::string what = "optional outputs mask " + std::to_string(mask);
    if (want_dinp) expect_close(d_dinp, dinp_ref, 1e-4f, what + " dinp");
    expect_close(d_dw, dw_ref, 1e-4f, what + " dweight");  // untouched when absent: still the start values
    expect_close(d_db, db_ref, 1e-4f, what + " dbias");
  }
}

TEST(CudaMatmul, LeadingDimsFlattened) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t B = 3, T = 7, K = 24, N = 40;
  Tensor inp = random_host({B, T, K}, DType::kBF16, 31), w = random_host({N, K}, DType::kBF16, 32);
  Tensor bias = random_host({N}, DType::kBF16, 33);
  Tensor ref = Tensor::empty({B, T, N}, DType::kBF16);
  cpu_ref().matmul_forward(ref, inp, w, bias);
  Tensor d_out = nan_device({B, T, N}, DType::kBF16);
  cuda::matmul_forward(ctx, d_out, to_device(inp), to_device(w), to_device(bias));
  expect_close(d_out, ref, tol_for(DType::kBF16), "forward (B, T, K)");

  Tensor dout = random_host({B, T, N}, DType::kBF16, 34);
  Tensor dinp_ref = Tensor::empty({B, T, K}, DType::kBF16), dw_ref = Tensor::zeros({N, K}, DType::kF32);
  cpu_ref().matmul_backward(dinp_ref, dw_ref, TensorView(), dout, inp, w);
  Tensor d_dinp = nan_device({B, T, K}, DType::kBF16), d_dw = to_device(Tensor::zeros({N, K}, DType::kF32));
  cuda::matmul_backward(ctx, d_dinp, d_dw, TensorView(), to_device(dout), to_device(inp), to_device(w));
  expect_close(d_dinp, dinp_ref, tol_for(DType::kBF16), "backward (B, T, K) dinp");
  expect_close(d_dw, dw_ref, 1e-4f, "backward (B, T, K) dweight");
}

// Views that start one element into a buffer: pointers only element-aligned, which cuBLASLt must be told.
TEST(CudaMatmul, UnalignedViews) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t M = 17, N = 24, K = 40;
  for (DType cd : kComputeDtypes) {
    Tensor inp = random_host({M, K}, cd, 41), w = random_host({N, K}, cd, 42), bias = random_host({N}, cd, 43);
    Tensor ref = Tensor::empty({M, N}, cd);
    cpu_ref().matmul_forward(ref, inp, w, bias);
    // Device buffers one element longer, the operands copied in at offset 1.
    Tensor inp_buf = random_host({M * K + 1}, cd, 44), w_buf = random_host({N * K + 1}, cd, 45);
    const size_t es = dtype_size(cd);
    std::memcpy(static_cast<char*>(inp_buf.raw()) + es, inp.raw(), size_t(inp.nbytes()));
    std::memcpy(static_cast<char*>(w_buf.raw()) + es, w.raw(), size_t(w.nbytes()));
    Tensor d_inp_buf = to_device(inp_buf), d_w_buf = to_device(w_buf);
    Tensor d_out_buf = nan_device({M * N + 1}, cd);
    TensorView d_inp = d_inp_buf.view().slice_flat(1, {M, K});
    TensorView d_w = d_w_buf.view().slice_flat(1, {N, K});
    TensorView d_out = d_out_buf.view().slice_flat(1, {M, N});
    cuda::matmul_forward(ctx, d_out, d_inp, d_w, to_device(bias));
    expect_close(to_host(d_out), ref, tol_for(cd), std::string("unaligned forward ") + dtype_name(cd));

    Tensor dout = random_host({M, N}, cd, 46);
    Tensor dinp_ref = Tensor::empty({M, K}, cd), dw_ref = Tensor::zeros({N, K}, cd);
    cpu_ref().matmul_backward(dinp_ref, dw_ref, TensorView(), dout, inp, w);
    Tensor dout_buf = random_host({M * N + 1}, cd, 47);
    std::memcpy(static_cast<char*>(dout_buf.raw()) + es, dout.raw(), size_t(dout.nbytes()));
    Tensor d_dout_buf = to_device(dout_buf), d_dinp_buf = nan_device({M * K + 1}, cd);
    Tensor d_dw_buf = to_device(Tensor::zeros({N * K + 1}, cd));
    TensorView d_dinp = d_dinp_buf.view().slice_flat(1, {M, K});
    TensorView d_dw = d_dw_buf.view().slice_flat(1, {N, K});
    cuda::matmul_backward(ctx, d_dinp, d_dw, TensorView(), d_dout_buf.view().slice_flat(1, {M, N}), d_inp, d_w);
    expect_close(to_host(d_dinp), dinp_ref, tol_for(cd), std::string("unaligned dinp ") + dtype_name(cd));
    expect_close(to_host(d_dw), dw_ref, tol_for(cd), std::string("unaligned dweight ") + dtype_name(cd));
  }
}

TEST(CudaMatmul, ZeroSizedDimensions) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  // K = 0: out = bias broadcast (0 without a bias).
  const int64_t M = 5, N = 17;
  Tensor bias = random_host({N}, DType::kF32, 51);
  Tensor ref = Tensor::empty({M, N}, DType::kF32);
  cpu_ref().matmul_forward(ref, Tensor::empty({M, 0}, DType::kF32), Tensor::empty({N, 0}, DType::kF32), bias);
  Tensor d_out = nan_device({M, N}, DType::kF32);
  cuda::matmul_forward(ctx, d_out, Tensor::empty({M, 0}, DType::kF32, ctx.device()),
                       Tensor::empty({N, 0}, DType::kF32, ctx.device()), to_device(bias));
  expect_close(d_out, ref, 0.0f, "K = 0 forward");
  Tensor d_out0 = nan_device({M, N}, DType::kBF16);
  cuda::matmul_forward(ctx, d_out0, Tensor::empty({M, 0}, DType::kBF16, ctx.device()),
                       Tensor::empty({N, 0}, DType::kBF16, ctx.device()), TensorView());
  expect_close(d_out0, Tensor::zeros({M, N}, DType::kF32), 0.0f, "K = 0 forward, no bias");

  // N = 0: dinp = 0 (overwrite), nothing else to do.
  Tensor d_dinp = nan_device({M, 7}, DType::kF32);
  cuda::matmul_backward(ctx, d_dinp, TensorView(), TensorView(), Tensor::empty({M, 0}, DType::kF32, ctx.device()),
                        TensorView(), Tensor::empty({0, 7}, DType::kF32, ctx.device()));
  expect_close(d_dinp, Tensor::zeros({M, 7}, DType::kF32), 0.0f, "N = 0 dinp");

  // M = 0: dweight and dbias unchanged.
  Tensor dw0 = random_host({N, 7}, DType::kF32, 52), db0 = random_host({N}, DType::kF32, 53);
  Tensor d_dw = to_device(dw0), d_db = to_device(db0);
  cuda::matmul_backward(ctx, TensorView(), d_dw, d_db, Tensor::empty({0, N}, DType::kF32, ctx.device()),
                        Tensor::empty({0, 7}, DType::kF32, ctx.device()), to_device(random_host({N, 7}, DType::kF32, 54)));
  expect_close(d_dw, dw0, 0.0f, "M = 0 dweight");
  expect_close(d_db, db0, 0.0f, "M = 0 dbias");
}

TEST(CudaMatmul, Deterministic) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t M = 217, N = 96, K = 64;
  for (DType cd : kComputeDtypes) {
    Tensor d_inp = to_device(random_host({M, K}, cd, 61)), d_w = to_device(random_host({N, K}, cd, 62));
    Tensor d_bias = to_device(random_host({N}, DType::kF32, 63)), d_dout = to_device(random_host({M, N}, cd, 64));
    Tensor dw0 = random_host({N, K}, DType::kF32, 65), db0 = random_host({N}, DType::kF32, 66);
    Tensor runs[2][4];
    for (auto& r : runs) {
      Tensor out = nan_device({M, N}, cd), dinp = nan_device({M, K}, cd), dw = to_device(dw0), db = to_device(db0);
      cuda::matmul_forward(ctx, out, d_inp, d_w, cd == DType::kF32 ? TensorView(d_bias) : TensorView());
      cuda::matmul_backward(ctx, dinp, dw, db, d_dout, d_inp, d_w);
      r[0] = to_host(out);
      r[1] = to_host(dinp);
      r[2] = to_host(dw);
      r[3] = to_host(db);
    }
    for (int i = 0; i < 4; ++i)
      EXPECT_TRUE(same_bytes(runs[0][i], runs[1][i])) << dtype_name(cd) << " output " << i << " differs between runs";
  }
}

TEST(CudaMatmul, RejectsBadArguments) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const Device dev = ctx.device();
  Tensor inp = Tensor::empty({5, 8}, DType::kBF16, dev), w = Tensor::empty({6, 8}, DType::kBF16, dev);
  Tensor out = Tensor::empty({5, 6}, DType::kBF16, dev);
  EXPECT_ANY_THROW(cuda_ops().matmul_forward(out, inp, Tensor::empty({48}, DType::kBF16, dev), TensorView()));
  EXPECT_ANY_THROW(cuda_ops().matmul_forward(out, Tensor::empty({5, 7}, DType::kBF16, dev), w, TensorView()));
  EXPECT_ANY_THROW(cuda_ops().matmul_forward(Tensor::empty({5, 7}, DType::kBF16, dev), inp, w, TensorView()));
  EXPECT_ANY_THROW(cuda_ops().matmul_forward(out, inp, Tensor::empty({6, 8}, DType::kF32, dev), TensorView()));
  EXPECT_ANY_THROW(cuda_ops().matmul_forward(Tensor::empty({5, 6}, DType::kF16, dev), inp, w, TensorView()));
  EXPECT_ANY_THROW(cuda_ops().matmul_forward(out, inp, w, Tensor::empty({7}, DType::kBF16, dev)));
  EXPECT_ANY_THROW(cuda_ops().matmul_forward(out, inp, w, Tensor::empty({6}, DType::kF16, dev)));
  EXPECT_ANY_THROW(cuda_ops().matmul_forward(out, Tensor::empty({5, 8}, DType::kBF16), w, TensorView()));  // host
  EXPECT_ANY_THROW(cuda_ops().matmul_forward(out, TensorView(), w, TensorView()));
  Tensor dout = Tensor::empty({5, 6}, DType::kBF16, dev);
  EXPECT_ANY_THROW(cuda_ops().matmul_backward(TensorView(), Tensor::empty({6, 7}, DType::kF32, dev), TensorView(),
                                         dout, inp, w));
  EXPECT_ANY_THROW(cuda_ops().matmul_backward(Tensor::empty({5, 7}, DType::kF32, dev), TensorView(), TensorView(),
                                         dout, inp, w));
  EXPECT_ANY_THROW(cuda_ops().matmul_backward(TensorView(), TensorView(), Tensor::empty({7}, DType::kF32, dev),
                                         dout, inp, w));
  EXPECT_ANY_THROW(cuda_ops().matmul_backward(TensorView(), Tensor::empty({6, 8}, DType::kF32, dev), TensorView(),
                                         dout, TensorView(), w));  // dweight needs inp
  EXPECT_ANY_THROW(cuda_ops().matmul_backward(TensorView(), TensorView(), Tensor::empty({6}, DType::kF16, dev),
                                         dout, inp, w));
}

}  // namespace
}  // namespace loom::test
#endif  // LOOM_HAVE_CUDA
