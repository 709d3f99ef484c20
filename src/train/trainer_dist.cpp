// The trainer's distributed path (world size > 1): this rank's model chunks (its pipeline stage, or its
// virtual stages with interleaving) built from the rank grid, the distributed optimizer (DDP buckets,
// ZeRO-1/2/3), one pipeline schedule call per step, and logging values reduced over the right groups.
//
// Loss bookkeeping (equal to the single-process run with the same global batch): every data-parallel
// rank trains its own nmb micro-batches; each micro-batch's forward prepares d(mean loss) / nmb (times
// the FP16 loss scale), the model makes the per-rank gradient of a context-parallel split add up over its
// CP group, and the optimizer averages over the dp_cp group (DP · CP ranks) — so the averaged gradient is
// the gradient of the mean loss over the global batch. The logged loss is the mean over micro-batches
// of the last pipeline stage, averaged over the data-parallel group.
#include <cmath>

#include "loom/ckpt/sharded.h"
#include "loom/pipeline/schedule.h"
#include "train/trainer_impl.h"

namespace loom {

ShardingStrategy Trainer::sharding_strategy() const {
  return resolve_sharding(cfg_.dist.use_distributed_optimizer, cfg_.dist.sharding_strategy);
}

void Trainer::build_model_chunks(const ModelOptions& base) {
  const int PP = ps_->pp_size(), TP = ps_->tp_size(), CP = ps_->cp_size();
  const int64_t L = cfg_.model.num_layers;
  const int V = cfg_.dist.virtual_stage_layers > 0 ? int(L / (int64_t(PP) * cfg_.dist.virtual_stage_layers)) : 1;
  const std::vector<std::vector<StageLayers>> split =
      pipeline_layer_split(L, PP, V, cfg_.dist.first_stage_layers, cfg_.dist.last_stage_layers);
  const ShardingStrategy sharding = sharding_strategy();
  // A single process keeps --fp16's FP16 gradients (copied to FP32 main grads by the optimizer); with
  // more ranks they are accumulated and reduced in FP32.
  const DType grad_dtype = distributed_ ? DType::kF32 : base.grad_dtype;
  if (grad_dtype != base.grad_dtype)
    log_ << " > note: with more than one rank Loom accumulates and reduces FP32 main gradients (as "
            "--accumulate-allreduce-grads-in-fp32)\n";
  std::vector<ParameterSet*> sets;
  std::vector<std::vector<ParamUnit>> units;
  for (int v = 0; v < V; ++v) {
    ModelOptions mo = base;
    mo.grad_dtype = grad_dtype;
    const StageLayers& sl = split[size_t(ps_->pp_rank())][size_t(v)];
    mo.parallel.tp = TP > 1 ? &ps_->tp() : nullptr;
    mo.parallel.sequence_parallel = cfg_.dist.sequence_parallel;
    mo.parallel.cp = CP > 1 ? &ps_->cp() : nullptr;
    mo.parallel.first_layer = sl.first_layer;
    mo.parallel.num_layers = sl.num_layers;
    mo.parallel.pre_process = ps_->is_pipeline_first_stage() && v == 0;
    mo.parallel.post_process = ps_->is_pipeline_last_stage() && v == V - 1;
    mo.activation_slots = pipeline_activation_slots(PP, V, nmb_);
    mo.param_storage = param_storage_for(sharding);
    chunks_.push_back(std::make_unique<GPTModel>(cfg_.model, *ctx_, mo));
    sets.push_back(&chunks_.back()->params());
    units.push_back(chunks_.back()->units());
  }
  DDPConfig ddp;
  ddp.sharding = sharding;
  ddp.bucket_size = cfg_.dist.ddp_bucket_size;
  ddp.overlap_grad_reduce = cfg_.dist.overlap_grad_reduce;
  ddp.overlap_param_gather = cfg_.dist.overlap_param_gather;
  dopt_ = std::make_unique<DistributedOptimizer>(*ctx_, sets, units, *ps_, ddp, cfg_.optim.adam);
  dopt_->initialize(cfg_.seed);
  for (size_t c = 0; c < chunks_.size(); ++c) chunks_[c]->set_hooks(dopt_->hooks(int(c)));

  int64_t local = 0;
  for (const auto& m : chunks_) local += m->params().numel();
  // Megatron's line, one per (tensor, pipeline) rank: printed here for this (the last) rank, and the
  // total over the model-parallel group.
  log_ << " > number of parameters on (tensor, pipeline) model parallel rank (" << ps_->tp_rank() << ", "
       << ps_->pp_rank() << "): " << local << "\n";
  const DistributedOptimizer::Memory mem = dopt_->memory();
  log_ << " > data-parallel sharding: " << sharding_strategy_name(sharding) << " over " << ps_->dp_cp().size()
       << " ranks; memory per rank (MB): parameters " << double(mem.params) / 1048576.0 << ", gradients "
       << double(mem.grads) / 1048576.0 << ", optimizer state " << double(mem.optimizer) / 1048576.0
       << " (model states " << mem.states() << " bytes; `loom calc` prints the same figures)\n";
  if (cfg_.precision.bf16 || cfg_.precision.fp16)
    log_ << " > mixed precision: " << (cfg_.precision.bf16 ? "bf16" : "fp16")
         << " compute, fp32 master weights and optimizer state, " << dtype_name(grad_dtype) << " main grads\n";
  if (!cfg_.recompute.granularity.empty())
    log_ << " > activation recomputation: " << cfg_.recompute.granularity
         << (cfg_.recompute.granularity == "full"
                 ? " (" + cfg_.recompute.method + ", " + std::to_string(*cfg_.recompute.num_layers) + " layers)"
                 : std::string())
         << "\n";
}

Trainer::StepOutcome Trainer::train_step() {
  StepOutcome out;
  out.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  out.lr = sched_->lr();

  timers_.start("forward-backward", 1);
  // Every stage reads the step's micro-batches (the first stage needs tokens, the last targets and the
  // mask, all of them positions and segments); the loader is cheap next to the model.
  std::vector<Batch> batches;
  timers_.start("batch-generator", 2);
  for (int64_t mb = 0; mb < nmb_; ++mb) {
    std::optional<Batch> b = train_loader_->next();
    LOOM_CHECK(b.has_value(), "[trainer] the training data ran out at iteration ", iteration_ + 1);
    batches.push_back(std::move(*b));
  }
  timers_.stop("batch-generator");
  dopt_->start_step();
  for (auto& m : chunks_) m->fp8_begin_step();
  PipelineStepConfig pc;
  pc.num_microbatches = nmb_;
  pc.dropout_seed = dropout_seed_;
  pc.first_microbatch_index = micro_batches_done_;
  const double loss_scale = out.loss_scale;
  pc.dloss_scale = [&](int64_t m) { return micro_batch_dloss(batches[size_t(m)], loss_scale); };
  PipelineCallbacks cb;
  cb.batch = [&](int64_t m) { return to_model_batch(batches[size_t(m)]); };
  cb.before_backward = [&](int chunk, int64_t, bool last) { dopt_->set_last_microbatch(chunk, last); };
  cb.timer = [&](const char* phase, bool start) {
    if (start)
      timers_.start(phase, 2);
    else
      timers_.stop(phase);
  };
  std::vector<GPTModel*> chunks;
  for (auto& m : chunks_) chunks.push_back(m.get());
  const PipelineStepResult r = run_pipeline_step(chunks, ps_->pp(), pc, cb);
  micro_batches_done_ += uint64_t(nmb_);
  timers_.start("grads-all-reduce", 1);
  dopt_->finish_grad_sync();
  timers_.stop("grads-all-reduce");
  fp8_after_backward();
  timers_.stop("forward-backward");
  // The last stage's mean over micro-batches, averaged over data-parallel replicas, known on every rank.
  const bool last = ps_->is_pipeline_last_stage();
  double loss = last ? r.loss_sum / double(nmb_) : 0.0;
  loss = ps_->dp().all_reduce_scalar(loss) / double(ps_->dp_size());
  out.loss = ps_->pp().all_reduce_scalar(last ? loss : 0.0);

  timers_.start("optimizer", 1);
  timers_.start("optimizer-clip-main-grad", 1);
  // Unscaled norm: the FP16 loss scale divides out (the norm of scaled gradients / scale).
  const double inv = scaler_ ? double(scaler_->inv_scale()) : 1.0;
  const double norm = dopt_->grad_norm() * inv;
  timers_.stop("optimizer-clip-main-grad");
  const bool found_inf = !std::isfinite(norm);
  if (scaler_) scaler_->update(found_inf);
  if (found_inf) {
    out.skipped = true;
    out.grad_norm = NAN;
    dopt_->start_step();  // drops the gradients
  } else {
    timers_.start("optimizer-inner-step", 1);
    const float scale = float(inv) * clip_coefficient(norm, float(cfg_.optim.clip_grad));
    dopt_->step(float(sched_->lr()), float(sched_->wd()), scale);
    timers_.stop("optimizer-inner-step");
    sched_->step(gbs_);
    out.grad_norm = norm;
  }
  timers_.stop("optimizer");
  return out;
}

double Trainer::evaluate_pipeline(const std::shared_ptr<const SampleDataset>& ds, int64_t& consumed_samples) {
  LoaderConfig lc = loader_config(consumed_samples);
  lc.prefetch_depth = 0;
  lc.role = ds == test_ds_ ? "test" : "validation";
  Loader loader(ds, lc);
  std::vector<GPTModel*> chunks;
  for (auto& m : chunks_) chunks.push_back(m.get());
  double total = 0;
  for (int64_t it = 0; it < cfg_.eval.eval_iters; ++it) {
    std::vector<Batch> batches;
    for (int64_t mb = 0; mb < nmb_; ++mb) {
      std::optional<Batch> b = loader.next();
      if (!b) user_error("the evaluation data (", ds->description(), ") ran out; it was sized for --eval-iters ",
                         cfg_.eval.eval_iters);
      batches.push_back(std::move(*b));
    }
    PipelineStepConfig pc;
    pc.num_microbatches = nmb_;
    pc.forward_only = true;
    PipelineCallbacks cb;
    cb.batch = [&](int64_t m) { return to_model_batch(batches[size_t(m)]); };
    const PipelineStepResult r = run_pipeline_step(chunks, ps_->pp(), pc, cb);
    total += r.loss_sum;
    consumed_samples += gbs_;
  }
  const bool last = ps_->is_pipeline_last_stage();
  double loss = last ? total / double(cfg_.eval.eval_iters * nmb_) : 0.0;
  loss = ps_->dp().all_reduce_scalar(loss) / double(ps_->dp_size());
  return ps_->pp().all_reduce_scalar(last ? loss : 0.0);
}

}  // namespace loom
