// Rotary position embedding CPU ops (rope_forward / rope_backward) on Megatron's grouped qkv layout. The forward
// is compared with an f64 per-element formula written here on MHA, GQA and MQA layouts, full and partial
// rotary (rotary_dim < HS), rotate_half and interleaved pairs, with and without position ids (restarting, as
// --reset-position-ids makes them); v heads and the channels past rotary_dim must keep their exact bits. The
// backward is checked against central finite differences of L = sum(rope(qkv) * R), and as the inverse of the
// forward. bf16/f16 must give exactly the rounded f32 results and leave untouched channels' bits alone (NaN
// payloads included); bad arguments are rejected before anything is written.
#include <functional>
#include <limits>
#include <string>

#include "cpu_test_util.h"
#include "loom/core/dtype.h"

namespace loom::test {
namespace {

struct RopeCase {
  int64_t B, T, NH, NKV, HS, rd;
  int64_t row() const { return NKV * (NH / NKV + 2) * HS; }
  AttentionParams attn() const {
    AttentionParams p;
    p.num_heads = NH;
    p.num_kv_heads = NKV;
    p.head_dim = HS;
    p.softmax_scale = 1.0f / std::sqrt(float(HS));
    return p;
  }
  std::string str(bool interleaved, bool ids) const {
    return "B" + std::to_string(B) + " T" + std::to_string(T) + " NH" + std::to_string(NH) + " NKV" +
           std::to_string(NKV) + " HS" + std::to_string(HS) + " rd" + std::to_string(rd) +
           (interleaved ? " interleaved" : "") + (ids ? " ids" : "");
  }
  // Whether column col of a qkv row is rotated: a q or k head (not v) and a channel below rd.
  bool rotated(int64_t col) const {
    const int64_t G = NH / NKV, head_in_group = (col / HS) % (G + 2);
    return head_in_group <= G && col % HS < rd;
  }
};

const RopeCase kCases[] = {
    {2, 5, 3, 3, 8, 8},     // MHA, full rotary
    {1, 37, 4, 2, 10, 6},   // GQA, partial rotary
    {2, 7, 3, 1, 5, 4},     // MQA, odd head size
    {1, 9, 8, 2, 64, 64},   // Llama-like heads
    {3, 4, 2, 1, 6, 2},     // a single pair
};

// cos/sin (max_pos, rd/2) f32 from inv_freq = 1 / base^(2i/rd).
std::pair<Tensor, Tensor> tables(int64_t max_pos, int64_t rd, double base = 10000.0) {
  Tensor c = Tensor::empty({max_pos, rd / 2}, DType::kF32), s = Tensor::empty({max_pos, rd / 2}, DType::kF32);
  for (int64_t p = 0; p < max_pos; ++p)
    for (int64_t i = 0; i < rd / 2; ++i) {
      const double angle = double(p) / std::pow(base, double(2 * i) / double(rd));
      c.data<float>()[p * rd / 2 + i] = float(std::cos(angle));
      s.data<float>()[p * rd / 2 + i] = float(std::sin(angle));
    }
  return {c, s};
}

// Positions that restart (documents) and revisit the table's last row.
Tensor reset_ids(int64_t B, int64_t T, int64_t max_pos) {
  Tensor t = Tensor::empty({B, T}, DType::kI32);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i) t.data<int32_t>()[b * T + i] = int32_t((i * (b + 2)) % 5 == 0 ? max_pos - 1 : i % 3);
  return t;
}

// rope(x) in f64 with the f32 table values; sign = -1 gives the inverse rotation.
std::vector<double> rope_ref(const RopeCase& k, bool interleaved, const std::vector<double>& x, const Tensor& cos,
                             const Tensor& sin, const Tensor& ids, double sign = 1.0) {
  std::vector<double> y = x;
  const int64_t half = k.rd / 2;
  for (int64_t b = 0; b < k.B; ++b)
    for (int64_t t = 0; t < k.T; ++t) {
      const int64_t p = ids.defined() ? ids.data<int32_t>()[b * k.T + t] : t;
      const size_t base = size_t((b * k.T + t) * k.row());
      for (int64_t col = 0; col < k.row(); ++col) {
        if (!k.rotated(col)) continue;
        const int64_t c = col % k.HS, head = col - c;
        const bool first = interleaved ? c % 2 == 0 : c < half;
        const int64_t i = interleaved ? c / 2 : (first ? c : c - half);
        const int64_t partner = interleaved ? (c ^ 1) : (first ? c + half : c - half);
        const double cs = cos.data<float>()[p * half + i], sn = sign * double(sin.data<float>()[p * half + i]);
        const double xs = x[base + size_t(col)], xp = x[base + size_t(head + partner)];
        y[base + size_t(col)] = first ? xs * cs - xp * sn : xs * cs + xp * sn;
      }
    }
  return y;
}

TEST(CpuRope, ForwardMatchesReferenceAndLeavesOtherChannelsBitExact) {
  for (const RopeCase& k : kCases)
    for (bool interleaved : {false, true})
      for (bool with_ids : {false, true}) {
        const int64_t max_pos = k.T + 3;
        auto [cos, sin] = tables(max_pos, k.rd);
        Tensor ids = with_ids ? reset_ids(k.B, k.T, max_pos) : Tensor();
        Tensor x = uniform_tensor({k.B, k.T, k.row()}, 1, -2, 2), y = clone(x);
        ops().rope_forward(y, cos, sin, k.attn(), RopeParams{k.rd, interleaved}, ids);
        const std::string what = k.str(interleaved, with_ids);
        // Two products and a sum of O(1) values in f32.
        expect_close(y, rope_ref(k, interleaved, to_f64(x), cos, sin, ids), 1e-6, 1e-6, "forward " + what);
        int64_t changed = 0;
        for (int64_t i = 0; i < x.numel(); ++i)
          changed += !k.rotated(i % k.row()) &&
                     std::memcmp(x.data<float>() + i, y.data<float>() + i, sizeof(float)) != 0;
        EXPECT_EQ(changed, 0) << what << ": v heads and channels >= rotary_dim must keep their bits";
      }
}

TEST(CpuRope, PositionZeroIsIdentityAndIdentityIdsEqualNone) {
  const RopeCase k{2, 6, 4, 2, 8, 8};
  auto [cos, sin] = tables(k.T, k.rd);
  Tensor x = uniform_tensor({k.B, k.T, k.row()}, 2), zeros = Tensor::zeros({k.B, k.T}, DType::kI32);
  Tensor y = clone(x);
  ops().rope_forward(y, cos, sin, k.attn(), RopeParams{k.rd, false}, zeros);
  EXPECT_TRUE(same_bits(x, y)) << "angle 0 (cos 1, sin 0) must not change a bit";
  Tensor t_ids = Tensor::empty({k.B, k.T}, DType::kI32);
  for (int64_t i = 0; i < k.B * k.T; ++i) t_ids.data<int32_t>()[i] = int32_t(i % k.T);
  for (bool interleaved : {false, true}) {
    Tensor a = clone(x), b = clone(x);
    ops().rope_forward(a, cos, sin, k.attn(), RopeParams{k.rd, interleaved});
    ops().rope_forward(b, cos, sin, k.attn(), RopeParams{k.rd, interleaved}, t_ids);
    EXPECT_TRUE(same_bits(a, b)) << "interleaved " << interleaved;
  }
}

TEST(CpuRope, BackwardMatchesFiniteDifferences) {
  for (const RopeCase& k : {RopeCase{2, 3, 4, 2, 6, 4}, RopeCase{1, 4, 3, 1, 5, 4}})
    for (bool interleaved : {false, true})
      for (bool with_ids : {false, true}) {
        const int64_t max_pos = k.T + 2;
        auto [cos, sin] = tables(max_pos, k.rd);
        Tensor ids = with_ids ? reset_ids(k.B, k.T, max_pos) : Tensor();
        Tensor x = uniform_tensor({k.B, k.T, k.row()}, 3), R = uniform_tensor({k.B, k.T, k.row()}, 4);
        Tensor d = clone(R);
        ops().rope_backward(d, cos, sin, k.attn(), RopeParams{k.rd, interleaved}, ids);
        std::vector<double> xd = to_f64(x), want(xd.size());
        const std::vector<double> r = to_f64(R);
        auto L = [&]() {
          const std::vector<double> y = rope_ref(k, interleaved, xd, cos, sin, ids);
          double s = 0;
          for (size_t i = 0; i < y.size(); ++i) s += y[i] * r[i];
          return s;
        };
        for (size_t i = 0; i < xd.size(); ++i) {
          constexpr double h = 1e-4;  // L is linear in x: only rounding (~1e-16 * |L| / h) remains
          const double x0 = xd[i];
          xd[i] = x0 + h;
          const double lp = L();
          xd[i] = x0 - h;
          const double lm = L();
          xd[i] = x0;
          want[i] = (lp - lm) / (2 * h);
        }
        expect_close(d, want, 1e-6, 1e-6, "dqkv " + k.str(interleaved, with_ids));
      }
}

TEST(CpuRope, BackwardUndoesForward) {
  const RopeCase k{2, 33, 6, 2, 16, 12};
  auto [cos, sin] = tables(64, k.rd, 500000.0);
  Tensor ids = reset_ids(k.B, k.T, 64);
  for (bool interleaved : {false, true}) {
    Tensor x = uniform_tensor({k.B, k.T, k.row()}, 5, -3, 3), y = clone(x);
    ops().rope_forward(y, cos, sin, k.attn(), RopeParams{k.rd, interleaved}, ids);
    ops().rope_backward(y, cos, sin, k.attn(), RopeParams{k.rd, interleaved}, ids);
    // cos^2 + sin^2 of the f32 table values is 1 to ~1e-7.
    expect_close(y, to_f64(x), 2e-6, 1e-6, interleaved ? "interleaved" : "rotate_half");
  }
}

TEST(CpuRope, ThreadCountDoesNotMatter) {
  const RopeCase k{4, 50, 4, 2, 32, 32};
  auto [cos, sin] = tables(k.T, k.rd);
  Tensor x = uniform_tensor({k.B, k.T, k.row()}, 6);
  std::vector<Tensor> ys;
  for (int threads : {1, 3})
    with_threads(threads, [&] {
      ys.push_back(clone(x));
      ops().rope_forward(ys.back(), cos, sin, k.attn(), RopeParams{k.rd, false});
      ops().rope_backward(ys.back(), cos, sin, k.attn(), RopeParams{k.rd, true});
    });
  EXPECT_TRUE(same_bits(ys[0], ys[1]));
}

// ---- bf16 / f16 ---------------------------------------------------------------------------------------

uint16_t* bits(const Tensor& t) { return static_cast<uint16_t*>(t.raw()); }
uint16_t encode(DType dt, float x) { return dt == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x); }
float decode(DType dt, uint16_t b) { return dt == DType::kBF16 ? bf16_to_f32(b) : f16_to_f32(b); }

TEST(LowpRope, RotatedChannelsAreTheRoundedF32ResultOthersKeepTheirBits) {
  for (DType dt : {DType::kBF16, DType::kF16})
    for (const RopeCase& k : {RopeCase{2, 5, 4, 2, 10, 6}, RopeCase{1, 7, 3, 1, 40, 34}})
      for (bool interleaved : {false, true})
        for (bool forward : {true, false}) {
          auto [cos, sin] = tables(k.T, k.rd);
          Tensor xf = uniform_tensor({k.B, k.T, k.row()}, 7, -2, 2), x = Tensor::empty(xf.shape(), dt);
          // Signalling-NaN bit patterns in channels that must not be touched: a widen/narrow round trip
          // would quieten them.
          const uint16_t snan = dt == DType::kBF16 ? 0x7F81 : 0x7C01;
          for (int64_t i = 0; i < x.numel(); ++i)
            bits(x)[i] = k.rotated(i % k.row()) ? encode(dt, xf.data<float>()[i]) : snan;
          Tensor want = Tensor::empty(x.shape(), DType::kF32);
          for (int64_t i = 0; i < x.numel(); ++i) want.data<float>()[i] = decode(dt, bits(x)[i]);
          Tensor y = clone(x);
          const RopeParams r{k.rd, interleaved};
          if (forward) {
            ops().rope_forward(y, cos, sin, k.attn(), r);
            ops().rope_forward(want, cos, sin, k.attn(), r);
          } else {
            ops().rope_backward(y, cos, sin, k.attn(), r);
            ops().rope_backward(want, cos, sin, k.attn(), r);
          }
          int64_t bad_rot = 0, bad_other = 0;
          for (int64_t i = 0; i < x.numel(); ++i) {
            if (k.rotated(i % k.row())) bad_rot += bits(y)[i] != encode(dt, want.data<float>()[i]);
            else bad_other += bits(y)[i] != snan;
          }
          const std::string what = std::string(dtype_name(dt)) + " " + k.str(interleaved, false) +
                                   (forward ? " forward" : " backward");
          EXPECT_EQ(bad_rot, 0) << what << ": rotated channels";
          EXPECT_EQ(bad_other, 0) << what << ": untouched channels";
        }
}

// ---- argument checks --------------------------------------------------------------------------------------

TEST(CpuRope, RejectsBadArgumentsBeforeWriting) {
  const RopeCase k{2, 4, 4, 2, 8, 8};
  auto [cos, sin] = tables(6, k.rd);
  const Tensor x = uniform_tensor({k.B, k.T, k.row()}, 8);
  Tensor y = clone(x);
  auto rope = [&](int64_t rd, TensorView c, TensorView s, TensorView ids, AttentionParams p) {
    ops().rope_forward(y, c, s, p, RopeParams{rd, false}, ids);
  };
  auto [cos6, sin6] = tables(6, 6);
  EXPECT_THROW(rope(7, cos, sin, {}, k.attn()), Error);      // odd rotary_dim
  EXPECT_THROW(rope(0, cos, sin, {}, k.attn()), Error);      // none
  EXPECT_THROW(rope(10, cos, sin, {}, k.attn()), Error);     // > HS
  EXPECT_THROW(rope(8, cos6, sin6, {}, k.attn()), Error);    // table width != rd/2
  EXPECT_THROW(rope(8, cos, sin6, {}, k.attn()), Error);     // cos and sin disagree
  auto [cos3, sin3] = tables(3, k.rd);
  EXPECT_THROW(rope(8, cos3, sin3, {}, k.attn()), Error);    // T = 4 > 3 positions
  AttentionParams wrong = k.attn();
  wrong.num_kv_heads = 4;
  EXPECT_THROW(rope(8, cos, sin, {}, wrong), Error);         // qkv row does not match the heads
  Tensor ids = reset_ids(k.B, k.T, 6);
  ids.data<int32_t>()[k.B * k.T - 1] = 6;                    // one past the table, in the last row
  EXPECT_THROW(rope(8, cos, sin, ids, k.attn()), Error);
  ids.data<int32_t>()[k.B * k.T - 1] = -1;
  EXPECT_THROW(ops().rope_backward(y, cos, sin, k.attn(), RopeParams{8, false}, ids), Error);
  EXPECT_THROW(rope(8, cos, sin, Tensor::zeros({k.B * k.T}, DType::kI32), k.attn()), Error);  // ids shape
  EXPECT_TRUE(same_bits(x, y)) << "a rejected call must not write";
  // The same tables with cos3 fit T = 3 when position ids stay below 3.
  Tensor ok_ids = Tensor::zeros({k.B, k.T}, DType::kI32);
  ops().rope_forward(y, cos3, sin3, k.attn(), RopeParams{8, false}, ok_ids);
}

}  // namespace
}  // namespace loom::test
