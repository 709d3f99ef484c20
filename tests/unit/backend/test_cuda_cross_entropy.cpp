// CUDA fused cross-entropy against the CPU reference: losses and in-place dlogits for f32/bf16/f16 logits,
// V = 1, 5, 217, 1000, 50257 with and without padding columns (Vp > V, gradient 0 there), loss masks with
// zeros and -1 / out-of-range targets under mask 0 (loss 0, gradient 0), forward only (logits untouched),
// no mask; determinism (same bits twice, and the same bits for an unaligned copy of the logits); the
// out-of-range target error raised before any work; argument checks. Skips without a GPU.
#if defined(LOOM_HAVE_CUDA)
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cross_entropy.cuh"
#include "cuda_test_util.h"

namespace loom::test {
namespace {

struct Case {
  int64_t N, V, Vp;
};

struct Inputs {
  Tensor logits, targets, mask;  // host; mask may be empty
};

// Logits spread over [-6, 6) (a realistic softmax: not one-hot, not uniform), targets in [0, V); with a
// mask, every third row is masked out and two of those carry out-of-range targets (-1 and V).
Inputs make_inputs(const Case& c, DType dt, bool with_mask, uint64_t seed) {
  Inputs in;
  in.logits = random_host({c.N, c.Vp}, dt, seed, -6.0f, 6.0f);
  in.targets = Tensor::empty({c.N}, DType::kI32);
  std::mt19937_64 g(seed + 1);
  std::uniform_int_distribution<int64_t> pick(0, c.V - 1);
  for (int64_t n = 0; n < c.N; ++n) in.targets.data<int32_t>()[n] = int32_t(pick(g));
  // A target in the last real column (next to the padding) when there is room.
  if (c.N > 1) in.targets.data<int32_t>()[1] = int32_t(c.V - 1);
  if (with_mask) {
    in.mask = Tensor::empty({c.N}, DType::kF32);
    int masked = 0;
    for (int64_t n = 0; n < c.N; ++n) {
      const bool out = n % 3 == 2;
      in.mask.data<float>()[n] = out ? 0.0f : (n % 2 ? 1.0f : 0.5f);
      if (out && masked < 2) in.targets.data<int32_t>()[n] = masked++ == 0 ? -1 : int32_t(c.V);
    }
  }
  return in;
}

// Tolerances for dlogits by the logits' dtype (values are probabilities times the scale, |d| < 1): f32 is
// limited by exp (both sides < 2 ulp) and the f32 vs f64 sums; bf16/f16 by one rounding of the result.
float grad_tol(DType dt) { return dt == DType::kF32 ? 4e-6f : default_tol(dt); }

void run_case(const Case& c, DType dt, bool with_mask, float scale, uint64_t seed) {
  auto& ctx = cuda_ctx();
  const std::string tag = std::string(dtype_name(dt)) + " N=" + std::to_string(c.N) + " V=" + std::to_string(c.V) +
                          " Vp=" + std::to_string(c.Vp) + (with_mask ? " mask" : "") +
                          " scale=" + std::to_string(scale);
  Inputs in = make_inputs(c, dt, with_mask, seed);
  const Tensor logits0 = host_clone(in.logits);

  Tensor ref_logits = host_clone(in.logits);
  Tensor ref_losses = Tensor::empty({c.N}, DType::kF32);
  cpu_ref().cross_entropy_forward_backward(ref_losses, ref_logits, in.targets, c.V, in.mask, scale);

  Tensor d_logits = to_device(in.logits), d_targets = to_device(in.targets);
  Tensor d_mask = with_mask ? to_device(in.mask) : Tensor();
  Tensor d_losses = ctx.empty({c.N}, DType::kF32);
  cuda::cross_entropy_forward_backward(ctx, d_losses, d_logits, d_targets, c.V, d_mask, scale);
  const Tensor got_losses = to_host(d_losses), got_logits = to_host(d_logits);

  // Losses ~ log(V) <= 11: f32 arithmetic either side, 2e-5 relative to max(1, |loss|).
  expect_close(got_losses, ref_losses, 2e-5f, "losses " + tag);
  if (scale == 0.0f) {
    EXPECT_TRUE(same_bytes(got_logits, logits0)) << "forward only must leave the logits alone: " << tag;
  } else {
    expect_close(got_logits, ref_logits, grad_tol(dt), "dlogits " + tag);
  }
  // Exact zeros: padding columns, masked-out rows; masked-out rows with bad targets also get loss 0.
  for (int64_t n = 0; n < c.N; ++n) {
    const bool masked_out = with_mask && in.mask.data<float>()[n] == 0.0f;
    const int32_t t = in.targets.data<int32_t>()[n];
    if (t < 0 || t >= c.V) {
      EXPECT_EQ(got_losses.data<float>()[n], 0.0f) << tag << " row " << n;
    }
    if (scale == 0.0f) continue;
    for (int64_t j = 0; j < c.Vp; ++j) {
      if (j < c.V && !masked_out) continue;
      if (host_get(got_logits, n * c.Vp + j) != 0.0f) {
        ADD_FAILURE() << tag << ": expected gradient 0 at row " << n << " column " << j;
        break;
      }
    }
  }

  // Determinism, and independence of the rows' alignment (the unaligned copy takes the scalar loads).
  if (scale != 0.0f) {
    Tensor again = to_device(in.logits), again_losses = ctx.empty({c.N}, DType::kF32);
    cuda::cross_entropy_forward_backward(ctx, again_losses, again, d_targets, c.V, d_mask, scale);
    EXPECT_TRUE(same_bytes(to_host(again), got_logits)) << "dlogits not deterministic: " << tag;
    EXPECT_TRUE(same_bytes(to_host(again_losses), got_losses)) << "losses not deterministic: " << tag;
    Tensor shifted = to_device_at(in.logits, 1), shifted_losses = ctx.empty({c.N}, DType::kF32);
    cuda::cross_entropy_forward_backward(ctx, shifted_losses, shifted, d_targets, c.V, d_mask, scale);
    EXPECT_TRUE(same_bytes(to_host(shifted), got_logits)) << "dlogits depend on alignment: " << tag;
    EXPECT_TRUE(same_bytes(to_host(shifted_losses), got_losses)) << "losses depend on alignment: " << tag;
  }
}

const std::vector<Case> kCases = {{1, 1, 1},       {1, 5, 5},       {5, 217, 217},  {5, 217, 224},
                                  {7, 1000, 1003}, {3, 50257, 50304}, {2, 50257, 50257}, {64, 217, 256}};

TEST(CudaCrossEntropy, MatchesCpuWithPaddingAndMasks) {
  REQUIRE_GPU();
  uint64_t seed = 1;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (const Case& c : kCases)
      for (bool with_mask : {false, true}) run_case(c, dt, with_mask, 1.0f / float(c.N), seed++);
}

TEST(CudaCrossEntropy, ForwardOnlyAndOtherScales) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    run_case({5, 217, 224}, dt, true, 0.0f, seed++);
    run_case({3, 50257, 50304}, dt, false, 0.0f, seed++);
    run_case({5, 217, 217}, dt, true, -2.5f, seed++);
    run_case({4, 1000, 1000}, dt, false, 4096.0f, seed++);
  }
}

TEST(CudaCrossEntropy, BadTargetIsAnErrorBeforeAnyWork) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const Case c{6, 217, 224};
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Inputs in = make_inputs(c, dt, true, 7);
    in.targets.data<int32_t>()[4] = 217;  // row 4 is not masked out (4 % 3 != 2)
    ASSERT_NE(in.mask.data<float>()[4], 0.0f);
    Tensor d_logits = to_device(in.logits), d_targets = to_device(in.targets), d_mask = to_device(in.mask);
    Tensor d_losses = ctx.empty({c.N}, DType::kF32);
    const std::string msg =
        what_of([&] { cuda_ops().cross_entropy_forward_backward(d_losses, d_logits, d_targets, c.V, d_mask, 1.0f); });
    EXPECT_NE(msg.find("outside the vocabulary"), std::string::npos) << msg;
    EXPECT_NE(msg.find("target 217 of row 4"), std::string::npos) << msg;
    EXPECT_TRUE(same_bytes(to_host(d_logits), in.logits)) << "the logits must be untouched";
    // The CPU agrees that this is an error.
    Tensor ref_losses = Tensor::empty({c.N}, DType::kF32);
    EXPECT_NE(what_of([&] {
                cpu_ref().cross_entropy_forward_backward(ref_losses, in.logits, in.targets, c.V, in.mask, 1.0f);
              }).find("outside the vocabulary"),
              std::string::npos);
    // Without a mask a -1 target is an error too (the first bad row is named).
    in.targets.data<int32_t>()[2] = -1;
    Tensor d_targets2 = to_device(in.targets);
    const std::string msg2 =
        what_of([&] { cuda_ops().cross_entropy_forward_backward(d_losses, d_logits, d_targets2, c.V, {}, 1.0f); });
    EXPECT_NE(msg2.find("target -1 of row 2"), std::string::npos) << msg2;
  }
}

TEST(CudaCrossEntropy, ChecksArguments) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  Tensor logits = ctx.empty({4, 10}, DType::kF32), losses = ctx.empty({4}, DType::kF32);
  Tensor targets = to_device(Tensor::zeros({4}, DType::kI32));
  auto call = [&](TensorView l, TensorView lg, TensorView t, int64_t V, TensorView m) {
    return what_of([&] { cuda_ops().cross_entropy_forward_backward(l, lg, t, V, m, 1.0f); });
  };
  EXPECT_NE(call(losses, logits, targets, 11, {}).find("vocab_size"), std::string::npos);
  EXPECT_NE(call(losses, logits, targets, 0, {}).find("vocab_size"), std::string::npos);
  EXPECT_NE(call(ctx.empty({3}, DType::kF32), logits, targets, 10, {}).find("losses"), std::string::npos);
  EXPECT_NE(call(losses, logits, ctx.empty({4}, DType::kI64), 10, {}).find("targets"), std::string::npos);
  EXPECT_NE(call(losses, logits, targets, 10, ctx.empty({5}, DType::kF32)).find("loss_mask"), std::string::npos);
  EXPECT_NE(call(losses, ctx.empty({4, 10}, DType::kF8E4M3), targets, 10, {}).find("logits"), std::string::npos);
  Tensor host_logits = Tensor::empty({4, 10}, DType::kF32);
  EXPECT_NE(call(losses, host_logits, targets, 10, {}), "no exception");
}

}  // namespace
}  // namespace loom::test
#endif  // LOOM_HAVE_CUDA
