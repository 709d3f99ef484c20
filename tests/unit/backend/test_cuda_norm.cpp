// CUDA LayerNorm / RMSNorm launchers (src/backend/cuda/norm.cu) against the CPU reference on identical
// inputs: odd shapes (N 1, 5, 217; C 1, 5, 64, 217, 771 in the warp-per-row kernels, 1536 and 2053 in the
// block-per-row kernels; 13000 and 60001 rows that need opted-in or no shared memory), every compute dtype,
// with and without bias and saved statistics, parameter gradients in f32 and in the compute dtype,
// pre-filled dinp / dweight / dbias (they must ACCUMULATE), run-to-run determinism, statistics that do not
// depend on the buffers' alignment (vector vs scalar path), the fused residual forms equal to the unfused
// pair bit for bit, and argument errors. Skipped without a GPU.
#if defined(LOOM_HAVE_CUDA)
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/cuda/norm.cuh"
#include "cuda_test_util.h"
#include "loom/core/check.h"

namespace loom::test {
namespace {

constexpr float kEps = 1e-5f;
const DType kDts[] = {DType::kF32, DType::kBF16, DType::kF16};
const int64_t kNs[] = {1, 5, 217};
const int64_t kCs[] = {1, 5, 64, 217, 771, 1536, 2053};

// f32 results differ from the CPU's by summation order only; 16-bit ones by at most one rounding step.
float tol(DType dt) { return dt == DType::kF32 ? 1e-4f : default_tol(dt); }

std::string tag(const char* what, DType dt, int64_t N, int64_t C) {
  return std::string(what) + " " + dtype_name(dt) + " N" + std::to_string(N) + " C" + std::to_string(C);
}

// Short names for the helpers of cuda_test_util.h; offset > 0 gives misaligned views.
Tensor dev(const Tensor& h, int64_t offset = 0) { return to_device_at(h, offset); }
Tensor dev_empty(Shape s, DType dt, int64_t offset = 0) { return device_empty_at(s, dt, offset); }

const cuda::CudaContext& ctx() { return cuda_ctx(); }

// ---- LayerNorm forward ------------------------------------------------------------------------------

void check_layernorm_forward(DType dt, int64_t N, int64_t C, bool with_bias, bool with_stats, uint64_t seed) {
  const std::string t = tag("layernorm_forward", dt, N, C) + (with_bias ? " bias" : "") + (with_stats ? "" : " nostats");
  Tensor x = random_host({N, C}, dt, seed, -2.0f, 2.0f);
  Tensor w = random_host({C}, dt, seed + 1, 0.5f, 1.5f);
  Tensor b = with_bias ? random_host({C}, dt, seed + 2) : Tensor();
  Tensor out = Tensor::empty({N, C}, dt), mean = Tensor::empty({N}, DType::kF32), rstd = Tensor::empty({N}, DType::kF32);
  cpu_ref().layernorm_forward(out, mean, rstd, x, w, b, kEps);

  Tensor dx = dev(x), dw = dev(w), db = with_bias ? dev(b) : Tensor();
  Tensor dout = dev_empty({N, C}, dt);
  Tensor dmean = with_stats ? dev_empty({N}, DType::kF32) : Tensor();
  Tensor drstd = with_stats ? dev_empty({N}, DType::kF32) : Tensor();
  cuda::layernorm_forward(ctx(), dout, dmean, drstd, dx, dw, db, kEps);
  expect_close(dout, out, tol(dt), t + " out");
  if (with_stats) {
    expect_close(dmean, mean, 1e-4f, t + " mean");
    expect_close(drstd, rstd, 1e-4f, t + " rstd");
  }
}

TEST(CudaNorm, LayerNormForwardMatchesCpu) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (DType dt : kDts)
    for (int64_t N : kNs)
      for (int64_t C : kCs) check_layernorm_forward(dt, N, C, /*with_bias=*/(N + C) % 2 == 0, true, ++seed);
  // Both bias choices and absent statistics on a few shapes.
  for (DType dt : kDts)
    for (int64_t C : {int64_t(5), int64_t(64), int64_t(1536)}) {
      check_layernorm_forward(dt, 5, C, true, true, ++seed);
      check_layernorm_forward(dt, 5, C, false, true, ++seed);
      check_layernorm_forward(dt, 217, C, true, false, ++seed);
    }
}

// ---- RMSNorm forward --------------------------------------------------------------------------------

void check_rmsnorm_forward(DType dt, int64_t N, int64_t C, bool with_stats, uint64_t seed) {
  const std::string t = tag("rmsnorm_forward", dt, N, C) + (with_stats ? "" : " nostats");
  Tensor x = random_host({N, C}, dt, seed, -2.0f, 2.0f);
  Tensor w = random_host({C}, dt, seed + 1, 0.5f, 1.5f);
  Tensor out = Tensor::empty({N, C}, dt), rstd = Tensor::empty({N}, DType::kF32);
  cpu_ref().rmsnorm_forward(out, rstd, x, w, kEps);
  Tensor dout = dev_empty({N, C}, dt);
  Tensor drstd = with_stats ? dev_empty({N}, DType::kF32) : Tensor();
  cuda::rmsnorm_forward(ctx(), dout, drstd, dev(x), dev(w), kEps);
  expect_close(dout, out, tol(dt), t + " out");
  if (with_stats) expect_close(drstd, rstd, 1e-4f, t + " rstd");
}

TEST(CudaNorm, RmsNormForwardMatchesCpu) {
  REQUIRE_GPU();
  uint64_t seed = 200;
  for (DType dt : kDts)
    for (int64_t N : kNs)
      for (int64_t C : kCs) check_rmsnorm_forward(dt, N, C, true, ++seed);
  for (DType dt : kDts) check_rmsnorm_forward(dt, 217, 771, false, ++seed);
}

// ---- fused residual forms ---------------------------------------------------------------------------

TEST(CudaNorm, ResidualFormsMatchCpuAndTheUnfusedPair) {
  REQUIRE_GPU();
  uint64_t seed = 300;
  for (DType dt : kDts)
    for (int64_t N : kNs)
      for (int64_t C : kCs) {
        const std::string t = tag("residual norm", dt, N, C);
        Tensor a = random_host({N, C}, dt, ++seed), b = random_host({N, C}, dt, ++seed);
        Tensor w = random_host({C}, dt, ++seed, 0.5f, 1.5f), bias = random_host({C}, dt, ++seed);
        Tensor da = dev(a), db = dev(b), dw = dev(w), dbias = dev(bias);

        // LayerNorm: CPU reference.
        Tensor res = Tensor::empty({N, C}, dt), out = Tensor::empty({N, C}, dt);
        Tensor mean = Tensor::empty({N}, DType::kF32), rstd = Tensor::empty({N}, DType::kF32);
        cpu_ref().residual_layernorm_forward(res, out, mean, rstd, a, b, w, bias, kEps);
        Tensor gres = dev_empty({N, C}, dt), gout = dev_empty({N, C}, dt);
        Tensor gmean = dev_empty({N}, DType::kF32), grstd = dev_empty({N}, DType::kF32);
        cuda::residual_layernorm_forward(ctx(), gres, gout, gmean, grstd, da, db, dw, dbias, kEps);
        // a + b is one f32 add rounded once on both sides: the same bits.
        EXPECT_TRUE(same_bytes(to_host(gres), res)) << t << " residual";
        expect_close(gout, out, tol(dt), t + " ln out");
        expect_close(gmean, mean, 1e-4f, t + " ln mean");
        expect_close(grstd, rstd, 1e-4f, t + " ln rstd");
        // The unfused GPU forward on the stored residual gives the same bits.
        Tensor uout = dev_empty({N, C}, dt);
        Tensor umean = dev_empty({N}, DType::kF32), urstd = dev_empty({N}, DType::kF32);
        cuda::layernorm_forward(ctx(), uout, umean, urstd, gres, dw, dbias, kEps);
        EXPECT_TRUE(same_bytes(to_host(uout), to_host(gout))) << t << " ln fused vs unfused out";
        EXPECT_TRUE(same_bytes(to_host(umean), to_host(gmean))) << t << " ln fused vs unfused mean";
        EXPECT_TRUE(same_bytes(to_host(urstd), to_host(grstd))) << t << " ln fused vs unfused rstd";

        // RMSNorm.
        Tensor rres = Tensor::empty({N, C}, dt), rout = Tensor::empty({N, C}, dt);
        Tensor rrstd = Tensor::empty({N}, DType::kF32);
        cpu_ref().residual_rmsnorm_forward(rres, rout, rrstd, a, b, w, kEps);
        Tensor gr_res = dev_empty({N, C}, dt), gr_out = dev_empty({N, C}, dt), gr_rstd = dev_empty({N}, DType::kF32);
        cuda::residual_rmsnorm_forward(ctx(), gr_res, gr_out, gr_rstd, da, db, dw, kEps);
        EXPECT_TRUE(same_bytes(to_host(gr_res), rres)) << t << " rms residual";
        expect_close(gr_out, rout, tol(dt), t + " rms out");
        expect_close(gr_rstd, rrstd, 1e-4f, t + " rms rstd");
        Tensor ur_out = dev_empty({N, C}, dt), ur_rstd = dev_empty({N}, DType::kF32);
        cuda::rmsnorm_forward(ctx(), ur_out, ur_rstd, gr_res, dw, kEps);
        EXPECT_TRUE(same_bytes(to_host(ur_out), to_host(gr_out))) << t << " rms fused vs unfused out";
        EXPECT_TRUE(same_bytes(to_host(ur_rstd), to_host(gr_rstd))) << t << " rms fused vs unfused rstd";
      }
}

// ---- alignment independence and determinism of the forwards ------------------------------------------

TEST(CudaNorm, ForwardBitsDoNotDependOnAlignmentOrRun) {
  REQUIRE_GPU();
  uint64_t seed = 400;
  for (DType dt : kDts)
    for (int64_t C : {int64_t(64), int64_t(1536)}) {  // multiples of every chunk: aligned views vectorise
      const int64_t N = 217;
      const std::string t = tag("forward alignment", dt, N, C);
      Tensor x = random_host({N, C}, dt, ++seed), w = random_host({C}, dt, ++seed), b = random_host({C}, dt, ++seed);
      auto run = [&](int64_t offset, bool rms) {
        Tensor out = dev_empty({N, C}, dt, offset), rstd = dev_empty({N}, DType::kF32), mean = dev_empty({N}, DType::kF32);
        if (rms) {
          cuda::rmsnorm_forward(ctx(), out, rstd, dev(x, offset), dev(w, offset), kEps);
        } else {
          cuda::layernorm_forward(ctx(), out, mean, rstd, dev(x, offset), dev(w, offset), dev(b, offset), kEps);
        }
        return std::vector<Tensor>{to_host(out), to_host(rstd), rms ? Tensor() : to_host(mean)};
      };
      for (bool rms : {false, true}) {
        const auto aligned = run(0, rms), again = run(0, rms), shifted = run(1, rms);
        for (size_t k = 0; k < aligned.size(); ++k) {
          if (!aligned[k].defined()) continue;
          EXPECT_TRUE(same_bytes(aligned[k], again[k])) << t << (rms ? " rms" : " ln") << " run-to-run, tensor " << k;
          EXPECT_TRUE(same_bytes(aligned[k], shifted[k])) << t << (rms ? " rms" : " ln") << " aligned vs not, " << k;
        }
      }
    }
}

// ---- backward ---------------------------------------------------------------------------------------

struct BwdCase {
  DType dt;
  int64_t N, C;
  DType gdt;       // dweight/dbias dtype (f32 or dt)
  bool has_dinp, has_dw, has_db;
  int64_t offset;  // element offset of every device view (1: unaligned, scalar path)
};

std::string bwd_tag(const char* op, const BwdCase& k) {
  return tag(op, k.dt, k.N, k.C) + " grads " + dtype_name(k.gdt) + (k.has_dinp ? " dinp" : "") +
         (k.has_dw ? " dw" : "") + (k.has_db ? " db" : "") + (k.offset ? " unaligned" : "");
}

// Runs the CPU and the GPU backward (LayerNorm or RMSNorm) from the same pre-filled gradients and compares;
// the GPU run is repeated from the same start to check the bits are reproducible.
void check_backward(const BwdCase& k, bool rms, uint64_t seed) {
  const std::string t = bwd_tag(rms ? "rmsnorm_backward" : "layernorm_backward", k);
  const int64_t N = k.N, C = k.C;
  Tensor x = random_host({N, C}, k.dt, seed, -2.0f, 2.0f);
  Tensor w = random_host({C}, k.dt, seed + 1, 0.5f, 1.5f);
  Tensor dy = random_host({N, C}, k.dt, seed + 2);
  Tensor y = Tensor::empty({N, C}, k.dt), mean = Tensor::empty({N}, DType::kF32), rstd = Tensor::empty({N}, DType::kF32);
  if (rms) cpu_ref().rmsnorm_forward(y, rstd, x, w, kEps);
  else cpu_ref().layernorm_forward(y, mean, rstd, x, w, Tensor(), kEps);
  // Pre-filled gradients: the op must add to them.
  const Tensor dx0 = k.has_dinp ? random_host({N, C}, k.dt, seed + 3) : Tensor();
  const Tensor dw0 = k.has_dw ? random_host({C}, k.gdt, seed + 4, -3.0f, 3.0f) : Tensor();
  const Tensor db0 = (k.has_db && !rms) ? random_host({C}, k.gdt, seed + 5, -3.0f, 3.0f) : Tensor();

  Tensor dx = dx0.defined() ? host_clone(dx0) : Tensor();
  Tensor dw = dw0.defined() ? host_clone(dw0) : Tensor();
  Tensor db = db0.defined() ? host_clone(db0) : Tensor();
  if (rms) cpu_ref().rmsnorm_backward(dx, dw, dy, x, w, rstd);
  else cpu_ref().layernorm_backward(dx, dw, db, dy, x, w, mean, rstd);

  const int64_t o = k.offset;
  Tensor gx = dev(x, o), gw = dev(w, o), gdy = dev(dy, o), gmean = dev(mean), grstd = dev(rstd);
  std::vector<Tensor> first;
  for (int run = 0; run < 2; ++run) {
    Tensor gdx = dx0.defined() ? dev(dx0, o) : Tensor();
    Tensor gdw = dw0.defined() ? dev(dw0, o) : Tensor();
    Tensor gdb = db0.defined() ? dev(db0, o) : Tensor();
    if (rms) cuda::rmsnorm_backward(ctx(), gdx, gdw, gdy, gx, gw, grstd);
    else cuda::layernorm_backward(ctx(), gdx, gdw, gdb, gdy, gx, gw, gmean, grstd);
    std::vector<Tensor> got = {gdx.defined() ? to_host(gdx) : Tensor(), gdw.defined() ? to_host(gdw) : Tensor(),
                               gdb.defined() ? to_host(gdb) : Tensor()};
    if (run == 0) {
      if (dx.defined()) expect_close(got[0], dx, tol(k.dt), t + " dinp");
      // Column sums over N rows: f32 order differences grow with N, 16-bit results round once.
      if (dw.defined()) expect_close(got[1], dw, k.gdt == DType::kF32 ? 2e-4f : tol(k.gdt), t + " dweight");
      if (db.defined()) expect_close(got[2], db, k.gdt == DType::kF32 ? 2e-4f : tol(k.gdt), t + " dbias");
      first = got;
    } else {
      for (size_t i = 0; i < got.size(); ++i) {
        if (got[i].defined()) {
          EXPECT_TRUE(same_bytes(got[i], first[i])) << t << " run-to-run, gradient " << i;
        }
      }
    }
  }
}

TEST(CudaNorm, LayerNormBackwardMatchesCpu) {
  REQUIRE_GPU();
  uint64_t seed = 500;
  for (DType dt : kDts)
    for (int64_t N : kNs)
      for (int64_t C : kCs) {
        const DType gdt = (N + C) % 2 ? DType::kF32 : dt;  // both gradient dtypes across the shapes
        check_backward({dt, N, C, gdt, true, true, true, 0}, false, seed += 10);
      }
  // Each gradient alone, mixed gradient dtypes, and misaligned views.
  for (DType dt : kDts)
    for (int64_t C : {int64_t(64), int64_t(771), int64_t(1536)}) {
      check_backward({dt, 217, C, DType::kF32, true, false, false, 0}, false, seed += 10);
      check_backward({dt, 217, C, dt, false, true, false, 0}, false, seed += 10);
      check_backward({dt, 217, C, DType::kF32, false, false, true, 0}, false, seed += 10);
      check_backward({dt, 217, C, dt, true, true, true, 1}, false, seed += 10);
    }
  // Many rows: several partial blocks per column and several rows per warp.
  for (DType dt : kDts) check_backward({dt, 5000, 96, DType::kF32, true, true, true, 0}, false, seed += 10);
}

TEST(CudaNorm, RmsNormBackwardMatchesCpu) {
  REQUIRE_GPU();
  uint64_t seed = 900;
  for (DType dt : kDts)
    for (int64_t N : kNs)
      for (int64_t C : kCs) {
        const DType gdt = (N + C) % 2 ? dt : DType::kF32;
        check_backward({dt, N, C, gdt, true, true, false, 0}, true, seed += 10);
      }
  for (DType dt : kDts)
    for (int64_t C : {int64_t(64), int64_t(1536)}) {
      check_backward({dt, 217, C, DType::kF32, true, false, false, 0}, true, seed += 10);
      check_backward({dt, 217, C, dt, false, true, false, 0}, true, seed += 10);
      check_backward({dt, 217, C, DType::kF32, true, true, false, 1}, true, seed += 10);
    }
  for (DType dt : kDts) check_backward({dt, 5000, 96, dt, true, true, false, 0}, true, seed += 10);
}

// Rows too wide for the default shared memory (13000: opted-in shared memory; 60001: more than any GPU
// gives a block, so the forward re-reads global memory and the backward accumulates in global partials).
TEST(CudaNorm, WideRows) {
  REQUIRE_GPU();
  uint64_t seed = 1300;
  for (DType dt : {DType::kF32, DType::kBF16})
    for (int64_t C : {int64_t(13000), int64_t(60001)}) {
      check_layernorm_forward(dt, 3, C, true, true, ++seed);
      check_rmsnorm_forward(dt, 3, C, true, ++seed);
      check_backward({dt, 9, C, DType::kF32, true, true, true, 0}, false, seed += 10);
      check_backward({dt, 9, C, dt, true, true, false, 0}, true, seed += 10);
    }
}

// ---- argument errors --------------------------------------------------------------------------------

TEST(CudaNorm, BadArgumentsThrow) {
  REQUIRE_GPU();
  const DType f = DType::kF32;
  Tensor x = dev_empty({5, 8}, f), out = dev_empty({5, 8}, f), w = dev_empty({8}, f), b = dev_empty({8}, f);
  Tensor mean = dev_empty({5}, f), rstd = dev_empty({5}, f);
  Tensor w_bad = dev_empty({7}, f), out_bad = dev_empty({5, 7}, f), stats_bad = dev_empty({4}, f);
  Tensor x_bf = dev_empty({5, 8}, DType::kBF16), x_i32 = dev_empty({5, 8}, DType::kI32);
  Tensor host_x = Tensor::empty({5, 8}, f);
  EXPECT_THROW(cuda_ops().layernorm_forward(out, mean, rstd, x, w_bad, b, kEps), Error);
  EXPECT_THROW(cuda_ops().layernorm_forward(out_bad, mean, rstd, x, w, b, kEps), Error);
  EXPECT_THROW(cuda_ops().layernorm_forward(out, stats_bad, rstd, x, w, b, kEps), Error);
  EXPECT_THROW(cuda_ops().layernorm_forward(out, mean, rstd, x_bf, w, b, kEps), Error);  // mixed dtypes
  EXPECT_THROW(cuda_ops().layernorm_forward(out, mean, rstd, x_i32, w, b, kEps), Error);
  EXPECT_THROW(cuda_ops().layernorm_forward(out, mean, rstd, host_x, w, b, kEps), Error);  // not on the device
  EXPECT_THROW(cuda_ops().layernorm_forward(out, mean, rstd, x, Tensor(), b, kEps), Error);  // weight required
  EXPECT_THROW(cuda_ops().layernorm_backward(x, w, b, out, x, w, Tensor(), rstd), Error);  // mean required
  EXPECT_THROW(cuda_ops().layernorm_backward(x, w_bad, b, out, x, w, mean, rstd), Error);
  EXPECT_THROW(cuda_ops().layernorm_backward(out_bad, w, b, out, x, w, mean, rstd), Error);
  EXPECT_THROW(cuda_ops().residual_layernorm_forward(x, out, mean, rstd, out_bad, x, w, b, kEps), Error);
  EXPECT_THROW(cuda_ops().rmsnorm_forward(out, stats_bad, x, w, kEps), Error);
  EXPECT_THROW(cuda_ops().rmsnorm_backward(x, w, out, x, w, Tensor()), Error);  // rstd required
  EXPECT_THROW(cuda_ops().rmsnorm_backward(x, dev_empty({8}, DType::kF16), out, x, w, rstd), Error);
  EXPECT_THROW(cuda_ops().residual_rmsnorm_forward(x, out, rstd, x, x_bf, w, kEps), Error);
  // Valid calls with nothing to do return quietly.
  EXPECT_NO_THROW(cuda_ops().layernorm_backward(Tensor(), Tensor(), Tensor(), out, x, w, mean, rstd));
  EXPECT_NO_THROW(cuda_ops().rmsnorm_forward(dev_empty({0, 8}, f), Tensor(), dev_empty({0, 8}, f), w, kEps));
}

}  // namespace
}  // namespace loom::test
#endif  // LOOM_HAVE_CUDA
