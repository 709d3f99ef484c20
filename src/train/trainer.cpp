// The trainer loop and its Megatron-format logging.
// Log line (one per --log-interval, averages over the interval as Megatron does):
//  [date] iteration  i/ N | consumed samples: S | elapsed time per iteration (ms): t | tokens per second: r |
//  learning rate: lr | global batch size: G | lm loss: L | loss scale: 1.0 | grad norm: g |
//  number of skipped iterations: k | number of nan iterations: n |
// As in Megatron, the learning rate printed is the scheduler's value after this iteration's step.
#include "loom/train/trainer.h"

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <memory>
#include <optional>
#include <ostream>

#include "loom/data/loader.h"
#include "loom/data/mock_dataset.h"
#include "loom/model/gpt.h"

namespace loom {

namespace {

std::string fmt(const char* f, auto... args) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

std::string now_string() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

// Coalesces consecutive parameters with the same weight-decay flag into ranges of the flat buffer.
std::vector<ParamRange> param_ranges(const ParameterSet& ps) {
  std::vector<ParamRange> out;
  for (const Parameter& p : ps.all()) {
    const bool wd = !p.no_weight_decay;
    if (!out.empty() && out.back().weight_decay == wd && out.back().offset + out.back().numel == p.offset)
      out.back().numel += p.shape.numel();
    else
      out.push_back({p.offset, p.shape.numel(), wd});
  }
  return out;
}

int64_t max_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return int64_t(ru.ru_maxrss) * 1024;
}

}  // namespace

TrainResult run_training(const TrainConfig& cfg_in, std::ostream& log) {
  TrainConfig cfg = cfg_in;
  const int world_size = 1;
  cfg.validate(world_size);
  auto ps = ParallelState::create(cfg.parallel, world_size, 0);
  const int dp = ps->dp_size();
  const int64_t gbs = cfg.global_batch_size(dp);
  const int64_t nmb = cfg.num_micro_batches(dp);
  const int64_t B = cfg.batch.micro_batch_size, T = cfg.batch.seq_length;

  // Data: mock samples, or Megatron indexed datasets split by --split (only the training split is
  // built: evaluation, which needs the validation and test splits, is not in this build).
  const int64_t train_samples = cfg.batch.train_iters * gbs;
  std::shared_ptr<const SampleDataset> train_data;
  BatchOptions batch_opts;
  if (cfg.data.mock_data) {
    train_data = std::make_shared<MockDataset>(*cfg.data.vocab_size, T, cfg.seed, train_samples);
    cfg.model.vocab_size = *cfg.data.vocab_size;
  } else {
    const std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(cfg.data.tokenizer);
    cfg.model.vocab_size = tokenizer->vocab_size();
    GPTDatasetConfig dcfg;
    dcfg.seq_length = T;
    dcfg.seed = cfg.seed;
    dcfg.split = cfg.data.train_data_path.empty() ? cfg.data.split : "1,0,0";
    dcfg.data_cache_path = cfg.data.data_cache_path;
    const auto& paths = cfg.data.train_data_path.empty() ? cfg.data.data_path : cfg.data.train_data_path;
    train_data = build_gpt_datasets(paths, {train_samples, 0, 0}, dcfg)[0];
    if (!train_data) user_error("--split '", cfg.data.split, "' gives the training split no documents");
    batch_opts.reset_position_ids = cfg.data.reset_position_ids;
    batch_opts.reset_attention_mask = cfg.data.reset_attention_mask;
    batch_opts.eod_mask_loss = cfg.data.eod_mask_loss;
    batch_opts.eod = tokenizer->eod();
    // Logged only now: a bad --data-path or tokenizer file fails before anything is printed.
    log << "> built " << tokenizer->name() << " tokenizer (vocabulary " << tokenizer->vocab_size() << ")\n";
  }
  log << "data: " << train_data->description() << "\n";
  cfg.model.padded_vocab_size =
      padded_vocab_size(cfg.model.vocab_size, cfg.data.make_vocab_size_divisible_by, ps->tp_size());
  log << " > padded vocab (size: " << cfg.model.vocab_size << ") with "
      << cfg.model.padded_vocab_size - cfg.model.vocab_size << " dummy tokens (new size: "
      << cfg.model.padded_vocab_size << ")\n";
  log << "using world size: " << ps->world_size() << ", data-parallel size: " << dp
      << ", context-parallel size: " << ps->cp_size() << ", tensor-model-parallel size: " << ps->tp_size()
      << ", pipeline-model-parallel size: " << ps->pp_size() << "\n";
  log << "setting number of micro-batches to constant " << nmb << "\n";

  auto ctx = make_cpu_context();
  log << "device: " << ctx->description() << "\n";
  GPTModel model(cfg.model, *ctx);
  model.initialize(cfg.seed);
  ParameterSet& params = model.params();
  log << " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): " << params.numel() << "\n";
  AdamW adamw(*ctx, params.numel(), param_ranges(params), cfg.optim.adam);

  LRSchedule sched;
  sched.max_lr = cfg.optim.lr;
  sched.min_lr = cfg.optim.min_lr;
  sched.warmup_steps = cfg.optim.lr_warmup_iters * gbs;
  sched.decay_steps = cfg.optim.lr_decay_iters.value_or(cfg.batch.train_iters) * gbs;
  sched.style = cfg.optim.lr_decay_style;

  LoaderConfig lcfg;
  lcfg.global_batch_size = gbs;
  lcfg.micro_batch_size = B;
  lcfg.dp_rank = ps->dp_rank();
  lcfg.dp_size = dp;
  lcfg.batch = batch_opts;
  Loader loader(train_data, lcfg);
  TrainResult result;
  int64_t consumed = 0;
  double interval_loss = 0, interval_ms = 0;
  int64_t interval_iters = 0, interval_skipped = 0, interval_nan = 0, interval_loss_count = 0;
  log << "training ...\n" << std::flush;

  for (int64_t it = 1; it <= cfg.batch.train_iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    for (int64_t mb = 0; mb < nmb; ++mb) {
      std::optional<Batch> batch = loader.next();
      LOOM_CHECK(batch.has_value(), "[trainer] the training data ran out at iteration ", it);
      GPTBatch gb{batch->tokens, batch->labels, {}, {}, {}};
      // Megatron's per-micro-batch loss is the mean over its unmasked tokens, averaged over micro-batches.
      double mask_sum = double(B * T);
      if (batch_opts.eod_mask_loss) {
        gb.loss_mask = batch->loss_mask;
        mask_sum = 0;
        for (int64_t i = 0; i < B * T; ++i) mask_sum += batch->loss_mask.data<float>()[i];
      }
      if (batch_opts.reset_position_ids) gb.position_ids = batch->position_ids;
      if (batch_opts.reset_attention_mask) gb.segment_ids = batch->segment_ids;
      const float dloss_scale = mask_sum > 0 ? float(1.0 / (mask_sum * double(nmb))) : 0.0f;
      loss_sum += model.forward(gb, dloss_scale);
      if (dloss_scale != 0.0f) model.backward(gb);
    }
    const double loss = loss_sum / double(nmb);
    const double norm = global_grad_norm(*ctx, params.grads(), ps->model_and_dp());
    const double lr = sched.lr_at((it - 1) * gbs);
    const bool finite = std::isfinite(norm);
    if (finite) {
      adamw.step(params.values(), params.grads(), float(lr), float(cfg.optim.weight_decay),
                 clip_coefficient(norm, float(cfg.optim.clip_grad)), /*zero_grads=*/true);
    } else {
      params.zero_grads(*ctx);  // skip the update, as Megatron does for a non-finite gradient
      ++result.skipped_iterations;
      ++interval_skipped;
    }
    consumed += gbs;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    result.losses.push_back(loss);
    result.grad_norms.push_back(norm);
    if (std::isnan(loss)) {
      ++result.nan_iterations;
      ++interval_nan;
    } else {
      interval_loss += loss;
      ++interval_loss_count;
    }
    interval_ms += ms;
    ++interval_iters;

    if (it % cfg.logging.log_interval == 0 || it == cfg.batch.train_iters) {
      const double avg_ms = interval_ms / double(interval_iters);
      const double avg_loss = interval_loss_count ? interval_loss / double(interval_loss_count) : NAN;
      std::string line = " [" + now_string() + "]";
      line += fmt(" iteration %8lld/%8lld |", (long long)it, (long long)cfg.batch.train_iters);
      line += fmt(" consumed samples: %12lld |", (long long)consumed);
      line += fmt(" elapsed time per iteration (ms): %.1f |", avg_ms);
      line += fmt(" tokens per second: %.1f |", double(gbs * T) / (avg_ms / 1000.0));
      line += fmt(" learning rate: %.6E |", sched.lr_at(it * gbs));
      line += fmt(" global batch size: %5lld |", (long long)gbs);
      line += fmt(" lm loss: %.6E |", avg_loss);
      line += " loss scale: 1.0 |";
      line += fmt(" grad norm: %.3f |", norm);
      line += fmt(" number of skipped iterations: %3lld |", (long long)interval_skipped);
      line += fmt(" number of nan iterations: %3lld |", (long long)interval_nan);
      log << line << "\n" << std::flush;
      interval_loss = interval_ms = 0;
      interval_iters = interval_skipped = interval_nan = interval_loss_count = 0;
    }
  }
  const AllocStats mem = ctx->memory_stats();
  result.peak_bytes = mem.peak_bytes;
  log << fmt("[after training is done] memory (MB) | allocated: %.1f | max allocated: %.1f | max resident: %.1f\n",
             double(mem.current_bytes) / 1048576.0, double(mem.peak_bytes) / 1048576.0,
             double(max_rss_bytes()) / 1048576.0);
  return result;
}

}  // namespace loom
