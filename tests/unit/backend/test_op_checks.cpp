// The op table checks every op's arguments once, at its entry points (src/backend/op_checks*.cpp), before
// any backend code runs. These tests call those entry points with representative bad arguments — a wrong
// dtype, mismatched shapes, a wrong rank, a missing or misplaced tensor, an out-of-range parameter — and
// expect the "[op] ..." message naming the tensor at fault: on a counting table that computes nothing (so the
// rejection is provably not the backend's), on the CPU backend, and on CUDA where a GPU is visible.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>

#include "backend/cpu/cpu_ops.h"
#include "loom/backend/ops.h"
#if defined(LOOM_HAVE_CUDA)
#include "cuda_test_util.h"
#endif

namespace loom::test {
namespace {

// An op table whose backend does nothing but count the calls that reach it.
class CountingOps final : public OpTable {
 public:
  explicit CountingOps(Device dev) : OpTable(dev) {}
  mutable int calls = 0;

 private:
  void do_matmul_forward(TensorView out, TensorView inp, TensorView weight, TensorView bias) const override { ++calls; }
  void do_matmul_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                          TensorView weight, GradWrite) const override { ++calls; }
  void do_embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                            TensorView position_ids) const override { ++calls; }
  void do_embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                             TensorView position_ids) const override { ++calls; }
  void do_layernorm_forward(TensorView out, TensorView mean, TensorView rstd, TensorView inp, TensorView weight,
                            TensorView bias, float eps) const override { ++calls; }
  void do_layernorm_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                             TensorView weight, TensorView mean, TensorView rstd) const override { ++calls; }
  void do_residual_layernorm_forward(TensorView residual, TensorView out, TensorView mean, TensorView rstd,
                                     TensorView a, TensorView b, TensorView weight, TensorView bias,
                                     float eps) const override { ++calls; }
  void do_rmsnorm_forward(TensorView out, TensorView rstd, TensorView inp, TensorView weight,
                          float eps) const override { ++calls; }
  void do_rmsnorm_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp, TensorView weight,
                           TensorView rstd) const override { ++calls; }
  void do_residual_rmsnorm_forward(TensorView residual, TensorView out, TensorView rstd, TensorView a, TensorView b,
                                   TensorView weight, float eps) const override { ++calls; }
  void do_glu_forward(TensorView out, TensorView inp, GluKind kind) const override { ++calls; }
  void do_glu_backward(TensorView dinp, TensorView inp, TensorView dout, GluKind kind, TensorView out) const override {
    ++calls;
  }
  void do_rope_forward(TensorView qkv, TensorView cos, TensorView sin, const AttentionParams& p, const RopeParams& r,
                       TensorView position_ids) const override { ++calls; }
  void do_rope_backward(TensorView dqkv, TensorView cos, TensorView sin, const AttentionParams& p, const RopeParams& r,
                        TensorView position_ids) const override { ++calls; }
  void do_residual_forward(TensorView out, TensorView a, TensorView b) const override { ++calls; }
  void do_gelu_forward(TensorView out, TensorView inp) const override { ++calls; }
  void do_gelu_backward(TensorView dinp, TensorView inp, TensorView dout, TensorView out) const override { ++calls; }
  void do_bias_add_forward(TensorView out, TensorView bias) const override { ++calls; }
  void do_bias_backward(TensorView dbias, TensorView dout) const override { ++calls; }
  void do_dropout_forward(TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
                          uint64_t offset) const override { ++calls; }
  void do_dropout_backward(TensorView dinp, TensorView dout, float p, uint64_t seed, uint64_t stream,
                           uint64_t offset) const override { ++calls; }
  void do_attention_forward(TensorView out, TensorView lse, TensorView qkv, const AttentionParams& p,
                            TensorView segment_ids) const override { ++calls; }
  void do_attention_backward(TensorView dqkv, TensorView dout, TensorView qkv, TensorView out, TensorView lse,
                             const AttentionParams& p, TensorView segment_ids) const override { ++calls; }
  void do_attention_block_forward(TensorView out, TensorView lse, TensorView q, TensorView kv,
                                  const AttentionBlock& blk, const AttentionParams& p) const override { ++calls; }
  void do_attention_merge(TensorView out, TensorView lse, TensorView out_block,
                          TensorView lse_block) const override { ++calls; }
  void do_attention_block_backward(TensorView dq, TensorView dkv, TensorView dout, TensorView q, TensorView kv,
                                   TensorView out, TensorView lse, const AttentionBlock& blk,
                                   const AttentionParams& p) const override { ++calls; }
  void do_attention_kv_pack(TensorView kv, TensorView qkv, const AttentionParams& p) const override { ++calls; }
  void do_attention_qkv_grad_unpack(TensorView dqkv, TensorView dq, TensorView dkv,
                                    const AttentionParams& p) const override { ++calls; }
  void do_cross_entropy_forward_backward(TensorView losses, TensorView logits, TensorView targets, int64_t vocab_size,
                                         TensorView loss_mask, float dlogits_scale) const override { ++calls; }
  void do_adamw_update(TensorView param, TensorView grad, TensorView m, TensorView v, const AdamWParams& p,
                       TensorView compute) const override { ++calls; }
  void do_sgd_update(TensorView param, TensorView grad, TensorView momentum_buf, const SgdParams& p,
                     TensorView compute) const override {
    ++calls;
  }
  double do_sum_squares(TensorView x) const override { ++calls; return 0; }
  int64_t do_count_zeros(TensorView x) const override { ++calls; return 0; }
  AbsStats do_abs_stats(TensorView x) const override { ++calls; return {}; }
  bool do_has_inf_or_nan(TensorView x) const override { ++calls; return false; }
  void do_scale_(TensorView x, float s) const override { ++calls; }
  void do_fill_(TensorView x, float value) const override { ++calls; }
  void do_cast(TensorView out, TensorView inp) const override { ++calls; }
  void do_fp8_quantize(TensorView out, TensorView inp, TensorView scale, TensorView amax) const override { ++calls; }
  void do_fp8_dequantize(TensorView out, TensorView inp, TensorView scale_inv) const override { ++calls; }
  void do_fp8_update_scaling(TensorView amax_history, TensorView scale, TensorView scale_inv, float fp8_max, int margin,
                             bool use_max) const override { ++calls; }
  void do_fp8_gemm(TensorView out, TensorView a, TensorView a_scale_inv, TensorView b, TensorView b_scale_inv,
                   TensorView bias, bool accumulate) const override { ++calls; }
  void do_transpose(TensorView out, TensorView inp) const override { ++calls; }
  void do_moe_permute_forward(TensorView out, TensorView inp, TensorView row_id_map) const override { ++calls; }
  void do_moe_permute_backward(TensorView dinp, TensorView dout, TensorView row_id_map) const override { ++calls; }
  void do_moe_unpermute_forward(TensorView out, TensorView inp, TensorView probs,
                                TensorView row_id_map) const override { ++calls; }
  void do_moe_unpermute_backward(TensorView dinp, TensorView dprobs, TensorView dout, TensorView inp, TensorView probs,
                                 TensorView row_id_map) const override { ++calls; }
  void do_grouped_matmul_forward(TensorView out, TensorView inp, TensorView weight,
                                 const std::vector<int64_t>& group_sizes) const override { ++calls; }
  void do_grouped_matmul_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                                  TensorView weight, const std::vector<int64_t>& group_sizes,
                                  GradWrite) const override {
    ++calls;
  }
};

// Expects f to throw an Error whose message names "[op]" and contains detail.
void expect_rejected(const std::function<void()>& f, const std::string& op, const std::string& detail) {
  try {
    f();
    ADD_FAILURE() << "no error for [" << op << "] " << detail;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[" + op + "]"), std::string::npos) << msg;
    EXPECT_NE(msg.find(detail), std::string::npos) << "expected \"" << detail << "\" in: " << msg;
  }
}

// A view of nothing on device dev: enough for the checks, which read metadata only (never data).
TensorView fake(Shape s, DType dt, Device dev) {
  static char byte;
  return TensorView(&byte, dt, s, dev);
}

TEST(OpChecks, BadArgumentsNeverReachTheBackend) {
  const Device gpu{DeviceType::kCUDA, 0};
  const CountingOps ops(gpu);
  auto t = [&](Shape s, DType dt = DType::kF32) { return fake(s, dt, gpu); };
  // Valid calls reach the backend once each.
  ops.matmul_forward(t({4, 3}), t({4, 2}), t({3, 2}), t({3}));
  ops.residual_forward(t({6}), t({6}), t({6}));
  EXPECT_EQ(ops.calls, 2);
  // Invalid ones stop at the entry point.
  expect_rejected([&] { ops.matmul_forward(t({4, 3}), t({4, 2}), t({3, 2}, DType::kBF16), {}); }, "matmul_forward",
                  "weight must be f32");
  expect_rejected([&] { ops.residual_forward(t({6}), t({6}), fake({6}, DType::kF32, cpu_device())); },
                  "residual_forward", "expected b on cuda:0, got f32(6)@cpu");
  expect_rejected([&] { ops.gelu_forward(t({6}), TensorView()); }, "gelu_forward", "inp is required");
  AttentionParams p{.num_heads = 2, .num_kv_heads = 2, .head_dim = 4, .softmax_scale = 0.5f};
  p.window = 0;
  expect_rejected([&] { ops.attention_forward(t({1, 3, 8}), t({1, 2, 3}), t({1, 3, 24}), p); }, "attention_forward",
                  "expected window -1 (unlimited) or > 0");
  EXPECT_EQ(ops.calls, 2);
}

// ---- the real backends ---------------------------------------------------------------------------------------

class BackendChecks : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (std::string(GetParam()) == "cpu") {
      ops_ = &cpu_ops_;
      return;
    }
#if defined(LOOM_HAVE_CUDA)
    if (!gpu_visible()) GTEST_SKIP() << "no CUDA GPU visible";
    ops_ = &cuda_ops();
#else
    GTEST_SKIP() << "this build has no CUDA backend";
#endif
  }
  const OpTable& ops() const { return *ops_; }
  Device dev() const { return ops_->device(); }
  // A zero-filled tensor on the backend's device.
  Tensor zeros(Shape s, DType dt = DType::kF32) const {
    Tensor t = Tensor::empty(s, dt, dev());
    ops().fill_(t, 0.0f);
    return t;
  }
  // A tensor on the other kind of device than the backend's (metadata only).
  TensorView elsewhere(Shape s, DType dt = DType::kF32) const {
    return fake(s, dt, dev().is_cpu() ? Device{DeviceType::kCUDA, 0} : cpu_device());
  }

 private:
  cpu::CpuOps cpu_ops_;
  const OpTable* ops_ = nullptr;
};

TEST_P(BackendChecks, MatmulDtypeShapeAndRank) {
  const DType bf = DType::kBF16, h = DType::kF16;
  expect_rejected([&] { ops().matmul_forward(zeros({4, 3}, bf), zeros({4, 8}, bf), zeros({3, 8}, h), {}); },
                  "matmul_forward", "weight must be bf16");
  expect_rejected([&] { ops().matmul_forward(zeros({4, 5}), zeros({4, 3}), zeros({5, 2}), {}); }, "matmul_forward",
                  "inp expected (4, 2)");
  expect_rejected([&] { ops().matmul_forward(zeros({4, 5}), zeros({4, 2}), zeros({10}), {}); }, "matmul_forward",
                  "weight must be (N, K)");
  expect_rejected([&] { ops().matmul_forward(TensorView(), zeros({4, 2}), zeros({5, 2}), {}); }, "matmul_forward",
                  "out expected (4, 5)");
  expect_rejected([&] { ops().matmul_forward(zeros({4, 5}), zeros({4, 2}), zeros({5, 2}), zeros({4})); },
                  "matmul_forward", "bias expected (5)");
}

TEST_P(BackendChecks, EverythingIsCheckedBeforeAnythingIsWritten) {
  // A bad dbias rejects the whole call: dinp, which comes first, keeps its bits.
  Tensor dinp = Tensor::empty({4, 2}, DType::kF32, dev());
  ops().fill_(dinp, 7.0f);
  expect_rejected(
      [&] { ops().matmul_backward(dinp, TensorView(), zeros({3}), zeros({4, 5}), zeros({4, 2}), zeros({5, 2})); },
      "matmul_backward", "dbias expected (5)");
  Tensor host = Tensor::empty({4, 2}, DType::kF32);
#if defined(LOOM_HAVE_CUDA)
  if (!dev().is_cpu()) host = to_host(dinp);
#endif
  if (dev().is_cpu()) std::memcpy(host.raw(), dinp.raw(), size_t(dinp.nbytes()));
  for (int64_t i = 0; i < host.numel(); ++i) ASSERT_EQ(host.data<float>()[i], 7.0f) << i;
}

TEST_P(BackendChecks, NormsAndElementwise) {
  const Tensor x = zeros({4, 8}), w = zeros({8}), mean = zeros({4});
  expect_rejected([&] { ops().layernorm_forward(zeros({4, 8}), mean, zeros({4}, DType::kBF16), x, w, {}, 1e-5f); },
                  "layernorm_forward", "expected f32 rstd");
  expect_rejected([&] { ops().layernorm_forward(zeros({4, 8}), mean, zeros({4}), x, zeros({7}), {}, 1e-5f); },
                  "layernorm_forward", "expected weight with 8 elements");
  expect_rejected([&] { ops().rmsnorm_backward(zeros({4, 8}), w, zeros({4, 8}), x, w, TensorView()); },
                  "rmsnorm_backward", "rstd saved by the forward is required");
  expect_rejected([&] { ops().residual_forward(zeros({6}), zeros({6}), zeros({5})); }, "residual_forward",
                  "expected b with 6 elements");
  expect_rejected([&] { ops().residual_forward(zeros({6}), zeros({6}), zeros({6}, DType::kF16)); },
                  "residual_forward", "all tensors must share one dtype");
  expect_rejected([&] { ops().residual_forward(zeros({6}), zeros({6}), elsewhere({6})); }, "residual_forward",
                  "expected b on " + dev().str());
  expect_rejected([&] { ops().gelu_forward(zeros({6}), TensorView()); }, "gelu_forward", "inp is required");
  expect_rejected([&] { ops().glu_forward(zeros({4, 3}), zeros({4, 5}), GluKind::kSwiGLU); }, "glu_forward",
                  "inp's last dim must be 2F");
  expect_rejected([&] { ops().dropout_forward(zeros({6}), zeros({6}), 1.0f, 1, 2); }, "dropout_forward",
                  "expected a dropout probability in [0, 1)");
  expect_rejected([&] { ops().cast(zeros({5}, DType::kBF16), zeros({6})); }, "cast", "expected out with 6 elements");
  expect_rejected([&] { ops().scale_(zeros({6}, DType::kI32), 2.0f); }, "scale_", "expected a float dtype");
}

TEST_P(BackendChecks, EmbeddingAndCrossEntropy) {
  expect_rejected([&] { ops().embedding_forward(zeros({2, 5, 8}), zeros({2, 5}), zeros({10, 8}), {}); },
                  "embedding_forward", "expected i32 tokens");
  expect_rejected(
      [&] { ops().embedding_forward(zeros({2, 5, 8}), zeros({2, 5}, DType::kI32), zeros({10, 8}), zeros({4, 8})); },
      "embedding_forward", "sequence length 5 exceeds the 4 positions of wpe");
  expect_rejected(
      [&] { ops().cross_entropy_forward_backward(zeros({4}), zeros({4, 8}, DType::kI32), zeros({4}, DType::kI32), 8, {},
                                                 1.0f); },
      "cross_entropy_forward_backward", "expected f32, bf16 or f16 logits");
  expect_rejected(
      [&] { ops().cross_entropy_forward_backward(zeros({4}), zeros({4, 8}), zeros({4}, DType::kI32), 9, {}, 1.0f); },
      "cross_entropy_forward_backward", "vocab_size 9 must be in [1, 8]");
}

TEST_P(BackendChecks, AttentionAndRope) {
  AttentionParams p{.num_heads = 2, .num_kv_heads = 2, .head_dim = 4, .softmax_scale = 0.5f};
  const Tensor qkv = zeros({1, 3, 24}), out = zeros({1, 3, 8}), lse = zeros({1, 2, 3});
  expect_rejected([&] { ops().attention_forward(out, lse, zeros({3, 24}), p); }, "attention_forward",
                  "expected qkv f32, bf16 or f16");
  expect_rejected([&] { ops().attention_forward(out, zeros({1, 3, 2}), qkv, p); }, "attention_forward",
                  "expected lse f32(1, 2, 3)");
  expect_rejected([&] { ops().attention_backward(zeros({1, 3, 24}, DType::kBF16), out, qkv, out, lse, p); },
                  "attention_backward", "expected dqkv f32(1, 3, 24)");
  AttentionParams bad = p;
  bad.num_kv_heads = 3;
  expect_rejected([&] { ops().attention_forward(out, lse, qkv, bad); }, "attention_forward",
                  "expected num_heads to be a positive multiple of num_kv_heads");
  const Tensor pos = zeros({3}, DType::kI32);
  expect_rejected(
      [&] { ops().attention_block_forward(out, lse, qkv, zeros({1, 3, 12}), AttentionBlock{pos, pos, {}, {}, 3}, p); },
      "attention_block_forward", "expected kv f32(1, Tk, 24 or 16)");
  const Tensor tables = zeros({8, 1});
  expect_rejected([&] { ops().rope_forward(zeros({1, 3, 24}), tables, tables, p, RopeParams{3, false}); },
                  "rope_forward", "expected an even rotary_dim in [2, head_dim = 4]");
}

TEST_P(BackendChecks, OptimizerAndFp8) {
  AdamWParams a;
  a.lr = 1e-3f;
  const Tensor p = zeros({8}), m = zeros({8}), v = zeros({8});
  expect_rejected([&] { ops().adamw_update(p, zeros({8}, DType::kBF16), m, v, a); }, "adamw_update",
                  "f32 master weights, gradients and state only), got bf16");
  expect_rejected([&] { ops().adamw_update(p, zeros({8}), m, v, a, zeros({8})); }, "adamw_update",
                  "expected a bf16 or f16 compute copy with 8 elements, got f32");
  expect_rejected([&] { ops().adamw_update(p, zeros({8}), m, v, a, zeros({7}, DType::kBF16)); }, "adamw_update",
                  "expected a bf16 or f16 compute copy with 8 elements, got bf16(7)");
  a.step = 0;
  expect_rejected([&] { ops().adamw_update(p, zeros({8}), m, v, a); }, "adamw_update", "step is 1-based");
  SgdParams sg;
  sg.momentum = 0.9f;
  expect_rejected([&] { ops().sgd_update(p, zeros({8}), zeros({7}), sg); }, "sgd_update",
                  "momentum_buf");
  expect_rejected([&] { ops().sgd_update(p, zeros({8}, DType::kF16), m, sg); }, "sgd_update",
                  "f32 master weights, gradients and momentum only), got f16");
  expect_rejected([&] { ops().sgd_update(p, zeros({8}), m, sg, zeros({8}, DType::kI32)); }, "sgd_update",
                  "expected a bf16 or f16 compute copy with 8 elements");
  expect_rejected([&] { (void)ops().count_zeros(zeros({8}, DType::kI32)); }, "count_zeros", "expected a float dtype");
  const Tensor s = zeros({1}), a4 = zeros({4, 16}, DType::kF8E4M3), b4 = zeros({8, 16}, DType::kF8E4M3);
  expect_rejected(
      [&] { ops().fp8_gemm(zeros({4, 8}), zeros({4, 16}, DType::kF8E5M2), s, zeros({8, 16}, DType::kF8E5M2), s, {},
                           false); },
      "fp8_gemm", "E5M2 x E5M2");
  // The bias is f32, bf16 or f16 (ops.h); the CPU used to accept an fp8 one too.
  expect_rejected([&] { ops().fp8_gemm(zeros({4, 8}, DType::kF16), a4, s, b4, s, zeros({8}, DType::kF8E4M3), false); },
                  "fp8_gemm", "expected bias f32, bf16 or f16");
  expect_rejected([&] { ops().fp8_quantize(zeros({4}, DType::kF8E4M3), zeros({4}), zeros({2}), s); }, "fp8_quantize",
                  "expected scale as a (1) f32 tensor on " + dev().str());
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendChecks, ::testing::Values("cpu", "cuda"),
                         [](const ::testing::TestParamInfo<const char*>& info) { return std::string(info.param); });

}  // namespace
}  // namespace loom::test
