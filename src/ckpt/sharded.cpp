// Sharded checkpoints and resharding on load (format and guarantees in include/loom/ckpt/sharded.h).
//
// Resharding works in the global tensor's row-major flat index space: a piece (saved or wanted) is a list
// of runs, each a stretch of consecutive global flat indices that is also consecutive in the piece's data.
// Along the partition dim a box is (outer, concatenated ranges, inner), so for every outer index and range
// the range's rows form one run of range.size * inner elements; the ZeRO flat window clips that list.
// Loading a target = intersecting its runs with the disjoint union of all saved runs of the tensor (sorted
// by global index), which also finds every uncovered element.
#include "loom/ckpt/sharded.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "json_no_duplicates.h"
#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/safetensors.h"

namespace loom {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kMetadataName = "metadata.json";
constexpr const char* kShardedKey = "sharded_checkpoint";
constexpr const char* kIndexKey = "loom_sharded_index";
constexpr const char* kFormat = "loom-sharded";
constexpr int kVersion = 1;

// A piece's geometry with the window resolved; `ok` false with `problem` set when it is malformed.
struct Geometry {
  int64_t outer = 1, inner = 1, global_d = 1, local_d = 1;  // (outer, local_d, inner) box layout
  int64_t box = 0;
  int64_t flat_begin = 0, flat_end = 0;
  std::string problem;
};

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

// Consecutive global flat indices [global, global + len) held at data offsets [local, local + len).
struct Run {
  int64_t global = 0;
  int64_t local = 0;
  int64_t len = 0;
  int piece = 0;  // saved runs: which saved piece of the tensor
};

// The runs of a box window, in data order, adjacent runs merged.
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

float load_f32(DType dt, const uint8_t* p) {
  switch (dt) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return bf16_to_f32(v);
    }
    case DType::kF16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return f16_to_f32(v);
    }
    case DType::kF8E4M3: return fp8_e4m3_to_f32(*p);
    case DType::kF8E5M2: return fp8_e5m2_to_f32(*p);
    default: LOOM_FAIL("[sharded] not a float dtype: ", dtype_name(dt));
  }
}

void store_f32(DType dt, float v, uint8_t* p) {
  switch (dt) {
    case DType::kF32: std::memcpy(p, &v, 4); break;
    case DType::kBF16: {
      const uint16_t b = f32_to_bf16(v);
      std::memcpy(p, &b, 2);
      break;
    }
    case DType::kF16: {
      const uint16_t b = f32_to_f16(v);
      std::memcpy(p, &b, 2);
      break;
    }
    case DType::kF8E4M3: *p = f32_to_fp8_e4m3(v); break;
    case DType::kF8E5M2: *p = f32_to_fp8_e5m2(v); break;
    default: LOOM_FAIL("[sharded] not a float dtype: ", dtype_name(dt));
  }
}

// n elements from src (dtype s) to dst (dtype d): a byte copy when equal, else through f32 (every Loom
// float dtype is exact in f32, so widening is exact and narrowing rounds once, to nearest even).
void convert(const void* src, DType s, void* dst, DType d, int64_t n) {
  if (s == d) {
    std::memcpy(dst, src, size_t(n) * dtype_size(s));
    return;
  }
  const auto* in = static_cast<const uint8_t*>(src);
  auto* out = static_cast<uint8_t*>(dst);
  const size_t ss = dtype_size(s), ds = dtype_size(d);
  for (int64_t i = 0; i < n; ++i) store_f32(d, load_f32(s, in + size_t(i) * ss), out + size_t(i) * ds);
}

json parse_object(const std::string& text, const char* what) {
  json j;
  try {
    j = json::parse(text.empty() ? std::string("{}") : text);
  } catch (const json::exception& e) {
    user_error("the ", what, " of a sharded checkpoint must be a JSON object; parsing it failed: ", e.what());
  }
  if (!j.is_object()) user_error("the ", what, " of a sharded checkpoint must be a JSON object, got ", j.dump());
  return j;
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

// One agreement point of the collective save: every rank learns whether every rank succeeded.
void agree(const Communicator& world, const std::exception_ptr& err, const std::string& root, int64_t iteration,
           const char* step) {
  const double ok = world.all_reduce_scalar(err ? 0.0 : 1.0, ReduceOp::kMin);
  if (err) std::rethrow_exception(err);
  if (ok < 1.0)
    user_error("saving the checkpoint of iteration ", iteration, " to ", root, " failed on another rank while ", step,
               " (that rank reports the cause); the previous checkpoint stays current");
}

}  // namespace

int64_t piece_box_numel(const TensorPiece& p) {
  const Geometry g = geometry(p.global_shape, p.partition_dim, p.ranges, 0, -1);
  LOOM_CHECK(g.problem.empty(), "[sharded] piece of ", p.name, ": ", g.problem);
  return g.box;
}

std::string shard_file_name(int rank) {
  LOOM_CHECK(rank >= 0, "[sharded] rank must be non-negative, got ", rank);
  char name[48];
  std::snprintf(name, sizeof(name), "shard_%05d.safetensors", rank);
  return name;
}

void write_shard(const std::string& staging, int rank, const std::vector<TensorPiece>& pieces) {
  NamedTensors tensors;
  json index = json::array();
  std::set<std::string> keys;
  for (const TensorPiece& p : pieces) {
    const Geometry g = geometry(p.global_shape, p.partition_dim, p.ranges, p.flat_begin, p.flat_end);
    check_piece(p, g, "saved");
    const int64_t n = g.flat_end - g.flat_begin;
    if (n == 0) continue;
    // One rank may hold several pieces of a tensor; each needs its own safetensors key.
    std::string key = p.name;
    for (int k = 1; !keys.insert(key).second; ++k) key = p.name + "#" + std::to_string(k);
    json ranges = json::array();
    for (const BoxRange& r : p.ranges) ranges.push_back({r.start, r.size});
    index.push_back({{"name", p.name},
                     {"dtype", safetensors_dtype_name(p.data.dtype())},
                     {"global_shape", std::vector<int64_t>(p.global_shape.begin(), p.global_shape.end())},
                     {"partition_dim", p.partition_dim},
                     {"ranges", ranges},
                     {"flat_begin", g.flat_begin},
                     {"flat_end", g.flat_end},
                     {"key", key}});
    tensors.emplace_back(key, TensorView(p.data.raw(), p.data.dtype(), Shape{n}, p.data.device()));
  }
  const json meta = {{"format", kFormat}, {"version", kVersion}, {"rank", rank}, {"pieces", index}};
  write_checkpoint_tensors(staging, shard_file_name(rank), tensors, {{kIndexKey, meta.dump()}});
}

void write_sharded_metadata(const std::string& staging, int world_size, const std::string& layout_json,
                            const std::string& metadata_json) {
  LOOM_CHECK(world_size >= 1, "[sharded] world size must be positive, got ", world_size);
  json j = parse_object(metadata_json, "metadata");
  const json layout = parse_object(layout_json, "layout");
  if (j.contains(kShardedKey))
    user_error("the metadata of a sharded checkpoint must not have the key \"", kShardedKey, "\" (it is reserved)");
  j[kShardedKey] = {{"format", kFormat}, {"version", kVersion}, {"world_size", world_size}, {"layout", layout}};
  write_checkpoint_text(staging, kMetadataName, j.dump(2) + "\n");
}

void save_sharded_checkpoint(const std::string& root, int64_t iteration, const std::vector<TensorPiece>& pieces,
                             const std::string& layout_json, const std::string& metadata_json,
                             const Communicator& world) {
  const int rank = world.rank();
  auto step = [&](const char* what, const auto& body) {
    std::exception_ptr err;
    try {
      body();
    } catch (...) {
      err = std::current_exception();
    }
    agree(world, err, root, iteration, what);
  };
  step("creating the staging directory", [&] {
    if (rank == 0) begin_checkpoint(root, iteration);
  });
  step("writing its shard", [&] {
    const std::string staging = checkpoint_staging_dir(root, iteration);
    write_shard(staging, rank, pieces);
    if (rank == 0) write_sharded_metadata(staging, world.size(), layout_json, metadata_json);
  });
  step("committing", [&] {
    if (rank == 0) commit_checkpoint(root, iteration);
  });
}

void save_sharded_checkpoint(const std::string& root, int64_t iteration, const std::vector<TensorPiece>& pieces,
                             const std::string& layout_json, const std::string& metadata_json, int rank,
                             int world_size, const std::function<void()>& barrier) {
  LOOM_CHECK(rank >= 0 && rank < world_size, "[sharded] rank ", rank, " outside world size ", world_size);
  if (rank == 0) begin_checkpoint(root, iteration);
  barrier();  // the staging dir exists
  const std::string staging = checkpoint_staging_dir(root, iteration);
  write_shard(staging, rank, pieces);
  if (rank == 0) write_sharded_metadata(staging, world_size, layout_json, metadata_json);
  barrier();  // every shard is durable
  if (rank == 0) commit_checkpoint(root, iteration);
  barrier();  // committed: every rank returns only once the checkpoint is current
}

// ---- reading ----------------------------------------------------------------------------------------

namespace {

struct SavedPiece {
  int shard = 0;
  std::string key;
  DType dtype = DType::kF32;
  int partition_dim = -1;
  std::vector<BoxRange> ranges;
  Geometry geom;
};

struct SavedTensor {
  Shape global_shape;
  int first_shard = 0;  // names the file in shape-disagreement messages
  std::vector<SavedPiece> pieces;
};

struct CopyOp {
  const SavedPiece* src = nullptr;
  int64_t src_off = 0;
  int64_t dst_off = 0;
  int64_t len = 0;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) user_error("cannot read ", path, ": ", std::strerror(errno));
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

}  // namespace

struct ShardedCheckpoint::Impl {
  std::string dir;
  int world_size = 0;
  std::string layout;
  std::string metadata;
  std::map<std::string, SavedTensor> tensors;
  mutable std::mutex mu;
  mutable std::map<int, SafetensorsFile> mapped;  // shards opened for data, kept for later reads

  std::string shard_path(int r) const { return (fs::path(dir) / shard_file_name(r)).string(); }

  void load_index(int r) {
    const std::string path = shard_path(r);
    std::error_code ec;
    if (!fs::exists(path, ec))
      user_error("checkpoint shard ", path, " is missing (", dir, "/", kMetadataName, " says the checkpoint has ",
                 world_size, " shards); the checkpoint is incomplete");
    const SafetensorsFile f = SafetensorsFile::open(path);  // validates the header; UserError names the file
    auto bad = [&](const auto&... why) { user_error("checkpoint shard ", path, ": ", why...); };
    const auto it = f.metadata().find(kIndexKey);
    if (it == f.metadata().end()) bad("has no \"", kIndexKey, "\" metadata entry (not a Loom checkpoint shard)");
    json idx;
    try {
      std::string dup;
      idx = ckpt_io::parse_json_noting_duplicates(it->second, &dup);
      if (!dup.empty()) bad("the piece index repeats the key \"", dup, "\"");
    } catch (const json::exception& e) {
      bad("the piece index is not valid JSON: ", e.what());
    }
    try {
      if (idx.at("format").get<std::string>() != kFormat) bad("the piece index has format ", idx.at("format").dump());
      if (idx.at("version").get<int>() > kVersion)
        bad("the piece index has version ", idx.at("version").get<int>(), "; this Loom reads up to ", kVersion);
      if (idx.at("rank").get<int>() != r)
        bad("the piece index says it was written by rank ", idx.at("rank").get<int>(), ", not ", r);
      std::set<std::string> keys;
      for (const json& e : idx.at("pieces")) {
        SavedPiece p;
        p.shard = r;
        const std::string name = e.at("name").get<std::string>();
        p.key = e.at("key").get<std::string>();
        const std::vector<int64_t> dims = e.at("global_shape").get<std::vector<int64_t>>();
        if (dims.size() > size_t(Shape::kMaxDims)) bad("piece ", name, " has ", dims.size(), " dims");
        const Shape gshape{std::span<const int64_t>(dims)};
        p.partition_dim = e.at("partition_dim").get<int>();
        for (const json& x : e.at("ranges")) p.ranges.push_back({x.at(0).get<int64_t>(), x.at(1).get<int64_t>()});
        p.geom = geometry(gshape, p.partition_dim, p.ranges, e.at("flat_begin").get<int64_t>(),
                          e.at("flat_end").get<int64_t>());
        if (!p.geom.problem.empty()) bad("piece ", name, ": ", p.geom.problem);
        const std::string dtype_str = e.at("dtype").get<std::string>();
        const std::optional<DType> dt = dtype_from_safetensors(dtype_str);
        if (!dt || !dtype_is_float(*dt)) bad("piece ", name, " has dtype ", dtype_str, " (a float dtype is needed)");
        p.dtype = *dt;
        if (!keys.insert(p.key).second) bad("two pieces share the tensor key ", p.key);
        if (!f.contains(p.key)) bad("piece ", name, " names tensor ", p.key, ", which the file does not hold");
        const SafetensorsInfo& info = f.info(p.key);
        const int64_t n = p.geom.flat_end - p.geom.flat_begin;
        if (info.dtype != p.dtype || info.shape != Shape{n})
          bad("tensor ", p.key, " is ", info.dtype_str, info.shape.str(), " but its index entry says ", dtype_str,
              "(", n, ")");
        auto [t, fresh] = tensors.try_emplace(name);
        if (fresh) {
          t->second.global_shape = gshape;
          t->second.first_shard = r;
        } else if (t->second.global_shape != gshape) {
          user_error("checkpoint tensor ", name, " has global shape ", t->second.global_shape.str(), " in ",
                     shard_path(t->second.first_shard), " but ", gshape.str(), " in ", path,
                     "; the shards come from different models");
        }
        t->second.pieces.push_back(std::move(p));
      }
    } catch (const json::exception& e) {
      bad("malformed piece index: ", e.what());
    }
  }

  const SavedTensor& lookup(const std::string& name) const {
    const auto it = tensors.find(name);
    if (it == tensors.end())
      user_error("checkpoint ", dir, " has no tensor ", name, " (it holds ", tensors.size(),
                 " tensors; was it saved from a different model configuration?)");
    return it->second;
  }

  // Checks `t` against the saved pieces and appends the copies that fill it (nothing is copied here).
  void plan(const TensorPiece& t, std::vector<CopyOp>& ops) const {
    const Geometry g = geometry(t.global_shape, t.partition_dim, t.ranges, t.flat_begin, t.flat_end);
    check_piece(t, g, "target");
    const SavedTensor& saved = lookup(t.name);
    if (saved.global_shape != t.global_shape)
      user_error("checkpoint tensor ", t.name, " has global shape ", saved.global_shape.str(), " in ", dir,
                 " but the model expects ", t.global_shape.str());
    std::vector<Run> want = box_runs(g, t.partition_dim, t.ranges, 0);
    if (want.empty()) return;

    // The disjoint union of the saved runs: sorted by global index, overlaps (replicas) cut away.
    std::vector<Run> all;
    for (size_t i = 0; i < saved.pieces.size(); ++i) {
      const SavedPiece& p = saved.pieces[i];
      std::vector<Run> r = box_runs(p.geom, p.partition_dim, p.ranges, int(i));
      all.insert(all.end(), r.begin(), r.end());
    }
    std::stable_sort(all.begin(), all.end(), [](const Run& a, const Run& b) { return a.global < b.global; });
    std::vector<Run> cover;
    int64_t covered = 0;
    for (Run r : all) {
      if (r.global + r.len <= covered) continue;
      if (r.global < covered) {
        const int64_t cut = covered - r.global;
        r.global += cut;
        r.local += cut;
        r.len -= cut;
      }
      cover.push_back(r);
      covered = r.global + r.len;
    }

    std::sort(want.begin(), want.end(), [](const Run& a, const Run& b) { return a.global < b.global; });
    for (const Run& w : want) {
      const int64_t end = w.global + w.len;
      auto c = std::partition_point(cover.begin(), cover.end(),
                                    [&](const Run& r) { return r.global + r.len <= w.global; });
      int64_t at = w.global;
      for (; at < end; ++c) {
        if (c == cover.end() || c->global > at) {
          const int64_t gap_end = c == cover.end() ? end : std::min(end, c->global);
          user_error("checkpoint ", dir, " does not cover all of tensor ", t.name, " ", t.global_shape.str(),
                     ": global elements ", coords(t.global_shape, at), " to ", coords(t.global_shape, gap_end - 1),
                     " (row-major flat indices [", at, ", ", gap_end, ")) are in no saved piece; wanted ",
                     ranges_str(t.ranges), t.partition_dim >= 0 ? " of dim " + std::to_string(t.partition_dim) : "",
                     ", flat [", g.flat_begin, ", ", g.flat_end, ") (was the checkpoint saved with every rank's "
                     "pieces, e.g. the ZeRO shards of all data-parallel ranks?)");
        }
        const int64_t stop = std::min(end, c->global + c->len);
        ops.push_back({&saved.pieces[size_t(c->piece)], c->local + (at - c->global), w.local + (at - w.global),
                       stop - at});
        at = stop;
      }
    }
  }
};

ShardedCheckpoint::ShardedCheckpoint() = default;
ShardedCheckpoint::~ShardedCheckpoint() = default;
ShardedCheckpoint::ShardedCheckpoint(ShardedCheckpoint&&) noexcept = default;
ShardedCheckpoint& ShardedCheckpoint::operator=(ShardedCheckpoint&&) noexcept = default;

bool is_sharded_checkpoint(const std::string& dir) {
  const std::string path = (fs::path(dir) / kMetadataName).string();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return false;
  try {
    const json j = json::parse(read_text(path));
    return j.is_object() && j.contains(kShardedKey) && j[kShardedKey].is_object();
  } catch (const json::exception&) {
    return false;
  }
}

ShardedCheckpoint ShardedCheckpoint::open(const std::string& dir) {
  ShardedCheckpoint ck;
  ck.impl_ = std::make_unique<Impl>();
  Impl& m = *ck.impl_;
  m.dir = dir;
  const std::string meta_path = (fs::path(dir) / kMetadataName).string();
  std::error_code ec;
  if (!fs::is_regular_file(meta_path, ec))
    user_error("checkpoint ", dir, " has no ", kMetadataName, " (not a checkpoint directory, or an incomplete one)");
  m.metadata = read_text(meta_path);
  json j;
  try {
    j = json::parse(m.metadata);
  } catch (const json::exception& e) {
    user_error("checkpoint metadata ", meta_path, " is not valid JSON: ", e.what());
  }
  if (!j.is_object() || !j.contains(kShardedKey) || !j[kShardedKey].is_object())
    user_error("checkpoint metadata ", meta_path, " has no \"", kShardedKey,
               "\" object: it is not a sharded checkpoint (saved by an older Loom as model.safetensors?)");
  const json& s = j[kShardedKey];
  try {
    if (s.at("format").get<std::string>() != kFormat)
      user_error("checkpoint metadata ", meta_path, ": \"", kShardedKey, "\" has format ", s.at("format").dump(),
                 ", expected \"", kFormat, "\"");
    if (s.at("version").get<int>() > kVersion)
      user_error("checkpoint metadata ", meta_path, " has sharded format version ", s.at("version").get<int>(),
                 "; this Loom reads up to ", kVersion);
    m.world_size = s.at("world_size").get<int>();
    m.layout = s.at("layout").dump();
  } catch (const json::exception& e) {
    user_error("checkpoint metadata ", meta_path, ": malformed \"", kShardedKey, "\" object: ", e.what());
  }
  if (m.world_size < 1)
    user_error("checkpoint metadata ", meta_path, " has world_size ", m.world_size, "; it must be positive");
  for (int r = 0; r < m.world_size; ++r) m.load_index(r);
  return ck;
}

const std::string& ShardedCheckpoint::dir() const { return impl_->dir; }
int ShardedCheckpoint::world_size() const { return impl_->world_size; }
const std::string& ShardedCheckpoint::layout_json() const { return impl_->layout; }
const std::string& ShardedCheckpoint::metadata_json() const { return impl_->metadata; }

std::vector<std::string> ShardedCheckpoint::tensor_names() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : impl_->tensors) out.push_back(name);
  return out;
}

bool ShardedCheckpoint::contains(const std::string& name) const { return impl_->tensors.count(name) != 0; }

const Shape& ShardedCheckpoint::global_shape(const std::string& name) const {
  return impl_->lookup(name).global_shape;
}

int ShardedCheckpoint::num_saved_pieces(const std::string& name) const {
  return int(impl_->lookup(name).pieces.size());
}

void ShardedCheckpoint::read(const std::vector<TensorPiece>& targets) const {
  LOOM_CHECK(impl_, "[sharded] read() on a ShardedCheckpoint that was not opened");
  std::vector<std::vector<CopyOp>> plans(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) impl_->plan(targets[i], plans[i]);

  // Map every shard needed before copying anything, so an unreadable file leaves the targets untouched.
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::map<const SavedPiece*, const uint8_t*> src;
  for (const auto& ops : plans)
    for (const CopyOp& op : ops) {
      if (src.count(op.src)) continue;
      auto f = impl_->mapped.find(op.src->shard);
      if (f == impl_->mapped.end())
        f = impl_->mapped
                .emplace(op.src->shard,
                         SafetensorsFile::open(impl_->shard_path(op.src->shard), SafetensorsFile::Mode::kMmap))
                .first;
      // The mapping lives in the cached SafetensorsFile; the Tensor returned by map() does not own it.
      src[op.src] = static_cast<const uint8_t*>(f->second.map(op.src->key).raw());
    }
  for (size_t i = 0; i < targets.size(); ++i) {
    const TensorView& dst = targets[i].data;
    const size_t ds = dtype_size(dst.dtype());
    for (const CopyOp& op : plans[i])
      convert(src[op.src] + size_t(op.src_off) * dtype_size(op.src->dtype), op.src->dtype,
              static_cast<uint8_t*>(dst.raw()) + size_t(op.dst_off) * ds, dst.dtype(), op.len);
  }
}

void ShardedCheckpoint::read(const TensorPiece& target) const { read(std::vector<TensorPiece>{target}); }

Tensor ShardedCheckpoint::read_full(const std::string& name, DType as) const {
  TensorPiece t;
  t.name = name;
  t.global_shape = global_shape(name);
  Tensor out = Tensor::empty(t.global_shape, as);
  t.data = out;
  read(t);
  return out;
}

}  // namespace loom
