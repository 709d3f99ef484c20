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

void Trainer::build_model_distributed() {
  const int PP = ps_->pp_size(), TP = ps_->tp_size(), CP = ps_->cp_size();
  const int64_t L = cfg_.model.num_layers;
  const int V = cfg_.dist.virtual_stage_layers > 0 ? int(L / (int64_t(PP) * cfg_.dist.virtual_stage_layers)) : 1;
  const std::vector<std::vector<StageLayers>> split =
      pipeline_layer_split(L, PP, V, cfg_.dist.first_stage_layers, cfg_.dist.last_stage_layers);
  const ShardingStrategy sharding = sharding_strategy();
  if (cfg_.precision.fp16 && cfg_.precision.grad_dtype() != DType::kF32)
    log_ << " > note: with more than one rank Loom accumulates and reduces FP32 main gradients (as "
            "--accumulate-allreduce-grads-in-fp32)\n";
  std::vector<ParameterSet*> sets;
  std::vector<std::vector<ParamUnit>> units;
  for (int v = 0; v < V; ++v) {
    ModelOptions mo = model_options();
    mo.grad_dtype = DType::kF32;
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
         << " compute, fp32 master weights, optimizer state and main grads\n";
}

Trainer::StepOutcome Trainer::train_step_distributed() {
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

double Trainer::evaluate_distributed(const std::shared_ptr<const SampleDataset>& ds, int64_t& consumed_samples) {
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

// ---- sharded checkpoints ------------------------------------------------------------------------------

namespace {

std::string fmt_ms(double ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", ms);
  return b;
}

// The box of a parameter this rank holds: the whole tensor, or its TP ranges along partition_dim.
TensorPiece param_box(const Parameter& p, const std::string& name) {
  TensorPiece t;
  t.name = name;
  t.global_shape = p.global_shape;
  if (!p.shard.empty()) {
    t.partition_dim = p.partition_dim;
    for (const ShardRange& r : p.shard) t.ranges.push_back({r.start, r.size});
  }
  return t;
}

// Who saves a replicated piece: one rank per distinct box. Model parameters are replicated over DP and CP
// (unless ZeRO-3 shards them: then the optimizer's flat ranges are the pieces), over TP for unsharded
// ones; the last stage's copy of the tied embedding is never saved.
bool saves_model_piece(const ParallelState& ps, const Parameter& p) {
  if (p.tied_embedding_copy) return false;
  if (p.shard.empty() && ps.tp_rank() != 0) return false;
  return ps.dp_rank() == 0 && ps.cp_rank() == 0;
}

}  // namespace

void Trainer::save_checkpoint_sharded() {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string& root = cfg_.checkpoint.save;
  log_ << "saving checkpoint at iteration " << iteration_ << " to " << root << " (sharded, " << ps_->world_size()
       << " ranks)\n" << std::flush;
  // With any ZeRO strategy the weights are saved from the masters each rank owns (flat ranges): a 16-bit
  // run's full f32 values exist nowhere else. Without sharding, from the model's full values.
  const bool from_masters = sharding_strategy() != ShardingStrategy::kNone;
  std::vector<TensorPiece> pieces;
  std::vector<StateShard> shards = dopt_->state_shards();
  // Optimizer state is saved by whoever owns it; without sharding every data-parallel replica owns all
  // of it, so only the first one saves.
  const bool owner_saves = sharding_strategy() != ShardingStrategy::kNone || (ps_->dp_rank() == 0 && ps_->cp_rank() == 0);
  for (const StateShard& s : shards) {
    const Parameter& p = *s.param;
    if (p.tied_embedding_copy || (p.shard.empty() && ps_->tp_rank() != 0) || !owner_saves) continue;
    auto add = [&](const std::string& name, TensorView v) {
      TensorPiece t = param_box(p, name);
      t.flat_begin = s.begin;
      t.flat_end = s.end;
      t.data = v;
      pieces.push_back(std::move(t));
    };
    if (from_masters) add(p.name, s.master);
    if (!cfg_.checkpoint.no_save_optim) {
      add("optimizer.exp_avg." + p.name, s.exp_avg);
      add("optimizer.exp_avg_sq." + p.name, s.exp_avg_sq);
    }
  }
  if (!from_masters)
    for (const auto& m : chunks_)
      for (const Parameter& p : m->params().all()) {
        if (!saves_model_piece(*ps_, p)) continue;
        TensorPiece t = param_box(p, p.name);
        t.data = p.value;
        pieces.push_back(std::move(t));
      }
  // FP8 scaling state: identical on the TP and DP x CP replicas after the amax reduction; one rank of
  // them saves it, under per-layer names (any layout reads it back).
  std::vector<Tensor> fp8_holder;
  if (ps_->tp_rank() == 0 && ps_->dp_rank() == 0 && ps_->cp_rank() == 0)
    for (const auto& [name, view] : fp8_state_tensors(fp8_holder)) {
      TensorPiece t;
      t.name = name;
      t.global_shape = view.shape();
      t.data = view;
      pieces.push_back(std::move(t));
    }
  const std::string layout = "{\"tp\":" + std::to_string(ps_->tp_size()) + ",\"pp\":" + std::to_string(ps_->pp_size()) +
                             ",\"cp\":" + std::to_string(ps_->cp_size()) + ",\"dp\":" + std::to_string(ps_->dp_size()) +
                             ",\"sharding\":\"" + sharding_strategy_name(sharding_strategy()) + "\"}";
  save_sharded_checkpoint(root, iteration_, pieces, layout, metadata_json(), ps_->world());
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  log_ << "  successfully saved checkpoint from iteration " << iteration_ << " to " << root << " [ t "
       << fmt_ms(ms) << " ms ]\n" << std::flush;
}

void Trainer::load_fp8_state(const ShardedCheckpoint& ck) {
  for (GPTModel* m : models())
    for (int s = 0; s < m->fp8_num_sites(); ++s)
      if (ck.contains(m->fp8_state_name(s))) m->fp8_set_state(s, ck.read_full(m->fp8_state_name(s), DType::kF32));
}

void Trainer::load_checkpoint_sharded(const std::string& dir) {
  const ShardedCheckpoint ck = ShardedCheckpoint::open(dir);
  const bool load_optim = !cfg_.checkpoint.finetune && !cfg_.checkpoint.no_load_optim;
  std::vector<TensorPiece> targets;
  if (!distributed_) {
    // One process: every tensor whole.
    for (const Parameter& p : model_->params().all()) {
      TensorPiece t = param_box(p, p.name);
      t.data = p.value;
      targets.push_back(t);
      if (load_optim) {
        t.name = "optimizer.exp_avg." + p.name;
        t.data = adamw_->exp_avg_mut().slice_flat(p.offset, p.shape);
        targets.push_back(t);
        t.name = "optimizer.exp_avg_sq." + p.name;
        t.data = adamw_->exp_avg_sq_mut().slice_flat(p.offset, p.shape);
        targets.push_back(t);
      }
    }
    ck.read(targets);
    model_->sync_compute();
    load_fp8_state(ck);
    return;
  }
  // Weights: every parameter value this rank has (ZeRO-3: none), and the master shards.
  for (const auto& m : chunks_)
    for (const Parameter& p : m->params().all()) {
      if (!p.value.defined()) continue;
      TensorPiece t = param_box(p, p.name);
      t.data = p.value;
      targets.push_back(std::move(t));
    }
  for (const StateShard& s : dopt_->state_shards()) {
    const Parameter& p = *s.param;
    auto add = [&](const std::string& name, TensorView v) {
      TensorPiece t = param_box(p, name);
      t.flat_begin = s.begin;
      t.flat_end = s.end;
      t.data = v;
      targets.push_back(std::move(t));
    };
    // The masters (views of the weights or a shard of their own): filled from the same saved tensor.
    if (s.master.defined())
      add(p.name, s.master);
    if (load_optim) {
      add("optimizer.exp_avg." + p.name, s.exp_avg);
      add("optimizer.exp_avg_sq." + p.name, s.exp_avg_sq);
    }
  }
  ck.read(targets);
  load_fp8_state(ck);
  dopt_->sync_params_from_masters();
  for (const auto& m : chunks_)
    if (m->params().storage() == ParamStorage::kFull) m->sync_compute();
}

}  // namespace loom
