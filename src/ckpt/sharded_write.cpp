// Writing sharded checkpoints (format and guarantees in include/loom/ckpt/sharded.h): every rank's
// shard file with its piece index, rank 0's metadata.json, and the collective save with agreement.
#include <cstdio>
#include <exception>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/safetensors.h"
#include "loom/ckpt/sharded.h"
#include "loom/core/crc32c.h"
#include "safetensors_impl.h"
#include "sharded_geometry.h"

namespace loom {

namespace {

using nlohmann::json;
using namespace sharded_detail;

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

void write_shard(const std::string& staging, int rank, const std::vector<TensorPiece>& pieces,
                 const std::string& metadata_text) {
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
  json meta = {{"format", kFormat}, {"version", kVersion}, {"rank", rank}, {"pieces", index}};
  if (!metadata_text.empty()) meta[kMetadataCrcKey] = safetensors_detail::hex8(crc32c(metadata_text));
  write_checkpoint_tensors(staging, shard_file_name(rank), tensors, {{kIndexKey, meta.dump()}});
}

std::string sharded_metadata_text(int world_size, const std::string& layout_json, const std::string& metadata_json) {
  LOOM_CHECK(world_size >= 1, "[sharded] world size must be positive, got ", world_size);
  json j = parse_object(metadata_json, "metadata");
  const json layout = parse_object(layout_json, "layout");
  if (j.contains(kShardedKey))
    user_error("the metadata of a sharded checkpoint must not have the key \"", kShardedKey, "\" (it is reserved)");
  j[kShardedKey] = {{"format", kFormat}, {"version", kVersion}, {"world_size", world_size}, {"layout", layout}};
  return j.dump(2) + "\n";
}

void write_sharded_metadata(const std::string& staging, int world_size, const std::string& layout_json,
                            const std::string& metadata_json) {
  write_checkpoint_text(staging, kMetadataName, sharded_metadata_text(world_size, layout_json, metadata_json));
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
    const std::string text = rank == 0 ? sharded_metadata_text(world.size(), layout_json, metadata_json) : "";
    write_shard(staging, rank, pieces, text);
    if (rank == 0) write_checkpoint_text(staging, kMetadataName, text);
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
  const std::string text = rank == 0 ? sharded_metadata_text(world_size, layout_json, metadata_json) : "";
  write_shard(staging, rank, pieces, text);
  if (rank == 0) write_checkpoint_text(staging, kMetadataName, text);
  barrier();  // every shard is durable
  if (rank == 0) commit_checkpoint(root, iteration);
  barrier();  // committed: every rank returns only once the checkpoint is current
}

}  // namespace loom
