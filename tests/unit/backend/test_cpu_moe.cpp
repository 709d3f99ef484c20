// CPU MoE ops (src/backend/cpu/moe.cpp): token permutation / unpermutation against a naive f64 loop, their
// backwards as the adjoints (<permute(x), g> = <x, permute_backward(g)>; unpermute's dprobs by central
// differences), bf16 rows against the f32 op on the widened inputs, row_id_map validation, and the grouped
// GEMM against one matmul per group (an empty group, accumulating dweight), against f64 in f32 with groups
// cut into pieces and in bf16 with groups padded to 16 x a 7-smooth row count. Odd sizes: N = 1, 5, 217.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <oneapi/dnnl/dnnl.h>
#include <string>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/matmul_internal.h"
#include "cpu_test_util.h"
#include "loom/core/check.h"
#include "moe_test_util.h"

namespace loom {
namespace {

using test::MoeRouting;
using test::random_routing;

struct Dims {
  int64_t N, E, k, C;
};
const Dims kDims[] = {{1, 3, 1, 5}, {5, 3, 2, 7}, {217, 8, 2, 13}, {5, 8, 2, 1}};

TEST(CpuMoe, PermuteAndUnpermuteMatchNaiveLoops) {
  for (const Dims& d : kDims) {
    SCOPED_TRACE("N=" + std::to_string(d.N));
    const MoeRouting r = random_routing(d.N, d.E, d.k, uint32_t(d.N + d.C));
    const int32_t* ids = r.row_id_map.data<int32_t>();
    Tensor x = test::uniform_tensor({d.N, d.C}, 1), yp = test::uniform_tensor({r.M, d.C}, 2);
    Tensor dy = test::uniform_tensor({d.N, d.C}, 3), g = test::uniform_tensor({r.M, d.C}, 4);
    Tensor xp = Tensor::empty({r.M, d.C}, DType::kF32), dx = Tensor::empty({d.N, d.C}, DType::kF32);
    Tensor y = Tensor::empty({d.N, d.C}, DType::kF32), dyp = Tensor::empty({r.M, d.C}, DType::kF32);
    Tensor dprobs = Tensor::empty({d.N, d.E}, DType::kF32);
    const OpTable& ops = test::ops();
    ops.moe_permute_forward(xp, x, r.row_id_map);
    ops.moe_permute_backward(dx, g, r.row_id_map);
    ops.moe_unpermute_forward(y, yp, r.probs, r.row_id_map);
    ops.moe_unpermute_backward(dyp, dprobs, dy, yp, r.probs, r.row_id_map);
    double adj_a = 0, adj_b = 0;
    for (int64_t n = 0; n < d.N; ++n)
      for (int64_t c = 0; c < d.C; ++c) {
        double dx_ref = 0, y_ref = 0;
        for (int64_t e = 0; e < d.E; ++e) {
          const int32_t row = ids[n * d.E + e];
          if (row < 0) continue;
          const double p = r.probs.data<float>()[n * d.E + e];
          EXPECT_EQ(xp.data<float>()[row * d.C + c], x.data<float>()[n * d.C + c]);
          dx_ref += g.data<float>()[row * d.C + c];
          y_ref += p * yp.data<float>()[row * d.C + c];
          EXPECT_NEAR(dyp.data<float>()[row * d.C + c], p * dy.data<float>()[n * d.C + c], 1e-6);
        }
        EXPECT_NEAR(dx.data<float>()[n * d.C + c], dx_ref, 1e-5);
        EXPECT_NEAR(y.data<float>()[n * d.C + c], y_ref, 1e-5);
        adj_b += double(x.data<float>()[n * d.C + c]) * dx.data<float>()[n * d.C + c];
      }
    for (int64_t i = 0; i < xp.numel(); ++i) adj_a += double(xp.data<float>()[i]) * g.data<float>()[i];
    EXPECT_NEAR(adj_a, adj_b, 1e-4 * (1 + std::fabs(adj_a)));
    // dprobs: the derivative of <y, dy> in probs[n, e] (y is linear in probs).
    for (int64_t n = 0; n < d.N; ++n)
      for (int64_t e = 0; e < d.E; ++e) {
        const int32_t row = ids[n * d.E + e];
        double ref = 0;
        if (row >= 0)
          for (int64_t c = 0; c < d.C; ++c) ref += double(dy.data<float>()[n * d.C + c]) * yp.data<float>()[row * d.C + c];
        EXPECT_NEAR(dprobs.data<float>()[n * d.E + e], ref, 1e-5);
      }
  }
}

TEST(CpuMoe, Bf16RowsAreTheF32OpRoundedOnce) {
  const MoeRouting r = random_routing(37, 8, 2, 7);
  const int64_t C = 19;
  Tensor yp32 = test::uniform_tensor({r.M, C}, 5);
  Tensor yp16 = Tensor::empty({r.M, C}, DType::kBF16), back = Tensor::empty({r.M, C}, DType::kF32);
  const OpTable& ops = test::ops();
  ops.cast(yp16, yp32);
  ops.cast(back, yp16);
  Tensor y16 = Tensor::empty({37, C}, DType::kBF16), y32 = Tensor::empty({37, C}, DType::kF32);
  Tensor want = Tensor::empty({37, C}, DType::kBF16);
  ops.moe_unpermute_forward(y16, yp16, r.probs, r.row_id_map);
  ops.moe_unpermute_forward(y32, back, r.probs, r.row_id_map);
  ops.cast(want, y32);
  EXPECT_EQ(std::memcmp(y16.raw(), want.raw(), size_t(want.nbytes())), 0);
}

TEST(CpuMoe, RejectsBadRowIdMapsAndShapes) {
  const OpTable& ops = test::ops();
  MoeRouting r = random_routing(5, 3, 2, 9, 0.0);
  Tensor x = test::uniform_tensor({5, 4}, 1), xp = Tensor::empty({r.M, 4}, DType::kF32);
  int32_t* ids = r.row_id_map.data<int32_t>();
  int64_t first = 0;
  while (ids[first] < 0) ++first;
  const int32_t keep = ids[first];
  ids[first] = int32_t(r.M);  // out of range
  EXPECT_THROW(ops.moe_permute_forward(xp, x, r.row_id_map), Error);
  int64_t second = first + 1;
  while (ids[second] < 0) ++second;
  ids[first] = ids[second];  // duplicate
  EXPECT_THROW(ops.moe_permute_forward(xp, x, r.row_id_map), Error);
  ids[first] = keep;
  Tensor short_xp = Tensor::empty({r.M - 1, 4}, DType::kF32);
  EXPECT_THROW(ops.moe_permute_forward(short_xp, x, r.row_id_map), Error);  // a row with no slot
  Tensor bf = Tensor::empty({r.M, 4}, DType::kBF16);
  EXPECT_THROW(ops.moe_permute_forward(bf, x, r.row_id_map), Error);  // dtype mismatch
  Tensor probs16 = Tensor::empty({5, 3}, DType::kBF16);
  EXPECT_THROW(ops.moe_unpermute_forward(x, xp, probs16, r.row_id_map), Error);
  ops.moe_permute_forward(xp, x, r.row_id_map);  // the repaired map works
}

TEST(CpuMoe, GroupedMatmulIsOneMatmulPerGroup) {
  const OpTable& ops = test::ops();
  const std::vector<int64_t> sizes = {3, 0, 217, 1};
  const int64_t M = 221, K = 7, N = 5, G = 4;
  Tensor inp = test::uniform_tensor({M, K}, 1), w = test::uniform_tensor({G, N, K}, 2);
  Tensor dout = test::uniform_tensor({M, N}, 3), out = Tensor::empty({M, N}, DType::kF32);
  Tensor dinp = Tensor::empty({M, K}, DType::kF32), dw = test::uniform_tensor({G, N, K}, 4);
  Tensor dw0 = Tensor::empty({G, N, K}, DType::kF32);
  std::memcpy(dw0.raw(), dw.raw(), size_t(dw.nbytes()));
  ops.grouped_matmul_forward(out, inp, w, sizes);
  ops.grouped_matmul_backward(dinp, dw, dout, inp, w, sizes);
  int64_t o = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = sizes[g];
    Tensor ref_dw = Tensor::zeros({N, K}, DType::kF32);
    if (m > 0) {
      Tensor ref = Tensor::empty({m, N}, DType::kF32), ref_dinp = Tensor::empty({m, K}, DType::kF32);
      const TensorView wg = w.view().slice_flat(g * N * K, {N, K}), ig = inp.view().slice_flat(o * K, {m, K});
      const TensorView dg = dout.view().slice_flat(o * N, {m, N});
      ops.matmul_forward(ref, ig, wg, TensorView());
      ops.matmul_backward(ref_dinp, ref_dw, TensorView(), dg, ig, wg);
      // The same products: equal up to the order of the 7- and 5-term sums. (The grouped op cuts its
      // products into other pieces than matmul_forward; oneDNN's AVX-512 sgemm gives every row the same bits
      // whatever the pieces, its AVX2 one does not.)
      for (int64_t i = 0; i < m * N; ++i)
        ASSERT_NEAR(out.data<float>()[o * N + i], ref.data<float>()[i], 2e-6) << "group " << g << " out " << i;
      for (int64_t i = 0; i < m * K; ++i)
        ASSERT_NEAR(dinp.data<float>()[o * K + i], ref_dinp.data<float>()[i], 2e-6) << "group " << g << " dinp " << i;
    }
    for (int64_t i = 0; i < N * K; ++i)
      EXPECT_NEAR(dw.data<float>()[g * N * K + i], dw0.data<float>()[g * N * K + i] + ref_dw.data<float>()[i], 1e-5);
    o += m;
  }
  EXPECT_THROW(ops.grouped_matmul_forward(out, inp, w, {3, 0, 216, 1}), Error);  // sizes do not sum to M
  EXPECT_THROW(ops.grouped_matmul_forward(out, inp, w, {221, 0, 0}), Error);     // one size per group
}

// f32 runs every group's product as pieces of >= 512 output rows or columns, all groups' pieces in one
// parallel region: groups of 600 and 1100 rows (cut along N = 1030 and along M), a small and an empty one,
// against f64 (dweight accumulating), and the same bits with 1 and 2 threads.
TEST(CpuMoe, GroupedMatmulF32PiecesMatchF64AndThreadCounts) {
  const OpTable& ops = test::ops();
  const std::vector<int64_t> sizes = {600, 0, 1100, 37};
  const int64_t M = 1737, K = 64, N = 1030, G = 4;
  const Tensor inp = test::uniform_tensor({M, K}, 1), w = test::uniform_tensor({G, N, K}, 2);
  const Tensor dout = test::uniform_tensor({M, N}, 3), dw0 = test::uniform_tensor({G, N, K}, 4);
  auto run = [&](Tensor& out, Tensor& dinp, Tensor& dw) {
    out = Tensor::empty({M, N}, DType::kF32);
    dinp = Tensor::empty({M, K}, DType::kF32);
    dw = test::clone(dw0);
    ops.grouped_matmul_forward(out, inp, w, sizes);
    ops.grouped_matmul_backward(dinp, dw, dout, inp, w, sizes);
  };
  Tensor out, dinp, dw, out1, dinp1, dw1;
  test::with_threads(2, [&] { run(out, dinp, dw); });
  test::with_threads(1, [&] { run(out1, dinp1, dw1); });
  EXPECT_TRUE(test::same_bits(out, out1) && test::same_bits(dinp, dinp1) && test::same_bits(dw, dw1));
  std::vector<double> ref_out(size_t(M * N)), ref_dinp(size_t(M * K)), ref_dw = test::to_f64(dw0);
  const float *x = inp.data<float>(), *wt = w.data<float>(), *dy = dout.data<float>();
  int64_t o = 0;
  for (int64_t g = 0; g < G; ++g) {
    const float* wg = wt + g * N * K;
    for (int64_t r = o; r < o + sizes[size_t(g)]; ++r)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          ref_out[size_t(r * N + n)] += double(x[r * K + k]) * wg[n * K + k];
          ref_dinp[size_t(r * K + k)] += double(dy[r * N + n]) * wg[n * K + k];
          ref_dw[size_t(g * N * K + n * K + k)] += double(dy[r * N + n]) * x[r * K + k];
        }
    o += sizes[size_t(g)];
  }
  test::expect_close(out, ref_out, 1e-4, 1e-5, "grouped f32 forward");
  test::expect_close(dinp, ref_dinp, 1e-4, 1e-5, "grouped f32 dinp");
  test::expect_close(dw, ref_dw, 1e-3, 1e-5, "grouped f32 dweight (accumulate)");
}

// With AVX-512, f32 weight gradients over at most 384 group rows run on Loom's own tile (moe.cpp's
// dweight_piece: 6 x 64 tiles, non-temporal stores when overwriting) instead of sgemm. Its bits are those of
// one sgemm over the group (oneDNN's AVX-512 kernels: one fused multiply-add chain per output up to 384
// rows), overwriting and accumulating, on shapes whose rows are no multiple of 6 and whose columns are no
// multiple of 64 or 16 (partial vectors, unaligned rows), groups of 1 to 384 rows, one of 385 and a shape
// of few rows and many columns (both sgemm).
TEST(CpuMoe, GroupedF32WeightGradientsAreOneSgemmPerGroup) {
  const OpTable& ops = test::ops();
  const bool avx512_sgemm = cpu::matmul_detail::onednn_isa_has(dnnl_cpu_isa_avx512_core);
  struct Case {
    int64_t N, K;
    std::vector<int64_t> sizes;
  };
  for (const Case& c : {Case{1030, 64, {1, 5, 128, 0, 384}}, Case{1100, 1100, {7, 200, 385}},
                        Case{700, 83, {96, 13}}, Case{6, 16, {3, 384}}, Case{37, 1100, {7, 200}}}) {
    const int64_t G = int64_t(c.sizes.size()), N = c.N, K = c.K;
    int64_t M = 0;
    for (int64_t m : c.sizes) M += m;
    const Tensor inp = test::uniform_tensor({M, K}, 11), w = test::uniform_tensor({G, N, K}, 12);
    const Tensor dout = test::uniform_tensor({M, N}, 13), dw0 = test::uniform_tensor({G, N, K}, 14);
    for (const GradWrite mode : {GradWrite::kOverwrite, GradWrite::kAccumulate}) {
      Tensor dw = mode == GradWrite::kOverwrite ? Tensor::zeros({G, N, K}, DType::kF32) : test::clone(dw0);
      Tensor ref = test::clone(dw0);
      ops.grouped_matmul_backward(TensorView(), dw, dout, inp, w, c.sizes, mode);
      int64_t o = 0;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t m = c.sizes[size_t(g)];
        float* rg = ref.data<float>() + g * N * K;
        if (m > 0)
          cpu::sgemm_serial(true, false, N, K, m, dout.data<float>() + o * N, N, inp.data<float>() + o * K, K,
                            mode == GradWrite::kAccumulate, rg, K);
        else if (mode == GradWrite::kOverwrite)
          std::fill(rg, rg + N * K, 0.0f);
        o += m;
      }
      const std::string what = "dweight N " + std::to_string(N) + " K " + std::to_string(K) +
                               (mode == GradWrite::kOverwrite ? " overwrite" : " accumulate");
      if (avx512_sgemm) {
        EXPECT_TRUE(test::same_bits(dw, ref)) << what;
      } else {  // oneDNN capped below AVX-512 (DNNL_MAX_CPU_ISA): its sums may be ordered otherwise
        test::expect_close(dw, test::to_f64(ref), 1e-5, 1e-5, what);
      }
    }
  }
}

// bf16 runs on cached per-shape oneDNN primitives, so the op rounds every group's rows up to 16 x a 7-smooth
// count: in place over the next groups' rows (out, dinp), through zero-padded scratch at the end of the
// buffer (the last group, 33 rows) and for dweight. Groups of 1, 3, 5, 16, 20, 33, 37, 449 rows and an empty
// one, against an f64 reference on the same bf16 values (f32 outputs: only f32 accumulation error), and the
// same bits with 1 and 2 threads.
TEST(CpuMoe, GroupedMatmulBf16PadsGroups) {
  const OpTable& ops = test::ops();
  // 449 rows pad to 480 (16 x 30: 16 x 29 is one of oneDNN's slow row counts), 31 rows running over the next
  // two groups (5 and 20 rows) into the last one, which are computed afterwards.
  const std::vector<int64_t> sizes = {3, 0, 37, 16, 1, 449, 5, 20, 33};
  const int64_t M = 564, K = 40, N = 24, G = 9;
  const Tensor inp = test::lowp_uniform({M, K}, DType::kBF16, 1), w = test::lowp_uniform({G, N, K}, DType::kBF16, 2);
  const Tensor dout = test::lowp_uniform({M, N}, DType::kBF16, 3), dw0 = test::uniform_tensor({G, N, K}, 4);
  const Tensor inp32 = test::widened(inp), w32 = test::widened(w), dout32 = test::widened(dout);
  auto run = [&](Tensor& out, Tensor& dinp, Tensor& dw) {
    out = Tensor::empty({M, N}, DType::kF32);
    dinp = Tensor::empty({M, K}, DType::kF32);
    dw = test::clone(dw0);
    ops.grouped_matmul_forward(out, inp, w, sizes);
    ops.grouped_matmul_backward(dinp, dw, dout, inp, w, sizes);
  };
  Tensor out, dinp, dw, out1, dinp1, dw1;
  test::with_threads(2, [&] { run(out, dinp, dw); });
  test::with_threads(1, [&] { run(out1, dinp1, dw1); });
  EXPECT_TRUE(test::same_bits(out, out1) && test::same_bits(dinp, dinp1) && test::same_bits(dw, dw1));
  std::vector<double> ref_out(size_t(M * N)), ref_dinp(size_t(M * K)), ref_dw = test::to_f64(dw0);
  const float *x = inp32.data<float>(), *wt = w32.data<float>(), *dy = dout32.data<float>();
  int64_t o = 0;
  for (int64_t g = 0; g < G; ++g) {
    const float* wg = wt + g * N * K;
    for (int64_t r = o; r < o + sizes[size_t(g)]; ++r) {
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          ref_out[size_t(r * N + n)] += double(x[r * K + k]) * wg[n * K + k];
          ref_dinp[size_t(r * K + k)] += double(dy[r * N + n]) * wg[n * K + k];
          ref_dw[size_t(g * N * K + n * K + k)] += double(dy[r * N + n]) * x[r * K + k];
        }
    }
    o += sizes[size_t(g)];
  }
  test::expect_close(out, ref_out, 1e-5, 1e-5, "grouped bf16 forward");
  test::expect_close(dinp, ref_dinp, 1e-5, 1e-5, "grouped bf16 dinp");
  test::expect_close(dw, ref_dw, 1e-5, 1e-5, "grouped bf16 dweight (accumulate)");
}

}  // namespace
}  // namespace loom
