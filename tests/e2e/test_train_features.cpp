// End-to-end checks of the trainer's Megatron features, run in-process through parse_train_args +
// run_training on tiny models: FP16 dynamic/static loss scaling (overflow skips, hysteresis, growth
// window), activation recomputation (bit-identical losses, falling peak memory), the LR schedule as
// trained (closed-form formulas in samples), evaluation blocks, exit conditions, TensorBoard events
// (decoded by the independent tests/golden/tb_decode.py), the JSONL metrics file, checkpoint load
// errors, and the timer / memory log lines. Every expectation is derived from Megatron's rules here,
// not read back from the trainer's own helpers.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "e2e_util.h"
#include "loom/backend/device_context.h"
#include "loom/ckpt/checkpoint.h"
#include "loom/ckpt/sharded.h"
#include "loom/core/check.h"
#include "loom/data/indexed_dataset.h"
#include "loom/data/loader.h"
#include "loom/data/mock_dataset.h"
#include "loom/model/gpt.h"
#include "loom/train/args.h"
#include "loom/train/trainer.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::e2e;
using nlohmann::json;

namespace {

std::string fmt_e6(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6E", v);
  return buf;
}

constexpr int64_t kGbs = 4;  // samples per iteration of tiny_args

// Tiny GPT on mock data (gbs 4 = 2 micro-batches of 2), evaluation off unless a test turns it on.
Args tiny_args(int64_t iters) {
  return {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--micro-batch-size", "2", "--global-batch-size", std::to_string(kGbs), "--train-iters",
          std::to_string(iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2",
          "--lr-decay-style", "cosine", "--mock-data", "--vocab-size", "100", "--log-interval", "1",
          "--eval-iters", "0", "--seed", "5"};
}

// The log line of iteration `it` ("" if none).
std::string iteration_line(const std::string& log, int64_t it) {
  for (const std::string& l : lines_of(log))
    if (iteration_of(l) == it) return l;
  return "";
}

// Megatron's get_lr, in samples, written out from its definition: linear warmup from init_lr over
// `warmup` samples, then the decay style to min_lr over `decay` samples (WSD: constant until the last
// `wsd` samples, then the annealing shape).
struct Schedule {
  double max_lr = 1e-3, min_lr = 1e-4, init_lr = 0;
  int64_t warmup = 0, decay = 0, wsd = 0;
  std::string style = "cosine", wsd_style = "exponential";
};

double expected_lr(const Schedule& s, int64_t n) {
  if (s.warmup > 0 && n <= s.warmup) return s.init_lr + (s.max_lr - s.init_lr) * double(n) / double(s.warmup);
  if (s.style == "constant") return s.max_lr;
  if (n > s.decay) return s.min_lr;
  if (s.style == "inverse-square-root") {
    const double w = double(std::max<int64_t>(s.warmup, 1)), k = double(std::max<int64_t>(n, 1));
    return std::max(s.min_lr, s.max_lr * std::sqrt(w / k));
  }
  const double ratio = double(n - s.warmup) / double(s.decay - s.warmup);
  double coeff = 1.0 - ratio;
  if (s.style == "cosine") coeff = (1.0 + std::cos(M_PI * ratio)) / 2.0;
  if (s.style == "WSD") {
    const int64_t start = s.decay - s.wsd;
    const double r = n <= start ? 0.0 : double(n - start) / double(s.wsd);
    if (s.wsd_style == "linear") coeff = 1.0 - r;
    if (s.wsd_style == "cosine") coeff = (1.0 + std::cos(M_PI * r)) / 2.0;
    if (s.wsd_style == "exponential") coeff = 2.0 * std::pow(0.5, r) - 1.0;
    if (s.wsd_style == "minus_sqrt") coeff = 1.0 - std::sqrt(r);
  }
  return s.min_lr + coeff * (s.max_lr - s.min_lr);
}

void expect_lr_close(double got, double want, const std::string& what) {
  EXPECT_NEAR(got, want, 1e-12 * std::max(1e-3, std::fabs(want))) << what;
}

// Megatron's DynamicGradScaler.update, in float32 as Megatron keeps the scale.
struct ScalerModel {
  float scale;
  int64_t window, hysteresis, hyst_left, growth = 0;
  ScalerModel(float s, int64_t w, int64_t h) : scale(s), window(w), hysteresis(h), hyst_left(h) {}
  void update(bool overflow) {
    if (overflow) {
      growth = 0;
      if (--hyst_left <= 0) scale = std::max(scale * 0.5f, 1.0f);
    } else if (++growth == window) {
      growth = 0;
      hyst_left = hysteresis;
      scale *= 2.0f;
    }
  }
};

// Every file under `root`: (size, content hash, mtime). A failed load must leave this unchanged.
struct FileState {
  size_t size = 0, hash = 0;
  fs::file_time_type mtime;
  bool operator==(const FileState&) const = default;
};
using Snapshot = std::map<std::string, FileState>;

Snapshot snapshot(const std::string& root) {
  Snapshot out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    const std::string bytes = e.is_regular_file() ? read_file(e.path().string()) : "";
    out[e.path().string()] = {bytes.size(), std::hash<std::string>{}(bytes), fs::last_write_time(e.path())};
  }
  return out;
}

void expect_unchanged(const Snapshot& before, const Snapshot& after) {
  for (const auto& [path, st] : before) {
    const auto it = after.find(path);
    EXPECT_TRUE(it != after.end()) << "removed: " << path;
    if (it != after.end()) {
      EXPECT_TRUE(it->second == st) << "modified: " << path;
    }
  }
  for (const auto& [path, st] : after) EXPECT_TRUE(before.count(path)) << "created: " << path;
}

std::string tracker_of(const std::string& root) { return read_file(root + "/latest_checkpointed_iteration.txt"); }

// A run that must fail to load the checkpoint under `ckpt`: its one-line UserError names `needle`, and no
// file under `ckpt` is created, removed or modified.
void expect_load_error_touches_nothing(const std::string& ckpt, const Args& args, const std::string& needle) {
  const Snapshot before = snapshot(ckpt);
  const std::string err = train_error(args);
  EXPECT_NE(err.find(needle), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  expect_unchanged(before, snapshot(ckpt));
}

// An indexed dataset (bytes as ids, NullTokenizer with --vocab-size 256: EOD 256): documents [0, text_docs)
// repeat one sentence, the next noise_docs are random bytes from an LCG seeded with `seed`.
void write_dataset(const std::string& prefix, int text_docs, int noise_docs, uint32_t seed) {
  IndexedDatasetWriter w(prefix, index_dtype_for_vocab(257));
  uint32_t x = seed;
  const std::string sentence = "the quick brown fox jumps over the lazy dog. ";
  for (int d = 0; d < text_docs + noise_docs; ++d) {
    std::vector<int32_t> ids;
    for (size_t i = 0; i < sentence.size(); ++i) {
      x = x * 1664525u + 1013904223u;
      ids.push_back(d >= text_docs ? int32_t(x >> 24) : int32_t(uint8_t(sentence[i])));
    }
    ids.push_back(256);
    w.add_sequence(ids);
    w.end_document();
  }
  w.finalize();
}

}  // namespace

// ---- FP16 loss scaling ----------------------------------------------------------------------------

// Default --initial-loss-scale 2^32 overflows the fp16 gradients: those iterations are skipped (no
// optimizer or scheduler step), the scale follows Megatron's hysteresis rule (the first overflow only
// spends hysteresis, each later one halves), and once clean, exactly --loss-scale-window clean
// iterations double it.
TEST(TrainFp16, OverflowSkipsBackOffWithHysteresisThenGrowsAfterWindow) {
  std::string log;
  const TrainResult r = train(cat(tiny_args(40), {"--fp16", "--loss-scale-window", "3"}), &log);
  ASSERT_EQ(r.losses.size(), 40u);
  ASSERT_GT(r.skipped_iterations, 0);
  EXPECT_EQ(r.nan_iterations, 0);  // the forward loss is finite; only the scaled gradients overflow

  std::vector<bool> skipped;
  for (double g : r.grad_norms) skipped.push_back(std::isnan(g));
  EXPECT_EQ(std::count(skipped.begin(), skipped.end(), true), r.skipped_iterations);
  ASSERT_TRUE(skipped[0] && skipped[1]) << "2^32 must overflow the fp16 gradients";
  // The first overflow does not lower the scale (hysteresis 2 -> 1), the second halves it.
  EXPECT_EQ(r.loss_scales[0], 4294967296.0);
  EXPECT_EQ(r.loss_scales[1], 4294967296.0);
  EXPECT_EQ(r.loss_scales[2], 2147483648.0);

  // The whole sequence, from the rule and the observed overflows.
  ScalerModel m(4294967296.0f, 3, 2);
  for (size_t i = 0; i < r.loss_scales.size(); ++i) {
    EXPECT_EQ(r.loss_scales[i], double(m.scale)) << "iteration " << i + 1;
    m.update(skipped[i]);
  }
  // Training proceeds with finite losses, and the scale grew during the run: every doubling came right
  // after exactly 3 clean iterations (the simulation above also checks that none came earlier).
  size_t first_clean = 0;
  while (first_clean < skipped.size() && skipped[first_clean]) ++first_clean;
  ASSERT_LT(first_clean, skipped.size());
  EXPECT_TRUE(std::isfinite(r.grad_norms[first_clean]));
  for (size_t i = 0; i < r.losses.size(); ++i) EXPECT_TRUE(std::isfinite(r.losses[i])) << i;
  int doublings = 0;
  for (size_t j = 3; j < r.loss_scales.size(); ++j) {
    if (r.loss_scales[j] != 2 * r.loss_scales[j - 1]) continue;
    ++doublings;
    EXPECT_FALSE(skipped[j - 1] || skipped[j - 2] || skipped[j - 3]) << "doubled at iteration " << j + 1;
  }
  EXPECT_GT(doublings, 0);

  // Skipped iterations do not advance the scheduler: iteration i trains with the lr of the samples of
  // the clean iterations before it.
  const Schedule s{.warmup = 2 * kGbs, .decay = 40 * kGbs};
  int64_t clean = 0;
  for (size_t i = 0; i < r.learning_rates.size(); ++i) {
    expect_lr_close(r.learning_rates[i], expected_lr(s, clean * kGbs), "iteration " + std::to_string(i + 1));
    if (!skipped[i]) ++clean;
  }
  EXPECT_EQ(r.learning_rates[0], r.learning_rates[1]);  // iteration 1 was skipped: still the lr of 0 samples

  // The log line of a skipped iteration says so and has no loss or grad norm; the post-update scale.
  const std::string l1 = iteration_line(log, 1);
  EXPECT_NE(l1.find("number of skipped iterations:   1 |"), std::string::npos) << l1;
  EXPECT_EQ(l1.find("lm loss:"), std::string::npos) << l1;
  EXPECT_EQ(l1.find("grad norm:"), std::string::npos) << l1;
  EXPECT_NE(l1.find("loss scale: 4294967296.0 |"), std::string::npos) << l1;
  const std::string l2 = iteration_line(log, 2);
  EXPECT_NE(l2.find("loss scale: 2147483648.0 |"), std::string::npos) << l2;
  const std::string lc = iteration_line(log, int64_t(first_clean) + 1);
  EXPECT_NE(lc.find("number of skipped iterations:   0 |"), std::string::npos) << lc;
  EXPECT_EQ(log_field(lc, "lm loss"), fmt_e6(r.losses[first_clean])) << lc;
}

// --loss-scale: a constant scaler. 1024 never overflows here and never changes; 2^32 overflows every
// iteration, every step is skipped, and still the scale stays (and the lr never advances) — and a run that
// skipped every step ends with an error, not exit 0.
TEST(TrainFp16, StaticLossScaleNeverChanges) {
  const TrainResult r = train(cat(tiny_args(12), {"--fp16", "--loss-scale", "1024"}));
  ASSERT_EQ(r.loss_scales.size(), 12u);
  for (double s : r.loss_scales) EXPECT_EQ(s, 1024.0);
  EXPECT_EQ(r.skipped_iterations, 0);

  std::ostringstream log;
  std::string err;
  try {
    omp_set_num_threads(1);
    run_training(parse_train_args(cat(tiny_args(6), {"--fp16", "--loss-scale", "4294967296"})),
                 log);
  } catch (const UserError& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("every one of the 6 iterations run (1 to 6) was skipped for non-finite gradients"),
            std::string::npos) << err;
  for (int64_t i = 1; i <= 6; ++i) {
    const std::string l = iteration_line(log.str(), i);
    EXPECT_NE(l.find("number of skipped iterations:   1 |"), std::string::npos) << l;
    EXPECT_NE(l.find("loss scale: 4294967296.0 |"), std::string::npos) << l;
    EXPECT_EQ(std::stod(log_field(l, "learning rate")), 0.0) << l;  // still at the start of warmup
  }
}

// ---- recomputation ----------------------------------------------------------------------------------

// With dropout on, every recomputation mode trains bit-identically to none, and the allocator's peak
// falls: none > selective > full. Runs in that order, so a peak carried over from an earlier (bigger)
// run in the same process would show up as a tie.
TEST(TrainRecompute, BitIdenticalLossesAndFallingPeakMemory) {
  const Args base = {"--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                     "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3",
                     "--mock-data", "--vocab-size", "100", "--log-interval", "10", "--eval-iters", "0"};
  const TrainResult none = train(base);
  const TrainResult selective = train(cat(base, {"--recompute-granularity", "selective"}));
  const TrainResult full_uniform = train(
      cat(base, {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"}));
  const TrainResult full_block = train(
      cat(base, {"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"}));
  // Block with 2 of 4 layers: two layers' activations go, one layer's recompute scratch comes.
  const TrainResult full_block2 = train(
      cat(base, {"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"}));
  const TrainResult legacy = train(cat(base, {"--checkpoint-activations"}));
  const TrainResult recompute_act = train(cat(base, {"--recompute-activations"}));
  ASSERT_EQ(none.losses.size(), 3u);
  for (const TrainResult* r : {&selective, &full_uniform, &full_block, &full_block2, &legacy, &recompute_act}) {
    EXPECT_EQ(r->losses, none.losses);
    EXPECT_EQ(r->grad_norms, none.grad_norms);
  }
  EXPECT_GT(none.peak_bytes, selective.peak_bytes);
  EXPECT_GT(selective.peak_bytes, full_uniform.peak_bytes);
  EXPECT_GT(none.peak_bytes, full_block2.peak_bytes);
  EXPECT_GT(full_block2.peak_bytes, full_uniform.peak_bytes);
  EXPECT_EQ(legacy.peak_bytes, full_uniform.peak_bytes);  // --checkpoint-activations = full uniform 1
}

// Dropout is really on in those runs (otherwise the bit-identity above would be weaker): turning it
// off changes the losses.
TEST(TrainRecompute, DefaultDropoutIsOn) {
  const TrainResult a = train(tiny_args(3));
  const TrainResult b = train(cat(tiny_args(3), {"--hidden-dropout", "0", "--attention-dropout", "0"}));
  EXPECT_NE(a.losses[0], b.losses[0]);
}

// ---- learning-rate schedule -------------------------------------------------------------------------

TEST(TrainSchedule, CosineWithWarmupInSamples) {
  const TrainResult r = train(cat(tiny_args(10), {"--lr-warmup-iters", "3", "--lr-warmup-init", "1e-5"}));
  const Schedule s{.init_lr = 1e-5, .warmup = 3 * kGbs, .decay = 10 * kGbs};
  ASSERT_EQ(r.learning_rates.size(), 10u);
  for (int64_t i = 0; i < 10; ++i)
    expect_lr_close(r.learning_rates[size_t(i)], expected_lr(s, i * kGbs), "iteration " + std::to_string(i + 1));
  // Spot values worked out by hand: iteration 2 trains at 4 of 12 warmup samples; iteration 4 at the
  // peak; iteration 9 at 32 samples, 20/28 of the way through the cosine.
  EXPECT_NEAR(r.learning_rates[1], 1e-5 + (1e-3 - 1e-5) / 3.0, 1e-15);
  EXPECT_NEAR(r.learning_rates[3], 1e-3, 1e-15);
  EXPECT_NEAR(r.learning_rates[8], 1e-4 + 9e-4 * 0.5 * (1 + std::cos(M_PI * 20.0 / 28.0)), 1e-15);
}

TEST(TrainSchedule, WSDAnnealsOverTheLastIterations) {
  for (const std::string style : {"exponential", "linear", "cosine", "minus_sqrt"}) {
    const TrainResult r = train(cat(tiny_args(12), {"--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4",
                                                    "--lr-wsd-decay-style", style}));
    const Schedule s{.warmup = 2 * kGbs, .decay = 12 * kGbs, .wsd = 4 * kGbs, .style = "WSD", .wsd_style = style};
    ASSERT_EQ(r.learning_rates.size(), 12u);
    for (int64_t i = 0; i < 12; ++i)
      expect_lr_close(r.learning_rates[size_t(i)], expected_lr(s, i * kGbs), style + " iteration " + std::to_string(i + 1));
    // Stable phase through iteration 9 (32 samples = the start of the anneal), then down.
    EXPECT_EQ(r.learning_rates[8], 1e-3) << style;
    EXPECT_LT(r.learning_rates[9], 1e-3) << style;
  }
  const TrainResult lin = train(cat(tiny_args(12), {"--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4",
                                                    "--lr-wsd-decay-style", "linear"}));
  EXPECT_NEAR(lin.learning_rates[9], 1e-4 + 0.75 * 9e-4, 1e-15);  // a quarter into the anneal
  const TrainResult ex = train(cat(tiny_args(12), {"--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4"}));
  EXPECT_NEAR(ex.learning_rates[9], 1e-4 + (2 * std::pow(0.5, 0.25) - 1) * 9e-4, 1e-15);
}

TEST(TrainSchedule, InverseSquareRoot) {
  const TrainResult r = train(cat(tiny_args(10), {"--lr-decay-style", "inverse-square-root", "--lr-warmup-iters",
                                                  "3", "--min-lr", "0"}));
  const Schedule s{.min_lr = 0, .warmup = 3 * kGbs, .decay = 10 * kGbs, .style = "inverse-square-root"};
  for (int64_t i = 0; i < 10; ++i)
    expect_lr_close(r.learning_rates[size_t(i)], expected_lr(s, i * kGbs), "iteration " + std::to_string(i + 1));
  EXPECT_NEAR(r.learning_rates[6], 1e-3 * std::sqrt(12.0 / 24.0), 1e-15);  // iteration 7: 24 samples
}

// ---- evaluation -------------------------------------------------------------------------------------

namespace {

// The Megatron block: a rule of len(body) + 1 dashes, the body, the same rule. Returns the bodies.
std::vector<std::string> validation_blocks(const std::string& log) {
  const std::vector<std::string> ls = lines_of(log);
  std::vector<std::string> out;
  for (size_t i = 0; i < ls.size(); ++i) {
    if (ls[i].find(" validation loss at ") != 0) continue;
    const std::string rule(ls[i].size() + 1, '-');
    EXPECT_TRUE(i > 0 && ls[i - 1] == rule) << "no dashed rule above: " << ls[i];
    EXPECT_TRUE(i + 1 < ls.size() && ls[i + 1] == rule) << "no dashed rule below: " << ls[i];
    out.push_back(ls[i]);
  }
  return out;
}

std::string block_body(const std::string& prefix, double loss) {
  return " validation loss at " + prefix + " | lm loss value: " + fmt_e6(loss) + " | lm loss PPL: " +
         fmt_e6(std::exp(loss)) + " | ";
}

}  // namespace

TEST(TrainEval, PeriodicAndFinalValidationAndTestBlocks) {
  std::string log;
  const TrainResult r = train(cat(tiny_args(10), {"--eval-interval", "5", "--eval-iters", "2"}), &log);
  ASSERT_EQ(r.valid_losses.size(), 2u);
  EXPECT_EQ(r.valid_losses[0].first, 5);
  EXPECT_EQ(r.valid_losses[1].first, 10);
  ASSERT_TRUE(std::isfinite(r.final_valid_loss));
  ASSERT_TRUE(std::isfinite(r.final_test_loss));
  const std::vector<std::string> blocks = validation_blocks(log);
  const std::vector<std::string> want = {
      block_body("iteration 5", r.valid_losses[0].second), block_body("iteration 10", r.valid_losses[1].second),
      block_body("iteration 10 on validation set", r.final_valid_loss),
      block_body("iteration 10 on test set", r.final_test_loss)};
  EXPECT_EQ(blocks, want) << log;
  // PPL is exp(loss) of the printed value too (not only of the internal double).
  for (const std::string& b : blocks) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(b, m, std::regex(R"(lm loss value: (\S+) \| lm loss PPL: (\S+) \|)"))) << b;
    EXPECT_NEAR(std::stod(m[2]), std::exp(std::stod(m[1])), 2e-5 * std::stod(m[2])) << b;
  }
  // The validation block comes after the iteration-5 log line and before iteration 6's.
  EXPECT_LT(log.find(iteration_line(log, 5)), log.find(blocks[0]));
  EXPECT_LT(log.find(blocks[0]), log.find(iteration_line(log, 6)));
  // Later evaluations continue through the validation set: a different batch, a different loss.
  EXPECT_NE(r.valid_losses[1].second, r.final_valid_loss);

  std::string quiet;
  const TrainResult q = train(cat(tiny_args(10), {"--eval-interval", "5", "--eval-iters", "0"}), &quiet);
  EXPECT_EQ(quiet.find("validation loss"), std::string::npos) << quiet;
  EXPECT_TRUE(q.valid_losses.empty());
  EXPECT_TRUE(std::isnan(q.final_valid_loss));
  EXPECT_TRUE(std::isnan(q.final_test_loss));
}

// --train-data-path / --valid-data-path / --test-data-path: each file is used for its purpose. Swapping
// the validation and test files swaps the final validation and test losses exactly.
TEST(TrainEval, SeparateTrainValidTestDataPaths) {
  TempDir tmp("paths");
  write_dataset(tmp / "train", 100, 0, 12345);
  write_dataset(tmp / "text", 40, 0, 12345);
  write_dataset(tmp / "noise", 0, 40, 12345);
  const Args base = {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                     "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--lr", "3e-3",
                     "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--train-data-path", tmp / "train",
                     "--data-cache-path", tmp / "cache", "--eval-interval", "1000", "--eval-iters", "2",
                     "--log-interval", "10"};
  std::string log;
  const TrainResult a = train(cat(base, {"--valid-data-path", tmp / "text", "--test-data-path", tmp / "noise"}), &log);
  const TrainResult b = train(cat(base, {"--valid-data-path", tmp / "noise", "--test-data-path", tmp / "text"}));
  ASSERT_TRUE(std::isfinite(a.final_valid_loss) && std::isfinite(a.final_test_loss));
  EXPECT_EQ(a.losses, b.losses);  // same training data
  EXPECT_EQ(a.final_valid_loss, b.final_test_loss);
  EXPECT_EQ(a.final_test_loss, b.final_valid_loss);
  EXPECT_NE(a.final_valid_loss, a.final_test_loss);
  const std::vector<std::string> blocks = validation_blocks(log);
  ASSERT_EQ(blocks.size(), 2u) << log;
  EXPECT_EQ(blocks[0], block_body("iteration 6 on validation set", a.final_valid_loss));
  EXPECT_EQ(blocks[1], block_body("iteration 6 on test set", a.final_test_loss));

  // Without --train-data-path, --valid-data-path is a one-line error naming the flags.
  const std::string err = train_error(cat(tiny_args(3), {"--valid-data-path", tmp / "text"}));
  EXPECT_NE(err.find("--valid-data-path"), std::string::npos) << err;
  EXPECT_NE(err.find("--train-data-path"), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), std::string::npos) << err;
}

// Data tokenised with a larger vocabulary than the model's: the run stops before the step that would
// embed it, naming the batch (iteration, micro-batch), the sample, the position and the id, on any device
// (a GPU embedding could only raise a flag afterwards).
TEST(TrainData, TokenIdsOutsideTheVocabularyAreAnErrorNamingTheBatch) {
  TempDir tmp("oob");
  write_dataset(tmp / "text", 60, 0, 12345);  // ASCII ids (32..122) and EOD 256
  const Args base = {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                     "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--lr", "3e-3",
                     "--tokenizer-type", "NullTokenizer", "--train-data-path", tmp / "text", "--data-cache-path",
                     tmp / "cache", "--eval-iters", "0", "--log-interval", "1"};
  const std::string err = train_error(cat(base, {"--vocab-size", "100"}));
  EXPECT_NE(err.find("the training batch of iteration 1 (micro-batch 0"), std::string::npos) << err;
  EXPECT_NE(err.find("is outside the vocabulary [0, 101)"), std::string::npos) << err;
  EXPECT_NE(err.find("--vocab-size"), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  // The data's own vocabulary (ids up to the EOD 256) trains.
  EXPECT_EQ(train(cat(base, {"--vocab-size", "256"})).losses.size(), 4u);
}

// ---- exit conditions ----------------------------------------------------------------------------------

TEST(TrainExit, ExitIntervalStopsAndSaves) {
  TempDir tmp("exit_interval");
  std::string log;
  const TrainResult r = train(cat(tiny_args(10), {"--exit-interval", "3", "--save", tmp / "ckpt"}), &log);
  EXPECT_EQ(r.final_iteration, 3);
  EXPECT_EQ(r.losses.size(), 3u);
  EXPECT_EQ(r.exit_reason, "exit-interval");
  EXPECT_EQ(tracker_of(tmp / "ckpt"), "3");
  const ShardedCheckpoint ck = ShardedCheckpoint::open(tmp / "ckpt/iter_0000003");
  EXPECT_TRUE(ck.contains("embedding.word_embeddings.weight"));
  EXPECT_TRUE(ck.contains("optimizer.exp_avg_sq.embedding.word_embeddings.weight"));
  EXPECT_NE(log.find("exiting program at iteration 3"), std::string::npos) << log;
}

TEST(TrainExit, ExitDurationStopsAfterTheFirstIterationAndSaves) {
  TempDir tmp("exit_duration");
  const TrainResult r = train(cat(tiny_args(10), {"--exit-duration-in-mins", "1e-6", "--save", tmp / "ckpt"}));
  EXPECT_EQ(r.final_iteration, 1);
  EXPECT_EQ(r.exit_reason, "exit-duration");
  EXPECT_EQ(tracker_of(tmp / "ckpt"), "1");
  EXPECT_TRUE(ShardedCheckpoint::open(tmp / "ckpt/iter_0000001").contains("embedding.word_embeddings.weight"));
}

TEST(TrainExit, TrainItersEndsNormallyAndSavesOnce) {
  TempDir tmp("exit_iters");
  std::string log;
  const TrainResult r = train(cat(tiny_args(4), {"--save", tmp / "ckpt", "--save-interval", "2"}), &log);
  EXPECT_EQ(r.exit_reason, "train-iters");
  EXPECT_EQ(r.final_iteration, 4);
  EXPECT_EQ(tracker_of(tmp / "ckpt"), "4");
  EXPECT_EQ(count_of(log, "saving checkpoint at iteration       4"), 1u) << log;
  EXPECT_EQ(count_of(log, "saving checkpoint at iteration       2"), 1u) << log;
}

// ---- TensorBoard ------------------------------------------------------------------------------------

namespace {

// tag -> [(step, value)] from the event file in `dir`, decoded by tests/golden/tb_decode.py.
std::map<std::string, std::vector<std::pair<int64_t, double>>> decode_tensorboard(const std::string& dir,
                                                                                   std::string* file_version) {
  std::string file;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find("tfevents") != std::string::npos) file = e.path().string();
  EXPECT_FALSE(file.empty()) << "no event file in " << dir;
  const std::string cmd =
      "/usr/bin/python3 " LOOM_SOURCE_DIR "/tests/golden/tb_decode.py '" + file + "' 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  LOOM_CHECK(p != nullptr, "popen failed");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  EXPECT_EQ(::pclose(p), 0) << out;
  std::map<std::string, std::vector<std::pair<int64_t, double>>> tags;
  for (const std::string& l : lines_of(out)) {
    const json ev = json::parse(l);
    if (ev.contains("file_version")) *file_version = ev["file_version"].get<std::string>();
    if (!ev.contains("scalars")) continue;
    for (const auto& [tag, v] : ev["scalars"].items())
      tags[tag].emplace_back(ev["step"].get<int64_t>(), v.is_string() ? NAN : v.get<double>());
  }
  return tags;
}

}  // namespace

TEST(TrainTensorBoard, ScalarsMatchTheRun) {
  TempDir tmp("tb");
  const int64_t N = 10;
  const TrainResult r =
      train(cat(tiny_args(N), {"--tensorboard-dir", tmp / "tb", "--eval-interval", "5", "--eval-iters", "1"}));
  std::string version;
  auto tags = decode_tensorboard(tmp / "tb", &version);
  EXPECT_EQ(version, "brain.Event:2");
  for (const char* t : {"lm loss", "lm loss vs samples", "learning-rate", "learning-rate vs samples", "loss-scale",
                        "loss-scale vs samples", "grad-norm", "grad-norm vs samples", "lm loss validation",
                        "lm loss validation vs samples"})
    EXPECT_TRUE(tags.count(t)) << "missing tag " << t;
  // No timers unless asked for.
  for (const auto& [tag, pts] : tags) EXPECT_EQ(tag.find("-time"), std::string::npos) << tag;

  ASSERT_EQ(tags["lm loss"].size(), size_t(N));
  ASSERT_EQ(tags["lm loss vs samples"].size(), size_t(N));
  ASSERT_EQ(tags["grad-norm"].size(), size_t(N));
  ASSERT_EQ(tags["learning-rate"].size(), size_t(N));
  for (int64_t i = 0; i < N; ++i) {
    const size_t k = size_t(i);
    EXPECT_EQ(tags["lm loss"][k], std::make_pair(i + 1, double(float(r.losses[k]))));
    EXPECT_EQ(tags["lm loss vs samples"][k], std::make_pair((i + 1) * kGbs, double(float(r.losses[k]))));
    EXPECT_EQ(tags["grad-norm"][k], std::make_pair(i + 1, double(float(r.grad_norms[k]))));
    EXPECT_EQ(tags["loss-scale"][k], std::make_pair(i + 1, 1.0));
    // As in Megatron's training_log: the learning rate after this iteration's scheduler step, i.e. the one
    // the next iteration trains with.
    if (i + 1 < N) {
      EXPECT_EQ(tags["learning-rate"][k], std::make_pair(i + 1, double(float(r.learning_rates[k + 1]))));
    }
  }
  // Validation points: periodic at 5 and 10, then the final evaluation at 10.
  const std::vector<std::pair<int64_t, double>> want_valid = {{5, double(float(r.valid_losses[0].second))},
                                                               {10, double(float(r.valid_losses[1].second))},
                                                               {10, double(float(r.final_valid_loss))}};
  EXPECT_EQ(tags["lm loss validation"], want_valid);
  ASSERT_EQ(tags["lm loss validation vs samples"].size(), 3u);
  EXPECT_EQ(tags["lm loss validation vs samples"][0].first, 5 * kGbs);
}

// FP16: "loss-scale" is the scale the log line prints for that iteration (Megatron logs
// optimizer.get_loss_scale() after the step, to both), and skipped iterations have no grad norm.
TEST(TrainTensorBoard, LossScaleIsTheLoggedScale) {
  TempDir tmp("tb_fp16");
  std::string log;
  const TrainResult r = train(cat(tiny_args(8), {"--fp16", "--loss-scale-window", "2", "--tensorboard-dir", tmp / "tb"}),
                              &log);
  std::string version;
  auto tags = decode_tensorboard(tmp / "tb", &version);
  ASSERT_EQ(tags["loss-scale"].size(), 8u);
  for (int64_t it = 1; it <= 8; ++it) {
    const std::string printed = log_field(iteration_line(log, it), "loss scale");
    ASSERT_FALSE(printed.empty());
    EXPECT_EQ(tags["loss-scale"][size_t(it - 1)], std::make_pair(it, std::stod(printed))) << "iteration " << it;
  }
  EXPECT_EQ(tags["grad-norm"].size(), size_t(8 - r.skipped_iterations));
}

TEST(TrainTensorBoard, TimersWithLogTimersToTensorboard) {
  TempDir tmp("tb_timers");
  train(cat(tiny_args(4), {"--tensorboard-dir", tmp / "tb", "--log-timers-to-tensorboard", "--timing-log-level", "2",
                           "--log-interval", "2"}));
  std::string version;
  auto tags = decode_tensorboard(tmp / "tb", &version);
  for (const char* t : {"iteration-time", "forward-backward-time", "forward-compute-time", "backward-compute-time",
                        "batch-generator-time", "optimizer-time"}) {
    ASSERT_TRUE(tags.count(t)) << "missing tag " << t;
    ASSERT_EQ(tags[t].size(), 2u) << t;  // one point per log interval
    EXPECT_EQ(tags[t][0].first, 2) << t;
    EXPECT_EQ(tags[t][1].first, 4) << t;
    EXPECT_GE(tags[t][0].second, 0.0) << t;
  }
}

// ---- JSONL metrics ----------------------------------------------------------------------------------

TEST(TrainMetricsJsonl, OneLinePerLogIntervalAndResumeAppends) {
  TempDir tmp("jsonl");
  const Args args = cat(tiny_args(8), {"--log-interval", "2", "--metrics-jsonl", tmp / "m/metrics.jsonl", "--save",
                                       tmp / "ckpt"});
  std::string log1, log2;
  const TrainResult first = train(cat(args, {"--exit-interval", "4"}), &log1);
  const std::vector<std::string> after_first = lines_of(read_file(tmp / "m/metrics.jsonl"));
  ASSERT_EQ(after_first.size(), 2u);
  const TrainResult second = train(cat(args, {"--load", tmp / "ckpt"}), &log2);
  const std::vector<std::string> lines = lines_of(read_file(tmp / "m/metrics.jsonl"));
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], after_first[0]);  // appended, not rewritten
  EXPECT_EQ(lines[1], after_first[1]);
  const std::vector<double> losses = [&] {
    std::vector<double> v = first.losses;
    v.insert(v.end(), second.losses.begin(), second.losses.end());
    return v;
  }();
  ASSERT_EQ(losses.size(), 8u);
  for (size_t j = 0; j < 4; ++j) {
    const json m = json::parse(lines[j]);
    const int64_t it = int64_t(2 * (j + 1));
    EXPECT_EQ(m["iteration"].get<int64_t>(), it);
    EXPECT_EQ(m["consumed samples"].get<int64_t>(), it * kGbs);
    // The interval's mean loss, exactly, and the same number the log line prints.
    const double mean = (losses[size_t(it - 2)] + losses[size_t(it - 1)]) / 2.0;
    EXPECT_EQ(m["lm loss"].get<double>(), mean) << lines[j];
    const std::string& log = it <= 4 ? log1 : log2;
    EXPECT_EQ(log_field(iteration_line(log, it), "lm loss"), fmt_e6(m["lm loss"].get<double>()));
    EXPECT_EQ(m["global batch size"].get<int64_t>(), kGbs);
    EXPECT_TRUE(m.contains("learning rate") && m.contains("grad norm") && m.contains("loss scale"));
  }
}

// ---- checkpoint load errors ---------------------------------------------------------------------------

TEST(TrainCheckpointErrors, ArchitectureMismatchNamesTheFlagAndTouchesNothing) {
  TempDir tmp("ckpt_arch");
  train(cat(tiny_args(6), {"--exit-interval", "3", "--save", tmp / "ckpt"}));
  Args args = cat(tiny_args(6), {"--load", tmp / "ckpt", "--save", tmp / "ckpt"});
  *(std::find(args.begin(), args.end(), "--hidden-size") + 1) = "64";
  expect_load_error_touches_nothing(tmp / "ckpt", args, "--hidden-size");
}

TEST(TrainCheckpointErrors, NoSaveOptimNeedsNoLoadOptim) {
  TempDir tmp("ckpt_optim");
  train(cat(tiny_args(6), {"--exit-interval", "3", "--save", tmp / "ckpt", "--no-save-optim"}));
  {
    const ShardedCheckpoint ck = ShardedCheckpoint::open(tmp / "ckpt/iter_0000003");
    EXPECT_TRUE(ck.contains("embedding.word_embeddings.weight"));
    for (const std::string& name : ck.tensor_names()) EXPECT_NE(name.rfind("optimizer.", 0), 0u) << name;
  }
  const Args args = cat(tiny_args(6), {"--load", tmp / "ckpt", "--save", tmp / "ckpt"});
  expect_load_error_touches_nothing(tmp / "ckpt", args, "--no-load-optim");

  const TrainResult r = train(cat(args, {"--no-load-optim"}));
  EXPECT_EQ(r.start_iteration, 3);
  EXPECT_EQ(r.final_iteration, 6);
  EXPECT_EQ(tracker_of(tmp / "ckpt"), "6");
}

// Megatron's load_checkpoint: a checkpoint without RNG state (--no-save-rng) loaded without --no-load-rng
// stops with "Unable to load rng state ... Specify --no-load-rng or --finetune"; silently restarting the
// dropout stream would break bit-exact resume without a word.
TEST(TrainCheckpointErrors, NoSaveRngNeedsNoLoadRng) {
  TempDir tmp("ckpt_rng");
  train(cat(tiny_args(6), {"--exit-interval", "3", "--save", tmp / "ckpt", "--no-save-rng"}));
  const Args args = cat(tiny_args(6), {"--load", tmp / "ckpt"});
  expect_load_error_touches_nothing(tmp / "ckpt", args, "--no-load-rng");

  const TrainResult r = train(cat(args, {"--no-load-rng"}));
  EXPECT_EQ(r.start_iteration, 3);
  EXPECT_EQ(r.final_iteration, 6);
}

TEST(TrainCheckpointErrors, TruncatedModelFileIsNamed) {
  TempDir tmp("ckpt_trunc");
  train(cat(tiny_args(6), {"--exit-interval", "3", "--save", tmp / "ckpt"}));
  const std::string model = tmp / "ckpt/iter_0000003/shard_00000.safetensors";
  fs::resize_file(model, fs::file_size(model) / 2);
  expect_load_error_touches_nothing(tmp / "ckpt", cat(tiny_args(6), {"--load", tmp / "ckpt", "--save", tmp / "ckpt"}),
                                    "shard_00000.safetensors");
}

namespace {

// Loss of the saved weights on the first global batch of the mock data (2 micro-batches of 2), as the
// trainer's first iteration computes it with dropout off: mean over micro-batches of the token mean.
double first_batch_loss(const std::string& checkpoint_dir, uint64_t seed) {
  GPTConfig m;
  m.num_layers = 2;
  m.hidden_size = 32;
  m.num_attention_heads = 4;
  m.max_position_embeddings = 16;
  m.vocab_size = 100;
  m.padded_vocab_size = 128;
  const std::unique_ptr<DeviceContext> ctx = make_cpu_context();
  GPTModel model(m, *ctx);
  const ShardedCheckpoint ck = ShardedCheckpoint::open(checkpoint_dir);
  for (const Parameter& p : model.params().all()) {
    const Tensor v = ck.read_full(p.name, DType::kF32);
    if (v.shape() != p.shape) {
      ADD_FAILURE() << p.name << " is " << v.shape().str() << " in " << checkpoint_dir;
      return NAN;
    }
    std::memcpy(p.value.raw(), v.raw(), size_t(v.nbytes()));
  }
  model.sync_compute();
  const MockDataset ds(100, 16, seed, 64);
  double sum = 0;
  for (int64_t mb = 0; mb < 2; ++mb) {
    Batch b;
    fill_batch(ds, 2 * mb, 2, BatchOptions{}, b);
    ForwardOptions fo;
    fo.training = false;
    sum += model.forward(GPTBatch{b.tokens, b.labels, {}, {}, {}}, 0.0f, fo);
  }
  return sum / 2.0;
}

}  // namespace

// --finetune: weights only, iteration 0, a fresh schedule; the first loss is the saved model's loss on
// the first batch.
TEST(TrainCheckpointErrors, FinetuneStartsAtZeroWithTheLoadedWeights) {
  TempDir tmp("finetune");
  const Args no_dropout = {"--hidden-dropout", "0", "--attention-dropout", "0"};
  train(cat(cat(tiny_args(5), no_dropout), {"--save", tmp / "ckpt"}));
  const auto before = snapshot(tmp / "ckpt");
  const TrainResult f = train(cat(cat(tiny_args(3), no_dropout), {"--load", tmp / "ckpt", "--finetune"}));
  EXPECT_EQ(f.start_iteration, 0);
  EXPECT_EQ(f.final_iteration, 3);
  ASSERT_EQ(f.losses.size(), 3u);
  EXPECT_EQ(f.learning_rates[0], 0.0);  // warmup starts over
  const double want = first_batch_loss(tmp / "ckpt/iter_0000005", 5);
  EXPECT_EQ(f.losses[0], want);
  const TrainResult fresh = train(cat(tiny_args(3), no_dropout));
  EXPECT_NE(fresh.losses[0], f.losses[0]);  // the weights were really loaded
  expect_unchanged(before, snapshot(tmp / "ckpt"));  // no --save: the loaded checkpoint is left alone
}

// ---- timers and memory lines --------------------------------------------------------------------------

TEST(TrainLogLines, TimersByLevelAndOneMemoryLine) {
  std::string log2, log1, log0;
  train(cat(tiny_args(4), {"--timing-log-level", "2", "--log-interval", "2"}), &log2);
  EXPECT_EQ(count_of(log2, "(min, max) time across ranks (ms):"), 2u) << log2;
  for (const char* t : {"forward-backward", "forward-compute", "backward-compute", "batch-generator", "optimizer"})
    EXPECT_TRUE(std::regex_search(log2, std::regex(std::string("\n    ") + t + R"( \.+: \([0-9.]+, [0-9.]+\))")))
        << t << "\n" << log2;
  EXPECT_EQ(count_of(log2, "[Rank 0] (after 2 iterations) memory (MB) | allocated: "), 1u) << log2;
  EXPECT_EQ(count_of(log2, "[Rank 0] (after"), 1u);

  train(cat(tiny_args(4), {"--timing-log-level", "1", "--log-interval", "2"}), &log1);
  EXPECT_NE(log1.find("\n    forward-backward ."), std::string::npos) << log1;
  EXPECT_EQ(log1.find("forward-compute"), std::string::npos) << log1;  // a level-2 timer

  train(cat(tiny_args(4), {"--log-interval", "2"}), &log0);
  EXPECT_EQ(log0.find("time across ranks"), std::string::npos) << log0;
  EXPECT_EQ(count_of(log0, "[Rank 0] (after 2 iterations) memory (MB)"), 1u) << log0;
}

// --data-path with --split: Megatron's contiguous document ranges, train [0, 80%), validation [80%, 90%),
// test [90%, 100%). Training sees only the text documents; validation and test are the noise documents,
// so their losses stay near log(256) while the training loss falls far below it. An empty validation
// split (--split 100,0,0) means no validation blocks. Dataset sizes follow Megatron's sample counts.
TEST(TrainEval, SplitMakesValidationAndTestSets) {
  TempDir tmp("split");
  write_dataset(tmp / "mixed", 80, 20, 777);
  const Args base = {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                     "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "40", "--lr", "1e-2",
                     "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer",
                     "--vocab-size", "256", "--data-path", tmp / "mixed", "--data-cache-path", tmp / "cache",
                     "--eval-interval", "20", "--eval-iters", "2", "--log-interval", "40"};
  std::string log;
  const TrainResult r = train(cat(base, {"--split", "80,10,10"}), &log);
  // Megatron: validation (40 / 20 + 1) * 2 * 4 = 24 samples, test 2 * 4 = 8.
  EXPECT_NE(log.find("    validation: 24\n"), std::string::npos) << log;
  EXPECT_NE(log.find("    test:       8\n"), std::string::npos) << log;
  ASSERT_EQ(r.valid_losses.size(), 2u);
  ASSERT_TRUE(std::isfinite(r.final_valid_loss) && std::isfinite(r.final_test_loss));
  const double trained = r.losses.back(), chance = std::log(256.0);
  EXPECT_LT(trained, chance - 2.0) << "the model did not learn the text documents";
  EXPECT_GT(r.final_valid_loss, chance - 1.0) << "validation must be the held-out noise documents";
  EXPECT_GT(r.final_test_loss, chance - 1.0) << "test must be the held-out noise documents";

  std::string no_valid_log;
  const TrainResult n = train(cat(base, {"--split", "100,0,0"}), &no_valid_log);
  EXPECT_TRUE(n.valid_losses.empty());
  EXPECT_EQ(no_valid_log.find("validation loss"), std::string::npos) << no_valid_log;
  EXPECT_NE(n.losses, r.losses);  // the training split now holds all 100 documents, noise included
}

namespace {

// A Megatron launch script's extra flags (dataset reader, backend, launcher rank, kernel choices, legacy
// scheduler spelling) change no loss bit; the log says once that the kernel choices do not matter.
TEST(TrainMegatronScripts, KernelChoiceAndLauncherFlagsChangeNoResult) {
  const TrainResult plain = train(tiny_args(4));
  std::string log;
  const TrainResult script =
      train(cat(tiny_args(4), {"--data-impl", "mmap", "--distributed-backend", "nccl", "--local-rank", "0",
                               "--use-flash-attn", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                               "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
                               "--no-persist-layer-norm", "--use-mcore-models", "--transformer-impl", "local",
                               "--override-lr-scheduler"}),
            &log);
  EXPECT_EQ(script.losses, plain.losses);
  EXPECT_EQ(count_of(log, "Megatron kernel choices; Loom always runs its own fused kernels"), 1u) << log;
  EXPECT_NE(log.find(" > --use-flash-attn --no-masked-softmax-fusion"), std::string::npos) << log;
}

}  // namespace

namespace {

// --local-rank from a Python launcher is checked against the launcher's environment, before any work.
TEST(TrainMegatronScripts, LocalRankMustAgreeWithTheLauncher) {
  if (std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) GTEST_SKIP() << "runs outside mpirun";
  ::setenv("SLURM_LOCALID", "1", 1);
  const std::string what = train_error(cat(tiny_args(4), {"--local-rank", "0"}));
  const TrainResult agreed = train(cat(tiny_args(4), {"--local_rank", "1"}));
  ::unsetenv("SLURM_LOCALID");
  EXPECT_NE(what.find("--local-rank 0 disagrees with the launcher's local rank 1 (SLURM_LOCALID)"), std::string::npos)
      << what;
  EXPECT_EQ(agreed.final_iteration, 4);
}

}  // namespace
