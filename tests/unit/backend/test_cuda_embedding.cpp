// CUDA embedding launchers (src/backend/cuda/embedding.cu) against the CPU reference on identical inputs.
// Both sides add in f32 in the same order (token order per gradient row) and round once, so results must be
// the same bits: forward and backward on odd shapes (B x T 1x1, 2x5, 3x217; C 1, 5, 64, 217, 771), every
// compute dtype, gradients in f32 and in the compute dtype, wpe present / absent, position_ids given /
// absent, a small vocabulary (many repeats) and a batch of one repeated id, pre-filled dwte / dwpe (they
// must ACCUMULATE), misaligned views (scalar path), run-to-run determinism, shape errors, and the device
// flag raised by out-of-range ids. Skipped without a GPU.
#if defined(LOOM_HAVE_CUDA)
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

#include "backend/cuda/embedding.cuh"
#include "cuda_test_util.h"
#include "loom/core/check.h"

namespace loom::test {
namespace {

const DType kDts[] = {DType::kF32, DType::kBF16, DType::kF16};
const int64_t kCs[] = {1, 5, 64, 217, 771};
struct BT {
  int64_t B, T;
};
const BT kBTs[] = {{1, 1}, {2, 5}, {3, 217}};

const cuda::CudaContext& ctx() { return cuda_ctx(); }

// Short names for the helpers of cuda_test_util.h; offset > 0 gives misaligned views.
Tensor dev(const Tensor& h, int64_t offset = 0) { return to_device_at(h, offset); }
Tensor dev_empty(Shape s, DType dt, int64_t offset = 0) { return device_empty_at(s, dt, offset); }

// i32 ids in [0, limit) (all equal to `only` when only >= 0).
Tensor random_ids(Shape s, int64_t limit, uint64_t seed, int32_t only = -1) {
  Tensor t = Tensor::empty(s, DType::kI32);
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int32_t> d(0, int32_t(limit - 1));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = only >= 0 ? only : d(g);
  return t;
}

struct EmbCase {
  DType dt;
  int64_t B, T, C, V;
  bool with_wpe, with_pos_ids;
  int64_t offset = 0;   // element offset of the float views (1: scalar path)
  int32_t only = -1;    // every token this id
  DType gdt = DType::kF32;
};

std::string case_tag(const char* op, const EmbCase& k) {
  return std::string(op) + " " + dtype_name(k.dt) + " B" + std::to_string(k.B) + " T" + std::to_string(k.T) + " C" +
         std::to_string(k.C) + " V" + std::to_string(k.V) + (k.with_wpe ? " wpe" : "") +
         (k.with_pos_ids ? " pos_ids" : "") + (k.offset ? " unaligned" : "") + (k.only >= 0 ? " one-id" : "") +
         " grads " + dtype_name(k.gdt);
}

void check_forward(const EmbCase& k, uint64_t seed) {
  const std::string t = case_tag("embedding_forward", k);
  const int64_t maxpos = k.T + 3;
  Tensor tokens = random_ids({k.B, k.T}, k.V, seed, k.only);
  Tensor pos = k.with_pos_ids ? random_ids({k.B, k.T}, maxpos, seed + 1) : Tensor();
  Tensor wte = random_host({k.V, k.C}, k.dt, seed + 2);
  Tensor wpe = k.with_wpe ? random_host({maxpos, k.C}, k.dt, seed + 3) : Tensor();
  Tensor out = Tensor::empty({k.B, k.T, k.C}, k.dt);
  cpu_ref().embedding_forward(out, tokens, wte, wpe, pos);

  Tensor gtok = dev(tokens), gpos = pos.defined() ? dev(pos) : Tensor();
  Tensor gwte = dev(wte, k.offset), gwpe = wpe.defined() ? dev(wpe, k.offset) : Tensor();
  Tensor first;
  for (int run = 0; run < 2; ++run) {
    Tensor gout = dev_empty({k.B, k.T, k.C}, k.dt, k.offset);
    cuda::embedding_forward(ctx(), gout, gtok, gwte, gwpe, gpos);
    Tensor got = to_host(gout);
    if (run == 0) {
      EXPECT_TRUE(same_bytes(got, out)) << t;
      if (!same_bytes(got, out)) expect_close(got, out, 0.0f, t);  // reports the worst element
      first = got;
    } else {
      EXPECT_TRUE(same_bytes(got, first)) << t << " run-to-run";
    }
  }
}

void check_backward(const EmbCase& k, uint64_t seed) {
  const std::string t = case_tag("embedding_backward", k);
  const int64_t maxpos = k.T + 3;
  Tensor tokens = random_ids({k.B, k.T}, k.V, seed, k.only);
  Tensor pos = k.with_pos_ids ? random_ids({k.B, k.T}, maxpos, seed + 1) : Tensor();
  Tensor dout = random_host({k.B, k.T, k.C}, k.dt, seed + 2);
  // Pre-filled gradients: the op must add to them.
  const Tensor dwte0 = random_host({k.V, k.C}, k.gdt, seed + 3, -2.0f, 2.0f);
  const Tensor dwpe0 = k.with_wpe ? random_host({maxpos, k.C}, k.gdt, seed + 4, -2.0f, 2.0f) : Tensor();
  Tensor dwte = host_clone(dwte0), dwpe = dwpe0.defined() ? host_clone(dwpe0) : Tensor();
  cpu_ref().embedding_backward(dwte, dwpe, dout, tokens, pos);

  Tensor gtok = dev(tokens), gpos = pos.defined() ? dev(pos) : Tensor(), gdout = dev(dout, k.offset);
  Tensor first_te, first_pe;
  for (int run = 0; run < 2; ++run) {
    Tensor gdwte = dev(dwte0, k.offset), gdwpe = dwpe0.defined() ? dev(dwpe0, k.offset) : Tensor();
    cuda::embedding_backward(ctx(), gdwte, gdwpe, gdout, gtok, gpos);
    Tensor te = to_host(gdwte), pe = gdwpe.defined() ? to_host(gdwpe) : Tensor();
    if (run == 0) {
      EXPECT_TRUE(same_bytes(te, dwte)) << t << " dwte";
      if (!same_bytes(te, dwte)) expect_close(te, dwte, 0.0f, t + " dwte");
      if (pe.defined()) {
        EXPECT_TRUE(same_bytes(pe, dwpe)) << t << " dwpe";
        if (!same_bytes(pe, dwpe)) expect_close(pe, dwpe, 0.0f, t + " dwpe");
      }
      first_te = te;
      first_pe = pe;
    } else {
      EXPECT_TRUE(same_bytes(te, first_te)) << t << " dwte run-to-run";
      if (pe.defined()) {
        EXPECT_TRUE(same_bytes(pe, first_pe)) << t << " dwpe run-to-run";
      }
    }
  }
}

TEST(CudaEmbedding, ForwardMatchesCpuBitForBit) {
  REQUIRE_GPU();
  uint64_t seed = 10;
  for (DType dt : kDts)
    for (const BT& bt : kBTs)
      for (int64_t C : kCs)
        for (int variant = 0; variant < 3; ++variant) {
          // 0: wpe, positions t; 1: wpe with position_ids; 2: no wpe (position_ids ignored).
          EmbCase k{dt, bt.B, bt.T, C, 37, variant != 2, variant >= 1};
          check_forward(k, seed += 10);
        }
  // Misaligned views take the scalar path; the same bits.
  for (DType dt : kDts)
    for (int64_t C : {int64_t(64), int64_t(771)}) {
      EmbCase k{dt, 3, 217, C, 37, true, true};
      k.offset = 1;
      check_forward(k, seed += 10);
      k.with_wpe = false;
      check_forward(k, seed += 10);
    }
}

TEST(CudaEmbedding, BackwardMatchesCpuBitForBit) {
  REQUIRE_GPU();
  uint64_t seed = 5000;
  for (DType dt : kDts)
    for (const BT& bt : kBTs)
      for (int64_t C : kCs)
        for (int variant = 0; variant < 3; ++variant) {
          EmbCase k{dt, bt.B, bt.T, C, 37, variant != 2, variant >= 1};
          k.gdt = (variant + C) % 2 ? DType::kF32 : dt;  // both gradient dtypes across the cases
          check_backward(k, seed += 10);
        }
  // Many duplicates: a vocabulary of 3, and every token the same id (one run of 651 rows).
  for (DType dt : kDts)
    for (DType gdt : {DType::kF32, dt}) {
      EmbCase k{dt, 3, 217, 64, 3, true, false};
      k.gdt = gdt;
      check_backward(k, seed += 10);
      k.only = 1;
      check_backward(k, seed += 10);
      k.with_pos_ids = true;
      check_backward(k, seed += 10);
      k.C = 771;
      k.offset = 1;
      check_backward(k, seed += 10);
    }
  // A larger vocabulary than tokens (most rows untouched) with misaligned views.
  for (DType dt : kDts) {
    EmbCase k{dt, 2, 217, 217, 1000, true, true};
    k.offset = 1;
    check_backward(k, seed += 10);
  }
}

TEST(CudaEmbedding, BadShapesThrow) {
  REQUIRE_GPU();
  cuda::embedding_take_error(ctx());  // a flag left by another test must not leak into the check below
  const DType f = DType::kF32;
  Tensor tokens = dev(random_ids({2, 5}, 10, 1));
  Tensor wte = dev_empty({10, 8}, f), wpe = dev_empty({5, 8}, f), out = dev_empty({2, 5, 8}, f);
  EXPECT_NO_THROW(cuda_ops().embedding_forward(out, tokens, wte, wpe, Tensor()));
  EXPECT_THROW(cuda_ops().embedding_forward(dev_empty({2, 5, 7}, f), tokens, wte, wpe, Tensor()), Error);
  EXPECT_THROW(cuda_ops().embedding_forward(out, tokens, wte, dev_empty({5, 7}, f), Tensor()), Error);
  EXPECT_THROW(cuda_ops().embedding_forward(out, tokens, wte, dev_empty({4, 8}, f), Tensor()), Error);  // T > maxpos
  EXPECT_THROW(cuda_ops().embedding_forward(out, dev_empty({2, 5}, f), wte, wpe, Tensor()), Error);  // f32 tokens
  EXPECT_THROW(cuda_ops().embedding_forward(out, tokens, wte, wpe, dev_empty({5, 2}, DType::kI32)), Error);
  EXPECT_THROW(cuda_ops().embedding_forward(dev_empty({2, 5, 8}, DType::kBF16), tokens, wte, wpe, Tensor()), Error);
  EXPECT_THROW(cuda_ops().embedding_forward(out, Tensor::empty({2, 5}, DType::kI32), wte, wpe, Tensor()), Error);
  EXPECT_THROW(cuda_ops().embedding_backward(wte, wpe, dev_empty({2, 5, 9}, f), tokens, Tensor()), Error);
  EXPECT_THROW(cuda_ops().embedding_backward(dev_empty({10, 8}, DType::kBF16), wpe,
                                            dev_empty({2, 5, 8}, DType::kF16), tokens, Tensor()),
               Error);  // gradient neither f32 nor the compute dtype
  // With position ids, maxpos may be shorter than T (the ids are checked on the device instead).
  Tensor ids = dev(random_ids({2, 5}, 3, 2));
  EXPECT_NO_THROW(cuda_ops().embedding_forward(out, tokens, wte, dev_empty({3, 8}, f), ids));
  EXPECT_FALSE(cuda::embedding_take_error(ctx()));
}

TEST(CudaEmbedding, OutOfRangeIdsRaiseTheDeviceFlag) {
  REQUIRE_GPU();
  const DType f = DType::kF32;
  cuda::embedding_take_error(ctx());  // clears anything an earlier test left
  Tensor tok_h = random_ids({2, 5}, 10, 3);
  tok_h.data<int32_t>()[7] = 10;  // == V: out of range
  Tensor tokens = dev(tok_h);
  Tensor wte = dev(random_host({10, 8}, f, 4)), out = dev_empty({2, 5, 8}, f);
  cuda::embedding_forward(ctx(), out, tokens, wte, Tensor(), Tensor());
  Tensor got = to_host(out);
  for (int64_t c = 0; c < 8; ++c) EXPECT_TRUE(std::isnan(got.data<float>()[7 * 8 + c])) << "bad row not NaN, c " << c;
  EXPECT_FALSE(std::isnan(got.data<float>()[6 * 8]));
  EXPECT_TRUE(cuda::embedding_take_error(ctx()));
  EXPECT_FALSE(cuda::embedding_take_error(ctx()));  // cleared

  // Backward skips the bad id (the other rows still accumulate) and raises the flag.
  Tensor dwte = dev(Tensor::zeros({10, 8}, f));
  cuda::embedding_backward(ctx(), dwte, Tensor(), dev(random_host({2, 5, 8}, f, 5)), tokens, Tensor());
  EXPECT_TRUE(cuda::embedding_take_error(ctx()));

  // A negative position id with wpe.
  Tensor pos_h = random_ids({2, 5}, 5, 6);
  pos_h.data<int32_t>()[2] = -1;
  Tensor good_tokens = dev(random_ids({2, 5}, 10, 7));
  cuda::embedding_forward(ctx(), out, good_tokens, wte, dev(random_host({5, 8}, f, 8)), dev(pos_h));
  EXPECT_TRUE(cuda::embedding_take_error(ctx()));
  cuda::embedding_forward(ctx(), out, good_tokens, wte, Tensor(), dev(pos_h));  // ids unused without wpe
  EXPECT_FALSE(cuda::embedding_take_error(ctx()));
}

}  // namespace
}  // namespace loom::test
#endif  // LOOM_HAVE_CUDA
