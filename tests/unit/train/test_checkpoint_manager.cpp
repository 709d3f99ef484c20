// CheckpointManager: what save() writes load() restores into a fresh run — weights, Adam moments and
// step, scheduler, progress and dropout counter — as one rank's shard of the one format; without --save
// it only says so; a checkpoint without optimizer state is refused (naming the flag) before anything
// changes.
#include <gtest/gtest.h>

#include <filesystem>

#include "loom/ckpt/checkpoint.h"
#include "loom/core/check.h"
#include "train/checkpoint_manager.h"
#include "train/step_runner.h"
#include "unit/train/trainer_parts_util.h"

namespace loom {
namespace {

using parts_test::build_tiny_run;
using parts_test::master_weights;

std::vector<float> adam_state(TrainingRun& run) {
  std::vector<float> out;
  for (const StateShard& s : run.dopt->state_shards())
    for (const TensorView& v : {s.exp_avg, s.exp_avg_sq}) out.insert(out.end(), v.data<float>(), v.data<float>() + v.numel());
  return out;
}

class CheckpointManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("loom_ckmgr_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // A run trained for two steps and saved at iteration 2.
  void train_and_save(TrainingRun& run, const std::string& extra) {
    build_tiny_run(run, "--save " + dir_ + " " + extra);
    Timers timers(0);
    StepRunner steps(run, timers);
    Loader loader(run.train_ds, run.loader_config(0));
    for (int i = 0; i < 2; ++i) {
      steps.step(loader);
      ++run.progress.iteration;
      run.progress.consumed_train += run.gbs;
    }
    run.progress.consumed_valid = 8;
    std::ostringstream log;
    CheckpointManager(run, log).save();
    EXPECT_NE(log.str().find("saving checkpoint at iteration       2 to " + dir_ + " (1 rank)"), std::string::npos)
        << log.str();
  }
  std::string dir_;
};

TEST_F(CheckpointManagerTest, LoadRestoresWhatSaveWrote) {
  TrainingRun a;
  train_and_save(a, "");
  EXPECT_TRUE(std::filesystem::is_regular_file(dir_ + "/iter_0000002/shard_00000.safetensors"));
  EXPECT_EQ(read_latest_checkpoint(dir_)->iteration, 2);

  TrainingRun b;
  build_tiny_run(b, "--load " + dir_);
  EXPECT_NE(master_weights(b), master_weights(a));  // a fresh initialisation...
  std::ostringstream log;
  CheckpointManager(b, log).load();
  EXPECT_EQ(master_weights(b), master_weights(a));  // ...replaced by the saved weights
  EXPECT_EQ(adam_state(b), adam_state(a));
  EXPECT_EQ(b.dopt->num_steps(), 2);
  EXPECT_EQ(b.sched->num_steps(), a.sched->num_steps());
  EXPECT_EQ(b.sched->lr(), a.sched->lr());
  EXPECT_EQ(b.progress.iteration, 2);
  EXPECT_EQ(b.progress.consumed_train, 2 * a.gbs);
  EXPECT_EQ(b.progress.consumed_valid, 8);
  EXPECT_EQ(b.progress.micro_batches_done, a.progress.micro_batches_done);
  EXPECT_NE(log.str().find("successfully loaded checkpoint from " + dir_ + " at iteration 2"), std::string::npos)
      << log.str();
  // --finetune: the weights only, from iteration 0.
  TrainingRun c;
  build_tiny_run(c, "--load " + dir_ + " --finetune");
  CheckpointManager(c, log).load();
  EXPECT_EQ(master_weights(c), master_weights(a));
  EXPECT_EQ(c.progress.iteration, 0);
  EXPECT_EQ(c.dopt->num_steps(), 0);
  EXPECT_EQ(c.sched->num_steps(), 0);
}

TEST_F(CheckpointManagerTest, NoSaveDirOnlySaysSo) {
  TrainingRun run;
  build_tiny_run(run);
  std::ostringstream log;
  CheckpointManager(run, log).save();
  EXPECT_NE(log.str().find("no --save directory: not saving a checkpoint at iteration 0"), std::string::npos);
}

TEST_F(CheckpointManagerTest, MissingOptimizerStateIsRefusedBeforeAnyChange) {
  TrainingRun a;
  train_and_save(a, "--no-save-optim");
  TrainingRun b;
  build_tiny_run(b, "--load " + dir_);
  const std::vector<float> fresh = master_weights(b);
  std::ostringstream log;
  try {
    CheckpointManager(b, log).load();
    ADD_FAILURE() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--no-load-optim"), std::string::npos) << e.what();
  }
  EXPECT_EQ(master_weights(b), fresh);
  EXPECT_EQ(b.progress.iteration, 0);
}

}  // namespace
}  // namespace loom
