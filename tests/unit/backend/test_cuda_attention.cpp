// CUDA attention core and context-parallel block ops against the CPU reference on identical inputs: odd
// shapes (T = 1, 5, 17, 217; B = 1, 2; 16-bit HS 64/128 up to T = 333 for the flash kernels), MHA/GQA/MQA,
// head sizes 16/64/128 and odd ones (24, 20), causal or
// not, sliding windows, document segments, attention dropout (same seed: the masks are bit-identical, so
// results agree within rounding), f32/bf16/f16; backward dqkv; block ops (arbitrary positions, packed and
// compact kv, merge, accumulating block backward; two key blocks merged equal the whole); determinism (two
// runs, same bytes); argument checks. Outputs start as NaN so unwritten elements show up. GPU tests skip
// when no GPU is visible.
#if defined(LOOM_HAVE_CUDA)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cuda/attention.cuh"
#include "cuda_test_util.h"

namespace loom {
namespace {

using namespace loom::test;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Cfg {
  int64_t B, T, NH, NKV, HS;
  bool causal = true;
  int64_t window = -1;
  bool segments = false;
  float dropout = 0;
  DType dt = DType::kF32;

  int64_t qkv_cols() const { return NKV * (NH / NKV + 2) * HS; }
  AttentionParams params() const {
    AttentionParams p;
    p.num_heads = NH;
    p.num_kv_heads = NKV;
    p.head_dim = HS;
    p.softmax_scale = 1.0f / std::sqrt(float(HS));
    p.causal = causal;
    p.window = window;
    p.dropout_p = dropout;
    p.dropout_seed = 1234;
    p.dropout_stream = 7;
    return p;
  }
  std::string name() const {
    return std::string(dtype_name(dt)) + " B" + std::to_string(B) + " T" + std::to_string(T) + " NH" +
           std::to_string(NH) + " NKV" + std::to_string(NKV) + " HS" + std::to_string(HS) +
           (causal ? "" : " noncausal") + (window > 0 ? " window" + std::to_string(window) : "") +
           (segments ? " segments" : "") + (dropout > 0 ? " dropout" : "");
  }
};

Tensor nan_host(Shape s, DType dt) {
  Tensor t = Tensor::empty(s, dt);
  for (int64_t i = 0; i < t.numel(); ++i) host_set(t, i, kNaN);
  return t;
}
Tensor nan_device(Shape s, DType dt) { return to_device(nan_host(s, dt)); }

// Non-decreasing segment ids (B, T): documents of varied lengths, different per batch row.
Tensor segment_ids(int64_t B, int64_t T) {
  Tensor s = Tensor::empty(Shape{B, T}, DType::kI32);
  for (int64_t b = 0; b < B; ++b) {
    int32_t id = 0;
    int64_t next = 3 + 5 * b;
    for (int64_t t = 0; t < T; ++t) {
      if (t == next) {
        ++id;
        next += 11 + 29 * ((id + b) % 3);
      }
      s.data<int32_t>()[b * T + t] = id;
    }
  }
  return s;
}

Tensor i32_host(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty(Shape{int64_t(v.size())}, DType::kI32);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t;
}

float out_tol(DType dt) { return dt == DType::kF32 ? 5e-5f : dt == DType::kBF16 ? 2e-2f : 4e-3f; }
float lse_tol(DType dt) { return dt == DType::kF32 ? 2e-5f : 1e-4f; }
float grad_tol(DType dt) { return dt == DType::kF32 ? 2e-4f : dt == DType::kBF16 ? 5e-2f : 1.2e-2f; }

struct Results {
  Tensor out, lse, dqkv;  // host copies
};

Results run_cuda(const Cfg& c, const Tensor& qkv, const Tensor& dout, const Tensor& seg, bool backward = true) {
  auto& ctx = cuda_ctx();
  const Shape out_s{c.B, c.T, c.NH * c.HS}, lse_s{c.B, c.NH, c.T};
  Tensor dq = to_device(qkv), ddout = to_device(dout);
  Tensor dseg = seg.defined() ? to_device(seg) : Tensor();
  Tensor out = nan_device(out_s, c.dt), lse = nan_device(lse_s, DType::kF32);
  cuda::attention_forward(ctx, out, lse, dq, c.params(), dseg);
  Results r;
  r.out = to_host(out);
  r.lse = to_host(lse);
  if (backward) {
    Tensor dqkv = nan_device(qkv.shape(), c.dt);
    cuda::attention_backward(ctx, dqkv, ddout, dq, out, lse, c.params(), dseg);
    r.dqkv = to_host(dqkv);
  }
  return r;
}

// The CPU op on the same inputs; its backward gets the CUDA forward's out and lse, so the comparison of
// dqkv isolates the backward kernels.
Results run_cpu(const Cfg& c, const Tensor& qkv, const Tensor& dout, const Tensor& seg, const Results& gpu,
            bool backward = true) {
  const Shape out_s{c.B, c.T, c.NH * c.HS}, lse_s{c.B, c.NH, c.T};
  Results r;
  r.out = nan_host(out_s, c.dt);
  r.lse = nan_host(lse_s, DType::kF32);
  cpu_ref().attention_forward(r.out, r.lse, qkv, c.params(), seg);
  if (backward) {
    r.dqkv = nan_host(qkv.shape(), c.dt);
    cpu_ref().attention_backward(r.dqkv, dout, qkv, gpu.out, gpu.lse, c.params(), seg);
  }
  return r;
}

void check_case(const Cfg& c, bool backward = true) {
  SCOPED_TRACE(c.name());
  const Tensor qkv = random_host(Shape{c.B, c.T, c.qkv_cols()}, c.dt, 11 + uint64_t(c.T) * 7 + uint64_t(c.HS));
  const Tensor dout = random_host(Shape{c.B, c.T, c.NH * c.HS}, c.dt, 99 + uint64_t(c.T));
  const Tensor seg = c.segments ? segment_ids(c.B, c.T) : Tensor();
  const Results g = run_cuda(c, qkv, dout, seg, backward);
  const Results r = run_cpu(c, qkv, dout, seg, g, backward);
  expect_close(g.out, r.out, out_tol(c.dt), "out " + c.name());
  expect_close(g.lse, r.lse, lse_tol(c.dt), "lse " + c.name());
  if (backward) expect_close(g.dqkv, r.dqkv, grad_tol(c.dt), "dqkv " + c.name());
}

// ---- whole-sequence op ----------------------------------------------------------------------------------

TEST(CudaAttention, MatchesCpuOnOddShapes) {
  REQUIRE_GPU();
  int variant = 0;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (auto [B, T] : {std::pair<int64_t, int64_t>{1, 1}, {2, 5}, {1, 17}, {2, 217}}) {
      for (auto [NH, NKV] : {std::pair<int64_t, int64_t>{4, 4}, {4, 2}, {4, 1}}) {
        for (int64_t HS : {16, 64, 128}) {
          Cfg c{B, T, NH, NKV, HS};
          c.dt = dt;
          switch (variant++ % 4) {  // rotate the masks through the shapes
            case 0: break;
            case 1: c.causal = false; break;
            case 2: c.window = 7; break;
            case 3: c.segments = true; break;
          }
          check_case(c);
        }
      }
    }
  }
}

TEST(CudaAttention, MasksOnLongSequence) {
  REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Cfg c{2, 217, 4, 2, 64};
    c.dt = dt;
    c.window = 50;  // straddles tile edges
    check_case(c);
    c.window = -1;
    c.segments = true;
    check_case(c);
    c.causal = false;  // segments without causality
    check_case(c);
    c.causal = true;
    c.window = 33;
    check_case(c);  // window and segments together
  }
}

TEST(CudaAttention, OddHeadSizes) {
  REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t HS : {24, 20, 7}) {  // multiple of 8 but not 16; not a multiple of 8 (scalar loads)
      Cfg c{2, 17, 4, 2, HS};
      c.dt = dt;
      check_case(c);
      c.T = 217;
      c.causal = false;
      check_case(c);
    }
  }
}

TEST(CudaAttention, LargeHeadSize) {
  REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Cfg c{1, 130, 2, 1, 256};
    c.dt = dt;
    check_case(c);
  }
}

TEST(CudaAttention, DropoutMatchesCpuMask) {
  REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (auto [T, HS] : {std::pair<int64_t, int64_t>{17, 16}, {217, 64}, {5, 128}}) {
      Cfg c{2, T, 4, 2, HS};
      c.dt = dt;
      c.dropout = 0.1f;
      check_case(c);
      c.causal = false;
      c.segments = true;
      check_case(c);
    }
  }
}

// The register-tiled kernels (flash_attention.cu) take 16-bit, head size 64/128, no window, segments or
// dropout: several 64-row tiles, a ragged last tile, MHA/GQA/MQA, causal and not; the same inputs twice give
// the same bytes.
TEST(CudaAttention, FlashPathLongSequences) {
  REQUIRE_GPU();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const Cfg cases[] = {{2, 333, 4, 2, 64}, {1, 256, 2, 1, 128}, {1, 200, 4, 4, 128, false}, {2, 130, 6, 2, 64, false},
                         {1, 64, 2, 2, 64}, {3, 71, 3, 1, 128}};
    for (Cfg c : cases) {
      c.dt = dt;
      check_case(c);
    }
    Cfg c{2, 333, 4, 1, 128};
    c.dt = dt;
    const Tensor qkv = random_host(Shape{c.B, c.T, c.qkv_cols()}, dt, 15);
    const Tensor dout = random_host(Shape{c.B, c.T, c.NH * c.HS}, dt, 16);
    const Results a = run_cuda(c, qkv, dout, Tensor()), b = run_cuda(c, qkv, dout, Tensor());
    EXPECT_TRUE(same_bytes(a.out, b.out)) << c.name();
    EXPECT_TRUE(same_bytes(a.lse, b.lse)) << c.name();
    EXPECT_TRUE(same_bytes(a.dqkv, b.dqkv)) << c.name();
  }
}

TEST(CudaAttention, Deterministic) {
  REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Cfg c{2, 217, 4, 1, 64};
    c.dt = dt;
    c.dropout = 0.1f;
    c.segments = true;
    const Tensor qkv = random_host(Shape{c.B, c.T, c.qkv_cols()}, dt, 5);
    const Tensor dout = random_host(Shape{c.B, c.T, c.NH * c.HS}, dt, 6);
    const Tensor seg = segment_ids(c.B, c.T);
    const Results a = run_cuda(c, qkv, dout, seg), b = run_cuda(c, qkv, dout, seg);
    EXPECT_TRUE(same_bytes(a.out, b.out)) << c.name();
    EXPECT_TRUE(same_bytes(a.lse, b.lse)) << c.name();
    EXPECT_TRUE(same_bytes(a.dqkv, b.dqkv)) << c.name();
  }
}

TEST(CudaAttention, RejectsBadArguments) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const Cfg c{1, 5, 4, 2, 16};
  const Tensor qkv = to_device(random_host(Shape{1, 5, c.qkv_cols()}, DType::kF32, 1));
  Tensor out = ctx.empty(Shape{1, 5, 64}, DType::kF32), lse = ctx.empty(Shape{1, 4, 5}, DType::kF32);
  AttentionParams p = c.params();
  EXPECT_NO_THROW(cuda_ops().attention_forward(out, lse, qkv, p, {}));
  Tensor bad_out = ctx.empty(Shape{1, 5, 63}, DType::kF32);
  EXPECT_ANY_THROW(cuda_ops().attention_forward(bad_out, lse, qkv, p, {}));
  Tensor bf_out = ctx.empty(Shape{1, 5, 64}, DType::kBF16);
  EXPECT_ANY_THROW(cuda_ops().attention_forward(bf_out, lse, qkv, p, {}));
  Tensor bad_lse = ctx.empty(Shape{1, 5, 4}, DType::kF32);
  EXPECT_ANY_THROW(cuda_ops().attention_forward(out, bad_lse, qkv, p, {}));
  Tensor host_out = Tensor::empty(Shape{1, 5, 64}, DType::kF32);
  EXPECT_ANY_THROW(cuda_ops().attention_forward(host_out, lse, qkv, p, {}));
  Tensor bad_seg = ctx.empty(Shape{1, 4}, DType::kI32);
  EXPECT_ANY_THROW(cuda_ops().attention_forward(out, lse, qkv, p, bad_seg));
  AttentionParams q = p;
  q.num_kv_heads = 3;
  EXPECT_ANY_THROW(cuda_ops().attention_forward(out, lse, qkv, q, {}));
  q = p;
  q.causal = false;
  q.window = 4;
  EXPECT_ANY_THROW(cuda_ops().attention_forward(out, lse, qkv, q, {}));
  q = p;
  q.dropout_p = 1.0f;
  EXPECT_ANY_THROW(cuda_ops().attention_forward(out, lse, qkv, q, {}));
  q = p;
  q.head_dim = 17;  // qkv's last dim no longer matches
  EXPECT_ANY_THROW(cuda_ops().attention_forward(out, lse, qkv, q, {}));
  Tensor dqkv = ctx.empty(qkv.shape(), DType::kBF16);
  Tensor dout = ctx.empty(Shape{1, 5, 64}, DType::kF32);
  EXPECT_ANY_THROW(cuda_ops().attention_backward(dqkv, dout, qkv, out, lse, p, {}));
  ctx.synchronize();
}

// ---- block ops --------------------------------------------------------------------------------------------

struct BlockIn {
  Tensor q, kv;        // host: packed q (B, Tq, qkv_cols); kv packed or compact (B, Tk, ...)
  Tensor q_pos, k_pos;  // host i32
  Tensor q_seg, k_seg;  // host i32 (B, T) or empty
};

AttentionBlock device_block(const BlockIn& in, int64_t seq_len, std::vector<Tensor>& keep) {
  AttentionBlock blk;
  keep.push_back(to_device(in.q_pos));
  blk.q_pos = keep.back();
  keep.push_back(to_device(in.k_pos));
  blk.k_pos = keep.back();
  if (in.q_seg.defined()) {
    keep.push_back(to_device(in.q_seg));
    blk.q_segment_ids = keep.back();
    keep.push_back(to_device(in.k_seg));
    blk.k_segment_ids = keep.back();
  }
  blk.seq_len = seq_len;
  return blk;
}
AttentionBlock host_block(const BlockIn& in, int64_t seq_len) {
  AttentionBlock blk;
  blk.q_pos = in.q_pos;
  blk.k_pos = in.k_pos;
  if (in.q_seg.defined()) {
    blk.q_segment_ids = in.q_seg;
    blk.k_segment_ids = in.k_seg;
  }
  blk.seq_len = seq_len;
  return blk;
}

// Rows `rows` of a host (B, T, ...) tensor, stacked.
Tensor gather(const Tensor& t, const std::vector<int32_t>& rows) {
  const int64_t B = t.size(0), T = t.size(1), R = t.numel() / (B * T), n = int64_t(rows.size());
  Tensor out = Tensor::empty(t.ndim() == 2 ? Shape{B, n} : Shape{B, n, t.size(2)}, t.dtype());
  const size_t es = dtype_size(t.dtype());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < n; ++k)
      std::memcpy(static_cast<char*>(out.raw()) + size_t((b * n + k) * R) * es,
                  static_cast<const char*>(t.raw()) + size_t((b * T + rows[size_t(k)]) * R) * es, size_t(R) * es);
  return out;
}

// A CP-like split: the queries are two chunks far apart (positions given), the keys another set of
// positions in scrambled order; compares block forward, merge and block backward with the CPU.
TEST(CudaAttentionBlocks, MatchCpu) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  const int64_t B = 2, T = 96;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int variant = 0; variant < 4; ++variant) {
      Cfg c{B, T, 4, (variant % 2) ? 1 : 2, variant == 3 ? 24 : 64};
      c.dt = dt;
      c.window = variant == 1 ? 20 : -1;
      c.dropout = variant >= 2 ? 0.1f : 0.0f;
      c.segments = variant == 2;
      SCOPED_TRACE(c.name());
      const AttentionParams p = c.params();
      const Tensor qkv = random_host(Shape{B, T, c.qkv_cols()}, dt, 40 + uint64_t(variant));
      const Tensor seg = segment_ids(B, T);
      std::vector<int32_t> qrows, krows;
      for (int32_t t = 5; t < 22; ++t) qrows.push_back(t);  // chunk 1 (17 queries)
      for (int32_t t = 70; t < 91; ++t) qrows.push_back(t);  // chunk 2
      for (int32_t t = 0; t < T; t += 3) krows.push_back(int32_t((t * 37) % T));  // scrambled keys
      BlockIn in;
      in.q = gather(qkv, qrows);
      const Tensor kv_packed = gather(qkv, krows);
      in.q_pos = i32_host(qrows);
      in.k_pos = i32_host(krows);
      if (c.segments) {
        in.q_seg = gather(seg, qrows);
        in.k_seg = gather(seg, krows);
      }
      const int64_t Tq = int64_t(qrows.size()), Tk = int64_t(krows.size());
      // Compact kv through both backends' pack (bit copies: must agree exactly).
      Tensor kv_c_cpu = nan_host(Shape{B, Tk, c.NKV * 2 * c.HS}, dt);
      cpu_ref().attention_kv_pack(kv_c_cpu, kv_packed, p);
      Tensor kv_c_dev = nan_device(kv_c_cpu.shape(), dt);
      cuda::attention_kv_pack(ctx, kv_c_dev, to_device(kv_packed), p);
      EXPECT_TRUE(same_bytes(to_host(kv_c_dev), kv_c_cpu)) << "kv_pack";

      for (bool compact : {false, true}) {
        in.kv = compact ? kv_c_cpu : kv_packed;
        std::vector<Tensor> keep;
        const AttentionBlock dblk = device_block(in, T, keep);
        const AttentionBlock hblk = host_block(in, T);
        const Tensor dqd = to_device(in.q), dkv = to_device(in.kv);
        for (DType odt : {dt, DType::kF32}) {  // out in the compute dtype or f32
          const Shape out_s{B, Tq, c.NH * c.HS}, lse_s{B, c.NH, Tq};
          Tensor out = nan_device(out_s, odt), lse = nan_device(lse_s, DType::kF32);
          cuda::attention_block_forward(ctx, out, lse, dqd, dkv, dblk, p);
          Tensor rout = nan_host(out_s, odt), rlse = nan_host(lse_s, DType::kF32);
          cpu_ref().attention_block_forward(rout, rlse, in.q, in.kv, hblk, p);
          const Tensor hout = to_host(out), hlse = to_host(lse);
          expect_close(hout, rout, out_tol(dt), "block out");
          expect_close(hlse, rlse, lse_tol(dt), "block lse");

          // Backward accumulates into pre-filled f32 dq / dkv; dout in the out dtype.
          const Tensor dout = random_host(out_s, odt, 77);
          const Tensor dq0 = random_host(Shape{B, Tq, c.NH * c.HS}, DType::kF32, 78);
          const Tensor dkv0 = random_host(Shape{B, Tk, c.NKV * 2 * c.HS}, DType::kF32, 79);
          Tensor gdq = to_device(dq0), gdkv = to_device(dkv0);
          cuda::attention_block_backward(ctx, gdq, gdkv, to_device(dout), dqd, dkv, out, lse, dblk, p);
          Tensor rdq = host_clone(dq0), rdkv = host_clone(dkv0);
          cpu_ref().attention_block_backward(rdq, rdkv, dout, in.q, in.kv, hout, hlse, hblk, p);
          expect_close(to_host(gdq), rdq, grad_tol(dt), "block dq");
          expect_close(to_host(gdkv), rdkv, grad_tol(dt), "block dkv");
        }
      }
    }
  }
}

// Keys cut into two blocks and merged equal one block over all keys (and the whole-sequence op); the block
// backwards of the two halves add up to the whole one; unpack reassembles dqkv like the CPU.
TEST(CudaAttentionBlocks, TwoBlocksMergedEqualTheWhole) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Cfg c{2, 217, 4, 2, 64};
    c.dt = dt;
    c.dropout = 0.1f;
    c.segments = true;
    SCOPED_TRACE(c.name());
    const AttentionParams p = c.params();
    const int64_t T = c.T, split = 100;
    const Tensor qkv = random_host(Shape{c.B, T, c.qkv_cols()}, dt, 3);
    const Tensor seg = segment_ids(c.B, T);
    std::vector<int32_t> all(static_cast<size_t>(T));
    std::iota(all.begin(), all.end(), 0);
    const std::vector<int32_t> lo(all.begin(), all.begin() + split), hi(all.begin() + split, all.end());
    const Tensor dqkv_in = to_device(qkv), dseg = to_device(seg);

    // Whole-sequence reference on the GPU.
    const Shape out_s{c.B, T, c.NH * c.HS}, lse_s{c.B, c.NH, T};
    Tensor wout = nan_device(out_s, DType::kF32), wlse = nan_device(lse_s, DType::kF32);
    {
      AttentionBlock blk;
      Tensor qp = to_device(i32_host(all));
      blk.q_pos = qp;
      blk.k_pos = qp;
      blk.q_segment_ids = dseg;
      blk.k_segment_ids = dseg;
      blk.seq_len = T;
      cuda::attention_block_forward(ctx, wout, wlse, dqkv_in, dqkv_in, blk, p);
      // One block over everything equals attention_forward (same mask, same positions).
      Tensor fout = nan_device(out_s, dt), flse = nan_device(lse_s, DType::kF32);
      cuda::attention_forward(ctx, fout, flse, dqkv_in, p, dseg);
      expect_close(to_host(flse), to_host(wlse), 1e-5f, "one block lse vs attention_forward");
      expect_close(to_host(fout), to_host(wout), out_tol(dt), "one block out vs attention_forward");
    }
    // Two key blocks (compact kv), merged.
    Tensor kv = nan_device(Shape{c.B, T, c.NKV * 2 * c.HS}, dt);
    cuda::attention_kv_pack(ctx, kv, dqkv_in, p);
    const Tensor kv_h = to_host(kv);
    Tensor acc_out, acc_lse;
    std::vector<Tensor> keep;
    std::vector<AttentionBlock> blocks;
    std::vector<Tensor> kvs;
    for (const auto* rows : {&lo, &hi}) {
      AttentionBlock blk;
      keep.push_back(to_device(i32_host(all)));
      blk.q_pos = keep.back();
      keep.push_back(to_device(i32_host(*rows)));
      blk.k_pos = keep.back();
      blk.q_segment_ids = dseg;
      keep.push_back(to_device(gather(seg, *rows)));
      blk.k_segment_ids = keep.back();
      blk.seq_len = T;
      blocks.push_back(blk);
      kvs.push_back(to_device(gather(kv_h, *rows)));
      Tensor out = nan_device(out_s, DType::kF32), lse = nan_device(lse_s, DType::kF32);
      cuda::attention_block_forward(ctx, out, lse, dqkv_in, kvs.back(), blk, p);
      if (!acc_out.defined()) {
        acc_out = out;
        acc_lse = lse;
      } else {
        // The CPU merge of the same partials is the reference for the CUDA merge.
        Tensor rout = to_host(acc_out), rlse = to_host(acc_lse);
        cpu_ref().attention_merge(rout, rlse, to_host(out), to_host(lse));
        cuda::attention_merge(ctx, acc_out, acc_lse, out, lse);
        expect_close(to_host(acc_out), rout, 1e-5f, "merge out vs cpu");
        expect_close(to_host(acc_lse), rlse, 1e-5f, "merge lse vs cpu");
      }
    }
    expect_close(to_host(acc_lse), to_host(wlse), 1e-5f, "merged lse vs whole");
    expect_close(to_host(acc_out), to_host(wout), dt == DType::kF32 ? 1e-5f : 1e-2f, "merged out vs whole");

    // Block backwards with the final out/lse add up to the whole block's backward.
    const Tensor dout = to_device(random_host(out_s, DType::kF32, 8));
    Tensor dq = to_device(Tensor::zeros(Shape{c.B, T, c.NH * c.HS}, DType::kF32));
    Tensor dkv_lo = to_device(Tensor::zeros(Shape{c.B, split, c.NKV * 2 * c.HS}, DType::kF32));
    Tensor dkv_hi = to_device(Tensor::zeros(Shape{c.B, T - split, c.NKV * 2 * c.HS}, DType::kF32));
    cuda::attention_block_backward(ctx, dq, dkv_lo, dout, dqkv_in, kvs[0], wout, wlse, blocks[0], p);
    cuda::attention_block_backward(ctx, dq, dkv_hi, dout, dqkv_in, kvs[1], wout, wlse, blocks[1], p);
    Tensor wdq = to_device(Tensor::zeros(Shape{c.B, T, c.NH * c.HS}, DType::kF32));
    Tensor wdkv = to_device(Tensor::zeros(Shape{c.B, T, c.NKV * 2 * c.HS}, DType::kF32));
    {
      AttentionBlock blk;
      Tensor qp = to_device(i32_host(all));
      blk.q_pos = qp;
      blk.k_pos = qp;
      blk.q_segment_ids = dseg;
      blk.k_segment_ids = dseg;
      blk.seq_len = T;
      cuda::attention_block_backward(ctx, wdq, wdkv, dout, dqkv_in, kv, wout, wlse, blk, p);
    }
    const float gt = dt == DType::kF32 ? 1e-4f : 2e-2f;
    expect_close(to_host(dq), to_host(wdq), gt, "summed block dq vs whole");
    const Tensor wdkv_h = to_host(wdkv);
    expect_close(to_host(dkv_lo), gather(wdkv_h, lo), gt, "block dkv (low keys) vs whole");
    expect_close(to_host(dkv_hi), gather(wdkv_h, hi), gt, "block dkv (high keys) vs whole");

    // Unpack: bit-identical to the CPU's.
    Tensor dqkv = nan_device(qkv.shape(), dt);
    cuda::attention_qkv_grad_unpack(ctx, dqkv, wdq, wdkv, p);
    Tensor rdqkv = nan_host(qkv.shape(), dt);
    cpu_ref().attention_qkv_grad_unpack(rdqkv, to_host(wdq), wdkv_h, p);
    EXPECT_TRUE(same_bytes(to_host(dqkv), rdqkv)) << "qkv_grad_unpack";
  }
}

TEST(CudaAttentionBlocks, NoVisibleKeyGivesZeroAndMinusInf) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  Cfg c{1, 8, 2, 1, 16};
  const AttentionParams p = c.params();  // causal
  const Tensor q = random_host(Shape{1, 3, c.qkv_cols()}, DType::kF32, 1);
  const Tensor kv = random_host(Shape{1, 4, c.NKV * 2 * c.HS}, DType::kF32, 2);
  BlockIn in;
  in.q = q;
  in.kv = kv;
  in.q_pos = i32_host({0, 1, 7});  // queries 0 and 1 see none of the keys 2..5
  in.k_pos = i32_host({2, 3, 4, 5});
  std::vector<Tensor> keep;
  const AttentionBlock blk = device_block(in, 8, keep);
  Tensor out = nan_device(Shape{1, 3, 32}, DType::kF32), lse = nan_device(Shape{1, 2, 3}, DType::kF32);
  cuda::attention_block_forward(ctx, out, lse, to_device(q), to_device(kv), blk, p);
  Tensor rout = nan_host(Shape{1, 3, 32}, DType::kF32), rlse = nan_host(Shape{1, 2, 3}, DType::kF32);
  cpu_ref().attention_block_forward(rout, rlse, q, kv, host_block(in, 8), p);
  expect_close(to_host(out), rout, 1e-5f, "out");
  const Tensor hl = to_host(lse);
  EXPECT_EQ(hl.data<float>()[0], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(hl.data<float>()[1], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isfinite(hl.data<float>()[2]));
  // Backward: rows with lse -inf contribute nothing (no NaN from exp(s - lse)).
  Tensor dq = to_device(Tensor::zeros(Shape{1, 3, 32}, DType::kF32));
  Tensor dkv = to_device(Tensor::zeros(Shape{1, 4, 32}, DType::kF32));
  const Tensor dout = random_host(Shape{1, 3, 32}, DType::kF32, 3);
  cuda::attention_block_backward(ctx, dq, dkv, to_device(dout), to_device(q), to_device(kv), out, lse, blk, p);
  Tensor rdq = Tensor::zeros(Shape{1, 3, 32}, DType::kF32), rdkv = Tensor::zeros(Shape{1, 4, 32}, DType::kF32);
  cpu_ref().attention_block_backward(rdq, rdkv, dout, q, kv, to_host(out), hl, host_block(in, 8), p);
  expect_close(to_host(dq), rdq, 1e-4f, "dq");
  expect_close(to_host(dkv), rdkv, 1e-4f, "dkv");
}

TEST(CudaAttentionBlocks, RejectsBadArguments) {
  REQUIRE_GPU();
  auto& ctx = cuda_ctx();
  Cfg c{1, 5, 2, 1, 16};
  AttentionParams p = c.params();
  const Tensor q = to_device(random_host(Shape{1, 5, c.qkv_cols()}, DType::kF32, 1));
  const Tensor kv = to_device(random_host(Shape{1, 4, 32}, DType::kF32, 2));
  BlockIn in;
  in.q_pos = i32_host({0, 1, 2, 3, 4});
  in.k_pos = i32_host({0, 1, 2, 3});
  std::vector<Tensor> keep;
  AttentionBlock blk = device_block(in, 5, keep);
  Tensor out = ctx.empty(Shape{1, 5, 32}, DType::kF32), lse = ctx.empty(Shape{1, 2, 5}, DType::kF32);
  EXPECT_NO_THROW(cuda_ops().attention_block_forward(out, lse, q, kv, blk, p));
  AttentionBlock b2 = blk;
  b2.k_pos = keep[0];  // wrong length
  EXPECT_ANY_THROW(cuda_ops().attention_block_forward(out, lse, q, kv, b2, p));
  const Tensor kv_bad = ctx.empty(Shape{1, 4, 33}, DType::kF32);
  EXPECT_ANY_THROW(cuda_ops().attention_block_forward(out, lse, q, kv_bad, blk, p));
  AttentionParams pd = p;
  pd.dropout_p = 0.1f;
  b2 = blk;
  b2.seq_len = 0;
  EXPECT_ANY_THROW(cuda_ops().attention_block_forward(out, lse, q, kv, b2, pd));
  Tensor dq_bf = ctx.empty(Shape{1, 5, 32}, DType::kBF16), dkv = ctx.empty(Shape{1, 4, 32}, DType::kF32);
  EXPECT_ANY_THROW(cuda_ops().attention_block_backward(dq_bf, dkv, out, q, kv, out, lse, blk, p));
  Tensor lse_bad = ctx.empty(Shape{1, 2, 4}, DType::kF32);
  EXPECT_ANY_THROW(cuda_ops().attention_merge(out, lse, out, lse_bad));
  Tensor kvp = ctx.empty(Shape{1, 5, 31}, DType::kF32);
  EXPECT_ANY_THROW(cuda_ops().attention_kv_pack(kvp, q, p));
  Tensor dqkv = ctx.empty(q.shape(), DType::kF32), dq = ctx.empty(Shape{1, 5, 32}, DType::kBF16);
  Tensor dkv5 = ctx.empty(Shape{1, 5, 32}, DType::kF32);
  EXPECT_ANY_THROW(cuda_ops().attention_qkv_grad_unpack(dqkv, dq, dkv5, p));
  ctx.synchronize();
}

}  // namespace
}  // namespace loom
#endif  // LOOM_HAVE_CUDA
