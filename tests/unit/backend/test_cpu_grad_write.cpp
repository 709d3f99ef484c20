// GradWrite::kOverwrite of the weight gradients (matmul_backward, grouped_matmul_backward): the stored
// gradient equals, value for value, what kAccumulate adds into a zeroed buffer, on every product path of the
// CPU backend (f32 sgemm; bf16 brgemm over few tokens, bf16 gemm:jit over many or, without AMX, over few
// tokens on a large gradient; f16 widened; compute-dtype gradients), whatever the buffer held before (it is
// filled with NaN: a kernel that read it would spread them); an empty product stores zeros under kOverwrite
// and leaves the buffer alone under kAccumulate; dinp and dbias keep their own rules.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpu_test_util.h"

namespace loom {
namespace {

// Equal values (a -0 against a +0 counts as equal: 0 + x and x differ only there), no NaN.
void expect_same_values(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float g = got.dtype() == DType::kF32 ? got.data<float>()[i] : test::decode(got.dtype(), test::bits(got)[i]);
    const float w = want.dtype() == DType::kF32 ? want.data<float>()[i] : test::decode(want.dtype(), test::bits(want)[i]);
    if (!(g == w)) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.numel() << " elements differ, first at " << first;
}

Tensor nan_filled(Shape s, DType dt) {
  Tensor t = Tensor::empty(s, dt);
  if (dt == DType::kF32) {
    std::fill(t.data<float>(), t.data<float>() + t.numel(), std::numeric_limits<float>::quiet_NaN());
  } else {
    const uint16_t nan = test::encode(dt, std::numeric_limits<float>::quiet_NaN());
    std::fill(test::bits(t), test::bits(t) + t.numel(), nan);
  }
  return t;
}

Tensor zeros(Shape s, DType dt) {
  Tensor t = Tensor::empty(s, dt);
  if (t.nbytes()) std::memset(t.raw(), 0, size_t(t.nbytes()));
  return t;
}

Tensor operand(Shape s, DType dt, uint64_t seed) {
  return dt == DType::kF32 ? test::uniform_tensor(s, seed) : test::lowp_uniform(s, dt, seed);
}

struct Product {
  int64_t M, N, K;
  DType cd, gd;  // compute dtype, gradient dtype
};

TEST(CpuGradWrite, MatmulOverwriteIsAccumulateIntoZeros) {
  const OpTable& ops = test::ops();
  const Product products[] = {
      {37, 29, 23, DType::kF32, DType::kF32},      // sgemm, one piece
      {1100, 640, 384, DType::kF32, DType::kF32},  // sgemm, grid pieces
      {64, 96, 160, DType::kBF16, DType::kF32},    // bf16 brgemm
      {300, 2560, 1024, DType::kBF16, DType::kF32},  // bf16, gemm:jit without AMX (>= 2^17 outputs)
      {256, 512, 384, DType::kBF16, DType::kF32},    // the same on a small gradient (2^17.6 outputs)
      {64, 512, 384, DType::kBF16, DType::kF32},     // and over few tokens (from 32 on)
      {1100, 256, 192, DType::kBF16, DType::kF32},   // bf16 gemm:jit (runtime reduction, > 512 tokens)
      {48, 80, 72, DType::kBF16, DType::kBF16},      // bf16 gradient in the compute dtype
      {45, 70, 33, DType::kF16, DType::kF32},        // f16 widened
      {45, 70, 33, DType::kF16, DType::kF16},
  };
  for (const Product& p : products) {
    const std::string what = std::string(dtype_name(p.cd)) + "/" + dtype_name(p.gd) + " M=" + std::to_string(p.M) +
                             " N=" + std::to_string(p.N) + " K=" + std::to_string(p.K);
    SCOPED_TRACE(what);
    const Tensor x = operand({p.M, p.K}, p.cd, 1), w = operand({p.N, p.K}, p.cd, 2), dy = operand({p.M, p.N}, p.cd, 3);
    Tensor acc = zeros({p.N, p.K}, p.gd), over = nan_filled({p.N, p.K}, p.gd);
    Tensor db_acc = zeros({p.N}, DType::kF32), db_over = zeros({p.N}, DType::kF32);
    Tensor dx_acc = nan_filled({p.M, p.K}, p.cd), dx_over = nan_filled({p.M, p.K}, p.cd);
    ops.matmul_backward(dx_acc, acc, db_acc, dy, x, w, GradWrite::kAccumulate);
    ops.matmul_backward(dx_over, over, db_over, dy, x, w, GradWrite::kOverwrite);
    expect_same_values(over, acc, "dweight");
    EXPECT_TRUE(test::same_bits(dx_over, dx_acc)) << "dinp does not depend on how dweight is written";
    EXPECT_TRUE(test::same_bits(db_over, db_acc)) << "dbias accumulates either way";
    // A second write adds to the stored gradient as to the accumulated one.
    ops.matmul_backward(TensorView(), over, TensorView(), dy, x, w, GradWrite::kAccumulate);
    ops.matmul_backward(TensorView(), acc, TensorView(), dy, x, w, GradWrite::kAccumulate);
    expect_same_values(over, acc, "dweight after a second, accumulating write");
  }
}

TEST(CpuGradWrite, EmptyProductStoresZerosOnlyWhenOverwriting) {
  const OpTable& ops = test::ops();
  for (DType cd : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(cd));
    const Tensor x = operand({0, 6}, cd, 1), w = operand({5, 6}, cd, 2), dy = operand({0, 5}, cd, 3);
    Tensor kept = test::filled({5, 6}, 2.5f), stored = nan_filled({5, 6}, DType::kF32);
    ops.matmul_backward(TensorView(), kept, TensorView(), dy, x, w, GradWrite::kAccumulate);
    ops.matmul_backward(TensorView(), stored, TensorView(), dy, x, w, GradWrite::kOverwrite);
    expect_same_values(kept, test::filled({5, 6}, 2.5f), "kAccumulate over no rows");
    expect_same_values(stored, zeros({5, 6}, DType::kF32), "kOverwrite over no rows");
  }
}

// Groups of 0, 5, 40 and 137 rows: f32 pieces, and bf16 groups padded to their cached row counts.
TEST(CpuGradWrite, GroupedOverwriteIsAccumulateIntoZeros) {
  const OpTable& ops = test::ops();
  const std::vector<int64_t> sizes = {5, 0, 137, 40};
  const int64_t M = 182, N = 48, K = 36, G = 4;
  for (DType cd : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(cd));
    const Tensor x = operand({M, K}, cd, 4), w = operand({G, N, K}, cd, 5), dy = operand({M, N}, cd, 6);
    Tensor acc = zeros({G, N, K}, DType::kF32), over = nan_filled({G, N, K}, DType::kF32);
    Tensor dx_acc = Tensor::empty({M, K}, cd), dx_over = Tensor::empty({M, K}, cd);
    ops.grouped_matmul_backward(dx_acc, acc, dy, x, w, sizes, GradWrite::kAccumulate);
    ops.grouped_matmul_backward(dx_over, over, dy, x, w, sizes, GradWrite::kOverwrite);
    expect_same_values(over, acc, "dweight (the empty group's slice zero)");
    EXPECT_TRUE(test::same_bits(dx_over, dx_acc)) << "dinp does not depend on how dweight is written";
    // The empty group under kAccumulate keeps what its slice held.
    Tensor kept = test::filled({G, N, K}, 0.75f);
    ops.grouped_matmul_backward(TensorView(), kept, dy, x, w, sizes, GradWrite::kAccumulate);
    for (int64_t i = N * K; i < 2 * N * K; ++i) ASSERT_EQ(kept.data<float>()[i], 0.75f) << "element " << i;
  }
}

}  // namespace
}  // namespace loom
