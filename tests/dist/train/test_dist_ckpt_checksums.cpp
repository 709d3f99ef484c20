// Checksummed sharded checkpoints under mpirun: a TP2 checkpoint saved by two ranks, with one rank's shard
// file damaged (1 KiB of garbage in a TP-split weight), must not load, whether two ranks read their own
// shards back or one process reshards both; the error names the file and the tensor and offers the
// earlier iteration, which --ckpt-step then resumes exactly.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "dist/train/dist_train_util.h"
#include "e2e/e2e_util.h"
#include "loom/ckpt/safetensors.h"
#include "unit/ckpt/ckpt_test_util.h"

namespace loom::e2e {
namespace {

const char* kModel =
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --lr-warmup-iters 2 --mock-data --vocab-size 97 "
    "--log-interval 1 --hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --seed 7 "
    "--make-vocab-size-divisible-by 64";  // 128 rows at TP 1 and 2: one model in both layouts

TEST(DistCkptChecksums, DamagedShardOfOneRankFailsEveryLoad) {
  TempDir ck("cksum");
  const std::string root = ck / "c", tp2 = "--tensor-model-parallel-size 2 ";
  const std::vector<double> first = train_losses(kModel, tp2 + "--save " + root + " --save-interval 5", 2, 10);
  ASSERT_EQ(first.size(), 10u);
  const std::string shard = root + "/iter_0000010/shard_00001.safetensors";
  const std::string tensor = "decoder.layers.0.mlp.linear_fc1.weight";  // rank 1's half of the rows
  {
    const SafetensorsFile f = SafetensorsFile::open(shard);
    ASSERT_TRUE(f.has_checksums());
    ASSERT_EQ(f.info(tensor).shape, Shape{64 * 32});
  }
  std::string garbage(1024, '\0');
  for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = char(i * 37 + 11);
  ckpt_test::overwrite_tensor_bytes(shard, tensor, 4096, garbage);

  // Only rank 1 reads the damaged shard under TP 2, and rank 0 goes on to train iterations 11-12. Rank 1's
  // error ends the whole job at once (exit status 2, a user error) instead of rank 0 waiting in its first
  // collective until the 1-minute timeout.
  const std::string load = " --train-iters 12 --override-opt_param-scheduler --load " + root +
                           " --distributed-timeout-minutes 1";
  for (const std::string& cmd : {mpirun(2) + loom_bin() + " train " + kModel + " " + tp2 + load,
                                 "OMP_NUM_THREADS=1 " + loom_bin() + " train " + kModel + load}) {
    SCOPED_TRACE(cmd);
    TempDir tmp("run");
    const auto start = std::chrono::steady_clock::now();
    const CliResult r = run_shell(cmd, tmp);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_LT(seconds, 30.0) << r.out << r.err;
    EXPECT_EQ(r.err.find("did not complete within"), std::string::npos) << r.err;
    for (const std::string& p : {"checkpoint " + root + "/iter_0000010 is damaged", shard, "tensor '" + tensor + "'",
                                 std::string("checksum mismatch"), "other checkpoints in " + root + ": iteration 5",
                                 std::string("--ckpt-step")})
      EXPECT_NE(r.err.find(p), std::string::npos) << "missing: " << p << "\n" << r.err;
  }
  // The earlier checkpoint, as offered: the same losses as the first run from iteration 6 on.
  const std::vector<double> again = train_losses(kModel, tp2 + "--load " + root + " --ckpt-step 5", 2, 10);
  ASSERT_EQ(again.size(), 5u);
  for (size_t i = 0; i < again.size(); ++i) EXPECT_EQ(again[i], first[5 + i]) << "iteration " << 6 + i;
}

}  // namespace
}  // namespace loom::e2e
