// The op table's entry points for the mixture-of-experts ops (token permutation / unpermutation and the
// grouped GEMM): argument checks — shapes, dtypes, devices, group sizes — then the backend's do_<op>.
// Everything is checked before anything is computed, so a rejected call leaves every output untouched.
// The values of row_id_map live in the backend's memory and are the backend's to check (ops.h).
#include "backend/op_checks.h"

namespace loom {

using namespace op_checks;

namespace {

struct PermShape {
  int64_t N = 0, E = 0, M = 0, C = 0;
};

// tokens (N, C) and rows (M, C) in one compute dtype; row_id_map (N, E) i32; all on dev.
PermShape check_permute(Device dev, const char* op, TensorView tokens, const char* tokens_name, TensorView rows,
                        const char* rows_name, TensorView row_id_map) {
  require(dev, row_id_map, op, "row_id_map");
  LOOM_CHECK(row_id_map.dtype() == DType::kI32 && row_id_map.ndim() == 2, "[", op,
             "] expected row_id_map (N, E) i32, got ", row_id_map.desc());
  PermShape s;
  s.N = row_id_map.size(0);
  s.E = row_id_map.size(1);
  LOOM_CHECK(s.E > 0, "[", op, "] expected at least one expert in row_id_map, got ", row_id_map.desc());
  if (s.N > 0) require(dev, tokens, op, tokens_name);
  LOOM_CHECK(tokens.ndim() == 2 && tokens.size(0) == s.N, "[", op, "] expected ", tokens_name, " (", s.N,
             ", C) to match row_id_map ", row_id_map.desc(), ", got ", tokens.desc());
  s.C = tokens.size(1);
  LOOM_CHECK(rows.ndim() == 2 && rows.size(1) == s.C, "[", op, "] expected ", rows_name, " (M, ", s.C, "), got ",
             rows.desc());
  s.M = rows.size(0);
  if (s.M > 0) require(dev, rows, op, rows_name);
  LOOM_CHECK(s.M <= s.N * s.E, "[", op, "] ", rows_name, " has ", s.M, " rows but row_id_map (", s.N, ", ", s.E,
             ") can address at most ", s.N * s.E);
  const DType dt = compute_dtype(tokens, op, tokens_name);
  LOOM_CHECK(rows.dtype() == dt, "[", op, "] ", rows_name, " must share the dtype of ", tokens_name, " (",
             dtype_name(dt), "), got ", rows.desc());
  return s;
}

void check_probs(Device dev, const char* op, TensorView probs, const char* name, const PermShape& s) {
  require(dev, probs, op, name);
  LOOM_CHECK(probs.dtype() == DType::kF32 && probs.ndim() == 2 && probs.size(0) == s.N && probs.size(1) == s.E,
             "[", op, "] expected ", name, " (", s.N, ", ", s.E, ") f32, got ", probs.desc());
}

struct GroupedShape {
  int64_t M = 0, K = 0, N = 0, G = 0;
};

// inp (M, K), weight (G, N, K), group sizes >= 0 summing to M; dtypes as matmul.
GroupedShape check_grouped(Device dev, const char* op, TensorView inp, TensorView weight,
                           const std::vector<int64_t>& group_sizes) {
  require(dev, weight, op, "weight");
  LOOM_CHECK(weight.ndim() == 3, "[", op, "] expected weight (G, N, K), got ", weight.desc());
  GroupedShape s;
  s.G = weight.size(0);
  s.N = weight.size(1);
  s.K = weight.size(2);
  LOOM_CHECK(int64_t(group_sizes.size()) == s.G, "[", op, "] expected ", s.G, " group sizes (one per weight[g]), got ",
             group_sizes.size());
  int64_t total = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    LOOM_CHECK(group_sizes[g] >= 0, "[", op, "] group ", g, " has negative size ", group_sizes[g]);
    total += group_sizes[g];
  }
  LOOM_CHECK(inp.ndim() == 2 && inp.size(1) == s.K, "[", op, "] expected inp (M, ", s.K, "), got ", inp.desc());
  s.M = inp.size(0);
  LOOM_CHECK(total == s.M, "[", op, "] group sizes sum to ", total, " but inp has ", s.M, " rows");
  if (s.M > 0) require(dev, inp, op, "inp");
  const DType dt = compute_dtype(weight, op, "weight");
  LOOM_CHECK(inp.dtype() == dt, "[", op, "] inp must share the compute dtype of weight (", dtype_name(dt), "), got ",
             inp.desc());
  return s;
}

// t is (rows, cols), given when it has elements, in the compute dtype cd (or f32 when f32_ok).
void check_rows(Device dev, const char* op, TensorView t, const char* name, int64_t rows, int64_t cols, DType cd,
                bool f32_ok) {
  LOOM_CHECK(t.ndim() == 2 && t.size(0) == rows && t.size(1) == cols, "[", op, "] expected ", name, " (", rows, ", ",
             cols, "), got ", t.desc());
  if (rows * cols > 0) require(dev, t, op, name);
  LOOM_CHECK(t.dtype() == cd || (f32_ok && t.dtype() == DType::kF32), "[", op, "] ", name, " must be ",
             dtype_name(cd), f32_ok && cd != DType::kF32 ? " (the compute dtype) or f32" : " (the compute dtype)",
             ", got ", t.desc());
}

}  // namespace

void OpTable::moe_permute_forward(TensorView out, TensorView inp, TensorView row_id_map) const {
  const char* op = "moe_permute_forward";
  check_permute(device(), op, inp, "inp", out, "out", row_id_map);
  do_moe_permute_forward(out, inp, row_id_map);
}

void OpTable::moe_permute_backward(TensorView dinp, TensorView dout, TensorView row_id_map) const {
  const char* op = "moe_permute_backward";
  check_permute(device(), op, dinp, "dinp", dout, "dout", row_id_map);
  do_moe_permute_backward(dinp, dout, row_id_map);
}

void OpTable::moe_unpermute_forward(TensorView out, TensorView inp, TensorView probs, TensorView row_id_map) const {
  const char* op = "moe_unpermute_forward";
  const PermShape s = check_permute(device(), op, out, "out", inp, "inp", row_id_map);
  check_probs(device(), op, probs, "probs", s);
  do_moe_unpermute_forward(out, inp, probs, row_id_map);
}

void OpTable::moe_unpermute_backward(TensorView dinp, TensorView dprobs, TensorView dout, TensorView inp,
                                     TensorView probs, TensorView row_id_map) const {
  const char* op = "moe_unpermute_backward";
  const PermShape s = check_permute(device(), op, dout, "dout", dinp, "dinp", row_id_map);
  LOOM_CHECK(inp.shape() == dinp.shape() && inp.dtype() == dinp.dtype(), "[", op, "] expected inp shaped like dinp ",
             dinp.desc(), ", got ", inp.desc());
  if (s.M > 0) require(device(), inp, op, "inp");
  check_probs(device(), op, probs, "probs", s);
  if (dprobs.defined()) check_probs(device(), op, dprobs, "dprobs", s);
  do_moe_unpermute_backward(dinp, dprobs, dout, inp, probs, row_id_map);
}

void OpTable::grouped_matmul_forward(TensorView out, TensorView inp, TensorView weight,
                                     const std::vector<int64_t>& group_sizes) const {
  const char* op = "grouped_matmul_forward";
  const GroupedShape s = check_grouped(device(), op, inp, weight, group_sizes);
  check_rows(device(), op, out, "out", s.M, s.N, weight.dtype(), true);
  do_grouped_matmul_forward(out, inp, weight, group_sizes);
}

void OpTable::grouped_matmul_backward(TensorView dinp, TensorView dweight, TensorView dout, TensorView inp,
                                      TensorView weight, const std::vector<int64_t>& group_sizes,
                                      GradWrite dweight_write) const {
  const char* op = "grouped_matmul_backward";
  const GroupedShape s = check_grouped(device(), op, inp, weight, group_sizes);
  const DType cd = weight.dtype();
  check_rows(device(), op, dout, "dout", s.M, s.N, cd, false);
  if (dinp.defined()) check_rows(device(), op, dinp, "dinp", s.M, s.K, cd, true);
  if (dweight.defined()) {
    require(device(), dweight, op, "dweight");
    LOOM_CHECK(dweight.shape() == weight.shape(), "[", op, "] expected dweight shaped like weight ", weight.desc(),
               ", got ", dweight.desc());
    LOOM_CHECK(dweight.dtype() == cd || dweight.dtype() == DType::kF32, "[", op, "] dweight must be ",
               dtype_name(cd), cd != DType::kF32 ? " (the compute dtype) or f32" : "", ", got ", dweight.desc());
  }
  do_grouped_matmul_backward(dinp, dweight, dout, inp, weight, group_sizes, dweight_write);
}

}  // namespace loom
