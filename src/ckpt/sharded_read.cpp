// Reading sharded checkpoints and resharding on load (format and guarantees in include/loom/ckpt/sharded.h).
// Loading a target = intersecting its runs with the disjoint union of all saved runs of the tensor (sorted
// by global index), which also finds every uncovered element.
// Checksums: every saved piece is one tensor of its shard file, verified whole by SafetensorsFile the
// first time any part of it is needed (a resharding load that needs half a piece still reads all of it,
// once); metadata.json is verified against the CRC shard 0's index records for it.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "json_no_duplicates.h"
#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/safetensors.h"
#include "loom/ckpt/sharded.h"
#include "loom/core/crc32c.h"
#include "loom/core/file_io.h"
#include "safetensors_impl.h"
#include "sharded_geometry.h"

namespace loom {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace sharded_detail;

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



}  // namespace

struct ShardedCheckpoint::Impl {
  std::string dir;
  int world_size = 0;
  std::string layout;
  std::string metadata;
  std::map<std::string, SavedTensor> tensors;
  mutable std::mutex mu;
  mutable std::map<int, SafetensorsFile> mapped;  // shards opened for data, kept for later reads

  // The single-file format of Loom 0.1.0 (no "sharded_checkpoint" object): its files stand in for the
  // shards, each tensor one whole piece.
  std::vector<std::string> legacy_files;
  std::vector<std::string> unchecked;  // files that record no checksums (written before Loom did)

  [[noreturn]] void damaged(const std::string& what) const {
    user_error("checkpoint ", dir, " is damaged: ", what, "; ", other_checkpoints_hint(dir));
  }

  std::string shard_path(int r) const {
    return (fs::path(dir) / (legacy_files.empty() ? shard_file_name(r) : legacy_files[size_t(r)])).string();
  }

  // A single-process checkpoint of Loom 0.1.0: metadata "files" names model.safetensors (parameters by
  // name), optimizer.safetensors ("<param>.exp_avg", "<param>.exp_avg_sq") and fp8_state.safetensors.
  // Every tensor becomes one whole piece under the sharded format's names ("optimizer.exp_avg.<param>"),
  // so the resharding reader loads it into any layout.
  void load_legacy(json files, const std::string& meta_path) {
    if (files.is_null()) {  // written before "files" existed: the fixed names, where present
      files = json::object();
      for (const auto& [role, name] : {std::pair{"model", "model.safetensors"}, {"optimizer", "optimizer.safetensors"},
                                       {"fp8", "fp8_state.safetensors"}}) {
        std::error_code ec;
        if (fs::is_regular_file(fs::path(dir) / name, ec)) files[role] = name;
      }
    }
    if (!files.is_object() || !files.contains("model") || !files["model"].is_string())
      user_error("checkpoint metadata ", meta_path, " has neither a \"", kShardedKey, "\" object nor \"files\": {\"model\": "
                 "...} (the single-file format); it is not a Loom checkpoint");
    for (const char* role : {"model", "optimizer", "fp8"}) {
      if (!files.contains(role)) continue;
      if (!files[role].is_string())
        user_error("checkpoint metadata ", meta_path, ": \"files\".\"", role, "\" must be a file name, got ",
                   files[role].dump());
      const std::string file = files[role].get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        user_error("checkpoint metadata ", meta_path, ": \"files\".\"", role, "\" is '", file,
                   "'; it must name a file inside the checkpoint directory");
      legacy_files.push_back(file);
      const int r = int(legacy_files.size()) - 1;
      const std::string path = shard_path(r);
      std::error_code ec;
      if (!fs::exists(path, ec))
        user_error("checkpoint file ", path, " is missing (", meta_path, " lists it); the checkpoint is incomplete");
      const SafetensorsFile f = SafetensorsFile::open(path);
      if (!f.has_checksums()) unchecked.push_back(file);
      for (const std::string& key : f.names()) {
        const SafetensorsInfo& info = f.info(key);
        if (!info.dtype || !dtype_is_float(*info.dtype))
          user_error("checkpoint file ", path, ": tensor ", key, " has dtype ", info.dtype_str, " (a float dtype is needed)");
        std::string name = key;
        if (std::string(role) == "optimizer") {
          const auto ends = [&](const std::string& suffix) {
            return key.size() > suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0;
          };
          if (ends(".exp_avg_sq"))
            name = "optimizer.exp_avg_sq." + key.substr(0, key.size() - 11);
          else if (ends(".exp_avg"))
            name = "optimizer.exp_avg." + key.substr(0, key.size() - 8);
          else
            user_error("checkpoint file ", path, ": tensor ", key, " is not \"<param>.exp_avg\" or \"<param>.exp_avg_sq\"");
        }
        SavedPiece p;
        p.shard = r;
        p.key = key;
        p.dtype = *info.dtype;
        p.geom = geometry(info.shape, -1, {}, 0, -1);
        auto [t, fresh] = tensors.try_emplace(name);
        if (!fresh) user_error("checkpoint ", dir, " holds tensor ", name, " twice (", path, ")");
        t->second.global_shape = info.shape;
        t->second.first_shard = r;
        t->second.pieces.push_back(std::move(p));
      }
    }
    world_size = 1;
    layout = R"({"cp":1,"dp":1,"ep":1,"etp":1,"pp":1,"sharding":"no_shard","single_file":true,"tp":1})";
  }

  void load_index(int r) {
    const std::string path = shard_path(r);
    std::error_code ec;
    if (!fs::exists(path, ec))
      user_error("checkpoint shard ", path, " is missing (", dir, "/", kMetadataName, " says the checkpoint has ",
                 world_size, " shards); the checkpoint is incomplete");
    const SafetensorsFile f = SafetensorsFile::open(path);  // validates the header; UserError names the file
    if (!f.has_checksums()) unchecked.push_back(shard_file_name(r));
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
      if (idx.contains(kMetadataCrcKey)) {
        const std::string want = idx.at(kMetadataCrcKey).get<std::string>();
        const std::string have = safetensors_detail::hex8(crc32c(metadata));
        if (want != have)
          damaged(detail::concat(kMetadataName, " has CRC-32C ", have, " but ", path, " records ", want,
                                 " for it (the file was damaged on disk or in a copy, or edited)"));
      }
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
    const json j = json::parse(read_file(path, "checkpoint metadata"));
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
  m.metadata = read_file(meta_path, "checkpoint metadata");
  json j;
  try {
    j = json::parse(m.metadata);
  } catch (const json::exception& e) {
    user_error("checkpoint metadata ", meta_path, " is not valid JSON: ", e.what());
  }
  if (!j.is_object()) user_error("checkpoint metadata ", meta_path, " is not a JSON object");
  if (!j.contains(kShardedKey)) {
    m.load_legacy(j.contains("files") ? j["files"] : json(), meta_path);
    return ck;
  }
  if (!j[kShardedKey].is_object())
    user_error("checkpoint metadata ", meta_path, ": \"", kShardedKey, "\" must be an object, got ",
               j[kShardedKey].dump());
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

std::string ShardedCheckpoint::checksum_note() const {
  const std::vector<std::string>& u = impl_->unchecked;
  if (u.empty()) return "";
  const size_t files = impl_->legacy_files.empty() ? size_t(impl_->world_size) : impl_->legacy_files.size();
  std::string which = u.size() == files ? "its files record" : u.front() + (u.size() > 1 ? " and " +
                      std::to_string(u.size() - 1) + " more files record" : " records");
  return "note: checkpoint " + impl_->dir + " was written before Loom recorded checksums (" + which +
         " none), so its tensors cannot be verified as they load";
}

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

  // Map (and verify) every saved piece needed before copying anything, so an unreadable or damaged file
  // leaves the targets untouched.
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
      try {
        src[op.src] = static_cast<const uint8_t*>(f->second.map(op.src->key).raw());
      } catch (const ChecksumError& e) {
        throw ChecksumError(detail::concat("checkpoint ", impl_->dir, " is damaged: ", e.what(), "; ",
                                           other_checkpoints_hint(impl_->dir)),
                            e.path(), e.tensor());
      }
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
