// Mixed-precision (bf16 / f16) CPU ops. Each op runs on low-precision tensors and is compared with the f32 op
// run on the same values widened to f32 (the inputs are rounded to bf16/f16 first, so both see identical
// numbers). Unless stated otherwise the contract is EXACT: a bf16/f16 output must be the RNE rounding of the
// f32 op's output (the ops widen, run the f32 code and round once), and an f32 output (statistics, losses,
// f32 main grads) must equal the f32 op's bit for bit. The matmuls are the exception, with a bound derived
// at the check (oneDNN's bf16 kernels sum in another order than sgemm). References use the core scalar
// conversions of loom/core/dtype.h, never the code under test. Shapes are odd (1, 5, 217 rows; C not a
// multiple of 16) so every vector tail is exercised; reductions are rerun with 1, 2 and 3 threads.
#include <bit>
#include <functional>
#include <sstream>
#include <string>

#include "backend/cpu/lowp.h"
#include "cpu_test_util.h"

namespace loom::test {
namespace {

const DType kLowp[] = {DType::kBF16, DType::kF16};

// "bf16 N5 C217"-style labels (an ostringstream: GCC 12 warns falsely on "literal" + std::string chains).
template <typename... Args>
std::string name(DType dt, const Args&... parts) {
  std::ostringstream s;
  s << dtype_name(dt);
  ((s << ' ' << parts), ...);
  return s.str();
}

void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  EXPECT_TRUE(same_bits(got, want)) << what;
}

// ---- lowp.h codecs ----------------------------------------------------------------------------------

// Bit-equal, or both NaN (NaN payloads are not part of the widening contract).
bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

TEST(LowpCodec, WidenEveryPatternExactlyAtEveryTailLength) {
  for (DType dt : kLowp) {
    std::vector<uint16_t> src(65536 + 40);
    for (size_t i = 0; i < src.size(); ++i) src[i] = uint16_t(i);
    std::vector<float> dst(src.size(), 7.0f);
    cpu::with_lowp(dt, [&](auto L) { decltype(L)::widen(dst.data(), src.data(), 65536); });
    for (uint32_t i = 0; i < 65536; ++i) {
      const float want = decode(dt, uint16_t(i));
      ASSERT_TRUE(same_float(dst[i], want)) << dtype_name(dt) << " pattern " << i;
      const float scalar = dt == DType::kBF16 ? cpu::bf16_decode(uint16_t(i)) : cpu::f16_decode(uint16_t(i));
      ASSERT_TRUE(same_float(scalar, want)) << dtype_name(dt) << " scalar pattern " << i;
    }
    // Masked tails write exactly n elements and nothing past them.
    for (int64_t n = 0; n <= 40; ++n)
      for (int64_t off : {0, 1, 3}) {
        std::fill(dst.begin(), dst.end(), 7.0f);
        cpu::widen(dst.data(), src.data() + 0x3C00 + off, dt, n);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(dst[size_t(i)], decode(dt, uint16_t(0x3C00 + off + i)));
        ASSERT_EQ(dst[size_t(n)], 7.0f) << "wrote past n = " << n;
      }
  }
}

// Every representable value, the midpoints between neighbours (ties) and one f32 ulp either side, f32
// patterns around the bf16 rounding boundary, f32 subnormals, overflow boundaries, random bits, specials.
std::vector<float> hard_inputs(DType dt) {
  std::vector<float> v;
  for (uint32_t b = 0; b + 1 < 65536; ++b) {
    const float lo = decode(dt, uint16_t(b)), hi = decode(dt, uint16_t(b + 1));
    v.push_back(lo);
    if (!std::isfinite(lo) || !std::isfinite(hi) || std::signbit(lo) != std::signbit(hi)) continue;
    const float mid = float((double(lo) + double(hi)) / 2);
    v.push_back(mid);
    v.push_back(std::nextafter(mid, INFINITY));
    v.push_back(std::nextafter(mid, -INFINITY));
  }
  for (uint32_t hi = 0; hi < 65536; hi += 3)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, 0x1000u})
      v.push_back(std::bit_cast<float>((hi << 16) | lo));
  std::mt19937 g(5);
  for (int i = 0; i < 1 << 18; ++i) v.push_back(std::bit_cast<float>(uint32_t(g())));
  for (float s : {INFINITY, -INFINITY, NAN, -NAN, 0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e-40f,
                  -1e-45f, 3.0e38f, 3.4028235e38f, 5.96e-8f, 2.98e-8f, 2.9802322e-8f})
    v.push_back(s);
  v.push_back(std::bit_cast<float>(0x7F800001u));  // signalling NaN
  v.push_back(std::bit_cast<float>(0xFFC12345u));
  return v;
}

TEST(LowpCodec, NarrowMatchesTheCoreConversionsIncludingTiesSubnormalsAndNaN) {
  for (DType dt : kLowp) {
    const std::vector<float> in = hard_inputs(dt);
    const int64_t n = int64_t(in.size());
    std::vector<uint16_t> out(size_t(n) + 1, 0xABCD);
    cpu::narrow(out.data(), dt, in.data(), n - 1);  // n - 1: ends in a masked tail
    int64_t bad = 0;
    for (int64_t i = 0; i + 1 < n; ++i) {
      const uint16_t want = encode(dt, in[size_t(i)]);
      const uint16_t scalar = dt == DType::kBF16 ? cpu::bf16_encode(in[size_t(i)]) : cpu::f16_encode(in[size_t(i)]);
      if ((out[size_t(i)] != want || scalar != want) && bad++ < 5)
        ADD_FAILURE() << dtype_name(dt) << " input 0x" << std::hex << std::bit_cast<uint32_t>(in[size_t(i)])
                      << " vector 0x" << out[size_t(i)] << " scalar 0x" << scalar << " want 0x" << want;
    }
    EXPECT_EQ(bad, 0) << dtype_name(dt);
    EXPECT_EQ(out[size_t(n - 1)], 0xABCD) << "wrote past the end";
  }
}

// ---- elementwise ------------------------------------------------------------------------------------

const int64_t kSizes[] = {1, 5, 217, 70001};  // 70001: the parallel path with a tail

TEST(LowpElementwise, ResidualGeluAndBiasAddAreTheRoundedF32Results) {
  for (DType dt : kLowp)
    for (int64_t n : kSizes) {
      const std::string tag = name(dt, "n", n);
      Tensor a = lowp_uniform({n}, dt, 1, -6, 6), b = lowp_uniform({n}, dt, 2), dy = lowp_uniform({n}, dt, 3);
      const Tensor af = widened(a), bf = widened(b), dyf = widened(dy);
      Tensor out = Tensor::empty({n}, dt), want = filled({n}, 0);

      ops().residual_forward(out, a, b);
      ops().residual_forward(want, af, bf);
      expect_rounded(out, want, tag + " residual");

      ops().gelu_forward(out, a);
      ops().gelu_forward(want, af);
      expect_rounded(out, want, tag + " gelu");

      ops().gelu_backward(out, a, dy);
      ops().gelu_backward(want, af, dyf);
      expect_rounded(out, want, tag + " gelu'");
      Tensor dy_alias = clone(dy);
      ops().gelu_backward(dy_alias, a, dy_alias);  // dinp may alias dout
      expect_same_bits(dy_alias, out, tag + " gelu' aliased");

      ops().residual_forward(a, a, b);  // out may alias a
      ops().residual_forward(want, af, bf);
      expect_rounded(a, want, tag + " residual in place");
    }
}

TEST(LowpElementwise, BiasAddRoundsOncePerElementWithLowpOrF32Bias) {
  for (DType dt : kLowp)
    for (int64_t N : {1, 5, 217})
      for (int64_t C : {1, 5, 217, 1500}) {  // 1500: rows longer than one scratch chunk
        const std::string tag = name(dt, "N", N, "C", C);
        Tensor out = lowp_uniform({N, C}, dt, 4), bias = lowp_uniform({C}, dt, 5);
        Tensor want = widened(out);
        ops().bias_add_forward(want, widened(bias));
        Tensor got = clone(out);
        ops().bias_add_forward(got, bias);
        expect_rounded(got, want, tag);
        // An f32 bias (not representable in dt) is added in f32 and rounded once.
        Tensor bias32 = uniform_tensor({C}, 6);
        want = widened(out);
        ops().bias_add_forward(want, bias32);
        got = clone(out);
        ops().bias_add_forward(got, bias32);
        expect_rounded(got, want, tag + " f32 bias");
      }
}

TEST(LowpElementwise, BiasBackwardAccumulatesIntoF32OrLowpAndIsThreadCountIndependent) {
  for (DType dt : kLowp)
    for (int64_t N : {1, 5, 217, 1000})
      for (int64_t C : {1, 5, 217}) {
        const std::string tag = name(dt, "N", N, "C", C);
        Tensor dout = lowp_uniform({N, C}, dt, 7);
        // f32 main grad: bit-identical to the f32 op on the widened dout.
        Tensor db = uniform_tensor({C}, 8), want = clone(db);
        ops().bias_backward(db, dout);
        ops().bias_backward(want, widened(dout));
        expect_same_bits(db, want, tag + " f32 dbias");
        // Low-precision grad: old + column sums in f32, rounded once.
        Tensor db16 = lowp_uniform({C}, dt, 9);
        Tensor want16 = widened(db16);
        ops().bias_backward(db16, dout);
        ops().bias_backward(want16, widened(dout));
        expect_rounded(db16, want16, tag + " lowp dbias");
      }
  const int64_t N = 1000, C = 217;
  for (DType dt : kLowp) {
    Tensor dout = lowp_uniform({N, C}, dt, 10), db0 = lowp_uniform({C}, dt, 11);
    std::vector<Tensor> dbs;
    for (int threads : {1, 2, 3}) {
      dbs.push_back(clone(db0));
      with_threads(threads, [&] { ops().bias_backward(dbs.back(), dout); });
    }
    expect_same_bits(dbs[0], dbs[1], name(dt, "threads 1 vs 2"));
    expect_same_bits(dbs[0], dbs[2], name(dt, "threads 1 vs 3"));
  }
}

TEST(LowpElementwise, ScaleFillSumSquaresAndCastsOnLowp) {
  const int64_t n = 70001;
  for (DType dt : kLowp) {
    Tensor x = lowp_uniform({n}, dt, 12, -100, 100);
    Tensor xf = widened(x);
    // sum_squares widens exactly and keeps the f32 op's block order: the same double.
    EXPECT_EQ(ops().sum_squares(x), ops().sum_squares(xf)) << dtype_name(dt);
    ops().scale_(x, -0.37f);
    ops().scale_(xf, -0.37f);
    expect_rounded(x, xf, name(dt, "scale_"));
    ops().fill_(x, 0.1f);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits(x)[i], encode(dt, 0.1f));
    // f32 -> dt -> f32 through the vector casts agrees with the core conversions.
    Tensor src = uniform_tensor({n}, 13, -70000, 70000), lp = Tensor::empty({n}, dt), back = filled({n}, 0);
    ops().cast(lp, src);
    expect_rounded(lp, src, name(dt, "cast"));
    ops().cast(back, lp);
    expect_same_bits(back, widened(lp), name(dt, "cast back"));
  }
  EXPECT_THROW(ops().sum_squares(Tensor::empty({3}, DType::kI32)), Error);
}

TEST(LowpElementwise, HasInfOrNanOnBf16AndF16) {
  const int64_t n = 70001;
  for (DType dt : kLowp) {
    const float big = dt == DType::kBF16 ? 3.3895314e38f : 65504.0f;  // largest finite: not flagged
    for (int64_t pos : {int64_t(0), int64_t(17), n / 2, n - 1}) {
      for (float bad : {INFINITY, -INFINITY, NAN}) {
        Tensor x = lowp_uniform({n}, dt, 14);
        bits(x)[n / 3] = encode(dt, big);
        bits(x)[n / 3 + 1] = encode(dt, -big);
        EXPECT_FALSE(ops().has_inf_or_nan(x)) << dtype_name(dt);
        bits(x)[pos] = encode(dt, bad);
        EXPECT_TRUE(ops().has_inf_or_nan(x)) << dtype_name(dt) << " " << bad << " at " << pos;
      }
    }
    // A value that overflows f16 only.
    Tensor y = Tensor::empty({5}, dt);
    ops().cast(y, filled({5}, 1e5f));
    EXPECT_EQ(ops().has_inf_or_nan(y), dt == DType::kF16);
    // Small tensors take the serial path.
    Tensor one = Tensor::empty({1}, dt);
    bits(one)[0] = dt == DType::kBF16 ? 0x7FC1 : 0x7E01;  // NaNs with payload
    EXPECT_TRUE(ops().has_inf_or_nan(one));
  }
}

// ---- layernorm ----------------------------------------------------------------------------------------

struct LnCase {
  int64_t N, C;
};
const LnCase kLnCases[] = {{1, 5}, {5, 217}, {217, 5}, {217, 100}, {3, 1500}};

TEST(LowpLayerNorm, ForwardAndFusedResidualAreTheRoundedF32Results) {
  for (DType dt : kLowp)
    for (LnCase k : kLnCases) {
      const std::string tag = name(dt, "N", k.N, "C", k.C);
      Tensor x = lowp_uniform({k.N, k.C}, dt, 20, -3, 3), w = lowp_uniform({k.C}, dt, 21),
             b = lowp_uniform({k.C}, dt, 22);
      Tensor out = Tensor::empty({k.N, k.C}, dt), mean = filled({k.N}, 0), rstd = filled({k.N}, 0);
      Tensor want = filled({k.N, k.C}, 0), wmean = filled({k.N}, 0), wrstd = filled({k.N}, 0);
      ops().layernorm_forward(out, mean, rstd, x, w, b, 1e-5f);
      ops().layernorm_forward(want, wmean, wrstd, widened(x), widened(w), widened(b), 1e-5f);
      expect_rounded(out, want, tag + " out");
      expect_same_bits(mean, wmean, tag + " mean");
      expect_same_bits(rstd, wrstd, tag + " rstd");
      ops().layernorm_forward(out, TensorView(), TensorView(), x, w, TensorView(), 1e-5f);
      ops().layernorm_forward(want, TensorView(), TensorView(), widened(x), widened(w), TensorView(), 1e-5f);
      expect_rounded(out, want, tag + " out without bias");

      // Fused: the residual is a + b rounded, and the norm is that of the rounded residual, exactly as
      // residual_forward followed by layernorm_forward on the low-precision tensors.
      Tensor a = lowp_uniform({k.N, k.C}, dt, 23), bb = lowp_uniform({k.N, k.C}, dt, 24);
      Tensor res = Tensor::empty({k.N, k.C}, dt), res2 = Tensor::empty({k.N, k.C}, dt);
      Tensor out2 = Tensor::empty({k.N, k.C}, dt), mean2 = filled({k.N}, 0), rstd2 = filled({k.N}, 0);
      ops().residual_layernorm_forward(res, out, mean, rstd, a, bb, w, b, 1e-5f);
      ops().residual_forward(res2, a, bb);
      ops().layernorm_forward(out2, mean2, rstd2, res2, w, b, 1e-5f);
      expect_same_bits(res, res2, tag + " fused residual");
      expect_same_bits(out, out2, tag + " fused out");
      expect_same_bits(mean, mean2, tag + " fused mean");
      expect_same_bits(rstd, rstd2, tag + " fused rstd");
    }
}

TEST(LowpLayerNorm, BackwardAccumulatesDinpAndParamGradsInF32OrLowp) {
  for (DType dt : kLowp)
    for (LnCase k : kLnCases) {
      const std::string tag = name(dt, "N", k.N, "C", k.C);
      Tensor x = lowp_uniform({k.N, k.C}, dt, 30, -3, 3), w = lowp_uniform({k.C}, dt, 31),
             dy = lowp_uniform({k.N, k.C}, dt, 32);
      Tensor mean = filled({k.N}, 0), rstd = filled({k.N}, 0), out = Tensor::empty({k.N, k.C}, dt);
      ops().layernorm_forward(out, mean, rstd, x, w, TensorView(), 1e-5f);
      const Tensor xf = widened(x), wf = widened(w), dyf = widened(dy);

      // dinp (residual stream) accumulates; f32 main grads for dweight/dbias.
      Tensor dx = lowp_uniform({k.N, k.C}, dt, 33), dw = uniform_tensor({k.C}, 34), db = uniform_tensor({k.C}, 35);
      Tensor want_dx = widened(dx), want_dw = clone(dw), want_db = clone(db);
      ops().layernorm_backward(dx, dw, db, dy, x, w, mean, rstd);
      ops().layernorm_backward(want_dx, want_dw, want_db, dyf, xf, wf, mean, rstd);
      expect_rounded(dx, want_dx, tag + " dinp");
      expect_same_bits(dw, want_dw, tag + " f32 dweight");
      expect_same_bits(db, want_db, tag + " f32 dbias");

      // Low-precision parameter grads: old + update in f32, rounded once.
      Tensor dw16 = lowp_uniform({k.C}, dt, 36), db16 = lowp_uniform({k.C}, dt, 37);
      Tensor want_dw16 = widened(dw16), want_db16 = widened(db16);
      ops().layernorm_backward(TensorView(), dw16, db16, dy, x, w, mean, rstd);
      ops().layernorm_backward(TensorView(), want_dw16, want_db16, dyf, xf, wf, mean, rstd);
      expect_rounded(dw16, want_dw16, tag + " lowp dweight");
      expect_rounded(db16, want_db16, tag + " lowp dbias");
    }
}

TEST(LowpLayerNorm, BackwardIsThreadCountIndependent) {
  const int64_t N = 300, C = 217;
  for (DType dt : kLowp) {
    Tensor x = lowp_uniform({N, C}, dt, 40, -3, 3), w = lowp_uniform({C}, dt, 41), dy = lowp_uniform({N, C}, dt, 42);
    Tensor mean = filled({N}, 0), rstd = filled({N}, 0), out = Tensor::empty({N, C}, dt);
    ops().layernorm_forward(out, mean, rstd, x, w, TensorView(), 1e-5f);
    const Tensor dx0 = lowp_uniform({N, C}, dt, 43), dw0 = lowp_uniform({C}, dt, 44);
    std::vector<Tensor> dxs, dws;
    for (int threads : {1, 2, 3}) {
      dxs.push_back(clone(dx0));
      dws.push_back(clone(dw0));
      with_threads(threads, [&] {
        ops().layernorm_backward(dxs.back(), dws.back(), TensorView(), dy, x, w, mean, rstd);
      });
    }
    for (int i : {1, 2}) {
      expect_same_bits(dxs[0], dxs[size_t(i)], name(dt, "dinp threads"));
      expect_same_bits(dws[0], dws[size_t(i)], name(dt, "dweight threads"));
    }
  }
}

// ---- embedding ----------------------------------------------------------------------------------------

Tensor random_ids(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  Tensor t = Tensor::empty({B, T}, DType::kI32);
  std::mt19937_64 g(seed);
  for (int64_t i = 0; i < B * T; ++i) t.data<int32_t>()[i] = int32_t(g() % uint64_t(V));
  return t;
}

struct EmbCase {
  int64_t B, T, C, V;
};
const EmbCase kEmbCases[] = {{1, 1, 5, 3}, {1, 5, 217, 4}, {3, 17, 100, 6}, {2, 217, 5, 50}};

TEST(LowpEmbedding, ForwardIsTheRoundedF32Sum) {
  for (DType dt : kLowp)
    for (EmbCase k : kEmbCases) {
      const std::string tag = name(dt, "B", k.B, "T", k.T, "C", k.C);
      Tensor tok = random_ids(k.B, k.T, k.V, 50), pid = random_ids(k.B, k.T, k.T + 2, 51);
      Tensor wte = lowp_uniform({k.V, k.C}, dt, 52), wpe = lowp_uniform({k.T + 2, k.C}, dt, 53);
      Tensor out = Tensor::empty({k.B, k.T, k.C}, dt), want = filled({k.B, k.T, k.C}, 0);
      ops().embedding_forward(out, tok, wte, wpe);
      ops().embedding_forward(want, tok, widened(wte), widened(wpe));
      expect_rounded(out, want, tag + " with wpe");
      ops().embedding_forward(out, tok, wte, wpe, pid);
      ops().embedding_forward(want, tok, widened(wte), widened(wpe), pid);
      expect_rounded(out, want, tag + " with position_ids");
      ops().embedding_forward(out, tok, wte, TensorView());
      ops().embedding_forward(want, tok, widened(wte), TensorView());
      expect_rounded(out, want, tag + " without wpe");
    }
}

TEST(LowpEmbedding, BackwardAccumulatesIntoF32OrLowpGrads) {
  for (DType dt : kLowp)
    for (EmbCase k : kEmbCases)
      for (bool with_pid : {false, true}) {
        const std::string tag = name(dt, "B", k.B, "T", k.T, "C", k.C, with_pid ? "pid" : "");
        Tensor tok = random_ids(k.B, k.T, k.V, 60);  // V small: ids repeat
        Tensor pid = random_ids(k.B, k.T, 3, 61);     // positions repeat too
        TensorView pv = with_pid ? TensorView(pid) : TensorView();
        const int64_t maxpos = k.T + 2;
        Tensor dy = lowp_uniform({k.B, k.T, k.C}, dt, 62);
        const Tensor dyf = widened(dy);
        // f32 main grads: bit-identical to the f32 op on the widened dout.
        Tensor dwte = uniform_tensor({k.V, k.C}, 63), dwpe = uniform_tensor({maxpos, k.C}, 64);
        Tensor want_te = clone(dwte), want_pe = clone(dwpe);
        ops().embedding_backward(dwte, dwpe, dy, tok, pv);
        ops().embedding_backward(want_te, want_pe, dyf, tok, pv);
        expect_same_bits(dwte, want_te, tag + " f32 dwte");
        expect_same_bits(dwpe, want_pe, tag + " f32 dwpe");
        // Low-precision grads: each row's sum in token order in f32 from the old value, rounded once
        // (rows never hit keep their bits).
        Tensor dwte16 = lowp_uniform({k.V, k.C}, dt, 65), dwpe16 = lowp_uniform({maxpos, k.C}, dt, 66);
        Tensor want_te16 = widened(dwte16), want_pe16 = widened(dwpe16);
        ops().embedding_backward(dwte16, dwpe16, dy, tok, pv);
        ops().embedding_backward(want_te16, want_pe16, dyf, tok, pv);
        expect_rounded(dwte16, want_te16, tag + " lowp dwte");
        expect_rounded(dwpe16, want_pe16, tag + " lowp dwpe");
      }
}

TEST(LowpEmbedding, BackwardIsThreadCountIndependent) {
  const int64_t B = 4, T = 64, C = 217, V = 9;
  for (DType dt : kLowp) {
    Tensor tok = random_ids(B, T, V, 70), dy = lowp_uniform({B, T, C}, dt, 71);
    const Tensor te0 = lowp_uniform({V, C}, dt, 72), pe0 = uniform_tensor({T, C}, 73);
    std::vector<Tensor> tes, pes;
    for (int threads : {1, 2, 3}) {
      tes.push_back(clone(te0));
      pes.push_back(clone(pe0));
      with_threads(threads, [&] { ops().embedding_backward(tes.back(), pes.back(), dy, tok); });
    }
    for (int i : {1, 2}) {
      expect_same_bits(tes[0], tes[size_t(i)], name(dt, "dwte threads"));
      expect_same_bits(pes[0], pes[size_t(i)], name(dt, "dwpe threads"));
    }
  }
}

// ---- cross-entropy --------------------------------------------------------------------------------------

TEST(LowpCrossEntropy, LossesExactAndInPlaceDlogitsRounded) {
  for (DType dt : kLowp)
    for (int64_t N : {1, 5, 217})
      for (int64_t V : {5, 217, 3001}) {
        const int64_t Vp = V + 11;
        const std::string tag = name(dt, "N", N, "V", V);
        Tensor logits = lowp_uniform({N, Vp}, dt, 80, -8, 8);
        Tensor tgt = Tensor::empty({N}, DType::kI32), mask = filled({N}, 1.0f);
        std::mt19937_64 g(81);
        for (int64_t n = 0; n < N; ++n) {
          tgt.data<int32_t>()[n] = int32_t(g() % uint64_t(V));
          if (n % 3 == 1) mask.data<float>()[n] = 0.5f;
          if (n % 7 == 2) {
            mask.data<float>()[n] = 0.0f;
            tgt.data<int32_t>()[n] = -1;  // padding row
          }
        }
        const Tensor lf0 = widened(logits);
        // Forward only: losses exact, logits untouched.
        Tensor loss = filled({N}, 0), want_loss = filled({N}, 0), lf = clone(lf0), before = clone(logits);
        ops().cross_entropy_forward_backward(loss, logits, tgt, V, mask, 0.0f);
        ops().cross_entropy_forward_backward(want_loss, lf, tgt, V, mask, 0.0f);
        expect_same_bits(loss, want_loss, tag + " forward losses");
        expect_same_bits(logits, before, tag + " forward leaves logits");
        // Forward + backward in place.
        ops().cross_entropy_forward_backward(loss, logits, tgt, V, mask, 1.0f / float(N));
        ops().cross_entropy_forward_backward(want_loss, lf, tgt, V, mask, 1.0f / float(N));
        expect_same_bits(loss, want_loss, tag + " losses");
        expect_rounded(logits, lf, tag + " dlogits");
      }
}

// ---- matmul ---------------------------------------------------------------------------------------------

// |got - want| <= ulp(want) in dt (0 for f32 outputs) + err[i]: want is the f32 op's result, err bounds the
// difference of two f32 summation orders of the same products (see the caller).
void expect_within(const Tensor& got, const Tensor& want, const std::vector<double>& err, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double w = want.data<float>()[i];
    double g, ulp = 0;
    if (got.dtype() == DType::kF32) {
      g = got.data<float>()[i];
    } else {
      g = decode(got.dtype(), bits(got)[i]);
      const int mant = got.dtype() == DType::kBF16 ? 8 : 11;  // significand bits
      const double a = std::max(std::fabs(w), got.dtype() == DType::kBF16 ? 1.2e-38 : 6.1e-5);
      ulp = std::ldexp(1.0, std::ilogb(a) - (mant - 1));
    }
    if (!(std::fabs(g - w) <= ulp + err[size_t(i)]) && bad++ < 3)
      ADD_FAILURE() << what << ": element " << i << " got " << g << " want " << w << " (ulp " << ulp << ", err "
                    << err[size_t(i)] << ")";
  }
  EXPECT_EQ(bad, 0) << what;
}

Tensor abs_of(const Tensor& x) {
  Tensor y = clone(x);
  for (int64_t i = 0; i < y.numel(); ++i) y.data<float>()[i] = std::fabs(y.data<float>()[i]);
  return y;
}

// Two f32 sums of the same K products (plus one more term) each differ from the exact sum by at most
// K * 2^-24 * sum|terms| (standard bound, first order): twice that bounds their difference. The sum of
// |terms| comes from the f32 op on absolute values (itself accurate to far better than a factor of 2).
std::vector<double> order_bound(const Tensor& abs_sum, int64_t K) {
  std::vector<double> e(size_t(abs_sum.numel()));
  for (int64_t i = 0; i < abs_sum.numel(); ++i)
    e[size_t(i)] = 4.0 * double(K + 2) * std::ldexp(1.0, -24) * abs_sum.data<float>()[i] + 1e-30;
  return e;
}

struct MmCase {
  int64_t M, K, N;
};

void check_matmul(DType dt, MmCase k, uint64_t seed) {
  const std::string tag = name(dt, "MxKxN", k.M, k.K, k.N);
  Tensor x = lowp_uniform({k.M, k.K}, dt, seed), w = lowp_uniform({k.N, k.K}, dt, seed + 1),
         b = lowp_uniform({k.N}, dt, seed + 2), dy = lowp_uniform({k.M, k.N}, dt, seed + 3);
  const Tensor xf = widened(x), wf = widened(w), bf = widened(b), dyf = widened(dy);

  // forward: out = x W^T + b, in dt and in f32.
  Tensor want = filled({k.M, k.N}, 0), absum = filled({k.M, k.N}, 0);
  ops().matmul_forward(want, xf, wf, bf);
  ops().matmul_forward(absum, abs_of(xf), abs_of(wf), abs_of(bf));
  const std::vector<double> e_fwd = order_bound(absum, k.K);
  Tensor out = Tensor::empty({k.M, k.N}, dt), out32 = filled({k.M, k.N}, 0);
  ops().matmul_forward(out, x, w, b);
  expect_within(out, want, e_fwd, tag + " forward");
  ops().matmul_forward(out32, x, w, b);
  expect_within(out32, want, e_fwd, tag + " forward f32 out");
  ops().matmul_forward(out32, x, w, TensorView());
  ops().matmul_forward(want, xf, wf, TensorView());
  expect_within(out32, want, e_fwd, tag + " forward without bias");

  // dinp = dout W (overwrite), in dt and in f32.
  Tensor want_dx = filled({k.M, k.K}, 0), abs_dx = filled({k.M, k.K}, 0);
  ops().matmul_backward(want_dx, TensorView(), TensorView(), dyf, xf, wf);
  ops().matmul_backward(abs_dx, TensorView(), TensorView(), abs_of(dyf), xf, abs_of(wf));
  const std::vector<double> e_dx = order_bound(abs_dx, k.N);
  Tensor dx = lowp_uniform({k.M, k.K}, dt, seed + 4), dx32 = uniform_tensor({k.M, k.K}, seed + 5);
  ops().matmul_backward(dx, TensorView(), TensorView(), dy, x, w);
  expect_within(dx, want_dx, e_dx, tag + " dinp");
  ops().matmul_backward(dx32, TensorView(), TensorView(), dy, x, w);
  expect_within(dx32, want_dx, e_dx, tag + " dinp f32");

  // dweight += dout^T x and dbias += colsum(dout): f32 main grads (pre-filled) and dt grads.
  Tensor dw = uniform_tensor({k.N, k.K}, seed + 6), db = uniform_tensor({k.N}, seed + 7);
  Tensor want_dw = clone(dw), want_db = clone(db), abs_dw = abs_of(dw), unused = filled({k.M, k.K}, 0);
  ops().matmul_backward(TensorView(), want_dw, want_db, dyf, xf, wf);
  ops().matmul_backward(TensorView(), abs_dw, TensorView(), abs_of(dyf), abs_of(xf), wf);
  const std::vector<double> e_dw = order_bound(abs_dw, k.M);
  ops().matmul_backward(TensorView(), dw, db, dy, x, w);
  expect_within(dw, want_dw, e_dw, tag + " f32 dweight");
  expect_same_bits(db, want_db, tag + " f32 dbias (bias_backward: exact)");

  Tensor dw16 = lowp_uniform({k.N, k.K}, dt, seed + 8), db16 = lowp_uniform({k.N}, dt, seed + 9);
  want_dw = widened(dw16);
  want_db = widened(db16);
  abs_dw = abs_of(want_dw);
  ops().matmul_backward(TensorView(), want_dw, want_db, dyf, xf, wf);
  ops().matmul_backward(TensorView(), abs_dw, TensorView(), abs_of(dyf), abs_of(xf), wf);
  ops().matmul_backward(TensorView(), dw16, db16, dy, x, w);
  expect_within(dw16, want_dw, order_bound(abs_dw, k.M), tag + " lowp dweight");
  expect_rounded(db16, want_db, tag + " lowp dbias");
}

TEST(LowpMatmul, OddShapesWithinOneUlpOfTheF32Product) {
  for (DType dt : kLowp)
    for (int64_t M : {1, 5, 217})
      for (int64_t K : {1, 5, 217})
        for (int64_t N : {1, 5, 217}) check_matmul(dt, {M, K, N}, uint64_t(M * 1000 + K * 10 + N));
}

TEST(LowpMatmul, LargerThanOneTileAlongEveryDimension) {
  // f16 products run in f32 tiles of 2048 x 2048 x 1024 (M x N x K): these shapes span several tiles of
  // N and K (and accumulate across K tiles); bf16 runs them through oneDNN as a check at size.
  for (DType dt : kLowp) check_matmul(dt, {67, 1100, 2100}, 90);
  check_matmul(DType::kF16, {2050, 40, 3}, 91);    // two M tiles
  check_matmul(DType::kF16, {5, 300, 2100}, 92);   // one K tile, reused across two N tiles
}

TEST(LowpMatmul, EmptyReductionGivesTheBiasInEitherOutputDtype) {
  for (DType dt : kLowp) {
    const int64_t M = 5, N = 217;
    Tensor x = Tensor::empty({M, 0}, dt), w = Tensor::empty({N, 0}, dt), b = lowp_uniform({N}, dt, 95);
    Tensor out = lowp_uniform({M, N}, dt, 96), out32 = uniform_tensor({M, N}, 97);
    ops().matmul_forward(out, x, w, b);
    ops().matmul_forward(out32, x, w, b);  // f32 out, bias in the compute dtype
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        ASSERT_EQ(bits(out)[m * N + n], bits(b)[n]) << dtype_name(dt);
        ASSERT_EQ(out32.data<float>()[m * N + n], decode(dt, bits(b)[n])) << dtype_name(dt);
      }
  }
}

TEST(LowpDTypes, WrongCombinationsNameTheOpAndTheDtypes) {
  auto expect_error = [](const std::function<void()>& f, const std::string& op, const std::string& detail) {
    try {
      f();
      ADD_FAILURE() << "no error for " << op << " " << detail;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("[" + op + "]"), std::string::npos) << msg;
      EXPECT_NE(msg.find(detail), std::string::npos) << msg;
    }
  };
  Tensor xb = Tensor::empty({4, 8}, DType::kBF16), xh = Tensor::empty({4, 8}, DType::kF16);
  Tensor wb = Tensor::empty({3, 8}, DType::kBF16), wh = Tensor::empty({3, 8}, DType::kF16);
  Tensor ob = Tensor::empty({4, 3}, DType::kBF16), oh = Tensor::empty({4, 3}, DType::kF16);
  Tensor f32_8 = filled({8}, 0), f32_48 = filled({4, 8}, 0), f32_38 = filled({3, 8}, 0);
  ops().fill_(xb, 1);
  ops().fill_(wb, 1);
  expect_error([&] { ops().matmul_forward(ob, xb, wh, TensorView()); }, "matmul_forward", "weight must be bf16");
  expect_error([&] { ops().matmul_forward(oh, xb, wb, TensorView()); }, "matmul_forward", "out must be bf16");
  expect_error([&] { ops().matmul_forward(ob, xb, f32_38, TensorView()); }, "matmul_forward", "got f32");
  expect_error([&] { ops().matmul_backward(xh, TensorView(), TensorView(), ob, xb, wb); }, "matmul_backward",
               "dinp must be bf16");
  expect_error([&] { ops().matmul_backward(TensorView(), wh, TensorView(), ob, xb, wb); }, "matmul_backward",
               "dweight must be bf16");
  expect_error([&] { ops().residual_forward(xb, xh, xb); }, "residual_forward", "f16");
  expect_error([&] { ops().gelu_forward(xb, f32_48); }, "gelu_forward", "f32");
  expect_error([&] { ops().bias_backward(Tensor::empty({8}, DType::kF16), xb); }, "bias_backward", "dbias must be f32");
  expect_error([&] { ops().bias_add_forward(xb, Tensor::empty({8}, DType::kF16)); }, "bias_add_forward",
               "bias must be bf16");
  Tensor mean = filled({4}, 0), rstd = filled({4}, 0), rstd_b = Tensor::empty({4}, DType::kBF16);
  Tensor vb = Tensor::empty({8}, DType::kBF16), vh = Tensor::empty({8}, DType::kF16);
  expect_error([&] { ops().layernorm_forward(xb, mean, rstd, xb, f32_8, TensorView(), 1e-5f); }, "layernorm_forward",
               "weight must be bf16");
  expect_error([&] { ops().layernorm_forward(xb, mean, rstd_b, xb, vb, TensorView(), 1e-5f); }, "layernorm_forward",
               "rstd");
  expect_error([&] { ops().layernorm_backward(xb, vh, TensorView(), xb, xb, vb, mean, rstd); }, "layernorm_backward",
               "dweight must be f32 or the compute dtype bf16");
  Tensor tok = Tensor::zeros({4}, DType::kI32), wte_b = Tensor::empty({5, 8}, DType::kBF16);
  expect_error([&] { ops().embedding_forward(Tensor::empty({4, 8}, DType::kF16), tok, wte_b, TensorView()); },
               "embedding_forward", "out must have the compute dtype bf16");
  expect_error([&] { ops().embedding_backward(Tensor::empty({5, 8}, DType::kF16), TensorView(), xb, tok); },
               "embedding_backward", "dwte must be f32 or the compute dtype bf16");
  Tensor grad_b = Tensor::empty({8}, DType::kBF16);
  AdamWParams p;
  p.lr = 1e-3f;
  expect_error([&] { ops().adamw_update(f32_8, grad_b, filled({8}, 0), filled({8}, 0), p); }, "adamw_update",
               "f32 master weights, gradients and state only), got bf16");
  Tensor logits_i = Tensor::empty({4, 8}, DType::kI32), losses = filled({4}, 0);
  expect_error([&] { ops().cross_entropy_forward_backward(losses, logits_i, tok, 8, TensorView(), 1.0f); },
               "cross_entropy_forward_backward", "f32, bf16 or f16 logits");
}

}  // namespace
}  // namespace loom::test
