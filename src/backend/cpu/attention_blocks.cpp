// CPU attention blocks for context parallelism (ops.h, AttentionBlock): the queries of one packed qkv tensor
// against the keys/values of another block with explicit global positions, the merge of partial results,
// the block backward, and the K/V pack / dqkv unpack around them.
//
// Why a separate, simpler kernel than attention.cpp: a rank's tokens are two chunks far apart in the
// sequence, and a block's positions are arbitrary per token, so visibility is decided by comparing
// positions, one query row at a time, with an exact two-pass softmax over the block's keys (Tk floats of
// scratch per thread). The tiled kernel stays the fast single-device path; with CP = 1 the parallel layer
// calls it instead of these.
// Numerics: every input row is widened to f32 once, all arithmetic is f32, results are rounded once when
// stored. The dropout mask is dropout_keep of the non-CP kernel's element index with the global sequence
// length and positions, so a sequence cut into blocks drops exactly what attention_forward drops.
// Determinism: forward tasks are (b, head), backward tasks are (b, kv group), merge/pack tasks are rows;
// each task owns every element it writes (dq rows of its group's heads, dkv rows of its group), so the
// results do not depend on the number of threads.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/lowp.h"
#include "loom/core/rng.h"

namespace loom::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// dst[0, n) = elements [off, off + n) of base (dtype dt) widened to f32 (exact).
void widen(float* dst, const void* base, DType dt, int64_t off, int64_t n) {
  switch (dt) {
    case DType::kF32: std::memcpy(dst, static_cast<const float*>(base) + off, size_t(n) * sizeof(float)); return;
    case DType::kBF16: Lowp<DType::kBF16>::widen(dst, static_cast<const uint16_t*>(base) + off, n); return;
    case DType::kF16: Lowp<DType::kF16>::widen(dst, static_cast<const uint16_t*>(base) + off, n); return;
    default: LOOM_FAIL("[attention_block] unsupported dtype ", dtype_name(dt));
  }
}

// Elements [off, off + n) of base (dtype dt) = src[0, n) rounded to the dtype (nearest even).
void narrow(void* base, DType dt, int64_t off, const float* src, int64_t n) {
  switch (dt) {
    case DType::kF32: std::memcpy(static_cast<float*>(base) + off, src, size_t(n) * sizeof(float)); return;
    case DType::kBF16: Lowp<DType::kBF16>::narrow(static_cast<uint16_t*>(base) + off, src, n); return;
    case DType::kF16: Lowp<DType::kF16>::narrow(static_cast<uint16_t*>(base) + off, src, n); return;
    default: LOOM_FAIL("[attention_block] unsupported dtype ", dtype_name(dt));
  }
}

// Head geometry shared by the block ops (Megatron's grouped layout, see attention_forward).
struct Heads {
  int64_t NH, NKV, G, HS;
  int64_t qkv_row() const { return NKV * (G + 2) * HS; }
  int64_t kv_row() const { return NKV * 2 * HS; }
  int64_t out_row() const { return NH * HS; }
  int64_t q_col(int64_t h) const { return ((h / G) * (G + 2) + h % G) * HS; }
};

Heads make_heads(const AttentionParams& p) {
  return Heads{p.num_heads, p.num_kv_heads, p.num_heads / p.num_kv_heads, p.head_dim};
}

struct BlockGeometry : Heads {
  int64_t B, Tq, Tk;
  int64_t kv_g;  // query heads per group in kv's layout: G (packed qkv) or 0 (compact kv)
  float scale;
  bool causal;
  int64_t window;
  DType dtype;  // of q and kv
  const int32_t* q_pos;
  const int32_t* k_pos;
  const int32_t* q_seg = nullptr;  // (B, Tq) or null
  const int32_t* k_seg = nullptr;  // (B, Tk) or null
  bool dropout = false;
  uint64_t seed = 0, stream = 0, seq_len = 0;
  uint32_t threshold = 0;
  float keep_scale = 1;

  int64_t kv_stride() const { return NKV * (kv_g + 2) * HS; }
  int64_t k_col(int64_t g) const { return (g * (kv_g + 2) + kv_g) * HS; }
  int64_t v_col(int64_t g) const { return k_col(g) + HS; }
  bool visible(int64_t b, int64_t i, int64_t j) const {
    const int32_t qi = q_pos[i], kj = k_pos[j];
    if (causal && kj > qi) return false;
    if (window > 0 && int64_t(kj) <= int64_t(qi) - window) return false;
    return !q_seg || q_seg[b * Tq + i] == k_seg[b * Tk + j];
  }
  // The dropout factor of (b, h, i, j): 1 / (1 - p) when kept, 0 when dropped.
  float keep(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const uint64_t idx = (uint64_t(b * NH + h) * seq_len + uint64_t(q_pos[i])) * seq_len + uint64_t(k_pos[j]);
    return dropout_keep(seed, stream, idx, threshold) ? keep_scale : 0.0f;
  }
};

BlockGeometry make_block_geometry(TensorView q, TensorView kv, const AttentionBlock& blk, const AttentionParams& p,
                                  const char* op) {
  BlockGeometry g{};
  static_cast<Heads&>(g) = make_heads(p);
  g.dtype = q.dtype();
  g.B = q.size(0);
  g.Tq = q.size(1);
  g.Tk = kv.size(1);
  g.kv_g = kv.size(2) == g.qkv_row() ? g.G : 0;
  g.scale = p.softmax_scale;
  g.causal = p.causal;
  g.window = p.window;
  g.q_pos = blk.q_pos.data<int32_t>();
  g.k_pos = blk.k_pos.data<int32_t>();
  if (blk.q_segment_ids.defined()) {
    g.q_seg = blk.q_segment_ids.data<int32_t>();
    g.k_seg = blk.k_segment_ids.data<int32_t>();
  }
  if (p.dropout_p > 0.0f) {
    // The positions index the dropout mask. They are in host memory here, so the CPU checks them (the GPU
    // cannot without a copy and a sync); the shapes and seq_len > 0 were checked by the OpTable entry point.
    for (int64_t i = 0; i < g.Tq; ++i)
      LOOM_CHECK(g.q_pos[i] >= 0 && g.q_pos[i] < blk.seq_len, "[", op, "] q_pos[", i, "] = ", g.q_pos[i],
                 " is outside [0, seq_len = ", blk.seq_len, ")");
    for (int64_t j = 0; j < g.Tk; ++j)
      LOOM_CHECK(g.k_pos[j] >= 0 && g.k_pos[j] < blk.seq_len, "[", op, "] k_pos[", j, "] = ", g.k_pos[j],
                 " is outside [0, seq_len = ", blk.seq_len, ")");
    g.dropout = true;
    g.seed = p.dropout_seed;
    g.stream = p.dropout_stream;
    g.seq_len = uint64_t(blk.seq_len);
    g.threshold = dropout_threshold(p.dropout_p);
    g.keep_scale = 1.0f / (1.0f - p.dropout_p);
  }
  return g;
}

// The key and value rows of group grp of batch row b, widened: k, v (Tk x HS).
void load_kv(float* k, float* v, const void* kv, const BlockGeometry& g, int64_t b, int64_t grp) {
  for (int64_t j = 0; j < g.Tk; ++j) {
    const int64_t row = (b * g.Tk + j) * g.kv_stride();
    widen(k + j * g.HS, kv, g.dtype, row + g.k_col(grp), g.HS);
    widen(v + j * g.HS, kv, g.dtype, row + g.v_col(grp), g.HS);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

}  // namespace

void CpuOps::do_attention_block_forward(TensorView out, TensorView lse, TensorView q, TensorView kv,
                                        const AttentionBlock& blk, const AttentionParams& p) const {
  const char* op = "attention_block_forward";
  const BlockGeometry g = make_block_geometry(q, kv, blk, p, op);
  const void* x = q.raw();
  const void* y = kv.raw();
  float* ls = lse.data<float>();
  const int64_t tasks = g.B * g.NH;
#pragma omp parallel if (tasks > 1)
  {
    std::vector<float> k(size_t(g.Tk * g.HS)), v(size_t(g.Tk * g.HS)), s(size_t(std::max<int64_t>(g.Tk, 1)));
    std::vector<float> qr(size_t(g.HS)), o(size_t(g.HS));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / g.NH, h = task % g.NH;
      load_kv(k.data(), v.data(), y, g, b, h / g.G);
      for (int64_t i = 0; i < g.Tq; ++i) {
        widen(qr.data(), x, g.dtype, (b * g.Tq + i) * g.qkv_row() + g.q_col(h), g.HS);
        for (float& e : qr) e *= g.scale;  // scores come out scaled, as in attention_forward
        float m = kNegInf;
        for (int64_t j = 0; j < g.Tk; ++j) {
          s[j] = g.visible(b, i, j) ? dot(qr.data(), k.data() + j * g.HS, g.HS) : kNegInf;
          m = std::max(m, s[j]);
        }
        std::fill(o.begin(), o.end(), 0.0f);
        float l = 0;
        if (m != kNegInf) {
          for (int64_t j = 0; j < g.Tk; ++j) {
            if (s[j] == kNegInf) continue;
            const float e = std::exp(s[j] - m);
            l += e;  // the normaliser sums the undropped probabilities
            const float w = g.dropout ? e * g.keep(b, h, i, j) : e;
            if (w != 0.0f) axpy(o.data(), w, v.data() + j * g.HS, g.HS);
          }
          const float inv = 1.0f / l;
          for (float& e : o) e *= inv;
        }
        narrow(out.raw(), out.dtype(), (b * g.Tq + i) * g.out_row() + h * g.HS, o.data(), g.HS);
        ls[(b * g.NH + h) * g.Tq + i] = m == kNegInf ? kNegInf : m + std::log(l);
      }
    }
  }
}

void CpuOps::do_attention_merge(TensorView out, TensorView lse, TensorView out_block, TensorView lse_block) const {
  const int64_t B = out.size(0), T = out.size(1), NH = lse.size(1), HS = out.size(2) / NH;
  float* la = lse.data<float>();
  const float* lb = lse_block.data<float>();
  const int64_t rows = B * T;
#pragma omp parallel if (rows > 1)
  {
    std::vector<float> a(static_cast<size_t>(HS)), c(static_cast<size_t>(HS));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r / T, t = r % T;
      for (int64_t h = 0; h < NH; ++h) {
        const int64_t li = (b * NH + h) * T + t, off = r * NH * HS + h * HS;
        const float x = la[li], y = lb[li];
        if (y == kNegInf) continue;  // nothing visible in the block
        widen(c.data(), out_block.raw(), out_block.dtype(), off, HS);
        if (x == kNegInf) {  // nothing visible so far: the block's result is the result
          narrow(out.raw(), out.dtype(), off, c.data(), HS);
          la[li] = y;
          continue;
        }
        const float mx = std::max(x, y);
        const float lsum = mx + std::log(std::exp(x - mx) + std::exp(y - mx));
        const float wa = std::exp(x - lsum), wb = std::exp(y - lsum);
        widen(a.data(), out.raw(), out.dtype(), off, HS);
#pragma omp simd
        for (int64_t d = 0; d < HS; ++d) a[d] = wa * a[d] + wb * c[d];
        narrow(out.raw(), out.dtype(), off, a.data(), HS);
        la[li] = lsum;
      }
    }
  }
}

void CpuOps::do_attention_block_backward(TensorView dq, TensorView dkv, TensorView dout, TensorView q, TensorView kv,
                                         TensorView out, TensorView lse, const AttentionBlock& blk,
                                         const AttentionParams& p) const {
  const char* op = "attention_block_backward";
  const BlockGeometry g = make_block_geometry(q, kv, blk, p, op);
  const void* x = q.raw();
  const void* y = kv.raw();
  const float* ls = lse.data<float>();
  float* dqp = dq.data<float>();
  float* dkvp = dkv.data<float>();
  const int64_t tasks = g.B * g.NKV;
#pragma omp parallel if (tasks > 1)
  {
    const size_t kvn = size_t(g.Tk * g.HS);
    std::vector<float> k(kvn), v(kvn), dk(kvn), dv(kvn);
    std::vector<float> qr(size_t(g.HS)), dyr(size_t(g.HS)), yr(size_t(g.HS)), dqr(size_t(g.HS));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / g.NKV, grp = task % g.NKV;
      load_kv(k.data(), v.data(), y, g, b, grp);
      std::fill(dk.begin(), dk.end(), 0.0f);
      std::fill(dv.begin(), dv.end(), 0.0f);
      for (int64_t h = grp * g.G; h < (grp + 1) * g.G; ++h) {
        for (int64_t i = 0; i < g.Tq; ++i) {
          const float L = ls[(b * g.NH + h) * g.Tq + i];
          if (L == kNegInf) continue;  // the query sees no key at all: every gradient of it is 0
          widen(qr.data(), x, g.dtype, (b * g.Tq + i) * g.qkv_row() + g.q_col(h), g.HS);
          const int64_t orow = (b * g.Tq + i) * g.out_row() + h * g.HS;
          widen(dyr.data(), dout.raw(), dout.dtype(), orow, g.HS);
          widen(yr.data(), out.raw(), out.dtype(), orow, g.HS);
          const float D = dot(dyr.data(), yr.data(), g.HS);
          std::fill(dqr.begin(), dqr.end(), 0.0f);
          for (int64_t j = 0; j < g.Tk; ++j) {
            if (!g.visible(b, i, j)) continue;
            const float* kj = k.data() + j * g.HS;
            const float* vj = v.data() + j * g.HS;
            const float pr = std::exp(dot(qr.data(), kj, g.HS) * g.scale - L);
            const float dp = dot(dyr.data(), vj, g.HS);
            const float z = g.dropout ? g.keep(b, h, i, j) : 1.0f;
            // Dropout: dV uses the dropped, rescaled probabilities; dS = P * (dP * Z / (1 - p) - D).
            const float ds = pr * (dp * z - D) * g.scale;
            axpy(dv.data() + j * g.HS, pr * z, dyr.data(), g.HS);
            axpy(dk.data() + j * g.HS, ds, qr.data(), g.HS);
            axpy(dqr.data(), ds, kj, g.HS);
          }
          float* dst = dqp + orow;
#pragma omp simd
          for (int64_t d = 0; d < g.HS; ++d) dst[d] += dqr[d];
        }
      }
      for (int64_t j = 0; j < g.Tk; ++j) {
        float* row = dkvp + (b * g.Tk + j) * g.kv_row() + 2 * grp * g.HS;
        const float* a = dk.data() + j * g.HS;
        const float* c = dv.data() + j * g.HS;
#pragma omp simd
        for (int64_t d = 0; d < g.HS; ++d) {
          row[d] += a[d];
          row[g.HS + d] += c[d];
        }
      }
    }
  }
}

void CpuOps::do_attention_kv_pack(TensorView kv, TensorView qkv, const AttentionParams& p) const {
  const Heads hd = make_heads(p);
  const int64_t rows = qkv.size(0) * qkv.size(1);
  const size_t es = dtype_size(qkv.dtype());
  const size_t head_bytes = size_t(2 * hd.HS) * es;  // a group's key and value heads are adjacent in qkv
  const char* src = static_cast<const char*>(qkv.raw());
  char* dst = static_cast<char*>(kv.raw());
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < hd.NKV; ++g)
      std::memcpy(dst + size_t(r * hd.kv_row() + 2 * g * hd.HS) * es,
                  src + size_t(r * hd.qkv_row() + (g * (hd.G + 2) + hd.G) * hd.HS) * es, head_bytes);
}

void CpuOps::do_attention_qkv_grad_unpack(TensorView dqkv, TensorView dq, TensorView dkv,
                                          const AttentionParams& p) const {
  const Heads hd = make_heads(p);
  const int64_t B = dqkv.size(0), T = dqkv.size(1);
  const float* a = dq.data<float>();
  const float* c = dkv.data<float>();
  const int64_t rows = B * T;
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < hd.NH; ++h)
      narrow(dqkv.raw(), dqkv.dtype(), r * hd.qkv_row() + hd.q_col(h), a + r * hd.out_row() + h * hd.HS, hd.HS);
    for (int64_t g = 0; g < hd.NKV; ++g)
      narrow(dqkv.raw(), dqkv.dtype(), r * hd.qkv_row() + (g * (hd.G + 2) + hd.G) * hd.HS,
             c + r * hd.kv_row() + 2 * g * hd.HS, 2 * hd.HS);
  }
}

}  // namespace loom::cpu
