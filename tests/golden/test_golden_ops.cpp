// The CPU op table against PyTorch (float64) references from tests/golden/gen_ops.py, on odd shapes
// (1, 5, 217 rows; head sizes 4, 5, 8; T spanning several 64-row attention blocks).
//
// Besides values, each test checks the op-table contract (include/loom/backend/ops.h):
//   - outputs that OVERWRITE are pre-filled with NaN, so a missed or accumulated write fails;
//   - outputs that ACCUMULATE (parameter grads, layernorm's dinp) start from a non-zero pattern `init`
//     and must end at init + reference; matmul is run twice and must reach init + 2 * reference;
//   - cross-entropy writes dlogits in place, exactly 0 in padded columns and masked rows, and leaves
//     the logits untouched when dlogits_scale == 0;
//   - gelu_backward works with dinp aliasing dout; adamw_update zeroes the gradient when asked.
//
// Error measure: max_i |got_i - ref_i| / max_i |ref_i|. Tolerances (f32 ops vs f64 references):
//   matmul, layernorm, gelu, attention, cross-entropy: 1e-5;  AdamW m and v: 1e-5, parameters 1e-6
//   (so the update itself, ~1e-2 of a parameter, is checked to ~1e-4);  embedding and bias grads: 1e-6
//   (sums of a few terms);  residual and bias add: 0 (one correctly rounded f32 add);
//   sum_squares (f64 accumulation): 1e-10.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>

#include "golden_util.h"

namespace loom {
namespace {

using namespace golden;

// ---- matmul -----------------------------------------------------------------------------------------

TEST(GoldenOps, MatmulForwardBackward) {
  Fixture fx("matmul");
  ASSERT_EQ(fx.cases().size(), 4u);
  for (const std::string& c : fx.cases()) {
    SCOPED_TRACE(c);
    Tensor inp = fx.get(c, "inp"), w = fx.get(c, "weight"), dout = fx.get(c, "dout");
    const bool bias = fx.has(c, "bias");
    Tensor b = bias ? fx.get(c, "bias") : Tensor();
    Tensor out = nan_tensor(fx.get(c, "out").shape());
    ops().matmul_forward(out, inp, w, b);
    expect_close("matmul." + c + ".out", out, fx.get(c, "out"), 1e-5);

    Tensor ref_dw = fx.get(c, "dweight"), ref_db = bias ? fx.get(c, "dbias") : Tensor();
    Tensor dinp = nan_tensor(inp.shape()), dw = accum_init(ref_dw, 1);
    Tensor dw0 = copy_of(dw), db = bias ? accum_init(ref_db, 2) : Tensor(), db0 = bias ? copy_of(db) : Tensor();
    ops().matmul_backward(dinp, dw, db, dout, inp, w);
    expect_close("matmul." + c + ".dinp (overwrite)", dinp, fx.get(c, "dinp"), 1e-5);
    expect_close("matmul." + c + ".dweight (accumulate)", dw, ref_dw, 1e-5, dw0);
    if (bias) expect_close("matmul." + c + ".dbias (accumulate)", db, ref_db, 1e-5, db0);
    // A second micro-batch without dinp: parameter grads keep adding up.
    ops().matmul_backward(TensorView(), dw, db, dout, inp, w);
    expect_close("matmul." + c + ".dweight (2 micro-batches)", dw, ref_dw, 1e-5, dw0, 2.0);
    if (bias) expect_close("matmul." + c + ".dbias (2 micro-batches)", db, ref_db, 1e-5, db0, 2.0);
  }
}

// ---- embedding ----------------------------------------------------------------------------------

TEST(GoldenOps, EmbeddingForwardBackward) {
  Fixture fx("embedding");
  ASSERT_EQ(fx.cases().size(), 4u);
  for (const std::string& c : fx.cases()) {
    SCOPED_TRACE(c);
    const bool pos = fx.param(c, "maxpos") > 0;
    Tensor tok = fx.get(c, "tokens"), wte = fx.get(c, "wte"), wpe = pos ? fx.get(c, "wpe") : Tensor();
    Tensor out = nan_tensor(fx.get(c, "out").shape());
    ops().embedding_forward(out, tok, wte, wpe);
    expect_close("embedding." + c + ".out", out, fx.get(c, "out"), 1e-6);

    Tensor ref_dwte = fx.get(c, "dwte"), ref_dwpe = pos ? fx.get(c, "dwpe") : Tensor();
    Tensor dwte = accum_init(ref_dwte, 3), dwte0 = copy_of(dwte);
    Tensor dwpe = pos ? accum_init(ref_dwpe, 4) : Tensor(), dwpe0 = pos ? copy_of(dwpe) : Tensor();
    ops().embedding_backward(dwte, dwpe, fx.get(c, "dout"), tok);
    expect_close("embedding." + c + ".dwte (accumulate)", dwte, ref_dwte, 1e-6, dwte0);
    if (pos) expect_close("embedding." + c + ".dwpe (accumulate)", dwpe, ref_dwpe, 1e-6, dwpe0);
  }
}

// ---- layernorm ------------------------------------------------------------------------------------

TEST(GoldenOps, LayernormForwardBackward) {
  Fixture fx("layernorm");
  ASSERT_EQ(fx.cases().size(), 4u);
  const float eps = 1e-5f;
  for (const std::string& c : fx.cases()) {
    SCOPED_TRACE(c);
    Tensor a = fx.get(c, "a"), b = fx.get(c, "b"), w = fx.get(c, "weight"), bias = fx.get(c, "bias");
    Tensor inp = Tensor::empty(a.shape(), DType::kF32);
    for (int64_t i = 0; i < inp.numel(); ++i) inp.data<float>()[i] = a.data<float>()[i] + b.data<float>()[i];
    const Shape rows{inp.shape().rows()};
    Tensor out = nan_tensor(inp.shape()), mean = nan_tensor(rows), rstd = nan_tensor(rows);
    ops().layernorm_forward(out, mean, rstd, inp, w, bias, eps);
    expect_close("layernorm." + c + ".out", out, fx.get(c, "out"), 1e-5);
    expect_close("layernorm." + c + ".mean", mean, fx.get(c, "mean"), 1e-5);
    expect_close("layernorm." + c + ".rstd", rstd, fx.get(c, "rstd"), 1e-5);

    if (fx.param(c, "backward")) {  // C == 1 is forward-only (see gen_ops.py)
      Tensor ref_dinp = fx.get(c, "dinp"), ref_dw = fx.get(c, "dweight"), ref_db = fx.get(c, "dbias");
      Tensor dinp = accum_init(ref_dinp, 5), dw = accum_init(ref_dw, 6), db = accum_init(ref_db, 7);
      Tensor dinp0 = copy_of(dinp), dw0 = copy_of(dw), db0 = copy_of(db);
      ops().layernorm_backward(dinp, dw, db, fx.get(c, "dout"), inp, w, fx.get(c, "mean"), fx.get(c, "rstd"));
      expect_close("layernorm." + c + ".dinp (residual, accumulate)", dinp, ref_dinp, 1e-5, dinp0);
      expect_close("layernorm." + c + ".dweight (accumulate)", dw, ref_dw, 1e-5, dw0);
      expect_close("layernorm." + c + ".dbias (accumulate)", db, ref_db, 1e-5, db0);
    }

    // Fused residual + layernorm: the residual is the same f32 sum, bit for bit.
    Tensor res = nan_tensor(inp.shape()), out2 = nan_tensor(inp.shape());
    Tensor mean2 = nan_tensor(rows), rstd2 = nan_tensor(rows);
    ops().residual_layernorm_forward(res, out2, mean2, rstd2, a, b, w, bias, eps);
    EXPECT_EQ(std::memcmp(res.raw(), inp.raw(), size_t(inp.nbytes())), 0) << "residual != a + b";
    expect_close("residual_layernorm." + c + ".out", out2, fx.get(c, "out"), 1e-5);
    expect_close("residual_layernorm." + c + ".rstd", rstd2, fx.get(c, "rstd"), 1e-5);
  }
}

// ---- elementwise --------------------------------------------------------------------------------

TEST(GoldenOps, GeluForwardBackward) {
  Fixture fx("elementwise");
  ASSERT_EQ(fx.cases("op_gelu").size(), 3u);
  for (const std::string& c : fx.cases("op_gelu")) {
    SCOPED_TRACE(c);
    Tensor inp = fx.get(c, "inp"), dout = fx.get(c, "dout");
    Tensor out = nan_tensor(inp.shape());
    ops().gelu_forward(out, inp);
    expect_close("gelu." + c + ".out", out, fx.get(c, "out"), 1e-5);
    Tensor dinp = nan_tensor(inp.shape());
    ops().gelu_backward(dinp, inp, dout);
    expect_close("gelu." + c + ".dinp", dinp, fx.get(c, "dinp"), 1e-5);
    Tensor alias = copy_of(dout);
    ops().gelu_backward(alias, inp, alias);
    expect_close("gelu." + c + ".dinp (aliasing dout)", alias, fx.get(c, "dinp"), 1e-5);
  }
}

TEST(GoldenOps, ResidualAndBias) {
  Fixture fx("elementwise");
  ASSERT_EQ(fx.cases("op_residual").size(), 3u);
  for (const std::string& c : fx.cases("op_residual")) {
    Tensor a = fx.get(c, "a"), out = nan_tensor(a.shape());
    ops().residual_forward(out, a, fx.get(c, "b"));
    expect_close("residual." + c + ".out", out, fx.get(c, "out"), 0.0);
  }
  ASSERT_EQ(fx.cases("op_bias").size(), 3u);
  for (const std::string& c : fx.cases("op_bias")) {
    Tensor x = fx.get(c, "x");
    ops().bias_add_forward(x, fx.get(c, "bias"));
    expect_close("bias_add." + c + ".out", x, fx.get(c, "out"), 0.0);
    Tensor ref = fx.get(c, "dbias"), db = accum_init(ref, 8), db0 = copy_of(db);
    ops().bias_backward(db, fx.get(c, "dout"));
    expect_close("bias_backward." + c + ".dbias (accumulate)", db, ref, 1e-6, db0);
  }
}

TEST(GoldenOps, SumSquares) {
  Fixture fx("elementwise");
  ASSERT_EQ(fx.cases("op_sumsq").size(), 3u);
  for (const std::string& c : fx.cases("op_sumsq")) {
    Tensor hl = fx.get(c, "sumsq_hi_lo");
    const double want = double(hl.data<float>()[0]) + double(hl.data<float>()[1]);
    const double got = ops().sum_squares(fx.get(c, "x"));
    std::printf("  [golden] sum_squares.%-32s rel err %.2e (tol 1e-10)\n", c.c_str(), std::fabs(got - want) / want);
    EXPECT_NEAR(got, want, 1e-10 * want) << c;
  }
}

// ---- attention ------------------------------------------------------------------------------------

TEST(GoldenOps, AttentionForwardBackward) {
  Fixture fx("attention");
  ASSERT_EQ(fx.cases().size(), 7u);
  for (const std::string& c : fx.cases()) {
    SCOPED_TRACE(c);
    AttentionParams p;
    const int64_t B = fx.param(c, "B"), T = fx.param(c, "T");
    p.num_heads = fx.param(c, "NH");
    p.num_kv_heads = fx.param(c, "NKV");
    p.head_dim = fx.param(c, "HS");
    p.softmax_scale = 1.0f / std::sqrt(float(p.head_dim));
    p.causal = true;
    p.window = fx.param(c, "window");
    Tensor qkv = fx.get(c, "qkv"), ref_out = fx.get(c, "out"), ref_lse = fx.get(c, "lse");
    ASSERT_EQ(qkv.shape(), Shape({B, T, (p.num_heads + 2 * p.num_kv_heads) * p.head_dim}));
    Tensor out = nan_tensor({B, T, p.num_heads * p.head_dim}), lse = nan_tensor({B, p.num_heads, T});
    ops().attention_forward(out, lse, qkv, p);
    expect_close("attention." + c + ".out", out, ref_out, 1e-5);
    expect_close("attention." + c + ".lse", lse, ref_lse, 1e-5);
    // Backward from the reference forward state, so it is judged on its own.
    Tensor dqkv = nan_tensor(qkv.shape());
    ops().attention_backward(dqkv, fx.get(c, "dout"), qkv, ref_out, ref_lse, p);
    expect_close("attention." + c + ".dqkv (overwrite)", dqkv, fx.get(c, "dqkv"), 1e-5);
  }
}

// ---- cross-entropy --------------------------------------------------------------------------------

TEST(GoldenOps, CrossEntropyPaddedVocabAndMask) {
  Fixture fx("cross_entropy");
  ASSERT_EQ(fx.cases().size(), 4u);
  for (const std::string& c : fx.cases()) {
    SCOPED_TRACE(c);
    const int64_t N = fx.param(c, "N"), Vp = fx.param(c, "Vp"), V = fx.param(c, "V");
    Tensor logits = fx.get(c, "logits"), original = copy_of(logits);
    Tensor mask = fx.param(c, "has_mask") ? fx.get(c, "mask") : Tensor();
    const float scale = fx.get(c, "scale").data<float>()[0];
    Tensor losses = nan_tensor({N});
    ops().cross_entropy_forward_backward(losses, logits, fx.get(c, "targets"), V, mask, scale);
    expect_close("cross_entropy." + c + ".losses", losses, fx.get(c, "losses"), 1e-5);
    if (scale == 0.0f) {
      EXPECT_EQ(std::memcmp(logits.raw(), original.raw(), size_t(logits.nbytes())), 0)
          << "dlogits_scale == 0 must leave the logits untouched";
      continue;
    }
    expect_close("cross_entropy." + c + ".dlogits (in place)", logits, fx.get(c, "dlogits"), 1e-5);
    int64_t nonzero_pad = 0, nonzero_masked = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < Vp; ++j) {
        const float d = logits.data<float>()[n * Vp + j];
        nonzero_pad += j >= V && d != 0.0f;
        nonzero_masked += mask && mask.data<float>()[n] == 0.0f && d != 0.0f;
      }
    EXPECT_EQ(nonzero_pad, 0) << "padded columns must get exactly 0 gradient";
    EXPECT_EQ(nonzero_masked, 0) << "masked rows must get exactly 0 gradient";
  }
}

// ---- AdamW --------------------------------------------------------------------------------------

TEST(GoldenOps, AdamWSeveralStepsVsTorch) {
  Fixture fx("adamw");
  ASSERT_EQ(fx.cases().size(), 3u);
  for (const std::string& c : fx.cases()) {
    SCOPED_TRACE(c);
    const int64_t N = fx.param(c, "N"), steps = fx.param(c, "steps");
    const bool zero_grad = fx.param(c, "zero_grad") != 0;
    Tensor param = fx.get(c, "param0"), grads = fx.get(c, "grads"), lrs = fx.get(c, "lrs");
    Tensor hyper = fx.get(c, "hyper"), ref_params = fx.get(c, "params");
    Tensor m = filled({N}, 0.0f), v = filled({N}, 0.0f);
    for (int64_t k = 0; k < steps; ++k) {
      AdamWParams p;
      p.lr = lrs.data<float>()[k];
      p.beta1 = hyper.data<float>()[0];
      p.beta2 = hyper.data<float>()[1];
      p.eps = hyper.data<float>()[2];
      p.weight_decay = hyper.data<float>()[3];
      p.grad_scale = hyper.data<float>()[4];
      p.step = k + 1;
      p.zero_grad = zero_grad;
      Tensor g = copy_of(grads.slice_flat(k * N, {N})), g0 = copy_of(g);
      ops().adamw_update(param, g, m, v, p);
      expect_close("adamw." + c + ".param after step " + std::to_string(k + 1), param,
                   ref_params.slice_flat(k * N, {N}), 1e-6);
      if (zero_grad) expect_close("adamw." + c + ".grad zeroed", g, filled({N}, 0.0f), 0.0);
      else EXPECT_EQ(std::memcmp(g.raw(), g0.raw(), size_t(g.nbytes())), 0) << "grad modified";
    }
    expect_close("adamw." + c + ".m", m, fx.get(c, "m"), 1e-5);
    expect_close("adamw." + c + ".v", v, fx.get(c, "v"), 1e-5);
  }
}

}  // namespace
}  // namespace loom
