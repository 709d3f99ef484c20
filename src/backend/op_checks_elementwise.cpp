// The op table's entry points for the elementwise ops, gated activations, dropout, cross-entropy, the
// optimizer and buffer utilities, casts and FP8: argument checks (the union of the CPU reference's and the
// CUDA launchers' former checks), then the backend's do_<op>. See op_checks.cpp for the rest.
#include <cmath>
#include <initializer_list>
#include <utility>

#include "backend/op_checks.h"

namespace loom {

using namespace op_checks;

namespace {

// ---- elementwise ------------------------------------------------------------------------------------------

// The compute dtype of an elementwise op: every tensor (all given, on dev) has it, and n elements, n that of
// the first.
DType common_dtype(Device dev, const char* op, std::initializer_list<std::pair<const char*, TensorView>> ts) {
  for (const auto& [name, t] : ts) require(dev, t, op, name);
  const auto& [first_name, first] = *ts.begin();
  const DType dt = first.dtype();
  LOOM_CHECK(is_compute_dtype(dt), "[", op, "] expected f32, bf16 or f16 tensors, got ", first_name, " ",
             first.desc());
  for (const auto& [name, t] : ts)
    LOOM_CHECK(t.dtype() == dt, "[", op, "] all tensors must share one dtype (f32, bf16 or f16): ", first_name,
               " is ", dtype_name(dt), " but ", name, " is ", t.desc());
  for (const auto& [name, t] : ts) expect_numel(t, first.numel(), op, name);
  return dt;
}

// An extra output written alongside the others (gelu_backward's / glu_backward's recomputed activation): it
// must not share a byte with any of them.
void check_disjoint(const char* op, const char* name, TensorView t,
                    std::initializer_list<std::pair<const char*, TensorView>> others) {
  for (const auto& [other_name, o] : others)
    LOOM_CHECK(!overlaps(t, o), "[", op, "] ", name, " ", t.desc(), " overlaps ", other_name, " ", o.desc(),
               ": it must be a separate buffer");
}

// ---- gated MLP --------------------------------------------------------------------------------------------

// inp (N, 2F) f32/bf16/f16; `half` (N, F) (out, or dout) and `full` (N, 2F) (dinp, optional) in inp's dtype.
void check_glu(Device dev, const char* op, TensorView inp, const char* half_name, TensorView half, TensorView full) {
  require(dev, inp, op, "inp");
  require(dev, half, op, half_name);
  const DType dt = inp.dtype();
  LOOM_CHECK(is_compute_dtype(dt), "[", op, "] expected f32, bf16 or f16 inp, got ", inp.desc());
  const int64_t C2 = inp.shape().cols();
  LOOM_CHECK(C2 > 0 && C2 % 2 == 0, "[", op, "] inp's last dim must be 2F = [gate | up] (even, > 0), got ",
             inp.desc());
  const int64_t F = C2 / 2, N = inp.numel() / C2;
  LOOM_CHECK(half.dtype() == dt, "[", op, "] ", half_name, " must be ", dtype_name(dt), " like inp, got ",
             half.desc());
  LOOM_CHECK(half.shape().cols() == F && half.numel() == N * F, "[", op, "] expected ", half_name, " (", N, ", ", F,
             ") for inp ", inp.desc(), ", got ", half.desc());
  if (full.defined()) {
    require(dev, full, op, "dinp");
    LOOM_CHECK(full.dtype() == dt, "[", op, "] dinp must be ", dtype_name(dt), " like inp, got ", full.desc());
    LOOM_CHECK(full.shape().cols() == 2 * F && full.numel() == N * 2 * F, "[", op,
               "] expected dinp shaped like inp ", inp.desc(), ", got ", full.desc());
  }
}

// ---- dropout ----------------------------------------------------------------------------------------------

void check_dropout(Device dev, const char* op, TensorView out, const char* out_name, TensorView inp,
                   const char* inp_name, float p) {
  LOOM_CHECK(p >= 0.0f && p < 1.0f, "[", op, "] expected a dropout probability in [0, 1), got ", p);
  for (const auto& [t, name] : {std::pair{out, out_name}, std::pair{inp, inp_name}}) {
    require(dev, t, op, name);
    LOOM_CHECK(is_compute_dtype(t.dtype()), "[", op, "] expected ", name, " f32, bf16 or f16, got ", t.desc());
  }
  LOOM_CHECK(out.dtype() == inp.dtype() && out.numel() == inp.numel(), "[", op, "] expected ", out_name,
             " with the dtype and element count of ", inp_name, " ", inp.desc(), ", got ", out.desc());
  // In place is fine (each element is read before it is written); any other overlap is not.
  LOOM_CHECK(inp.raw() == out.raw() || !overlaps(inp, out), "[", op, "] ", out_name, " must be ", inp_name,
             " itself or not overlap it");
}

// ---- optimizer and buffer utilities -----------------------------------------------------------------------

// An optimizer update's operand: f32 (master weights, gradients, state), on dev, n elements. `state` names
// the op's state in the message ("state", "momentum").
void expect_optimizer_f32(Device dev, TensorView t, const char* op, const char* name, const char* state, int64_t n) {
  LOOM_CHECK(t.defined() && t.dtype() == DType::kF32, "[", op, "] expected f32 ", name, " (", op,
             " takes f32 master weights, gradients and ", state, " only), got ",
             t.defined() ? t.desc() : std::string("nothing"));
  on_device(dev, t, op, name);
  expect_numel(t, n, op, name);
}

// The optional 16-bit compute copy an optimizer update also writes.
void expect_compute_copy(Device dev, TensorView compute, const char* op, int64_t n) {
  if (!compute.defined()) return;
  LOOM_CHECK((compute.dtype() == DType::kBF16 || compute.dtype() == DType::kF16) && compute.numel() == n, "[", op,
             "] expected a bf16 or f16 compute copy with ", n, " elements, got ", compute.desc());
  on_device(dev, compute, op, "compute");
}

// x, given and on dev, in one of the float dtypes (compute dtypes and fp8).
void expect_float_buffer(Device dev, TensorView x, const char* op) {
  require(dev, x, op, "x");
  LOOM_CHECK(is_float_dtype(x.dtype()), "[", op, "] expected a float dtype (f32, bf16, f16, fp8e4m3, fp8e5m2), got ",
             x.desc());
}

// ---- FP8 --------------------------------------------------------------------------------------------------

// A scale, inverse scale or amax: a (1) f32 tensor on the op's device, read and written by the device only.
void expect_scalar(Device dev, TensorView t, const char* op, const char* name) {
  LOOM_CHECK(t.defined() && t.device() == dev && t.dtype() == DType::kF32 && t.numel() == 1, "[", op, "] expected ",
             name, " as a (1) f32 tensor on ", dev.str(), ", got ", t.desc());
}

// out and inp of a (de)quantisation: given, on dev, one of each side's dtypes, the same element count.
void check_fp8_convert(Device dev, const char* op, TensorView out, TensorView inp, bool quantize) {
  require(dev, out, op, "out");
  require(dev, inp, op, "inp");
  const TensorView fp8 = quantize ? out : inp, wide = quantize ? inp : out;
  const char* fp8_name = quantize ? "out" : "inp";
  const char* wide_name = quantize ? "inp" : "out";
  LOOM_CHECK(is_fp8(fp8.dtype()), "[", op, "] expected ", fp8_name, " e4m3 or e5m2, got ", fp8.desc());
  LOOM_CHECK(is_compute_dtype(wide.dtype()), "[", op, "] expected ", wide_name, " f32, bf16 or f16, got ",
             wide.desc());
  LOOM_CHECK(out.numel() == inp.numel(), "[", op, "] out ", out.desc(), " and inp ", inp.desc(),
             " differ in element count");
}

}  // namespace

void OpTable::residual_forward(TensorView out, TensorView a, TensorView b) const {
  common_dtype(device(), "residual_forward", {{"out", out}, {"a", a}, {"b", b}});
  do_residual_forward(out, a, b);
}

void OpTable::gelu_forward(TensorView out, TensorView inp) const {
  common_dtype(device(), "gelu_forward", {{"out", out}, {"inp", inp}});
  do_gelu_forward(out, inp);
}

void OpTable::gelu_backward(TensorView dinp, TensorView inp, TensorView dout, TensorView out) const {
  const char* op = "gelu_backward";
  common_dtype(device(), op, {{"dinp", dinp}, {"inp", inp}, {"dout", dout}});
  if (out.defined()) {
    common_dtype(device(), op, {{"dinp", dinp}, {"out", out}});
    check_disjoint(op, "out", out, {{"inp", inp}, {"dinp", dinp}, {"dout", dout}});
  }
  do_gelu_backward(dinp, inp, dout, out);
}

void OpTable::bias_add_forward(TensorView out, TensorView bias) const {
  const char* op = "bias_add_forward";
  require(device(), out, op, "out");
  require(device(), bias, op, "bias");
  const DType dt = out.dtype();
  LOOM_CHECK(is_compute_dtype(dt), "[", op, "] expected f32, bf16 or f16 out, got ", out.desc());
  // The sum is f32 whatever the bias dtype, rounded once to out's dtype: a bias in out's dtype, an f32
  // bias, or (f32 out, as matmul_forward allows) a bf16/f16 bias.
  LOOM_CHECK(bias.dtype() == dt || bias.dtype() == DType::kF32 || (dt == DType::kF32 && is_compute_dtype(bias.dtype())),
             "[", op, "] bias must be ", dtype_name(dt), " (out's dtype) or f32, got bias ", bias.desc(), " for out ",
             out.desc());
  const int64_t C = bias.numel();
  LOOM_CHECK(C > 0 && out.numel() % C == 0, "[", op, "] out ", out.desc(), " is not a multiple of bias ",
             bias.desc());
  do_bias_add_forward(out, bias);
}

void OpTable::bias_backward(TensorView dbias, TensorView dout) const {
  const char* op = "bias_backward";
  require(device(), dbias, op, "dbias");
  require(device(), dout, op, "dout");
  const DType dt = dout.dtype();
  LOOM_CHECK(is_compute_dtype(dt), "[", op, "] expected f32, bf16 or f16 dout, got ", dout.desc());
  LOOM_CHECK(dbias.dtype() == DType::kF32 || dbias.dtype() == dt, "[", op, "] dbias must be f32 or dout's dtype ",
             dtype_name(dt), ", got dbias ", dbias.desc(), " for dout ", dout.desc());
  const int64_t C = dbias.numel();
  LOOM_CHECK(C > 0 && dout.numel() % C == 0, "[", op, "] dout ", dout.desc(), " is not a multiple of dbias ",
             dbias.desc());
  do_bias_backward(dbias, dout);
}

void OpTable::glu_forward(TensorView out, TensorView inp, GluKind kind) const {
  check_glu(device(), "glu_forward", inp, "out", out, TensorView());
  do_glu_forward(out, inp, kind);
}

void OpTable::glu_backward(TensorView dinp, TensorView inp, TensorView dout, GluKind kind, TensorView out) const {
  const char* op = "glu_backward";
  require(device(), dinp, op, "dinp");
  check_glu(device(), op, inp, "dout", dout, dinp);
  if (out.defined()) {
    check_glu(device(), op, inp, "out", out, TensorView());
    check_disjoint(op, "out", out, {{"inp", inp}, {"dinp", dinp}, {"dout", dout}});
  }
  do_glu_backward(dinp, inp, dout, kind, out);
}

void OpTable::dropout_forward(TensorView out, TensorView inp, float p, uint64_t seed, uint64_t stream,
                              uint64_t offset) const {
  check_dropout(device(), "dropout_forward", out, "out", inp, "inp", p);
  do_dropout_forward(out, inp, p, seed, stream, offset);
}

void OpTable::dropout_backward(TensorView dinp, TensorView dout, float p, uint64_t seed, uint64_t stream,
                               uint64_t offset) const {
  check_dropout(device(), "dropout_backward", dinp, "dinp", dout, "dout", p);
  do_dropout_backward(dinp, dout, p, seed, stream, offset);
}

void OpTable::cross_entropy_forward_backward(TensorView losses, TensorView logits, TensorView targets,
                                             int64_t vocab_size, TensorView loss_mask, float dlogits_scale) const {
  const char* op = "cross_entropy_forward_backward";
  const Device dev = device();
  LOOM_CHECK(logits.defined() && is_compute_dtype(logits.dtype()), "[", op, "] expected f32, bf16 or f16 logits, got ",
             logits.defined() ? logits.desc() : std::string("nothing"));
  on_device(dev, logits, op, "logits");
  const int64_t Vp = logits.shape().cols();
  const int64_t V = vocab_size;
  LOOM_CHECK(V >= 1 && V <= Vp, "[", op, "] vocab_size ", V, " must be in [1, ", Vp, "] (padded logits width)");
  const int64_t N = logits.numel() / Vp;
  LOOM_CHECK(losses.defined() && losses.dtype() == DType::kF32 && losses.numel() == N, "[", op,
             "] expected f32 losses with ", N, " elements, got ", losses.defined() ? losses.desc() : "nothing");
  LOOM_CHECK(targets.defined() && targets.dtype() == DType::kI32 && targets.numel() == N, "[", op,
             "] expected i32 targets with ", N, " elements, got ", targets.defined() ? targets.desc() : "nothing");
  on_device(dev, losses, op, "losses");
  on_device(dev, targets, op, "targets");
  if (loss_mask.defined()) {
    LOOM_CHECK(loss_mask.dtype() == DType::kF32 && loss_mask.numel() == N, "[", op, "] expected f32 loss_mask with ",
               N, " elements, got ", loss_mask.desc());
    on_device(dev, loss_mask, op, "loss_mask");
  }
  do_cross_entropy_forward_backward(losses, logits, targets, vocab_size, loss_mask, dlogits_scale);
}

void OpTable::adamw_update(TensorView param, TensorView grad, TensorView m, TensorView v, const AdamWParams& p,
                           TensorView compute) const {
  const int64_t n = param.numel();
  expect_optimizer_f32(device(), param, "adamw_update", "param", "state", n);
  expect_optimizer_f32(device(), grad, "adamw_update", "grad", "state", n);
  expect_optimizer_f32(device(), m, "adamw_update", "exp_avg", "state", n);
  expect_optimizer_f32(device(), v, "adamw_update", "exp_avg_sq", "state", n);
  // Step 0 would divide by a zero bias correction.
  LOOM_CHECK(p.step >= 1, "[adamw_update] step is 1-based, got ", p.step);
  expect_compute_copy(device(), compute, "adamw_update", n);
  do_adamw_update(param, grad, m, v, p, compute);
}

void OpTable::sgd_update(TensorView param, TensorView grad, TensorView momentum_buf, const SgdParams& p,
                         TensorView compute) const {
  const int64_t n = param.numel();
  auto expect_f32 = [&](TensorView t, const char* name) {
    expect_optimizer_f32(device(), t, "sgd_update", name, "momentum", n);
  };
  expect_f32(param, "param");
  expect_f32(grad, "grad");
  LOOM_CHECK(std::isfinite(p.momentum) && p.momentum >= 0.0f, "[sgd_update] momentum must be >= 0, got ", p.momentum);
  if (p.momentum != 0.0f)
    expect_f32(momentum_buf, "momentum_buf");
  else
    LOOM_CHECK(!momentum_buf.defined(), "[sgd_update] momentum 0 takes no momentum buffer, got ", momentum_buf.desc());
  expect_compute_copy(device(), compute, "sgd_update", n);
  do_sgd_update(param, grad, momentum_buf, p, compute);
}

AbsStats OpTable::abs_stats(TensorView x) const {
  require(device(), x, "abs_stats", "x");
  LOOM_CHECK(x.dtype() == DType::kF32, "[abs_stats] expected an f32 buffer (optimizer state, master weights), got ",
             x.desc());
  return do_abs_stats(x);
}

int64_t OpTable::count_zeros(TensorView x) const {
  expect_float_buffer(device(), x, "count_zeros");
  return do_count_zeros(x);
}

double OpTable::sum_squares(TensorView x) const {
  expect_float_buffer(device(), x, "sum_squares");
  return do_sum_squares(x);
}

bool OpTable::has_inf_or_nan(TensorView x) const {
  expect_float_buffer(device(), x, "has_inf_or_nan");
  return do_has_inf_or_nan(x);
}

void OpTable::scale_(TensorView x, float s) const {
  expect_float_buffer(device(), x, "scale_");
  do_scale_(x, s);
}

void OpTable::fill_(TensorView x, float value) const {
  require(device(), x, "fill_", "x");
  const DType dt = x.dtype();
  LOOM_CHECK(is_float_dtype(dt) || dt == DType::kI32 || dt == DType::kI64 || dt == DType::kU16,
             "[fill_] expected a float, i32, i64 or u16 dtype, got ", x.desc());
  do_fill_(x, value);
}

void OpTable::cast(TensorView out, TensorView inp) const {
  require(device(), out, "cast", "out");
  require(device(), inp, "cast", "inp");
  expect_numel(out, inp.numel(), "cast", "out");
  // The same dtype (any) is a copy; a conversion needs float dtypes on both sides.
  LOOM_CHECK(out.dtype() == inp.dtype() || (is_float_dtype(out.dtype()) && is_float_dtype(inp.dtype())),
             "[cast] expected float dtypes (f32, bf16, f16, fp8e4m3, fp8e5m2) or one dtype, got out ", out.desc(),
             ", inp ", inp.desc());
  do_cast(out, inp);
}

void OpTable::fp8_quantize(TensorView out, TensorView inp, TensorView scale, TensorView amax) const {
  const char* op = "fp8_quantize";
  check_fp8_convert(device(), op, out, inp, /*quantize=*/true);
  expect_scalar(device(), scale, op, "scale");
  expect_scalar(device(), amax, op, "amax");
  do_fp8_quantize(out, inp, scale, amax);
}

void OpTable::fp8_dequantize(TensorView out, TensorView inp, TensorView scale_inv) const {
  const char* op = "fp8_dequantize";
  check_fp8_convert(device(), op, out, inp, /*quantize=*/false);
  expect_scalar(device(), scale_inv, op, "scale_inv");
  do_fp8_dequantize(out, inp, scale_inv);
}

void OpTable::fp8_update_scaling(TensorView amax_history, TensorView scale, TensorView scale_inv, float fp8_max,
                                 int margin, bool use_max) const {
  const char* op = "fp8_update_scaling";
  for (const auto& [t, name] : {std::pair{amax_history, "amax_history"}, std::pair{scale, "scale"},
                                std::pair{scale_inv, "scale_inv"}}) {
    require(device(), t, op, name);
    LOOM_CHECK(t.dtype() == DType::kF32, "[", op, "] expected ", name, " f32, got ", t.desc());
  }
  LOOM_CHECK(amax_history.ndim() == 2, "[", op, "] expected amax_history (L, n), got ", amax_history.desc());
  const int64_t L = amax_history.size(0), n = amax_history.size(1);
  LOOM_CHECK(L >= 1 && scale.numel() == n && scale_inv.numel() == n, "[", op, "] amax_history ",
             amax_history.desc(), " needs scale and scale_inv of ", n, " elements, got ", scale.desc(), " and ",
             scale_inv.desc());
  LOOM_CHECK(fp8_max > 0 && margin >= 0, "[", op, "] expected fp8_max > 0 and margin >= 0, got ", fp8_max, ", ",
             margin);
  do_fp8_update_scaling(amax_history, scale, scale_inv, fp8_max, margin, use_max);
}

void OpTable::fp8_gemm(TensorView out, TensorView a, TensorView a_scale_inv, TensorView b, TensorView b_scale_inv,
                       TensorView bias, bool accumulate) const {
  const char* op = "fp8_gemm";
  const Device dev = device();
  require(dev, out, op, "out");
  require(dev, a, op, "a");
  require(dev, b, op, "b");
  expect_scalar(dev, a_scale_inv, op, "a_scale_inv");
  expect_scalar(dev, b_scale_inv, op, "b_scale_inv");
  LOOM_CHECK(is_fp8(a.dtype()) && is_fp8(b.dtype()), "[", op, "] expected fp8 operands, got a ", a.desc(), ", b ",
             b.desc());
  LOOM_CHECK(!(a.dtype() == DType::kF8E5M2 && b.dtype() == DType::kF8E5M2), "[", op,
             "] E5M2 x E5M2 has no tensor-core GEMM; quantise one operand as E4M3");
  LOOM_CHECK(is_compute_dtype(out.dtype()), "[", op, "] expected out f32, bf16 or f16, got ", out.desc());
  LOOM_CHECK(b.ndim() == 2 && a.ndim() >= 1, "[", op, "] expected b (N, K), got ", b.desc());
  const int64_t N = b.size(0), K = b.size(1);
  LOOM_CHECK(a.size(a.ndim() - 1) == K, "[", op, "] a ", a.desc(), " and b ", b.desc(), " disagree on K");
  const int64_t M = a.shape().rows();  // leading dims flattened (well defined for K == 0 too)
  LOOM_CHECK(out.numel() == M * N, "[", op, "] expected out with ", M, " x ", N, " elements, got ", out.desc());
  if (bias.defined()) {
    LOOM_CHECK(bias.numel() == N, "[", op, "] expected bias with ", N, " elements, got ", bias.desc());
    // Added in f32 whatever its dtype: the CPU widens it, CUDA adds it after the product (in cuBLASLt's
    // epilogue only when it has a 16-bit out's dtype). nn::Fp8Gemm passes a bias in the compute dtype with an
    // f32 out.
    LOOM_CHECK(is_compute_dtype(bias.dtype()), "[", op, "] expected bias f32, bf16 or f16, got ", bias.desc());
    on_device(dev, bias, op, "bias");
  }
  do_fp8_gemm(out, a, a_scale_inv, b, b_scale_inv, bias, accumulate);
}

void OpTable::transpose(TensorView out, TensorView inp) const {
  const char* op = "transpose";
  require(device(), out, op, "out");
  require(device(), inp, op, "inp");
  LOOM_CHECK(inp.ndim() == 2 && out.ndim() == 2 && out.size(0) == inp.size(1) && out.size(1) == inp.size(0),
             "[", op, "] expected out (C, R) for inp (R, C), got out ", out.desc(), ", inp ", inp.desc());
  LOOM_CHECK(out.dtype() == inp.dtype(), "[", op, "] expected one dtype, got out ", out.desc(), ", inp ", inp.desc());
  const size_t es = dtype_size(inp.dtype());
  LOOM_CHECK(es == 1 || es == 2 || es == 4, "[", op, "] expected 1-, 2- or 4-byte elements, got ", inp.desc());
  do_transpose(out, inp);
}

}  // namespace loom
