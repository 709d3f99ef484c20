// Attention blocks for context parallelism (attention_block_forward/backward, attention_merge, the K/V pack
// and dqkv unpack): with the whole sequence as one block they equal attention_forward/backward; keys cut into
// blocks and merged equal one block; the sequence cut into CP ranks' chunk pairs and run in ring order
// (every rank's queries against every rank's keys, merged, then the block backwards with the final out/lse)
// equals the whole-sequence attention, including GQA, sliding windows, document segments and attention
// dropout (the mask uses global positions).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "attention_test_util.h"
#include "backend/cpu/cpu_ops.h"
#include "cpu_test_util.h"

namespace loom::cpu {
namespace {

using attn_test::Case;
using namespace loom::test;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

Tensor random_qkv(const Case& c, uint32_t seed) {
  Tensor t = Tensor::empty(Shape{c.B, c.T, c.qkv_cols()}, DType::kF32);
  const std::vector<float> v = attn_test::randn(t.numel(), seed);
  std::memcpy(t.raw(), v.data(), v.size() * sizeof(float));
  return t;
}

Tensor positions(const std::vector<int32_t>& p) {
  Tensor t = Tensor::empty(Shape{int64_t(p.size())}, DType::kI32);
  std::memcpy(t.raw(), p.data(), p.size() * sizeof(int32_t));
  return t;
}

std::vector<int32_t> iota(int64_t begin, int64_t end) {
  std::vector<int32_t> v(size_t(end - begin));
  std::iota(v.begin(), v.end(), int32_t(begin));
  return v;
}

// Rows rows[k] of the (B, T, ...) tensor t (any dtype), stacked: (B, rows.size(), ...).
Tensor gather_rows(const Tensor& t, const std::vector<int32_t>& rows) {
  const int64_t B = t.size(0), T = t.size(1), R = t.numel() / (B * T), n = int64_t(rows.size());
  Tensor out = Tensor::empty(t.ndim() == 2 ? Shape{B, n} : Shape{B, n, t.size(2)}, t.dtype());
  const size_t es = dtype_size(t.dtype());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < n; ++k)
      std::memcpy(static_cast<char*>(out.raw()) + size_t((b * n + k) * R) * es,
                  static_cast<const char*>(t.raw()) + size_t((b * T + rows[k]) * R) * es, size_t(R) * es);
  return out;
}

// Writes src (B, n, ...) rows into rows[k] of dst (B, T, ...) (inverse of gather_rows).
void scatter_rows(Tensor& dst, const Tensor& src, const std::vector<int32_t>& rows) {
  const int64_t B = dst.size(0), T = dst.size(1), R = dst.numel() / (B * T), n = int64_t(rows.size());
  const size_t es = dtype_size(dst.dtype());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < n; ++k)
      std::memcpy(static_cast<char*>(dst.raw()) + size_t((b * T + rows[k]) * R) * es,
                  static_cast<const char*>(src.raw()) + size_t((b * n + k) * R) * es, size_t(R) * es);
}
void scatter_cols(Tensor& dst, const Tensor& src, const std::vector<int32_t>& cols) {
  const int64_t rows = dst.size(0) * dst.size(1), T = dst.size(2), n = int64_t(cols.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < n; ++k) dst.data<float>()[r * T + cols[k]] = src.data<float>()[r * n + k];
}

// |a - b| <= atol + rtol |b| everywhere; -inf matches -inf.
void expect_near(const Tensor& got, const Tensor& want, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<double> g = to_f64(got), w = to_f64(want);
  int bad = 0;
  for (size_t i = 0; i < g.size() && bad < 5; ++i) {
    if (std::isinf(w[i]) && g[i] == w[i]) continue;
    if (!(std::abs(g[i] - w[i]) <= atol + rtol * std::abs(w[i]))) {
      ADD_FAILURE() << what << "[" << i << "]: got " << g[i] << ", want " << w[i];
      ++bad;
    }
  }
}

struct Full {
  Tensor out, lse, dqkv;
};

Full reference(const Case& c, const Tensor& qkv, const Tensor& dout, const Tensor& seg = {}) {
  Full r{Tensor::empty(dout.shape(), qkv.dtype()), Tensor::empty(Shape{c.B, c.NH, c.T}, DType::kF32),
         Tensor::empty(qkv.shape(), qkv.dtype())};
  ops().attention_forward(r.out, r.lse, qkv, c.params(), seg);
  ops().attention_backward(r.dqkv, dout, qkv, r.out, r.lse, c.params(), seg);
  return r;
}

Tensor random_dout(const Case& c, uint32_t seed) {
  Tensor t = Tensor::empty(Shape{c.B, c.T, c.NH * c.HS}, DType::kF32);
  const std::vector<float> v = attn_test::randn(t.numel(), seed);
  std::memcpy(t.raw(), v.data(), v.size() * sizeof(float));
  return t;
}

// The CP layout (context_parallel.h): rank r of cp holds chunks r and 2cp-1-r of T / (2cp) tokens.
std::vector<int32_t> rank_positions(int64_t T, int cp, int r) {
  const int64_t c = T / (2 * cp);
  std::vector<int32_t> p = iota(r * c, (r + 1) * c);
  const std::vector<int32_t> hi = iota((2 * cp - 1 - r) * c, (2 * cp - r) * c);
  p.insert(p.end(), hi.begin(), hi.end());
  return p;
}

// Queries at q_rows of the full qkv against the key blocks `blocks` (positions of the full sequence): forward
// block by block with merges, then the block backwards with the merged out/lse. Returns out, lse (for the
// query rows) and dqkv of the full sequence (each block's dkv scattered to its rows, dq to the query rows),
// as one rank of a ring would compute them (its share of dk/dv summed over every rank's queries is what the
// caller adds up).
struct Partial {
  Tensor out, lse, dq;      // query rows
  std::vector<Tensor> dkv;  // per key block
};
Partial run_blocks(const Case& c, const Tensor& qkv, const Tensor& dout_full, const std::vector<int32_t>& q_rows,
                   const std::vector<std::vector<int32_t>>& blocks, bool compact, const Tensor& seg = {}) {
  const AttentionParams p = c.params();
  const Tensor q = gather_rows(qkv, q_rows), qp = positions(q_rows);
  const Tensor dout = gather_rows(dout_full, q_rows);
  const int64_t Tq = int64_t(q_rows.size());
  Partial r{Tensor::zeros(Shape{c.B, Tq, c.NH * c.HS}, DType::kF32), Tensor::empty(Shape{c.B, c.NH, Tq}, DType::kF32),
            Tensor::zeros(Shape{c.B, Tq, c.NH * c.HS}, DType::kF32), {}};
  std::vector<Tensor> kvs, kps;
  for (const auto& rows : blocks) {
    Tensor kv = gather_rows(qkv, rows);
    if (compact) {
      Tensor packed = Tensor::empty(Shape{c.B, int64_t(rows.size()), 2 * c.NKV * c.HS}, qkv.dtype());
      ops().attention_kv_pack(packed, kv, p);
      kv = packed;
    }
    kvs.push_back(kv);
    kps.push_back(positions(rows));
  }
  // AttentionBlock views must outlive the calls: keep the segment tensors alive per call.
  for (size_t k = 0; k < blocks.size(); ++k) {
    Tensor qs, ks;
    AttentionBlock blk{qp, kps[k], {}, {}, c.T};
    if (seg.defined()) {
      qs = gather_rows(seg, q_rows);
      ks = gather_rows(seg, blocks[k]);
      blk.q_segment_ids = qs;
      blk.k_segment_ids = ks;
    }
    if (k == 0) {
      ops().attention_block_forward(r.out, r.lse, q, kvs[k], blk, p);
    } else {
      Tensor ob = Tensor::empty(r.out.shape(), DType::kF32), lb = Tensor::empty(r.lse.shape(), DType::kF32);
      ops().attention_block_forward(ob, lb, q, kvs[k], blk, p);
      ops().attention_merge(r.out, r.lse, ob, lb);
    }
  }
  return r;
}

// Backward of the blocks given the final out/lse of the query rows.
void run_blocks_backward(const Case& c, Partial& r, const Tensor& qkv, const Tensor& dout_full,
                         const std::vector<int32_t>& q_rows, const std::vector<std::vector<int32_t>>& blocks,
                         const Tensor& out_final, const Tensor& lse_final, const Tensor& seg = {}) {
  const AttentionParams p = c.params();
  const Tensor q = gather_rows(qkv, q_rows), qp = positions(q_rows), dout = gather_rows(dout_full, q_rows);
  for (const auto& rows : blocks) {
    Tensor kv = gather_rows(qkv, rows), kp = positions(rows), qs, ks;
    AttentionBlock blk{qp, kp, {}, {}, c.T};
    if (seg.defined()) {
      qs = gather_rows(seg, q_rows);
      ks = gather_rows(seg, rows);
      blk.q_segment_ids = qs;
      blk.k_segment_ids = ks;
    }
    Tensor dkv = Tensor::zeros(Shape{c.B, int64_t(rows.size()), 2 * c.NKV * c.HS}, DType::kF32);
    ops().attention_block_backward(r.dq, dkv, dout, q, kv, out_final, lse_final, blk, p);
    r.dkv.push_back(dkv);
  }
}

// dqkv of the full sequence from dq (rows q_rows) and dkv per key block (rows blocks[k]), all f32 sums.
Tensor assemble_dqkv(const Case& c, const Tensor& dq_full, const Tensor& dkv_full) {
  Tensor d = Tensor::empty(Shape{c.B, c.T, c.qkv_cols()}, DType::kF32);
  ops().attention_qkv_grad_unpack(d, dq_full, dkv_full, c.params());
  return d;
}

void add_rows(Tensor& acc, const Tensor& part, const std::vector<int32_t>& rows) {
  const int64_t B = acc.size(0), T = acc.size(1), R = acc.numel() / (B * T), n = int64_t(rows.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < n; ++k)
      for (int64_t e = 0; e < R; ++e) acc.data<float>()[(b * T + rows[k]) * R + e] += part.data<float>()[(b * n + k) * R + e];
}

// Splits [0, T) into the given contiguous block sizes.
std::vector<std::vector<int32_t>> contiguous_blocks(const std::vector<int64_t>& sizes) {
  std::vector<std::vector<int32_t>> b;
  int64_t s = 0;
  for (int64_t n : sizes) {
    b.push_back(iota(s, s + n));
    s += n;
  }
  return b;
}

// The whole sequence as blocks `blocks` of keys (queries: all of it): out, lse, dqkv vs the fused op.
void check_against_full(const Case& c, const std::vector<std::vector<int32_t>>& blocks, bool compact, double tol,
                        const Tensor& seg = {}) {
  SCOPED_TRACE(c.name() + (compact ? " compact" : " packed") + " blocks " + std::to_string(blocks.size()));
  const Tensor qkv = random_qkv(c, 7), dout = random_dout(c, 8);
  const Full want = reference(c, qkv, dout, seg);
  const std::vector<int32_t> all = iota(0, c.T);
  Partial r = run_blocks(c, qkv, dout, all, blocks, compact, seg);
  expect_near(r.out, want.out, tol, tol, "out");
  expect_near(r.lse, want.lse, tol, tol, "lse");
  run_blocks_backward(c, r, qkv, dout, all, blocks, r.out, r.lse, seg);
  Tensor dkv = Tensor::zeros(Shape{c.B, c.T, 2 * c.NKV * c.HS}, DType::kF32);
  for (size_t k = 0; k < blocks.size(); ++k) add_rows(dkv, r.dkv[k], blocks[k]);
  expect_near(assemble_dqkv(c, r.dq, dkv), want.dqkv, tol, tol, "dqkv");
}

TEST(AttentionBlocks, OneBlockEqualsAttention) {
  for (const Case& c : {Case{1, 1, 2, 2, 8, -1}, Case{2, 5, 4, 2, 8, -1}, Case{1, 37, 4, 1, 5, -1},
                        Case{2, 37, 4, 2, 8, 6}, Case{1, 70, 2, 2, 16, -1}, Case{1, 9, 2, 1, 4, -1, false}})
    for (bool compact : {false, true}) check_against_full(c, {iota(0, c.T)}, compact, 1e-5);
}

TEST(AttentionBlocks, SplitKeysAndMergeEqualsOneBlock) {
  check_against_full(Case{2, 5, 4, 2, 8, -1}, contiguous_blocks({2, 3}), true, 1e-5);
  check_against_full(Case{1, 37, 4, 2, 8, -1}, contiguous_blocks({10, 20, 7}), true, 1e-5);
  check_against_full(Case{2, 37, 4, 2, 8, 5}, contiguous_blocks({13, 1, 23}), false, 1e-5);
  check_against_full(Case{1, 24, 4, 4, 8, -1, false}, contiguous_blocks({8, 8, 8}), true, 1e-5);
  // Keys out of order, interleaved across blocks: positions decide, not the storage order.
  std::vector<std::vector<int32_t>> odd_even(2);
  for (int32_t t = 36; t >= 0; --t) odd_even[t % 2].push_back(t);
  check_against_full(Case{1, 37, 4, 2, 8, 7}, odd_even, true, 1e-5);
}

TEST(AttentionBlocks, SegmentsAndDropoutUseGlobalIndices) {
  const Case c{2, 24, 4, 2, 8, -1};
  Tensor seg = Tensor::empty(Shape{c.B, c.T}, DType::kI32);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.T; ++t) seg.data<int32_t>()[b * c.T + t] = int32_t(t < 7 + 3 * b ? 0 : t < 15 ? 1 : 2);
  check_against_full(c, contiguous_blocks({6, 6, 12}), true, 1e-5, seg);
  Case d = c;
  d.dropout_p = 0.25f;
  d.seed = 1234;
  d.stream = 99;
  check_against_full(d, contiguous_blocks({5, 11, 8}), true, 1e-5);
  d.window = 5;
  check_against_full(d, contiguous_blocks({24}), false, 1e-5);
}

// The ring of cp ranks simulated in one process: rank r's queries (its chunk pair) against every rank's keys
// in ring order (r, r-1, ...), merged; the backward with the merged out/lse; dk/dv of each key block summed
// over the ranks that saw it. Gathered back, everything equals the whole-sequence op.
void check_ring(const Case& c, int cp, double tol) {
  SCOPED_TRACE(c.name() + " cp" + std::to_string(cp));
  const Tensor qkv = random_qkv(c, 11), dout = random_dout(c, 12);
  const Full want = reference(c, qkv, dout);
  Tensor out = Tensor::empty(want.out.shape(), DType::kF32), lse = Tensor::empty(want.lse.shape(), DType::kF32);
  Tensor dq = Tensor::zeros(Shape{c.B, c.T, c.NH * c.HS}, DType::kF32);
  Tensor dkv = Tensor::zeros(Shape{c.B, c.T, 2 * c.NKV * c.HS}, DType::kF32);
  for (int r = 0; r < cp; ++r) {
    std::vector<std::vector<int32_t>> ring;
    for (int s = 0; s < cp; ++s) ring.push_back(rank_positions(c.T, cp, ((r - s) % cp + cp) % cp));
    const std::vector<int32_t> mine = rank_positions(c.T, cp, r);
    Partial p = run_blocks(c, qkv, dout, mine, ring, true);
    run_blocks_backward(c, p, qkv, dout, mine, ring, p.out, p.lse);
    scatter_rows(out, p.out, mine);
    scatter_cols(lse, p.lse, mine);
    add_rows(dq, p.dq, mine);
    for (int s = 0; s < cp; ++s) add_rows(dkv, p.dkv[size_t(s)], ring[size_t(s)]);
  }
  expect_near(out, want.out, tol, tol, "out");
  expect_near(lse, want.lse, tol, tol, "lse");
  expect_near(assemble_dqkv(c, dq, dkv), want.dqkv, tol, tol, "dqkv");
}

TEST(AttentionBlocks, SimulatedRingEqualsFullSequence) {
  check_ring(Case{2, 16, 4, 2, 8, -1}, 2, 1e-5);
  check_ring(Case{2, 24, 4, 2, 8, -1}, 3, 1e-5);
  check_ring(Case{2, 24, 4, 2, 8, 5}, 2, 1e-5);
  check_ring(Case{1, 32, 4, 1, 8, 3}, 4, 1e-5);
  Case d{2, 16, 4, 2, 8, -1};
  d.dropout_p = 0.3f;
  d.seed = 5;
  check_ring(d, 4, 1e-5);
}

TEST(AttentionBlocks, NoVisibleKeyGivesZeroAndMinusInfAndMergesAsNothing) {
  const Case c{1, 8, 2, 1, 4, -1};
  const Tensor qkv = random_qkv(c, 3);
  const AttentionParams p = c.params();
  const Tensor q = gather_rows(qkv, iota(0, 4)), kv = gather_rows(qkv, iota(4, 8));
  const Tensor qp = positions(iota(0, 4)), kp = positions(iota(4, 8));
  Tensor out = filled(Shape{c.B, 4, c.NH * c.HS}, 7.0f), lse = filled(Shape{c.B, c.NH, 4}, 7.0f);
  ops().attention_block_forward(out, lse, q, kv, AttentionBlock{qp, kp, {}, {}, c.T}, p);  // keys all in the future
  for (double v : to_f64(out)) EXPECT_EQ(v, 0.0);
  for (double v : to_f64(lse)) EXPECT_EQ(v, double(kNegInf));
  // Merging the empty block into a real result changes nothing, and merging a real one into the empty copies it.
  Tensor o1 = Tensor::empty(out.shape(), DType::kF32), l1 = Tensor::empty(lse.shape(), DType::kF32);
  ops().attention_block_forward(o1, l1, q, q, AttentionBlock{qp, qp, {}, {}, c.T}, p);
  const Tensor o1c = clone(o1), l1c = clone(l1);
  ops().attention_merge(o1, l1, out, lse);
  EXPECT_TRUE(same_bits(o1, o1c) && same_bits(l1, l1c));
  ops().attention_merge(out, lse, o1c, l1c);
  EXPECT_TRUE(same_bits(out, o1c) && same_bits(lse, l1c));
  // The backward of an invisible block adds exact zeros.
  Tensor dq = Tensor::zeros(out.shape(), DType::kF32), dkv = Tensor::zeros(Shape{c.B, 4, 2 * c.NKV * c.HS}, DType::kF32);
  Tensor dout = uniform_tensor(out.shape(), 4);
  ops().attention_block_backward(dq, dkv, dout, q, kv, o1c, l1c, AttentionBlock{qp, kp, {}, {}, c.T}, p);
  for (double v : to_f64(dq)) EXPECT_EQ(v, 0.0);
  for (double v : to_f64(dkv)) EXPECT_EQ(v, 0.0);
}

// bf16 / f16 inputs: a block split with f32 accumulators against the fused op on the same 16-bit inputs.
TEST(AttentionBlocks, LowPrecisionInputsMatchFusedOp) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const Case c{2, 24, 4, 2, 8, -1};
    const Tensor qkv = to_lowp(random_qkv(c, 21), dt), dout = to_lowp(random_dout(c, 22), dt);
    const Full want = reference(c, qkv, dout);
    const AttentionParams p = c.params();
    const Tensor qp = positions(iota(0, c.T));
    Tensor out = Tensor::empty(want.out.shape(), DType::kF32), lse = Tensor::empty(want.lse.shape(), DType::kF32);
    const std::vector<std::vector<int32_t>> blocks = contiguous_blocks({10, 14});
    for (size_t k = 0; k < blocks.size(); ++k) {
      Tensor kv = gather_rows(qkv, blocks[k]), kp = positions(blocks[k]);
      Tensor ob = Tensor::empty(out.shape(), DType::kF32), lb = Tensor::empty(lse.shape(), DType::kF32);
      ops().attention_block_forward(k == 0 ? out : ob, k == 0 ? lse : lb, qkv, kv, AttentionBlock{qp, kp, {}, {}, c.T}, p);
      if (k > 0) ops().attention_merge(out, lse, ob, lb);
    }
    const double tol = dt == DType::kBF16 ? 2e-2 : 4e-3;
    expect_near(out, widened(want.out), tol, tol, "out");
    expect_near(lse, want.lse, 1e-4, 1e-4, "lse");
    Tensor out16 = Tensor::empty(out.shape(), dt);
    ops().cast(out16, out);
    Tensor dq = Tensor::zeros(out.shape(), DType::kF32), dkv = Tensor::zeros(Shape{c.B, c.T, 2 * c.NKV * c.HS}, DType::kF32);
    for (const auto& rows : blocks) {
      Tensor kv = gather_rows(qkv, rows), kp = positions(rows);
      Tensor part = Tensor::zeros(Shape{c.B, int64_t(rows.size()), 2 * c.NKV * c.HS}, DType::kF32);
      ops().attention_block_backward(dq, part, dout, qkv, kv, out16, lse, AttentionBlock{qp, kp, {}, {}, c.T}, p);
      add_rows(dkv, part, rows);
    }
    Tensor dqkv = Tensor::empty(qkv.shape(), dt);
    ops().attention_qkv_grad_unpack(dqkv, dq, dkv, p);
    expect_near(widened(dqkv), widened(want.dqkv), 3 * tol, 3 * tol, "dqkv");
  }
}

TEST(AttentionBlocks, RejectsBadArguments) {
  const Case c{1, 4, 2, 1, 4, -1};
  const Tensor qkv = random_qkv(c, 1), qp = positions(iota(0, 4)), short_pos = positions(iota(0, 3));
  Tensor out = Tensor::empty(Shape{1, 4, 8}, DType::kF32), lse = Tensor::empty(Shape{1, 2, 4}, DType::kF32);
  EXPECT_THROW(ops().attention_block_forward(out, lse, qkv, qkv, AttentionBlock{qp, short_pos, {}, {}, 4}, c.params()), Error);
  Tensor bad_kv = Tensor::empty(Shape{1, 4, 12}, DType::kF32);
  EXPECT_THROW(ops().attention_block_forward(out, lse, qkv, bad_kv, AttentionBlock{qp, qp, {}, {}, 0}, c.params()), Error);
  Case d = c;
  d.dropout_p = 0.1f;  // dropout needs the global length
  EXPECT_THROW(ops().attention_block_forward(out, lse, qkv, qkv, AttentionBlock{qp, qp, {}, {}, 0}, d.params()), Error);
}

}  // namespace
}  // namespace loom::cpu
