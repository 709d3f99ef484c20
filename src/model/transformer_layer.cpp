// One transformer layer's forward and backward (see transformer_layer.h). Invariant: a recomputed forward
// runs the very same ops on the very same inputs with the same dropout masks, so it reproduces every bit.
#include "model/transformer_layer.h"

namespace loom {

void TransformerLayer::mlp_activation(const DeviceContext& ctx, TensorView act, TensorView fc) const {
  const int64_t F = ffn_local_, N = act.numel() / F;
  switch (activation_) {
    case MlpActivation::kGeLU: ctx.ops().gelu_forward(act, fc); return;
    case MlpActivation::kSwiGLU: ctx.ops().glu_forward(act.reshape({N, F}), fc.reshape({N, 2 * F}), GluKind::kSwiGLU); return;
    case MlpActivation::kGeGLU: ctx.ops().glu_forward(act.reshape({N, F}), fc.reshape({N, 2 * F}), GluKind::kGeGLU); return;
    case MlpActivation::kReGLU: ctx.ops().glu_forward(act.reshape({N, F}), fc.reshape({N, 2 * F}), GluKind::kReGLU); return;
  }
}

void TransformerLayer::forward(const TransformerLayerContext& c, TensorView out, TransformerLayerSaved& s,
                               TensorView x) const {
  const DeviceContext& ctx = c.ctx;
  ln1.forward(ctx, s.ln1, s.ln1_saved, x);
  qkv.forward(ctx, s.qkv, s.ln1, c.sp_gathered, lora_mask(c, qkv_lora_site));
  if (qk_norm) qk_norm->forward(ctx, s.qkv, s.qk_saved, c.qk_a);
  if (c.rope) c.rope->forward(ctx, s.qkv, attn.params(), c.positions);  // in place: attention reads rotated q, k
  c.attend(*this, s, /*recompute=*/false);
  // Bias-dropout-add: the bias is part of the linear output, dropout follows, then the residual add.
  const TensorView attn_out = proj.forward(ctx, c.branch, s.att, epilogue(c, proj_dropout_site), c.dln,
                                              lora_mask(c, proj_lora_site));
  ln2.forward_residual(ctx, s.residual2, s.ln2, s.ln2_saved, x, attn_out);
  if (moe) {
    // The experts' (and shared experts') output on this rank's rows, then bias-dropout-add.
    const int64_t C = s.ln2.shape().cols(), Nl = s.ln2.numel() / C;
    const TensorView y = c.branch.slice_flat(0, Shape{Nl, C});
    if (!s.moe) s.moe = std::make_shared<MoeLayerSaved>();
    moe->forward(ctx, c.moe, y, *s.moe, s.ln2);
    const RowEpilogue e = epilogue(c, mlp_dropout_site);
    if (e.active) e.forward(out, y.reshape(out.shape()));
    ctx.ops().residual_forward(out, e.active ? out : y.reshape(out.shape()), s.residual2);
    return;
  }
  fc1->forward(ctx, s.fc, s.ln2, c.sp_gathered, lora_mask(c, fc1_lora_site));
  mlp_activation(ctx, c.act, s.fc);
  // Under SP fc2's full rows go to the branch scratch and reduce-scatter into `out`; else straight there.
  fc2->forward(ctx, fc2->sequence_parallel() ? c.branch : out, c.act, epilogue(c, mlp_dropout_site), out,
              lora_mask(c, fc2_lora_site));
  ctx.ops().residual_forward(out, out, s.residual2);
}

void TransformerLayer::backward(const TransformerLayerContext& c, TransformerLayerSaved& s, TensorView x) const {
  const DeviceContext& ctx = c.ctx;
  // MLP branch: dres is d(out) = d(residual2) through the skip connection.
  if (moe) {
    const int64_t C = s.ln2.shape().cols(), Nl = s.ln2.numel() / C;
    const RowEpilogue e = epilogue(c, mlp_dropout_site);
    TensorView dy = c.dres;
    if (e.active) {
      dy = c.branch.slice_flat(0, c.dres.shape());
      e.backward(dy, c.dres);
    }
    moe->backward(ctx, c.moe, c.dln.slice_flat(0, Shape{Nl, C}), dy, s.ln2, *s.moe);
  } else {
    mlp_backward(c, s);
  }
  ln2.backward(ctx, c.dres, c.dln, s.residual2, s.ln2_saved);
  attention_backward(c, s, x);
}

// The dense MLP's backward: c.dln = d(ln2 output) from c.dres = d(out).
void TransformerLayer::mlp_backward(const TransformerLayerContext& c, TransformerLayerSaved& s) const {
  const DeviceContext& ctx = c.ctx;
  const OpTable& ops = ctx.ops();
  // The activation is recomputed instead of saving B·T·F per layer: fc2's weight gradient reads it. Where
  // fc2's backward can be split (splits_backward), the activation's backward writes it from the same pass
  // that takes dfc = d(act) from fc2's input gradient (one exponential per element instead of two); else it
  // is recomputed first.
  const bool fused = fc2->splits_backward();
  // dfc1 = d(fc1 output): in place over dfc (GeLU), or over fc1's output (gated: d[gate | up] is twice as
  // wide as dfc; the op allows dinp to alias inp, and nothing reads fc1's output after this point).
  TensorView dfc1 = c.dfc;
  auto activation_backward = [&](TensorView act_out) {
    if (activation_ == MlpActivation::kGeLU) {
      ops.gelu_backward(c.dfc, s.fc, c.dfc, act_out);
      return;
    }
    const int64_t F = ffn_local_, N = c.dfc.numel() / F;
    const GluKind kind = activation_ == MlpActivation::kGeGLU   ? GluKind::kGeGLU
                         : activation_ == MlpActivation::kReGLU ? GluKind::kReGLU
                                                                : GluKind::kSwiGLU;
    ops.glu_backward(s.fc.reshape({N, 2 * F}), s.fc.reshape({N, 2 * F}), c.dfc.reshape({N, F}), kind,
                     act_out.defined() ? act_out.reshape({N, F}) : TensorView());
    dfc1 = s.fc;
  };
  if (fused) {
    fc2->backward(ctx, c.dfc, c.dres, c.act, epilogue(c, mlp_dropout_site), c.branch, lora_mask(c, fc2_lora_site),
                  [&] { activation_backward(c.act); });
  } else {
    mlp_activation(ctx, c.act, s.fc);
    fc2->backward(ctx, c.dfc, c.dres, c.act, epilogue(c, mlp_dropout_site), c.branch, lora_mask(c, fc2_lora_site));
    activation_backward(TensorView());
  }
  fc1->backward(ctx, c.dln, dfc1, s.ln2, c.sp_gathered, c.sp_grad, lora_mask(c, fc1_lora_site));
}

void TransformerLayer::attention_backward(const TransformerLayerContext& c, TransformerLayerSaved& s,
                                          TensorView x) const {
  const DeviceContext& ctx = c.ctx;
  // Attention branch: dres is now d(residual2) = d(x) through the skip connection.
  if (c.recompute_attention) c.attend(*this, s, /*recompute=*/true);
  proj.backward(ctx, c.datt, c.dres, s.att, epilogue(c, proj_dropout_site), c.branch, lora_mask(c, proj_lora_site));
  c.attend_backward(*this, s);
  if (c.rope) c.rope->backward(ctx, c.dqkv, attn.params(), c.positions);
  if (qk_norm) qk_norm->backward(ctx, c.dqkv, s.qk_saved, c.qk_a, c.qk_b);
  qkv.backward(ctx, c.dln, c.dqkv, s.ln1, c.sp_gathered, c.sp_grad, lora_mask(c, qkv_lora_site));
  ln1.backward(ctx, c.dres, c.dln, x, s.ln1_saved);
}

}  // namespace loom
