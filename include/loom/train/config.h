// Configuration of `loom train`: one small struct per concern, filled from Megatron's flag names
// (see train/args.h), with cross-field rules in TrainConfig::validate().
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include <vector>

#include "loom/data/tokenizer.h"
#include "loom/dist/parallel_state.h"
#include "loom/fp8/fp8.h"
#include "loom/model/gpt.h"
#include "loom/optim/optimizer.h"
#include "loom/optim/scheduler.h"

namespace loom {

struct DataConfig {
  bool mock_data = false;   // --mock-data: uniform random tokens over --vocab-size
  // --data-path: Megatron indexed-dataset prefixes, "prefix" or "w1 prefix1 w2 prefix2 ...", split by --split.
  std::vector<std::string> data_path;
  std::vector<std::string> train_data_path;  // --train-data-path: like --data-path, all of it for training
  std::string split = "969, 30, 1";          // --split (Megatron's default)
  std::string data_cache_path;               // --data-cache-path (default <prefix dir>/cache/GPTDataset_indices)
  TokenizerConfig tokenizer;                 // --tokenizer-type, --vocab-file, --merge-file, --tokenizer-model, ...
  std::optional<int64_t> vocab_size;         // --vocab-size (--mock-data, NullTokenizer)
  int64_t make_vocab_size_divisible_by = 128;  // --make-vocab-size-divisible-by
  bool reset_position_ids = false;    // --reset-position-ids: positions restart after each EOD
  bool reset_attention_mask = false;  // --reset-attention-mask: no attention across documents
  bool eod_mask_loss = false;         // --eod-mask-loss: no loss on EOD tokens
  // --sft: --data-path is a `loom preprocess --sft` dataset (loom/data/sft_dataset.h): answer-only loss,
  // samples packed (--sft-packing, the default) or padded (--no-sft-packing), --sft-overlong policy.
  bool sft = false;
  bool sft_packing = true;
  // --train-data-path names one .npy file: NeMo's packed SFT records (loom/data/npy_packed_dataset.h).
  bool npy_records() const { return train_data_path.size() == 1 && train_data_path[0].ends_with(".npy"); }
  std::string sft_overlong = "truncate";
};

struct BatchConfig {
  int64_t seq_length = 0;        // --seq-length (T)
  int64_t micro_batch_size = 0;  // --micro-batch-size (B)
  std::optional<int64_t> global_batch_size;  // --global-batch-size (default micro x data-parallel size)
  int64_t train_iters = 0;       // --train-iters (with --train-samples: train_samples // global batch)
  std::optional<int64_t> train_samples;  // --train-samples: sample-based training (Megatron-LM)
  std::optional<int64_t> train_tokens;   // --train-tokens: stop once this many tokens are consumed (Megatron-DeepSpeed)
};

struct OptimConfig {
  double lr = 0;                       // --lr (peak)
  double min_lr = 0;                   // --min-lr
  double lr_warmup_init = 0;           // --lr-warmup-init: warmup starts here
  int64_t lr_warmup_iters = 0;         // --lr-warmup-iters
  std::optional<double> lr_warmup_fraction;  // --lr-warmup-fraction of the decay iterations (excl. with iters)
  std::optional<int64_t> lr_decay_iters;  // --lr-decay-iters (default --train-iters)
  std::optional<int64_t> lr_decay_samples;   // --lr-decay-samples (sample-based; default --train-samples)
  std::optional<int64_t> lr_warmup_samples;  // --lr-warmup-samples (sample-based)
  std::optional<int64_t> lr_wsd_decay_samples;  // --lr-wsd-decay-samples (sample-based WSD)
  std::optional<int64_t> lr_decay_tokens;    // --lr-decay-tokens: decay over tokens (Megatron-DeepSpeed)
  std::optional<int64_t> lr_warmup_tokens;   // --lr-warmup-tokens: warm up over tokens (Megatron-DeepSpeed)
  LRDecayStyle lr_decay_style = LRDecayStyle::kLinear;  // --lr-decay-style (Megatron default linear)
  std::string lr_wsd_decay_style = "exponential";       // --lr-wsd-decay-style (Megatron's default)
  std::optional<int64_t> lr_wsd_decay_iters;            // --lr-wsd-decay-iters (required with WSD)
  double weight_decay = 0.01;          // --weight-decay (constant style)
  std::optional<double> start_weight_decay;  // --start-weight-decay (default --weight-decay)
  std::optional<double> end_weight_decay;    // --end-weight-decay (default --weight-decay)
  std::string weight_decay_incr_style = "constant";  // --weight-decay-incr-style constant|linear|cosine
  bool override_opt_param_scheduler = false;        // --override-opt_param-scheduler: flags win on resume
  bool use_checkpoint_opt_param_scheduler = false;  // --use-checkpoint-opt_param-scheduler: checkpoint wins
  OptimizerKind optimizer = OptimizerKind::kAdam;  // --optimizer adam|sgd
  AdamWConfig adam;                    // --adam-beta1/--adam-beta2/--adam-eps
  float sgd_momentum = 0.9f;           // --sgd-momentum (with --optimizer sgd)
  DeepSpeedSchedule deepspeed_schedule;  // ds_config "scheduler" (replaces the Megatron schedule when set)
  OptimizerConfig optimizer_config() const { return {optimizer, adam, sgd_momentum}; }
  double clip_grad = 1.0;              // --clip-grad (0 disables)
};

// Mixed precision (Megatron: --bf16 / --fp16 with FP32 master weights, FP32 optimizer state).
struct PrecisionConfig {
  bool bf16 = false;  // --bf16: BF16 compute, FP32 main grads
  bool fp16 = false;  // --fp16: FP16 compute with loss scaling
  std::optional<double> loss_scale;           // --loss-scale: static scale (else dynamic)
  double initial_loss_scale = 4294967296.0;   // --initial-loss-scale (2^32)
  double min_loss_scale = 1.0;                // --min-loss-scale
  int64_t loss_scale_window = 1000;           // --loss-scale-window (clean steps before the scale doubles)
  int64_t hysteresis = 2;                     // --hysteresis (overflows tolerated before the scale halves)
  bool attention_softmax_in_fp32 = false;     // --attention-softmax-in-fp32 (Loom's softmax is always f32)
  bool accumulate_allreduce_grads_in_fp32 = false;  // --accumulate-allreduce-grads-in-fp32 (forced by --bf16)
  // FP8 (Transformer Engine's delayed scaling; emulated on the CPU backend). fp8_format set = FP8 on.
  std::string fp8_format;                     // --fp8-format e4m3|hybrid ("" = off)
  std::optional<int> fp8_margin;              // --fp8-margin (default 0)
  std::optional<int> fp8_amax_history_len;    // --fp8-amax-history-len (default 1)
  std::string fp8_amax_compute_algo;          // --fp8-amax-compute-algo max|most_recent (default most_recent)
  std::optional<bool> fp8_wgrad;              // --fp8-wgrad / --no-fp8-wgrad (default on)
  // The recipe when --fp8-format is given (defaults filled in); UserError for invalid values, for FP8
  // without 16-bit compute, and for an --fp8-* flag without --fp8-format.
  std::optional<Fp8Recipe> fp8_recipe() const;
  DType compute_dtype() const { return bf16 ? DType::kBF16 : fp16 ? DType::kF16 : DType::kF32; }
  // Megatron: main grads are f32 for bf16 (forced) and with the flag, else the model's dtype.
  DType grad_dtype() const { return fp16 && !accumulate_allreduce_grads_in_fp32 ? DType::kF16 : DType::kF32; }
};

// Activation recomputation and dropout (--recompute-*, --hidden-dropout, --attention-dropout).
struct RecomputeConfig {
  std::string granularity;  // --recompute-granularity: "" (none) | full | selective
  std::string method;       // --recompute-method: uniform | block (required with full)
  std::optional<int64_t> num_layers;  // --recompute-num-layers (required with full)
  float hidden_dropout = 0.1f;     // --hidden-dropout (Megatron's default)
  float attention_dropout = 0.1f;  // --attention-dropout (Megatron's default)
};

struct EvalConfig {
  int64_t eval_interval = 1000;  // --eval-interval (iterations)
  int64_t eval_iters = 100;      // --eval-iters (batches per evaluation; 0 disables evaluation)
  std::vector<std::string> valid_data_path;  // --valid-data-path (with --train-data-path)
  std::vector<std::string> test_data_path;   // --test-data-path (with --train-data-path)
  // --target-eval-loss X (MLPerf's convergence target, 0.925 for llama2_70b_lora): training stops at the
  // first periodic evaluation whose MLPerf metric (the mean over validation sequences of each sequence's
  // mean masked-token loss, train/evaluator.h) is <= X. Every evaluation then reads the validation set from
  // its first sample, as MLPerf scores the same set each time. Needs --eval-iters > 0.
  std::optional<double> target_eval_loss;
};

// Distributed training beyond the rank grid (ParallelConfig): docs/parallelism.md.
struct DistConfig {
  bool sequence_parallel = false;           // --sequence-parallel (needs TP > 1)
  int64_t virtual_stage_layers = 0;         // --num-layers-per-virtual-pipeline-stage (0: no interleaving)
  int64_t first_stage_layers = 0;           // --decoder-first-pipeline-num-layers (0: even split)
  int64_t last_stage_layers = 0;            // --decoder-last-pipeline-num-layers (0: even split)
  bool use_distributed_optimizer = false;   // --use-distributed-optimizer (ZeRO-1)
  std::string sharding_strategy;            // --data-parallel-sharding-strategy no_shard|optim|optim_grads|optim_grads_params
  int64_t ddp_bucket_size = 0;              // --ddp-bucket-size (elements; 0: Megatron's default)
  bool overlap_grad_reduce = false;         // --overlap-grad-reduce
  bool overlap_param_gather = false;        // --overlap-param-gather (sharded strategies, with --overlap-grad-reduce)
  double timeout_minutes = 10.0;            // --distributed-timeout-minutes (Megatron's default)
  // --distributed-backend nccl|gloo|mpi (empty: not given). CPU ranks always use MPI collectives (said once
  // in the log when a GPU script asks for nccl); GPU runs use NCCL.
  std::string backend;
  // --local-rank / --local_rank N, set by Python launchers; Loom takes its rank from mpirun/srun's
  // environment and fails when the two disagree.
  std::optional<int64_t> local_rank;
};

// Mixture-of-experts run options (the architecture itself is GPTConfig::moe).
struct MoeTrainConfig {
  // --moe-layer-freq as given: an int N (every N-th layer, from layer 0, is a MoE layer) or Megatron's
  // Python list expression ("[1,0,1,1]", "([0]+[1]*3)*2"); resolved into model.moe.layer_pattern once
  // --num-layers is known. Empty: 1 (every layer).
  std::string layer_freq;
  MoeDispatcher dispatcher = MoeDispatcher::kAllGather;  // --moe-token-dispatcher-type (Megatron's default)
  bool shared_expert_overlap = false;  // --moe-shared-expert-overlap (alltoall: shared experts run while the
                                       // routed tokens are exchanged)
  bool per_layer_logging = false;      // --moe-per-layer-logging: router losses per layer in TensorBoard
};

struct CheckpointConfig {
  std::string save;                    // --save DIR
  std::string load;                    // --load DIR
  // --ckpt-step N (Megatron's): load <load>/iter_<N> instead of the checkpoint the tracker names (e.g. an
  // earlier one when the latest is damaged).
  std::optional<int64_t> ckpt_step;
  std::optional<int64_t> save_interval;  // --save-interval (iterations); the end of training always saves
  bool no_save_optim = false;          // --no-save-optim
  bool no_save_rng = false;            // --no-save-rng
  bool no_load_optim = false;          // --no-load-optim
  bool no_load_rng = false;            // --no-load-rng
  bool finetune = false;               // --finetune: load weights only, start at iteration 0
  // --pretrained-checkpoint DIR (Megatron's): the model to fine-tune (a Loom checkpoint directory or a
  // Hugging Face model directory), loaded weights only when --load holds no checkpoint of this run. With
  // LoRA it is the frozen base (a LoRA checkpoint otherwise names the base it was trained on).
  std::string pretrained_checkpoint;
};

// LoRA fine-tuning (loom/nn/lora.h, ModelOptions::lora): --lora-rank > 0 turns it on.
struct LoraTrainConfig {
  int64_t rank = 0;      // --lora-rank (0: no LoRA)
  float alpha = 32.0f;   // --lora-alpha (the update is scaled by alpha / rank)
  float dropout = 0.0f;  // --lora-dropout (on each adapter's input)
  // --lora-target-modules (Megatron, NeMo or PEFT names, see parse_lora_targets); empty: Megatron-Bridge's
  // default linear_qkv linear_proj linear_fc1 linear_fc2.
  std::vector<std::string> target_modules;
  bool alpha_given = false, dropout_given = false;
  bool enabled() const { return rank > 0; }
  std::vector<std::string> targets_or_default() const;
  // The flags' own rules (rank >= 0; alpha, dropout and modules only with a rank; alpha > 0, dropout in
  // [0, 1)): UserError naming the flag. `loom train` and `loom calc` both apply them.
  void validate() const;
};

struct ExitConfig {
  std::optional<int64_t> exit_interval;         // --exit-interval: stop when iteration % N == 0
  std::optional<double> exit_duration_in_mins;  // --exit-duration-in-mins
  bool exit_signal_handler = false;             // --exit-signal-handler: SIGTERM/SIGINT save and exit 0
  // Megatron's check_for_nan_in_loss_and_grad (on; --no-check-for-nan-in-loss-and-grad turns it off): a
  // non-finite loss, or outside FP16 dynamic loss scaling a non-finite gradient norm, stops the run with an
  // error naming the iteration, before the update. Off: such steps are skipped and counted.
  bool check_for_nan_in_loss_and_grad = true;
};

struct LoggingConfig {
  int64_t log_interval = 100;  // --log-interval (iterations)
  int timing_log_level = 0;    // --timing-log-level 0|1|2
  std::string tensorboard_dir;            // --tensorboard-dir
  int64_t tensorboard_log_interval = 1;   // --tensorboard-log-interval
  bool log_timers_to_tensorboard = false;       // --log-timers-to-tensorboard
  bool log_memory_to_tensorboard = false;       // --log-memory-to-tensorboard
  bool log_validation_ppl_to_tensorboard = false;  // --log-validation-ppl-to-tensorboard
  bool log_learning_rate_to_tensorboard = true;    // --no-log-learning-rate-to-tensorboard
  bool log_loss_scale_to_tensorboard = true;       // --no-log-loss-scale-to-tensorboard
  bool log_batch_size_to_tensorboard = false;      // --log-batch-size-to-tensorboard
  bool log_params_norm = false;   // --log-params-norm
  bool log_num_zeros_in_grad = false;          // --log-num-zeros-in-grad: zeros in the gradients, log + TensorBoard
  bool log_world_size_to_tensorboard = false;  // --log-world-size-to-tensorboard
  int64_t tensorboard_queue_size = 1000;       // --tensorboard-queue-size: events buffered before a flush
  std::string timing_log_option = "minmax";    // --timing-log-option max|minmax|all: timers across ranks
  bool log_throughput = false;    // --log-throughput
  bool log_optimizer_states_to_tensorboard = false;  // --log-optimizer-states-to-tensorboard (Megatron-DeepSpeed)
  // --wandb-project / --wandb-exp-name (Loom has no W&B client: the run warns once; metrics go to
  // TensorBoard and --metrics-jsonl).
  std::string wandb_project, wandb_exp_name;
  std::string metrics_jsonl;      // --metrics-jsonl FILE: one JSON object per log line (Loom's)
  // Megatron's --profile: NVTX ranges around each timed phase and cudaProfilerStart/Stop around
  // iterations [profile_step_start, profile_step_end) on the ranks in profile_ranks, for
  // `nsys profile --capture-range=cudaProfilerApi`. Needs the CUDA device.
  bool profile = false;            // --profile
  int64_t profile_step_start = 10;  // --profile-step-start (iteration)
  int64_t profile_step_end = 12;    // --profile-step-end (iteration, exclusive)
  std::vector<int> profile_ranks{0};  // --profile-ranks (global ranks)
  bool profile_ranks_given = false;
  std::string profile_name;  // --profile-name: the NVTX range spanning the profiled window (default "loom")
};

// MLPerf Training's :::MLLOG log of the run (loom/train/mlperf_log.h, docs/training.md): written by global
// rank 0 when `log` is set; the submission fields are the checker's submission_* keys.
struct MlperfConfig {
  std::string log;                    // --mlperf-log FILE ("" = none)
  std::string division = "closed";    // --mlperf-submission-division closed|open
  std::string status = "onprem";      // --mlperf-submission-status onprem|cloud|preview|research
  std::string org = "Loom";           // --mlperf-submission-org NAME
  std::string platform;               // --mlperf-submission-platform NAME (default "<ranks>x<device>")
};

// Megatron-DeepSpeed's launch flags and its ds_config.json (train/deepspeed_config.cpp,
// docs/migrating.md). The file is applied when the flags are parsed; the batch values are resolved
// against the data-parallel size by the set-up, with DeepSpeed's rules.
struct DeepSpeedConfig {
  bool enabled = false;                    // --deepspeed
  std::string config_path;                 // --deepspeed_config / --deepspeed-config FILE
  std::optional<int> zero_stage;           // --zero-stage N
  bool activation_checkpointing = false;   // --deepspeed-activation-checkpointing
  bool partition_activations = false;      // --partition-activations
  bool contiguous_checkpointing = false;   // --contigious-checkpointing (Megatron-DeepSpeed's spelling)
  // train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps as the file gives them.
  std::optional<int64_t> train_batch_size, micro_batch_size, gradient_accumulation_steps;
  bool micro_batch_flag_given = false, global_batch_flag_given = false;  // --micro-batch-size / --global-batch-size
  // What the file and the flags decided (which value won where both gave one): printed once by the run.
  std::vector<std::string> notes;
};

struct TrainConfig {
  GPTConfig model;  // vocab sizes are filled in by resolve_vocab()
  DataConfig data;
  BatchConfig batch;
  OptimConfig optim;
  ParallelConfig parallel;
  DistConfig dist;
  LoggingConfig logging;
  PrecisionConfig precision;
  RecomputeConfig recompute;
  EvalConfig eval;
  CheckpointConfig checkpoint;
  LoraTrainConfig lora;
  ExitConfig exit;
  DeepSpeedConfig deepspeed;
  MlperfConfig mlperf;
  MoeTrainConfig moe;
  uint64_t seed = 1234;  // --seed
  // --device auto|cpu|cuda (Loom's): where the run computes. auto = the GPU when this build has the CUDA
  // backend and one is visible (rank r uses GPU local_rank % visible GPUs), else the CPU.
  std::string device = "auto";
  // Megatron flags whose only effect there is the choice of kernels (--use-flash-attn,
  // --no-masked-softmax-fusion, --transformer-impl X, ...), as given: Loom always runs its own fused
  // kernels, so they change no result; the run's log says so once.
  std::vector<std::string> kernel_choice_flags;
  std::optional<int64_t> num_workers;  // --num-workers (PyTorch data-loader processes; Loom reads in-process)
  bool no_pipeline_parallel = false;   // --no-pipeline-parallel (Megatron-DeepSpeed; needs pipeline size 1)
  bool max_position_embeddings_given = false;

  // Cross-field checks that need no data and no allocation; UserError names the flags.
  void validate(int world_size) const;
  int64_t global_batch_size(int dp_size) const {
    return batch.global_batch_size.value_or(batch.micro_batch_size * dp_size);
  }
  int64_t num_micro_batches(int dp_size) const {
    return global_batch_size(dp_size) / (batch.micro_batch_size * dp_size);
  }
};

// Megatron's _vocab_size_with_padding: round up to a multiple of divisible_by x TP size.
int64_t padded_vocab_size(int64_t vocab_size, int64_t divisible_by, int tp_size);

}  // namespace loom
