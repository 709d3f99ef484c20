// Sharded checkpoints with real ranks (mpirun -np 4): the collective save (ckpt/sharded.h) of a TP2 x ZeRO2
// layout, every rank then reading its TP4 piece and a ZeRO-over-3 window, compared element by element with
// the global values; and failure agreement: one rank's bad piece makes every rank throw and keeps the
// previous checkpoint current.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/sharded.h"
#include "loom/dist/communicator.h"

namespace loom {
namespace {

const Communicator& world() {
  static std::unique_ptr<Communicator> w = init_world(std::chrono::milliseconds(60000));
  return *w;
}

// A directory every rank agrees on (rank 0's pid, broadcast), on tmpfs when there is one.
std::string shared_dir() {
  Tensor pid = Tensor::empty({1}, DType::kI64);
  pid.data<int64_t>()[0] = ::getpid();
  world().broadcast(pid, 0);
  std::error_code ec;
  const std::string base = std::filesystem::is_directory("/dev/shm", ec) ? "/dev/shm" : "/tmp";
  return base + "/loom_dist_ckpt_" + std::to_string(pid.data<int64_t>()[0]);
}

// Global (6, 8) tensor split along dim 1 by TP; element values distinct and bf16-exact.
constexpr int64_t kRows = 6, kCols = 8;
float value(int64_t row, int64_t col) { return float(row * 16 + col) * 0.5f - 7.0f; }

class DistSharded : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(world().size(), 4) << "run under mpirun -np 4"; }
};

// Rank r's piece: TP rank r % 2 holds columns [4t, 4t + 4); ZeRO rank r / 2 holds flat [0, 5) or [5, 24).
TensorPiece saved_piece(int r, Tensor& storage) {
  const int tp = r % 2, dp = r / 2;
  TensorPiece p;
  p.name = "decoder.layers.0.self_attention.linear_proj.weight";
  p.global_shape = {kRows, kCols};
  p.partition_dim = 1;
  p.ranges = {{4 * tp, 4}};
  p.flat_begin = dp == 0 ? 0 : 5;
  p.flat_end = dp == 0 ? 5 : 24;
  storage = Tensor::empty({p.flat_end - p.flat_begin}, DType::kBF16);
  for (int64_t k = p.flat_begin; k < p.flat_end; ++k)
    storage.data<uint16_t>()[k - p.flat_begin] = f32_to_bf16(value(k / 4, 4 * tp + k % 4));
  p.data = storage;
  return p;
}

TEST_F(DistSharded, SaveTP2Zero2ReadTP4AndZero3) {
  const int r = world().rank();
  const std::string root = shared_dir();
  Tensor st;
  const TensorPiece mine = saved_piece(r, st);
  save_sharded_checkpoint(root, 100, {mine}, R"({"tp":2,"dp":2,"zero":"optim"})", R"({"iteration":100})", world());
  const std::optional<LatestCheckpoint> latest = read_latest_checkpoint(root);
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->iteration, 100);
  const ShardedCheckpoint ck = ShardedCheckpoint::open(latest->dir);
  EXPECT_EQ(ck.world_size(), 4);

  // TP4: rank r holds columns [2r, 2r + 2), in f32.
  TensorPiece tp4 = mine;
  tp4.ranges = {{2 * r, 2}};
  tp4.flat_begin = 0;
  tp4.flat_end = -1;
  Tensor a = Tensor::empty({kRows * 2}, DType::kF32);
  tp4.data = a;
  ck.read(tp4);
  for (int64_t k = 0; k < kRows * 2; ++k) ASSERT_EQ(a.data<float>()[k], value(k / 2, 2 * r + k % 2)) << k;

  // TP1 x ZeRO3 over ranks 0..2: flat thirds of the whole tensor; rank 3 reads the whole tensor.
  TensorPiece z = mine;
  z.partition_dim = -1;
  z.ranges = {};
  z.flat_begin = r < 3 ? 16 * r : 0;
  z.flat_end = r < 3 ? 16 * (r + 1) : kRows * kCols;
  Tensor b = Tensor::empty({z.flat_end - z.flat_begin}, DType::kF32);
  z.data = b;
  ck.read(z);
  for (int64_t i = z.flat_begin; i < z.flat_end; ++i)
    ASSERT_EQ(b.data<float>()[i - z.flat_begin], value(i / kCols, i % kCols)) << i;

  // A save where rank 3's piece is malformed: every rank throws, the tracker still names iteration 100.
  TensorPiece bad = mine;
  if (r == 3) bad.flat_end = 1000;
  bool threw = false;
  try {
    save_sharded_checkpoint(root, 200, {bad}, "{}", "{}", world());
  } catch (const Error&) {
    threw = true;
    EXPECT_EQ(r, 3);
  } catch (const UserError& e) {
    threw = true;
    EXPECT_NE(r, 3);
    EXPECT_NE(std::string(e.what()).find("another rank"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(threw);
  world().barrier();
  EXPECT_EQ(read_latest_checkpoint(root)->iteration, 100);
  EXPECT_FALSE(std::filesystem::exists(checkpoint_dir(root, 200)));
  world().barrier();
  if (r == 0) std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace loom
