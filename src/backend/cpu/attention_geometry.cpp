// The CPU attention core's geometry from the op's arguments (checked by the OpTable entry point), and the
// document segment ranges from segment_ids: see attention_geometry.h.
#include "backend/cpu/attention_geometry.h"

#include <limits>

#include "loom/core/rng.h"

namespace loom::cpu::attn {

Geometry make_geometry(TensorView qkv, const AttentionParams& p) {
  const DType dt = qkv.dtype();
  Geometry g{};
  g.B = qkv.size(0);
  g.T = qkv.size(1);
  g.NH = p.num_heads;
  g.NKV = p.num_kv_heads;
  g.G = g.NH / g.NKV;
  g.HS = p.head_dim;
  g.HSP = (g.HS + kW - 1) / kW * kW;
  g.qkv_row = g.NKV * (g.G + 2) * g.HS;
  g.out_row = g.NH * g.HS;
  g.scale = p.softmax_scale;
  g.causal = p.causal;
  g.window = p.window;
  g.dtype = dt;
  g.dropout = p.dropout_p > 0.0f;
  if (g.dropout) g.drop = Dropout{p.dropout_seed, p.dropout_stream, dropout_threshold(p.dropout_p),
                                  1.0f / (1.0f - p.dropout_p)};
  return g;
}

// The ids must not decrease along T: checked here, where the CPU reads them (see the header).
std::vector<int32_t> segment_ranges(TensorView segment_ids, const Geometry& g, const char* op) {
  std::vector<int32_t> r;
  if (!segment_ids.defined()) return r;
  LOOM_CHECK(g.T <= std::numeric_limits<int32_t>::max(), "[", op, "] sequence length ", g.T,
             " is too long for segment_ids");
  const int32_t* ids = segment_ids.data<int32_t>();
  r.resize(size_t(2 * g.B * g.T));
  int32_t* begin = r.data();
  int32_t* end = begin + g.B * g.T;
  for (int64_t b = 0; b < g.B; ++b) {
    const int32_t* id = ids + b * g.T;
    for (int64_t t = 1; t < g.T; ++t)
      LOOM_CHECK(id[t] >= id[t - 1], "[", op, "] segment_ids must not decrease along T (documents are contiguous), ",
                 "got segment_ids[", b, ", ", t - 1, "] = ", id[t - 1], " > segment_ids[", b, ", ", t, "] = ", id[t]);
    for (int64_t t0 = 0; t0 < g.T;) {
      int64_t t1 = t0 + 1;
      while (t1 < g.T && id[t1] == id[t0]) ++t1;
      std::fill(begin + b * g.T + t0, begin + b * g.T + t1, int32_t(t0));
      std::fill(end + b * g.T + t0, end + b * g.T + t1, int32_t(t1));
      t0 = t1;
    }
  }
  return r;
}

}  // namespace loom::cpu::attn
