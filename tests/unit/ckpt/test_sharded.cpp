// Sharded checkpoints (ckpt/sharded.h): ranks simulated in one process save a TP2 x ZeRO2 layout, and the
// checkpoint is read back into other layouts (TP1, TP4, ZeRO over 3 ranks, another partition dim, another
// dtype); every element is compared exactly against a reference computed here by plain per-element index
// arithmetic (independent of the run-based mapping in sharded.cpp). Plus the error cases (coverage gap,
// shape mismatch, missing tensor, missing or corrupt shard), crash atomicity, and the checksums (a
// damaged piece or metadata.json is caught, a checkpoint without checksums loads with a note).
#include "loom/ckpt/sharded.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <vector>

#include "loom/ckpt/checkpoint.h"
#include "unit/ckpt/ckpt_test_util.h"

namespace loom {
namespace {

using ckpt_test::expect_user_error;
using ckpt_test::TempDirTest;
using ckpt_test::read_file;
using ckpt_test::write_file;

// A saved tensor: its global values (f32; bf16-exact for tensors saved as bf16) and how TP splits it.
struct Spec {
  std::string name;
  Shape shape;
  DType saved_dtype;
  int partition_dim;                                  // under TP (-1: replicated)
  std::function<std::vector<BoxRange>(int, int)> tp;  // (tp_rank, tp_size) -> ranges
  std::vector<float> values;                          // global, row-major
};

// Values that are not bf16-exact (so narrowing to bf16 must round) unless `bf16_exact`.
std::vector<float> make_values(int64_t n, int seed, bool bf16_exact) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    float x = float(seed) + float(i) * 0.37f + 1.0f / 3.0f;
    if (i % 2) x = -x;
    v[size_t(i)] = bf16_exact ? bf16_to_f32(f32_to_bf16(x)) : x;
  }
  return v;
}

std::vector<BoxRange> even_split(int64_t n, int r, int size) { return {{n / size * r, n / size}}; }

// fc1 of a gated MLP: rows [0, F) are the gate, [F, 2F) the up projection; TP rank r holds its slice of
// each, concatenated (two ranges).
std::vector<BoxRange> gated_split(int64_t rows, int r, int size) {
  const int64_t f = rows / 2, s = f / size;
  return {{s * r, s}, {f + s * r, s}};
}

std::vector<Spec> specs() {
  std::vector<Spec> out;
  out.push_back({"w_col", {8, 6}, DType::kF32, 0, [](int r, int s) { return even_split(8, r, s); }, {}});
  out.push_back({"w_row", {5, 8}, DType::kBF16, 1, [](int r, int s) { return even_split(8, r, s); }, {}});
  out.push_back({"fc1", {8, 3}, DType::kF32, 0, [](int r, int s) { return gated_split(8, r, s); }, {}});
  out.push_back({"bias", {7}, DType::kF32, -1, nullptr, {}});
  out.push_back({"w3d", {2, 4, 3}, DType::kBF16, 1, [](int r, int s) { return even_split(4, r, s); }, {}});
  for (size_t i = 0; i < out.size(); ++i)
    out[i].values = make_values(out[i].shape.numel(), int(i) * 10 + 1, out[i].saved_dtype == DType::kBF16);
  return out;
}

// The global flat index of element k of the box (partition_dim, ranges) — element by element, the
// obvious way.
int64_t box_to_global(const Shape& g, int pd, const std::vector<BoxRange>& ranges, int64_t k) {
  if (pd < 0) return k;
  std::vector<int64_t> box(g.begin(), g.end());
  int64_t local = 0;
  for (const BoxRange& r : ranges) local += r.size;
  box[size_t(pd)] = local;
  std::vector<int64_t> idx(box.size());
  for (int i = int(box.size()) - 1; i >= 0; --i) {
    idx[size_t(i)] = k % box[size_t(i)];
    k /= box[size_t(i)];
  }
  int64_t l = idx[size_t(pd)];
  for (const BoxRange& r : ranges) {
    if (l < r.size) {
      idx[size_t(pd)] = r.start + l;
      break;
    }
    l -= r.size;
  }
  int64_t flat = 0;
  for (int i = 0; i < g.ndim(); ++i) flat = flat * g[i] + idx[size_t(i)];
  return flat;
}

float to_dtype_and_back(float x, DType dt) {
  return dt == DType::kBF16 ? bf16_to_f32(f32_to_bf16(x)) : dt == DType::kF16 ? f16_to_f32(f32_to_f16(x)) : x;
}

float element(const TensorView& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32: return t.data<float>()[i];
    case DType::kBF16: return bf16_to_f32(t.data<uint16_t>()[i]);
    case DType::kF16: return f16_to_f32(t.data<uint16_t>()[i]);
    default: ADD_FAILURE() << "unexpected dtype"; return 0;
  }
}

void set_element(const TensorView& t, int64_t i, float x) {
  switch (t.dtype()) {
    case DType::kF32: t.data<float>()[i] = x; break;
    case DType::kBF16: t.data<uint16_t>()[i] = f32_to_bf16(x); break;
    case DType::kF16: t.data<uint16_t>()[i] = f32_to_f16(x); break;
    default: ADD_FAILURE() << "unexpected dtype";
  }
}

// A piece holding the spec's values (stored in dtype `dt`); `storage` keeps its data alive.
TensorPiece make_piece(const Spec& s, int pd, std::vector<BoxRange> ranges, int64_t fb, int64_t fe, DType dt,
                       std::vector<Tensor>& storage) {
  TensorPiece p;
  p.name = s.name;
  p.global_shape = s.shape;
  p.partition_dim = pd;
  p.ranges = std::move(ranges);
  p.flat_begin = fb;
  p.flat_end = fe;
  Tensor t = Tensor::empty({fe - fb}, dt);
  for (int64_t k = fb; k < fe; ++k)
    set_element(t, k - fb, s.values[size_t(box_to_global(s.shape, pd, p.ranges, k))]);
  storage.push_back(t);
  p.data = t;
  return p;
}

// An empty destination piece of the same geometry, filled with a sentinel.
TensorPiece make_target(const Spec& s, int pd, std::vector<BoxRange> ranges, int64_t fb, int64_t fe, DType dt,
                        std::vector<Tensor>& storage) {
  TensorPiece p;
  p.name = s.name;
  p.global_shape = s.shape;
  p.partition_dim = pd;
  p.ranges = std::move(ranges);
  p.flat_begin = fb;
  p.flat_end = fe;
  Tensor t = Tensor::empty({fe - fb}, dt);
  for (int64_t k = 0; k < fe - fb; ++k) set_element(t, k, -12345.0f);
  storage.push_back(t);
  p.data = t;
  return p;
}

// Every element of a filled target equals the reference converted to the target's dtype.
void expect_filled(const Spec& s, const TensorPiece& t) {
  int bad = 0;
  for (int64_t k = t.flat_begin; k < t.flat_end; ++k) {
    const int64_t g = box_to_global(s.shape, t.partition_dim, t.ranges, k);
    const float want = to_dtype_and_back(s.values[size_t(g)], t.data.dtype());
    const float got = element(t.data, k - t.flat_begin);
    if (got != want && bad++ < 5)
      ADD_FAILURE() << s.name << " box element " << k << " (global " << g << "): got " << got << ", want " << want;
  }
}

int64_t box_numel(const Spec& s, int pd, const std::vector<BoxRange>& ranges) {
  TensorPiece p;
  p.global_shape = s.shape;
  p.partition_dim = pd;
  p.ranges = ranges;
  return piece_box_numel(p);
}

constexpr int kTP = 2, kDP = 2, kWorld = kTP * kDP;

// Rank r's pieces in the TP2 x ZeRO2 layout (Megatron order: tp fastest). ZeRO splits each rank's TP box
// unevenly by flat range: dp 0 holds the first third, dp 1 the rest. The replicated bias is held (and
// saved) by both TP ranks: duplicates the reader must tolerate.
std::vector<TensorPiece> rank_pieces(const std::vector<Spec>& all, int r, std::vector<Tensor>& storage,
                                     const std::function<bool(const Spec&, int)>& skip = nullptr) {
  const int tp = r % kTP, dp = r / kTP;
  std::vector<TensorPiece> out;
  for (const Spec& s : all) {
    if (skip && skip(s, r)) continue;
    const std::vector<BoxRange> ranges = s.partition_dim >= 0 ? s.tp(tp, kTP) : std::vector<BoxRange>{};
    const int64_t n = box_numel(s, s.partition_dim, ranges), cut = n / 3;
    out.push_back(make_piece(s, s.partition_dim, ranges, dp == 0 ? 0 : cut, dp == 0 ? cut : n, s.saved_dtype,
                             storage));
  }
  return out;
}

class ShardedTest : public TempDirTest {
 protected:
  // Saves the simulated ranks' pieces as the checkpoint of `iteration` under `root` and commits it.
  std::string save_all(const std::string& root, int64_t iteration, const std::vector<Spec>& all,
                       const std::function<bool(const Spec&, int)>& skip = nullptr) {
    std::vector<Tensor> storage;
    const std::string staging = begin_checkpoint(root, iteration);
    for (int r = 0; r < kWorld; ++r) write_shard(staging, r, rank_pieces(all, r, storage, skip));
    write_sharded_metadata(staging, kWorld, R"({"tp":2,"pp":1,"dp":2,"cp":1,"zero":"optim"})",
                           R"({"iteration": )" + std::to_string(iteration) + "}");
    commit_checkpoint(root, iteration);
    return checkpoint_dir(root, iteration);
  }
};

TEST_F(ShardedTest, ShardFileNames) {
  EXPECT_EQ(shard_file_name(0), "shard_00000.safetensors");
  EXPECT_EQ(shard_file_name(123), "shard_00123.safetensors");
}

TEST_F(ShardedTest, ReadsBackIntoTP1Full) {
  const std::vector<Spec> all = specs();
  const std::string dir = save_all(file("ck"), 10, all);
  ASSERT_TRUE(is_sharded_checkpoint(dir));
  const ShardedCheckpoint ck = ShardedCheckpoint::open(dir);
  EXPECT_EQ(ck.world_size(), kWorld);
  EXPECT_EQ(nlohmann::json::parse(ck.layout_json()), nlohmann::json::parse(R"({"tp":2,"pp":1,"dp":2,"cp":1,"zero":"optim"})"));
  EXPECT_EQ(nlohmann::json::parse(ck.metadata_json())["iteration"], 10);
  EXPECT_EQ(ck.tensor_names(), (std::vector<std::string>{"bias", "fc1", "w3d", "w_col", "w_row"}));
  EXPECT_EQ(ck.num_saved_pieces("bias"), 4);  // 2 TP replicas x 2 ZeRO halves
  for (const Spec& s : all) {
    EXPECT_EQ(ck.global_shape(s.name), s.shape);
    // read_full in f32: exact (bf16-saved values widen exactly).
    const Tensor full = ck.read_full(s.name, DType::kF32);
    ASSERT_EQ(full.shape(), s.shape);
    for (int64_t i = 0; i < s.shape.numel(); ++i) ASSERT_EQ(full.data<float>()[i], s.values[size_t(i)]) << s.name;
    // The same through a target with the TP partition dim and a single full range, in bf16 (rounds the f32
    // tensors to nearest even).
    std::vector<Tensor> st;
    if (s.partition_dim >= 0) {
      TensorPiece t = make_target(s, s.partition_dim, {{0, s.shape[s.partition_dim]}}, 0, s.shape.numel(),
                                  DType::kBF16, st);
      ck.read(t);
      expect_filled(s, t);
    }
  }
}

TEST_F(ShardedTest, ReadsBackIntoTP4) {
  const std::vector<Spec> all = specs();
  const ShardedCheckpoint ck = ShardedCheckpoint::open(save_all(file("ck"), 10, all));
  for (int r = 0; r < 4; ++r) {
    std::vector<Tensor> st;
    std::vector<TensorPiece> targets;
    for (const Spec& s : all) {
      const std::vector<BoxRange> ranges = s.partition_dim >= 0 ? s.tp(r, 4) : std::vector<BoxRange>{};
      targets.push_back(make_target(s, s.partition_dim, ranges, 0, box_numel(s, s.partition_dim, ranges),
                                    DType::kF32, st));
    }
    ck.read(targets);
    for (size_t i = 0; i < all.size(); ++i) expect_filled(all[i], targets[i]);
  }
}

TEST_F(ShardedTest, ReadsBackIntoZeroOver3RanksAndOtherDtypes) {
  const std::vector<Spec> all = specs();
  const ShardedCheckpoint ck = ShardedCheckpoint::open(save_all(file("ck"), 10, all));
  for (const DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    // TP1 x ZeRO3: each rank holds a flat third of the whole tensor (box = whole tensor).
    for (const Spec& s : all) {
      const int64_t n = s.shape.numel();
      for (int z = 0; z < 3; ++z) {
        std::vector<Tensor> st;
        TensorPiece t = make_target(s, -1, {}, n * z / 3, n * (z + 1) / 3, dt, st);
        ck.read(t);
        expect_filled(s, t);
      }
    }
    // TP4 x ZeRO3 (flat windows of TP4 boxes; the gated tensor's box has two ranges).
    for (const Spec& s : all) {
      if (s.partition_dim < 0) continue;
      for (int r = 0; r < 4; ++r) {
        const std::vector<BoxRange> ranges = s.tp(r, 4);
        const int64_t n = box_numel(s, s.partition_dim, ranges);
        for (int z = 0; z < 3; ++z) {
          std::vector<Tensor> st;
          TensorPiece t = make_target(s, s.partition_dim, ranges, n * z / 3, n * (z + 1) / 3, dt, st);
          ck.read(t);
          expect_filled(s, t);
        }
      }
    }
  }
}

TEST_F(ShardedTest, ReadsAlongAnotherPartitionDimAndOddRanges) {
  const std::vector<Spec> all = specs();
  const ShardedCheckpoint ck = ShardedCheckpoint::open(save_all(file("ck"), 10, all));
  // w_col was split along dim 0; ask for columns, ranges out of order, and a flat window of that box.
  const Spec& w = all[0];
  std::vector<Tensor> st;
  TensorPiece cols = make_target(w, 1, {{4, 2}, {1, 2}}, 0, 8 * 4, DType::kF32, st);
  TensorPiece window = make_target(w, 1, {{4, 2}, {1, 2}}, 5, 19, DType::kBF16, st);
  // w_row (split along dim 1) read by rows.
  const Spec& wr = all[1];
  TensorPiece rows = make_target(wr, 0, {{3, 2}, {0, 1}}, 0, 3 * 8, DType::kF32, st);
  // The 3-D tensor along its last dim.
  const Spec& w3 = all[4];
  TensorPiece last = make_target(w3, 2, {{1, 2}}, 0, 2 * 4 * 2, DType::kF32, st);
  ck.read({cols, window, rows, last});
  expect_filled(w, cols);
  expect_filled(w, window);
  expect_filled(wr, rows);
  expect_filled(w3, last);
}

TEST_F(ShardedTest, SeveralPiecesOfOneTensorOnOneRankAndEmptyRanks) {
  const std::vector<Spec> all = specs();
  const Spec& s = all[0];
  std::vector<Tensor> st;
  const std::string root = file("ck");
  const std::string staging = begin_checkpoint(root, 3);
  // Rank 0 holds two disjoint flat windows of the whole tensor (two safetensors keys for one name), rank 1
  // the middle (as a partition-dim box with one full range), rank 2 nothing at all.
  write_shard(staging, 0, {make_piece(s, -1, {}, 0, 10, DType::kF32, st), make_piece(s, -1, {}, 30, 48, DType::kF32, st)});
  write_shard(staging, 1, {make_piece(s, 0, {{0, 8}}, 10, 30, DType::kF32, st)});
  write_shard(staging, 2, {});
  write_sharded_metadata(staging, 3, "{}", "{}");
  commit_checkpoint(root, 3);
  const ShardedCheckpoint ck = ShardedCheckpoint::open(checkpoint_dir(root, 3));
  EXPECT_EQ(ck.num_saved_pieces("w_col"), 3);
  TensorPiece t = make_target(s, -1, {}, 0, 48, DType::kF32, st);
  ck.read(t);
  expect_filled(s, t);
}

TEST_F(ShardedTest, CoverageGapNamesTensorAndRange) {
  const std::vector<Spec> all = specs();
  // ZeRO rank dp 1 of TP rank 0 (global rank 2) did not save w_col: its rows 0..3 lack box elements
  // [8, 24), i.e. global flat [8, 24) = elements (1, 2) .. (3, 5).
  const ShardedCheckpoint ck = ShardedCheckpoint::open(
      save_all(file("ck"), 10, all, [](const Spec& s, int r) { return s.name == "w_col" && r == 2; }));
  std::vector<Tensor> st;
  TensorPiece full = make_target(all[0], -1, {}, 0, 48, DType::kF32, st);
  TensorPiece other = make_target(all[1], -1, {}, 0, 40, DType::kF32, st);
  expect_user_error([&] { ck.read({other, full}); }, {"w_col", "(8, 6)", "[8, 24)", "(1, 2)", "(3, 5)"});
  // Checks run before copying: the good target was not written either.
  EXPECT_EQ(element(other.data, 0), -12345.0f);
  // Rows 4..7 (TP rank 1's part) are still fully covered.
  TensorPiece ok = make_target(all[0], 0, {{4, 4}}, 0, 24, DType::kF32, st);
  ck.read(ok);
  expect_filled(all[0], ok);
}

TEST_F(ShardedTest, ShapeMismatchAndMissingTensor) {
  const std::vector<Spec> all = specs();
  const ShardedCheckpoint ck = ShardedCheckpoint::open(save_all(file("ck"), 10, all));
  Spec wrong = all[0];
  wrong.shape = Shape{8, 7};
  std::vector<Tensor> st;
  TensorPiece t = make_target(wrong, -1, {}, 0, 56, DType::kF32, st);
  expect_user_error([&] { ck.read(t); }, {"w_col", "(8, 6)", "(8, 7)"});
  Spec missing = all[0];
  missing.name = "decoder.layers.9.mlp.linear_fc2.weight";
  TensorPiece m = make_target(missing, -1, {}, 0, 48, DType::kF32, st);
  expect_user_error([&] { ck.read(m); }, {"decoder.layers.9.mlp.linear_fc2.weight", "no tensor"});
  expect_user_error([&] { (void)ck.global_shape("nope"); }, {"nope"});
}

TEST_F(ShardedTest, MissingOrCorruptShardNamesTheFile) {
  const std::vector<Spec> all = specs();
  const std::string dir = save_all(file("ck"), 10, all);
  const std::string shard2 = dir + "/shard_00002.safetensors";
  const std::string shard1 = dir + "/shard_00001.safetensors";
  const std::string bytes2 = read_file(shard2);
  std::filesystem::remove(shard2);
  expect_user_error([&] { ShardedCheckpoint::open(dir); }, {shard2, "missing"});
  write_file(shard2, bytes2);
  (void)ShardedCheckpoint::open(dir);  // whole again

  const std::string bytes1 = read_file(shard1);
  write_file(shard1, bytes1.substr(0, bytes1.size() / 2));  // truncated
  expect_user_error([&] { ShardedCheckpoint::open(dir); }, {shard1});
  std::string garbled = bytes1;
  garbled[10] = '\x01';  // inside the JSON header
  write_file(shard1, garbled);
  expect_user_error([&] { ShardedCheckpoint::open(dir); }, {shard1});
  write_file(shard1, bytes1);
  (void)ShardedCheckpoint::open(dir);

  // A plain safetensors file without the piece index.
  write_safetensors(shard1, {});
  expect_user_error([&] { ShardedCheckpoint::open(dir); }, {shard1, "loom_sharded_index"});
  std::filesystem::remove(dir + "/metadata.json");
  EXPECT_FALSE(is_sharded_checkpoint(dir));
  expect_user_error([&] { ShardedCheckpoint::open(dir); }, {dir, "metadata.json"});
}

TEST_F(ShardedTest, ShardsOfDifferentModelsAreRejected) {
  std::vector<Spec> all = specs();
  const std::string dir = save_all(file("ck"), 10, all);
  std::vector<Spec> other = specs();
  other[3].shape = Shape{9};
  other[3].values = make_values(9, 5, false);
  const std::string dir2 = save_all(file("ck2"), 10, other);
  std::filesystem::copy_file(dir2 + "/shard_00003.safetensors", dir + "/shard_00003.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  expect_user_error([&] { ShardedCheckpoint::open(dir); }, {"bias", "(7)", "(9)", "shard_00003.safetensors"});
}

TEST_F(ShardedTest, MetadataMustBeObjectsAndNotUseTheReservedKey) {
  const std::string staging = begin_checkpoint(file("ck"), 1);
  expect_user_error([&] { write_sharded_metadata(staging, 1, "[1]", "{}"); }, {"layout", "JSON object"});
  expect_user_error([&] { write_sharded_metadata(staging, 1, "{}", "not json"); }, {"metadata", "JSON object"});
  expect_user_error([&] { write_sharded_metadata(staging, 1, "{}", R"({"sharded_checkpoint": 1})"); },
                    {"sharded_checkpoint", "reserved"});
}

TEST_F(ShardedTest, CrashBeforeCommitLeavesPreviousCheckpoint) {
  const std::vector<Spec> all = specs();
  const std::string root = file("ck");
  save_all(root, 10, all);
  // A save of iteration 20 that dies after some shards were written: no commit.
  std::vector<Spec> newer = specs();
  for (float& v : newer[0].values) v += 1.0f;
  {
    std::vector<Tensor> st;
    const std::string staging = begin_checkpoint(root, 20);
    write_shard(staging, 0, rank_pieces(newer, 0, st));
    write_shard(staging, 1, rank_pieces(newer, 1, st));
  }
  // And a re-save of iteration 10 itself that dies after writing everything but before commit.
  {
    std::vector<Tensor> st;
    const std::string staging = begin_checkpoint(root, 10);
    for (int r = 0; r < kWorld; ++r) write_shard(staging, r, rank_pieces(newer, r, st));
    write_sharded_metadata(staging, kWorld, "{}", "{}");
  }
  EXPECT_EQ(read_file(checkpoint_tracker_path(root)), "10");
  const std::optional<LatestCheckpoint> latest = read_latest_checkpoint(root);
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->iteration, 10);
  EXPECT_FALSE(std::filesystem::exists(checkpoint_dir(root, 20)));
  const ShardedCheckpoint ck = ShardedCheckpoint::open(latest->dir);
  const Tensor w = ck.read_full("w_col", DType::kF32);
  for (int64_t i = 0; i < 48; ++i) ASSERT_EQ(w.data<float>()[i], all[0].values[size_t(i)]);  // the old values
  // The next save cleans the crashed staging dirs up and commits normally.
  save_all(root, 20, newer);
  EXPECT_FALSE(std::filesystem::exists(checkpoint_staging_dir(root, 10)));
  const ShardedCheckpoint ck20 = ShardedCheckpoint::open(read_latest_checkpoint(root)->dir);
  EXPECT_EQ(ck20.read_full("w_col", DType::kF32).data<float>()[5], newer[0].values[5]);
}

TEST_F(ShardedTest, CollectiveSaveOverASingleRankWorld) {
  const std::vector<Spec> all = specs();
  std::vector<Tensor> st;
  std::vector<TensorPiece> pieces;
  for (const Spec& s : all) pieces.push_back(make_piece(s, -1, {}, 0, s.shape.numel(), s.saved_dtype, st));
  const std::unique_ptr<Communicator> world = make_self_communicator("world");
  save_sharded_checkpoint(file("a"), 5, pieces, R"({"tp":1})", R"({"note":"x"})", *world);
  int barriers = 0;
  save_sharded_checkpoint(file("b"), 6, pieces, R"({"tp":1})", "{}", 0, 1, [&] { ++barriers; });
  EXPECT_EQ(barriers, 3);
  for (const std::string& dir : {checkpoint_dir(file("a"), 5), checkpoint_dir(file("b"), 6)}) {
    const ShardedCheckpoint ck = ShardedCheckpoint::open(dir);
    for (const Spec& s : all) {
      const Tensor t = ck.read_full(s.name, DType::kF32);
      for (int64_t i = 0; i < s.shape.numel(); ++i) ASSERT_EQ(t.data<float>()[i], s.values[size_t(i)]) << dir;
    }
  }
  // A failing rank (a malformed piece) fails the save; the previous checkpoint stays current.
  TensorPiece bad = pieces[0];
  bad.flat_end = 1000;
  EXPECT_THROW(save_sharded_checkpoint(file("a"), 7, {bad}, "{}", "{}", *world), Error);
  EXPECT_EQ(read_latest_checkpoint(file("a"))->iteration, 5);
}

// ---- checksums ----------------------------------------------------------------------------------

// A damaged piece: every read that needs any part of it (the whole tensor, or one TP rank's slice that
// overlaps it only partly) fails, naming the checkpoint directory, the shard file, the tensor and the
// other checkpoints of the root; reads of other tensors still work; a failed read leaves its targets
// untouched.
TEST_F(ShardedTest, DamagedPieceNamesDirFileTensorAndOtherCheckpoints) {
  const std::vector<Spec> all = specs();
  const std::string root = file("ck");
  for (int64_t it : {10, 20, 30}) save_all(root, it, all);
  const std::string dir = checkpoint_dir(root, 30);
  const std::string shard = dir + "/shard_00001.safetensors";  // tp 1, dp 0: the first third of its box
  ckpt_test::overwrite_tensor_bytes(shard, "w_col", 4, std::string(8, '\x77'));
  const ShardedCheckpoint ck = ShardedCheckpoint::open(dir);  // headers only: fine
  EXPECT_EQ(ck.checksum_note(), "");
  const std::vector<std::string> parts = {"checkpoint " + dir + " is damaged", shard, "tensor 'w_col'",
                                          "checksum mismatch", "other checkpoints in " + root + ": iterations 10, 20",
                                          "--ckpt-step", checkpoint_dir(root, 20)};
  auto expect_damaged = [&](const std::function<void()>& read) {
    try {
      read();
      ADD_FAILURE() << "read a damaged piece";
    } catch (const ChecksumError& e) {
      EXPECT_EQ(e.path(), shard);
      EXPECT_EQ(e.tensor(), "w_col");
      for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  };
  expect_damaged([&] { ck.read_full("w_col", DType::kF32); });
  // TP4 rank 2 (rows 4 and 5) overlaps only the first of the damaged piece's rows; the bias comes first in
  // the same call and must stay untouched too.
  std::vector<Tensor> st;
  std::vector<TensorPiece> targets = {make_target(all[3], -1, {}, 0, 7, DType::kF32, st),
                                      make_target(all[0], 0, {{4, 2}}, 0, 12, DType::kF32, st)};
  expect_damaged([&] { ck.read(targets); });
  for (const TensorPiece& t : targets)
    for (int64_t k = 0; k < t.data.numel(); ++k) ASSERT_EQ(t.data.data<float>()[k], -12345.0f) << t.name;
  // TP4 rank 0 (rows 0 and 1) needs only pieces of TP rank 0: no damage there.
  TensorPiece clean = make_target(all[0], 0, {{0, 2}}, 0, 12, DType::kF32, st);
  ck.read(clean);
  expect_filled(all[0], clean);
  ck.read(targets[0]);
  expect_filled(all[3], targets[0]);

  // The only checkpoint of its root: nothing to fall back to.
  const std::string lone = save_all(file("lone"), 5, all);
  ckpt_test::overwrite_tensor_bytes(lone + "/shard_00000.safetensors", "bias", 0, ckpt_test::nan_bytes(1));
  expect_user_error([&] { ShardedCheckpoint::open(lone).read_full("bias", DType::kF32); },
                    {lone, "shard_00000.safetensors", "'bias'", "there is no other checkpoint in " + file("lone")});
}

// metadata.json is checked against the checksum shard 0 records for it: an edit that keeps it valid JSON
// (a changed digit of the iteration) is caught at open.
TEST_F(ShardedTest, DamagedMetadataIsCaughtAtOpen) {
  const std::vector<Spec> all = specs();
  std::vector<Tensor> st;
  std::vector<TensorPiece> pieces;
  for (const Spec& s : all) pieces.push_back(make_piece(s, -1, {}, 0, s.shape.numel(), s.saved_dtype, st));
  const std::string root = file("ck");
  save_sharded_checkpoint(root, 4, pieces, R"({"tp":1})", R"({"iteration": 4})", 0, 1, [] {});
  save_sharded_checkpoint(root, 8, pieces, R"({"tp":1})", R"({"iteration": 8})", 0, 1, [] {});
  const std::string dir = checkpoint_dir(root, 8), meta = dir + "/metadata.json";
  (void)ShardedCheckpoint::open(dir);
  std::string text = read_file(meta);
  const size_t at = text.find("\"iteration\": 8");
  ASSERT_NE(at, std::string::npos) << text;
  text[at + 13] = '9';
  write_file(meta, text);
  expect_user_error([&] { ShardedCheckpoint::open(dir); },
                    {"checkpoint " + dir + " is damaged", "metadata.json", "shard_00000.safetensors", "iteration 4"});
}

// A checkpoint written before checksums (the same files without them) loads, unverified, and says so
// once; so does the single-file format.
TEST_F(ShardedTest, CheckpointWithoutChecksumsLoadsWithANote) {
  const std::vector<Spec> all = specs();
  const std::string dir = save_all(file("ck"), 10, all);
  for (int r = 0; r < kWorld; ++r) ckpt_test::strip_checksums(dir + "/" + shard_file_name(r));
  ASSERT_FALSE(SafetensorsFile::open(dir + "/shard_00000.safetensors").has_checksums());
  const ShardedCheckpoint ck = ShardedCheckpoint::open(dir);
  EXPECT_NE(ck.checksum_note().find("note: checkpoint " + dir), std::string::npos) << ck.checksum_note();
  EXPECT_NE(ck.checksum_note().find("cannot be verified"), std::string::npos) << ck.checksum_note();
  for (const Spec& s : all) {
    std::vector<Tensor> st;
    TensorPiece t = make_target(s, -1, {}, 0, s.shape.numel(), DType::kF32, st);
    ck.read(t);
    expect_filled(s, t);
  }
  // One shard without (copied in from an older save): named.
  const std::string dir2 = save_all(file("ck2"), 10, all);
  ckpt_test::strip_checksums(dir2 + "/shard_00002.safetensors");
  EXPECT_NE(ShardedCheckpoint::open(dir2).checksum_note().find("shard_00002.safetensors records none"),
            std::string::npos)
      << ShardedCheckpoint::open(dir2).checksum_note();
  const std::string legacy = std::string(LOOM_SOURCE_DIR) + "/tests/golden/fixtures/legacy_single_ckpt/ck/iter_0000004";
  EXPECT_NE(ShardedCheckpoint::open(legacy).checksum_note().find("its files record none"), std::string::npos);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// The single-file format of Loom 0.1.0 reads as a world of one: every tensor one whole piece, the Adam
// moments under the sharded names, the values those of the files; broken "files" lists are named.
TEST_F(TempDirTest, SingleFileCheckpointsReadAsAWorldOfOne) {
  const std::string fixture =
      std::string(LOOM_SOURCE_DIR) + "/tests/golden/fixtures/legacy_single_ckpt/ck/iter_0000004";
  const ShardedCheckpoint ck = ShardedCheckpoint::open(fixture);
  EXPECT_EQ(ck.world_size(), 1);
  EXPECT_EQ(nlohmann::json::parse(ck.layout_json())["sharding"], "no_shard");
  const SafetensorsFile model = SafetensorsFile::open(fixture + "/model.safetensors");
  const SafetensorsFile optim = SafetensorsFile::open(fixture + "/optimizer.safetensors");
  EXPECT_EQ(ck.tensor_names().size(), model.names().size() + optim.names().size());
  for (const std::string& name : model.names()) {
    ASSERT_TRUE(ck.contains(name)) << name;
    EXPECT_EQ(ck.num_saved_pieces(name), 1);
    const Tensor a = ck.read_full(name, DType::kF32), b = model.read(name);
    ASSERT_EQ(a.shape(), b.shape()) << name;
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())), 0) << name;
    const Tensor m = ck.read_full("optimizer.exp_avg_sq." + name, DType::kF32);
    const Tensor want = optim.read(name + ".exp_avg_sq");
    EXPECT_EQ(std::memcmp(m.raw(), want.raw(), size_t(m.nbytes())), 0) << name;
  }
  // A slice of a whole piece (how a TP rank reads it).
  TensorPiece row;
  row.name = "embedding.word_embeddings.weight";
  row.global_shape = ck.global_shape(row.name);
  row.partition_dim = 0;
  row.ranges = {{64, 64}};
  Tensor half = Tensor::empty({64, row.global_shape[1]}, DType::kF32);
  row.data = half;
  ck.read(row);
  const Tensor full = model.read(row.name);
  EXPECT_EQ(std::memcmp(half.raw(), full.data<float>() + 64 * row.global_shape[1], size_t(half.nbytes())), 0);

  // Broken lists of files.
  const std::string dir = file("legacy");
  std::filesystem::copy(fixture, dir);
  const std::string meta = read_file(dir + "/metadata.json");
  auto with_files = [&](const std::string& files) {
    nlohmann::json j = nlohmann::json::parse(meta);
    j["files"] = nlohmann::json::parse(files);
    write_file(dir + "/metadata.json", j.dump());
  };
  with_files(R"({"model": "../model.safetensors"})");
  expect_user_error([&] { ShardedCheckpoint::open(dir); }, {"../model.safetensors", "inside the checkpoint directory"});
  with_files(R"({"model": "gone.safetensors"})");
  expect_user_error([&] { ShardedCheckpoint::open(dir); }, {"gone.safetensors", "is missing"});
  with_files(R"({"optimizer": "optimizer.safetensors"})");
  expect_user_error([&] { ShardedCheckpoint::open(dir); }, {"metadata.json", "not a Loom checkpoint"});
  with_files(R"({"model": "optimizer.safetensors"})");
  (void)ShardedCheckpoint::open(dir);  // names are the file's own: "<param>.exp_avg" as a model tensor
  with_files(R"({"model": "model.safetensors", "optimizer": "model.safetensors"})");
  expect_user_error([&] { ShardedCheckpoint::open(dir); }, {"model.safetensors", "is not \"<param>.exp_avg\""});
}

}  // namespace
}  // namespace loom
