// The op table's entry points for the linear layer, embedding and norms: each checks its arguments once —
// shapes, dtypes (the mixed-precision rules of ops.h), devices, parameter ranges — and then calls the
// backend's do_<op>. The checks are the union of what the CPU reference and the CUDA launchers required
// before they were moved here, so no backend accepts what another rejects. Everything is checked before
// anything is computed, so a rejected call leaves every output untouched. Helpers are declared in
// op_checks.h; the other entry points are in op_checks_elementwise.cpp and op_checks_attention.cpp.
#include "backend/op_checks.h"

namespace loom {

namespace op_checks {

void require(Device dev, TensorView t, const char* op, const char* name) {
  LOOM_CHECK(t.defined(), "[", op, "] ", name, " is required");
  on_device(dev, t, op, name);
}

void on_device(Device dev, TensorView t, const char* op, const char* name) {
  LOOM_CHECK(!t.defined() || t.device() == dev, "[", op, "] expected ", name, " on ", dev.str(), ", got ", t.desc());
}

void expect_numel(TensorView t, int64_t n, const char* op, const char* name) {
  LOOM_CHECK(t.numel() == n, "[", op, "] expected ", name, " with ", n, " elements, got ", t.desc());
}

DType compute_dtype(TensorView t, const char* op, const char* name) {
  LOOM_CHECK(is_compute_dtype(t.dtype()), "[", op, "] expected f32, bf16 or f16 ", name, ", got ", t.desc());
  return t.dtype();
}

void check_heads(const AttentionParams& p, const char* op) {
  LOOM_CHECK(p.num_heads > 0 && p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0, "[", op,
             "] expected num_heads to be a positive multiple of num_kv_heads, got ", p.num_heads, " and ",
             p.num_kv_heads);
  LOOM_CHECK(p.head_dim > 0, "[", op, "] expected head_dim > 0, got ", p.head_dim);
}

void check_attention_params(const AttentionParams& p, const char* op) {
  LOOM_CHECK(p.window == -1 || p.window > 0, "[", op, "] expected window -1 (unlimited) or > 0, got ", p.window);
  LOOM_CHECK(p.causal || p.window == -1, "[", op, "] a sliding window needs causal attention");
  LOOM_CHECK(p.dropout_p >= 0.0f && p.dropout_p < 1.0f, "[", op, "] expected dropout_p in [0, 1), got ",
             p.dropout_p);
}

}  // namespace op_checks

using namespace op_checks;

namespace {

// ---- matmul -----------------------------------------------------------------------------------------------

// t is (rows, cols) once its leading dims are flattened. An empty view has shape () (one "row" of one
// column), so presence is checked explicitly; a tensor with no elements may have no storage.
void check_2d(Device dev, const char* op, TensorView t, int64_t rows, int64_t cols, const char* name) {
  LOOM_CHECK((t.defined() || rows * cols == 0) && t.ndim() >= 1 && t.shape().rows() == rows &&
                 t.shape().cols() == cols,
             "[", op, "] ", name, " expected (", rows, ", ", cols, ") (leading dims flattened), got ", t.desc());
  on_device(dev, t, op, name);
}

// `t` must be the compute dtype cd, or (when f32_ok) f32.
void check_dtype(const char* op, TensorView t, DType cd, bool f32_ok, const char* name) {
  LOOM_CHECK(t.dtype() == cd || (f32_ok && t.dtype() == DType::kF32), "[", op, "] ", name, " must be ",
             dtype_name(cd), f32_ok && cd != DType::kF32 ? " (the compute dtype) or f32" : " (the compute dtype)",
             ", got ", t.desc());
}

DType matmul_compute_dtype(const char* op, TensorView t, const char* name) {
  LOOM_CHECK(is_compute_dtype(t.dtype()), "[", op, "] expected ", name, " in f32, bf16 or f16, got ", t.desc());
  return t.dtype();
}

// ---- embedding --------------------------------------------------------------------------------------------

// A given f32, bf16 or f16 tensor on dev (the dtype rules between tensors are checked by the ops).
void expect_float(Device dev, TensorView t, const char* op, const char* name) {
  require(dev, t, op, name);
  LOOM_CHECK(is_compute_dtype(t.dtype()), "[", op, "] expected f32, bf16 or f16 ", name, ", got ", t.desc());
}

struct EmbShape {
  int64_t B = 0, T = 0, C = 0, V = 0;
};

// tokens (B, T) or (T) i32; table (V, C); act (B, T, C); the position table (maxpos, C) and position_ids
// (shaped like tokens), each optional. Without ids the positions are 0..T-1, so T must fit the table. The
// id values live in the backend's memory and are the backend's to check.
EmbShape check_embedding(Device dev, const char* op, TensorView tokens, TensorView table, const char* table_name,
                         TensorView act, const char* act_name, TensorView pos, const char* pos_name,
                         TensorView position_ids) {
  LOOM_CHECK(tokens.defined() && tokens.dtype() == DType::kI32, "[", op, "] expected i32 tokens, got ",
             tokens.desc());
  on_device(dev, tokens, op, "tokens");
  expect_float(dev, table, op, table_name);
  expect_float(dev, act, op, act_name);
  LOOM_CHECK(table.ndim() == 2, "[", op, "] expected ", table_name, " (V, C), got ", table.desc());
  EmbShape s;
  s.V = table.size(0);
  s.C = table.size(1);
  s.T = tokens.shape().cols();
  s.B = s.T == 0 ? 0 : tokens.numel() / s.T;
  LOOM_CHECK(act.numel() == s.B * s.T * s.C, "[", op, "] expected ", act_name, " (", s.B, ", ", s.T, ", ", s.C,
             "), got ", act.desc());
  LOOM_CHECK(s.B * s.T == 0 || s.V > 0, "[", op, "] every token id is outside the empty vocabulary of ", table_name,
             " ", table.desc());
  if (position_ids.defined()) {
    LOOM_CHECK(position_ids.dtype() == DType::kI32 && position_ids.shape() == tokens.shape(), "[", op,
               "] expected i32 position_ids shaped like tokens ", tokens.shape().str(), ", got ", position_ids.desc());
    on_device(dev, position_ids, op, "position_ids");
  }
  if (pos.defined()) {
    expect_float(dev, pos, op, pos_name);
    LOOM_CHECK(pos.ndim() == 2 && pos.size(1) == s.C, "[", op, "] expected ", pos_name, " (maxpos, ", s.C, "), got ",
               pos.desc());
    if (!position_ids.defined())
      LOOM_CHECK(pos.size(0) >= s.T, "[", op, "] sequence length ", s.T, " exceeds the ", pos.size(0),
                 " positions of ", pos_name);
  }
  return s;
}

// ---- layernorm and RMSNorm --------------------------------------------------------------------------------

// A given tensor on dev in the call's compute dtype dt (activations and parameters share it).
void expect_dtype(Device dev, TensorView t, DType dt, const char* op, const char* name) {
  require(dev, t, op, name);
  LOOM_CHECK(t.dtype() == dt, "[", op, "] ", name, " must be ", dtype_name(dt),
             " (all activations and parameters of one call share the compute dtype), got ", t.desc());
}

// A parameter gradient, when given: f32 (main grads) or the compute dtype, C elements.
void expect_grad(Device dev, TensorView t, DType dt, int64_t C, const char* op, const char* name) {
  if (!t.defined()) return;
  on_device(dev, t, op, name);
  LOOM_CHECK(t.dtype() == DType::kF32 || t.dtype() == dt, "[", op, "] ", name, " must be f32 or the compute dtype ",
             dtype_name(dt), ", got ", t.desc());
  expect_numel(t, C, op, name);
}

// Per-row statistics, when given: f32 with N elements.
void expect_stats(Device dev, TensorView t, int64_t N, const char* op, const char* name) {
  if (!t.defined()) return;
  on_device(dev, t, op, name);
  LOOM_CHECK(t.dtype() == DType::kF32, "[", op, "] expected f32 ", name, ", got ", t.desc());
  expect_numel(t, N, op, name);
}

struct NormShape {
  int64_t N = 0, C = 0;
  DType dt = DType::kF32;
};

// The rows (N, C) a norm reads from `x` (inp, or the residual of a fused forward), its compute dtype, and
// x, weight and an (N, C) tensor `rows` (out or dout) in that dtype.
NormShape check_norm_rows(Device dev, const char* op, TensorView x, const char* x_name, TensorView rows,
                          const char* rows_name, TensorView weight) {
  NormShape s;
  require(dev, x, op, x_name);
  s.dt = compute_dtype(x, op, x_name);
  expect_dtype(dev, rows, s.dt, op, rows_name);
  expect_dtype(dev, weight, s.dt, op, "weight");
  s.C = x.shape().cols();
  LOOM_CHECK(s.C > 0, "[", op, "] empty last dim in ", x_name, " ", x.desc());
  s.N = x.numel() / s.C;
  expect_numel(rows, x.numel(), op, rows_name);
  expect_numel(weight, s.C, op, "weight");
  return s;
}

// The a + b inputs of a fused residual forward.
void check_residual_inputs(Device dev, const NormShape& s, const char* op, TensorView a, TensorView b) {
  expect_dtype(dev, a, s.dt, op, "a");
  expect_dtype(dev, b, s.dt, op, "b");
  expect_numel(a, s.N * s.C, op, "a");
  expect_numel(b, s.N * s.C, op, "b");
}

// The optional bias of a layernorm (compute dtype, C elements).
void check_norm_bias(Device dev, const NormShape& s, const char* op, TensorView bias) {
  if (!bias.defined()) return;
  expect_dtype(dev, bias, s.dt, op, "bias");
  expect_numel(bias, s.C, op, "bias");
}

// dinp, when given: (N, C) in the compute dtype.
void check_norm_dinp(Device dev, const NormShape& s, const char* op, TensorView dinp) {
  if (!dinp.defined()) return;
  expect_dtype(dev, dinp, s.dt, op, "dinp");
  expect_numel(dinp, s.N * s.C, op, "dinp");
}

}  // namespace

void OpTable::matmul_forward(TensorView out, TensorView inp, TensorView weight, TensorView bias) const {
  const char* op = "matmul_forward";
  const Device dev = device();
  LOOM_CHECK(weight.ndim() == 2, "[matmul_forward] weight must be (N, K), got ", weight.desc());
  on_device(dev, weight, op, "weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  LOOM_CHECK(inp.ndim() >= 1, "[matmul_forward] inp must be (M, K), got ", inp.desc());
  const int64_t M = inp.shape().rows();
  check_2d(dev, op, inp, M, K, "inp");
  check_2d(dev, op, out, M, N, "out");
  const DType cd = matmul_compute_dtype(op, inp, "inp");
  check_dtype(op, weight, cd, false, "weight");
  check_dtype(op, out, cd, true, "out");
  if (bias) {
    LOOM_CHECK(bias.numel() == N, "[matmul_forward] bias expected (", N, "), got ", bias.desc());
    check_dtype(op, bias, cd, true, "bias");
    on_device(dev, bias, op, "bias");
  }
  do_matmul_forward(out, inp, weight, bias);
}

void OpTable::matmul_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout, TensorView inp,
                              TensorView weight, GradWrite dweight_write) const {
  const char* op = "matmul_backward";
  const Device dev = device();
  LOOM_CHECK(weight.ndim() == 2, "[matmul_backward] weight must be (N, K), got ", weight.desc());
  on_device(dev, weight, op, "weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  LOOM_CHECK(dout.ndim() >= 1, "[matmul_backward] dout must be (M, N), got ", dout.desc());
  const int64_t M = dout.shape().rows();
  check_2d(dev, op, dout, M, N, "dout");
  const DType cd = matmul_compute_dtype(op, dout, "dout");
  check_dtype(op, weight, cd, false, "weight");
  if (dinp) {
    check_2d(dev, op, dinp, M, K, "dinp");
    check_dtype(op, dinp, cd, true, "dinp");
  }
  if (dweight) {
    check_2d(dev, op, inp, M, K, "inp");
    check_dtype(op, inp, cd, false, "inp");
    check_dtype(op, dweight, cd, true, "dweight");
    LOOM_CHECK(dweight.shape() == weight.shape(), "[matmul_backward] dweight ", dweight.desc(), " vs weight ",
               weight.desc());
    on_device(dev, dweight, op, "dweight");
  }
  if (dbias) {
    LOOM_CHECK(dbias.numel() == N, "[matmul_backward] dbias expected (", N, "), got ", dbias.desc());
    check_dtype(op, dbias, cd, true, "dbias");
    on_device(dev, dbias, op, "dbias");
  }
  do_matmul_backward(dinp, dweight, dbias, dout, inp, weight, dweight_write);
}

void OpTable::embedding_forward(TensorView out, TensorView tokens, TensorView wte, TensorView wpe,
                                TensorView position_ids) const {
  const char* op = "embedding_forward";
  check_embedding(device(), op, tokens, wte, "wte", out, "out", wpe, "wpe", position_ids);
  const DType dt = wte.dtype();
  LOOM_CHECK(out.dtype() == dt, "[", op, "] out must have the compute dtype ", dtype_name(dt), ", got ", out.desc());
  LOOM_CHECK(!wpe.defined() || wpe.dtype() == dt, "[", op, "] wpe must have the compute dtype ", dtype_name(dt),
             ", got ", wpe.desc());
  do_embedding_forward(out, tokens, wte, wpe, position_ids);
}

void OpTable::embedding_backward(TensorView dwte, TensorView dwpe, TensorView dout, TensorView tokens,
                                 TensorView position_ids) const {
  const char* op = "embedding_backward";
  check_embedding(device(), op, tokens, dwte, "dwte", dout, "dout", dwpe, "dwpe", position_ids);
  const DType dt = dout.dtype();
  LOOM_CHECK(dwte.dtype() == dt || dwte.dtype() == DType::kF32, "[", op, "] dwte must be f32 or the compute dtype ",
             dtype_name(dt), ", got ", dwte.desc());
  LOOM_CHECK(!dwpe.defined() || dwpe.dtype() == dt || dwpe.dtype() == DType::kF32, "[", op,
             "] dwpe must be f32 or the compute dtype ", dtype_name(dt), ", got ", dwpe.desc());
  do_embedding_backward(dwte, dwpe, dout, tokens, position_ids);
}

void OpTable::layernorm_forward(TensorView out, TensorView mean, TensorView rstd, TensorView inp, TensorView weight,
                                TensorView bias, float eps) const {
  const char* op = "layernorm_forward";
  const Device dev = device();
  const NormShape s = check_norm_rows(dev, op, inp, "inp", out, "out", weight);
  check_norm_bias(dev, s, op, bias);
  expect_stats(dev, mean, s.N, op, "mean");
  expect_stats(dev, rstd, s.N, op, "rstd");
  do_layernorm_forward(out, mean, rstd, inp, weight, bias, eps);
}

void OpTable::layernorm_backward(TensorView dinp, TensorView dweight, TensorView dbias, TensorView dout,
                                 TensorView inp, TensorView weight, TensorView mean, TensorView rstd) const {
  const char* op = "layernorm_backward";
  const Device dev = device();
  const NormShape s = check_norm_rows(dev, op, inp, "inp", dout, "dout", weight);
  LOOM_CHECK(mean.defined() && rstd.defined(), "[", op, "] mean and rstd saved by the forward are required");
  expect_stats(dev, mean, s.N, op, "mean");
  expect_stats(dev, rstd, s.N, op, "rstd");
  check_norm_dinp(dev, s, op, dinp);
  expect_grad(dev, dweight, s.dt, s.C, op, "dweight");
  expect_grad(dev, dbias, s.dt, s.C, op, "dbias");
  do_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd);
}

void OpTable::residual_layernorm_forward(TensorView residual, TensorView out, TensorView mean, TensorView rstd,
                                         TensorView a, TensorView b, TensorView weight, TensorView bias,
                                         float eps) const {
  const char* op = "residual_layernorm_forward";
  const Device dev = device();
  const NormShape s = check_norm_rows(dev, op, residual, "residual", out, "out", weight);
  check_norm_bias(dev, s, op, bias);
  expect_stats(dev, mean, s.N, op, "mean");
  expect_stats(dev, rstd, s.N, op, "rstd");
  check_residual_inputs(dev, s, op, a, b);
  do_residual_layernorm_forward(residual, out, mean, rstd, a, b, weight, bias, eps);
}

void OpTable::rmsnorm_forward(TensorView out, TensorView rstd, TensorView inp, TensorView weight, float eps) const {
  const char* op = "rmsnorm_forward";
  const Device dev = device();
  const NormShape s = check_norm_rows(dev, op, inp, "inp", out, "out", weight);
  expect_stats(dev, rstd, s.N, op, "rstd");
  do_rmsnorm_forward(out, rstd, inp, weight, eps);
}

void OpTable::rmsnorm_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp, TensorView weight,
                               TensorView rstd) const {
  const char* op = "rmsnorm_backward";
  const Device dev = device();
  const NormShape s = check_norm_rows(dev, op, inp, "inp", dout, "dout", weight);
  LOOM_CHECK(rstd.defined(), "[", op, "] rstd saved by the forward is required");
  expect_stats(dev, rstd, s.N, op, "rstd");
  check_norm_dinp(dev, s, op, dinp);
  expect_grad(dev, dweight, s.dt, s.C, op, "dweight");
  do_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd);
}

void OpTable::residual_rmsnorm_forward(TensorView residual, TensorView out, TensorView rstd, TensorView a,
                                       TensorView b, TensorView weight, float eps) const {
  const char* op = "residual_rmsnorm_forward";
  const Device dev = device();
  const NormShape s = check_norm_rows(dev, op, residual, "residual", out, "out", weight);
  expect_stats(dev, rstd, s.N, op, "rstd");
  check_residual_inputs(dev, s, op, a, b);
  do_residual_rmsnorm_forward(residual, out, rstd, a, b, weight, eps);
}

}  // namespace loom
