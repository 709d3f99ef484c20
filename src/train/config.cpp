#include "loom/train/config.h"

#include <cmath>

#include "loom/optim/distributed_optimizer.h"
#include "loom/pipeline/schedule.h"

namespace loom {

int64_t padded_vocab_size(int64_t vocab_size, int64_t divisible_by, int tp_size) {
  const int64_t multiple = divisible_by * tp_size;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

namespace {

// Mixture of experts against the layout (Megatron's validate_args rules, and Loom's own limits).
void validate_moe_layout(const TrainConfig& c, int world_size) {
  const ParallelConfig& p = c.parallel;
  const int TP = p.tensor_model_parallel_size, EP = p.expert_model_parallel_size;
  const int ETP = p.expert_tensor_parallel_size == 0 ? TP : p.expert_tensor_parallel_size;
  const MoeConfig& m = c.model.moe;
  if (m.num_experts == 0) {
    if (EP != 1) user_error("--expert-model-parallel-size ", EP, " needs --num-experts (mixture-of-experts layers)");
    if (p.expert_tensor_parallel_size != 0 && p.expert_tensor_parallel_size != TP)
      user_error("--expert-tensor-parallel-size ", p.expert_tensor_parallel_size,
                 " needs --num-experts (mixture-of-experts layers)");
    if (c.moe.shared_expert_overlap || c.moe.dispatcher != MoeDispatcher::kAllGather || c.moe.per_layer_logging)
      user_error("--moe-token-dispatcher-type, --moe-shared-expert-overlap and --moe-per-layer-logging need "
                 "--num-experts (mixture-of-experts layers)");
    return;
  }
  if (EP < 1) user_error("--expert-model-parallel-size must be >= 1, got ", EP);
  if (m.num_experts % EP != 0)
    user_error("--num-experts (", m.num_experts, ") must be divisible by --expert-model-parallel-size (", EP, ")");
  const int PP = p.pipeline_model_parallel_size;
  if (world_size % (ETP * EP * PP) != 0)
    user_error("world size ", world_size, " is not divisible by --expert-tensor-parallel-size (", ETP,
               ") x --expert-model-parallel-size (", EP, ") x --pipeline-model-parallel-size (", PP, ") = ",
               ETP * EP * PP, " (the expert-parallel grid)");
  if (TP > 1 && !c.dist.sequence_parallel && !(ETP == TP && EP == 1))
    user_error("mixture of experts with --tensor-model-parallel-size ", TP, " and --expert-model-parallel-size ", EP,
               " / --expert-tensor-parallel-size ", ETP, " needs --sequence-parallel (each rank must route its own "
               "tokens), as Megatron requires with expert parallelism");
  if (ETP > 1 && m.num_experts > 0 && c.model.moe_ffn_hidden_size() % ETP != 0)
    user_error("--moe-ffn-hidden-size (", c.model.moe_ffn_hidden_size(), ") must be divisible by "
               "--expert-tensor-parallel-size (", ETP, ")");
  if (m.shared_expert_intermediate_size % TP != 0)
    user_error("--moe-shared-expert-intermediate-size (", m.shared_expert_intermediate_size,
               ") must be divisible by --tensor-model-parallel-size (", TP, ")");
  if (EP > 1 && c.precision.fp16)
    user_error("--expert-model-parallel-size > 1 does not support --fp16 (as Megatron); use --bf16");
  if (c.moe.shared_expert_overlap && (c.moe.dispatcher != MoeDispatcher::kAllToAll || m.shared_expert_intermediate_size == 0))
    user_error("--moe-shared-expert-overlap needs shared experts (--moe-shared-expert-intermediate-size) and "
               "--moe-token-dispatcher-type alltoall");
  if (!c.precision.fp8_format.empty())
    user_error("--fp8-format with --num-experts: Loom's expert GEMMs have no FP8 path yet; train MoE models in --bf16");
  if (c.lora.rank > 0)
    user_error("--lora-rank with --num-experts: LoRA adapters on experts are not built; fine-tune MoE models in full");
}

// The layout flags against the model shape: every impossible combination named before anything is built.
void dist_validate(const TrainConfig& c, int world_size) {
  const ParallelConfig& p = c.parallel;
  const DistConfig& d = c.dist;
  const int TP = p.tensor_model_parallel_size, PP = p.pipeline_model_parallel_size, CP = p.context_parallel_size;
  if (TP < 1 || PP < 1 || CP < 1)
    user_error("--tensor-model-parallel-size, --pipeline-model-parallel-size and --context-parallel-size must be "
               ">= 1, got ", TP, ", ", PP, ", ", CP);
  if (world_size % (TP * PP * CP) != 0)
    user_error("world size ", world_size, " is not divisible by --tensor-model-parallel-size (", TP,
               ") x --pipeline-model-parallel-size (", PP, ") x --context-parallel-size (", CP, ") = ", TP * PP * CP);
  validate_moe_layout(c, world_size);
  validate_tensor_parallel(c.model, TP, d.sequence_parallel);
  if (PP > 1) {  // the stage split, as build time will do it
    int chunks = 1;
    if (d.virtual_stage_layers > 0) {
      if (c.model.num_layers % (int64_t(PP) * d.virtual_stage_layers) != 0)
        user_error("--num-layers (", c.model.num_layers, ") must be divisible by --pipeline-model-parallel-size (", PP,
                   ") x --num-layers-per-virtual-pipeline-stage (", d.virtual_stage_layers, ")");
      chunks = int(c.model.num_layers / (int64_t(PP) * d.virtual_stage_layers));
    }
    pipeline_layer_split(c.model.num_layers, PP, chunks, d.first_stage_layers, d.last_stage_layers);
  }
  if (d.sequence_parallel && (c.batch.micro_batch_size * c.batch.seq_length / CP) % TP != 0)
    user_error("--sequence-parallel: the tokens of a micro-batch per context rank (--micro-batch-size x --seq-length / "
               "--context-parallel-size = ", c.batch.micro_batch_size * c.batch.seq_length / CP,
               ") must be divisible by --tensor-model-parallel-size (", TP, ")");
  if (c.batch.seq_length % (2 * CP) != 0 && CP > 1)
    user_error("--seq-length (", c.batch.seq_length, ") must be divisible by 2 x --context-parallel-size (", 2 * CP, ")");
  if (d.first_stage_layers < 0 || d.last_stage_layers < 0 || d.virtual_stage_layers < 0)
    user_error("--decoder-first/last-pipeline-num-layers and --num-layers-per-virtual-pipeline-stage must be >= 0");
  if ((d.first_stage_layers || d.last_stage_layers || d.virtual_stage_layers) && PP == 1)
    user_error("--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers and "
               "--num-layers-per-virtual-pipeline-stage need --pipeline-model-parallel-size > 1");
  if (d.virtual_stage_layers && (d.first_stage_layers || d.last_stage_layers))
    user_error("--num-layers-per-virtual-pipeline-stage cannot be combined with uneven first/last stages");
  if (!(d.timeout_minutes > 0)) user_error("--distributed-timeout-minutes must be > 0, got ", d.timeout_minutes);
  if (d.ddp_bucket_size < 0) user_error("--ddp-bucket-size must be >= 1, got ", d.ddp_bucket_size);
  const bool sharded = resolve_sharding(d.use_distributed_optimizer, d.sharding_strategy) != ShardingStrategy::kNone;
  if (d.overlap_param_gather && !sharded)
    user_error("--overlap-param-gather needs --use-distributed-optimizer (or --data-parallel-sharding-strategy "
               "optim, optim_grads or optim_grads_params): without sharding there is no parameter all-gather");
  if (d.overlap_param_gather && !d.overlap_grad_reduce)
    user_error("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron)");
}

}  // namespace

std::optional<Fp8Recipe> PrecisionConfig::fp8_recipe() const {
  if (fp8_format.empty()) {
    const char* stray = fp8_margin ? "--fp8-margin"
                        : fp8_amax_history_len ? "--fp8-amax-history-len"
                        : !fp8_amax_compute_algo.empty() ? "--fp8-amax-compute-algo"
                        : fp8_wgrad ? (*fp8_wgrad ? "--fp8-wgrad" : "--no-fp8-wgrad")
                                    : nullptr;
    if (stray) user_error(stray, " has no effect without --fp8-format e4m3|hybrid");
    return std::nullopt;
  }
  Fp8Recipe r;
  r.format = parse_fp8_format(fp8_format);
  r.margin = fp8_margin.value_or(0);
  r.amax_history_len = fp8_amax_history_len.value_or(1);
  if (!fp8_amax_compute_algo.empty()) r.amax_compute_algo = parse_amax_compute_algo(fp8_amax_compute_algo);
  r.wgrad = fp8_wgrad.value_or(true);
  r.validate();
  if (!bf16 && !fp16) user_error("--fp8-format needs --bf16 or --fp16 (FP8 GEMMs read 16-bit activations and weights)");
  return r;
}

std::vector<std::string> LoraTrainConfig::targets_or_default() const {
  if (!target_modules.empty()) return target_modules;
  return {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"};
}

void LoraTrainConfig::validate() const {
  if (rank < 0) user_error("--lora-rank must be >= 1 (or 0: no LoRA), got ", rank);
  if (!enabled() && (alpha_given || dropout_given || !target_modules.empty()))
    user_error(alpha_given ? "--lora-alpha" : dropout_given ? "--lora-dropout" : "--lora-target-modules",
               " needs --lora-rank R (R >= 1) to turn LoRA on");
  if (enabled()) {
    if (!(dropout >= 0.0f && dropout < 1.0f)) user_error("--lora-dropout must be in [0, 1), got ", dropout);
    if (!std::isfinite(alpha) || alpha <= 0.0f) user_error("--lora-alpha must be > 0, got ", alpha);
  }
}

void TrainConfig::validate(int world_size) const {
  const auto need = [](bool ok, const char* flag) {
    if (!ok) user_error("missing required flag ", flag);
  };
  lora.validate();
  need(model.num_layers > 0, "--num-layers");
  need(model.hidden_size > 0, "--hidden-size");
  need(model.num_attention_heads > 0, "--num-attention-heads");
  need(batch.seq_length > 0, "--seq-length");
  need(batch.micro_batch_size > 0, "--micro-batch-size");
  need(batch.train_iters > 0, "--train-iters");
  if (device != "auto" && device != "cpu" && device != "cuda")
    user_error("--device must be auto, cpu or cuda, got '", device, "'");
  if (logging.profile) {
    if (logging.profile_step_start < 0 || logging.profile_step_end <= logging.profile_step_start)
      user_error("--profile-step-start ", logging.profile_step_start, " / --profile-step-end ",
                 logging.profile_step_end, ": need 0 <= start < end");
    for (int r : logging.profile_ranks)
      if (r < 0 || r >= world_size)
        user_error("--profile-ranks ", r, ": a global rank in [0, ", world_size, ") (world size ", world_size, ")");
  }
  // Shapes and architecture options (--kv-channels, --num-query-groups, --ffn-hidden-size, RoPE, window).
  model.validate_architecture();
  if (model.max_position_embeddings < batch.seq_length)
    user_error("--max-position-embeddings (", model.max_position_embeddings, ") must be >= --seq-length (",
               batch.seq_length, ")");
  const int sources = int(data.mock_data) + int(!data.data_path.empty()) + int(!data.train_data_path.empty());
  if (sources == 0) user_error("no training data: pass --data-path PREFIX (see `loom preprocess`) or --mock-data");
  if (sources > 1) user_error("--mock-data, --data-path and --train-data-path are mutually exclusive");
  if (data.mock_data && !data.vocab_size) user_error("--mock-data needs --vocab-size");
  if (data.vocab_size && *data.vocab_size < 1) user_error("--vocab-size must be >= 1, got ", *data.vocab_size);
  if (!data.mock_data && data.tokenizer.type.empty())
    user_error("--tokenizer-type is required with --data-path (e.g. GPT2BPETokenizer with --vocab-file and "
               "--merge-file)");
  if (data.sft && (data.mock_data || !data.train_data_path.empty()))
    user_error("--sft reads one --data-path prefix written by `loom preprocess --sft` (not --mock-data or "
               "--train-data-path)");
  if (data.npy_records() && (data.reset_position_ids || data.reset_attention_mask || data.eod_mask_loss))
    user_error("--train-data-path ", data.train_data_path[0], ": packed SFT records give each sample its own "
               "positions, attention and loss mask; drop --reset-position-ids, --reset-attention-mask and --eod-mask-loss");
  if (data.sft && (data.reset_position_ids || data.reset_attention_mask || data.eod_mask_loss))
    user_error("--sft: the SFT dataset gives each sample its own positions, attention and answer-only loss; drop "
               "--reset-position-ids, --reset-attention-mask and --eod-mask-loss");
  if (data.mock_data && (data.reset_position_ids || data.reset_attention_mask || data.eod_mask_loss))
    user_error("--reset-position-ids, --reset-attention-mask and --eod-mask-loss need documents: use --data-path "
               "(mock data has no end-of-document token)");
  if (data.make_vocab_size_divisible_by < 1)
    user_error("--make-vocab-size-divisible-by must be >= 1, got ", data.make_vocab_size_divisible_by);
  const int mp = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size *
                 parallel.context_parallel_size;
  const int dp = mp > 0 && world_size % mp == 0 ? world_size / mp : 1;
  if (batch.global_batch_size) {
    const int64_t g = *batch.global_batch_size, unit = batch.micro_batch_size * dp;
    if (g < 1) user_error("--global-batch-size must be >= 1, got ", g);
    if (g % unit != 0)
      user_error("--global-batch-size (", g, ") must be divisible by --micro-batch-size (", batch.micro_batch_size,
                 ") x data-parallel size (", dp, ") = ", unit);
  }
  dist_validate(*this, world_size);
  (void)precision.fp8_recipe();  // throws for invalid FP8 flags
  if (optim.lr < 0) user_error("--lr must be >= 0, got ", optim.lr);
  if (optim.min_lr < 0 || optim.min_lr > optim.lr)
    user_error("--min-lr (", optim.min_lr, ") must be in [0, --lr (", optim.lr, ")]");
  if (optim.lr_warmup_iters < 0) user_error("--lr-warmup-iters must be >= 0, got ", optim.lr_warmup_iters);
  if (optim.lr_warmup_fraction && optim.lr_warmup_iters > 0)
    user_error("--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive");
  if (optim.lr_warmup_fraction && !(*optim.lr_warmup_fraction >= 0 && *optim.lr_warmup_fraction < 1))
    user_error("--lr-warmup-fraction must be in [0, 1), got ", *optim.lr_warmup_fraction);
  const int64_t decay = optim.lr_decay_iters.value_or(batch.train_iters);
  if (decay < 1) user_error("--lr-decay-iters must be >= 1, got ", decay);
  if (optim.lr_warmup_iters >= decay)
    user_error("--lr-warmup-iters (", optim.lr_warmup_iters, ") must be smaller than --lr-decay-iters (", decay,
               optim.lr_decay_iters ? ")" : ", which defaults to --train-iters)");
  if (optim.lr_decay_style == LRDecayStyle::kWSD) {
    if (!optim.lr_wsd_decay_iters) user_error("--lr-decay-style WSD needs --lr-wsd-decay-iters");
    if (*optim.lr_wsd_decay_iters < 1 || *optim.lr_wsd_decay_iters > decay)
      user_error("--lr-wsd-decay-iters (", *optim.lr_wsd_decay_iters, ") must be in [1, --lr-decay-iters (", decay,
                 ")]");
  }
  if (optim.lr_warmup_init < 0 || optim.lr_warmup_init > optim.lr)
    user_error("--lr-warmup-init (", optim.lr_warmup_init, ") must be in [0, --lr (", optim.lr, ")]");
  if (optim.override_opt_param_scheduler && optim.use_checkpoint_opt_param_scheduler)
    user_error("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are mutually exclusive");
  for (const auto& [flag, v] : {std::pair{"--start-weight-decay", optim.start_weight_decay},
                                std::pair{"--end-weight-decay", optim.end_weight_decay}})
    if (v && *v < 0) user_error(flag, " must be >= 0, got ", *v);
  if (optim.weight_decay < 0) user_error("--weight-decay must be >= 0, got ", optim.weight_decay);
  if (!(optim.adam.beta1 >= 0 && optim.adam.beta1 < 1)) user_error("--adam-beta1 must be in [0, 1)");
  if (!(optim.adam.beta2 >= 0 && optim.adam.beta2 < 1)) user_error("--adam-beta2 must be in [0, 1)");
  if (!(optim.adam.eps > 0)) user_error("--adam-eps must be > 0");
  if (!(optim.sgd_momentum >= 0 && std::isfinite(optim.sgd_momentum)))
    user_error("--sgd-momentum must be >= 0 (0: plain SGD), got ", optim.sgd_momentum);
  if (optim.clip_grad < 0) user_error("--clip-grad must be >= 0 (0 disables clipping), got ", optim.clip_grad);
  if (logging.log_interval < 1) user_error("--log-interval must be >= 1, got ", logging.log_interval);
  if (logging.timing_log_level < 0 || logging.timing_log_level > 2)
    user_error("--timing-log-level must be 0, 1 or 2, got ", logging.timing_log_level);
  if (logging.tensorboard_log_interval < 1)
    user_error("--tensorboard-log-interval must be >= 1, got ", logging.tensorboard_log_interval);
  // precision
  if (precision.bf16 && precision.fp16) user_error("--bf16 and --fp16 are mutually exclusive");
  if (precision.loss_scale && !(*precision.loss_scale > 0))
    user_error("--loss-scale must be > 0, got ", *precision.loss_scale);
  if (precision.loss_scale && !precision.fp16 && !precision.bf16)
    user_error("--loss-scale applies to --fp16 (or --bf16) training; fp32 training has no loss scale");
  if (!(precision.initial_loss_scale > 0)) user_error("--initial-loss-scale must be > 0");
  if (!(precision.min_loss_scale > 0) || precision.min_loss_scale > precision.initial_loss_scale)
    user_error("--min-loss-scale (", precision.min_loss_scale, ") must be in (0, --initial-loss-scale (",
               precision.initial_loss_scale, ")]");
  if (precision.loss_scale_window < 1) user_error("--loss-scale-window must be >= 1, got ", precision.loss_scale_window);
  if (precision.hysteresis < 1) user_error("--hysteresis must be >= 1, got ", precision.hysteresis);
  // recomputation and dropout
  const std::string& g = recompute.granularity;
  if (!g.empty() && g != "full" && g != "selective")
    user_error("--recompute-granularity must be full or selective, got '", g, "'");
  if (!recompute.method.empty() && recompute.method != "uniform" && recompute.method != "block")
    user_error("--recompute-method must be uniform or block, got '", recompute.method, "'");
  if (g == "full") {
    if (recompute.method.empty())
      user_error("--recompute-granularity full needs --recompute-method uniform or block");
    if (!recompute.num_layers)
      user_error("--recompute-granularity full needs --recompute-num-layers (1 to --num-layers)");
  } else if (!recompute.method.empty() || recompute.num_layers) {
    user_error("--recompute-method and --recompute-num-layers go with --recompute-granularity full");
  }
  if (recompute.num_layers && (*recompute.num_layers < 1 || *recompute.num_layers > model.num_layers))
    user_error("--recompute-num-layers must be in [1, --num-layers (", model.num_layers, ")], got ",
               *recompute.num_layers);
  if (!(recompute.hidden_dropout >= 0 && recompute.hidden_dropout < 1))
    user_error("--hidden-dropout must be in [0, 1), got ", recompute.hidden_dropout);
  if (!(recompute.attention_dropout >= 0 && recompute.attention_dropout < 1))
    user_error("--attention-dropout must be in [0, 1), got ", recompute.attention_dropout);
  // evaluation
  if (eval.eval_interval < 1) user_error("--eval-interval must be >= 1, got ", eval.eval_interval);
  if (eval.eval_iters < 0) user_error("--eval-iters must be >= 0, got ", eval.eval_iters);
  if ((!eval.valid_data_path.empty() || !eval.test_data_path.empty()) && data.train_data_path.empty())
    user_error("--valid-data-path and --test-data-path go with --train-data-path (with --data-path, --split "
               "makes the validation and test sets)");
  if (eval.target_eval_loss) {
    const double x = *eval.target_eval_loss;
    if (!(x > 0) || !std::isfinite(x))
      user_error("--target-eval-loss must be a finite loss > 0 (MLPerf's llama2_70b_lora target is 0.925), got ", x);
    if (eval.eval_iters == 0)
      user_error("--target-eval-loss needs evaluation: set --eval-iters > 0 (batches per evaluation) and "
                 "--eval-interval N (iterations between evaluations)");
    if (eval.eval_interval > batch.train_iters)
      user_error("--target-eval-loss: --eval-interval (", eval.eval_interval, ") is larger than --train-iters (",
                 batch.train_iters, "), so no evaluation would check the target; use an --eval-interval <= ",
                 batch.train_iters);
  }
  // MLPerf logging
  const MlperfConfig& ml = mlperf;
  if (ml.log.empty() && (ml.division != "closed" || ml.status != "onprem" || ml.org != "Loom" || !ml.platform.empty()))
    user_error("--mlperf-submission-* flags describe the --mlperf-log FILE; add --mlperf-log or drop them");
  if (ml.division != "closed" && ml.division != "open")
    user_error("--mlperf-submission-division must be closed or open, got '", ml.division, "'");
  if (ml.status != "onprem" && ml.status != "cloud" && ml.status != "preview" && ml.status != "research")
    user_error("--mlperf-submission-status must be onprem, cloud, preview or research, got '", ml.status, "'");
  if (ml.org.empty()) user_error("--mlperf-submission-org must not be empty");
  if (!ml.log.empty() && ml.division == "closed" && optim.optimizer != OptimizerKind::kAdam)
    user_error("--mlperf-submission-division closed: llama2_70b_lora's closed rules train with AdamW (the log's "
               "opt_adamw_* keys); use --optimizer adam, or --mlperf-submission-division open");
  // checkpoints and exit
  if (checkpoint.save_interval && *checkpoint.save_interval < 1)
    user_error("--save-interval must be >= 1, got ", *checkpoint.save_interval);
  if (checkpoint.save_interval && checkpoint.save.empty()) user_error("--save-interval needs --save DIR");
  if (checkpoint.finetune && checkpoint.load.empty()) user_error("--finetune needs --load DIR");
  if (exit.exit_interval && *exit.exit_interval < 1)
    user_error("--exit-interval must be >= 1, got ", *exit.exit_interval);
  if (exit.exit_duration_in_mins && !(*exit.exit_duration_in_mins > 0))
    user_error("--exit-duration-in-mins must be > 0, got ", *exit.exit_duration_in_mins);
}

}  // namespace loom
