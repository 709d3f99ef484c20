// CUDA MoE ops (src/backend/cuda/moe.cu) against the CPU reference on identical inputs: permute / unpermute
// forward and backward (dinp, dprobs) and the grouped GEMM, in f32, bf16 and f16, on N = 1, 5, 217 tokens,
// E = 3, 8, k = 1, 2, with dropped pairs and an empty expert group. Permutation is a copy, so it must be
// byte-identical; the sums run in the CPU's order (f32), dprobs within tolerance (block reduction vs f64).
// Every test skips when no GPU is visible.
#include <gtest/gtest.h>

#if defined(LOOM_HAVE_CUDA)
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "moe_test_util.h"

namespace loom::test {
namespace {

const DType kDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
struct Dims {
  int64_t N, E, k, C;
};
const Dims kDims[] = {{1, 3, 1, 5}, {5, 3, 2, 7}, {217, 8, 2, 133}};

TEST(CudaMoe, PermuteUnpermuteMatchCpu) {
  REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Dims& d : kDims) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " N=" + std::to_string(d.N));
      const MoeRouting r = random_routing(d.N, d.E, d.k, uint32_t(d.N * 7 + d.C));
      Tensor x = random_host({d.N, d.C}, dt, 1), yp = random_host({r.M, d.C}, dt, 2);
      Tensor dy = random_host({d.N, d.C}, dt, 3), g = random_host({r.M, d.C}, dt, 4);
      Tensor map_d = to_device(r.row_id_map), probs_d = to_device(r.probs);
      // CPU reference.
      Tensor xp = Tensor::empty({r.M, d.C}, dt), dx = Tensor::empty({d.N, d.C}, dt);
      Tensor y = Tensor::empty({d.N, d.C}, dt), dyp = Tensor::empty({r.M, d.C}, dt);
      Tensor dprobs = Tensor::empty({d.N, d.E}, DType::kF32);
      cpu_ref().moe_permute_forward(xp, x, r.row_id_map);
      cpu_ref().moe_permute_backward(dx, g, r.row_id_map);
      cpu_ref().moe_unpermute_forward(y, yp, r.probs, r.row_id_map);
      cpu_ref().moe_unpermute_backward(dyp, dprobs, dy, yp, r.probs, r.row_id_map);
      // GPU.
      Tensor xp_d = Tensor::empty({r.M, d.C}, dt, cuda_ctx().device()), dx_d = Tensor::empty({d.N, d.C}, dt, cuda_ctx().device());
      Tensor y_d = Tensor::empty({d.N, d.C}, dt, cuda_ctx().device()), dyp_d = Tensor::empty({r.M, d.C}, dt, cuda_ctx().device());
      Tensor dprobs_d = Tensor::empty({d.N, d.E}, DType::kF32, cuda_ctx().device());
      Tensor x_d = to_device(x), yp_d = to_device(yp), dy_d = to_device(dy), g_d = to_device(g);
      cuda_ops().moe_permute_forward(xp_d, x_d, map_d);
      cuda_ops().moe_permute_backward(dx_d, g_d, map_d);
      cuda_ops().moe_unpermute_forward(y_d, yp_d, probs_d, map_d);
      cuda_ops().moe_unpermute_backward(dyp_d, dprobs_d, dy_d, yp_d, probs_d, map_d);
      Tensor xp_h = to_host(xp_d);
      EXPECT_EQ(std::memcmp(xp_h.raw(), xp.raw(), size_t(xp.nbytes())), 0) << "permute is a copy";
      expect_close_host(to_host(dx_d), dx, default_tol(dt), "permute_backward");
      expect_close_host(to_host(y_d), y, default_tol(dt), "unpermute_forward");
      expect_close_host(to_host(dyp_d), dyp, default_tol(dt), "unpermute_backward dinp");
      expect_close_host(to_host(dprobs_d), dprobs, 1e-4f, "unpermute_backward dprobs");
    }
}

TEST(CudaMoe, GroupedMatmulMatchesCpu) {
  REQUIRE_GPU();
  const std::vector<int64_t> sizes = {3, 0, 217, 1};
  const int64_t M = 221, K = 24, N = 40, G = 4;
  for (DType dt : kDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor inp = random_host({M, K}, dt, 1), w = random_host({G, N, K}, dt, 2), dout = random_host({M, N}, dt, 3);
    Tensor out = Tensor::empty({M, N}, dt), dinp = Tensor::empty({M, K}, dt);
    Tensor dw = random_host({G, N, K}, DType::kF32, 4), dw_d = to_device(dw);
    cpu_ref().grouped_matmul_forward(out, inp, w, sizes);
    cpu_ref().grouped_matmul_backward(dinp, dw, dout, inp, w, sizes);
    Tensor inp_d = to_device(inp), w_d = to_device(w), dout_d = to_device(dout);
    Tensor out_d = Tensor::empty({M, N}, dt, cuda_ctx().device()), dinp_d = Tensor::empty({M, K}, dt, cuda_ctx().device());
    cuda_ops().grouped_matmul_forward(out_d, inp_d, w_d, sizes);
    cuda_ops().grouped_matmul_backward(dinp_d, dw_d, dout_d, inp_d, w_d, sizes);
    const float tol = dt == DType::kF32 ? 1e-4f : 2e-2f;
    expect_close_host(to_host(out_d), out, tol, "grouped forward");
    expect_close_host(to_host(dinp_d), dinp, tol, "grouped dinp");
    expect_close_host(to_host(dw_d), dw, tol, "grouped dweight (accumulate)");
    // kOverwrite: every group's slice stored (the empty group's zeroed) over NaN, as on the CPU.
    Tensor dw_over = Tensor::empty({G, N, K}, DType::kF32);
    for (int64_t i = 0; i < dw_over.numel(); ++i) dw_over.data<float>()[i] = NAN;
    Tensor dw_over_d = to_device(dw_over);
    cpu_ref().grouped_matmul_backward(TensorView(), dw_over, dout, inp, w, sizes, GradWrite::kOverwrite);
    cuda_ops().grouped_matmul_backward(TensorView(), dw_over_d, dout_d, inp_d, w_d, sizes, GradWrite::kOverwrite);
    expect_close_host(to_host(dw_over_d), dw_over, tol, "grouped dweight (overwrite)");
  }
}

}  // namespace
}  // namespace loom::test

#endif  // LOOM_HAVE_CUDA
