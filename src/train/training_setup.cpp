// The set-up of a training run (training_run.h): rank grid, device, data, model chunks and optimizer,
// scheduler and loss scaler — Megatron's initialize_megatron / build_train_valid_test_datasets /
// setup_model_and_optimizer — and the TrainingRun helpers the parts share.
#include <algorithm>
#include <cstdlib>

#include "loom/data/mock_dataset.h"
#include "loom/data/npy_packed_dataset.h"
#include "loom/data/sft_dataset.h"
#include "loom/pipeline/schedule.h"
#include "train/deepspeed_config.h"
#include "train/training_run.h"

namespace loom {

namespace {

// The node-local rank from the launcher (OpenMPI, SLURM, torchrun-style), else the global rank.
int local_rank(int global_rank) {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "LOCAL_RANK"})
    if (const char* v = std::getenv(var); v && *v) return std::atoi(v);
  return global_rank;
}

// The run's device (--device; the CUDA device of this rank's local rank), validated.
std::unique_ptr<DeviceContext> make_device_context(const TrainingRun& run) {
  const TrainConfig& cfg = run.cfg;

  const std::string& dev = cfg.device;
  // auto: distributed runs stay on the CPU until the trainer builds NCCL groups (build_model says so).
  const bool want_cuda = dev == "cuda" || (dev == "auto" && cuda_available() && !run.distributed);
  if (!want_cuda) return make_cpu_context();
  if (run.distributed)
    user_error("--device ", dev, ": distributed training on GPUs (NCCL process groups for every parallel group) is "
               "not wired into the trainer yet; run distributed jobs with --device cpu, or a single GPU process");
  const int count = cuda_device_count();
  if (count == 0)
    user_error("--device cuda: no CUDA GPU is visible (no driver, or CUDA_VISIBLE_DEVICES hides them all)");
  return make_cuda_context(local_rank(run.ps->rank()) % count);
}

ModelOptions model_options(const TrainConfig& cfg) {

  ModelOptions o;
  o.compute_dtype = cfg.precision.compute_dtype();
  o.grad_dtype = cfg.precision.grad_dtype();
  if (!cfg.recompute.granularity.empty()) o.recompute_granularity = parse_recompute_granularity(cfg.recompute.granularity);
  if (!cfg.recompute.method.empty()) o.recompute_method = parse_recompute_method(cfg.recompute.method);
  o.recompute_num_layers = cfg.recompute.num_layers.value_or(0);
  o.fp8 = cfg.precision.fp8_recipe();
  if (cfg.lora.enabled())
    o.lora = LoraOptions{{cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout},
                         parse_lora_targets(cfg.lora.targets_or_default(), cfg.model)};
  return o;
}

// This rank's model chunks (its pipeline stage, or its virtual stages with interleaving) and the
// distributed optimizer over them.
void build_model_chunks(TrainingRun& run, const ModelOptions& base, std::ostream& log) {
  const TrainConfig& cfg = run.cfg;

  const int PP = run.ps->pp_size(), TP = run.ps->tp_size(), CP = run.ps->cp_size();
  const int64_t L = cfg.model.num_layers;
  const int V = cfg.dist.virtual_stage_layers > 0 ? int(L / (int64_t(PP) * cfg.dist.virtual_stage_layers)) : 1;
  const std::vector<std::vector<StageLayers>> split =
      pipeline_layer_split(L, PP, V, cfg.dist.first_stage_layers, cfg.dist.last_stage_layers);
  const ShardingStrategy sharding = run.sharding();
  // A single process keeps --fp16's FP16 gradients (copied to FP32 main grads by the optimizer); with
  // more ranks they are accumulated and reduced in FP32.
  const DType grad_dtype = run.distributed ? DType::kF32 : base.grad_dtype;
  if (grad_dtype != base.grad_dtype)
    log << " > note: with more than one rank Loom accumulates and reduces FP32 main gradients (as "
            "--accumulate-allreduce-grads-in-fp32)\n";
  std::vector<ParameterSet*> sets;
  std::vector<std::vector<ParamUnit>> units;
  for (int v = 0; v < V; ++v) {
    ModelOptions mo = base;
    mo.grad_dtype = grad_dtype;
    const StageLayers& sl = split[size_t(run.ps->pp_rank())][size_t(v)];
    mo.parallel.tp = TP > 1 ? &run.ps->tp() : nullptr;
    mo.parallel.sequence_parallel = cfg.dist.sequence_parallel;
    mo.parallel.cp = CP > 1 ? &run.ps->cp() : nullptr;
    if (cfg.model.is_moe()) {
      mo.parallel.tp_cp = &run.ps->tp_cp();
      ExpertParallel& ep = mo.parallel.expert;
      ep.kind = cfg.moe.dispatcher;
      ep.ep = &run.ps->ep();
      ep.etp = &run.ps->etp();
      ep.etp_ep = &run.ps->etp_ep();
      // Tokens replicated over the expert-tensor-parallel ranks: ETP = TP (the same ranks) without SP. Any
      // other ETP group holds different tokens on each rank (SP shards, or other data-parallel batches).
      ep.etp_replicated = run.ps->etp().size() > 1 && run.ps->etp().size() == TP && !cfg.dist.sequence_parallel;
      mo.parallel.moe_shared_expert_overlap = cfg.moe.shared_expert_overlap;
    }
    mo.parallel.first_layer = sl.first_layer;
    mo.parallel.num_layers = sl.num_layers;
    mo.parallel.pre_process = run.ps->is_pipeline_first_stage() && v == 0;
    mo.parallel.post_process = run.ps->is_pipeline_last_stage() && v == V - 1;
    mo.activation_slots = pipeline_activation_slots(PP, V, run.nmb);
    mo.param_storage = param_storage_for(sharding);
    run.chunks.push_back(std::make_unique<GPTModel>(cfg.model, *run.ctx, mo));
    sets.push_back(&run.chunks.back()->trainable());
    units.push_back(run.chunks.back()->units());
  }
  DDPConfig ddp;
  ddp.sharding = sharding;
  ddp.bucket_size = cfg.dist.ddp_bucket_size;
  ddp.overlap_grad_reduce = cfg.dist.overlap_grad_reduce;
  ddp.overlap_param_gather = cfg.dist.overlap_param_gather;
  run.dopt = std::make_unique<DistributedOptimizer>(*run.ctx, sets, units, *run.ps, ddp, cfg.optim.optimizer_config());
  run.dopt->initialize(cfg.seed);
  // The frozen base of a LoRA run is the model's own (the optimizer holds the adapters only): the checkpoint
  // manager loads it, or initialises it when the run names no model.
  for (size_t c = 0; c < run.chunks.size(); ++c) run.chunks[c]->set_hooks(run.dopt->hooks(int(c)));

  int64_t local = 0;
  for (const auto& m : run.chunks) local += m->params().numel();
  // Megatron's line, one per (tensor, pipeline) rank: printed here for this (the last) rank, and the
  // total over the model-parallel group.
  log << " > number of parameters on (tensor, pipeline) model parallel rank (" << run.ps->tp_rank() << ", "
       << run.ps->pp_rank() << "): " << local << "\n";
  if (const std::optional<LoraOptions>& lo = run.chunks.front()->options().lora) {
    int64_t trained = 0;
    for (const auto& m : run.chunks) trained += m->trainable().numel();
    std::string targets;
    for (LoraTarget t : lo->targets) targets += std::string(targets.empty() ? "" : " ") + lora_target_name(t);
    log << " > LoRA: rank " << lo->config.rank << ", alpha " << lo->config.alpha << " (scale "
        << lo->config.scale() << "), dropout " << lo->config.dropout << " on " << targets << ": " << trained
        << " trainable adapter parameters on this rank (" << 100.0 * double(trained) / double(std::max<int64_t>(local, 1))
        << "% of the frozen base's " << local << ")\n";
  }
  // The optimizer's figures cover what it trains (with LoRA: the adapters); a LoRA base is the model's own,
  // frozen: its compute copy (the f32 values in FP32 runs), whole on every rank.
  const DistributedOptimizer::Memory mem = run.dopt->memory();
  int64_t frozen = 0;
  for (const auto& m : run.chunks) {
    if (!m->lora()) continue;
    const ParameterSet& base = m->params();
    if (base.values().defined()) frozen += base.values().nbytes();
    if (base.compute_values().defined() && base.compute_values().raw() != base.values().raw())
      frozen += base.compute_values().nbytes();
  }
  log << " > data-parallel sharding: " << sharding_strategy_name(sharding) << " over " << run.ps->dp_cp().size()
       << " ranks";
  if (&run.ps->expert_dp() != &run.ps->dp_cp())  // expert parallelism: experts are replicated over expert_dp only
    log << " (expert parameters over " << run.ps->expert_dp().size() << ")";
  log << "; memory per rank (MB): ";
  if (run.chunks.front()->lora()) log << "frozen base weights " << double(frozen) / 1048576.0 << ", LoRA adapter ";
  log << "parameters " << double(mem.params) / 1048576.0 << ", gradients " << double(mem.grads) / 1048576.0
       << ", optimizer state " << double(mem.optimizer) / 1048576.0 << " (model states " << frozen + mem.states()
       << " bytes; `loom calc` prints the same figures)\n";
  if (cfg.precision.bf16 || cfg.precision.fp16)
    log << " > mixed precision: " << (cfg.precision.bf16 ? "bf16" : "fp16")
         << " compute, fp32 master weights and optimizer state, " << dtype_name(grad_dtype) << " main grads\n";
  if (!cfg.recompute.granularity.empty())
    log << " > activation recomputation: " << cfg.recompute.granularity
         << (cfg.recompute.granularity == "full"
                 ? " (" + cfg.recompute.method + ", " + std::to_string(*cfg.recompute.num_layers) + " layers)"
                 : std::string())
         << "\n";
}

}  // namespace

std::vector<GPTModel*> TrainingRun::models() const {
  std::vector<GPTModel*> out;
  for (const auto& m : chunks) out.push_back(m.get());
  return out;
}

ShardingStrategy TrainingRun::sharding() const {
  return resolve_sharding(cfg.dist.use_distributed_optimizer, cfg.dist.sharding_strategy);
}

LoaderConfig TrainingRun::loader_config(int64_t consumed_samples) const {
  LoaderConfig lc;
  lc.global_batch_size = gbs;
  lc.micro_batch_size = B;
  lc.dp_rank = ps->dp_rank();
  lc.dp_size = dp;
  lc.consumed_samples = consumed_samples;
  lc.batch = batch_opts;
  return lc;
}

GPTBatch TrainingRun::model_batch(const Batch& b) const {

  GPTBatch gb{b.tokens, b.labels, {}, {}, {}};
  if (batch_opts.eod_mask_loss || batch_opts.dataset_extras) gb.loss_mask = b.loss_mask;
  if (batch_opts.reset_position_ids || batch_opts.dataset_extras) gb.position_ids = b.position_ids;
  if (batch_opts.reset_attention_mask || batch_opts.dataset_extras) gb.segment_ids = b.segment_ids;
  if (ctx->device().is_cpu()) return gb;
  // One micro-batch in flight at a time on the device (one pipeline stage: forward then backward of each
  // micro-batch, GPU runs being single-process for now): reuse the staging tensors.
  TensorView* fields[5] = {&gb.tokens, &gb.targets, &gb.loss_mask, &gb.position_ids, &gb.segment_ids};
  for (int i = 0; i < 5; ++i) {
    const TensorView src = *fields[i];
    if (!src.defined()) continue;
    Tensor& dst = dev_batch_[i];
    if (!dst.defined() || dst.shape() != src.shape() || dst.dtype() != src.dtype())
      dst = ctx->empty(src.shape(), src.dtype());
    ctx->copy(dst, src);
    *fields[i] = dst;
  }
  return gb;
}

void TrainingRun::check_device_inputs() {

  const std::string err = ctx->take_input_errors();
  if (!err.empty())
    user_error("the training batches of iteration", progress.iteration > progress.inputs_checked_through + 1 ? "s " : " ",
               progress.inputs_checked_through + 1,
               progress.iteration > progress.inputs_checked_through + 1 ? ".." + std::to_string(progress.iteration) : std::string(),
               ": ", err,
               ". The data holds ids the model cannot embed: check --vocab-size / the tokenizer against the "
               "data, and --max-position-embeddings against --seq-length");
  progress.inputs_checked_through = progress.iteration;
}

void setup_parallel_and_device(TrainingRun& run, const TrainConfig& config, std::unique_ptr<Communicator> world,
                               std::ostream& log) {
  run.cfg = config;
  TrainConfig& cfg = run.cfg;
  const int world_size = world->size();
  // ds_config.json's batch keys need the data-parallel size (DeepSpeed's rules); a layout that does not
  // divide the world is left to validate()'s message.
  const int64_t mp = int64_t(cfg.parallel.tensor_model_parallel_size) * cfg.parallel.pipeline_model_parallel_size *
                   cfg.parallel.context_parallel_size;
  if (mp > 0 && world_size % mp == 0) {
    const int dp = int(world_size / mp);
    resolve_deepspeed_batch(cfg, dp);
    // Sample-based training (Megatron's update_train_iters without batch ramp-up).
    if (cfg.batch.train_samples && cfg.batch.micro_batch_size > 0) {
      const int64_t gbs = cfg.global_batch_size(dp);
      cfg.batch.train_iters = *cfg.batch.train_samples / gbs;
      if (cfg.batch.train_iters < 1)
        user_error("--train-samples (", *cfg.batch.train_samples, ") is less than one global batch (", gbs, ")");
    }
  }
  cfg.validate(world_size);
  run.distributed = world_size > 1;
  run.ps = run.distributed ? ParallelState::create(cfg.parallel, std::move(world))
                           : ParallelState::create(cfg.parallel, world_size, 0);
  run.dp = run.ps->dp_size();
  run.gbs = cfg.global_batch_size(run.dp);
  run.nmb = cfg.num_micro_batches(run.dp);
  run.B = cfg.batch.micro_batch_size;
  run.T = cfg.batch.seq_length;
  run.progress.dropout_seed = cfg.seed;
  // --train-tokens (Megatron-DeepSpeed): training stops at the first iteration that reaches the tokens.
  run.last_iteration = cfg.batch.train_iters;
  if (cfg.batch.train_tokens)
    run.last_iteration = std::min(run.last_iteration, (*cfg.batch.train_tokens + run.gbs * run.T - 1) / (run.gbs * run.T));
  // --local-rank from a Python launcher must name the rank mpirun/srun gave this process.
  if (cfg.dist.local_rank)
    for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"})
      if (const char* v = std::getenv(var); v && *v) {
        if (std::atoi(v) != *cfg.dist.local_rank)
          user_error("--local-rank ", *cfg.dist.local_rank, " disagrees with the launcher's local rank ", v, " (", var,
                     "); Loom takes its rank from mpirun/srun: drop --local-rank");
        break;
      }
  // The device before any data or model work, so a wrong --device / --profile fails fast.
  run.ctx = make_device_context(run);
  if (cfg.logging.profile && run.ctx->device().is_cpu())
    user_error("--profile records NVTX ranges and CUDA profiler captures for Nsight Systems; this run computes on "
               "the CPU: drop --profile, or run on a GPU (--device cuda)");
  if (cfg.dist.backend == "nccl" && run.distributed && run.ctx->device().is_cpu())
    log << " > --distributed-backend nccl: the ranks compute on the CPU, so their collectives use MPI\n";
  for (const std::string& n : cfg.deepspeed.notes) log << n << "\n";
  if (!cfg.logging.wandb_project.empty() || !cfg.logging.wandb_exp_name.empty())
    log << " > WARNING: --wandb-project / --wandb-exp-name: Loom has no Weights & Biases client; the metrics go to "
           "--tensorboard-dir and --metrics-jsonl\n";
  if (cfg.num_workers)
    log << " > --num-workers " << *cfg.num_workers << ": Loom's loader reads the memory-mapped data in the training "
           "process (no worker processes); the batches are the same\n";
  if (cfg.batch.train_tokens && run.last_iteration < cfg.batch.train_iters)
    log << " > --train-tokens " << *cfg.batch.train_tokens << ": training stops after iteration " << run.last_iteration
        << " (" << run.gbs * run.T << " tokens per iteration)\n";
  if (!cfg.kernel_choice_flags.empty()) {
    log << " >";
    for (const std::string& f : cfg.kernel_choice_flags) log << " " << f;
    log << ": Megatron kernel choices; Loom always runs its own fused kernels (softmax in FP32), so the results "
           "do not depend on them\n";
  }
}

void setup_data(TrainingRun& run, std::ostream& log) {
  TrainConfig& cfg = run.cfg;

  // Megatron's train_valid_test_num_samples.
  const int64_t train_samples = cfg.batch.train_samples.value_or(cfg.batch.train_iters * run.gbs);
  const int64_t eval_iters = cfg.eval.eval_iters;
  const int64_t valid_samples = (cfg.batch.train_iters / cfg.eval.eval_interval + 1) * eval_iters * run.gbs;
  const int64_t test_samples = eval_iters * run.gbs;
  if (cfg.data.mock_data) {
    const int64_t V = *cfg.data.vocab_size;
    run.train_ds = std::make_shared<MockDataset>(V, run.T, cfg.seed, train_samples);
    // Distinct seeds: the validation and test tokens are not the training tokens.
    if (valid_samples > 0) run.valid_ds = std::make_shared<MockDataset>(V, run.T, cfg.seed + 1, valid_samples);
    if (test_samples > 0) run.test_ds = std::make_shared<MockDataset>(V, run.T, cfg.seed + 2, test_samples);
    cfg.model.vocab_size = V;
    run.batch_opts.vocab_size = V;
    run.batch_opts.vocab_source = "--mock-data (--vocab-size)";
  } else {
    const std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(cfg.data.tokenizer);
    cfg.model.vocab_size = tokenizer->vocab_size();
    GPTDatasetConfig dcfg;
    dcfg.seq_length = run.T;
    dcfg.seed = cfg.seed;
    dcfg.data_cache_path = cfg.data.data_cache_path;
    if (cfg.data.sft) {
      SftConfig scfg;
      scfg.seq_length = run.T;
      scfg.packing = cfg.data.sft_packing;
      scfg.overlong = parse_sft_overlong(cfg.data.sft_overlong);
      scfg.seed = uint32_t(cfg.seed);
      scfg.pad_id = std::max(tokenizer->eod(), 0);
      scfg.data_cache_path = cfg.data.data_cache_path;
      auto ds = build_sft_datasets(cfg.data.data_path, {train_samples, valid_samples, test_samples}, cfg.data.split, scfg);
      run.train_ds = ds[0];
      run.valid_ds = ds[1];
      run.test_ds = ds[2];
      if (!run.train_ds) user_error("--split '", cfg.data.split, "' gives the training split no SFT samples");
      run.batch_opts.dataset_extras = true;
    } else if (cfg.data.train_data_path.empty()) {
      dcfg.split = cfg.data.split;
      auto ds = build_gpt_datasets(cfg.data.data_path, {train_samples, valid_samples, test_samples}, dcfg);
      run.train_ds = ds[0];
      run.valid_ds = ds[1];
      run.test_ds = ds[2];
      if (!run.train_ds) user_error("--split '", cfg.data.split, "' gives the training split no documents");
    } else if (cfg.data.npy_records()) {
      // NeMo's packed SFT records (.npy), e.g. the MLPerf Llama-2 70B LoRA data: each path used whole.
      const int32_t pad = std::max(tokenizer->eod(), 0);
      auto npy = [&](const std::vector<std::string>& p, int64_t n, const char* flag) -> std::shared_ptr<const SampleDataset> {
        if (p.empty() || n <= 0) return nullptr;
        if (p.size() != 1 || !p[0].ends_with(".npy")) user_error(flag, ": with a .npy --train-data-path, give one .npy file here too");
        return std::make_shared<NpyPackedDataset>(p[0], run.T, n, uint32_t(cfg.seed), pad);
      };
      run.train_ds = npy(cfg.data.train_data_path, train_samples, "--train-data-path");
      run.valid_ds = npy(cfg.eval.valid_data_path, valid_samples, "--valid-data-path");
      run.test_ds = npy(cfg.eval.test_data_path, test_samples, "--test-data-path");
      run.batch_opts.dataset_extras = true;
    } else {
      // --train-data-path / --valid-data-path / --test-data-path: each used whole for its purpose.
      dcfg.split = "1,0,0";
      run.train_ds = build_gpt_datasets(cfg.data.train_data_path, {train_samples, 0, 0}, dcfg)[0];
      if (!cfg.eval.valid_data_path.empty() && valid_samples > 0)
        run.valid_ds = build_gpt_datasets(cfg.eval.valid_data_path, {valid_samples, 0, 0}, dcfg)[0];
      if (!cfg.eval.test_data_path.empty() && test_samples > 0)
        run.test_ds = build_gpt_datasets(cfg.eval.test_data_path, {test_samples, 0, 0}, dcfg)[0];
    }
    run.batch_opts.reset_position_ids = cfg.data.reset_position_ids;
    run.batch_opts.reset_attention_mask = cfg.data.reset_attention_mask;
    run.batch_opts.eod_mask_loss = cfg.data.eod_mask_loss;
    run.batch_opts.eod = tokenizer->eod();
    // The tokenizer's own vocabulary, not the padded one: ids in the padding rows are as wrong as ids past it.
    run.batch_opts.vocab_size = tokenizer->vocab_size();
    run.batch_opts.vocab_source = tokenizer->name() == "NullTokenizer"
                                      ? "NullTokenizer (--vocab-size " + std::to_string(tokenizer->vocab_size() - 1) +
                                            " and its end-of-document id " + std::to_string(tokenizer->eod()) + ")"
                                      : tokenizer->name();
    log << "> built " << tokenizer->name() << " tokenizer (vocabulary " << tokenizer->vocab_size() << ")\n";
  }
  // Logged only now: a bad --data-path or tokenizer file fails before anything is printed.
  log << " > datasets target sizes (minimum size):\n"
       << "    train:      " << train_samples << "\n    validation: " << valid_samples
       << "\n    test:       " << test_samples << "\n";
  log << "data: train " << run.train_ds->description() << "\n";
  if (run.valid_ds) log << "data: validation " << run.valid_ds->description() << "\n";
  if (run.test_ds) log << "data: test " << run.test_ds->description() << "\n";
}

void setup_model_and_optimizer(TrainingRun& run, std::ostream& log) {
  TrainConfig& cfg = run.cfg;

  cfg.model.padded_vocab_size =
      padded_vocab_size(cfg.model.vocab_size, cfg.data.make_vocab_size_divisible_by, run.ps->tp_size());
  cfg.model.hidden_dropout = cfg.recompute.hidden_dropout;
  cfg.model.attention_dropout = cfg.recompute.attention_dropout;
  log << " > padded vocab (size: " << cfg.model.vocab_size << ") with "
       << cfg.model.padded_vocab_size - cfg.model.vocab_size << " dummy tokens (new size: "
       << cfg.model.padded_vocab_size << ")\n";
  if (cfg.device == "auto" && run.distributed && cuda_available())
    log << " > --device auto: a GPU is visible, but distributed runs compute on the CPU until multi-GPU "
            "training lands\n";
  // The allocator is process-wide: count this run's bytes only (what earlier runs in the same process,
  // e.g. tests, still hold is the baseline).
  run.ctx->reset_peak_memory();
  run.base_bytes = run.ctx->memory_stats().current_bytes;
  log << "device: " << run.ctx->description() << "\n";
  const ModelOptions mo = model_options(cfg);
  if (mo.fp8)
    log << " > fp8: " << fp8_format_name(mo.fp8->format) << " (E4M3 forward, "
         << (mo.fp8->format == Fp8Format::kHybrid ? "E5M2" : "E4M3") << " gradients), delayed scaling: margin "
         << mo.fp8->margin << ", amax history " << mo.fp8->amax_history_len << " ("
         << amax_compute_algo_name(mo.fp8->amax_compute_algo) << "), weight gradients "
         << (mo.fp8->wgrad ? "in fp8" : "in " + std::string(dtype_name(mo.compute_dtype)))
         << (run.ctx->device().is_cpu() ? "; emulated on the CPU (quantise, dequantise, f32 GEMM)" : "") << "\n";
  build_model_chunks(run, mo, log);

  // Megatron's get_optimizer_param_scheduler, in samples.
  SchedulerConfig sc;
  const int64_t decay_iters = cfg.optim.lr_decay_iters.value_or(cfg.batch.train_iters);
  sc.init_lr = cfg.optim.lr_warmup_init;
  sc.max_lr = cfg.optim.lr;
  sc.min_lr = cfg.optim.min_lr;
  // Megatron's get_optimizer_param_scheduler: iteration-based lengths x global batch, or sample-based ones.
  const std::optional<int64_t>& samples = cfg.batch.train_samples;
  sc.lr_decay_steps = samples ? cfg.optim.lr_decay_samples.value_or(*samples) : decay_iters * run.gbs;
  sc.lr_warmup_steps = cfg.optim.lr_warmup_fraction
                           ? int64_t(*cfg.optim.lr_warmup_fraction * double(sc.lr_decay_steps))
                           : samples ? cfg.optim.lr_warmup_samples.value_or(0) : cfg.optim.lr_warmup_iters * run.gbs;
  sc.lr_decay_style = cfg.optim.lr_decay_style;
  sc.wsd_decay_steps = samples ? cfg.optim.lr_wsd_decay_samples.value_or(0)
                               : cfg.optim.lr_wsd_decay_iters.value_or(0) * run.gbs;
  sc.tokens_per_sample = run.T;
  sc.lr_warmup_tokens = cfg.optim.lr_warmup_tokens;
  sc.lr_decay_tokens = cfg.optim.lr_decay_tokens;
  sc.lr_wsd_decay_style = parse_wsd_decay_style(cfg.optim.lr_wsd_decay_style);
  sc.wd_incr_style = parse_wd_incr_style(cfg.optim.weight_decay_incr_style);
  if (sc.wd_incr_style == WDIncrStyle::kConstant) {
    if (cfg.optim.start_weight_decay || cfg.optim.end_weight_decay)
      user_error("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine");
    sc.start_wd = sc.end_wd = cfg.optim.weight_decay;
  } else {
    if (!cfg.optim.start_weight_decay || !cfg.optim.end_weight_decay)
      user_error("--weight-decay-incr-style ", cfg.optim.weight_decay_incr_style,
                 " needs --start-weight-decay and --end-weight-decay");
    sc.start_wd = *cfg.optim.start_weight_decay;
    sc.end_wd = *cfg.optim.end_weight_decay;
  }
  sc.wd_incr_steps = samples ? *samples : cfg.batch.train_iters * run.gbs;
  sc.deepspeed = cfg.optim.deepspeed_schedule;  // ds_config "scheduler": steps once per applied step
  if (sc.deepspeed.enabled()) {
    sc.deepspeed.samples_per_step = run.gbs;
    if (sc.deepspeed.type == DeepSpeedScheduleType::kWarmupCosineLR) sc.deepspeed.base_lr = cfg.optim.lr;
  }
  sc.override_opt_param_scheduler = cfg.optim.override_opt_param_scheduler;
  sc.use_checkpoint_opt_param_scheduler = cfg.optim.use_checkpoint_opt_param_scheduler;
  run.sched = std::make_unique<OptimizerParamScheduler>(sc);

  DynamicGradScalerConfig gs;
  gs.initial_scale = cfg.precision.initial_loss_scale;
  gs.min_scale = cfg.precision.min_loss_scale;
  gs.growth_interval = cfg.precision.loss_scale_window;
  gs.hysteresis = cfg.precision.hysteresis;
  run.scaler = make_grad_scaler(cfg.precision.fp16, cfg.precision.bf16, cfg.precision.loss_scale.value_or(0.0), gs);
}

}  // namespace loom
