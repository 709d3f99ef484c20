// `loom calc` arithmetic (see loom/train/calc.h and docs/calc.md for the formulas): the GPU table, the
// validation of the flags into a CalcInput, and compute_calc's model, memory and time figures, LoRA's
// and MoE's included (the adapters' shapes and FLOPs per token are calc_lora.cpp's, the expert layout and
// MoE buffers calc_moe.cpp's); the printed report is calc_report.cpp's.
// Counts that are exact integers (parameters, model-state bytes) are int64; the paper's activation and
// FLOP formulas divide by TP and are kept in double.
#include "loom/train/calc.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <memory>

#include "loom/core/check.h"
#include "loom/data/tokenizer.h"
#include "train/calc_impl.h"

namespace loom {

using calc_detail::is_16bit;
using calc_detail::is_gpt2_architecture;
using calc_detail::lora_layer_adapters;

const std::vector<GpuSpec>& gpu_specs() {
  // Datasheet figures are quoted "with sparsity"; these are the dense halves (docs/calc.md cites them).
  static const std::vector<GpuSpec> specs = {
      {"A100", "A100 SXM", 156, 312, std::nullopt},
      {"H100", "H100 SXM", 495, 989, 1979},
      {"H200", "H200 SXM", 495, 989, 1979},
      {"B200", "B200 (HGX)", 1100, 2250, 4500},
  };
  return specs;
}

const GpuSpec& find_gpu(const std::string& name) {
  std::string want = name;
  for (char& ch : want) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  std::string valid;
  for (const GpuSpec& g : gpu_specs()) {
    if (g.name == want) return g;
    valid += (valid.empty() ? "" : ", ") + g.name;
  }
  user_error("--gpu: unknown GPU '", name, "' (valid: ", valid, "; or give --gpu-tflops X)");
}

double parse_token_count(const std::string& flag, const std::string& v) {
  std::string num = v;
  double mult = 1;
  if (!num.empty()) {
    switch (num.back()) {
      case 'k': case 'K': mult = 1e3; break;
      case 'm': case 'M': mult = 1e6; break;
      case 'b': case 'B': case 'g': case 'G': mult = 1e9; break;
      case 't': case 'T': mult = 1e12; break;
      default: break;
    }
    if (mult != 1) num.pop_back();
  }
  double x = 0;
  size_t pos = 0;
  bool ok = !num.empty() && (std::isdigit(static_cast<unsigned char>(num[0])) || num[0] == '.');
  if (ok) {
    try {
      x = std::stod(num, &pos);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  if (!ok || pos != num.size() || !std::isfinite(x * mult) || x * mult < 1)
    user_error(flag, ": expected a token count >= 1 such as 300e9, 300B or 1.5T, got '", v, "'");
  return x * mult;
}

CalcInput make_calc_input(const TrainConfig& cfg, const CalcOptions& opts) {
  CalcInput in;
  const auto need = [](bool ok, const char* flag) {
    if (!ok) user_error("missing required flag ", flag);
  };
  need(cfg.model.num_layers > 0, "--num-layers");
  need(cfg.model.hidden_size > 0, "--hidden-size");
  need(cfg.model.num_attention_heads > 0, "--num-attention-heads");
  need(cfg.batch.seq_length > 0, "--seq-length");
  in.model = cfg.model;
  in.seq_length = cfg.batch.seq_length;
  if (in.model.max_position_embeddings < in.seq_length)
    user_error("--max-position-embeddings (", in.model.max_position_embeddings, ") must be >= --seq-length (",
               in.seq_length, ")");

  // Parallel layout.
  in.parallel = cfg.parallel;
  const int t = in.parallel.tensor_model_parallel_size, p = in.parallel.pipeline_model_parallel_size,
            c = in.parallel.context_parallel_size;
  if (t < 1) user_error("--tensor-model-parallel-size must be >= 1, got ", t);
  if (p < 1) user_error("--pipeline-model-parallel-size must be >= 1, got ", p);
  if (c < 1) user_error("--context-parallel-size must be >= 1, got ", c);
  if (in.model.num_attention_heads % t != 0)
    user_error("--num-attention-heads (", in.model.num_attention_heads,
               ") must be divisible by --tensor-model-parallel-size (", t, ")");
  if (in.model.group_query_attention && in.model.num_query_groups % t != 0)
    user_error("--num-query-groups (", in.model.num_query_groups,
               ") must be divisible by --tensor-model-parallel-size (", t, ")");
  if (in.model.num_layers % p != 0)
    user_error("--num-layers (", in.model.num_layers, ") must be divisible by --pipeline-model-parallel-size (",
               p, ")");
  if (in.seq_length % c != 0)
    user_error("--seq-length (", in.seq_length, ") must be divisible by --context-parallel-size (", c, ")");
  validate_tensor_parallel(in.model, t, false);  // and --ffn-hidden-size, as the model checks it
  const int64_t model_parallel = int64_t(t) * p * c;
  in.num_gpus = opts.num_gpus.value_or(model_parallel);
  if (in.num_gpus < 1 || in.num_gpus % model_parallel != 0)
    user_error("--num-gpus (", in.num_gpus, ") must be a positive multiple of TP x PP x CP = ", model_parallel);
  // Data-parallel sharding, resolved as the trainer resolves it (same function, same errors).
  in.sharding = resolve_sharding(cfg.dist.use_distributed_optimizer, cfg.dist.sharding_strategy);
  if (cfg.dist.ddp_bucket_size < 0) user_error("--ddp-bucket-size must be >= 1, got ", cfg.dist.ddp_bucket_size);
  in.ddp_bucket_size = cfg.dist.ddp_bucket_size;
  if (in.sharding != ShardingStrategy::kNone && in.zero_group_size() == 1)
    in.notes.push_back("ZeRO shards over 1 rank: no saving (DP x CP = 1; --num-gpus sets DP)");
  // Calc's own --sequence-parallel, or the training configuration's (a --config file's sequence_parallel).
  in.sequence_parallel = opts.sequence_parallel || cfg.dist.sequence_parallel;
  if (in.sequence_parallel && t == 1)
    in.notes.push_back("--sequence-parallel has no effect with --tensor-model-parallel-size 1");

  // Batch.
  if (cfg.batch.micro_batch_size < 0)
    user_error("--micro-batch-size must be >= 1, got ", cfg.batch.micro_batch_size);
  in.micro_batch_size = cfg.batch.micro_batch_size;
  if (in.micro_batch_size == 0) {
    in.micro_batch_size = 1;
    in.notes.push_back("--micro-batch-size not given: 1 assumed");
  }
  const int64_t dp = in.data_parallel_size(), unit = in.micro_batch_size * dp;
  in.global_batch_size = cfg.batch.global_batch_size.value_or(unit);
  if (in.global_batch_size < 1 || in.global_batch_size % unit != 0)
    user_error("--global-batch-size (", in.global_batch_size, ") must be a positive multiple of --micro-batch-size (",
               in.micro_batch_size, ") x data-parallel size (", dp, ") = ", unit);

  // Precision, recomputation and LoRA: the same rules as `loom train`.
  cfg.lora.validate();
  in.precision = cfg.precision;
  if (cfg.optim.optimizer == OptimizerKind::kSGD) {
    in.optimizer_state_bytes = cfg.optim.sgd_momentum != 0.0f ? 4 : 0;
    in.optimizer_state_what = cfg.optim.sgd_momentum != 0.0f ? "SGD momentum buffer" : "no SGD state (momentum 0)";
  }
  if (in.precision.bf16 && in.precision.fp16) user_error("--bf16 and --fp16 are mutually exclusive");
  if (in.precision.fp8_recipe())  // validates the --fp8-* flags as `loom train` does
    in.notes.push_back("--fp8-format: throughput uses the GPU's dense FP8 peak; memory excludes the FP8 weight "
                       "caches (2 B per linear-layer parameter: the FP8 weight and its transpose)");
  in.recompute = cfg.recompute;
  const std::string& g = in.recompute.granularity;
  if (!g.empty() && g != "full" && g != "selective")
    user_error("--recompute-granularity must be full or selective, got '", g, "'");
  if (!in.recompute.method.empty() && in.recompute.method != "uniform" && in.recompute.method != "block")
    user_error("--recompute-method must be uniform or block, got '", in.recompute.method, "'");
  if (g == "full") {
    if (in.recompute.method.empty())
      user_error("--recompute-granularity full needs --recompute-method uniform or block");
    if (!in.recompute.num_layers)
      user_error("--recompute-granularity full needs --recompute-num-layers (1 to --num-layers)");
  } else if (!in.recompute.method.empty() || in.recompute.num_layers) {
    user_error("--recompute-method and --recompute-num-layers go with --recompute-granularity full");
  }
  if (in.recompute.num_layers && (*in.recompute.num_layers < 1 || *in.recompute.num_layers > in.model.num_layers))
    user_error("--recompute-num-layers must be in [1, --num-layers (", in.model.num_layers, ")], got ",
               *in.recompute.num_layers);

  // Vocabulary, resolved as `loom train` does (the tokenizer wins), padded for the TP size.
  if (cfg.data.make_vocab_size_divisible_by < 1)
    user_error("--make-vocab-size-divisible-by must be >= 1, got ", cfg.data.make_vocab_size_divisible_by);
  if (!cfg.data.tokenizer.type.empty()) {
    const std::unique_ptr<Tokenizer> tok = make_tokenizer(cfg.data.tokenizer);
    in.model.vocab_size = tok->vocab_size();
    in.notes.push_back("vocabulary " + std::to_string(in.model.vocab_size) + " from " + tok->name());
  } else if (cfg.data.vocab_size) {
    if (*cfg.data.vocab_size < 1) user_error("--vocab-size must be >= 1, got ", *cfg.data.vocab_size);
    in.model.vocab_size = *cfg.data.vocab_size;
  } else {
    in.model.vocab_size = 50257;
    in.notes.push_back("no --vocab-size or --tokenizer-type: GPT-2's vocabulary of 50257 assumed");
  }
  in.model.padded_vocab_size = padded_vocab_size(in.model.vocab_size, cfg.data.make_vocab_size_divisible_by, t);
  in.model.validate();
  calc_detail::validate_moe_calc(in, cfg);
  if (cfg.lora.enabled()) {
    in.lora = LoraOptions{{cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout},
                          parse_lora_targets(cfg.lora.targets_or_default(), in.model)};
    lora_layer_adapters(in.model, *in.lora);  // the rank against every adapter's shape
    if (cfg.lora.target_modules.empty())
      in.notes.push_back("no --lora-target-modules: the trainer's default linear_qkv linear_proj linear_fc1 linear_fc2");
  }
  if (!is_gpt2_architecture(in.model))
    in.notes.push_back("the paper's formulas below (parameters, FLOPs, activation rows) describe GPT-2's layer; the "
                       "exact counts, this run's FLOPs and Loom's buffers use this architecture");

  // Length of training and throughput.
  if (opts.train_tokens && cfg.batch.train_iters > 0)
    user_error("--train-tokens and --train-iters both say how long to train: give one");
  if (opts.train_tokens) {
    in.train_tokens = *opts.train_tokens;
  } else if (cfg.batch.train_iters > 0) {
    in.train_tokens = double(cfg.batch.train_iters) * double(in.global_batch_size) * double(in.seq_length);
  }
  if (opts.mfu && opts.gpu_tflops)
    user_error("--mfu and --gpu-tflops are two ways to give the achieved throughput: give one");
  in.gpu = find_gpu(opts.gpu.value_or("H100"));
  if (!opts.gpu && !opts.gpu_tflops) in.notes.push_back("no --gpu or --gpu-tflops: H100 assumed");
  if (opts.mfu) {
    if (!(*opts.mfu > 0 && *opts.mfu <= 1)) user_error("--mfu must be in (0, 1], got ", *opts.mfu);
    in.mfu = *opts.mfu;
  }
  if (opts.gpu_tflops && !(*opts.gpu_tflops > 0 && std::isfinite(*opts.gpu_tflops)))
    user_error("--gpu-tflops must be > 0, got ", *opts.gpu_tflops);
  in.gpu_tflops = opts.gpu_tflops;
  return in;
}

namespace {

// Per-layer activation bytes of one micro-batch (Korthikanti et al. 2022, table 2 and section 4).
struct LayerActivations {
  double none, selective, full;
};

}  // namespace

CalcReport compute_calc(const CalcInput& in) {
  CalcReport r;
  r.input = in;
  const GPTConfig& m = in.model;
  const int64_t L = m.num_layers, H = m.hidden_size;
  const double l = double(L), h = double(H), a = double(m.num_attention_heads), s = double(in.seq_length),
               V = double(m.padded_vocab_size), B = double(in.global_batch_size), b = double(in.micro_batch_size);
  const int t = in.parallel.tensor_model_parallel_size, p = in.parallel.pipeline_model_parallel_size,
            c = in.parallel.context_parallel_size;
  LOOM_CHECK(L % p == 0 && t >= 1 && c >= 1 && in.num_gpus >= 1, "[calc] input not validated");

  // Parameters. The paper writes s for the position-embedding rows; Loom's table has
  // max_position_embeddings rows (== seq length unless --max-position-embeddings says otherwise).
  r.params = m.num_parameters();
  r.params_formula =
      12.0 * l * h * h * (1.0 + 13.0 / (12.0 * h) + (V + double(m.max_position_embeddings)) / (12.0 * l * h));
  // TP splits every weight matrix and the qkv/fc1 biases; the proj/fc2 biases and the norms (qk-norms
  // included) are replicated. GPT-2: (12*h^2 + 7*h)/t + 6*h per layer.
  const int64_t L_stage = L / p;
  const int64_t QKV = m.qkv_size(), F = m.ffn_hidden_size(), F1 = (m.gated_mlp() ? 2 : 1) * F,
                HSA = m.num_attention_heads * m.head_dim(), norm = Norm::num_parameters(m.normalization, H);
  const int64_t attention_split = H * QKV + (m.qkv_bias() ? QKV : 0) + HSA * H;
  const int64_t layer_split = attention_split + H * F1 + (m.add_bias_linear ? F1 : 0) + F * H;
  const int64_t layer_replicated = 2 * norm + (m.add_bias_linear ? 2 * H : 0) +
                                   (m.qk_layernorm ? 2 * Norm::num_parameters(m.normalization, m.head_dim()) : 0);
  const int64_t layer_per_rank = layer_split / t + layer_replicated;
  // A MoE layer: the same attention and norms, then its router, shared experts and E/EP routed experts.
  calc_detail::moe_figures(in, L_stage, r);
  const int64_t moe_layer_per_rank =
      r.moe ? attention_split / t + layer_replicated + r.moe->layer_shared_per_rank + r.moe->layer_experts_per_rank : 0;
  const auto stage_layers = [&](int64_t moe_layers) {
    return (L_stage - moe_layers) * layer_per_rank + moe_layers * moe_layer_per_rank;
  };
  const int64_t moe_first = r.moe ? r.moe->layers_first_stage : 0, moe_last = r.moe ? r.moe->layers_last_stage : 0;
  const int64_t word_emb = m.padded_vocab_size * H / t, final_norm = norm;
  const int64_t pos_emb =
      m.position_embedding_type == PositionEmbeddingType::kLearnedAbsolute ? m.max_position_embeddings * H : 0;
  const int64_t output_layer = m.untie_embeddings_and_output_weights ? word_emb : 0;  // vocab-parallel too
  r.params_first_stage = stage_layers(moe_first) + word_emb + pos_emb + (p == 1 ? final_norm + output_layer : 0);
  // With PP > 1 the last stage holds the output layer: its own one when untied, else a copy of the tied
  // word embedding; the same count either way.
  r.params_last_stage = p == 1 ? r.params_first_stage : stage_layers(moe_last) + word_emb + final_norm;
  if (in.lora) {
    const int64_t rank = in.lora->config.rank;
    r.lora_adapters = lora_layer_adapters(m, *in.lora);
    int64_t layer_global = 0;
    for (const LoraAdapterShape& a : r.lora_adapters) {
      layer_global += rank * (a.in + a.out);
      r.lora_layer_params += a.params_per_rank(rank, t);
    }
    r.lora_params = L * layer_global;
    r.lora_params_stage = L_stage * r.lora_layer_params;
  }

  // FLOPs per iteration. One layer's forward (GPT-2: 24*B*s*h^2 matmuls + 4*B*s^2*h attention core).
  r.flops_model = m.flops_per_step(in.global_batch_size, in.seq_length);
  // One layer's forward (a dense model's layers are all alike; a MoE layer's differs from a dense one).
  const double layer_forward = m.layer_forward_flops(in.global_batch_size, in.seq_length);
  const auto forward_of = [&](const std::function<bool(int64_t)>& which) {  // Σ over the layers `which` picks
    double f = 0;
    int64_t n = 0;
    for (int64_t i = 0; i < L; ++i)
      if (which(i)) {
        ++n;
        if (m.is_moe()) f += m.layer_forward_flops(in.global_batch_size, in.seq_length, i);
      }
    return m.is_moe() ? f : double(n) * layer_forward;
  };
  r.flops_selective = r.flops_model + l * m.attention_core_forward_flops(in.global_batch_size, in.seq_length);
  r.flops_full = r.flops_model + forward_of([](int64_t) { return true; });
  const std::string& g = in.recompute.granularity;
  double recomputed_forward = 0;  // the forward FLOPs of the recomputed layers
  if (g == "full") {
    const int64_t n = in.recompute.num_layers.value_or(L);
    const bool block = in.recompute.method == "block";
    r.recomputed_layers = block ? std::min(n, L_stage) * p : L;
    recomputed_forward = forward_of([&](int64_t i) { return !block || i % L_stage < n; });
  }
  r.flops_run = g == "selective" ? r.flops_selective : r.flops_model + recomputed_forward;
  if (in.lora) {
    // Executed work: the base's linears (and the logits) forward once and backward once for the input
    // gradients; the attention core forward and its usual 2x backward; the adapters as counted per token.
    const double core = m.attention_core_forward_flops(in.global_batch_size, in.seq_length);
    const double linears = layer_forward - core, tokens = B * s;
    double ad_forward = 0, ad_backward = 0;
    for (const LoraAdapterShape& ad : r.lora_adapters) {
      ad_forward += ad.forward_flops_per_token(in.lora->config.rank, t);
      ad_backward += ad.backward_flops_per_token(in.lora->config.rank, t);
    }
    r.flops_adapters_forward_layer = tokens * ad_forward;
    r.flops_adapters = l * tokens * (ad_forward + ad_backward);
    r.flops_lora = l * (2.0 * linears + 3.0 * core) +
                   2.0 * m.logits_forward_flops(in.global_batch_size, in.seq_length) + r.flops_adapters;
    r.flops_selective = r.flops_lora + l * core;
    const double layer_again = layer_forward + r.flops_adapters_forward_layer;  // a recomputed layer's forward
    r.flops_full = r.flops_lora + l * layer_again;
    r.flops_run = g == "selective" ? r.flops_selective : r.flops_lora + double(r.recomputed_layers) * layer_again;
  }

  // Model states on one rank: FP32 master weights (+ the 16-bit copy the matmuls read), main grads, Adam's
  // m and v in FP32; the strategy decides which of them are split over the d ranks of the dp_cp group.
  // With more than one rank the trainer keeps FP32 main grads whatever the precision flags say.
  const int64_t d = in.zero_group_size();
  r.zero_group = d;
  const bool b16 = is_16bit(in.precision);
  const int cb = b16 ? 2 : 4, master_and_copy = 4 + (b16 ? 2 : 0);
  const int grad_size = in.num_gpus > 1 ? 4 : int(dtype_size(in.precision.grad_dtype()));
  switch (in.sharding) {
    case ShardingStrategy::kNone:
      r.weight_per_param = {master_and_copy, 0};
      r.grad_per_param = {grad_size, 0};
      r.optimizer_per_param = {in.optimizer_state_bytes, 0};
      break;
    case ShardingStrategy::kOptim:
    case ShardingStrategy::kOptimGrads:
      // Every rank runs forward/backward on the full compute-dtype weights; FP32 runs step their 1/d range
      // of those same weights in place, 16-bit runs keep a separate FP32 master shard.
      r.weight_per_param = {cb, b16 ? 4 : 0};
      r.grad_per_param = in.sharding == ShardingStrategy::kOptim ? StateBytesPerParam{4, 0} : StateBytesPerParam{0, 4};
      r.optimizer_per_param = {0, in.optimizer_state_bytes};
      break;
    case ShardingStrategy::kOptimGradsParams:
      r.weight_per_param = {0, master_and_copy};
      r.grad_per_param = {0, 4};
      r.optimizer_per_param = {0, in.optimizer_state_bytes};
      break;
  }
  // With LoRA those formulas apply to the adapters; the frozen base adds its compute copy, whole.
  const int64_t P1 = in.lora ? r.lora_params_stage : r.params_first_stage,
                Plast = in.lora ? r.lora_params_stage : r.params_last_stage;
  r.weight_bytes = r.weight_per_param.bytes(P1, d);
  r.grad_bytes = r.grad_per_param.bytes(P1, d);
  r.optimizer_bytes = r.optimizer_per_param.bytes(P1, d);
  r.last_weight_bytes = r.weight_per_param.bytes(Plast, d);
  r.last_grad_bytes = r.grad_per_param.bytes(Plast, d);
  r.last_optimizer_bytes = r.optimizer_per_param.bytes(Plast, d);
  if (in.lora) {
    r.frozen_per_param = cb;
    r.frozen_bytes = cb * r.params_first_stage;
    r.last_frozen_bytes = cb * r.params_last_stage;
  }
  r.layer_params = in.lora ? r.lora_layer_params : layer_per_rank;
  if (r.moe) {
    // The routed experts' states are sharded over the expert-data-parallel group instead of DP x CP.
    const int64_t e1 = r.moe->experts_first_stage, elast = r.moe->experts_last_stage, de = r.moe->expert_dp;
    r.weight_bytes = r.weight_per_param.bytes(P1 - e1, d) + r.weight_per_param.bytes(e1, de);
    r.grad_bytes = r.grad_per_param.bytes(P1 - e1, d) + r.grad_per_param.bytes(e1, de);
    r.optimizer_bytes = r.optimizer_per_param.bytes(P1 - e1, d) + r.optimizer_per_param.bytes(e1, de);
    r.last_weight_bytes = r.weight_per_param.bytes(Plast - elast, d) + r.weight_per_param.bytes(elast, de);
    r.last_grad_bytes = r.grad_per_param.bytes(Plast - elast, d) + r.grad_per_param.bytes(elast, de);
    r.last_optimizer_bytes = r.optimizer_per_param.bytes(Plast - elast, d) + r.optimizer_per_param.bytes(elast, de);
    r.layer_params = std::max(layer_per_rank, moe_layer_per_rank);
  }
  if (in.sharding == ShardingStrategy::kOptimGrads) {
    // The same default as the trainer's DDP buckets (Megatron's), over the dp_cp group.
    r.bucket_size = in.ddp_bucket_size > 0 ? in.ddp_bucket_size : std::max<int64_t>(40'000'000, 1'000'000 * d);
    r.transient_bytes = 4 * std::min(P1, 2 * r.bucket_size);
  } else if (in.sharding == ShardingStrategy::kOptimGradsParams) {
    r.transient_bytes = std::min<int64_t>(2, L_stage) * r.layer_params * (cb + 4);
  }

  // Activations (first stage). CP splits the sequence, so s -> s/CP throughout; the paper's numbers are
  // for 16-bit activations and double for FP32. Under 1F1B the first stage holds min(PP, micro-batches)
  // micro-batches' activations at once.
  const int64_t dp = in.data_parallel_size();
  r.micro_batches = in.global_batch_size / (in.micro_batch_size * dp);
  r.micro_batches_in_flight = std::min<int64_t>(p, r.micro_batches);
  const double sl = s / double(c), sbh = sl * b * h, tt = double(t), scale = is_16bit(in.precision) ? 1.0 : 2.0;
  const bool sp = in.sequence_parallel && t > 1;
  const double rep = sp ? tt : 1.0;  // what SP divides: the parts TP alone leaves replicated
  LayerActivations per;
  per.none = scale * (sp ? sbh / tt * (34.0 + 5.0 * a * sl / h) : sbh * (10.0 + 24.0 / tt + 5.0 * a * sl / (h * tt)));
  per.selective = scale * (sp ? 34.0 * sbh / tt : sbh * (10.0 + 24.0 / tt));
  per.full = scale * 2.0 * sbh / rep;  // only each layer's (group's) input is kept
  const double in_flight = double(r.micro_batches_in_flight);
  // Section 4.4: the embedding's dropout mask for every micro-batch in flight; with PP 1 the first stage
  // is also the last and holds the final norm and output-layer inputs (4*s*b*h) and FP32 logits (4*s*b*V/t).
  const double extra = sbh / rep * in_flight + (p == 1 ? 4.0 * sbh / rep + 4.0 * sl * b * V / tt : 0.0);
  const double Ls = double(L_stage);
  const auto row = [&](const std::string& label, const std::string& formula, double per_layer, double stage) {
    r.activations.push_back({label, formula, per_layer, stage * in_flight, extra});
  };
  // A MoE layer: the paper's layer with its MLP internals (16*s*b*h/t) replaced by the MoE buffers; the
  // per-layer column shows a MoE layer when the stage has no dense one.
  const double moe_delta = r.moe ? r.moe->layer_bytes - r.moe->dense_mlp_bytes : 0.0;
  const double moe_first_d = double(moe_first);
  const bool all_moe = moe_first == L_stage;
  const std::string moe_formula = r.moe ? " (MoE layer: - 16*s*b*h/t + its buffers, below)" : "";
  // Formulas as the paper writes them for this layout (at TP 1 all three forms agree).
  row("none",
      (t == 1 ? "s*b*h*(34 + 5*a*s/h)" : sp ? "s*b*h/t*(34 + 5*a*s/h)" : "s*b*h*(10 + 24/t + 5*a*s/(h*t))") +
          moe_formula,
      per.none + (all_moe ? moe_delta : 0.0), Ls * per.none + moe_first_d * moe_delta);
  row("selective", (t == 1 ? "34*s*b*h" : sp ? "34*s*b*h/t" : "s*b*h*(10 + 24/t)") + moe_formula,
      per.selective + (all_moe ? moe_delta : 0.0), Ls * per.selective + moe_first_d * moe_delta);
  std::string full_formula = sp ? "2*s*b*h/t" : "2*s*b*h";
  double full_stage = Ls * per.full;
  if (g == "full") {
    const int64_t n = *in.recompute.num_layers;
    if (in.recompute.method == "uniform") {
      // One checkpoint per group of n layers.
      const int64_t groups = (L_stage + n - 1) / n;
      full_stage = double(groups) * per.full;
      if (n > 1) full_formula += " per group of " + std::to_string(n) + " layers";
    } else {
      // block: the first n layers of each stage keep their input, the rest keep everything.
      const int64_t kept = std::min(n, L_stage);
      full_stage = double(kept) * per.full + double(L_stage - kept) * per.none +
                   double(calc_detail::moe_layers_in(m, kept, L_stage - kept)) * moe_delta;
      if (kept < L_stage) full_formula += " for " + std::to_string(kept) + " of " + std::to_string(L_stage) + " layers";
    }
  }
  row("full", full_formula, per.full, full_stage);
  r.run_row = g == "selective" ? 1 : g == "full" ? 2 : 0;

  // Loom's exact buffers (one process only: the model has no parallel layout yet).
  if (in.parallel.tensor_model_parallel_size == 1 && in.parallel.pipeline_model_parallel_size == 1 &&
      in.parallel.context_parallel_size == 1 && (!r.moe || r.moe->ep == 1)) {
    ModelOptions mo;
    mo.compute_dtype = in.precision.compute_dtype();
    mo.grad_dtype = in.precision.grad_dtype();
    if (!g.empty()) mo.recompute_granularity = parse_recompute_granularity(g);
    if (!in.recompute.method.empty()) mo.recompute_method = parse_recompute_method(in.recompute.method);
    mo.recompute_num_layers = in.recompute.num_layers.value_or(0);
    mo.lora = in.lora;
    const GPTMemoryPlan plan = GPTModel::memory_plan(m, mo, in.micro_batch_size, in.seq_length);
    CalcReport::LoomPlan lp;
    lp.parameter_bytes = plan.parameter_bytes();
    lp.activation_bytes = plan.activation_bytes();
    const int64_t trained = in.lora ? r.lora_params : r.params;
    lp.optimizer_bytes = int64_t(in.optimizer_state_bytes) * trained;
    if (mo.grad_dtype != DType::kF32) lp.main_grad_bytes = 4 * trained;
    if (in.lora)
      lp.adapter_scratch_bytes =
          calc_detail::lora_scratch_bytes(r.lora_adapters, in.lora->config, in.micro_batch_size * in.seq_length,
                                          int64_t(dtype_size(mo.compute_dtype)), int64_t(dtype_size(mo.grad_dtype)));
    if (r.moe) lp.moe_bytes = r.moe->loom_layers * std::llround(r.moe->layer_bytes);
    r.loom_plan = lp;
  }

  // Throughput and time. X counts every executed FLOP (Megatron's reported TFLOP/s include recomputation).
  r.peak_tflops = is_16bit(in.precision) ? in.gpu.bf16_tflops : in.gpu.tf32_tflops;
  if (!in.precision.fp8_format.empty()) {
    if (!in.gpu.fp8_tflops)
      user_error("--fp8-format: the ", in.gpu.description, " (--gpu ", in.gpu.name, ") has no FP8 tensor cores; "
                 "choose --gpu H100, H200 or B200");
    r.peak_tflops = *in.gpu.fp8_tflops;
  }
  r.achieved_tflops = in.gpu_tflops.value_or(in.mfu * r.peak_tflops);
  const double cluster = double(in.num_gpus) * r.achieved_tflops * 1e12;  // n*X in FLOP/s
  r.seconds_per_iteration = r.flops_run / cluster;
  if (in.train_tokens) {
    // 6*T*P counts the parameters a token passes through: with MoE the active ones (top-k experts).
    const double T = *in.train_tokens, P = double(r.moe ? r.moe->active_params : r.params);
    r.iterations = T / (B * s);
    r.seconds_6tp = 6.0 * T * P / cluster;
    r.seconds_8tp = 8.0 * T * P / cluster;
    r.seconds_lora_4tp = 4.0 * T * P / cluster;
    r.seconds_lora_6tp = 6.0 * T * P / cluster;
    r.seconds_run = r.iterations * r.seconds_per_iteration;
  }
  return r;
}

}  // namespace loom
