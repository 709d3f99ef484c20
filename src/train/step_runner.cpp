// One training iteration (see step_runner.h).
#include "train/step_runner.h"

#include "train/moe_metrics.h"

#include <algorithm>
#include <cmath>

#include "loom/core/check.h"
#include "loom/pipeline/schedule.h"

namespace loom {

StepRunner::StepRunner(TrainingRun& run, Timers& timers) : run_(run), timers_(timers) {}

float StepRunner::micro_batch_dloss(const Batch& b, double loss_scale) const {
  // Megatron's per-micro-batch loss is the mean over its unmasked tokens, averaged over micro-batches;
  // the FP16 loss scale multiplies the gradient seed.
  double mask_sum = double(run_.B * run_.T);
  if (run_.batch_opts.eod_mask_loss || run_.batch_opts.dataset_extras) {
    mask_sum = 0;
    const float* mp = b.loss_mask.data<float>();
    for (int64_t i = 0; i < run_.B * run_.T; ++i) mask_sum += mp[i];
  }
  return mask_sum > 0 ? float(loss_scale / (mask_sum * double(run_.nmb))) : 0.0f;
}

namespace {
const char* non_finite_str(double v) { return std::isnan(v) ? "NaN" : v > 0 ? "inf" : "-inf"; }
}  // namespace

void StepRunner::check_finite(double loss, double grad_norm) {
  const int64_t iteration = run_.progress.iteration + 1;
  const char* hint = " (Megatron's --check-for-nan-in-loss-and-grad, on by default; --no-check-for-nan-in-loss-and-"
                     "grad skips such steps instead). Resume from an earlier checkpoint, e.g. with a lower --lr or "
                     "a smaller --clip-grad";
  if (run_.cfg.exit.check_for_nan_in_loss_and_grad) {
    if (!std::isfinite(loss))
      user_error("iteration ", iteration, ": the training loss is ", non_finite_str(loss), "; stopped before the update",
                 hint);
    // A loss scale (FP16's dynamic one, or --loss-scale) expects overflows: the step is skipped, as
    // Megatron's MixedPrecisionOptimizer does.
    if (!run_.scaler && !std::isfinite(grad_norm))
      user_error("iteration ", iteration, ": the gradient norm is ", non_finite_str(grad_norm), " (loss ", loss,
                 "); stopped before the update", hint);
  }
  if (!run_.scaler || !run_.scaler->is_dynamic()) return;
  // An overflow with the scale already at its floor cannot be fixed by backing off: once that happens as
  // many times in a row as --hysteresis tolerates, every later step would be skipped too.
  const bool floor_overflow = !std::isfinite(grad_norm) && run_.scaler->at_floor();
  overflows_at_floor_ = floor_overflow ? overflows_at_floor_ + 1 : 0;
  if (overflows_at_floor_ >= std::max<int64_t>(1, run_.cfg.precision.hysteresis))
    user_error("iteration ", iteration, ": the FP16 gradients overflow with the loss scale at its minimum (",
               run_.scaler->scale(), ", --min-loss-scale) for ", overflows_at_floor_,
               " steps in a row: every later step would be skipped. Lower --min-loss-scale, use --bf16, or resume "
               "from an earlier checkpoint with a lower --lr");
}

StepOutcome StepRunner::step(Loader& loader) {
  const TrainConfig& cfg = run_.cfg;
  StepOutcome out;
  out.loss_scale = run_.loss_scale();
  out.lr = run_.sched->lr();

  timers_.start("forward-backward", 1);
  // Every stage reads the step's micro-batches (the first stage needs tokens, the last targets and the
  // mask, all of them positions and segments); the loader is cheap next to the model.
  std::vector<Batch> batches;
  timers_.start("batch-generator", 2);
  for (int64_t mb = 0; mb < run_.nmb; ++mb) {
    std::optional<Batch> b = loader.next();
    LOOM_CHECK(b.has_value(), "[trainer] the training data ran out at iteration ", run_.progress.iteration + 1);
    batches.push_back(std::move(*b));
  }
  timers_.stop("batch-generator");
  run_.dopt->start_step();
  const std::vector<GPTModel*> chunks = run_.models();
  for (GPTModel* m : chunks) m->fp8_begin_step();
  PipelineStepConfig pc;
  pc.num_microbatches = run_.nmb;
  pc.dropout_seed = run_.progress.dropout_seed;
  pc.first_microbatch_index = run_.progress.micro_batches_done;
  const double loss_scale = out.loss_scale;
  pc.dloss_scale = [&](int64_t m) { return micro_batch_dloss(batches[size_t(m)], loss_scale); };
  pc.moe_aux_loss_scale = float(loss_scale / double(run_.nmb));  // Megatron's MoEAuxLossAutoScaler scale
  PipelineCallbacks cb;
  cb.batch = [&](int64_t m) { return run_.model_batch(batches[size_t(m)]); };
  cb.before_backward = [&](int chunk, int64_t, bool last) { run_.dopt->set_last_microbatch(chunk, last); };
  cb.timer = [&](const char* phase, bool start) {
    if (start)
      timers_.start(phase, 2);
    else
      timers_.stop(phase);
  };
  const PipelineStepResult r = run_pipeline_step(chunks, run_.ps->pp(), pc, cb);
  run_.progress.micro_batches_done += uint64_t(run_.nmb);
  timers_.start("grads-all-reduce", 1);
  run_.dopt->finish_grad_sync();
  timers_.stop("grads-all-reduce");
  // FP8: tensor-parallel ranks hold shards of one tensor, DP x CP ranks replicas of it (or of its
  // tokens): one scale for all of them, from the max of their amaxes.
  for (GPTModel* m : chunks) m->fp8_update_scaling({&run_.ps->tp(), &run_.ps->dp_cp()});
  timers_.stop("forward-backward");
  // The last stage's mean over micro-batches, averaged over data-parallel replicas, known on every rank.
  const bool last = run_.ps->is_pipeline_last_stage();
  double loss = last ? r.loss_sum / double(run_.nmb) : 0.0;
  loss = run_.ps->dp().all_reduce_scalar(loss) / double(run_.ps->dp_size());
  out.loss = run_.ps->pp().all_reduce_scalar(last ? loss : 0.0);
  out.moe = collect_moe_figures(run_);

  timers_.start("optimizer", 1);
  timers_.start("optimizer-clip-main-grad", 1);
  // Unscaled norm: the FP16 loss scale divides out (the norm of scaled gradients / scale). Loss scales are
  // powers of two, so this and the AdamW grad_scale below give Megatron's unscale-first numbers exactly.
  const double inv = run_.scaler ? double(run_.scaler->inv_scale()) : 1.0;
  const double norm = run_.dopt->grad_norm() * inv;
  timers_.stop("optimizer-clip-main-grad");
  const bool found_inf = !std::isfinite(norm);
  check_finite(out.loss, norm);
  if (run_.scaler) run_.scaler->update(found_inf);
  if (found_inf) {
    out.skipped = true;
    out.grad_norm = NAN;
    run_.dopt->start_step();  // drops the gradients
  } else {
    // Megatron counts after the clip-norm pass and before the update (the count ignores the scale).
    if (cfg.logging.log_num_zeros_in_grad) out.num_zeros = double(run_.dopt->num_zeros_in_grad());
    timers_.start("optimizer-inner-step", 1);
    const float scale = float(inv) * clip_coefficient(norm, float(cfg.optim.clip_grad));
    run_.dopt->step(float(run_.sched->lr()), float(run_.sched->wd()), scale);
    timers_.stop("optimizer-inner-step");
    run_.sched->step(run_.gbs);
    update_expert_biases(run_);  // aux-loss-free balancing moves with the weights
    out.grad_norm = norm;
  }
  timers_.stop("optimizer");
  return out;
}

}  // namespace loom
