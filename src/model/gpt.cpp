// GPTModel: buffers (one layout shared by the static memory plan and the allocation), forward, backward
// and activation recomputation. Invariant: a recomputed forward runs the very same ops on the very same
// inputs with the same dropout masks as the original forward, so it reproduces every bit.
#include "loom/model/gpt.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "loom/core/rng.h"
#include "loom/parallel/context_parallel.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom {

namespace {

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser: a bijection that spreads every input bit
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Philox stream of one dropout site for one micro-batch. The site hash names the tensor (layer index
// included); a tensor-parallel rank will mix its TP rank into the site hash for dropout inside TP regions
// (attention probabilities of its heads), as Megatron's model-parallel RNG tracker does, and leave it out
// for the replicated hidden dropout so all TP ranks drop the same elements.
uint64_t dropout_stream(uint64_t site, uint64_t micro_batch_index) { return mix64(site ^ mix64(micro_batch_index)); }

const char* granularity_flag(RecomputeGranularity g) {
  switch (g) {
    case RecomputeGranularity::kNone: return "(unset)";
    case RecomputeGranularity::kSelective: return "selective";
    case RecomputeGranularity::kFull: return "full";
  }
  return "?";
}

int64_t local_layer_count(const GPTConfig& c, const ModelParallel& mp) {
  return mp.num_layers < 0 ? c.num_layers - mp.first_layer : mp.num_layers;
}

// The attention core's parameters on one TP rank: its NH/TP query heads and NKV/TP query groups.
AttentionParams local_attention_params(const GPTConfig& c, int tp) {
  AttentionParams p = c.attention_params();
  p.num_heads /= tp;
  p.num_kv_heads /= tp;
  return p;
}

// Local sizes of one (cfg, opts, B, T): the residual stream holds Nl token rows (the SP shard of the
// flattened B·Tl tokens, else all of them); tensor-parallel regions hold all N = B·Tl rows with the local
// heads / FFN columns / vocabulary columns.
struct Dims {
  int TP = 1, CP = 1, tp_rank = 0;
  bool sp = false;
  int64_t B = 0, Tl = 0, N = 0, Nl = 0;
  int64_t C = 0, NHl = 0, NKVl = 0, HS = 0, Al = 0, QKVl = 0, Fl = 0, F1l = 0, Vl = 0, vocab_start = 0;
  Shape resid() const { return sp ? Shape{Nl, C} : Shape{B, Tl, C}; }
  Shape full(int64_t X) const { return {B, Tl, X}; }
};

Dims make_dims(const GPTConfig& c, const ModelOptions& o, int64_t B, int64_t T) {
  Dims d;
  d.TP = o.parallel.tp_size();
  d.CP = o.parallel.cp_size();
  d.tp_rank = o.parallel.tp_rank();
  d.sp = o.parallel.sequence_parallel;
  d.B = B;
  d.Tl = T / d.CP;
  d.N = B * d.Tl;
  d.Nl = d.sp ? d.N / d.TP : d.N;
  d.C = c.hidden_size;
  d.NHl = c.num_attention_heads / d.TP;
  d.NKVl = c.num_kv_heads() / d.TP;
  d.HS = c.head_dim();
  d.Al = d.NHl * d.HS;
  d.QKVl = c.qkv_size() / d.TP;
  d.Fl = c.ffn_hidden_size() / d.TP;
  d.F1l = (c.gated_mlp() ? 2 : 1) * d.Fl;
  d.Vl = c.padded_vocab_size / d.TP;
  d.vocab_start = int64_t(d.tp_rank) * d.Vl;
  return d;
}

// A linear layer: whole at TP = 1 (the original declaration), else the shard `ranges` along partition_dim.
Linear make_linear(ParameterSet& ps, const std::string& prefix, int64_t in, int64_t out, bool bias, float std_,
                   int tp, int partition_dim, std::vector<ShardRange> ranges) {
  if (tp == 1) return Linear(ps, prefix, in, out, bias, std_);
  return Linear(ps, prefix, in, out, bias, std_, partition_dim, std::move(ranges));
}

}  // namespace

struct GPTModel::Layer {
  // Declaration order is parameter order in the flat buffers: norms, attention, MLP (GPT-2's order, with
  // the qk-norms after the attention projections). With TP > 1: linear_qkv holds this rank's query groups
  // (one contiguous row range of the grouped layout), fc1 its FFN rows (a gated fc1 its gate rows and its
  // up rows), linear_proj / fc2 their input columns; norms and the row-parallel biases are whole.
  Norm ln1, ln2;
  Linear qkv, proj;
  std::optional<QKNorm> qk_norm;
  Linear fc1, fc2;
  AttentionCore attn;
  uint64_t attn_dropout_site, proj_dropout_site, mlp_dropout_site;
  Layer(ParameterSet& ps, const GPTConfig& c, int64_t i, int tp, int r)
      : ln1(ps, prefix(i) + "input_layernorm", c.hidden_size, c.layernorm_epsilon, c.normalization),
        ln2(ps, prefix(i) + "pre_mlp_layernorm", c.hidden_size, c.layernorm_epsilon, c.normalization),
        qkv(make_linear(ps, prefix(i) + "self_attention.linear_qkv", c.hidden_size, c.qkv_size(), c.qkv_bias(),
                        c.init_method_std, tp, 0, {even_shard(c.qkv_size(), tp, r)})),
        proj(make_linear(ps, prefix(i) + "self_attention.linear_proj", c.num_attention_heads * c.head_dim(),
                         c.hidden_size, c.add_bias_linear, scaled_std(c), tp, 1,
                         {even_shard(c.num_attention_heads * c.head_dim(), tp, r)})),
        qk_norm(c.qk_layernorm ? std::optional<QKNorm>(std::in_place, ps, prefix(i) + "self_attention",
                                                       local_attention_params(c, tp), c.layernorm_epsilon,
                                                       c.normalization)
                               : std::nullopt),
        fc1(make_linear(ps, prefix(i) + "mlp.linear_fc1", c.hidden_size, (c.gated_mlp() ? 2 : 1) * c.ffn_hidden_size(),
                        c.add_bias_linear, c.init_method_std, tp, 0, fc1_shard(c, tp, r))),
        fc2(make_linear(ps, prefix(i) + "mlp.linear_fc2", c.ffn_hidden_size(), c.hidden_size, c.add_bias_linear,
                        scaled_std(c), tp, 1, {even_shard(c.ffn_hidden_size(), tp, r)})),
        attn(local_attention_params(c, tp)),
        attn_dropout_site(hash_stream(prefix(i) + "self_attention.core_attention.attention_dropout")),
        proj_dropout_site(hash_stream(prefix(i) + "self_attention.hidden_dropout")),
        mlp_dropout_site(hash_stream(prefix(i) + "mlp.hidden_dropout")) {}
  static std::string prefix(int64_t i) { return "decoder.layers." + std::to_string(i) + "."; }
  // Megatron's output_layer_init_method: std / sqrt(2 · num_layers) for projections into the residual
  // (the GLOBAL layer count, whatever this pipeline stage holds).
  static float scaled_std(const GPTConfig& c) {
    return float(c.init_method_std / std::sqrt(2.0 * double(c.num_layers)));
  }
  static std::vector<ShardRange> fc1_shard(const GPTConfig& c, int tp, int r) {
    const int64_t F = c.ffn_hidden_size();
    const ShardRange s = even_shard(F, tp, r);
    if (!c.gated_mlp()) return {s};
    return {s, {F + s.start, s.size}};  // [gate_r | up_r]: the local GLU sees its own halves
  }
};

struct GPTModel::LayerActs {
  Tensor ln1;        // (B, T, C)
  Norm::Saved ln1_saved;
  Tensor qkv;        // (B, T, (NH + 2·NKV)·HS) after the qk-norm and RoPE: what the attention core reads
  QKNorm::Saved qk_saved;  // --qk-layernorm: the q/k heads before the norm and its statistics
  Tensor att;        // (B, T, NH·HS) attention core output
  AttentionCore::Saved attn_saved;
  Tensor residual2;  // (B, T, C) x + attention branch
  Tensor ln2;        // (B, T, C)
  Norm::Saved ln2_saved;
  Tensor fc;         // (B, T, F), or (B, T, 2F) = [gate | up] for a gated MLP: fc1's output
  Tensor out;        // (B, T, C) layer output = next layer's input
};

// Full recomputation: a recomputed layer belongs to the group [group_begin, group_end), re-run together
// in backward; its activations live in scratch_[l - group_begin].
struct GPTModel::LayerRole {
  bool recomputed = false;
  int64_t group_begin = 0, group_end = 0;
};

struct GPTModel::BufferSlot {
  PlannedBuffer buffer;
  Tensor* target;  // where the model keeps it; null for the static plan
};

// Everything declare_parameters() builds, moved into the model (memory_plan() throws it away).
struct GPTModel::Declared {
  std::unique_ptr<Embedding> embedding;
  std::vector<std::unique_ptr<Layer>> layers;
  std::unique_ptr<Norm> final_ln;
  std::unique_ptr<Linear> output_layer;
  Parameter* tied_copy = nullptr;
  // Parameter index ranges [begin, end) in ParameterSet::all() of the units, in forward order.
  std::vector<std::pair<std::string, std::pair<size_t, size_t>>> units;
};

// One micro-batch's saved activations (pipeline schedules keep several in flight).
struct GPTModel::SlotState {
  Tensor x0;
  std::vector<LayerActs> acts;
  Tensor lnf;
  Norm::Saved lnf_saved;
  Tensor logits, losses, pipe_grad;
  ForwardOptions fwd;
  bool backward_ready = false;
};

namespace {
AttentionParams with_dropout(AttentionParams p, const DropoutMask& d) {
  p.dropout_p = d.active() ? d.p : 0.0f;
  p.dropout_seed = d.seed;
  p.dropout_stream = d.stream;
  return p;
}

uint64_t embedding_dropout_site() {
  static const uint64_t site = hash_stream("embedding.embedding_dropout");
  return site;
}
}  // namespace

PositionEmbeddingType parse_position_embedding_type(std::string_view s) {
  if (s == "learned_absolute") return PositionEmbeddingType::kLearnedAbsolute;
  if (s == "rope") return PositionEmbeddingType::kRope;
  if (s == "none") return PositionEmbeddingType::kNone;
  if (s == "mrope" || s == "relative")
    user_error("--position-embedding-type ", s, " is not supported by Loom; valid: learned_absolute, rope, none");
  user_error("--position-embedding-type must be learned_absolute, rope or none, got '", s, "'");
}

const char* position_embedding_type_name(PositionEmbeddingType t) {
  switch (t) {
    case PositionEmbeddingType::kLearnedAbsolute: return "learned_absolute";
    case PositionEmbeddingType::kRope: return "rope";
    case PositionEmbeddingType::kNone: return "none";
  }
  return "?";
}

const char* mlp_activation_name(MlpActivation a) {
  switch (a) {
    case MlpActivation::kGeLU: return "gelu";
    case MlpActivation::kSwiGLU: return "swiglu";
    case MlpActivation::kGeGLU: return "geglu";
    case MlpActivation::kReGLU: return "reglu";
  }
  return "?";
}

int64_t GPTConfig::ffn_hidden_size() const {
  if (ffn_hidden > 0) return ffn_hidden;
  // Megatron: int((4 * h * 2 / 3) / 64) * 64. 8h/3 is never within rounding of a multiple of 64 unless it
  // is one, so the float expression equals this integer one.
  return gated_mlp() ? hidden_size / 24 * 64 : 4 * hidden_size;
}

int64_t GPTConfig::rotary_dim() const {
  if (position_embedding_type != PositionEmbeddingType::kRope) return 0;
  return int64_t(double(head_dim()) * double(rotary_percent));  // Megatron: int(kv_channels * rotary_percent)
}

AttentionParams GPTConfig::attention_params() const {
  AttentionParams p;
  p.num_heads = num_attention_heads;
  p.num_kv_heads = num_kv_heads();
  p.head_dim = head_dim();
  p.softmax_scale = float(1.0 / std::sqrt(double(head_dim())));
  p.causal = true;
  p.window = window_size_left >= 0 ? window_size_left + 1 : -1;  // keys [i - L, i]: L + 1 of them
  return p;
}

RotaryOptions GPTConfig::rotary_options() const {
  RotaryOptions o;
  o.rotary_dim = rotary_dim();
  o.base = rotary_base;
  o.interleaved = rotary_interleaved;
  if (use_rope_scaling) {
    RopeScaling s;
    s.factor = double(rope_scaling_factor);
    o.scaling = s;
  }
  return o;
}

int64_t GPTConfig::num_parameters() const {
  const int64_t C = hidden_size, F = ffn_hidden_size(), HS = head_dim(), NH = num_attention_heads;
  const int64_t QKV = qkv_size(), F1 = (gated_mlp() ? 2 : 1) * F, norm = Norm::num_parameters(normalization, C);
  const int64_t attention = C * QKV + (qkv_bias() ? QKV : 0) + NH * HS * C + (add_bias_linear ? C : 0) +
                            (qk_layernorm ? 2 * Norm::num_parameters(normalization, HS) : 0);
  const int64_t mlp = C * F1 + F * C + (add_bias_linear ? F1 + C : 0);
  const int64_t per_layer = 2 * norm + attention + mlp;
  const int64_t embeddings =
      padded_vocab_size * C +
      (position_embedding_type == PositionEmbeddingType::kLearnedAbsolute ? max_position_embeddings * C : 0);
  const int64_t output_layer = untie_embeddings_and_output_weights ? padded_vocab_size * C : 0;
  return embeddings + num_layers * per_layer + norm + output_layer;
}

double GPTConfig::attention_core_forward_flops(int64_t B, int64_t T) const {
  // Q·K^T and P·V: 2·T·HS multiply-adds per query and head each.
  return 4.0 * double(B) * double(T) * double(T) * double(num_attention_heads) * double(head_dim());
}

double GPTConfig::layer_forward_flops(int64_t B, int64_t T) const {
  const double c = double(hidden_size), f = double(ffn_hidden_size()), q = double(num_attention_heads * head_dim());
  const double weights = c * double(qkv_size()) + q * c + c * f * (gated_mlp() ? 2.0 : 1.0) + f * c;
  return 2.0 * double(B) * double(T) * weights + attention_core_forward_flops(B, T);
}

double GPTConfig::logits_forward_flops(int64_t B, int64_t T) const {
  return 2.0 * double(B) * double(T) * double(hidden_size) * double(padded_vocab_size);
}

double GPTConfig::flops_per_step(int64_t B, int64_t T) const {
  return 3.0 * (double(num_layers) * layer_forward_flops(B, T) + logits_forward_flops(B, T));
}

void GPTConfig::validate_architecture() const {
  if (num_layers < 1) user_error("--num-layers must be >= 1, got ", num_layers);
  if (hidden_size < 1) user_error("--hidden-size must be >= 1, got ", hidden_size);
  if (num_attention_heads < 1) user_error("--num-attention-heads must be >= 1, got ", num_attention_heads);
  if (kv_channels < 0) user_error("--kv-channels must be >= 1, got ", kv_channels);
  if (kv_channels == 0 && hidden_size % num_attention_heads != 0)
    user_error("--hidden-size (", hidden_size, ") must be divisible by --num-attention-heads (", num_attention_heads,
               "), or give the head size with --kv-channels");
  if (group_query_attention) {
    if (num_query_groups < 1) user_error("--num-query-groups must be >= 1, got ", num_query_groups);
    if (num_attention_heads % num_query_groups != 0)
      user_error("--num-attention-heads (", num_attention_heads, ") must be divisible by --num-query-groups (",
                 num_query_groups, ")");
  }
  if (ffn_hidden < 0) user_error("--ffn-hidden-size must be >= 1, got ", ffn_hidden);
  if (ffn_hidden_size() < 1)
    user_error("the default --ffn-hidden-size of a gated MLP, int(4 * ", hidden_size,
               " * 2 / 3 / 64) * 64, is 0 for a hidden size below 24: give --ffn-hidden-size");
  if (position_embedding_type == PositionEmbeddingType::kRope) {
    if (!(rotary_base > 0)) user_error("--rotary-base must be > 0, got ", rotary_base);
    if (!(rotary_percent > 0.0f && rotary_percent <= 1.0f))
      user_error("--rotary-percent must be in (0, 1], got ", rotary_percent);
    const int64_t rd = rotary_dim();
    if (rd < 2 || rd % 2 != 0)
      user_error("--rotary-percent ", rotary_percent, " of the head size ", head_dim(), " gives ", rd,
                 " rotary channels; RoPE needs an even number >= 2");
    if (use_rope_scaling && !(rope_scaling_factor > 0))
      user_error("--rope-scaling-factor must be > 0, got ", rope_scaling_factor);
  } else {
    const char* t = position_embedding_type_name(position_embedding_type);
    if (use_rope_scaling) user_error("--use-rope-scaling needs --position-embedding-type rope (got ", t, ")");
    if (rotary_interleaved) user_error("--rotary-interleaved needs --position-embedding-type rope (got ", t, ")");
  }
  if (window_size_left < -1)
    user_error("--window-size: the left window must be >= 0 (or -1: none), got ", window_size_left);
  if (max_position_embeddings < 1)
    user_error("--max-position-embeddings must be >= 1, got ", max_position_embeddings);
  if (!(hidden_dropout >= 0.0f && hidden_dropout < 1.0f))
    user_error("--hidden-dropout must be in [0, 1), got ", hidden_dropout);
  if (!(attention_dropout >= 0.0f && attention_dropout < 1.0f))
    user_error("--attention-dropout must be in [0, 1), got ", attention_dropout);
}

void GPTConfig::validate() const {
  validate_architecture();
  if (vocab_size < 1) user_error("vocabulary size must be >= 1, got ", vocab_size);
  if (padded_vocab_size < vocab_size)
    user_error("padded vocabulary ", padded_vocab_size, " is smaller than the vocabulary ", vocab_size);
}

RecomputeGranularity parse_recompute_granularity(std::string_view s) {
  if (s == "full") return RecomputeGranularity::kFull;
  if (s == "selective") return RecomputeGranularity::kSelective;
  user_error("--recompute-granularity must be 'full' or 'selective', got '", s, "'");
}

RecomputeMethod parse_recompute_method(std::string_view s) {
  if (s == "uniform") return RecomputeMethod::kUniform;
  if (s == "block") return RecomputeMethod::kBlock;
  user_error("--recompute-method must be 'uniform' or 'block', got '", s, "'");
}

void ModelOptions::validate(const GPTConfig& cfg) const {
  if (compute_dtype != DType::kF32 && compute_dtype != DType::kBF16 && compute_dtype != DType::kF16)
    user_error("the compute dtype must be f32, bf16 (--bf16) or f16 (--fp16), got ", dtype_name(compute_dtype));
  if (grad_dtype != DType::kF32 && grad_dtype != compute_dtype)
    user_error("gradients must be f32 (--accumulate-allreduce-grads-in-fp32) or in the compute dtype ",
               dtype_name(compute_dtype), ", got ", dtype_name(grad_dtype));
  switch (recompute_granularity) {
    case RecomputeGranularity::kNone: break;  // Megatron ignores --recompute-method/-num-layers then
    case RecomputeGranularity::kSelective:
      if (recompute_method != RecomputeMethod::kNone)
        user_error("--recompute-method is not supported with --recompute-granularity selective; drop it");
      if (recompute_num_layers != 0)
        user_error("--recompute-num-layers must not be given with --recompute-granularity selective, got ",
                   recompute_num_layers);
      break;
    case RecomputeGranularity::kFull: {
      if (recompute_method == RecomputeMethod::kNone)
        user_error("--recompute-granularity full needs --recompute-method uniform or block");
      // Megatron counts recomputed layers per pipeline stage.
      const int64_t nl = std::max<int64_t>(local_layer_count(cfg, parallel), 1);
      if (recompute_num_layers < 1 || recompute_num_layers > nl)
        user_error("--recompute-num-layers must be in [1, ", nl, "] (--num-layers",
                   nl == cfg.num_layers ? "" : " per pipeline stage", ") with --recompute-granularity ",
                   granularity_flag(recompute_granularity), ", got ", recompute_num_layers);
      break;
    }
  }
  if (activation_slots < 1) user_error("activation slots (pipeline micro-batches in flight) must be >= 1, got ",
                                       activation_slots);
  const ModelParallel& mp = parallel;
  const int64_t nl = local_layer_count(cfg, mp);
  if (mp.first_layer < 0 || mp.first_layer > cfg.num_layers || nl < 0 || mp.first_layer + nl > cfg.num_layers)
    user_error("pipeline stage layers [", mp.first_layer, ", ", mp.first_layer + nl, ") are not within --num-layers ",
               cfg.num_layers, " (check --pipeline-model-parallel-size / --decoder-first-pipeline-num-layers)");
  const int tp = mp.tp_size();
  if (tp > 1) {
    const int64_t nkv = cfg.num_kv_heads(), f = cfg.ffn_hidden_size();
    if (cfg.num_attention_heads % tp != 0)
      user_error("--num-attention-heads (", cfg.num_attention_heads, ") must be divisible by --tensor-model-parallel-size (",
                 tp, ")");
    if (nkv % tp != 0)
      user_error("--num-query-groups (", nkv, ") must be divisible by --tensor-model-parallel-size (", tp,
                 "): each rank holds whole query groups");
    if (f % tp != 0)
      user_error("--ffn-hidden-size (", f, ") must be divisible by --tensor-model-parallel-size (", tp, ")");
    if (cfg.padded_vocab_size % tp != 0)
      user_error("the padded vocabulary (", cfg.padded_vocab_size, ") must be divisible by --tensor-model-parallel-size (",
                 tp, "); pad it to a multiple of --make-vocab-size-divisible-by x TP");
  }
  if (mp.sequence_parallel && tp == 1)
    user_error("--sequence-parallel needs --tensor-model-parallel-size > 1");
}

int64_t GPTMemoryPlan::parameter_bytes() const {
  int64_t n = 0;
  for (const PlannedBuffer& b : parameters) n += b.bytes();
  return n;
}

int64_t GPTMemoryPlan::activation_bytes() const {
  int64_t n = 0;
  for (const PlannedBuffer& b : activations) n += b.bytes();
  return n;
}


std::vector<GPTModel::LayerRole> GPTModel::layer_roles(const GPTConfig& cfg, const ModelOptions& opts) {
  // Over this stage's layers (local indices), as Megatron recomputes per pipeline stage.
  const int64_t L = local_layer_count(cfg, opts.parallel), N = opts.recompute_num_layers;
  std::vector<LayerRole> roles(static_cast<size_t>(L));
  if (opts.recompute_granularity != RecomputeGranularity::kFull) return roles;
  for (int64_t l = 0; l < L; ++l) {
    LayerRole& r = roles[size_t(l)];
    if (opts.recompute_method == RecomputeMethod::kUniform) {
      r = {true, l / N * N, std::min(l / N * N + N, L)};
    } else if (l < N) {  // block: the first N layers, each on its own
      r = {true, l, l + 1};
    }
  }
  return roles;
}

// The one list of activation buffers: memory_plan() reports it, ensure_buffers() allocates it. Recomputed
// layers own no buffers except a group's output; their LayerActs are bound to scratch_ afterwards. Each
// activation slot has its own saved buffers (named "slot<k>." from the second on); scratch is shared.
std::vector<GPTModel::BufferSlot> GPTModel::activation_layout(const GPTConfig& cfg, const ModelOptions& opts,
                                                              int64_t B, int64_t T, GPTModel* m) {
  const DType cd = opts.compute_dtype, f32 = DType::kF32;
  const Dims d = make_dims(cfg, opts, B, T);
  const int64_t C = d.C, N = d.N, Nl = d.Nl, NHl = d.NHl, A = d.Al;
  const bool selective = opts.recompute_granularity == RecomputeGranularity::kSelective;
  const bool layernorm = cfg.normalization == NormKind::kLayerNorm;  // RMSNorm keeps no mean
  const ModelParallel& mp = opts.parallel;
  const int64_t first = mp.first_layer, nl = local_layer_count(cfg, mp);
  const std::vector<LayerRole> roles = layer_roles(cfg, opts);
  std::vector<BufferSlot> out;
  auto emit = [&](std::string name, Shape s, DType dt, Tensor* target) {
    out.push_back({PlannedBuffer{std::move(name), s, dt}, m ? target : nullptr});
  };
  auto emit_stats = [&](const std::string& name, int64_t rows, Norm::Saved* sv) {
    if (layernorm) emit(name + ".mean", {rows}, f32, sv ? &sv->mean : nullptr);
    emit(name + ".rstd", {rows}, f32, sv ? &sv->rstd : nullptr);
  };
  // All fields of one layer's activations; the attention core output and lse unless selective, the
  // output only when `with_out`.
  auto emit_acts = [&](const std::string& p, LayerActs* a, bool with_att, bool with_out) {
    emit(p + "ln1", d.resid(), cd, a ? &a->ln1 : nullptr);
    emit_stats(p + "ln1", Nl, a ? &a->ln1_saved : nullptr);
    emit(p + "qkv", d.full(d.QKVl), cd, a ? &a->qkv : nullptr);
    if (cfg.qk_layernorm) {
      QKNorm::Saved* q = a ? &a->qk_saved : nullptr;
      emit(p + "q_layernorm.input", d.full(A), cd, q ? &q->q_inp : nullptr);
      emit(p + "k_layernorm.input", d.full(d.NKVl * d.HS), cd, q ? &q->k_inp : nullptr);
      emit_stats(p + "q_layernorm", N * NHl, q ? &q->q : nullptr);
      emit_stats(p + "k_layernorm", N * d.NKVl, q ? &q->k : nullptr);
    }
    if (with_att) {
      emit(p + "attention", d.full(A), cd, a ? &a->att : nullptr);
      emit(p + "attention.lse", {B, NHl, d.Tl}, f32, a ? &a->attn_saved.lse : nullptr);
    }
    emit(p + "residual2", d.resid(), cd, a ? &a->residual2 : nullptr);
    emit(p + "ln2", d.resid(), cd, a ? &a->ln2 : nullptr);
    emit_stats(p + "ln2", Nl, a ? &a->ln2_saved : nullptr);
    emit(p + "fc1", d.full(d.F1l), cd, a ? &a->fc : nullptr);
    if (with_out) emit(p + "output", d.resid(), cd, a ? &a->out : nullptr);
  };

  for (int k = 0; k < opts.activation_slots; ++k) {
    SlotState* S = m ? &m->slots_[size_t(k)] : nullptr;
    const std::string sp = k == 0 ? "" : "slot" + std::to_string(k) + ".";
    emit(sp + (mp.pre_process ? "embedding.output" : "pipeline.input"), d.resid(), cd, S ? &S->x0 : nullptr);
    for (int64_t l = 0; l < nl; ++l) {
      const LayerRole& r = roles[size_t(l)];
      LayerActs* a = S ? &S->acts[size_t(l)] : nullptr;
      const std::string p = sp + "decoder.layers." + std::to_string(first + l) + ".";
      if (!r.recomputed) {
        emit_acts(p, a, !selective, true);
      } else if (l == r.group_end - 1) {
        emit(p + "output", d.resid(), cd, a ? &a->out : nullptr);  // next group's input
      }
    }
    if (mp.post_process) {
      emit(sp + "decoder.final_layernorm.output", d.resid(), cd, S ? &S->lnf : nullptr);
      emit_stats(sp + "decoder.final_layernorm", Nl, S ? &S->lnf_saved : nullptr);
      emit(sp + "output_layer.logits", d.full(d.Vl), cd, S ? &S->logits : nullptr);
      emit(sp + "losses", {B, d.Tl}, f32, S ? &S->losses : nullptr);
    }
    // The gradient at the stage boundary: output_grad() on entry of backward, input_grad() on exit
    // (output_grad is dead once backward has read it, so one buffer serves both).
    if (!mp.pre_process || !mp.post_process)
      emit(sp + "pipeline.grad", d.resid(), cd, S ? &S->pipe_grad : nullptr);
  }
  int64_t slots = 0;
  for (const LayerRole& r : roles)
    if (r.recomputed) slots = std::max(slots, r.group_end - r.group_begin);
  for (int64_t s = 0; s < slots; ++s) {
    // The last slot's output is never needed: a group's last layer writes the kept group output.
    emit_acts("recompute.slot" + std::to_string(s) + ".", m ? &m->scratch_[size_t(s)] : nullptr, true,
              s + 1 < slots);
  }
  if (selective) {
    emit("selective.attention", d.full(A), cd, m ? &m->att_scratch_ : nullptr);
    emit("selective.attention.lse", {B, NHl, d.Tl}, f32, m ? &m->lse_scratch_ : nullptr);
  }
  emit("scratch.mlp_activation", d.full(d.Fl), cd, m ? &m->act_ : nullptr);
  emit("scratch.branch", d.full(C), cd, m ? &m->branch_ : nullptr);
  emit("grad.residual", d.resid(), cd, m ? &m->dres_ : nullptr);
  emit("grad.ln", d.resid(), cd, m ? &m->dln_ : nullptr);
  emit("grad.attention", d.full(A), cd, m ? &m->datt_ : nullptr);
  emit("grad.qkv", d.full(d.QKVl), cd, m ? &m->dqkv_ : nullptr);
  emit("grad.fc1", d.full(d.Fl), cd, m ? &m->dfc_ : nullptr);  // d(MLP activation output), and GeLU's d(fc1)
  if (cfg.qk_layernorm) {
    emit("scratch.qk_layernorm", d.full(A), cd, m ? &m->qk_a_ : nullptr);
    emit("grad.qk_layernorm", d.full(A), cd, m ? &m->qk_b_ : nullptr);
  }
  if (d.sp) {
    emit("tp.sp.gathered", {N, C}, cd, m ? &m->sp_gathered_ : nullptr);
    emit("tp.sp.grad", {N, C}, cd, m ? &m->sp_grad_ : nullptr);
  }
  if (d.TP > 1 && mp.post_process) emit("tp.cross_entropy.stats", {2, N}, f32, m ? &m->ce_stats_ : nullptr);
  if (d.TP > 1 && mp.pre_process) {
    emit("tp.embedding.tokens", {B, d.Tl}, DType::kI32, m ? &m->tp_tokens_ : nullptr);
    if (cfg.position_embedding_type == PositionEmbeddingType::kLearnedAbsolute)
      emit("tp.embedding.positions", {B, d.Tl}, DType::kI32, m ? &m->tp_positions_ : nullptr);
  }
  if (d.CP > 1) {
    const Shape bt{B, d.Tl};
    emit("cp.tokens", bt, DType::kI32, m ? &m->cp_tokens_ : nullptr);
    emit("cp.targets", bt, DType::kI32, m ? &m->cp_targets_ : nullptr);
    emit("cp.loss_mask", bt, f32, m ? &m->cp_loss_mask_ : nullptr);
    emit("cp.position_ids", bt, DType::kI32, m ? &m->cp_position_ids_ : nullptr);
    emit("cp.segment_ids", bt, DType::kI32, m ? &m->cp_segment_ids_ : nullptr);
    emit("cp.positions", bt, DType::kI32, m ? &m->cp_positions_ : nullptr);
  }
  return out;
}

GPTModel::Declared GPTModel::declare_parameters(ParameterSet& ps, const GPTConfig& cfg, const ModelOptions& opts) {
  const ModelParallel& mp = opts.parallel;
  const int tp = mp.tp_size(), r = mp.tp_rank();
  const int64_t nl = local_layer_count(cfg, mp);
  const ShardRange vocab = even_shard(cfg.padded_vocab_size, tp, r);
  Declared d;
  auto unit = [&](std::string name, auto&& build) {
    const size_t begin = ps.all().size();
    build();
    d.units.push_back({std::move(name), {begin, ps.all().size()}});
  };
  if (mp.pre_process) {
    unit("embedding", [&] {
      const bool learned = cfg.position_embedding_type == PositionEmbeddingType::kLearnedAbsolute;
      const int64_t P = learned ? cfg.max_position_embeddings : 0;
      d.embedding = tp == 1 ? std::make_unique<Embedding>(ps, cfg.padded_vocab_size, cfg.hidden_size, P,
                                                          cfg.init_method_std)
                            : std::make_unique<Embedding>(ps, cfg.padded_vocab_size, cfg.hidden_size, P,
                                                          cfg.init_method_std, vocab);
    });
  }
  for (int64_t l = 0; l < nl; ++l) {
    const int64_t g = mp.first_layer + l;
    unit("decoder.layers." + std::to_string(g),
         [&] { d.layers.push_back(std::make_unique<Layer>(ps, cfg, g, tp, r)); });
  }
  if (mp.post_process) {
    unit("head", [&] {
      d.final_ln = std::make_unique<Norm>(ps, "decoder.final_layernorm", cfg.hidden_size, cfg.layernorm_epsilon,
                                          cfg.normalization);
      // Megatron initialises the untied output layer with init_method (not the scaled one).
      if (cfg.untie_embeddings_and_output_weights) {
        d.output_layer = std::make_unique<Linear>(
            tp == 1 ? Linear(ps, "output_layer", cfg.hidden_size, cfg.padded_vocab_size, false, cfg.init_method_std)
                    : Linear(ps, "output_layer", cfg.hidden_size, cfg.padded_vocab_size, false, cfg.init_method_std, 0,
                             {vocab}));
      } else if (!mp.pre_process) {
        // The last stage's copy of the tied word embedding: the same name, so it initialises to the same
        // values as the first stage's; its gradient is summed with that one over the embedding group.
        const Shape g{cfg.padded_vocab_size, cfg.hidden_size};
        d.tied_copy = tp == 1 ? &ps.add("embedding.word_embeddings.weight", g, InitKind::kNormal,
                                        cfg.init_method_std, false, 0)
                              : &ps.add_sharded("embedding.word_embeddings.weight", g, 0, {vocab}, InitKind::kNormal,
                                                cfg.init_method_std, false);
        d.tied_copy->tied_embedding_copy = true;
      }
    });
  }
  // Gradients that are partial sums over the TP group (summed there before the optimizer, see
  // Parameter::sequence_parallel): with SP the norms and the row-parallel biases see this rank's token
  // shard only; with TP the qk-norms see this rank's heads only.
  for (size_t i = 0; i < ps.all().size(); ++i) {
    Parameter& p = ps.all()[i];
    const std::string& n = p.name;
    auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
    const bool qk = has("q_layernorm") || has("k_layernorm");
    if (tp > 1 && qk) p.sequence_parallel = true;
    if (mp.sequence_parallel && !qk &&
        (has("input_layernorm.") || has("pre_mlp_layernorm.") || has("final_layernorm.") ||
         has("linear_proj.bias") || has("linear_fc2.bias")))
      p.sequence_parallel = true;
  }
  return d;
}

GPTMemoryPlan GPTModel::memory_plan(const GPTConfig& cfg, const ModelOptions& opts, int64_t B, int64_t T) {
  cfg.validate();
  opts.validate(cfg);
  LOOM_CHECK(B >= 1 && T >= 1, "[GPTModel] memory_plan needs a positive micro-batch shape, got B=", B, " T=", T);
  const ModelParallel& mp = opts.parallel;
  if (T % (2 * mp.cp_size()) != 0 && mp.cp_size() > 1)
    user_error("--seq-length ", T, " must be divisible by 2 x --context-parallel-size (", 2 * mp.cp_size(), ")");
  if (mp.sequence_parallel && (B * T / mp.cp_size()) % mp.tp_size() != 0)
    user_error("--sequence-parallel: the micro-batch's ", B * T / mp.cp_size(),
               " tokens (--micro-batch-size x --seq-length / CP) must be divisible by --tensor-model-parallel-size ",
               mp.tp_size());
  GPTMemoryPlan plan;
  ParameterSet declared;  // the local parameters, declared but never allocated
  declare_parameters(declared, cfg, opts);
  const int64_t n = declared.numel();
  plan.parameters.push_back({"params.values", {n}, DType::kF32});
  if (opts.compute_dtype != DType::kF32) plan.parameters.push_back({"params.compute", {n}, opts.compute_dtype});
  if (opts.with_grads) plan.parameters.push_back({"params.grads", {n}, opts.grad_dtype});
  if (cfg.position_embedding_type == PositionEmbeddingType::kRope) {
    const Shape table{cfg.max_position_embeddings, cfg.rotary_dim() / 2};
    plan.parameters.push_back({"rope.cos", table, DType::kF32});
    plan.parameters.push_back({"rope.sin", table, DType::kF32});
  }
  for (BufferSlot& s : activation_layout(cfg, opts, B, T, nullptr)) plan.activations.push_back(std::move(s.buffer));
  return plan;
}

GPTModel::GPTModel(const GPTConfig& cfg, const DeviceContext& ctx, const ModelOptions& opts)
    : cfg_(cfg), opts_(opts), ctx_(ctx) {
  cfg_.validate();
  opts_.validate(cfg_);
  Declared d = declare_parameters(params_, cfg_, opts_);
  embedding_ = std::move(d.embedding);
  layers_ = std::move(d.layers);
  final_ln_ = std::move(d.final_ln);
  output_layer_ = std::move(d.output_layer);
  tied_copy_ = d.tied_copy;
  params_.allocate(ctx, opts_.compute_dtype, opts_.grad_dtype, opts_.with_grads, opts_.param_storage);
  for (const auto& [name, range] : d.units) {
    ParamUnit u;
    u.name = name;
    if (range.second > range.first) {
      const Parameter& first = params_.all()[range.first];
      const Parameter& last = params_.all()[range.second - 1];
      u.offset = first.offset;
      u.numel = last.offset + last.shape.numel() - first.offset;
    }
    if (name == "embedding") embedding_unit_ = int(units_.size());
    if (name == "head") head_unit_ = int(units_.size());
    units_.push_back(std::move(u));
  }
  first_layer_unit_ = embedding_unit_ >= 0 ? 1 : 0;
  if (cfg.position_embedding_type == PositionEmbeddingType::kRope)
    rope_ = std::make_unique<RotaryEmbedding>(ctx, cfg.rotary_options(), cfg.max_position_embeddings);
  roles_ = layer_roles(cfg_, opts_);
  slots_.resize(size_t(opts_.activation_slots));
  for (SlotState& s : slots_) s.acts.resize(layers_.size());
  acts_.resize(layers_.size());
  int64_t slots = 0;
  for (const LayerRole& r : roles_)
    if (r.recomputed) slots = std::max(slots, r.group_end - r.group_begin);
  scratch_.resize(size_t(slots));
}

GPTModel::~GPTModel() = default;

void GPTModel::store_slot() {
  SlotState& s = slots_[size_t(slot_)];
  s.x0 = x0_;
  s.acts = acts_;
  s.lnf = lnf_;
  s.lnf_saved = lnf_saved_;
  s.logits = logits_;
  s.losses = losses_;
  s.pipe_grad = pipe_grad_;
  s.fwd = fwd_;
  s.backward_ready = backward_ready_;
}

void GPTModel::load_slot() {
  const SlotState& s = slots_[size_t(slot_)];
  x0_ = s.x0;
  acts_ = s.acts;
  lnf_ = s.lnf;
  lnf_saved_ = s.lnf_saved;
  logits_ = s.logits;
  losses_ = s.losses;
  pipe_grad_ = s.pipe_grad;
  fwd_ = s.fwd;
  backward_ready_ = s.backward_ready;
}

void GPTModel::set_slot(int slot) {
  LOOM_CHECK(slot >= 0 && slot < opts_.activation_slots, "[GPTModel] slot ", slot, " outside [0, ",
             opts_.activation_slots, ") (ModelOptions::activation_slots)");
  if (slot == slot_) return;
  store_slot();
  slot_ = slot;
  load_slot();
}

void GPTModel::prepare(int64_t B, int64_t T) { ensure_buffers(B, T); }

TensorView GPTModel::input() const {
  LOOM_CHECK(B_ > 0, "[GPTModel] input() before prepare()/forward(): the micro-batch shape is unknown");
  return x0_;
}
TensorView GPTModel::output() const {
  LOOM_CHECK(B_ > 0, "[GPTModel] output() before prepare()/forward()");
  return layer_input(int64_t(layers_.size()));
}
TensorView GPTModel::output_grad() const {
  LOOM_CHECK(pipe_grad_.defined(), "[GPTModel] output_grad() needs a stage without post_process, after prepare()");
  return pipe_grad_;
}
TensorView GPTModel::input_grad() const {
  LOOM_CHECK(pipe_grad_.defined(), "[GPTModel] input_grad() needs a stage without pre_process, after prepare()");
  return pipe_grad_;
}

void GPTModel::ensure_buffers(int64_t B, int64_t T) {
  if (B == B_ && T == T_) return;
  const ModelParallel& mp = opts_.parallel;
  LOOM_CHECK(B >= 1 && T >= 1, "[GPTModel] micro-batch shape must be positive, got B=", B, " T=", T);
  if (mp.cp_size() > 1 && T % (2 * mp.cp_size()) != 0)
    user_error("--seq-length ", T, " must be divisible by 2 x --context-parallel-size (", 2 * mp.cp_size(), ")");
  if (mp.sequence_parallel && (B * T / mp.cp_size()) % mp.tp_size() != 0)
    user_error("--sequence-parallel: the micro-batch's ", B * T / mp.cp_size(),
               " tokens (--micro-batch-size x --seq-length / CP) must be divisible by --tensor-model-parallel-size ",
               mp.tp_size());
  // Free the old set before allocating the new one so the two never coexist.
  if (B_ > 0)
    for (BufferSlot& s : activation_layout(cfg_, opts_, B_, T_, this)) *s.target = Tensor();
  for (SlotState& s : slots_) s = SlotState{{}, std::vector<LayerActs>(layers_.size()), {}, {}, {}, {}, {}, {}, false};
  load_slot();
  scratch_.assign(scratch_.size(), LayerActs{});
  activation_bytes_ = 0;

  for (BufferSlot& s : activation_layout(cfg_, opts_, B, T, this)) {
    *s.target = ctx_.empty(s.buffer.shape, s.buffer.dtype);
    activation_bytes_ += s.target->nbytes();
  }
  for (SlotState& S : slots_) {
    // Bind recomputed layers to their scratch slot (sharing storage), keeping a group's own output.
    for (size_t l = 0; l < S.acts.size(); ++l) {
      const LayerRole& r = roles_[l];
      if (!r.recomputed) continue;
      const bool last = int64_t(l) == r.group_end - 1;
      Tensor kept_out = S.acts[l].out;
      S.acts[l] = scratch_[size_t(int64_t(l) - r.group_begin)];
      if (last) S.acts[l].out = kept_out;
    }
    if (opts_.recompute_granularity == RecomputeGranularity::kSelective) {
      for (LayerActs& a : S.acts) {
        a.att = att_scratch_;
        a.attn_saved.lse = lse_scratch_;
      }
    }
  }
  load_slot();
  B_ = B;
  T_ = T;
}

DropoutMask GPTModel::hidden_mask(uint64_t site) const {
  if (!fwd_.training || cfg_.hidden_dropout <= 0.0f) return {};
  return {cfg_.hidden_dropout, fwd_.dropout_seed, dropout_stream(site, fwd_.micro_batch_index)};
}

DropoutMask GPTModel::attention_mask(uint64_t site) const {
  if (!fwd_.training || cfg_.attention_dropout <= 0.0f) return {};
  // With TP > 1 a rank draws the probabilities of its own heads from a stream of its own (Megatron's
  // model-parallel RNG tracker): the masks differ from a single process's (the attention op indexes
  // local heads), the dropout rate and the expectation do not.
  const int tp = opts_.parallel.tp_size();
  const uint64_t s = tp > 1 ? site ^ mix64(0x7470ull + uint64_t(opts_.parallel.tp_rank())) : site;
  return {cfg_.attention_dropout, fwd_.dropout_seed, dropout_stream(s, fwd_.micro_batch_index)};
}

Parameter& GPTModel::output_weight() const {
  if (output_layer_) return output_layer_->weight();
  if (tied_copy_) return *tied_copy_;
  return embedding_->word_embeddings();
}

TensorView GPTModel::layer_input(int64_t l) const {
  return l == 0 ? TensorView(x0_) : TensorView(acts_[size_t(l - 1)].out);
}

TensorView GPTModel::column_input(TensorView shard) const {
  if (!opts_.parallel.sequence_parallel) return shard;
  sp_all_gather(opts_.parallel.tp, sp_gathered_, shard);
  return sp_gathered_;
}

TensorView GPTModel::column_input_grad() const {
  return opts_.parallel.sequence_parallel ? TensorView(sp_grad_) : TensorView(dln_);
}

void GPTModel::reduce_column_input_grad() const {
  // The input of a column-parallel layer is replicated (or all-gathered): its gradient is the sum of
  // every rank's partial gradient, reduce-scattered back to the token shard under SP.
  if (opts_.parallel.sequence_parallel) sp_reduce_scatter(opts_.parallel.tp, dln_, sp_grad_);
  else tp_all_reduce(opts_.parallel.tp, dln_);
}

// Forward of a row-parallel layer into the residual stream, dropout included. Returns the branch output
// in the residual layout: out_full itself, or (SP) shard_out. The bias is added by TP rank 0 only, before
// the reduction; under SP dropout runs before the reduce-scatter on every rank's partial sum with the
// single-process mask of the full (N, C) tensor (dropout is linear in its input, so the reduced result is
// the single-process one).
TensorView GPTModel::row_parallel_forward(const Linear& lin, TensorView out_full, TensorView inp,
                                          const DropoutMask& drop, TensorView shard_out) const {
  const ModelParallel& mp = opts_.parallel;
  if (mp.tp_size() == 1) {
    lin.forward(ctx_, out_full, inp);
    dropout_forward(ctx_, out_full, out_full, drop);
    return out_full;
  }
  Parameter* b = lin.bias();
  ctx_.ops().matmul_forward(out_full, inp, lin.weight().compute,
                            b != nullptr && mp.tp_rank() == 0 ? b->compute.view() : TensorView());
  if (mp.sequence_parallel) {
    dropout_forward(ctx_, out_full, out_full, drop);
    sp_reduce_scatter(mp.tp, shard_out, out_full);
    return shard_out;
  }
  tp_all_reduce(mp.tp, out_full);
  dropout_forward(ctx_, out_full, out_full, drop);
  return out_full;
}

// dout: d(branch output) in the residual layout. Without SP it is replicated: every rank computes the
// whole (replicated) bias gradient. With SP it is all-gathered first and the bias gradient sums this
// rank's token rows only (a partial sum: the bias is marked sequence_parallel).
void GPTModel::row_parallel_backward(const Linear& lin, TensorView dinp, TensorView dout, TensorView inp,
                                     const DropoutMask& drop) const {
  const ModelParallel& mp = opts_.parallel;
  if (!mp.sequence_parallel) {
    TensorView d = dout;
    if (drop.active()) {
      dropout_backward(ctx_, branch_, dout, drop);
      d = branch_;
    }
    lin.backward(ctx_, dinp, d, inp);
    return;
  }
  const Dims dm = make_dims(cfg_, opts_, B_, T_);
  const TensorView full = TensorView(branch_).reshape({dm.N, dm.C});
  sp_all_gather(mp.tp, full, dout);
  dropout_backward(ctx_, full, full, drop);
  ctx_.ops().matmul_backward(dinp, lin.weight().grad, TensorView(), full, inp, lin.weight().compute);
  if (Parameter* b = lin.bias())
    ctx_.ops().bias_backward(b->grad, full.slice_flat(int64_t(mp.tp_rank()) * dm.Nl * dm.C, {dm.Nl, dm.C}));
}

void GPTModel::forward_layer(int64_t l, TensorView segment_ids) {
  const Layer& L = *layers_[size_t(l)];
  LayerActs& a = acts_[size_t(l)];
  const bool sp = opts_.parallel.sequence_parallel;
  const TensorView x = layer_input(l);
  L.ln1.forward(ctx_, a.ln1, a.ln1_saved, x);
  L.qkv.forward(ctx_, a.qkv, column_input(a.ln1));
  if (L.qk_norm) L.qk_norm->forward(ctx_, a.qkv, a.qk_saved, qk_a_);
  if (rope_) rope_->forward(ctx_, a.qkv, L.attn.params(), cp_positions_);  // in place: attention reads rotated q, k
  attention_forward(L, a, segment_ids, attention_mask(L.attn_dropout_site));
  // Bias-dropout-add: the bias is part of the linear output, dropout follows, then the residual add.
  const TensorView attn_out = row_parallel_forward(L.proj, branch_, a.att, hidden_mask(L.proj_dropout_site), dln_);
  L.ln2.forward_residual(ctx_, a.residual2, a.ln2, a.ln2_saved, x, attn_out);
  L.fc1.forward(ctx_, a.fc, column_input(a.ln2));
  mlp_activation_forward(a.fc);
  row_parallel_forward(L.fc2, sp ? TensorView(branch_) : TensorView(a.out), act_, hidden_mask(L.mlp_dropout_site),
                       a.out);
  ctx_.ops().residual_forward(a.out, a.out, a.residual2);
}

// The attention core over this rank's tokens: the CP ring over the whole sequence when CP > 1.
void GPTModel::attention_forward(const Layer& L, LayerActs& a, TensorView segment_ids, const DropoutMask& drop) {
  if (opts_.parallel.cp_size() == 1) {
    L.attn.forward(ctx_, a.att, a.attn_saved, a.qkv, segment_ids, drop);
    return;
  }
  a.attn_saved.dropout = drop;
  ContextParallelAttention::forward(ctx_, a.att, a.attn_saved.lse, a.qkv, with_dropout(L.attn.params(), drop),
                                    *opts_.parallel.cp, segment_ids);
}

GPTBatch GPTModel::local_batch(const GPTBatch& batch) {
  const ModelParallel& mp = opts_.parallel;
  if (mp.cp_size() == 1) return batch;
  const int cp = mp.cp_size(), r = mp.cp_rank();
  GPTBatch lb;
  auto slice = [&](const Tensor& dst, TensorView src) -> TensorView {
    if (!src.defined()) return {};
    cp_slice_sequence(ctx_, dst, src, cp, r);
    return dst;
  };
  lb.tokens = slice(cp_tokens_, batch.tokens);
  lb.targets = slice(cp_targets_, batch.targets);
  lb.loss_mask = slice(cp_loss_mask_, batch.loss_mask);
  lb.segment_ids = slice(cp_segment_ids_, batch.segment_ids);
  // Global positions of the local tokens (RoPE always; learned positions unless position_ids are given).
  const std::vector<int32_t> pos = cp_local_positions(T_, cp, r);
  const int64_t Tl = T_ / cp;
  for (int64_t b = 0; b < B_; ++b) std::copy(pos.begin(), pos.end(), cp_positions_.data<int32_t>() + b * Tl);
  lb.position_ids = batch.position_ids.defined() ? slice(cp_position_ids_, batch.position_ids) : TensorView(cp_positions_);
  return lb;
}

void GPTModel::mlp_activation_forward(TensorView fc) const {
  const Dims d = make_dims(cfg_, opts_, B_, T_);
  const int64_t N = d.N, F = d.Fl;
  switch (cfg_.activation) {
    case MlpActivation::kGeLU: ctx_.ops().gelu_forward(act_, fc); return;
    case MlpActivation::kSwiGLU:
    case MlpActivation::kGeGLU:
    case MlpActivation::kReGLU: ctx_.ops().glu_forward(act_.reshape({N, F}), fc.reshape({N, 2 * F}), glu_kind()); return;
  }
}

GluKind GPTModel::glu_kind() const {
  switch (cfg_.activation) {
    case MlpActivation::kGeGLU: return GluKind::kGeGLU;
    case MlpActivation::kReGLU: return GluKind::kReGLU;
    default: return GluKind::kSwiGLU;
  }
}

// Enters with dres_ = d(layer output), leaves with dres_ = d(layer input).
void GPTModel::backward_layer(int64_t l, TensorView segment_ids) {
  const Layer& L = *layers_[size_t(l)];
  LayerActs& a = acts_[size_t(l)];
  const OpTable& ops = ctx_.ops();
  // MLP branch: dres is d(out) = d(residual2) through the skip connection.
  mlp_activation_forward(a.fc);  // recompute instead of saving B·T·F per layer
  row_parallel_backward(L.fc2, dfc_, dres_, act_, hidden_mask(L.mlp_dropout_site));  // dfc_ = d(act output)
  TensorView dfc1 = dfc_;
  if (cfg_.gated_mlp()) {
    // d[gate | up] is twice as wide as dfc_; it overwrites fc1's output in place (the op allows dinp to
    // alias inp), which nothing reads after this point.
    const Dims d = make_dims(cfg_, opts_, B_, T_);
    const int64_t N = d.N, F = d.Fl;
    ops.glu_backward(a.fc.reshape({N, 2 * F}), a.fc.reshape({N, 2 * F}), dfc_.reshape({N, F}), glu_kind());
    dfc1 = a.fc;
  } else {
    ops.gelu_backward(dfc_, a.fc, dfc_);
  }
  L.fc1.backward(ctx_, column_input_grad(), dfc1, column_input(a.ln2));
  reduce_column_input_grad();
  L.ln2.backward(ctx_, dres_, dln_, a.residual2, a.ln2_saved);
  // Attention branch: dres is now d(residual2) = d(x) through the skip connection.
  if (opts_.recompute_granularity == RecomputeGranularity::kSelective)
    attention_forward(L, a, segment_ids, a.attn_saved.dropout);
  row_parallel_backward(L.proj, datt_, dres_, a.att, hidden_mask(L.proj_dropout_site));
  if (opts_.parallel.cp_size() > 1)
    ContextParallelAttention::backward(ctx_, dqkv_, datt_, a.qkv, a.att, a.attn_saved.lse,
                                       with_dropout(L.attn.params(), a.attn_saved.dropout), *opts_.parallel.cp,
                                       segment_ids);
  else
    L.attn.backward(ctx_, dqkv_, datt_, a.qkv, a.att, a.attn_saved, segment_ids);
  if (rope_) rope_->backward(ctx_, dqkv_, L.attn.params(), cp_positions_);
  if (L.qk_norm) L.qk_norm->backward(ctx_, dqkv_, a.qk_saved, qk_a_, qk_b_);
  L.qkv.backward(ctx_, column_input_grad(), dqkv_, column_input(a.ln1));
  reduce_column_input_grad();
  L.ln1.backward(ctx_, dres_, dln_, layer_input(l), a.ln1_saved);
}

// Embedding output (after dropout) into x0_. TP > 1: vocabulary-parallel lookup (rows of other ranks'
// tokens are 0; the positions added by TP rank 0), summed over the group (reduce-scattered to the token
// shard under SP, with dropout before, on the full tensor, as for row-parallel layers).
void GPTModel::embedding_forward(const GPTBatch& batch) {
  const ModelParallel& mp = opts_.parallel;
  const DropoutMask drop = hidden_mask(embedding_dropout_site());
  if (mp.tp_size() == 1) {
    embedding_->forward(ctx_, x0_, batch.tokens, batch.position_ids);
    dropout_forward(ctx_, x0_, x0_, drop);
    return;
  }
  const Dims d = make_dims(cfg_, opts_, B_, T_);
  Parameter* wpe = embedding_->position_embeddings();
  vocab_local_tokens(tp_tokens_, tp_outside_, batch.tokens, d.vocab_start, d.Vl);
  if (wpe) embedding_positions(tp_positions_, batch.position_ids);
  const TensorView out = mp.sequence_parallel ? TensorView(branch_) : TensorView(x0_);
  const TensorView scratch = mp.sequence_parallel ? TensorView(sp_grad_) : TensorView(dres_);
  vocab_parallel_embedding_forward(ctx_, out, tp_tokens_, tp_outside_, embedding_->word_embeddings().compute,
                                   wpe ? wpe->compute.view() : TensorView(), tp_positions_, mp.tp_rank() == 0,
                                   scratch);
  if (mp.sequence_parallel) {
    dropout_forward(ctx_, out, out, drop);
    sp_reduce_scatter(mp.tp, x0_, out);
  } else {
    tp_all_reduce(mp.tp, x0_);
    dropout_forward(ctx_, x0_, x0_, drop);
  }
}

// Enters with dres_ = d(x0_).
void GPTModel::embedding_backward(const GPTBatch& batch) {
  const ModelParallel& mp = opts_.parallel;
  const DropoutMask drop = hidden_mask(embedding_dropout_site());
  if (mp.tp_size() == 1) {
    dropout_backward(ctx_, dres_, dres_, drop);
    embedding_->backward(ctx_, dres_, batch.tokens, batch.position_ids);
    return;
  }
  const Dims d = make_dims(cfg_, opts_, B_, T_);
  TensorView dout = dres_;
  if (mp.sequence_parallel) {
    dout = TensorView(branch_);
    sp_all_gather(mp.tp, dout, dres_);
  }
  dropout_backward(ctx_, dout, dout, drop);
  Parameter* wpe = embedding_->position_embeddings();
  vocab_local_tokens(tp_tokens_, tp_outside_, batch.tokens, d.vocab_start, d.Vl);
  if (wpe) embedding_positions(tp_positions_, batch.position_ids);
  vocab_parallel_embedding_backward(ctx_, embedding_->word_embeddings().grad, wpe ? wpe->grad.view() : TensorView(),
                                    dout, tp_tokens_, tp_outside_, tp_positions_);
}

float GPTModel::forward(const GPTBatch& batch, float dloss_scale, const ForwardOptions& opts) {
  const ModelParallel& mp = opts_.parallel;
  const TensorView tokens = batch.tokens, targets = batch.targets;
  LOOM_CHECK(opts.training || dloss_scale == 0.0f,
             "[GPTModel] an evaluation forward (training = false) cannot prepare backward; dloss_scale must be 0, got ",
             dloss_scale);
  // A middle pipeline stage may run without tokens: the shape then comes from prepare().
  const TensorView shape_src = tokens.defined() ? tokens : batch.segment_ids;
  int64_t B = B_, T = T_;
  if (shape_src.defined()) {
    LOOM_CHECK(shape_src.ndim() == 2, "[GPTModel] tokens must be (B, T), got ", shape_src.desc());
    B = shape_src.size(0);
    T = shape_src.size(1);
  }
  LOOM_CHECK(B > 0, "[GPTModel] forward() without tokens needs prepare(B, T) first");
  for (const TensorView* t : {&batch.tokens, &batch.targets, &batch.loss_mask, &batch.position_ids, &batch.segment_ids})
    LOOM_CHECK(!t->defined() || (t->ndim() == 2 && t->size(0) == B && t->size(1) == T),
               "[GPTModel] batch tensors must be (B, T) = (", B, ", ", T, "), got ", t->desc());
  if (mp.pre_process)
    LOOM_CHECK(tokens.defined() && tokens.dtype() == DType::kI32, "[GPTModel] tokens must be i32 (B, T), got ",
               tokens.desc());
  if (mp.post_process)
    LOOM_CHECK(targets.defined() && targets.dtype() == DType::kI32, "[GPTModel] targets must be i32 (B, T), got ",
               targets.desc());
  LOOM_CHECK(T <= cfg_.max_position_embeddings || cfg_.position_embedding_type == PositionEmbeddingType::kNone,
             "[GPTModel] sequence length ", T, " exceeds --max-position-embeddings ", cfg_.max_position_embeddings);
  backward_ready_ = false;
  ensure_buffers(B, T);
  fwd_ = opts;
  const OpTable& ops = ctx_.ops();
  const GPTBatch batch_in = batch;
  const GPTBatch local = local_batch(batch_in);
  {
  const GPTBatch& batch = local;  // this rank's tokens from here on
  const TensorView targets = batch.targets;

  if (mp.pre_process) {
    call_hook(&ParamHooks::before_forward, embedding_unit_);
    embedding_forward(batch);
    call_hook(&ParamHooks::after_forward, embedding_unit_);
  }
  const int64_t nl = int64_t(layers_.size());
  for (int64_t l = 0; l < nl; ++l) {
    call_hook(&ParamHooks::before_forward, first_layer_unit_ + int(l));
    forward_layer(l, batch.segment_ids);
    call_hook(&ParamHooks::after_forward, first_layer_unit_ + int(l));
  }
  if (!mp.post_process) {
    backward_ready_ = opts.training && opts_.with_grads;
    return 0.0f;
  }
  call_hook(&ParamHooks::before_forward, head_unit_);
  const Dims d = make_dims(cfg_, opts_, B, T);
  final_ln_->forward(ctx_, lnf_, lnf_saved_, layer_input(nl));
  ops.matmul_forward(logits_, column_input(lnf_), output_weight().compute, TensorView());
  const int64_t N = d.N;
  const TensorView mask = batch.loss_mask.defined() ? batch.loss_mask.reshape({N}) : TensorView();
  // CP: each rank's gradient is CP x its share of d(mean loss), so the average over dp_cp (DP x CP
  // replicas, what the gradient reduction computes) is the DP average of whole-micro-batch gradients.
  dloss_scale *= float(d.CP);
  if (d.TP == 1) {
    ops.cross_entropy_forward_backward(losses_.reshape({N}), logits_.reshape({N, cfg_.padded_vocab_size}),
                                       targets.reshape({N}), cfg_.vocab_size, mask, dloss_scale);
  } else {
    vocab_parallel_cross_entropy(ctx_, mp.tp, losses_.reshape({N}), logits_.reshape({N, d.Vl}), targets.reshape({N}),
                                 d.vocab_start, cfg_.vocab_size, mask, dloss_scale, ce_stats_);
  }
  call_hook(&ParamHooks::after_forward, head_unit_);
  backward_ready_ = dloss_scale != 0.0f;
  double sum = 0, count = 0;
  const float* lp = losses_.data<float>();
  const float* mp_ = mask.defined() ? mask.data<float>() : nullptr;
  for (int64_t i = 0; i < N; ++i) {
    const double w = mp_ ? double(mp_[i]) : 1.0;
    if (w != 0.0) sum += w * double(lp[i]);
    count += w;
  }
  if (d.CP > 1) {  // the mean over the whole micro-batch
    sum = mp.cp->all_reduce_scalar(sum);
    count = mp.cp->all_reduce_scalar(count);
  }
  return count > 0 ? float(sum / count) : 0.0f;
  }
}

void GPTModel::backward(const GPTBatch& batch_in) {
  LOOM_CHECK(opts_.with_grads, "[GPTModel] backward() on a model built without gradients (ModelOptions::with_grads)");
  LOOM_CHECK(backward_ready_, "[GPTModel] backward() needs a preceding forward() with dloss_scale != 0");
  const TensorView shape_src = batch_in.tokens.defined() ? batch_in.tokens : batch_in.segment_ids;
  LOOM_CHECK(!shape_src.defined() || (shape_src.ndim() == 2 && shape_src.size(0) == B_ && shape_src.size(1) == T_),
             "[GPTModel] backward() batch must be the forward's (", B_, ", ", T_, "), got ", shape_src.desc());
  const ModelParallel& mp = opts_.parallel;
  LOOM_CHECK(!mp.pre_process || batch_in.tokens.defined(), "[GPTModel] backward() needs the batch's tokens");
  backward_ready_ = false;
  const GPTBatch batch = local_batch(batch_in);
  const OpTable& ops = ctx_.ops();
  const int64_t nl = int64_t(layers_.size());
  if (mp.post_process) {
    call_hook(&ParamHooks::before_backward, head_unit_);
    const Dims d = make_dims(cfg_, opts_, B_, T_);
    // Output layer: dlnf = dlogits · W; dW += dlogits^T · lnf (W: output_layer.weight, or the tied Wte).
    Parameter& w = output_weight();
    ops.matmul_backward(column_input_grad(), w.grad, TensorView(), logits_.reshape({d.N, d.Vl}), column_input(lnf_),
                        w.compute);
    reduce_column_input_grad();
    ops.fill_(dres_, 0.0f);
    final_ln_->backward(ctx_, dres_, dln_, layer_input(nl), lnf_saved_);
    call_hook(&ParamHooks::after_backward, head_unit_);
  } else {
    ops.cast(dres_, pipe_grad_);  // output_grad()
  }
  for (int64_t l = nl; l-- > 0;) {
    const LayerRole& r = roles_[size_t(l)];
    const int u = first_layer_unit_ + int(l);
    // Entering a recomputed group from its top: re-run it from its kept input into the scratch slots
    // (its units' parameters are needed from here on: before_backward for all of them first).
    if (r.recomputed && l == r.group_end - 1) {
      for (int64_t g = r.group_end; g-- > r.group_begin;) call_hook(&ParamHooks::before_backward, first_layer_unit_ + int(g));
      for (int64_t g = r.group_begin; g < r.group_end; ++g) forward_layer(g, batch.segment_ids);
    } else if (!r.recomputed) {
      call_hook(&ParamHooks::before_backward, u);
    }
    backward_layer(l, batch.segment_ids);
    call_hook(&ParamHooks::after_backward, u);
  }
  if (mp.pre_process) {
    call_hook(&ParamHooks::before_backward, embedding_unit_);
    embedding_backward(batch);
    call_hook(&ParamHooks::after_backward, embedding_unit_);
  } else {
    ops.cast(pipe_grad_, dres_);  // input_grad()
  }
}

}  // namespace loom
