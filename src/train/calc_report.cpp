// `loom calc`'s printed report (format_calc_report) and the number formatting it uses; the figures it
// prints come from compute_calc in calc.cpp. With LoRA the parameter, FLOP, memory and time sections say
// which figures are the frozen base's and which the adapters', and which FLOP convention is used.
#include "loom/train/calc.h"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>

#include "train/calc_impl.h"

namespace loom {

using calc_detail::is_16bit;
using calc_detail::is_gpt2_architecture;

namespace {

std::string commas(int64_t v) {
  const std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out = v < 0 ? "-" : "";
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string fixed(double v, int prec) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

// 124475904 -> "124.48M"
std::string short_count(double v) {
  const char* units[] = {"", "K", "M", "B", "T"};
  int u = 0;
  while (u < 4 && std::fabs(v) >= 1000.0) {
    v /= 1000.0;
    ++u;
  }
  return fixed(v, u == 0 ? 0 : 2) + units[u];
}

std::string sci(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4e FLOP", v);
  return buf;
}

std::string sig(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::string paren(const std::string& s) {
  std::string out = "(";
  out += s;
  out += ')';
  return out;
}

std::string gib(double bytes) { return fixed(bytes / 1073741824.0, 2) + " GiB"; }

std::string rpad(const std::string& s, size_t width) {
  std::string out(s.size() < width ? width - s.size() : 0, ' ');
  out += s;
  return out;
}

std::string bytes_line(int64_t bytes) { return rpad(commas(bytes) + " B", 22) + "  (" + gib(double(bytes)) + ")"; }

std::string duration(double seconds) {
  return fixed(seconds / 86400.0, 2) + " days = " + fixed(seconds / 3600.0, 1) + " hours = " +
         commas(std::llround(seconds)) + " s";
}

std::string pad(std::string s, size_t width) {
  if (s.size() < width) s.resize(width, ' ');
  return s;
}

// "18 B/param", "6 + 12/d B/param", "18/d B/param".
std::string per_param_text(const StateBytesPerParam& b) {
  std::string out;
  if (b.full || !b.sharded) out = std::to_string(b.full);
  if (b.sharded) out += (out.empty() ? "" : " + ") + std::to_string(b.sharded) + "/d";
  return out + " B/param";
}

StateBytesPerParam operator+(const StateBytesPerParam& x, const StateBytesPerParam& y) {
  return {x.full + y.full, x.sharded + y.sharded};
}

// "16*(8192 + 10240)", the adapter's r*(in + out).
std::string lora_shape_text(int64_t rank, const LoraAdapterShape& a) {
  return std::to_string(rank) + "*(" + std::to_string(a.in) + " + " + std::to_string(a.out) + ")";
}

std::string granularity_name(const RecomputeConfig& rc) {
  if (rc.granularity.empty()) return "none";
  if (rc.granularity == "full")
    return "full, " + rc.method + ", " + std::to_string(rc.num_layers.value_or(0)) + " layer(s)";
  return rc.granularity;
}

// The FLOP rows of a LoRA run: hardware FLOPs (docs/calc.md, "LoRA fine-tuning").
void lora_flops_lines(std::ostream& os, const CalcReport& r) {
  const GPTConfig& m = r.input.model;
  const std::string& g = r.input.recompute.granularity;
  const bool full_all = r.recomputed_layers == m.num_layers;
  const char* mark = "   <- this run";
  os << "  convention: hardware FLOPs of a LoRA step, the matmuls it executes (Megatron's model FLOPs, 3 x forward, "
        "describe full training); X, MFU and the times below count these:\n"
        "              the frozen base's forward and its backward for input gradients only (no weight-gradient "
        "GEMMs, no embedding backward), the attention core's backward (2 x its forward), the adapters' forward, "
        "backward and recomputed h\n";
  os << "  LoRA (no recomputation):   " << sci(r.flops_lora)
     << "  2*(l*linears + logits) + 3*l*attention core + adapters, linears = 2*B*s*(weights of qkv, proj, MLP), "
        "attention core = 4*B*s^2*a*d, logits = 2*B*s*h*V"
     << (g.empty() ? mark : "") << "\n";
  os << "  selective recomputation:   " << sci(r.flops_selective) << "  LoRA + 4*B*s^2*a*d*l (attention core again)"
     << (g == "selective" ? mark : "") << "\n";
  os << "  full recomputation:        " << sci(r.flops_full)
     << "  LoRA + l*(linears + attention core + adapters' forward)" << (g == "full" && full_all ? mark : "") << "\n";
  if (g == "full" && !full_all)
    os << "  this run (" << r.recomputed_layers << " of " << m.num_layers << " layers recomputed): "
       << sci(r.flops_run) << "  LoRA + " << r.recomputed_layers << "*(layer + adapters' forward)\n";
  os << "  adapters (included above): " << sci(r.flops_adapters) << "  forward " << sci(r.flops_adapters_forward_layer)
     << " per layer: down 2*B*s*in*r (column-parallel: on each of the t TP ranks, A being whole), up "
        "2*B*s*r*out (out: the whole fused layer for a slice); backward 3 x down (h again, dA, input gradient) "
        "and 2 x up (dB, dh; row-parallel: on each TP rank)\n";
  os << "  full training (model FLOPs, for reference): " << sci(r.flops_model)
     << "  3*(l*layer + 2*B*s*h*V), as without LoRA\n";
}

// "mixture of experts: 8 experts, top-2, ..." (GPTConfig::moe).
void moe_architecture_line(std::ostream& os, const GPTConfig& m) {
  const RouterConfig& rc = m.moe.router;
  os << "mixture of experts: " << m.moe.num_experts << " experts (E) of FFN " << m.moe_ffn_hidden_size() << ", top-"
     << rc.topk << " (k), " << m.num_moe_layers() << " of " << m.num_layers << " layers; routing "
     << (rc.score_function == MoeScoreFunction::kSigmoid ? "sigmoid"
         : rc.pre_softmax                                 ? "softmax, pre-softmax"
                                                          : "softmax")
     << (rc.topk_scaling_factor != 0 ? ", scaled by " + sig(rc.topk_scaling_factor) : std::string())
     << (rc.enable_expert_bias ? ", expert bias" : "");
  if (m.moe.shared_expert_intermediate_size > 0)
    os << "; shared experts " << m.moe.shared_expert_intermediate_size << (m.moe.shared_expert_gate ? " (gated)" : "");
  os << "\n";
}

// The MoE rows of the parameter section.
void moe_parameter_lines(std::ostream& os, const CalcReport& r) {
  const CalcReport::Moe& o = *r.moe;
  const GPTConfig& m = r.input.model;
  os << "  active parameters:      " << rpad(commas(o.active_params), 20) << "  ("
     << short_count(double(o.active_params)) << ")  what one token passes through: each MoE layer's top-"
     << m.moe.router.topk << " routed experts instead of all " << m.moe.num_experts
     << " (FLOPs and the 6*T*P times count these)\n";
  os << "  routed experts:         " << rpad(commas(o.expert_params), 20) << "  ("
     << short_count(double(o.expert_params)) << ")  " << m.num_moe_layers() << " MoE layers x " << m.moe.num_experts
     << " experts x " << commas(o.expert_params / std::max<int64_t>(1, m.num_moe_layers() * m.moe.num_experts))
     << " (fc1 + fc2); the rest is dense\n";
}

// The MoE rows of the memory section: where the experts live and whose states shard where.
void moe_memory_lines(std::ostream& os, const CalcReport& r) {
  const CalcReport::Moe& o = *r.moe;
  const GPTConfig& m = r.input.model;
  const int pp = r.input.parallel.pipeline_model_parallel_size;
  os << "  of which routed experts:" << rpad(commas(o.experts_first_stage), 20) << "  ("
     << short_count(double(o.experts_first_stage)) << ")  " << o.layers_first_stage << " MoE layers x "
     << m.moe.num_experts / o.ep << " experts (E/EP, EP " << o.ep << ") x " << commas(o.layer_experts_per_rank /
     std::max<int64_t>(1, m.moe.num_experts / o.ep)) << " (FFN / ETP, ETP " << o.etp << ")";
  if (pp > 1) os << "; last stage " << commas(o.experts_last_stage);
  os << "\n";
  os << "  expert data parallel:   d_e = n / (ETP x EP x PP) = " << o.expert_dp
     << " ranks hold the same experts: their gradients are reduced, and ZeRO shards their states, over d_e (the "
        "rest over d)\n";
}

}  // namespace

std::string format_calc_report(const CalcReport& r) {
  const CalcInput& in = r.input;
  const GPTConfig& m = in.model;
  const int t = in.parallel.tensor_model_parallel_size, p = in.parallel.pipeline_model_parallel_size,
            c = in.parallel.context_parallel_size;
  const bool b16 = is_16bit(in.precision);
  const bool fp8 = !in.precision.fp8_format.empty();
  const std::string dtype = std::string(in.precision.bf16 ? "bf16" : in.precision.fp16 ? "fp16" : "fp32") +
                            (fp8 ? " with FP8 GEMMs (" + in.precision.fp8_format + ")" : "");
  std::ostringstream os;

  for (const std::string& n : in.notes) os << "note: " << n << "\n";
  os << "model: GPT, " << m.num_layers << " layers (l), hidden " << m.hidden_size << " (h), " << m.num_attention_heads
     << " heads (a), sequence " << in.seq_length << " (s), " << m.max_position_embeddings
     << " position embeddings\n";
  if (!is_gpt2_architecture(m))
    os << "architecture: " << norm_kind_name(m.normalization) << ", " << mlp_activation_name(m.activation) << " MLP "
       << m.ffn_hidden_size() << " wide, " << m.num_kv_heads() << " key/value heads (g) of size " << m.head_dim()
       << " (d), " << position_embedding_type_name(m.position_embedding_type) << " positions"
       << (m.add_bias_linear ? "" : m.add_qkv_bias ? ", qkv bias only" : ", no linear biases")
       << (m.untie_embeddings_and_output_weights ? ", untied output layer" : "")
       << (m.qk_layernorm ? ", qk-layernorm" : "")
       << (m.window_size_left >= 0 ? ", window " + std::to_string(m.window_size_left) + ",0" : std::string()) << "\n";
  if (m.is_moe()) moe_architecture_line(os, m);
  os << "vocabulary: " << m.vocab_size << ", padded to " << m.padded_vocab_size << " (V)\n";
  os << "layout: " << in.num_gpus << " GPUs = TP " << t << " x PP " << p << " x CP " << c << " x DP "
     << in.data_parallel_size() << "; sequence parallel " << (in.sequence_parallel && t > 1 ? "on" : "off") << "\n";
  os << "batch: micro-batch " << in.micro_batch_size << " (b), global batch " << in.global_batch_size
     << " (B), " << r.micro_batches << " micro-batch(es) per iteration per data-parallel rank\n";
  os << "precision: " << dtype << "; recomputation: " << granularity_name(in.recompute) << "\n";

  const std::optional<LoraOptions>& lora = in.lora;
  if (lora) {
    std::string targets;
    for (const LoraAdapterShape& a : r.lora_adapters) targets += std::string(" ") + lora_target_name(a.target);
    os << "LoRA: rank " << lora->config.rank << " (r), alpha " << sig(lora->config.alpha) << ", dropout "
       << sig(lora->config.dropout) << " on" << targets << "; the base frozen, the adapters trained\n";
  }

  os << "\nParameters\n";
  const bool gpt2_arch = is_gpt2_architecture(m);
  os << "  parameters (exact):     " << rpad(commas(r.params), 20) << "  (" << short_count(double(r.params))
     << ")  " << (lora ? "the frozen base, " : "") << "from the layer shapes: "
     << (gpt2_arch ? "l*(12*h^2 + 13*h) + (V + position embeddings)*h + 2*h"
                   : "l*(norms + qkv + proj + MLP) + embeddings (+ output layer); docs/models.md")
     << "\n";
  os << "  parameters (formula):   " << rpad(commas(std::llround(r.params_formula)), 20) << "  ("
     << short_count(r.params_formula)
     << ")  12*l*h^2*(1 + 13/(12*h) + (V+s)/(12*l*h)), s = position embeddings " << m.max_position_embeddings
     << " (the paper's s is the sequence length, equal to it there)\n";
  if (r.moe) moe_parameter_lines(os, r);
  if (lora) {
    const int64_t rank = lora->config.rank;
    os << "  LoRA adapters (exact):  " << rpad(commas(r.lora_params), 20) << "  (" << short_count(double(r.lora_params))
       << ")  trainable, " << fixed(100.0 * double(r.lora_params) / double(r.params), 3)
       << "% of the frozen base above: l x r*(in + out) per adapted linear:\n";
    for (const LoraAdapterShape& a : r.lora_adapters)
      os << "    " << pad(lora_target_name(a.target), 12) << rpad(commas(rank * (a.in + a.out)), 14)
         << " per layer = " << lora_shape_text(rank, a) << ": A (r, " << a.in << "), B (" << a.out << ", r); "
         << (a.column_parallel ? "column-parallel (TP: A whole, B split)" : "row-parallel (TP: A split, B whole)")
         << "\n";
  }

  os << "\nFLOPs per iteration (B = " << in.global_batch_size << " sequences of s = " << in.seq_length << " tokens)\n";
  const char* mark = "   <- this run";
  const std::string& g = in.recompute.granularity;
  const bool full_all = r.recomputed_layers == m.num_layers;
  if (lora) {
    lora_flops_lines(os, r);
  } else {
    os << "  model (no recomputation):  " << sci(r.flops_model) << "  "
       << (gpt2_arch ? "72*B*s*l*h^2*(1 + s/(6*h) + V/(12*l*h))"
                     : "3*(l*layer + 2*B*s*h*V), layer = 2*B*s*(weights of qkv, proj, MLP) + 4*B*s^2*a*d")
       << (g.empty() ? mark : "") << "\n";
    os << "  selective recomputation:   " << sci(r.flops_selective) << "  model + "
       << (gpt2_arch ? "4*B*s^2*h*l" : "4*B*s^2*a*d*l") << " (attention core again)"
       << (g == "selective" ? mark : "") << "\n";
    os << "  full recomputation:        " << sci(r.flops_full) << "  "
       << (gpt2_arch ? "96*B*s*l*h^2*(1 + s/(6*h) + V/(16*l*h))" : "model + l*layer")
       << (g == "full" && full_all ? mark : "") << "\n";
    if (g == "full" && !full_all)
      os << "  this run (" << r.recomputed_layers << " of " << m.num_layers << " layers recomputed): " << sci(r.flops_run)
         << "  model + " << r.recomputed_layers << (gpt2_arch ? "*(24*B*s*h^2 + 4*B*s^2*h)\n" : "*layer\n");
  }

  os << "\nMemory per rank (first pipeline stage: " << m.num_layers / p << " of " << m.num_layers
     << " layers and the embeddings; one TP rank)\n";
  os << "  parameters on the rank: " << rpad(commas(r.params_first_stage), 20) << "  ("
     << short_count(double(r.params_first_stage)) << ")" << (lora ? " of the frozen base" : "");
  if (p > 1) os << "; last stage " << commas(r.params_last_stage);
  os << "\n";
  if (r.moe) moe_memory_lines(os, r);
  if (lora)
    os << "  LoRA adapters on it:    " << rpad(commas(r.lora_params_stage), 20) << "  ("
       << short_count(double(r.lora_params_stage)) << ")  " << m.num_layers / p << " layers x "
       << commas(r.lora_layer_params)
       << (t > 1 ? " (TP " + std::to_string(t) + ": column-parallel A + B/t, row-parallel A/t + B)" : std::string())
       << (p > 1 ? "; the same on every stage" : "") << "\n";
  const ShardingStrategy sh = in.sharding;
  const int64_t d = r.zero_group;
  const bool zero = sh != ShardingStrategy::kNone;
  const std::string group = "DP " + std::to_string(in.data_parallel_size()) + " x CP " + std::to_string(c);
  const int64_t trained = lora ? r.lora_params_stage : r.params_first_stage;
  if (zero)
    os << "  data-parallel sharding: " << sharding_strategy_name(sh) << " (" << zero_stage_name(sh) << ") over d = " << d
       << " ranks (" << group << "); a shard is ceil(P/d) = " << commas((trained + d - 1) / d)
       << (lora ? " adapter params (the frozen base is not sharded)\n" : " params\n");
  else
    os << "  data-parallel sharding: no_shard (no ZeRO) over d = " << d << " ranks (" << group
       << "): every rank holds all its stage's model states\n";
  // "(ZeRO-1, d = 8)" after each per-parameter figure of a sharded run.
  const std::string zero_tag =
      zero ? " (" + std::string(zero_stage_name(sh)) + ", d = " + std::to_string(d) +
                 (r.moe ? "; routed experts d_e = " + std::to_string(r.moe->expert_dp) : std::string()) + ")"
           : "";
  const bool grads_f32 = r.grad_per_param.full + r.grad_per_param.sharded == 4;
  std::string weights_what, grads_what, optimizer_what;
  switch (sh) {
    case ShardingStrategy::kNone:
      weights_what = b16 ? "FP32 master + 16-bit copy" : "FP32";
      grads_what = std::string(grads_f32 ? "FP32" : "FP16") + " main grads" +
                   (grads_f32 && in.precision.grad_dtype() != DType::kF32 ? " (always FP32 with more than one rank)" : "");
      optimizer_what = in.optimizer_state_what + " in FP32 (no ZeRO sharding)";
      break;
    case ShardingStrategy::kOptim:
    case ShardingStrategy::kOptimGrads:
      weights_what = b16 ? "16-bit copy + FP32 master shard" : "FP32 weights, the masters (the rank steps its 1/d range)";
      grads_what = sh == ShardingStrategy::kOptim ? "FP32 main grads, reduce-scattered after backward"
                                              : "FP32 main-grad shard";
      optimizer_what = in.optimizer_state_what + " shards in FP32";
      break;
    case ShardingStrategy::kOptimGradsParams:
      weights_what = b16 ? "FP32 master shard + 16-bit copy shard" : "FP32 weight shard (the masters)";
      grads_what = "FP32 main-grad shard";
      optimizer_what = in.optimizer_state_what + " shards in FP32";
      break;
  }
  const std::string of = lora ? "the adapters' " : "";
  if (lora)
    os << "  frozen base weights:    " << bytes_line(r.frozen_bytes) << "  " << r.frozen_per_param
       << " B/param of the base: its " << (b16 ? "16-bit" : "FP32") << " compute copy only (no "
       << (b16 ? "FP32 master, " : "") << "gradients or optimizer state), whole on every rank (not ZeRO-sharded)\n";
  os << "  weights:                " << bytes_line(r.weight_bytes) << "  " << per_param_text(r.weight_per_param)
     << zero_tag << ": " << of << weights_what << "\n";
  os << "  gradients:              " << bytes_line(r.grad_bytes) << "  " << per_param_text(r.grad_per_param) << zero_tag
     << ": " << of << grads_what << "\n";
  os << "  optimizer state:        " << bytes_line(r.optimizer_bytes) << "  " << per_param_text(r.optimizer_per_param)
     << zero_tag << ": " << of << optimizer_what << "\n";
  const std::string states_text = per_param_text(r.weight_per_param + r.grad_per_param + r.optimizer_per_param);
  if (lora)
    os << "  model states:           " << bytes_line(r.states_bytes()) << "  frozen base " << r.frozen_per_param
       << " B/param + adapters " << states_text << zero_tag
       << " (`loom train` logs the same bytes: \"model states N bytes\")\n";
  else
    os << "  model states:           " << bytes_line(r.states_bytes()) << "  " << states_text << zero_tag << "\n";
  if (sh == ShardingStrategy::kOptimGrads)
    os << "  gradient buckets:       " << bytes_line(r.transient_bytes)
       << "  transient, not model states: FP32 gradients of up to 2 buckets of " << commas(r.bucket_size)
       << " (one written by backward, one being reduce-scattered): 4*min(P, 2*bucket)\n";
  if (sh == ShardingStrategy::kOptimGradsParams)
    os << "  gathered layers:        " << bytes_line(r.transient_bytes)
       << "  transient, not model states: the gathered parameters (" << (b16 ? 2 : 4)
       << " B) and FP32 gradients of about two layers of " << commas(r.layer_params)
       << " params (one in use, one being gathered or reduce-scattered); the embedding's gather comes on top "
          "when it is larger\n";
  if (p > 1 && lora)
    os << "  last stage states:      " << bytes_line(r.last_states_bytes()) << "  frozen base "
       << commas(r.last_frozen_bytes) << " + adapters' weights " << commas(r.last_weight_bytes) << " + gradients "
       << commas(r.last_grad_bytes) << " + optimizer " << commas(r.last_optimizer_bytes) << " B for its "
       << commas(r.params_last_stage) << " base params and " << commas(r.lora_params_stage) << " adapter params\n";
  else if (p > 1)
    os << "  last stage states:      " << bytes_line(r.last_states_bytes()) << "  weights "
       << commas(r.last_weight_bytes) << " + gradients " << commas(r.last_grad_bytes) << " + optimizer "
       << commas(r.last_optimizer_bytes) << " B for its " << commas(r.params_last_stage) << " params\n";
  os << "  activations (Korthikanti et al. 2022, " << (b16 ? "16-bit" : "FP32: twice the paper's 16-bit")
     << (lora ? "; LoRA saves the same tensors, its adapters keeping only transient scratch" : "")
     << "; b = " << in.micro_batch_size << ", " << r.micro_batches_in_flight << " micro-batch(es) in flight x "
     << m.num_layers / p << " layers";
  if (c > 1) os << ", s/CP = " << in.seq_length / c << " tokens per rank";
  os << "):\n";
  os << "    " << pad("recompute", 10) << rpad("per layer", 18) << rpad("activations", 24) << rpad("with states", 26)
     << "  per-layer formula\n";
  for (size_t i = 0; i < r.activations.size(); ++i) {
    const ActivationEstimate& a = r.activations[i];
    const int64_t act = std::llround(a.total()), tot = act + r.states_bytes();
    os << "    " << pad(a.label, 10) << rpad(commas(std::llround(a.per_layer)) + " B", 18)
       << rpad(commas(act) + " B", 24) << rpad(commas(tot) + " B", 26) << "  " << a.formula
       << (i == r.run_row ? mark : "") << "\n";
    os << "    " << pad("", 10) << rpad("", 18) << rpad(paren(gib(double(act))), 24)
       << rpad(paren(gib(double(tot))), 26) << "\n";
  }
  if (r.moe) {
    const CalcReport::Moe& o = *r.moe;
    os << "    MoE layers (" << o.layers_first_stage << " of the stage's " << m.num_layers / p << "): "
       << commas(std::llround(o.layer_bytes)) << " B each in place of the MLP's "
       << commas(std::llround(o.dense_mlp_bytes)) << " B: M = " << commas(o.rows) << " expert rows (k x n, n = "
       << commas(o.tokens) << " tokens routed on the rank; balanced routing), cb*M*(2h + (F1 + F)/ETP)"
       << (o.rows_move ? " + 2*cb*M*h (rows sent to the experts' ranks and back)" : "") << " + 8*n*E (router)"
       << (m.moe.shared_expert_intermediate_size > 0 ? " + shared experts' fc1 output and output" : "") << "\n";
  }
  os << "    activations include " << commas(std::llround(r.activations[0].extra))
     << " B outside the layers: embedding dropout masks"
     << (p == 1 ? ", final norm and output-layer inputs, FP32 logits" : "") << "\n";

  if (r.loom_plan) {
    const CalcReport::LoomPlan& lp = *r.loom_plan;
    os << "\nLoom's buffers for this run (what `loom train` allocates; its log's \"max allocated\" adds the data "
          "loader's batch buffers)\n";
    os << "  parameters and grads:   " << bytes_line(lp.parameter_bytes)
       << (lora ? "  (the frozen base's compute copy; the adapters' masters, copy and grads)" : "") << "\n";
    os << "  optimizer state:        " << bytes_line(lp.optimizer_bytes) << "\n";
    if (lp.main_grad_bytes) os << "  FP32 main-grad copy:    " << bytes_line(lp.main_grad_bytes) << "\n";
    os << "  activations:            " << bytes_line(lp.activation_bytes) << "  (b = " << in.micro_batch_size
       << "; fused attention keeps no s x s scores)\n";
    if (lora)
      os << "  LoRA adapter scratch:   " << bytes_line(lp.adapter_scratch_bytes)
         << "  transient: the most one adapter holds at once (dropped input, h, the up GEMM's output; in backward "
            "dh and the input gradient)\n";
    if (r.moe)
      os << "  MoE layers' buffers:    " << bytes_line(lp.moe_bytes) << "  " << r.moe->loom_layers << " x "
         << commas(std::llround(r.moe->layer_bytes))
         << " B: allocated per call (sized by the routing; an estimate for balanced routing)\n";
    os << "  total:                  " << bytes_line(lp.total()) << "\n";
  }

  os << "\nThroughput\n";
  os << "  achieved per GPU:  " << fixed(r.achieved_tflops, 1) << " TFLOP/s (X)";
  if (in.gpu_tflops)
    os << " from --gpu-tflops = " << fixed(r.achieved_tflops / r.peak_tflops, 3) << " of the " << in.gpu.description
       << " dense " << (fp8 ? "FP8" : b16 ? "BF16/FP16" : "TF32") << " peak " << fixed(r.peak_tflops, 0);
  else
    os << " = MFU " << fixed(in.mfu, 2) << " x " << in.gpu.description << " dense "
       << (fp8 ? "FP8" : b16 ? "BF16" : "TF32") << " peak " << fixed(r.peak_tflops, 0);
  os << "\n";
  os << "  time per iteration:  " << sig(r.seconds_per_iteration) << " s  (this run's "
     << (lora ? "LoRA hardware " : "") << "FLOPs / (n*X), n = " << in.num_gpus << ")\n";
  os << "  tokens per second:   " << commas(std::llround(double(in.global_batch_size) * double(in.seq_length) /
                                                         r.seconds_per_iteration))
     << "\n";

  os << "\nTraining time\n";
  if (!in.train_tokens) {
    os << "  give --train-tokens T (or --train-iters N) to estimate it\n";
  } else {
    os << "  tokens (T):  " << commas(std::llround(*in.train_tokens)) << "  (" << short_count(*in.train_tokens)
       << "; " << commas(std::llround(r.iterations)) << " iterations of B*s tokens)\n";
    if (lora) {
      // P is the frozen base: 2*P per token forward, 2*P backward (input gradients only), 2*P recomputed.
      os << "  4*T*P/(n*X) (LoRA, no recomputation):    " << duration(r.seconds_lora_4tp) << (g.empty() ? mark : "")
         << "\n";
      os << "  6*T*P/(n*X) (LoRA, full recomputation):  " << duration(r.seconds_lora_6tp) << (g == "full" ? mark : "")
         << "\n";
      os << "  (P the frozen base; forward 2*P and input-gradient backward 2*P FLOPs per token, adapters and "
            "attention left out)\n";
    } else {
      os << "  6*T*P/(n*X) (no recomputation):    " << duration(r.seconds_6tp) << (g.empty() ? mark : "") << "\n";
      os << "  8*T*P/(n*X) (full recomputation):  " << duration(r.seconds_8tp) << (g == "full" ? mark : "") << "\n";
      if (r.moe)
        os << "  (P = the " << commas(r.moe->active_params) << " active parameters: a token passes through its top-"
           << m.moe.router.topk << " experts only)\n";
    }
    os << "  from this run's FLOPs per iteration: " << duration(r.seconds_run) << "\n";
  }

  os << "\nDense peak TFLOP/s per GPU (NVIDIA datasheets, without sparsity)\n";
  os << "  " << pad("GPU", 12) << rpad("TF32", 8) << rpad("BF16/FP16", 11) << rpad("FP8", 8) << "\n";
  for (const GpuSpec& s : gpu_specs())
    os << "  " << pad(s.description, 12) << rpad(fixed(s.tf32_tflops, 0), 8) << rpad(fixed(s.bf16_tflops, 0), 11)
       << rpad(s.fp8_tflops ? fixed(*s.fp8_tflops, 0) : "-", 8) << (s.name == in.gpu.name ? "   <- --gpu" : "")
       << "\n";
  return os.str();
}

}  // namespace loom
