// The piece geometry of sharded checkpoints (see sharded_geometry.h).
#include "sharded_geometry.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "loom/core/check.h"

namespace loom::sharded_detail {

Geometry geometry(const Shape& g, int partition_dim, const std::vector<BoxRange>& ranges, int64_t flat_begin,
                  int64_t flat_end) {
  Geometry r;
  auto fail = [&](std::string why) {
    r.problem = std::move(why);
    return r;
  };
  for (int i = 0; i < g.ndim(); ++i)
    if (g[i] < 0) return fail("global shape " + g.str() + " has a negative extent");
  if (partition_dim < -1 || partition_dim >= g.ndim())
    return fail("partition dim " + std::to_string(partition_dim) + " is out of range for global shape " + g.str());
  if (partition_dim == -1) {
    if (!ranges.empty()) return fail("ranges are given but partition dim is -1 (the whole tensor)");
    r.box = g.numel();
    r.outer = 1;
    r.global_d = r.local_d = 1;
    r.inner = r.box;
  } else {
    const int d = partition_dim;
    for (int i = 0; i < d; ++i) r.outer *= g[i];
    for (int i = d + 1; i < g.ndim(); ++i) r.inner *= g[i];
    r.global_d = g[d];
    if (ranges.empty()) return fail("partition dim " + std::to_string(d) + " needs at least one range");
    r.local_d = 0;
    for (const BoxRange& x : ranges) {
      if (x.start < 0 || x.size <= 0 || x.start + x.size > g[d])
        return fail("range [" + std::to_string(x.start) + ", " + std::to_string(x.start + x.size) + ") is not a " +
                    "non-empty part of dim " + std::to_string(d) + " (size " + std::to_string(g[d]) + ")");
      r.local_d += x.size;
    }
    r.box = r.outer * r.local_d * r.inner;
  }
  r.flat_begin = flat_begin;
  r.flat_end = flat_end == -1 ? r.box : flat_end;
  if (r.flat_begin < 0 || r.flat_begin > r.flat_end || r.flat_end > r.box)
    return fail("flat range [" + std::to_string(flat_begin) + ", " + std::to_string(flat_end) +
                ") is not within the box of " + std::to_string(r.box) + " elements");
  return r;
}

std::vector<Run> box_runs(const Geometry& g, int partition_dim, const std::vector<BoxRange>& ranges, int piece) {
  std::vector<Run> out;
  const int64_t fb = g.flat_begin, fe = g.flat_end;
  if (fb >= fe) return out;
  auto add = [&](int64_t global, int64_t local, int64_t len) {
    if (!out.empty()) {
      Run& p = out.back();
      if (p.global + p.len == global && p.local + p.len == local) {
        p.len += len;
        return;
      }
    }
    out.push_back({global, local, len, piece});
  };
  if (partition_dim == -1) {
    add(fb, 0, fe - fb);
    return out;
  }
  const int64_t row = g.local_d * g.inner;  // box elements per outer index
  for (int64_t o = fb / row; o <= (fe - 1) / row; ++o) {
    int64_t lstart = 0;
    for (const BoxRange& x : ranges) {
      const int64_t seg_begin = (o * g.local_d + lstart) * g.inner;
      const int64_t seg_end = seg_begin + x.size * g.inner;
      lstart += x.size;
      const int64_t b = std::max(seg_begin, fb), e = std::min(seg_end, fe);
      if (b >= e) continue;
      add((o * g.global_d + x.start) * g.inner + (b - seg_begin), b - fb, e - b);
    }
  }
  return out;
}

std::string coords(const Shape& g, int64_t flat) {
  std::vector<int64_t> idx(size_t(g.ndim()));
  for (int i = g.ndim() - 1; i >= 0; --i) {
    idx[size_t(i)] = g[i] ? flat % g[i] : 0;
    flat = g[i] ? flat / g[i] : 0;
  }
  std::string s = "(";
  for (size_t i = 0; i < idx.size(); ++i) s += (i ? ", " : "") + std::to_string(idx[i]);
  return s + ")";
}

std::string ranges_str(const std::vector<BoxRange>& ranges) {
  if (ranges.empty()) return "the whole tensor";
  std::ostringstream os;
  for (size_t i = 0; i < ranges.size(); ++i)
    os << (i ? ", " : "") << "[" << ranges[i].start << ", " << ranges[i].start + ranges[i].size << ")";
  return os.str();
}

void convert(const void* src, DType s, void* dst, DType d, int64_t n) {
  if (s == d) {
    std::memcpy(dst, src, size_t(n) * dtype_size(s));
    return;
  }
  for (int64_t i = 0; i < n; ++i) store_from_f32(dst, d, i, load_as_f32(src, s, i));
}

void check_piece(const TensorPiece& p, const Geometry& g, const char* what) {
  LOOM_CHECK(!p.name.empty(), "[sharded] a ", what, " piece has an empty name");
  LOOM_CHECK(g.problem.empty(), "[sharded] ", what, " piece of ", p.name, ": ", g.problem);
  const int64_t n = g.flat_end - g.flat_begin;
  if (n == 0) return;
  LOOM_CHECK(p.data.defined(), "[sharded] ", what, " piece of ", p.name, " has no data");
  LOOM_CHECK(p.data.device().is_cpu(), "[sharded] ", what, " piece of ", p.name, " must be in host memory, got ",
             p.data.desc());
  LOOM_CHECK(dtype_is_float(p.data.dtype()), "[sharded] ", what, " piece of ", p.name,
             " must have a float dtype, got ", p.data.desc());
  LOOM_CHECK(p.data.numel() == n, "[sharded] ", what, " piece of ", p.name, ": flat range [", g.flat_begin, ", ",
             g.flat_end, ") has ", n, " elements but the data is ", p.data.desc());
}


}  // namespace loom::sharded_detail
