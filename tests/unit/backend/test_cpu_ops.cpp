// CPU reference ops: embedding (with and without position_ids), layernorm (+ fused residual), cross-entropy. Each
// op is compared with a plain f64 loop written here, on odd shapes; backward ops are checked against central finite
// differences of the f64 forward for the objective L = sum(out * R) (R random), with gradient buffers
// pre-filled with nonzero values to pin down accumulate (+=) versus overwrite (=). Ops with reductions
// are run with 1, 2 and 3 OpenMP threads and must agree bit for bit.
// Tolerances are absolute + relative against the f64 value and are stated at each check.
#include <functional>
#include <string>

#include "cpu_test_util.h"

namespace loom::test {
namespace {

// ---- embedding -------------------------------------------------------------------------------------

struct EmbCase {
  int64_t B, T, C, V;
};

Tensor random_tokens(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  Tensor t = Tensor::empty({B, T}, DType::kI32);
  std::mt19937_64 g(seed);
  for (int64_t i = 0; i < B * T; ++i) t.data<int32_t>()[i] = int32_t(g() % uint64_t(V));
  return t;
}

TEST(CpuEmbedding, ForwardMatchesReferenceExactly) {
  for (EmbCase k : {EmbCase{1, 1, 1, 3}, EmbCase{2, 5, 5, 7}, EmbCase{3, 17, 217, 11}, EmbCase{1, 217, 5, 50}}) {
    const int64_t maxpos = k.T + 3;
    Tensor tok = random_tokens(k.B, k.T, k.V, 1);
    Tensor wte = uniform_tensor({k.V, k.C}, 2), wpe = uniform_tensor({maxpos, k.C}, 3);
    Tensor out = filled({k.B, k.T, k.C}, 99.0f), out_nopos = filled({k.B, k.T, k.C}, 99.0f);
    ops().embedding_forward(out, tok, wte, wpe);
    ops().embedding_forward(out_nopos, tok, wte, TensorView());
    for (int64_t b = 0; b < k.B; ++b)
      for (int64_t t = 0; t < k.T; ++t)
        for (int64_t c = 0; c < k.C; ++c) {
          const int64_t i = (b * k.T + t) * k.C + c;
          const int32_t id = tok.data<int32_t>()[b * k.T + t];
          const double te = wte.data<float>()[id * k.C + c], pe = wpe.data<float>()[t * k.C + c];
          // A sum of two floats rounded once: the f32 op must equal the rounded f64 sum exactly.
          ASSERT_EQ(out.data<float>()[i], float(te + pe)) << "B" << k.B << " T" << k.T << " C" << k.C;
          ASSERT_EQ(out_nopos.data<float>()[i], float(te));
        }
  }
}

TEST(CpuEmbedding, BackwardAccumulatesScatterAndMatchesFiniteDifferences) {
  for (EmbCase k : {EmbCase{1, 1, 1, 3}, EmbCase{2, 5, 5, 4}, EmbCase{3, 17, 217, 6}}) {
    const int64_t maxpos = k.T + 2;
    Tensor tok = random_tokens(k.B, k.T, k.V, 4);  // V small: most ids repeat
    Tensor wte = uniform_tensor({k.V, k.C}, 5), wpe = uniform_tensor({maxpos, k.C}, 6);
    Tensor R = uniform_tensor({k.B, k.T, k.C}, 7);
    Tensor dwte = uniform_tensor({k.V, k.C}, 8), dwpe = uniform_tensor({maxpos, k.C}, 9);  // nonzero: += check
    const std::vector<double> dwte0 = to_f64(dwte), dwpe0 = to_f64(dwpe);
    ops().embedding_backward(dwte, dwpe, R, tok);

    std::vector<double> te = to_f64(wte), pe = to_f64(wpe);
    const int32_t* ids = tok.data<int32_t>();
    const float* r = R.data<float>();
    auto objective = [&]() {  // L = sum(out * R), out from the f64 forward
      double L = 0;
      for (int64_t i = 0; i < k.B * k.T; ++i)
        for (int64_t c = 0; c < k.C; ++c) L += (te[ids[i] * k.C + c] + pe[(i % k.T) * k.C + c]) * r[i * k.C + c];
      return L;
    };
    std::vector<double> want_te = dwte0, want_pe = dwpe0;
    for (size_t j = 0; j < te.size(); ++j) want_te[j] += central_diff(te[j], objective);
    for (size_t j = 0; j < pe.size(); ++j) want_pe[j] += central_diff(pe[j], objective);
    // Sums of up to B*T values in [-1, 1] in f32 plus the pre-fill: 1e-5 absolute is ~100 ulps of 1.
    expect_close(dwte, want_te, 1e-5, 1e-6, "dwte");
    expect_close(dwpe, want_pe, 1e-5, 1e-6, "dwpe");
  }
}

TEST(CpuEmbedding, BackwardIsThreadCountIndependent) {
  const int64_t B = 4, T = 97, C = 217, V = 13;
  Tensor tok = random_tokens(B, T, V, 10);
  Tensor dout = uniform_tensor({B, T, C}, 11);
  Tensor dwte0 = uniform_tensor({V, C}, 12), dwpe0 = uniform_tensor({T, C}, 13);
  std::vector<Tensor> te, pe;
  for (int threads : {1, 2, 3}) {
    te.push_back(clone(dwte0));
    pe.push_back(clone(dwpe0));
    with_threads(threads, [&] { ops().embedding_backward(te.back(), pe.back(), dout, tok); });
  }
  for (size_t i = 1; i < te.size(); ++i) {
    EXPECT_TRUE(same_bits(te[0], te[i])) << "dwte differs with " << i + 1 << " threads";
    EXPECT_TRUE(same_bits(pe[0], pe[i])) << "dwpe differs with " << i + 1 << " threads";
  }
  EXPECT_FALSE(same_bits(te[0], dwte0));  // the op did write something
}

TEST(CpuEmbedding, RejectsOutOfRangeTokensAndTooLongSequences) {
  Tensor tok = random_tokens(1, 4, 5, 14);
  Tensor wte = uniform_tensor({5, 3}, 15), wpe = uniform_tensor({3, 3}, 16), out = filled({1, 4, 3}, 0);
  EXPECT_THROW(ops().embedding_forward(out, tok, wte, wpe), Error);  // T = 4 > 3 positions
  tok.data<int32_t>()[2] = 5;
  EXPECT_THROW(ops().embedding_forward(out, tok, wte, TensorView()), Error);
  tok.data<int32_t>()[2] = -1;
  EXPECT_THROW(ops().embedding_backward(wte, TensorView(), out, tok), Error);
}

// ---- embedding with position_ids (Megatron's --reset-position-ids) ------------------------------------

// Position ids that restart at 0 at random document boundaries (so rows of wpe repeat within a batch row),
// with the first row's boundaries at 1 and 2 (a one-token document) when T allows.
Tensor reset_position_ids(int64_t B, int64_t T, uint64_t seed) {
  Tensor t = Tensor::empty({B, T}, DType::kI32);
  std::mt19937_64 g(seed);
  for (int64_t b = 0; b < B; ++b) {
    int32_t p = 0;
    for (int64_t i = 0; i < T; ++i) {
      const bool boundary = i > 0 && ((b == 0 && (i == 1 || i == 2)) || g() % 4 == 0);
      p = boundary ? 0 : p + (i > 0);
      t.data<int32_t>()[b * T + i] = p;
    }
  }
  return t;
}

TEST(CpuEmbedding, PositionIdsForwardMatchesReferenceExactly) {
  for (EmbCase k : {EmbCase{1, 1, 1, 3}, EmbCase{2, 5, 5, 7}, EmbCase{3, 17, 217, 11}, EmbCase{2, 217, 5, 50}}) {
    const int64_t maxpos = k.T;  // ids stay below T
    Tensor tok = random_tokens(k.B, k.T, k.V, 21), pid = reset_position_ids(k.B, k.T, 22);
    Tensor wte = uniform_tensor({k.V, k.C}, 23), wpe = uniform_tensor({maxpos, k.C}, 24);
    Tensor out = filled({k.B, k.T, k.C}, 99.0f);
    ops().embedding_forward(out, tok, wte, wpe, pid);
    for (int64_t i = 0; i < k.B * k.T; ++i)
      for (int64_t c = 0; c < k.C; ++c) {
        const int32_t id = tok.data<int32_t>()[i], pos = pid.data<int32_t>()[i];
        const double te = wte.data<float>()[id * k.C + c], pe = wpe.data<float>()[pos * k.C + c];
        ASSERT_EQ(out.data<float>()[i * k.C + c], float(te + pe)) << "B" << k.B << " T" << k.T << " C" << k.C;
      }
  }
}

// A sequence longer than the table is fine when the ids fit it: only the ids are checked.
TEST(CpuEmbedding, PositionIdsMayExceedTheTableLengthInT) {
  const int64_t B = 2, T = 9, C = 4, V = 5, maxpos = 3;
  Tensor tok = random_tokens(B, T, V, 25), pid = Tensor::empty({B, T}, DType::kI32);
  for (int64_t i = 0; i < B * T; ++i) pid.data<int32_t>()[i] = int32_t(i % maxpos);
  Tensor wte = uniform_tensor({V, C}, 26), wpe = uniform_tensor({maxpos, C}, 27), out = filled({B, T, C}, 0);
  ops().embedding_forward(out, tok, wte, wpe, pid);
  EXPECT_EQ(out.data<float>()[(1 * T + 4) * C + 2],
            wte.data<float>()[tok.data<int32_t>()[T + 4] * C + 2] + wpe.data<float>()[((T + 4) % maxpos) * C + 2]);
}

// Repeated positions accumulate: dwpe[p] += sum of dout over every token whose id is p, on top of the
// pre-filled gradient, against an f64 scatter; dwte is unaffected by the position ids.
TEST(CpuEmbedding, PositionIdsBackwardAccumulatesRepeatedPositions) {
  for (EmbCase k : {EmbCase{1, 1, 1, 3}, EmbCase{2, 5, 5, 4}, EmbCase{3, 17, 217, 6}, EmbCase{4, 97, 70, 9}}) {
    const int64_t maxpos = k.T + 1;
    Tensor tok = random_tokens(k.B, k.T, k.V, 31), pid = reset_position_ids(k.B, k.T, 32);
    Tensor R = uniform_tensor({k.B, k.T, k.C}, 33);
    Tensor dwte = uniform_tensor({k.V, k.C}, 34), dwpe = uniform_tensor({maxpos, k.C}, 35);
    Tensor dwte_nopid = clone(dwte), dwpe_unused = clone(dwpe);
    std::vector<double> want_te = to_f64(dwte), want_pe = to_f64(dwpe);
    ops().embedding_backward(dwte, dwpe, R, tok, pid);
    ops().embedding_backward(dwte_nopid, TensorView(), R, tok);
    const int32_t* ids = tok.data<int32_t>();
    const int32_t* pos = pid.data<int32_t>();
    const float* r = R.data<float>();
    for (int64_t i = 0; i < k.B * k.T; ++i)
      for (int64_t c = 0; c < k.C; ++c) {
        want_te[size_t(ids[i] * k.C + c)] += r[i * k.C + c];
        want_pe[size_t(pos[i] * k.C + c)] += r[i * k.C + c];
      }
    // Sums of up to B*T values in [-1, 1] in f32 plus the pre-fill.
    expect_close(dwte, want_te, 1e-5, 1e-6, "dwte");
    expect_close(dwpe, want_pe, 1e-5, 1e-6, "dwpe");
    EXPECT_TRUE(same_bits(dwte, dwte_nopid));
    if (k.T > 2) {  // position 0 is shared by several tokens here: the gradient really summed them
      int shared = 0;
      for (int64_t i = 0; i < k.B * k.T; ++i) shared += pos[i] == 0;
      EXPECT_GT(shared, k.B);
    }
  }
}

// position_ids = t gives the same bits as no position_ids, forward and backward.
TEST(CpuEmbedding, IdentityPositionIdsGiveTheSameBitsAsNone) {
  const int64_t B = 3, T = 37, C = 217, V = 9;
  Tensor tok = random_tokens(B, T, V, 41), pid = Tensor::empty({B, T}, DType::kI32);
  for (int64_t i = 0; i < B * T; ++i) pid.data<int32_t>()[i] = int32_t(i % T);
  Tensor wte = uniform_tensor({V, C}, 42), wpe = uniform_tensor({T, C}, 43), dout = uniform_tensor({B, T, C}, 44);
  Tensor a = filled({B, T, C}, 0), b = filled({B, T, C}, 1);
  ops().embedding_forward(a, tok, wte, wpe);
  ops().embedding_forward(b, tok, wte, wpe, pid);
  EXPECT_TRUE(same_bits(a, b));
  Tensor te_a = uniform_tensor({V, C}, 45), pe_a = uniform_tensor({T, C}, 46);
  Tensor te_b = clone(te_a), pe_b = clone(pe_a);
  ops().embedding_backward(te_a, pe_a, dout, tok);
  ops().embedding_backward(te_b, pe_b, dout, tok, pid);
  EXPECT_TRUE(same_bits(te_a, te_b));
  EXPECT_TRUE(same_bits(pe_a, pe_b));
}

TEST(CpuEmbedding, PositionIdsBackwardIsThreadCountIndependent) {
  const int64_t B = 4, T = 97, C = 217, V = 13;
  Tensor tok = random_tokens(B, T, V, 51), pid = reset_position_ids(B, T, 52);
  Tensor dout = uniform_tensor({B, T, C}, 53);
  Tensor dwte0 = uniform_tensor({V, C}, 54), dwpe0 = uniform_tensor({T, C}, 55);
  std::vector<Tensor> te, pe;
  for (int threads : {1, 2, 3}) {
    te.push_back(clone(dwte0));
    pe.push_back(clone(dwpe0));
    with_threads(threads, [&] { ops().embedding_backward(te.back(), pe.back(), dout, tok, pid); });
  }
  for (size_t i = 1; i < te.size(); ++i) {
    EXPECT_TRUE(same_bits(te[0], te[i])) << "dwte differs with " << i + 1 << " threads";
    EXPECT_TRUE(same_bits(pe[0], pe[i])) << "dwpe differs with " << i + 1 << " threads";
  }
  EXPECT_FALSE(same_bits(pe[0], dwpe0));
}

// Out-of-range, mis-shaped or mistyped ids are rejected before anything is written.
TEST(CpuEmbedding, RejectsBadPositionIdsBeforeWriting) {
  const int64_t B = 2, T = 4, C = 3, V = 5, maxpos = 4;
  Tensor tok = random_tokens(B, T, V, 61), pid = reset_position_ids(B, T, 62);
  Tensor wte = uniform_tensor({V, C}, 63), wpe = uniform_tensor({maxpos, C}, 64);
  Tensor out = filled({B, T, C}, 7.0f), dout = uniform_tensor({B, T, C}, 65);
  Tensor dwte = filled({V, C}, 0.5f), dwpe = filled({maxpos, C}, 0.5f);
  const Tensor out0 = clone(out), dwte0 = clone(dwte), dwpe0 = clone(dwpe);
  EXPECT_NO_THROW(ops().embedding_forward(out, tok, wte, wpe, pid));
  out = clone(out0);
  for (int32_t bad : {int32_t(maxpos), -1, 1 << 30}) {
    pid.data<int32_t>()[B * T - 1] = bad;  // the last token: the check must cover every id before any work
    EXPECT_THROW(ops().embedding_forward(out, tok, wte, wpe, pid), Error) << bad;
    EXPECT_THROW(ops().embedding_backward(dwte, dwpe, dout, tok, pid), Error) << bad;
  }
  EXPECT_TRUE(same_bits(out, out0));
  EXPECT_TRUE(same_bits(dwte, dwte0));
  EXPECT_TRUE(same_bits(dwpe, dwpe0));
  try {
    ops().embedding_forward(out, tok, wte, wpe, pid);
    ADD_FAILURE() << "position id 2^30 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("position id"), std::string::npos) << e.what();
  }
  Tensor wrong_shape = Tensor::zeros({B * T}, DType::kI32), wrong_dtype = Tensor::zeros({B, T}, DType::kF32);
  EXPECT_THROW(ops().embedding_forward(out, tok, wte, wpe, wrong_shape), Error);
  EXPECT_THROW(ops().embedding_forward(out, tok, wte, wpe, wrong_dtype), Error);
  EXPECT_THROW(ops().embedding_backward(dwte, dwpe, dout, tok, wrong_shape), Error);
}

// ---- layernorm -------------------------------------------------------------------------------------

constexpr float kEps = 1e-5f;

struct LnRef {
  std::vector<double> out, mean, rstd;
};

LnRef layernorm_ref(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b, int64_t N,
                    int64_t C) {
  LnRef r;
  r.out.resize(size_t(N * C));
  for (int64_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += x[n * C + c];
    m /= double(C);
    for (int64_t c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    v /= double(C);
    const double s = 1.0 / std::sqrt(v + double(kEps));
    for (int64_t c = 0; c < C; ++c) r.out[n * C + c] = (x[n * C + c] - m) * s * w[c] + b[c];
    r.mean.push_back(m);
    r.rstd.push_back(s);
  }
  return r;
}

const int64_t kOddSizes[] = {1, 5, 217};

TEST(CpuLayerNorm, ForwardMatchesReference) {
  for (int64_t N : kOddSizes)
    for (int64_t C : kOddSizes) {
      Tensor x = uniform_tensor({N, C}, 20, 1.0f, 3.0f);  // offset mean: exercises the centred variance
      Tensor w = uniform_tensor({C}, 21, 0.5f, 1.5f), b = uniform_tensor({C}, 22);
      Tensor out = filled({N, C}, 7), mean = filled({N}, 7), rstd = filled({N}, 7);
      ops().layernorm_forward(out, mean, rstd, x, w, b, kEps);
      const LnRef ref = layernorm_ref(to_f64(x), to_f64(w), to_f64(b), N, C);
      const std::string tag = " N" + std::to_string(N) + " C" + std::to_string(C);
      // f32 statistics over <= 217 values: a few ulps; rstd reaches 316 for C = 1 (var 0), hence relative.
      expect_close(mean, ref.mean, 1e-6, 1e-6, "mean" + tag);
      expect_close(rstd, ref.rstd, 0, 1e-5, "rstd" + tag);
      expect_close(out, ref.out, 1e-5, 1e-5, "out" + tag);
    }
}

TEST(CpuLayerNorm, ForwardIsAlignmentIndependentAndStatsAreOptional) {
  // A recomputed forward may run on differently aligned buffers: results must not change by a bit.
  const int64_t N = 9, C = 53;
  Tensor x = uniform_tensor({N, C}, 23), w = uniform_tensor({C}, 24), b = uniform_tensor({C}, 25);
  Tensor out = filled({N, C}, 0), mean = filled({N}, 0), rstd = filled({N}, 0);
  ops().layernorm_forward(out, mean, rstd, x, w, b, kEps);
  Tensor big = filled({N * C + 1}, 0), big_out = filled({N * C + 1}, 0);
  std::memcpy(big.data<float>() + 1, x.data<float>(), size_t(x.nbytes()));
  TensorView x_shift = big.view().slice_flat(1, {N, C}), out_shift = big_out.view().slice_flat(1, {N, C});
  ops().layernorm_forward(out_shift, TensorView(), TensorView(), x_shift, w, b, kEps);
  EXPECT_EQ(std::memcmp(out_shift.raw(), out.raw(), size_t(out.nbytes())), 0);
}

TEST(CpuLayerNorm, BackwardMatchesFiniteDifferencesAndAccumulates) {
  for (int64_t N : kOddSizes)
    for (int64_t C : kOddSizes) {
      Tensor x = uniform_tensor({N, C}, 30, -1.0f, 2.0f);
      Tensor w = uniform_tensor({C}, 31, 0.5f, 1.5f), b = uniform_tensor({C}, 32);
      Tensor R = uniform_tensor({N, C}, 33);
      Tensor out = filled({N, C}, 0), mean = filled({N}, 0), rstd = filled({N}, 0);
      ops().layernorm_forward(out, mean, rstd, x, w, b, kEps);
      Tensor dx = uniform_tensor({N, C}, 34), dw = uniform_tensor({C}, 35), db = uniform_tensor({C}, 36);
      std::vector<double> want_dx = to_f64(dx), want_dw = to_f64(dw), want_db = to_f64(db);
      ops().layernorm_backward(dx, dw, db, R, x, w, mean, rstd);

      std::vector<double> xd = to_f64(x), wd = to_f64(w), bd = to_f64(b);
      const std::vector<double> r = to_f64(R);
      int64_t row = 0;  // the objective over one row: perturbing x[row, :] changes only that row
      auto row_objective = [&]() {
        std::vector<double> xr(xd.begin() + row * C, xd.begin() + (row + 1) * C);
        const LnRef o = layernorm_ref(xr, wd, bd, 1, C);
        double L = 0;
        for (int64_t c = 0; c < C; ++c) L += o.out[c] * r[row * C + c];
        return L;
      };
      auto objective = [&]() {
        const LnRef o = layernorm_ref(xd, wd, bd, N, C);
        double L = 0;
        for (size_t i = 0; i < o.out.size(); ++i) L += o.out[i] * r[i];
        return L;
      };
      for (row = 0; row < N; ++row)
        for (int64_t c = 0; c < C; ++c) want_dx[row * C + c] += central_diff(xd[row * C + c], row_objective);
      for (int64_t c = 0; c < C; ++c) {
        want_dw[c] += central_diff(wd[c], objective);
        want_db[c] += central_diff(bd[c], objective);
      }
      const std::string tag = " N" + std::to_string(N) + " C" + std::to_string(C);
      // dinp: f32 row reductions over <= 217 terms, magnitudes ~rstd ~2: 2e-5 abs + 1e-4 rel.
      expect_close(dx, want_dx, 2e-5, 1e-4, "dinp" + tag);
      // dweight/dbias: sums over <= 217 rows of O(1) terms: 1e-4 abs + 1e-5 rel.
      expect_close(dw, want_dw, 1e-4, 1e-5, "dweight" + tag);
      expect_close(db, want_db, 1e-4, 1e-5, "dbias" + tag);
    }
}

TEST(CpuLayerNorm, BackwardOptionalOutputsGiveTheSameBits) {
  const int64_t N = 70, C = 33;  // two row blocks
  Tensor x = uniform_tensor({N, C}, 40), w = uniform_tensor({C}, 41), b = uniform_tensor({C}, 42);
  Tensor R = uniform_tensor({N, C}, 43), out = filled({N, C}, 0), mean = filled({N}, 0), rstd = filled({N}, 0);
  ops().layernorm_forward(out, mean, rstd, x, w, b, kEps);
  Tensor dx = uniform_tensor({N, C}, 44), dw = uniform_tensor({C}, 45), db = uniform_tensor({C}, 46);
  Tensor dx2 = clone(dx), dw2 = clone(dw), db2 = clone(db);
  ops().layernorm_backward(dx, dw, db, R, x, w, mean, rstd);
  ops().layernorm_backward(dx2, TensorView(), TensorView(), R, x, w, mean, rstd);
  ops().layernorm_backward(TensorView(), dw2, TensorView(), R, x, w, mean, rstd);
  ops().layernorm_backward(TensorView(), TensorView(), db2, R, x, w, mean, rstd);
  EXPECT_TRUE(same_bits(dx, dx2));
  EXPECT_TRUE(same_bits(dw, dw2));
  EXPECT_TRUE(same_bits(db, db2));
}

TEST(CpuLayerNorm, ForwardAndBackwardAreThreadCountIndependent) {
  const int64_t N = 517, C = 217;  // 9 row blocks, the last one partial
  Tensor x = uniform_tensor({N, C}, 50), w = uniform_tensor({C}, 51), b = uniform_tensor({C}, 52);
  Tensor R = uniform_tensor({N, C}, 53);
  Tensor dx0 = uniform_tensor({N, C}, 54), dw0 = uniform_tensor({C}, 55), db0 = uniform_tensor({C}, 56);
  std::vector<Tensor> outs, dxs, dws, dbs;
  for (int threads : {1, 2, 3}) {
    Tensor out = filled({N, C}, 0), mean = filled({N}, 0), rstd = filled({N}, 0);
    Tensor dx = clone(dx0), dw = clone(dw0), db = clone(db0);
    with_threads(threads, [&] {
      ops().layernorm_forward(out, mean, rstd, x, w, b, kEps);
      ops().layernorm_backward(dx, dw, db, R, x, w, mean, rstd);
    });
    outs.push_back(out);
    dxs.push_back(dx);
    dws.push_back(dw);
    dbs.push_back(db);
  }
  for (size_t i = 1; i < outs.size(); ++i) {
    EXPECT_TRUE(same_bits(outs[0], outs[i])) << i + 1 << " threads";
    EXPECT_TRUE(same_bits(dxs[0], dxs[i])) << i + 1 << " threads";
    EXPECT_TRUE(same_bits(dws[0], dws[i])) << i + 1 << " threads";
    EXPECT_TRUE(same_bits(dbs[0], dbs[i])) << i + 1 << " threads";
  }
}

TEST(CpuLayerNorm, FusedResidualEqualsResidualThenLayerNormBitwise) {
  for (int64_t N : kOddSizes)
    for (int64_t C : kOddSizes) {
      Tensor a = uniform_tensor({N, C}, 60), bb = uniform_tensor({N, C}, 61);
      Tensor w = uniform_tensor({C}, 62), b = uniform_tensor({C}, 63);
      Tensor res = filled({N, C}, 5), out = filled({N, C}, 5), mean = filled({N}, 5), rstd = filled({N}, 5);
      ops().residual_layernorm_forward(res, out, mean, rstd, a, bb, w, b, kEps);
      Tensor res2 = filled({N, C}, 6), out2 = filled({N, C}, 6), mean2 = filled({N}, 6), rstd2 = filled({N}, 6);
      ops().residual_forward(res2, a, bb);
      ops().layernorm_forward(out2, mean2, rstd2, res2, w, b, kEps);
      EXPECT_TRUE(same_bits(res, res2));
      EXPECT_TRUE(same_bits(out, out2));
      EXPECT_TRUE(same_bits(mean, mean2));
      EXPECT_TRUE(same_bits(rstd, rstd2));
      for (int64_t i = 0; i < N * C; ++i) ASSERT_EQ(res.data<float>()[i], a.data<float>()[i] + bb.data<float>()[i]);
    }
  // In place on the residual stream (residual aliases a), as the transformer block uses it.
  const int64_t N = 5, C = 217;
  Tensor a = uniform_tensor({N, C}, 64), bb = uniform_tensor({N, C}, 65), w = uniform_tensor({C}, 66);
  Tensor want_res = filled({N, C}, 0), want_out = filled({N, C}, 0), out = filled({N, C}, 0);
  ops().residual_forward(want_res, a, bb);
  ops().layernorm_forward(want_out, TensorView(), TensorView(), want_res, w, TensorView(), kEps);
  ops().residual_layernorm_forward(a, out, TensorView(), TensorView(), a, bb, w, TensorView(), kEps);
  EXPECT_TRUE(same_bits(a, want_res));
  EXPECT_TRUE(same_bits(out, want_out));
}

// ---- cross-entropy -----------------------------------------------------------------------------------

struct CeRef {
  std::vector<double> loss, dlogits;
};

CeRef cross_entropy_ref(const std::vector<double>& x, const int32_t* tgt, const float* mask, int64_t N, int64_t V,
                        int64_t Vp, double scale) {
  CeRef r;
  r.dlogits.assign(size_t(N * Vp), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const double* row = x.data() + n * Vp;
    double mx = -INFINITY, s = 0;
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, row[j]);
    for (int64_t j = 0; j < V; ++j) s += std::exp(row[j] - mx);
    const double m = mask ? mask[n] : 1.0;
    const bool valid = tgt[n] >= 0 && tgt[n] < V;
    r.loss.push_back(valid ? mx + std::log(s) - row[tgt[n]] : 0.0);
    if (!valid) continue;
    for (int64_t j = 0; j < V; ++j)
      r.dlogits[n * Vp + j] = (std::exp(row[j] - mx) / s - (j == tgt[n] ? 1.0 : 0.0)) * scale * m;
  }
  return r;
}

Tensor random_targets(int64_t N, int64_t V, uint64_t seed) {
  Tensor t = Tensor::empty({N}, DType::kI32);
  std::mt19937_64 g(seed);
  for (int64_t i = 0; i < N; ++i) t.data<int32_t>()[i] = int32_t(g() % uint64_t(V));
  return t;
}

// Logits in [-8, 8] with padded columns holding huge values that must be ignored.
Tensor random_logits(int64_t N, int64_t V, int64_t Vp, uint64_t seed) {
  Tensor t = uniform_tensor({N, Vp}, seed, -8.0f, 8.0f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = V; j < Vp; ++j) t.data<float>()[n * Vp + j] = 1e30f;
  return t;
}

TEST(CpuCrossEntropy, MatchesReferenceWithPaddingAndMask) {
  for (int64_t N : kOddSizes)
    for (int64_t V : kOddSizes) {
      const int64_t Vp = V + 3;
      const float scale = 0.37f;
      Tensor logits = random_logits(N, V, Vp, 70);
      Tensor tgt = random_targets(N, V, 71);
      Tensor mask = uniform_tensor({N}, 72, 0.0f, 1.0f);
      mask.data<float>()[0] = 0.0f;  // a masked-out row: zero gradient, loss still reported
      const CeRef ref = cross_entropy_ref(to_f64(logits), tgt.data<int32_t>(), mask.data<float>(), N, V, Vp, scale);
      Tensor loss = filled({N}, 9);
      ops().cross_entropy_forward_backward(loss, logits, tgt, V, mask, scale);
      const std::string tag = " N" + std::to_string(N) + " V" + std::to_string(V);
      // Loss: log-sum-exp with fast_exp (~2 ulp) and block sums in f64: 2e-6 abs + 1e-6 rel.
      expect_close(loss, ref.loss, 2e-6, 1e-6, "loss" + tag);
      // dlogits: softmax * scale, |value| <= 0.37: 1e-7 abs + 1e-6 rel (exp ulps); padding must be 0.
      expect_close(logits, ref.dlogits, 1e-7, 1e-6, "dlogits" + tag);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = V; j < Vp; ++j) ASSERT_EQ(logits.data<float>()[n * Vp + j], 0.0f);
    }
}

TEST(CpuCrossEntropy, GradientMatchesFiniteDifferencesOfTheMaskedScaledLoss) {
  const int64_t N = 5, V = 217, Vp = 224;
  const double scale = 0.2;
  Tensor logits = random_logits(N, V, Vp, 73), tgt = random_targets(N, V, 74);
  Tensor mask = uniform_tensor({N}, 75, 0.0f, 2.0f);
  std::vector<double> x = to_f64(logits);
  Tensor loss = filled({N}, 0);
  ops().cross_entropy_forward_backward(loss, logits, tgt, V, mask, float(scale));
  auto objective = [&]() {  // L = scale * sum_n mask_n * loss_n
    const CeRef r = cross_entropy_ref(x, tgt.data<int32_t>(), nullptr, N, V, Vp, 1.0);
    double L = 0;
    for (int64_t n = 0; n < N; ++n) L += scale * mask.data<float>()[n] * r.loss[size_t(n)];
    return L;
  };
  std::vector<double> want(size_t(N * Vp), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < V; ++j) want[n * Vp + j] = central_diff(x[n * Vp + j], objective);
  expect_close(logits, want, 2e-7, 1e-5, "dlogits vs finite differences");  // FD error ~1e-9
}

TEST(CpuCrossEntropy, ForwardOnlyLeavesLogitsUntouchedAndGivesTheSameLoss) {
  const int64_t N = 7, V = 1000, Vp = 1024;
  Tensor logits = random_logits(N, V, Vp, 76), tgt = random_targets(N, V, 77);
  Tensor copy = clone(logits), loss_fwd = filled({N}, 0), loss_bwd = filled({N}, 0);
  ops().cross_entropy_forward_backward(loss_fwd, logits, tgt, V, TensorView(), 0.0f);
  EXPECT_TRUE(same_bits(logits, copy));
  ops().cross_entropy_forward_backward(loss_bwd, copy, tgt, V, TensorView(), 1.0f);
  EXPECT_TRUE(same_bits(loss_fwd, loss_bwd));
  EXPECT_FALSE(same_bits(logits, copy));
}

TEST(CpuCrossEntropy, Gpt2VocabularyAccuracyAndExtremeLogits) {
  const int64_t N = 3, V = 50257, Vp = 50304;
  Tensor logits = random_logits(N, V, Vp, 78);
  float* x = logits.data<float>();
  for (int64_t j = 0; j < V; ++j) x[Vp + j] *= 40.0f;  // row 1: logits up to +-320, exp would overflow
  x[2 * Vp + 5] = 60.0f;                               // row 2: one dominant logit
  Tensor tgt = random_targets(N, V, 79);
  tgt.data<int32_t>()[2] = 5;
  const CeRef ref = cross_entropy_ref(to_f64(logits), tgt.data<int32_t>(), nullptr, N, V, Vp, 1.0 / N);
  Tensor loss = filled({N}, 0);
  ops().cross_entropy_forward_backward(loss, logits, tgt, V, TensorView(), float(1.0 / N));
  expect_close(loss, ref.loss, 5e-6, 1e-6, "loss");  // |loss| up to ~600 in row 1
  expect_close(logits, ref.dlogits, 1e-8, 1e-5, "dlogits");
  double row_sum = 0;  // softmax - onehot sums to 0 in each row
  for (int64_t j = 0; j < Vp; ++j) row_sum += x[j];
  EXPECT_NEAR(row_sum, 0.0, 1e-6);
}

TEST(CpuCrossEntropy, MaskedRowsMayHoldInvalidTargetsOthersMayNot) {
  const int64_t N = 4, V = 5, Vp = 8;
  Tensor logits = random_logits(N, V, Vp, 80), tgt = random_targets(N, V, 81), mask = filled({N}, 1.0f);
  tgt.data<int32_t>()[1] = -1;
  mask.data<float>()[1] = 0.0f;
  Tensor loss = filled({N}, 9);
  Tensor bad = clone(logits);
  ops().cross_entropy_forward_backward(loss, logits, tgt, V, mask, 1.0f);
  EXPECT_EQ(loss.data<float>()[1], 0.0f);
  for (int64_t j = 0; j < Vp; ++j) EXPECT_EQ(logits.data<float>()[Vp + j], 0.0f);
  EXPECT_GT(loss.data<float>()[0], 0.0f);
  EXPECT_THROW(ops().cross_entropy_forward_backward(loss, bad, tgt, V, TensorView(), 1.0f), Error);
  EXPECT_THROW(ops().cross_entropy_forward_backward(loss, bad, tgt, Vp + 1, TensorView(), 1.0f), Error);
}

TEST(CpuCrossEntropy, IsThreadCountIndependent) {
  const int64_t N = 64, V = 1001, Vp = 1008;
  Tensor logits0 = random_logits(N, V, Vp, 82), tgt = random_targets(N, V, 83);
  std::vector<Tensor> xs, ls;
  for (int threads : {1, 2, 3}) {
    xs.push_back(clone(logits0));
    ls.push_back(filled({N}, 0));
    with_threads(threads,
                 [&] { ops().cross_entropy_forward_backward(ls.back(), xs.back(), tgt, V, TensorView(), 1.0f / N); });
  }
  for (size_t i = 1; i < xs.size(); ++i) {
    EXPECT_TRUE(same_bits(xs[0], xs[i]));
    EXPECT_TRUE(same_bits(ls[0], ls[i]));
  }
}

}  // namespace
}  // namespace loom::test
