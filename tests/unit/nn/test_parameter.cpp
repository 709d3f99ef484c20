// ParameterSet layout, initialisation and mixed-precision buffers; modules reading the compute copy.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <omp.h>

#include "loom/nn/modules.h"

using namespace loom;

TEST(ParameterSet, ContiguousLayoutAndViews) {
  auto ctx = make_cpu_context();
  ParameterSet ps;
  Linear lin(ps, "mlp.linear_fc1", 3, 5, true, 0.02f);
  LayerNorm ln(ps, "ln", 5, 1e-5f);
  ps.allocate(*ctx);
  ASSERT_EQ(ps.all().size(), 4u);
  EXPECT_EQ(ps.numel(), 15 + 5 + 5 + 5);
  EXPECT_EQ(ps.find("mlp.linear_fc1.weight")->shape, Shape({5, 3}));
  EXPECT_EQ(ps.find("mlp.linear_fc1.bias")->offset, 15);
  EXPECT_TRUE(ps.find("mlp.linear_fc1.bias")->no_weight_decay);
  EXPECT_FALSE(ps.find("mlp.linear_fc1.weight")->no_weight_decay);
  EXPECT_TRUE(ps.find("ln.weight")->no_weight_decay);
  EXPECT_EQ(ps.find("ln.weight")->value.raw(), static_cast<float*>(ps.values().raw()) + 20);
  EXPECT_EQ(ps.find("ln.bias")->grad.raw(), static_cast<float*>(ps.grads().raw()) + 25);
  EXPECT_THROW(ps.add("x", {1}, InitKind::kZeros, 0, true), Error);  // after allocate
}

// find() is a hash lookup, so declaring a model is O(parameters): 300,000 declarations, each checked for
// a duplicate name, would be 4.5e10 string comparisons with the old linear scan (minutes; ctest times out).
// Copies keep their own index.
TEST(ParameterSet, FindIsALookupAndDuplicatesAreRefused) {
  ParameterSet ps;
  const int64_t n = 300000;
  for (int64_t i = 0; i < n; ++i) ps.add("layers." + std::to_string(i) + ".w", Shape{1}, InitKind::kZeros, 0, false);
  for (int64_t i = 0; i < n; i += 997) {
    const Parameter* p = ps.find("layers." + std::to_string(i) + ".w");
    ASSERT_NE(p, nullptr) << i;
    EXPECT_EQ(p->offset, i);
  }
  EXPECT_EQ(ps.find("layers.300000.w"), nullptr);
  try {
    ps.add("layers.17.w", Shape{2}, InitKind::kZeros, 0, false);
    ADD_FAILURE() << "a duplicate name was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("duplicate parameter name layers.17.w"), std::string::npos) << e.what();
  }
  const ParameterSet copy = ps;
  ASSERT_NE(copy.find("layers.5.w"), nullptr);
  EXPECT_EQ(copy.find("layers.5.w"), &copy.all()[5]);
}

TEST(ParameterSet, InitIsKeyedByNameNotOrderOrThreads) {
  auto ctx = make_cpu_context();
  ParameterSet a, b;
  a.add("w1", {64, 33}, InitKind::kNormal, 0.02f, false);
  a.add("w2", {7}, InitKind::kNormal, 0.5f, false);
  a.add("ones", {4}, InitKind::kOnes, 0, true);
  b.add("w2", {7}, InitKind::kNormal, 0.5f, false);  // other order
  b.add("w1", {64, 33}, InitKind::kNormal, 0.02f, false);
  a.allocate(*ctx);
  b.allocate(*ctx);
  omp_set_num_threads(1);
  a.initialize(1234);
  omp_set_num_threads(2);
  b.initialize(1234);
  for (const char* n : {"w1", "w2"}) {
    const Parameter& pa = *a.find(n);
    const Parameter& pb = *b.find(n);
    ASSERT_EQ(0, std::memcmp(pa.value.raw(), pb.value.raw(), size_t(pa.value.nbytes()))) << n;
  }
  // Statistics of the normal init.
  const Parameter& w1 = *a.find("w1");
  double s = 0, s2 = 0;
  for (int64_t i = 0; i < w1.value.numel(); ++i) {
    s += w1.value.data<float>()[i];
    s2 += double(w1.value.data<float>()[i]) * w1.value.data<float>()[i];
  }
  const double n = double(w1.value.numel()), mean = s / n, sd = std::sqrt(s2 / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.003);
  EXPECT_NEAR(sd, 0.02, 0.002);
  EXPECT_EQ(a.find("ones")->value.data<float>()[3], 1.0f);
  // Different seed -> different values.
  b.initialize(1235);
  EXPECT_NE(0, std::memcmp(w1.value.raw(), b.find("w1")->value.raw(), size_t(w1.value.nbytes())));
}

TEST(ParameterSet, ComputeCopyAndGradDtypes) {
  auto ctx = make_cpu_context();
  {  // f32: the compute copy is the master buffer itself.
    ParameterSet ps;
    Linear lin(ps, "fc", 4, 3, true, 0.02f);
    ps.allocate(*ctx);
    EXPECT_EQ(ps.compute_values().raw(), ps.values().raw());
    EXPECT_EQ(ps.find("fc.weight")->compute.raw(), ps.find("fc.weight")->value.raw());
    EXPECT_EQ(ps.compute_dtype(), DType::kF32);
    EXPECT_EQ(ps.values().nbytes() + ps.grads().nbytes(), 8 * ps.numel());  // no separate compute copy
  }
  ParameterSet ps;
  Linear lin(ps, "fc", 4, 3, true, 0.5f);
  LayerNorm ln(ps, "ln", 3, 1e-5f);
  ps.allocate(*ctx, DType::kF16, DType::kF16);
  EXPECT_EQ(ps.values().dtype(), DType::kF32);
  EXPECT_EQ(ps.compute_values().dtype(), DType::kF16);
  EXPECT_EQ(ps.grads().dtype(), DType::kF16);
  EXPECT_EQ(ps.values().nbytes() + ps.compute_values().nbytes() + ps.grads().nbytes(), 8 * ps.numel());
  const Parameter& b = *ps.find("fc.bias");
  EXPECT_EQ(b.compute.raw(), static_cast<uint16_t*>(ps.compute_values().raw()) + b.offset);
  EXPECT_EQ(b.grad.raw(), static_cast<uint16_t*>(ps.grads().raw()) + b.offset);
  ps.initialize(3);  // leaves the compute copy in sync
  const float* v = ps.values().data<float>();
  const uint16_t* c = ps.compute_values().data<uint16_t>();
  for (int64_t i = 0; i < ps.numel(); ++i) ASSERT_EQ(c[i], f32_to_f16(v[i])) << i;
  ps.values().data<float>()[0] = 1.0f + 1.0f / 4096.0f;  // a tie between two f16 values: rounds to even
  ps.sync_compute(*ctx);
  EXPECT_EQ(c[0], f32_to_f16(1.0f));
  EXPECT_THROW(ParameterSet().allocate(*ctx, DType::kBF16, DType::kF16), Error);
}

// Inference sets allocate no gradient buffer; values and the compute copy are laid out as usual.
TEST(ParameterSet, WithoutGrads) {
  auto ctx = make_cpu_context();
  ParameterSet ps;
  Linear lin(ps, "fc", 4, 3, true, 0.02f);
  ps.allocate(*ctx, DType::kBF16, DType::kF32, /*with_grads=*/false);
  EXPECT_FALSE(ps.grads().defined());
  EXPECT_FALSE(ps.find("fc.weight")->grad.defined());
  EXPECT_EQ(ps.compute_values().dtype(), DType::kBF16);
  ps.initialize(5);
  const ParameterSet& cps = ps;
  const Parameter* b = cps.find("fc.bias");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->compute.raw(), static_cast<const uint16_t*>(ps.compute_values().raw()) + b->offset);
  EXPECT_EQ(cps.find("fc.nothing"), nullptr);
  EXPECT_THROW(ps.zero_grads(*ctx), Error);
}

// A frozen set (a LoRA base): in 16 bits the compute copy is all there is (2 bytes per parameter, no f32
// values, no gradients); initialize() and write_value() give exactly the rounding a full set's
// sync_compute() gives. In f32 the values are the compute copy.
TEST(ParameterSet, FrozenHoldsTheComputeCopyOnly) {
  auto ctx = make_cpu_context();
  ParameterSet full, frozen;
  Linear a(full, "fc", 40, 30, true, 0.5f), b(frozen, "fc", 40, 30, true, 0.5f);
  full.allocate(*ctx, DType::kBF16, DType::kF32);
  frozen.allocate(*ctx, DType::kBF16, DType::kF32, /*with_grads=*/true, ParamStorage::kFrozen);
  EXPECT_FALSE(frozen.values().defined());
  EXPECT_FALSE(frozen.grads().defined());
  EXPECT_FALSE(frozen.find("fc.weight")->value.defined());
  EXPECT_EQ(frozen.compute_values().nbytes(), 2 * frozen.numel());
  full.initialize(9);
  frozen.initialize(9);
  ASSERT_EQ(0, std::memcmp(full.compute_values().raw(), frozen.compute_values().raw(),
                           size_t(full.compute_values().nbytes())));
  frozen.sync_compute(*ctx);  // nothing to sync from
  Tensor src = Tensor::empty({30}, DType::kF32);
  for (int i = 0; i < 30; ++i) src.data<float>()[i] = 1.0f + float(i) / 3.0f;
  frozen.write_value(*frozen.find("fc.bias"), src);
  std::memcpy(full.find("fc.bias")->value.raw(), src.raw(), 30 * sizeof(float));
  full.sync_compute(*ctx);
  EXPECT_EQ(0, std::memcmp(full.find("fc.bias")->compute.raw(), frozen.find("fc.bias")->compute.raw(), 60));
  EXPECT_THROW(frozen.write_value(*frozen.find("fc.bias"), Tensor::empty({29}, DType::kF32)), Error);
  ParameterSet f32;
  Linear c(f32, "fc", 4, 3, false, 0.5f);
  f32.allocate(*ctx, DType::kF32, DType::kF32, true, ParamStorage::kFrozen);
  EXPECT_EQ(f32.values().raw(), f32.compute_values().raw());
  EXPECT_FALSE(f32.grads().defined());
}

// Modules read the compute copy: a bf16 linear layer computes with the rounded weights, not the masters.
TEST(Modules, LinearReadsComputeCopy) {
  auto ctx = make_cpu_context();
  ParameterSet ps;
  Linear lin(ps, "fc", 2, 1, false, 0.02f);
  ps.allocate(*ctx, DType::kBF16, DType::kF32);
  float* w = ps.values().data<float>();
  w[0] = 1.0f + 1.0f / 256.0f;  // not representable in bf16; rounds (to even) to 1
  w[1] = 0.0f;
  ps.sync_compute(*ctx);
  Tensor x = Tensor::empty({1, 2}, DType::kBF16), y = Tensor::empty({1, 1}, DType::kBF16);
  x.data<uint16_t>()[0] = f32_to_bf16(1.0f);
  x.data<uint16_t>()[1] = f32_to_bf16(1.0f);
  lin.forward(*ctx, y, x);
  EXPECT_EQ(bf16_to_f32(y.data<uint16_t>()[0]), 1.0f);
  Tensor dy = Tensor::empty({1, 1}, DType::kBF16);
  dy.data<uint16_t>()[0] = f32_to_bf16(2.0f);
  lin.backward(*ctx, TensorView(), dy, x);
  EXPECT_EQ(ps.grads().data<float>()[0], 2.0f);  // f32 main grads accumulate
  lin.backward(*ctx, TensorView(), dy, x);
  EXPECT_EQ(ps.grads().data<float>()[1], 4.0f);
}

// A step's first write of a linear weight's gradient stores it (GradWrite::kOverwrite) once the gradients
// are marked as zero, later writes add; writers that always add (the embedding's scatter) clear the mark
// so that a matmul after them adds too; the LOOM_CHECK_GRAD_OVERWRITE check catches a marked gradient that
// does not hold zeros, naming the parameter.
TEST(ParameterSet, FirstWriteOfAStepStoresTheWeightGradient) {
  auto ctx = make_cpu_context();
  ParameterSet ps;
  Linear lin(ps, "fc", 4, 3, true, 0.5f);
  Embedding emb(ps, 6, 4, 0, 0.5f);
  ps.allocate(*ctx);
  ps.initialize(7);
  Tensor x = Tensor::empty({5, 4}, DType::kF32), dy = Tensor::empty({5, 3}, DType::kF32);
  Tensor dx = Tensor::empty({5, 4}, DType::kF32);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = 0.1f * float(i % 7) - 0.3f;
  for (int64_t i = 0; i < dy.numel(); ++i) dy.data<float>()[i] = 0.05f * float(i % 5) - 0.1f;
  Parameter& w = *ps.find("fc.weight");
  Parameter& b = *ps.find("fc.bias");
  auto grad_of = [](const Parameter& p) {
    return std::vector<float>(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  };
  // The reference: plain accumulation into zeroed gradients, twice.
  lin.backward(*ctx, dx, dy, x);
  const std::vector<float> once = grad_of(w), once_b = grad_of(b);
  lin.backward(*ctx, dx, dy, x);
  const std::vector<float> twice = grad_of(w);
  ps.zero_grads(*ctx);
  ps.mark_grads_zero();
  EXPECT_TRUE(w.grad_zero && b.grad_zero);
  lin.backward(*ctx, dx, dy, x);
  EXPECT_FALSE(w.grad_zero) << "the matmul took the mark";
  EXPECT_TRUE(b.grad_zero) << "the bias gradient (a column sum) always adds and leaves the mark";
  EXPECT_EQ(grad_of(w), once);
  EXPECT_EQ(grad_of(b), once_b);
  lin.backward(*ctx, dx, dy, x);
  EXPECT_EQ(grad_of(w), twice) << "the second write adds";

  // take_grad_write: kOverwrite once per mark; a group only when every member is marked.
  ps.zero_grads(*ctx);
  ps.mark_grads_zero();
  EXPECT_EQ(take_grad_write(*ctx, w), GradWrite::kOverwrite);
  EXPECT_EQ(take_grad_write(*ctx, w), GradWrite::kAccumulate);
  Parameter& wte = *ps.find("embedding.word_embeddings.weight");
  EXPECT_EQ(take_grad_write(*ctx, std::vector<Parameter*>{&w, &wte}), GradWrite::kAccumulate);
  EXPECT_FALSE(wte.grad_zero) << "a group's take clears every member's mark";

  // The embedding's scatter-add clears its weight's mark: a tied output layer after it must add.
  ps.mark_grads_zero();
  Tensor tokens = Tensor::empty({1, 2}, DType::kI32), demb = Tensor::empty({1, 2, 4}, DType::kF32);
  tokens.data<int32_t>()[0] = 1;
  tokens.data<int32_t>()[1] = 4;
  for (int64_t i = 0; i < demb.numel(); ++i) demb.data<float>()[i] = 1.0f;
  emb.backward(*ctx, demb, tokens, TensorView());
  EXPECT_FALSE(wte.grad_zero);
  EXPECT_EQ(take_grad_write(*ctx, wte), GradWrite::kAccumulate);

  // A parameter without a gradient bound (inference, ZeRO-2/3 outside its bucket's backward): nothing is
  // written, kAccumulate, and the mark stays.
  ParameterSet nograd;
  Linear lin2(nograd, "fc2", 4, 3, false, 0.5f);
  nograd.allocate(*ctx, DType::kF32, DType::kF32, /*with_grads=*/false);
  nograd.mark_grads_zero();
  Parameter& w2 = *nograd.find("fc2.weight");
  EXPECT_EQ(take_grad_write(*ctx, w2), GradWrite::kAccumulate);
  EXPECT_TRUE(w2.grad_zero);

  // The debugging check: a marked gradient that holds a non-zero fails, naming the parameter.
  const bool checks = grad_overwrite_checks();
  set_grad_overwrite_checks(true);
  w.grad_zero = true;
  w.grad.data<float>()[3] = 1.0f;
  try {
    take_grad_write(*ctx, w);
    ADD_FAILURE() << "a marked gradient holding a non-zero passed the check";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fc.weight"), std::string::npos) << e.what();
  }
  w.grad.data<float>()[3] = 0.0f;
  w.grad_zero = true;
  EXPECT_NO_THROW(take_grad_write(*ctx, w));
  set_grad_overwrite_checks(checks);
}
