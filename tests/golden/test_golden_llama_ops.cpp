// The Llama-family CPU ops (RMSNorm, SwiGLU/GeGLU/ReGLU, RoPE) against PyTorch (float64) references from
// tests/golden/gen_llama_ops.py (fixtures/ops_llama.safetensors), on odd shapes (1, 5, 217 rows; MHA, GQA, MQA;
// partial and interleaved rotary; position ids with resets).
//
// The op-table contract is checked as in test_golden_ops.cpp: outputs that OVERWRITE start as NaN, outputs
// that ACCUMULATE (rmsnorm's dinp and dweight) start from a non-zero pattern and must end at init + reference;
// RoPE works in place; the fused residual + RMSNorm must give the f32 sum a + b bit for bit.
// Error measure: max_i |got_i - ref_i| / max_i |ref_i|; tolerance 1e-5 for every f32 op here (the value used
// for layernorm and gelu in test_golden_ops.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>

#include "golden_util.h"

namespace loom {
namespace {

constexpr double kTol = 1e-5;

using namespace golden;

TEST(GoldenLlamaOps, RmsnormForwardBackwardAndFusedResidual) {
  Fixture fx("llama");
  ASSERT_EQ(fx.cases("op_rmsnorm").size(), 4u);
  for (const std::string& c : fx.cases("op_rmsnorm")) {
    SCOPED_TRACE(c);
    Tensor a = fx.get(c, "a"), b = fx.get(c, "b"), w = fx.get(c, "weight");
    const float eps = fx.get(c, "eps").data<float>()[0];
    Tensor inp = Tensor::empty(a.shape(), DType::kF32);
    for (int64_t i = 0; i < inp.numel(); ++i) inp.data<float>()[i] = a.data<float>()[i] + b.data<float>()[i];
    const Shape rows{inp.shape().rows()};
    Tensor out = nan_tensor(inp.shape()), rstd = nan_tensor(rows);
    ops().rmsnorm_forward(out, rstd, inp, w, eps);
    expect_close("rmsnorm." + c + ".out", out, fx.get(c, "out"), kTol);
    expect_close("rmsnorm." + c + ".rstd", rstd, fx.get(c, "rstd"), kTol);

    if (fx.param(c, "backward")) {  // C == 1 is forward-only (see gen_llama_ops.py)
      Tensor ref_dinp = fx.get(c, "dinp"), ref_dw = fx.get(c, "dweight");
      Tensor dinp = accum_init(ref_dinp, 1), dw = accum_init(ref_dw, 2), dinp0 = copy_of(dinp), dw0 = copy_of(dw);
      ops().rmsnorm_backward(dinp, dw, fx.get(c, "dout"), inp, w, fx.get(c, "rstd"));
      expect_close("rmsnorm." + c + ".dinp (residual, accumulate)", dinp, ref_dinp, kTol, dinp0);
      expect_close("rmsnorm." + c + ".dweight (accumulate)", dw, ref_dw, kTol, dw0);
    }

    Tensor res = nan_tensor(inp.shape()), out2 = nan_tensor(inp.shape()), rstd2 = nan_tensor(rows);
    ops().residual_rmsnorm_forward(res, out2, rstd2, a, b, w, eps);
    EXPECT_EQ(std::memcmp(res.raw(), inp.raw(), size_t(inp.nbytes())), 0) << "residual != a + b";
    expect_close("residual_rmsnorm." + c + ".out", out2, fx.get(c, "out"), kTol);
    expect_close("residual_rmsnorm." + c + ".rstd", rstd2, fx.get(c, "rstd"), kTol);
  }
}

TEST(GoldenLlamaOps, GluForwardBackwardAllKinds) {
  Fixture fx("llama");
  const GluKind kinds[] = {GluKind::kSwiGLU, GluKind::kGeGLU, GluKind::kReGLU};
  const char* names[] = {"swiglu", "geglu", "reglu"};
  ASSERT_EQ(fx.cases("op_glu").size(), 9u);
  for (const std::string& c : fx.cases("op_glu")) {
    SCOPED_TRACE(c);
    const int64_t k = fx.param(c, "kind");
    ASSERT_TRUE(k >= 0 && k < 3);
    ASSERT_EQ(c.rfind(names[k], 0), 0u) << "case name and kind disagree";
    Tensor inp = fx.get(c, "inp"), dout = fx.get(c, "dout");
    Tensor out = nan_tensor(dout.shape());
    ops().glu_forward(out, inp, kinds[k]);
    expect_close("glu." + c + ".out", out, fx.get(c, "out"), kTol);
    Tensor dinp = nan_tensor(inp.shape());
    ops().glu_backward(dinp, inp, dout, kinds[k]);
    expect_close("glu." + c + ".dinp (overwrite)", dinp, fx.get(c, "dinp"), kTol);
  }
}

TEST(GoldenLlamaOps, RopeForwardAndBackwardMatchHuggingFaceFormula) {
  Fixture fx("llama");
  ASSERT_EQ(fx.cases("op_rope").size(), 6u);
  for (const std::string& c : fx.cases("op_rope")) {
    SCOPED_TRACE(c);
    AttentionParams p;
    p.num_heads = fx.param(c, "NH");
    p.num_kv_heads = fx.param(c, "NKV");
    p.head_dim = fx.param(c, "HS");
    RopeParams r;
    r.rotary_dim = fx.param(c, "rotary_dim");
    r.interleaved = fx.param(c, "interleaved") != 0;
    Tensor cos = fx.get(c, "cos"), sin = fx.get(c, "sin");
    ASSERT_EQ(cos.shape(), Shape({fx.param(c, "max_pos"), r.rotary_dim / 2}));
    Tensor ids = fx.param(c, "has_ids") ? fx.get(c, "position_ids") : Tensor();
    Tensor qkv = fx.get(c, "qkv");
    ops().rope_forward(qkv, cos, sin, p, r, ids);
    expect_close("rope." + c + ".out (in place)", qkv, fx.get(c, "out"), kTol);
    Tensor d = fx.get(c, "dout");
    ops().rope_backward(d, cos, sin, p, r, ids);
    expect_close("rope." + c + ".dqkv (in place)", d, fx.get(c, "dqkv"), kTol);
  }
}

}  // namespace
}  // namespace loom
