// Flag table for `loom train`, parsed by the shared argparse-style parser (train/flags.h). Every flag in
// the table changes what the run does; Megatron flags for features this build does not have yet are
// errors that say so, never silently accepted.
#include "loom/train/args.h"

#include <functional>
#include <set>

#include "loom/core/check.h"
#include "loom/data/sft_dataset.h"
#include "loom/train/timers.h"
#include "train/args_checks.h"
#include "train/deepspeed_config.h"

namespace loom {

namespace {

struct Flag {
  std::string name;
  std::string metavar;  // empty for switches; ending in "..." takes every value up to the next flag
  std::string help;
  std::function<void(TrainConfig&, const std::string&)> set;
};

// --num-layers' bound: far above any real model (hundreds of layers), low enough that declaring or
// planning the model stays a matter of seconds.
constexpr int64_t kMaxLayers = 65536;
int64_t parse_int(const std::string& flag, const std::string& v) { return parse_int_flag(flag, v); }
double parse_float(const std::string& flag, const std::string& v) { return parse_float_flag(flag, v); }

// Megatron's tuple_type "L,R" or "(L,R)". Causal attention has no right window; -1 on the left is
// Transformer Engine's "unlimited".
// Python's bool spellings, as Megatron-DeepSpeed's BOOL arguments take them.
bool parse_bool(const std::string& flag, const std::string& v) {
  if (v == "true" || v == "True" || v == "1") return true;
  if (v == "false" || v == "False" || v == "0") return false;
  user_error(flag, " takes true or false, got '", v, "'");
}

int64_t parse_window_size(const std::string& v) {
  std::string t;
  for (char ch : v)
    if (ch != ' ') t += ch;
  if (t.size() >= 2 && t.front() == '(' && t.back() == ')') t = t.substr(1, t.size() - 2);
  const size_t comma = t.find(',');
  if (comma == std::string::npos)
    user_error("--window-size takes two integers LEFT,RIGHT (e.g. 4096,0), got '", v, "'");
  const int64_t left = parse_int("--window-size", t.substr(0, comma));
  const int64_t right = parse_int("--window-size", t.substr(comma + 1));
  if (right != 0)
    user_error("--window-size ", v, ": the right window must be 0 (Loom's attention is causal), got ", right);
  if (left < -1) user_error("--window-size ", v, ": the left window must be >= 0 (or -1: unlimited), got ", left);
  return left;
}

const std::vector<Flag>& flags() {
  using C = TrainConfig;
  using S = const std::string&;
  static const std::vector<Flag> table = [] {
  std::vector<Flag> t = {
      // model
      {"--num-layers", "N", "transformer layers", [](C& c, S v) { c.model.num_layers = parse_positive_flag("--num-layers", v, kMaxLayers); }},
      {"--hidden-size", "C", "hidden size", [](C& c, S v) { c.model.hidden_size = parse_positive_flag("--hidden-size", v); }},
      {"--num-attention-heads", "NH", "attention heads",
       [](C& c, S v) { c.model.num_attention_heads = parse_positive_flag("--num-attention-heads", v); }},
      {"--max-position-embeddings", "P", "learned position embeddings (default: --seq-length)",
       [](C& c, S v) {
         c.model.max_position_embeddings = parse_positive_flag("--max-position-embeddings", v);
         c.max_position_embeddings_given = true;
       }},
      {"--init-method-std", "F", "std of the normal init (default 0.02)",
       [](C& c, S v) { c.model.init_method_std = float(parse_float("--init-method-std", v)); }},
      {"--norm-epsilon", "F", "LayerNorm / RMSNorm epsilon (default 1e-5)",
       [](C& c, S v) { c.model.layernorm_epsilon = float(parse_float("--norm-epsilon", v)); }},
      // architecture (defaults: GPT-2; docs/models.md)
      {"--normalization", "S", "LayerNorm | RMSNorm (default LayerNorm)",
       [](C& c, S v) { c.model.normalization = parse_norm_kind(v); }},
      {"--swiglu", "", "SwiGLU MLP: linear_fc1 is [gate | up], 2 x --ffn-hidden-size wide",
       [](C& c, S) { c.model.activation = MlpActivation::kSwiGLU; }},
      {"--ffn-hidden-size", "F", "MLP width (default 4 x hidden, with --swiglu int(8 x hidden / 3 / 64) x 64)",
       [](C& c, S v) { c.model.ffn_hidden = parse_positive_flag("--ffn-hidden-size", v); }},
      {"--kv-channels", "HS", "attention head size (default hidden / heads)",
       [](C& c, S v) { c.model.kv_channels = parse_positive_flag("--kv-channels", v); }},
      {"--group-query-attention", "", "grouped-query attention: --num-query-groups key/value heads",
       [](C& c, S) { c.model.group_query_attention = true; }},
      {"--num-query-groups", "G", "key/value heads with --group-query-attention (default 1)",
       [](C& c, S v) { c.model.num_query_groups = parse_positive_flag("--num-query-groups", v); }},
      {"--disable-bias-linear", "", "no biases in the linear layers", [](C& c, S) { c.model.add_bias_linear = false; }},
      {"--add-qkv-bias", "", "keep the linear_qkv bias with --disable-bias-linear",
       [](C& c, S) { c.model.add_qkv_bias = true; }},
      {"--untie-embeddings-and-output-weights", "", "separate output_layer.weight instead of the word embedding",
       [](C& c, S) { c.model.untie_embeddings_and_output_weights = true; }},
      {"--position-embedding-type", "S", "learned_absolute | rope | none (default learned_absolute)",
       [](C& c, S v) { c.model.position_embedding_type = parse_position_embedding_type(v); }},
      {"--use-rotary-position-embeddings", "", "deprecated: --position-embedding-type rope",
       [](C& c, S) { c.model.position_embedding_type = PositionEmbeddingType::kRope; }},
      {"--rotary-base", "N", "RoPE base (default 10000)",
       [](C& c, S v) { c.model.rotary_base = parse_float("--rotary-base", v); }},
      {"--rotary-percent", "F", "fraction of each head's channels RoPE rotates (default 1.0)",
       [](C& c, S v) { c.model.rotary_percent = float(parse_float("--rotary-percent", v)); }},
      {"--rotary-interleaved", "", "RoPE pairs channels (2i, 2i+1) instead of (i, i + d/2)",
       [](C& c, S) { c.model.rotary_interleaved = true; }},
      {"--use-rope-scaling", "", "Llama 3.1 RoPE frequency scaling", [](C& c, S) { c.model.use_rope_scaling = true; }},
      {"--rope-scaling-factor", "F", "factor of --use-rope-scaling (default 8.0)",
       [](C& c, S v) { c.model.rope_scaling_factor = float(parse_float("--rope-scaling-factor", v)); }},
      {"--window-size", "L,R", "sliding-window attention: query i sees keys [i-L, i+R]; R must be 0 (causal)",
       [](C& c, S v) { c.model.window_size_left = parse_window_size(v); }},
      {"--qk-layernorm", "", "normalize each query and key head (with --normalization's kind)",
       [](C& c, S) { c.model.qk_layernorm = true; }},
      {"--vocab-size", "V", "vocabulary size (required with --mock-data)",
       [](C& c, S v) { c.data.vocab_size = parse_positive_flag("--vocab-size", v); }},
      {"--make-vocab-size-divisible-by", "N", "pad the vocabulary to a multiple of N (default 128)",
       [](C& c, S v) { c.data.make_vocab_size_divisible_by = parse_positive_flag("--make-vocab-size-divisible-by", v); }},
      // batch
      {"--seq-length", "T", "sequence length", [](C& c, S v) { c.batch.seq_length = parse_positive_flag("--seq-length", v); }},
      {"--micro-batch-size", "B", "sequences per micro-batch",
       [](C& c, S v) { c.batch.micro_batch_size = parse_positive_flag("--micro-batch-size", v); }},
      {"--global-batch-size", "G", "sequences per step; micro-batches accumulate (default: micro-batch size)",
       [](C& c, S v) { c.batch.global_batch_size = parse_positive_flag("--global-batch-size", v); }},
      {"--train-iters", "N", "optimizer steps", [](C& c, S v) { c.batch.train_iters = parse_positive_flag("--train-iters", v); }},
      {"--train-samples", "N", "sample-based training: train_samples // global batch iterations; the lr schedule "
       "counts samples (excludes --train-iters)",
       [](C& c, S v) { c.batch.train_samples = parse_int("--train-samples", v); }},
      {"--train-tokens", "N", "Megatron-DeepSpeed: stop once N tokens (samples x --seq-length) are consumed",
       [](C& c, S v) { c.batch.train_tokens = parse_int("--train-tokens", v); }},
      {"--lr-decay-samples", "N", "sample-based decay length (default --train-samples)",
       [](C& c, S v) { c.optim.lr_decay_samples = parse_int("--lr-decay-samples", v); }},
      {"--lr-warmup-samples", "N", "sample-based warmup length (default 0)",
       [](C& c, S v) { c.optim.lr_warmup_samples = parse_int("--lr-warmup-samples", v); }},
      {"--lr-wsd-decay-samples", "N", "sample-based WSD annealing length",
       [](C& c, S v) { c.optim.lr_wsd_decay_samples = parse_int("--lr-wsd-decay-samples", v); }},
      {"--lr-decay-tokens", "N", "Megatron-DeepSpeed: decay the lr over N tokens (samples x --seq-length)",
       [](C& c, S v) { c.optim.lr_decay_tokens = parse_int("--lr-decay-tokens", v); }},
      {"--lr-warmup-tokens", "N", "Megatron-DeepSpeed: warm the lr up over N tokens",
       [](C& c, S v) { c.optim.lr_warmup_tokens = parse_int("--lr-warmup-tokens", v); }},
      // optimizer and schedule
      {"--lr", "F", "peak learning rate", [](C& c, S v) { c.optim.lr = parse_float("--lr", v); }},
      {"--min-lr", "F", "final learning rate (default 0)", [](C& c, S v) { c.optim.min_lr = parse_float("--min-lr", v); }},
      {"--lr-warmup-iters", "N", "linear warmup iterations (default 0)",
       [](C& c, S v) { c.optim.lr_warmup_iters = parse_int("--lr-warmup-iters", v); }},
      {"--lr-decay-iters", "N", "iterations to decay over (default --train-iters)",
       [](C& c, S v) { c.optim.lr_decay_iters = parse_int("--lr-decay-iters", v); }},
      {"--lr-decay-style", "S", "constant | linear | cosine | inverse-square-root | WSD (default linear)",
       [](C& c, S v) { c.optim.lr_decay_style = parse_lr_decay_style(v); }},
      {"--weight-decay", "F", "AdamW weight decay, not applied to biases and norms (default 0.01)",
       [](C& c, S v) { c.optim.weight_decay = parse_float("--weight-decay", v); }},
      {"--adam-beta1", "F", "default 0.9", [](C& c, S v) { c.optim.adam.beta1 = float(parse_float("--adam-beta1", v)); }},
      {"--adam-beta2", "F", "default 0.999",
       [](C& c, S v) { c.optim.adam.beta2 = float(parse_float("--adam-beta2", v)); }},
      {"--adam-eps", "F", "default 1e-8", [](C& c, S v) { c.optim.adam.eps = float(parse_float("--adam-eps", v)); }},
      {"--optimizer", "adam|sgd", "adam (AdamW, decoupled weight decay; default) or sgd (torch.optim.SGD: L2 weight "
       "decay, --sgd-momentum); both ZeRO-sharded alike",
       [](C& c, S v) { c.optim.optimizer = parse_optimizer_kind(v); }},
      {"--sgd-momentum", "F", "SGD momentum (default 0.9; 0: no momentum buffer)",
       [](C& c, S v) { c.optim.sgd_momentum = float(parse_float("--sgd-momentum", v)); }},
      {"--clip-grad", "F", "clip the global gradient norm to F, 0 disables (default 1.0)",
       [](C& c, S v) { c.optim.clip_grad = parse_float("--clip-grad", v); }},
      {"--lr-warmup-init", "F", "learning rate the warmup starts from (default 0)",
       [](C& c, S v) { c.optim.lr_warmup_init = parse_float("--lr-warmup-init", v); }},
      {"--lr-warmup-fraction", "F", "warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)",
       [](C& c, S v) { c.optim.lr_warmup_fraction = parse_float("--lr-warmup-fraction", v); }},
      {"--lr-wsd-decay-style", "S", "WSD anneal shape: exponential | linear | cosine | minus_sqrt (default exponential)",
       [](C& c, S v) { c.optim.lr_wsd_decay_style = v; }},
      {"--lr-wsd-decay-iters", "N", "WSD: iterations of the final anneal (required with --lr-decay-style WSD)",
       [](C& c, S v) { c.optim.lr_wsd_decay_iters = parse_int("--lr-wsd-decay-iters", v); }},
      {"--start-weight-decay", "F", "weight decay at iteration 0 (with --weight-decay-incr-style)",
       [](C& c, S v) { c.optim.start_weight_decay = parse_float("--start-weight-decay", v); }},
      {"--end-weight-decay", "F", "weight decay at the end of training (with --weight-decay-incr-style)",
       [](C& c, S v) { c.optim.end_weight_decay = parse_float("--end-weight-decay", v); }},
      {"--weight-decay-incr-style", "S", "constant | linear | cosine (default constant)",
       [](C& c, S v) { c.optim.weight_decay_incr_style = v; }},
      {"--override-opt-param-scheduler", "", "on --load, the schedule flags win over the checkpoint's",
       [](C& c, S) { c.optim.override_opt_param_scheduler = true; }},
      {"--use-checkpoint-opt-param-scheduler", "", "on --load, the checkpoint's schedule wins over the flags",
       [](C& c, S) { c.optim.use_checkpoint_opt_param_scheduler = true; }},
      {"--override-lr-scheduler", "", "legacy spelling of --override-opt-param-scheduler",
       [](C& c, S) { c.optim.override_opt_param_scheduler = true; }},
      {"--use-checkpoint-lr-scheduler", "", "legacy spelling of --use-checkpoint-opt-param-scheduler",
       [](C& c, S) { c.optim.use_checkpoint_opt_param_scheduler = true; }},
      // mixed precision
      {"--bf16", "", "BF16 compute, FP32 master weights, main grads and optimizer state",
       [](C& c, S) { c.precision.bf16 = true; }},
      {"--fp16", "", "FP16 compute with dynamic loss scaling, FP32 master weights and optimizer state",
       [](C& c, S) { c.precision.fp16 = true; }},
      {"--loss-scale", "F", "static FP16 loss scale (default: dynamic)",
       [](C& c, S v) { c.precision.loss_scale = parse_float("--loss-scale", v); }},
      {"--initial-loss-scale", "F", "first dynamic loss scale (default 2^32)",
       [](C& c, S v) { c.precision.initial_loss_scale = parse_float("--initial-loss-scale", v); }},
      {"--min-loss-scale", "F", "dynamic loss scale floor (default 1)",
       [](C& c, S v) { c.precision.min_loss_scale = parse_float("--min-loss-scale", v); }},
      {"--loss-scale-window", "N", "clean iterations before the dynamic scale doubles (default 1000)",
       [](C& c, S v) { c.precision.loss_scale_window = parse_int("--loss-scale-window", v); }},
      {"--hysteresis", "N", "overflows tolerated before the dynamic scale halves (default 2)",
       [](C& c, S v) { c.precision.hysteresis = parse_int("--hysteresis", v); }},
      {"--attention-softmax-in-fp32", "", "softmax in FP32 (always the case in Loom's fused attention)",
       [](C& c, S) {
         c.precision.attention_softmax_in_fp32 = true;
         c.kernel_choice_flags.push_back("--attention-softmax-in-fp32");  // logged with the kernel choices
       }},
      {"--accumulate-allreduce-grads-in-fp32", "", "FP32 main grads with --fp16 (always on with --bf16)",
       [](C& c, S) { c.precision.accumulate_allreduce_grads_in_fp32 = true; }},
      {"--fp8-format", "S", "FP8 GEMMs in every linear layer: e4m3 | hybrid (E5M2 gradients); needs --bf16/--fp16",
       [](C& c, S v) { c.precision.fp8_format = v; }},
      {"--fp8-margin", "N", "FP8 scale = (fp8_max / amax) / 2^margin (default 0)",
       [](C& c, S v) { c.precision.fp8_margin = int(parse_int("--fp8-margin", v)); }},
      {"--fp8-amax-history-len", "N", "steps of amax history per FP8 tensor (default 1)",
       [](C& c, S v) { c.precision.fp8_amax_history_len = int(parse_positive_flag("--fp8-amax-history-len", v, std::numeric_limits<int>::max())); }},
      {"--fp8-amax-compute-algo", "S", "max | most_recent: the amax the FP8 scale follows (default most_recent)",
       [](C& c, S v) { c.precision.fp8_amax_compute_algo = v; }},
      {"--fp8-wgrad", "", "weight gradients from FP8 operands (the default)",
       [](C& c, S) { c.precision.fp8_wgrad = true; }},
      {"--no-fp8-wgrad", "", "weight gradients in the compute dtype instead of FP8",
       [](C& c, S) { c.precision.fp8_wgrad = false; }},
      // recomputation and dropout
      {"--recompute-granularity", "S", "full | selective activation recomputation",
       [](C& c, S v) { c.recompute.granularity = v; }},
      {"--recompute-method", "S", "uniform | block (with --recompute-granularity full)",
       [](C& c, S v) { c.recompute.method = v; }},
      {"--recompute-num-layers", "N", "uniform: layers per recomputed group; block: layers recomputed",
       [](C& c, S v) { c.recompute.num_layers = parse_int("--recompute-num-layers", v); }},
      {"--recompute-activations", "", "same as --recompute-granularity selective",
       [](C& c, S) { c.recompute.granularity = "selective"; }},
      {"--checkpoint-activations", "", "legacy: --recompute-granularity full --recompute-method uniform",
       [](C& c, S) {
         c.recompute.granularity = "full";
         c.recompute.method = "uniform";
         if (!c.recompute.num_layers) c.recompute.num_layers = 1;
       }},
      {"--activations-checkpoint-method", "S", "legacy spelling of --recompute-method",
       [](C& c, S v) { c.recompute.method = v; }},
      {"--checkpoint-num-layers", "N", "legacy spelling of --recompute-num-layers",
       [](C& c, S v) { c.recompute.num_layers = parse_int("--checkpoint-num-layers", v); }},
      {"--hidden-dropout", "P", "dropout on embeddings and before residual adds (default 0.1)",
       [](C& c, S v) { c.recompute.hidden_dropout = float(parse_float("--hidden-dropout", v)); }},
      {"--attention-dropout", "P", "dropout on attention probabilities (default 0.1)",
       [](C& c, S v) { c.recompute.attention_dropout = float(parse_float("--attention-dropout", v)); }},
      // evaluation
      {"--eval-interval", "N", "iterations between validation evaluations (default 1000)",
       [](C& c, S v) { c.eval.eval_interval = parse_int("--eval-interval", v); }},
      {"--eval-iters", "N", "batches per evaluation, 0 disables evaluation (default 100)",
       [](C& c, S v) { c.eval.eval_iters = parse_int("--eval-iters", v); }},
      {"--valid-data-path", "PREFIX...", "validation datasets (with --train-data-path)",
       [](C& c, S v) { c.eval.valid_data_path.push_back(v); }},
      {"--test-data-path", "PREFIX...", "test datasets (with --train-data-path)",
       [](C& c, S v) { c.eval.test_data_path.push_back(v); }},
      // checkpoints
      {"--save", "DIR", "checkpoint directory to save to", [](C& c, S v) { c.checkpoint.save = v; }},
      {"--load", "DIR", "checkpoint directory to resume from (its latest_checkpointed_iteration.txt)",
       [](C& c, S v) { c.checkpoint.load = v; }},
      {"--ckpt-step", "N", "load the checkpoint of iteration N from --load instead of the one its tracker names",
       [](C& c, S v) { c.checkpoint.ckpt_step = parse_int("--ckpt-step", v); }},
      {"--save-interval", "N", "iterations between checkpoints (the end of training always saves)",
       [](C& c, S v) { c.checkpoint.save_interval = parse_int("--save-interval", v); }},
      {"--no-save-optim", "", "do not save the optimizer state", [](C& c, S) { c.checkpoint.no_save_optim = true; }},
      {"--no-save-rng", "", "do not save the RNG state", [](C& c, S) { c.checkpoint.no_save_rng = true; }},
      {"--no-load-optim", "", "do not load the optimizer state", [](C& c, S) { c.checkpoint.no_load_optim = true; }},
      {"--no-load-rng", "", "do not load the RNG state", [](C& c, S) { c.checkpoint.no_load_rng = true; }},
      {"--finetune", "", "load weights only and start at iteration 0 (no optimizer, scheduler or RNG state)",
       [](C& c, S) { c.checkpoint.finetune = true; }},
      {"--pretrained-checkpoint", "DIR", "the model to fine-tune (Loom or Hugging Face directory) when --load holds no "
       "checkpoint; with LoRA the frozen base", [](C& c, S v) { c.checkpoint.pretrained_checkpoint = v; }},
      // LoRA
      {"--lora-rank", "R", "LoRA fine-tuning: adapters of rank R on --lora-target-modules, the base frozen",
       [](C& c, S v) { c.lora.rank = parse_int("--lora-rank", v); }},
      {"--lora-alpha", "A", "LoRA scale numerator: updates are scaled by A / rank (default 32)",
       [](C& c, S v) {
         c.lora.alpha = float(parse_float("--lora-alpha", v));
         c.lora.alpha_given = true;
       }},
      {"--lora-dropout", "P", "dropout on each LoRA adapter's input (default 0)",
       [](C& c, S v) {
         c.lora.dropout = float(parse_float("--lora-dropout", v));
         c.lora.dropout_given = true;
       }},
      {"--lora-target-modules", "NAME...", "linears to adapt: linear_qkv linear_proj linear_fc1 linear_fc2 (default all "
       "four), PEFT's q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, NeMo's attention mlp all; commas work too",
       [](C& c, S v) {
         for (size_t b = 0; b <= v.size();) {
           const size_t e = std::min(v.find(',', b), v.size());
           if (e > b) c.lora.target_modules.push_back(v.substr(b, e - b));
           b = e + 1;
         }
       }},
      // exit conditions
      {"--exit-interval", "N", "stop (after saving) when the iteration is a multiple of N",
       [](C& c, S v) { c.exit.exit_interval = parse_int("--exit-interval", v); }},
      {"--exit-duration-in-mins", "M", "stop (after saving) once the run has lasted M minutes",
       [](C& c, S v) { c.exit.exit_duration_in_mins = parse_float("--exit-duration-in-mins", v); }},
      {"--exit-signal-handler", "", "on SIGTERM/SIGINT finish the iteration, save and exit 0",
       [](C& c, S) { c.exit.exit_signal_handler = true; }},
      {"--no-check-for-nan-in-loss-and-grad", "",
       "skip (and count) steps with a non-finite loss or gradient norm instead of stopping with an error",
       [](C& c, S) { c.exit.check_for_nan_in_loss_and_grad = false; }},
      // data
      {"--mock-data", "", "train on random tokens (needs --vocab-size)", [](C& c, S) { c.data.mock_data = true; }},
      {"--data-path", "PREFIX...", "indexed datasets: PREFIX, or W1 PREFIX1 W2 PREFIX2 ... (split by --split)",
       [](C& c, S v) { c.data.data_path.push_back(v); }},
      {"--train-data-path", "PREFIX...", "like --data-path, all used for training (no split)",
       [](C& c, S v) { c.data.train_data_path.push_back(v); }},
      {"--split", "W,W,W", "train,valid,test weights of the documents (default 969, 30, 1)",
       [](C& c, S v) { c.data.split = v; }},
      {"--data-cache-path", "DIR", "where dataset index caches go (default <prefix>/cache/GPTDataset_indices, under the --data-path prefix)",
       [](C& c, S v) { c.data.data_cache_path = v; }},
      // the tokenizer flags come from tokenizer_flag_specs(), spliced in after --data-cache-path by specs()
      {"--reset-position-ids", "", "restart position ids after each end-of-document token",
       [](C& c, S) { c.data.reset_position_ids = true; }},
      {"--reset-attention-mask", "", "documents in one sequence do not attend to each other",
       [](C& c, S) { c.data.reset_attention_mask = true; }},
      {"--sft", "", "supervised fine-tuning: --data-path is `loom preprocess --sft` output (answer-only loss, "
       "packed samples)",
       [](C& c, S) { c.data.sft = true; }},
      {"--sft-packing", "", "--sft: pack samples into sequences, first-fit decreasing (the default)",
       [](C& c, S) { c.data.sft_packing = true; }},
      {"--no-sft-packing", "", "--sft: one sample per sequence, padded", [](C& c, S) { c.data.sft_packing = false; }},
      {"--sft-overlong", "truncate|skip|error", "--sft: a sample longer than --seq-length + 1 tokens (default truncate; "
       "counted in the log)",
       [](C& c, S v) {
         parse_sft_overlong(v);
         c.data.sft_overlong = v;
       }},
      {"--eod-mask-loss", "", "no loss on end-of-document tokens", [](C& c, S) { c.data.eod_mask_loss = true; }},
      // parallelism (docs/parallelism.md)
      {"--tensor-model-parallel-size", "N", "default 1",
       [](C& c, S v) { c.parallel.tensor_model_parallel_size = int(parse_positive_flag("--tensor-model-parallel-size", v, std::numeric_limits<int>::max())); }},
      {"--pipeline-model-parallel-size", "N", "default 1",
       [](C& c, S v) {
         c.parallel.pipeline_model_parallel_size = int(parse_positive_flag("--pipeline-model-parallel-size", v, std::numeric_limits<int>::max()));
       }},
      {"--context-parallel-size", "N", "default 1",
       [](C& c, S v) { c.parallel.context_parallel_size = int(parse_positive_flag("--context-parallel-size", v, std::numeric_limits<int>::max())); }},
      {"--expert-model-parallel-size", "N", "default 1; split the experts of mixture-of-experts layers over N "
       "ranks (needs --num-experts)",
       [](C& c, S v) {
         c.parallel.expert_model_parallel_size = int(parse_positive_flag("--expert-model-parallel-size", v, std::numeric_limits<int>::max()));
       }},
      {"--expert-tensor-parallel-size", "N", "default: the tensor-model-parallel size; split each expert's FFN over N "
       "ranks (the world must divide by N x EP x PP; needs --num-experts)",
       [](C& c, S v) {
         c.parallel.expert_tensor_parallel_size = int(parse_positive_flag("--expert-tensor-parallel-size", v, std::numeric_limits<int>::max()));
         if (c.parallel.expert_tensor_parallel_size < 1)
           user_error("--expert-tensor-parallel-size must be >= 1, got ", v);
       }},
      {"--sequence-parallel", "", "split norms/dropout along the sequence across the TP group",
       [](C& c, S) { c.dist.sequence_parallel = true; }},
      {"--num-layers-per-virtual-pipeline-stage", "N", "interleaved 1F1B: layers per model chunk",
       [](C& c, S v) { c.dist.virtual_stage_layers = parse_positive_flag("--num-layers-per-virtual-pipeline-stage", v); }},
      {"--decoder-first-pipeline-num-layers", "N", "layers of the first pipeline stage (uneven split)",
       [](C& c, S v) { c.dist.first_stage_layers = parse_int("--decoder-first-pipeline-num-layers", v); }},
      {"--decoder-last-pipeline-num-layers", "N", "layers of the last pipeline stage (uneven split)",
       [](C& c, S v) { c.dist.last_stage_layers = parse_int("--decoder-last-pipeline-num-layers", v); }},
      {"--use-distributed-optimizer", "", "ZeRO-1: shard FP32 masters and Adam state over data-parallel ranks",
       [](C& c, S) { c.dist.use_distributed_optimizer = true; }},
      {"--data-parallel-sharding-strategy", "no_shard|optim|optim_grads|optim_grads_params",
       "ZeRO stage 0/1/2/3 (default no_shard, or optim with --use-distributed-optimizer)",
       [](C& c, S v) { c.dist.sharding_strategy = v; }},
      {"--ddp-bucket-size", "N", "elements per gradient-reduction bucket (default max(40M, 1M x DP))",
       [](C& c, S v) { c.dist.ddp_bucket_size = parse_int("--ddp-bucket-size", v); }},
      {"--overlap-grad-reduce", "", "reduce gradient buckets during backward",
       [](C& c, S) { c.dist.overlap_grad_reduce = true; }},
      {"--overlap-param-gather", "",
       "all-gather updated parameters bucket by bucket behind the next forward (ZeRO-1/2), prefetch the next "
       "unit's parameters (ZeRO-3)",
       [](C& c, S) { c.dist.overlap_param_gather = true; }},
      {"--distributed-backend", "nccl|gloo|mpi", "collectives: NCCL for GPU ranks; CPU ranks use MPI (gloo = CPU)",
       [](C& c, S v) {
         if (v != "nccl" && v != "gloo" && v != "mpi")
           user_error("--distributed-backend ", v, ": choose nccl (GPU ranks), gloo or mpi (CPU ranks; Loom serves "
                      "both with MPI)");
         c.dist.backend = v;
       }},
      {"--local-rank", "N", "(also --local_rank) set by Python launchers; checked against mpirun/srun's local rank",
       [](C& c, S v) { c.dist.local_rank = parse_int("--local-rank", v); }},
      {"--distributed-timeout-minutes", "X", "abort every rank when a collective takes longer (default 10)",
       [](C& c, S v) { c.dist.timeout_minutes = parse_float("--distributed-timeout-minutes", v); }},
      // device and profiling
      {"--data-impl", "mmap", "Megatron's indexed-dataset reader: mmap, the only one (Loom memory-maps .bin/.idx)",
       [](C&, S v) {
         if (v != "mmap")
           user_error("--data-impl ", v, ": Loom reads Megatron's .bin/.idx datasets by memory map only; use "
                      "--data-impl mmap (lazy, cached and infer are Megatron's older readers)");
       }},
      {"--transformer-impl", "local|transformer_engine", "a Megatron kernel choice; Loom runs its own (logged once)",
       [](C& c, S v) {
         if (v != "local" && v != "transformer_engine")
           user_error("--transformer-impl ", v, ": Megatron's choices are local and transformer_engine");
         c.kernel_choice_flags.push_back("--transformer-impl " + v);
       }},
      {"--device", "auto|cpu|cuda", "where to compute: auto (default) = the GPU when the build has CUDA and one is "
       "visible (GPU local_rank % count), else the CPU",
       [](C& c, S v) { c.device = v; }},
      {"--profile", "", "NVTX ranges and cudaProfilerStart/Stop around --profile-step-start..end (nsys "
       "--capture-range=cudaProfilerApi); CUDA device only",
       [](C& c, S) { c.logging.profile = true; }},
      {"--profile-step-start", "N", "first profiled iteration (default 10)",
       [](C& c, S v) { c.logging.profile_step_start = parse_int("--profile-step-start", v); }},
      {"--profile-step-end", "N", "iteration where profiling stops (default 12)",
       [](C& c, S v) { c.logging.profile_step_end = parse_int("--profile-step-end", v); }},
      {"--profile-execution", "BOOL", "true: as --profile", [](C& c, S v) {
         if (parse_bool("--profile-execution", v)) c.logging.profile = true;
       }},
      {"--profile-name", "NAME", "name of the NVTX range spanning the profiled window (default loom); nsys -o names "
       "the capture file",
       [](C& c, S v) {
         if (v.empty()) user_error("--profile-name: the name must not be empty");
         c.logging.profile_name = v;
       }},
      {"--profile-ranks", "RANK...", "global ranks that profile (default 0)",
       [](C& c, S v) {
         if (!c.logging.profile_ranks_given) c.logging.profile_ranks.clear();  // the first value replaces the default
         c.logging.profile_ranks_given = true;
         c.logging.profile_ranks.push_back(int(parse_int("--profile-ranks", v)));
       }},
      // misc
      {"--seed", "N", "random seed for init and data order (default 1234)",
       [](C& c, S v) { c.seed = uint64_t(parse_int("--seed", v)); }},
      {"--log-interval", "N", "iterations between log lines (default 100)",
       [](C& c, S v) { c.logging.log_interval = parse_positive_flag("--log-interval", v); }},
      {"--timing-log-option", "max|minmax|all", "timers across ranks: the maximum, (min, max) (default) or every "
       "rank's value",
       [](C& c, S v) {
         parse_timing_log_option(v);  // validated here, used by the run's timers
         c.logging.timing_log_option = v;
       }},
      {"--timing-log-level", "0|1|2", "timers printed after each log line: 1 forward-backward and optimizer, 2 also "
       "forward-compute, backward-compute, batch-generator (default 0: none)",
       [](C& c, S v) { c.logging.timing_log_level = int(parse_int("--timing-log-level", v)); }},
      {"--tensorboard-dir", "DIR", "write TensorBoard event files here", [](C& c, S v) { c.logging.tensorboard_dir = v; }},
      {"--tensorboard-log-interval", "N", "iterations between TensorBoard points (default 1)",
       [](C& c, S v) { c.logging.tensorboard_log_interval = parse_int("--tensorboard-log-interval", v); }},
      {"--tensorboard-queue-size", "N", "TensorBoard events buffered before they are written out (default 1000; "
       "every log line also writes them)",
       [](C& c, S v) {
         c.logging.tensorboard_queue_size = parse_int("--tensorboard-queue-size", v);
         if (c.logging.tensorboard_queue_size < 1) user_error("--tensorboard-queue-size must be >= 1, got ", v);
       }},
      {"--log-num-zeros-in-grad", "", "add the number of zeros in the gradients to the log line and TensorBoard",
       [](C& c, S) { c.logging.log_num_zeros_in_grad = true; }},
      {"--log-world-size-to-tensorboard", "", "the world size to TensorBoard",
       [](C& c, S) { c.logging.log_world_size_to_tensorboard = true; }},
      {"--log-loss-scale-to-tensorboard", "", "the loss scale to TensorBoard (the default)",
       [](C& c, S) { c.logging.log_loss_scale_to_tensorboard = true; }},
      {"--wandb-project", "NAME", "Weights & Biases project: Loom has no W&B client and warns once (metrics go to "
       "--tensorboard-dir and --metrics-jsonl)",
       [](C& c, S v) { c.logging.wandb_project = v; }},
      {"--wandb-exp-name", "NAME", "Weights & Biases run name (see --wandb-project)",
       [](C& c, S v) { c.logging.wandb_exp_name = v; }},
      {"--log-timers-to-tensorboard", "", "timers and throughput to TensorBoard",
       [](C& c, S) { c.logging.log_timers_to_tensorboard = true; }},
      {"--log-memory-to-tensorboard", "", "allocator figures to TensorBoard",
       [](C& c, S) { c.logging.log_memory_to_tensorboard = true; }},
      {"--log-validation-ppl-to-tensorboard", "", "validation perplexity to TensorBoard",
       [](C& c, S) { c.logging.log_validation_ppl_to_tensorboard = true; }},
      {"--no-log-learning-rate-to-tensorboard", "", "leave the learning rate out of TensorBoard", [](C& c, S) { c.logging.log_learning_rate_to_tensorboard = false; }},
      {"--no-log-loss-scale-to-tensorboard", "", "leave the loss scale out of TensorBoard", [](C& c, S) { c.logging.log_loss_scale_to_tensorboard = false; }},
      {"--log-batch-size-to-tensorboard", "", "global batch size to TensorBoard", [](C& c, S) { c.logging.log_batch_size_to_tensorboard = true; }},
      {"--log-params-norm", "", "add the parameter norm to the log line", [](C& c, S) { c.logging.log_params_norm = true; }},
      {"--log-throughput", "", "add Megatron's throughput per GPU (TFLOP/s/GPU) to the log line",
       [](C& c, S) { c.logging.log_throughput = true; }},
      {"--metrics-jsonl", "FILE", "also write every log line's figures as one JSON object per line",
       [](C& c, S v) { c.logging.metrics_jsonl = v; }},
      // MLPerf Training (docs/training.md)
      {"--mlperf-log", "FILE", "MLPerf Training :::MLLOG lines of the run (llama2_70b_lora keys), from rank 0",
       [](C& c, S v) { c.mlperf.log = v; }},
      {"--mlperf-submission-division", "closed|open", "the log's submission_division (default closed)",
       [](C& c, S v) { c.mlperf.division = v; }},
      {"--mlperf-submission-status", "S", "the log's submission_status: onprem | cloud | preview | research "
       "(default onprem)",
       [](C& c, S v) { c.mlperf.status = v; }},
      {"--mlperf-submission-org", "NAME", "the log's submission_org (default Loom)", [](C& c, S v) { c.mlperf.org = v; }},
      {"--mlperf-submission-platform", "NAME", "the log's submission_platform (default <ranks>x<device>)",
       [](C& c, S v) { c.mlperf.platform = v; }},
      {"--target-eval-loss", "X", "stop at the first evaluation whose MLPerf metric (mean per-sequence validation "
       "loss) is <= X (llama2_70b_lora: 0.925)",
       [](C& c, S v) { c.eval.target_eval_loss = parse_float("--target-eval-loss", v); }},
      {"--log-optimizer-states-to-tensorboard", "", "Megatron-DeepSpeed: L2 / L1 / max-abs of the Adam moments and the "
       "weights to TensorBoard (optimizer/...)",
       [](C& c, S) { c.logging.log_optimizer_states_to_tensorboard = true; }},
      {"--num-workers", "N", "PyTorch data-loader processes: Loom reads the memory-mapped data in the training "
       "process (same batches; logged)",
       [](C& c, S v) {
         c.num_workers = parse_int("--num-workers", v);
         if (*c.num_workers < 0) user_error("--num-workers must be >= 0, got ", v);
       }},
      {"--no-pipeline-parallel", "", "Megatron-DeepSpeed's non-pipeline model: needs --pipeline-model-parallel-size 1",
       [](C& c, S) { c.no_pipeline_parallel = true; }},
      // Megatron-DeepSpeed (docs/migrating.md)
      {"--deepspeed", "", "Megatron-DeepSpeed's switch: take --deepspeed_config FILE (ZeRO stage, batch, precision, "
       "optimizer, scheduler)",
       [](C& c, S) { c.deepspeed.enabled = true; }},
      {"--deepspeed-config", "FILE", "(also --deepspeed_config) DeepSpeed's ds_config.json, with --deepspeed",
       [](C& c, S v) { c.deepspeed.config_path = v; }},
      {"--zero-stage", "N", "ZeRO stage 0-3 when ds_config has no zero_optimization.stage (with --deepspeed)",
       [](C& c, S v) { c.deepspeed.zero_stage = int(parse_int("--zero-stage", v)); }},
      {"--deepspeed-activation-checkpointing", "", "DeepSpeed's recompute engine for --checkpoint-activations: "
       "the same full recomputation",
       [](C& c, S) { c.deepspeed.activation_checkpointing = true; }},
      {"--partition-activations", "", "DeepSpeed's placement of checkpointed activations (results unchanged; logged)",
       [](C& c, S) { c.deepspeed.partition_activations = true; }},
      {"--contigious-checkpointing", "", "DeepSpeed's buffer for checkpointed activations (results unchanged; logged)",
       [](C& c, S) { c.deepspeed.contiguous_checkpointing = true; }},
      {"--checkpoint-in-cpu", "", "not supported: Loom keeps checkpointed activations in device memory",
       [](C&, S) {
         user_error("--checkpoint-in-cpu: Loom cannot move checkpointed activations to host memory; drop the flag "
                    "(recomputation with --checkpoint-activations keeps one layer input per layer on the device)");
       }},
  };
  // Megatron switches whose only effect there is the choice of kernels: recorded, logged once by the run.
  for (const char* name : {"--use-flash-attn", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                           "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                           "--use-mcore-models", "--no-async-tensor-model-parallel-allreduce"})
    t.push_back({name, "", "a Megatron kernel choice; Loom always runs its fused kernels (logged once)",
                 [name](C& c, S) { c.kernel_choice_flags.push_back(name); }});
  return t;
  }();
  return table;
}

}  // namespace

namespace {

// The table above, as specs for the shared parser: the metavar decides the arity.
std::vector<FlagSpec<TrainConfig>> specs() {
  std::vector<FlagSpec<TrainConfig>> out;
  for (const Flag& f : flags()) {
    const bool multi = f.metavar.ends_with("...");
    const Arity arity = f.metavar.empty() ? Arity::kSwitch : multi ? Arity::kOneOrMore : Arity::kOne;
    std::string metavar = f.metavar;
    if (multi) metavar = metavar.substr(0, metavar.size() - 3) + " [...]";
    out.push_back({{f.name, arity, metavar, f.help}, [set = f.set](TrainConfig& c, const std::vector<std::string>& v) {
                     if (v.empty()) set(c, "");
                     for (const std::string& x : v) set(c, x);
                   }});
    if (f.name == "--eod-mask-loss")  // the mixture-of-experts flags (args_moe.cpp)
      for (auto& m : moe_flag_specs()) out.push_back(std::move(m));
    if (f.name == "--data-cache-path")  // the tokenizer flags, shared with generate and preprocess
      for (auto& t : tokenizer_flag_specs<TrainConfig>([](TrainConfig& c) -> TokenizerConfig& { return c.data.tokenizer; }))
        out.push_back(std::move(t));
  }
  LOOM_CHECK(out.size() > flags().size(), "the tokenizer flags were not spliced into the train flag table");
  return out;
}

// Megatron flags for features this build does not have yet: a clear error instead of "unknown flag".
const std::vector<std::string>& unsupported() {
  static const std::vector<std::string> names = {
      // CUDA graphs of the steady-state step are not built yet (docs/performance.md)
      "--cuda-graph", "--enable-cuda-graph", "--external-cuda-graph", "--use-pytorch-profiler",
      // architecture variants Loom does not build
      "--rotary-seq-len-interpolation-factor", "--no-rope-freq", "--window-attn-skip-freq", "--apply-layernorm-1p",
      "--squared-relu", "--quick-geglu", "--glu-linear-offset", "--no-position-embedding",
      // MoE options not built: the router's own GEMM dtype (Loom's gate GEMM reads the compute dtype and
      // writes f32 logits; routing runs in f64), DeepSeek's group-limited routing, the flex dispatcher's
      // backends, Megatron-Core's MoE upcycling
      "--moe-router-dtype", "--moe-router-num-groups", "--moe-router-group-topk", "--moe-enable-deepep",
      "--moe-use-upcycling"};
  return names;
}

}  // namespace

TrainConfig parse_train_args(const std::vector<std::string>& args) {
  TrainConfig cfg;
  // Megatron has no defaults for the model's shape: these must come from the command line.
  cfg.model.num_layers = cfg.model.hidden_size = cfg.model.num_attention_heads = 0;
  // The flags named on the command line, by their table names (after argparse's "_" == "-" and prefix
  // rules): ds_config.json values yield to some of them (DeepSpeed's rules).
  const std::vector<std::string> named = apply_flags(specs(), args, cfg, unsupported(), "Megatron's pretrain_gpt.py");
  const std::set<std::string> given(named.begin(), named.end());
  if (!cfg.max_position_embeddings_given) cfg.model.max_position_embeddings = cfg.batch.seq_length;
  // Megatron reads --num-query-groups only with --group-query-attention; alone it would silently build
  // multi-head attention, which is never what was meant.
  if (!cfg.model.group_query_attention)
    for (const std::string& a : args)
      if (a == "--num-query-groups" || a.starts_with("--num-query-groups="))
        user_error("--num-query-groups needs --group-query-attention (without it every head has its own keys "
                   "and values)");
  cfg.data.tokenizer.vocab_size = cfg.data.vocab_size;  // NullTokenizer's and TikTokenizer's --vocab-size
  resolve_moe_flags(cfg);
  check_sample_based_flags(cfg, given);
  apply_deepspeed_config(cfg, given);
  return cfg;
}

std::string train_help() {
  return specs_help("usage: loom train [--config FILE.yaml] [flags]   (Megatron-LM flag names)\n"
                    "  --config FILE.yaml                       flags from a YAML file (keys are flag names, e.g.\n"
                    "                                           configs/llama3-8b.yaml); command-line flags override it",
                    specs());
}

}  // namespace loom
