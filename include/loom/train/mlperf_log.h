// MLPerf Training's log (the format of MLCommons' mllog, read by its compliance checker): one event a line,
//   :::MLLOG {"namespace": "", "time_ms": 1718000000123, "event_type": "POINT", "key": "seed", "value": 1234,
//             "metadata": {"file": "trainer.cpp", "lineno": 210}}
// event_type is POINT for single events and INTERVAL_START / INTERVAL_END for the *_start / *_stop keys;
// time_ms is the wall clock in milliseconds since the Unix epoch; metadata names the source file and line
// that logged the event, then the event's own fields (samples_count, epoch_num, status, ...).
//
// MlperfRunLog writes the events of one llama2_70b_lora run in the order the training 5.0.0 rules check
// (docs/training.md lists them):
//   cache_clear, init_start, submission_*                      at construction (before data and model)
//   hyperparameters, init_stop, run_start, block_start         init_done (training is about to start)
//   train_loss                                                 every --log-interval
//   block_stop, eval_start | eval_accuracy, eval_stop [, block_start]   around each periodic evaluation
//   [block_stop,] run_stop (status success | aborted)          run_stop, or the destructor: aborted
// samples_count is the number of training samples consumed so far, epoch_num the same in epochs of the
// training set. Every line is flushed as written, so a killed run keeps all complete lines.
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "loom/nn/lora.h"
#include "loom/train/config.h"

namespace loom {

// A JSON scalar of a log line (a value or a metadata field). Non-finite doubles are written as null.
using MllogValue = std::variant<std::nullptr_t, bool, int64_t, double, std::string>;
using MllogFields = std::vector<std::pair<std::string, MllogValue>>;

enum class MllogEvent { kPoint, kIntervalStart, kIntervalEnd };

// One line without the newline: ":::MLLOG " and the JSON object above (keys in that order; metadata: file
// (the base name of where.file_name()), lineno, then `metadata` in the order given).
std::string mllog_line(int64_t time_ms, MllogEvent event, std::string_view key, const MllogValue& value,
                       const MllogFields& metadata, const std::source_location& where);

// Milliseconds since the Unix epoch (the system clock).
int64_t mllog_now_ms();

class MllogWriter {
 public:
  // Creates or truncates `path` (and its parent directories). `clock` gives time_ms (default mllog_now_ms;
  // tests pass a fake). UserError naming --mlperf-log and the path when it cannot be opened.
  explicit MllogWriter(const std::string& path, std::function<int64_t()> clock = {});
  ~MllogWriter();
  MllogWriter(const MllogWriter&) = delete;
  MllogWriter& operator=(const MllogWriter&) = delete;

  // Writes and flushes one line. UserError naming the path on a write failure.
  void event(MllogEvent event, std::string_view key, const MllogValue& value = nullptr, const MllogFields& metadata = {},
             const std::source_location& where = std::source_location::current());
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  std::function<int64_t()> clock_;
};

// What the llama2_70b_lora rules ask the log to state about the run, as the run resolved it.
struct MlperfRunInfo {
  int64_t global_batch_size = 0;            // global_batch_size (sequences per optimizer step)
  int64_t gradient_accumulation_steps = 1;  // micro-batches per data-parallel rank per step
  int64_t max_sequence_length = 0;          // --seq-length
  int64_t train_samples = 0;  // distinct training samples (the records of the training set); epoch_num's unit
  int64_t eval_samples = 0;   // samples scored per evaluation (--eval-iters x global batch)
  int64_t seed = 0;
  bool adamw = true;                   // AdamW: the opt_adamw_* keys are logged
  double base_learning_rate = 0;       // opt_base_learning_rate (--lr)
  double adamw_beta_1 = 0, adamw_beta_2 = 0, adamw_epsilon = 0;
  double weight_decay = 0;             // opt_adamw_weight_decay (--weight-decay)
  double gradient_clip_norm = 0;       // opt_gradient_clip_norm (--clip-grad; 0 = none)
  int64_t warmup_steps = 0;            // opt_learning_rate_warmup_steps (optimizer steps)
  double warmup_factor = 0;            // opt_learning_rate_warmup_factor: warmup steps / training steps
  int64_t training_steps = 0;          // opt_learning_rate_training_steps (--train-iters)
  std::string decay_schedule;          // opt_learning_rate_decay_schedule (--lr-decay-style)
  // lora_rank / lora_alpha, logged when the run trains LoRA adapters (the closed rules need rank 16).
  std::optional<LoraConfig> lora;
};

class MlperfRunLog {
 public:
  // Opens `cfg.log` and writes cache_clear, init_start and the submission keys (benchmark llama2_70b_lora;
  // `platform` is used when cfg.platform is empty).
  MlperfRunLog(const MlperfConfig& cfg, const std::string& platform, std::function<int64_t()> clock = {},
               const std::source_location& where = std::source_location::current());
  // Writes run_stop with status aborted when the run started and did not stop (an error ended it); never
  // throws.
  ~MlperfRunLog();
  MlperfRunLog(const MlperfRunLog&) = delete;
  MlperfRunLog& operator=(const MlperfRunLog&) = delete;

  // The hyperparameters, init_stop, run_start and the first block_start at `samples` consumed (0, or a
  // resumed checkpoint's count).
  void init_done(const MlperfRunInfo& info, int64_t samples,
                 const std::source_location& where = std::source_location::current());
  void train_loss(int64_t samples, double loss, double lr,
                  const std::source_location& where = std::source_location::current());
  // block_stop and eval_start, before an evaluation.
  void eval_start(int64_t samples, const std::source_location& where = std::source_location::current());
  // eval_accuracy (the MLPerf metric) and eval_stop; then block_start when training goes on.
  void eval_result(int64_t samples, double metric, bool training_goes_on,
                   const std::source_location& where = std::source_location::current());
  // block_stop (if a block is open) and run_stop with status success (the target was reached) or aborted.
  void run_stop(int64_t samples, bool success, const std::source_location& where = std::source_location::current());
  bool stopped() const { return stopped_; }

 private:
  MllogFields samples_metadata(int64_t samples) const;

  MllogWriter w_;
  int64_t train_samples_ = 0;
  int64_t last_samples_ = 0;
  bool started_ = false, stopped_ = false, in_block_ = false;
};

}  // namespace loom
