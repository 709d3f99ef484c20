// GPT- and Llama-family decoder assembled from nn modules, with Megatron-core's parameter names:
//   embedding.word_embeddings.weight (Vp, C), embedding.position_embeddings.weight (P, C) [learned_absolute]
//   decoder.layers.N.input_layernorm.{weight,bias}            bias only for LayerNorm
//   decoder.layers.N.self_attention.linear_qkv.{weight,bias}   ((NH + 2·NKV)·HS, C), grouped layout
//   decoder.layers.N.self_attention.linear_proj.{weight,bias}  (C, NH·HS)
//   decoder.layers.N.self_attention.{q,k}_layernorm.{weight,bias}  (HS) with --qk-layernorm
//   decoder.layers.N.pre_mlp_layernorm.{weight,bias}
//   decoder.layers.N.mlp.linear_fc1.{weight,bias}  (F, C), or (2F, C) = [gate | up] for gated MLPs
//   decoder.layers.N.mlp.linear_fc2.{weight,bias}  (C, F)
//   decoder.final_layernorm.{weight,bias}; output_layer.weight (Vp, C) when untied (else the word embedding).
// Linear biases exist unless --disable-bias-linear (the qkv bias comes back with --add-qkv-bias).
// Pre-LN layers: x += drop(proj(attn(rope(qknorm(qkv(ln1(x))))))); x += drop(fc2(act(fc1(ln2(x))))), with
// Megatron's dropout sites: the embedding output and both bias-dropout-adds use --hidden-dropout, the
// attention probabilities --attention-dropout. qkv uses Megatron's grouped layout (per query group: its
// NH/NKV query heads, its key head, its value head). RoPE (--position-embedding-type rope) rotates the q and
// k heads in place by the token's index in the sequence (as Megatron-core: --reset-position-ids moves
// learned position embeddings only; RoPE scores depend on i - j alone, so within a document the two agree).
// docs/models.md lists every option and its flag.
//
// Mixed precision (Megatron's --bf16 / --fp16): the ParameterSet keeps f32 master weights and a compute
// copy (ModelOptions::compute_dtype) the ops read; gradients accumulate in ModelOptions::grad_dtype (f32
// main grads by default). Activations and the logits are in the compute dtype; norm/attention
// statistics and the per-token losses are f32 (cross-entropy computes in f32 and writes dlogits in place).
//
// Activation memory: per layer the saved tensors of LayerActs (+ statistics); the MLP activation output is
// not saved but recomputed in backward from fc1's output (a gated MLP's backward then overwrites fc1's
// output with its gradient, which nothing reads again). Recomputation (Megatron's
// --recompute-granularity/--recompute-method/--recompute-num-layers) removes buffers for real:
//   selective    the attention core output and its lse are not kept per layer; one shared scratch holds
//                them and backward re-runs the core just before linear_proj's backward needs it;
//   full uniform layers in groups of N keep only the group output (the next group's input); backward
//                re-runs each group forward from its input into one shared scratch sized for a group;
//   full block   the first N layers are recomputed one at a time that way; the others keep everything.
// Recomputed forwards regenerate the same dropout masks (Philox, keyed by site and micro-batch), so losses
// and every gradient are bit-identical to no recomputation. memory_plan() lists every buffer the model
// allocates; the model allocates exactly those (loom calc predicts memory from the same numbers).
// Gradient scratch (dres, dln, datt, dqkv, dfc, qk-norm) is shared by all layers since backward visits one
// at a time.
#pragma once
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loom/dist/communicator.h"
#include "loom/fp8/fp8.h"
#include "loom/nn/lora.h"
#include "loom/nn/modules.h"
#include "loom/nn/moe.h"
#include "loom/parallel/moe_dispatch.h"
#include "loom/parallel/parallel_linear.h"

namespace loom {

class TransformerLayer;  // model/transformer_layer.h (private to the model layer)
struct TransformerLayerSaved;
struct TransformerLayerContext;


// --position-embedding-type: learned_absolute | rope | none.
enum class PositionEmbeddingType { kLearnedAbsolute, kRope, kNone };
PositionEmbeddingType parse_position_embedding_type(std::string_view s);  // UserError naming the flag
const char* position_embedding_type_name(PositionEmbeddingType t);  // Megatron's spelling

// MLP activation: GeLU (tanh approximation, 4C-wide by default) or a gated linear unit over fc1's
// [gate | up] halves. Megatron's --swiglu selects kSwiGLU; GeGLU and ReGLU have no Megatron flag and are
// reachable through this config only.
enum class MlpActivation { kGeLU, kSwiGLU, kGeGLU, kReGLU };
const char* mlp_activation_name(MlpActivation a);  // "gelu", "swiglu", "geglu", "reglu"

// Mixture of experts (Megatron-Core's MoELayer in place of the MLP; docs/models.md "Mixture of experts").
// A MoE layer's MLP: the router (decoder.layers.N.mlp.router.weight (E, C)), E routed experts
// (decoder.layers.N.mlp.experts.linear_fc1.weight<e> (F1, C), linear_fc2.weight<e> (C, F), F =
// moe_ffn_hidden_size(), no biases, the model's activation) and optionally shared experts that see every
// token (decoder.layers.N.mlp.shared_experts.linear_fc1/linear_fc2.weight, no biases; with the gate,
// shared_experts.gate_weight (1, C): their output scaled by sigmoid(x · gate)). Layer output = routed
// experts (prob-weighted) + shared experts, then the usual bias-dropout-add.
struct MoeConfig {
  int64_t num_experts = 0;  // --num-experts E; 0: a dense model
  int64_t ffn_hidden_size = 0;  // --moe-ffn-hidden-size; 0: the model's ffn_hidden_size() (Megatron's default)
  int64_t shared_expert_intermediate_size = 0;  // --moe-shared-expert-intermediate-size; 0: no shared experts
  bool shared_expert_gate = false;  // --moe-shared-expert-gate
  // --moe-layer-freq resolved per layer: 1 = MoE, 0 = dense MLP; empty: every layer is a MoE layer.
  std::vector<int> layer_pattern;
  RouterConfig router;  // --moe-router-*, --moe-*-loss-coeff, capacity; router.num_experts == num_experts
};

struct GPTConfig {
  int64_t num_layers = 12;               // L (--num-layers)
  int64_t hidden_size = 768;             // C (--hidden-size)
  int64_t num_attention_heads = 12;      // NH (--num-attention-heads)
  int64_t max_position_embeddings = 1024;  // P (--max-position-embeddings): learned table / RoPE table rows
  int64_t vocab_size = 50257;            // V: real tokens; the loss covers these columns only
  int64_t padded_vocab_size = 50304;     // Vp: V rounded up to --make-vocab-size-divisible-by
  float init_method_std = 0.02f;         // --init-method-std
  float layernorm_epsilon = 1e-5f;       // --norm-epsilon (LayerNorm and RMSNorm)
  // Dropout probabilities in [0, 1). 0 here; the trainer sets Megatron's defaults (0.1 each).
  float hidden_dropout = 0.0f;           // --hidden-dropout: embedding output and both residual branches
  float attention_dropout = 0.0f;        // --attention-dropout: softmax probabilities

  // Architecture options (defaults: GPT-2). docs/models.md has the Llama / Mistral / Qwen settings.
  NormKind normalization = NormKind::kLayerNorm;      // --normalization LayerNorm | RMSNorm
  MlpActivation activation = MlpActivation::kGeLU;     // --swiglu: kSwiGLU
  int64_t ffn_hidden = 0;        // --ffn-hidden-size F; 0: Megatron's default (see ffn_hidden_size())
  int64_t kv_channels = 0;       // --kv-channels HS; 0: C / NH
  bool group_query_attention = false;  // --group-query-attention
  int64_t num_query_groups = 1;        // --num-query-groups NKV (with --group-query-attention; else NKV = NH)
  bool add_bias_linear = true;         // false with --disable-bias-linear: no bias in any linear layer
  bool add_qkv_bias = false;           // --add-qkv-bias: linear_qkv keeps its bias even then
  bool untie_embeddings_and_output_weights = false;  // --untie-embeddings-and-output-weights
  PositionEmbeddingType position_embedding_type = PositionEmbeddingType::kLearnedAbsolute;
  double rotary_base = 10000.0;        // --rotary-base
  float rotary_percent = 1.0f;         // --rotary-percent: rotary_dim = int(HS · percent), even
  bool rotary_interleaved = false;     // --rotary-interleaved
  bool use_rope_scaling = false;       // --use-rope-scaling: Llama 3.1 frequency scaling
  float rope_scaling_factor = 8.0f;    // --rope-scaling-factor
  // --window-size L,0: a query at i attends to keys [i - L, i] (Transformer Engine's (left, right) window;
  // the right side must be 0 for causal attention). -1: no window.
  int64_t window_size_left = -1;
  bool qk_layernorm = false;           // --qk-layernorm: per-head norm of q and k (before RoPE)
  MoeConfig moe;                       // mixture of experts (moe.num_experts > 0)

  bool is_moe() const { return moe.num_experts > 0; }
  bool is_moe_layer(int64_t layer) const {  // global layer index
    return is_moe() && (moe.layer_pattern.empty() || moe.layer_pattern.at(size_t(layer)) != 0);
  }
  int64_t num_moe_layers() const;
  int64_t moe_ffn_hidden_size() const { return moe.ffn_hidden_size > 0 ? moe.ffn_hidden_size : ffn_hidden_size(); }

  // Megatron's default for --ffn-hidden-size: 4C, or int(4C · 2/3 / 64) · 64 for gated MLPs (the same
  // parameter count with three matrices).
  int64_t ffn_hidden_size() const;
  int64_t head_dim() const { return kv_channels > 0 ? kv_channels : hidden_size / num_attention_heads; }  // HS
  int64_t num_kv_heads() const { return group_query_attention ? num_query_groups : num_attention_heads; }  // NKV
  bool gated_mlp() const { return activation != MlpActivation::kGeLU; }
  bool qkv_bias() const { return add_bias_linear || add_qkv_bias; }
  int64_t qkv_size() const { return (num_attention_heads + 2 * num_kv_heads()) * head_dim(); }  // qkv width
  int64_t rotary_dim() const;  // int(HS · rotary_percent) (Megatron), 0 without RoPE
  // The attention core's parameters (heads, softmax scale 1/sqrt(HS), causal, window) without dropout.
  AttentionParams attention_params() const;
  // RoPE options for RotaryEmbedding (valid with position_embedding_type kRope).
  RotaryOptions rotary_options() const;

  // Parameters, counted exactly from the shapes (every option; see docs/models.md for the formula).
  int64_t num_parameters() const;
  // The parameters one token uses: num_parameters() with each MoE layer's routed experts counted top-k
  // times instead of E times (= num_parameters() for a dense model).
  int64_t num_active_parameters() const;
  // Model FLOPs (matmuls only, causal attention counted in full, as Megatron's
  // num_floating_point_operations, which they equal for every option here):
  //   layer forward   2·B·T·(C·qkv_size + NH·HS·C + C·F·(2 if gated else 1) + F·C) + 4·B·T²·NH·HS
  //   logits forward  2·B·T·C·Vp
  // With the GPT-2 shapes the layer forward is 24·B·T·C² + 4·B·T²·C.
  // layer: the global layer index (a MoE layer counts its top-k routed experts and its shared experts).
  double layer_forward_flops(int64_t B, int64_t T, int64_t layer = 0) const;
  double attention_core_forward_flops(int64_t B, int64_t T) const;  // 4·B·T²·NH·HS (selective recompute)
  double logits_forward_flops(int64_t B, int64_t T) const;
  // One forward+backward over B sequences of length T: 3 x (L · layer forward + logits forward).
  // Recomputation is not counted (it is hardware work, not model work).
  double flops_per_step(int64_t B, int64_t T) const;
  // Everything but the vocabulary (which the trainer resolves later); UserError naming the flag.
  void validate_architecture() const;
  void validate_moe() const;  // the mixture-of-experts fields (part of validate_architecture)
  void validate() const;  // validate_architecture() and the vocabulary sizes
};

enum class RecomputeGranularity { kNone, kSelective, kFull };  // --recompute-granularity {,selective,full}
enum class RecomputeMethod { kNone, kUniform, kBlock };        // --recompute-method {,uniform,block}
// Megatron's flag values ("selective", "full"; "uniform", "block"); UserError naming the flag otherwise.
RecomputeGranularity parse_recompute_granularity(std::string_view s);
RecomputeMethod parse_recompute_method(std::string_view s);

// Where this model instance sits in the parallel layout (docs/parallelism.md). Defaults: one process,
// the whole model. The model keeps the pointers; the communicators must outlive it.
//   TP  attention split by query groups (a rank holds NKV/TP groups with their NH/TP query heads: one
//       contiguous row range of linear_qkv in the grouped layout), the MLP by the FFN dimension (a gated
//       fc1 holds its gate rows and its up rows), linear_proj / linear_fc2 row-parallel (input dim split;
//       partial outputs all-reduced, the bias added once), word embedding and output layer split by
//       vocabulary (Vp/TP rows each; vocabulary-parallel cross-entropy, no rank holds full logits).
//   SP  (--sequence-parallel, TP > 1) the residual stream, norms and hidden dropout hold B·T/TP tokens of
//       the flattened (B·T) token axis; all-gather before column-parallel layers, reduce-scatter after
//       row-parallel ones. Replicated parameters used there are marked Parameter::sequence_parallel.
//   CP  the sequence split in 2·CP chunks, this rank holding chunks cp_rank and 2·CP−1−cp_rank (causal
//       load balance); ring attention exchanges K/V blocks over the CP group.
//   PP  this instance is one pipeline stage (or one virtual-stage chunk): global layers
//       [first_layer, first_layer + num_layers) keep their global names; pre_process: it owns the
//       embedding; post_process: the final norm, output layer and loss. With tied embeddings and PP > 1 the
//       post_process stage holds a copy of the word embedding (Parameter::tied_embedding_copy).
// Initial values are functions of global indices, so every layout builds the same model as one process,
// and computes the same losses (up to floating-point summation order): hidden-dropout masks are the
// single process's under every layout (TP/SP draw them over the full token x hidden tensor, CP ranks at
// their sequence chunks' global offsets), and so are attention-dropout masks under CP (global positions).
// Only attention dropout under TP differs: a rank draws per-rank masks over its own heads (Megatron's
// model-parallel RNG tracker; same rate and expectation).
struct ModelParallel {
  const Communicator* tp = nullptr;  // null or size 1: no tensor parallelism
  bool sequence_parallel = false;    // --sequence-parallel (needs TP > 1)
  const Communicator* cp = nullptr;  // null or size 1: no context parallelism
  // SP and CP together: the group over which a micro-batch's tokens are spread (tp x cp, tp fastest); MoE
  // routing gathers over it. Null: built from tp or cp alone when only one of them splits the tokens.
  const Communicator* tp_cp = nullptr;
  // Mixture of experts: the expert-parallel layout and dispatcher; --moe-shared-expert-overlap.
  ExpertParallel expert;
  bool moe_shared_expert_overlap = false;
  int64_t first_layer = 0;
  int64_t num_layers = -1;           // -1: every layer from first_layer on
  bool pre_process = true;
  bool post_process = true;
  // Layers of this instance out of the model's `total_layers`.
  int64_t layer_count(int64_t total_layers) const { return num_layers < 0 ? total_layers - first_layer : num_layers; }
  int tp_size() const { return tp ? tp->size() : 1; }
  int tp_rank() const { return tp ? tp->rank() : 0; }
  int cp_size() const { return cp ? cp->size() : 1; }
  int cp_rank() const { return cp ? cp->rank() : 0; }
};

// --lora-target-modules: the linears that carry LoRA adapters. Whole layers by Megatron's names
// (linear_qkv, linear_proj, linear_fc1, linear_fc2); Hugging Face PEFT's names adapt the matching slice of
// Loom's fused layers (q_proj, k_proj, v_proj of linear_qkv; gate_proj, up_proj of a gated linear_fc1) with
// adapters named decoder.layers.N.self_attention.q_proj.lora_{A,B}.weight, mlp.gate_proj...; o_proj and
// down_proj are linear_proj and linear_fc2 (and up_proj is linear_fc1 in a model without a gated MLP).
enum class LoraTarget { kQkv, kProj, kFc1, kFc2, kQ, kK, kV, kGate, kUp };
const char* lora_target_name(LoraTarget t);  // the canonical spelling: linear_qkv, ..., q_proj, ...
// Accepts the Megatron and PEFT names above and NeMo's (attention_qkv, attention_dense, mlp_fc1, mlp_fc2,
// and the groups attention = qkv + proj, mlp = fc1 + fc2, all); returns the canonical targets in enum
// order. UserError naming --lora-target-modules for an unknown name, one the model does not have
// (gate_proj without a gated MLP) or two that adapt the same output (linear_qkv with q_proj).
std::vector<LoraTarget> parse_lora_targets(const std::vector<std::string>& names, const GPTConfig& cfg);

// Where a target's adapter sits in a layer: its name after decoder.layers.N. ("self_attention.q_proj"), the
// fused linear it adapts ("self_attention.linear_qkv"; weight (out, in)), A's columns and B's rows (global),
// and the rows of that linear's weight (its output columns) that B's rows update, in B's row order, as local
// indices on each of `tp` ranks (every rank's are the same; empty: all of them, in order). The update of the
// merged weight is W[rows[k]] += (alpha / rank) · (B·A)[k]: q_proj's rows are the query heads of each group
// of Megatron's grouped qkv layout, gate_proj / up_proj the halves of a gated fc1.
struct LoraSite {
  std::string module;
  std::string layer;
  int64_t in = 0, out = 0;
  std::vector<ShardRange> rows;
};
LoraSite lora_site(const GPTConfig& cfg, LoraTarget t, int tp = 1);

struct LoraOptions {
  LoraConfig config;                // rank, alpha, dropout
  std::vector<LoraTarget> targets;  // canonical (parse_lora_targets), non-empty
};

// How the model is built (fixed for its lifetime).
struct ModelOptions {
  DType compute_dtype = DType::kF32;  // kBF16 for --bf16, kF16 for --fp16: parameter copy and activations
  // Gradient buffer: kF32 (Megatron's main grads; always for --bf16) or, for --fp16 without
  // --accumulate-allreduce-grads-in-fp32, kF16. Must be kF32 or compute_dtype.
  DType grad_dtype = DType::kF32;
  RecomputeGranularity recompute_granularity = RecomputeGranularity::kNone;
  RecomputeMethod recompute_method = RecomputeMethod::kNone;  // required for kFull, unset otherwise
  // --recompute-num-layers: group size (uniform) or number of recomputed layers (block); in
  // [1, num_layers] for kFull, 0 (unset) otherwise. Ignored with kNone, as Megatron ignores it.
  int64_t recompute_num_layers = 0;
  // false: an inference-only model (`loom generate`): no gradient buffer, backward() is refused.
  bool with_grads = true;
  ModelParallel parallel;  // the layout this instance is part of (default: single process)
  // kExternal for ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params): the distributed
  // optimizer binds parameter storage around each unit's use; initialize() then is the optimizer's job.
  ParamStorage param_storage = ParamStorage::kFull;
  // Micro-batches whose activations can be alive at once (pipeline schedules keep up to PP of them in
  // flight); each slot has its own saved activations, scratch is shared. >= 1.
  int activation_slots = 1;
  // FP8 GEMMs (--fp8-format ...): every linear layer (qkv, proj, fc1, fc2) and the output layer run under
  // this delayed-scaling recipe (loom/nn/fp8_gemm.h); needs bf16 or f16 compute. Unset: no FP8.
  std::optional<Fp8Recipe> fp8;
  // LoRA fine-tuning: adapters on the target linears form the trainable set; every base parameter is
  // frozen (no gradient buffer, no weight-gradient GEMM; only input gradients flow through it).
  std::optional<LoraOptions> lora;
  void validate(const GPTConfig& cfg) const;  // throws UserError naming the Megatron flags
};

// The tensor-parallel rules on the architecture (heads, query groups, FFN size divisible by TP;
// --sequence-parallel needs TP > 1); UserError naming the flags. ModelOptions::validate and the trainer's
// start-up check share it.
void validate_tensor_parallel(const GPTConfig& cfg, int tp, bool sequence_parallel);

// Per-call forward settings.
struct ForwardOptions {
  bool training = true;  // false: evaluation (no dropout; dloss_scale must be 0, no backward follows)
  uint64_t dropout_seed = 0;  // the run's --seed
  // Counter the caller advances for every micro-batch of the run (never reused, e.g. iteration · num
  // micro-batches + micro-batch), mixed into every site's dropout stream so each micro-batch draws fresh
  // masks while the recomputed forward of the same micro-batch redraws the same ones.
  uint64_t micro_batch_index = 0;
  // Mixture of experts: the factor the router's load-balancing and z-loss gradients are scaled by, the
  // main loss's backward scale as Megatron's MoEAuxLossAutoScaler sets it (loss scale / micro-batches per
  // step: the aux losses are per micro-batch, averaged like the LM loss). NaN: dloss_scale x the loss
  // tokens (Σ loss_mask, B x T without a mask; the mask is then read on the host).
  float moe_aux_loss_scale = std::numeric_limits<float>::quiet_NaN();
};

// The router statistics of one MoE layer over the training micro-batches since the last reset (the log's
// load_balancing_loss and z_loss, Megatron's figures without their coefficients, and the per-expert token
// counts of the micro-batches' tokens).
struct MoeLayerStats {
  int64_t layer = 0;  // global layer index
  double load_balancing_loss = 0;  // Σ over micro-batches
  double z_loss = 0;
  int64_t micro_batches = 0;
  std::vector<double> tokens_per_expert;  // (E) Σ over micro-batches
};

// One buffer the model allocates.
struct PlannedBuffer {
  std::string name;  // e.g. "decoder.layers.3.qkv", "recompute.slot0.fc", "params.grads"
  Shape shape;
  DType dtype = DType::kF32;
  int64_t bytes() const { return shape.numel() * int64_t(dtype_size(dtype)); }
};

// Every buffer of a model for micro-batches of shape (B, T). Optimizer state (AdamW's m, v) is not the
// model's and is not included.
struct GPTMemoryPlan {
  // f32 master values, compute copy (bf16/f16 only), grads (unless ModelOptions::with_grads is false), and
  // the RoPE cos/sin tables (constants built with the model).
  std::vector<PlannedBuffer> parameters;
  std::vector<PlannedBuffer> activations;  // everything forward/backward allocate (saved, scratch, logits)
  int64_t parameter_bytes() const;
  int64_t activation_bytes() const;
  int64_t total_bytes() const { return parameter_bytes() + activation_bytes(); }
};

// One micro-batch. tokens and targets (B, T) i32 are required; the rest are optional (empty views):
// loss_mask (B, T) f32 (Megatron's loss mask: --eod-mask-loss), position_ids (B, T) i32
// (--reset-position-ids), segment_ids (B, T) i32 (--reset-attention-mask: documents do not attend
// to each other).
struct GPTBatch {
  TensorView tokens, targets;
  TensorView loss_mask, position_ids, segment_ids;
};

class GPTModel {
 public:
  using Options = ModelOptions;
  GPTModel(const GPTConfig& cfg, const DeviceContext& ctx, const ModelOptions& opts = {});
  GPTModel(const GPTModel&) = delete;
  GPTModel& operator=(const GPTModel&) = delete;
  ~GPTModel();

  const GPTConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opts_; }
  // Every parameter of the model (with LoRA: the frozen base, without gradients).
  ParameterSet& params() { return params_; }
  const ParameterSet& params() const { return params_; }
  // What the optimizer trains: params(), or with LoRA the adapters (their own set, storage and gradients).
  // units() and the hooks address this set.
  ParameterSet& trainable() { return opts_.lora ? lora_params_ : params_; }
  const ParameterSet& trainable() const { return opts_.lora ? lora_params_ : params_; }
  bool lora() const { return opts_.lora.has_value(); }
  // Initialises the master weights (base and adapters, unless their storage is external) and syncs the
  // compute copies.
  void initialize(uint64_t seed);
  // Refreshes the compute copies from the master weights; call after every write to params().values()
  // or trainable().values() (optimizer step, checkpoint load). A no-op for f32 compute.
  void sync_compute() const;

  // Forward over a micro-batch. Returns the mean loss over its tokens (over the unmasked tokens when a
  // loss mask is given: sum(loss · mask) / sum(mask), as Megatron). dloss_scale != 0 prepares
  // backward: the logits buffer becomes dlogits = dloss_scale · d(sum of mask · losses).
  // With dloss_scale == 0 the logits stay available through logits(). Dropout applies when
  // opts.training and the config's probability is > 0. MoE layers add the gradients of their router losses
  // (aux and z; not part of the returned loss) with Megatron's MoEAuxLossAutoScaler scale, the factor
  // on d(mean loss): opts.moe_aux_loss_scale (the trainer's loss scale / micro-batches), or without it
  // dloss_scale · Σ loss_mask (B·T without a mask; then a pipeline stage with MoE layers needs the
  // micro-batch's loss mask too, whenever the loss has one).
  float forward(const GPTBatch& batch, float dloss_scale, const ForwardOptions& opts);
  float forward(const GPTBatch& batch, float dloss_scale) { return forward(batch, dloss_scale, ForwardOptions{}); }
  float forward(TensorView tokens, TensorView targets, float dloss_scale) {
    return forward(GPTBatch{tokens, targets, {}, {}, {}}, dloss_scale);
  }
  // Accumulates parameter gradients of the last forward (which must have had dloss_scale != 0); `batch`
  // must be the one that forward saw.
  void backward(const GPTBatch& batch);
  void backward(TensorView tokens) { backward(GPTBatch{tokens, {}, {}, {}, {}}); }
  TensorView logits() const { return logits_; }  // (B, T, Vp), compute dtype
  TensorView losses() const { return losses_; }  // (B, T) f32 per-token losses of the last forward
  // The RoPE tables (null without RoPE); constants, shared with InferenceSession.
  const RotaryEmbedding* rotary() const { return rope_.get(); }
  // The local transformer layers (model/transformer_layer.h; generation runs them over a KV cache).
  int64_t num_local_layers() const { return int64_t(layers_.size()); }
  const TransformerLayer& layer(int64_t l) const { return *layers_.at(size_t(l)); }

  // ---- parallel layouts (see ModelParallel) ----
  // The units of this instance in forward order (pre_process adds "embedding", post_process "head").
  const std::vector<ParamUnit>& units() const { return units_; }
  void set_hooks(ParamHooks* hooks) { hooks_ = hooks; }  // null: none
  // The activation slot the next forward/backward use (pipeline schedules: one per micro-batch in flight).
  void set_slot(int slot);
  // Pipeline stage entry/exit, per slot: without pre_process, forward reads its input hidden states
  // (B, T_local, C) from input() of the current slot (the schedule receives into it); without
  // post_process, forward leaves its output in output() (sent to the next stage) and returns 0, and
  // backward reads d(output) from output_grad(); without pre_process backward leaves d(input) in
  // input_grad(). T_local = T / CP (and the SP token shard when sequence parallel: B·T/(CP·TP) rows).
  TensorView input() const;
  TensorView output() const;
  TensorView output_grad() const;
  TensorView input_grad() const;
  // The (B, T) micro-batch shape must be fixed before input() exists: allocates the buffers.
  void prepare(int64_t B, int64_t T);

  // ---- FP8 (ModelOptions::fp8) ----
  bool fp8() const { return fp8_ != nullptr; }
  // A new step (or an evaluation after an optimizer step): weights are quantised again at their next use.
  void fp8_begin_step();
  // After a step's backward: this step's amaxes reduced (max) over `groups` — the ranks holding the same
  // tensors: tensor- and data-parallel replicas — then every scale updated (the recipe's rule).
  void fp8_update_scaling(const std::vector<const Communicator*>& groups);
  // Drops the amaxes recorded since the last update (evaluation forwards must not steer training scales).
  void fp8_discard_amaxes();
  // The scaling state of GEMM site s (linear layers in order qkv, proj, fc1, fc2 per local layer, then the
  // output layer): rows input, weight, grad; columns scale, then the amax history (most recent first).
  // Checkpoints save it under fp8_state_name(s) and restore it with fp8_set_state.
  int fp8_num_sites() const;
  std::string fp8_state_name(int site) const;
  Tensor fp8_state(int site) const;            // (3, 1 + history length) f32, host
  void fp8_set_state(int site, TensorView st);  // the same shape

  // ---- mixture of experts ----
  // The statistics of every local MoE layer (in layer order) since reset_moe_stats().
  std::vector<MoeLayerStats> moe_stats() const;
  void reset_moe_stats();
  // Aux-loss-free balancing (--moe-router-enable-expert-bias), after a step's optimizer update: each MoE
  // layer's token counts since the last update, summed over the data-parallel replicas by `sum` (in place,
  // the same call order on every rank), move its expert bias (Megatron's get_updated_expert_bias).
  void update_expert_bias(const std::function<void(std::vector<float>&)>& sum);
  // The expert biases of the local MoE layers (checkpoints: "decoder.layers.N.mlp.router.expert_bias").
  std::vector<std::pair<std::string, std::vector<float>*>> expert_biases();

  // Every buffer a model built with (cfg, opts) allocates for (B, T) micro-batches; validates both.
  static GPTMemoryPlan memory_plan(const GPTConfig& cfg, const ModelOptions& opts, int64_t B, int64_t T);
  // Bytes of the activation buffers allocated now (0 before the first forward); equals
  // memory_plan(config(), options(), B, T).activation_bytes() for the last forward's (B, T).
  int64_t activation_bytes() const { return activation_bytes_; }

 private:
  using Layer = TransformerLayer;
  using LayerActs = TransformerLayerSaved;
  struct LayerRole;
  struct BufferSlot;
  struct Declared;
  struct SlotState;
  // Declares the base parameters into `ps` and the LoRA adapters into `lora_ps`; the units address the
  // trainable set (lora_ps with LoRA).
  static Declared declare_parameters(ParameterSet& ps, ParameterSet& lora_ps, const GPTConfig& cfg,
                                     const ModelOptions& opts);
  static std::vector<LayerRole> layer_roles(const GPTConfig& cfg, const ModelOptions& opts);
  static std::vector<BufferSlot> activation_layout(const GPTConfig& cfg, const ModelOptions& opts, int64_t B,
                                                   int64_t T, GPTModel* model);
  void ensure_buffers(int64_t B, int64_t T);
  void store_slot();  // working activation handles -> slots_[slot_]
  void load_slot();   // slots_[slot_] -> working activation handles
  void forward_layer(int64_t l, const TransformerLayerContext& c);
  void backward_layer(int64_t l, const TransformerLayerContext& c);
  TensorView layer_input(int64_t l) const;
  DropoutMask hidden_mask(uint64_t site) const;
  // Hidden dropout on this rank's tokens with the single process's mask (CP: per sequence chunk).
  void hidden_dropout_forward(TensorView out, TensorView inp, const DropoutMask& d) const;
  void hidden_dropout_backward(TensorView dinp, TensorView dout, const DropoutMask& d) const;
  template <typename F>
  void for_hidden_dropout_runs(TensorView out, TensorView inp, const DropoutMask& d, F apply) const;
  DropoutMask attention_mask(uint64_t site) const;
  // The hidden dropout of a row-parallel layer's bias-dropout-add, as its epilogue.
  RowEpilogue hidden_dropout_epilogue(uint64_t site) const;
  // The column-parallel layers' input (all-gathered under SP) and input-gradient scratch.
  TensorView sp_gathered() const { return sp_gathered_; }
  TensorView sp_grad() const { return sp_grad_; }
  struct Fp8State;
  // The context the layers run in: this model's scratch, RoPE positions, attention (core or CP ring) and
  // hidden dropout.
  TransformerLayerContext layer_context(TensorView segment_ids) const;
  void embedding_forward(const GPTBatch& batch);
  void embedding_backward(const GPTBatch& batch);
  void call_hook(void (ParamHooks::*f)(int), int unit) const {
    if (hooks_ != nullptr && unit >= 0) (hooks_->*f)(unit);
  }

  GPTConfig cfg_;
  ModelOptions opts_;
  const DeviceContext& ctx_;
  std::vector<ParamUnit> units_;
  ParamHooks* hooks_ = nullptr;
  std::unique_ptr<Fp8State> fp8_;
  ParameterSet params_;
  ParameterSet lora_params_;               // the adapters (ModelOptions::lora), else empty
  std::unique_ptr<Embedding> embedding_;   // pre_process only
  std::vector<std::unique_ptr<Layer>> layers_;  // the local layers [first_layer, first_layer + num_layers)
  std::unique_ptr<Norm> final_ln_;         // post_process only
  // post_process only: the vocabulary-parallel output layer; tied, it borrows the word embedding (or, on
  // a last stage without the embedding, tied_copy_, the embedding's copy).
  std::unique_ptr<ColumnParallelLinear> output_layer_;
  Parameter* tied_copy_ = nullptr;
  std::unique_ptr<RotaryEmbedding> rope_;  // RoPE tables (null without RoPE)
  std::vector<LayerRole> roles_;   // per local layer: kept or recomputed (and its group)
  int embedding_unit_ = -1, first_layer_unit_ = 0, head_unit_ = -1;  // indices into units_ (-1: absent)

  int64_t B_ = 0, T_ = 0;          // the micro-batch shape (global T; this rank holds T / CP positions)
  int64_t activation_bytes_ = 0;
  // The working set of the current slot (handles into slots_[slot_], swapped by set_slot()).
  int slot_ = 0;
  std::vector<SlotState> slots_;
  bool backward_ready_ = false;
  ForwardOptions fwd_;             // of the last forward; backward's recomputation redraws its masks
  Tensor x0_;                      // (B, T, C) embedding output (after dropout) = input of layer 0 (= input())
  std::vector<LayerActs> acts_;    // per local layer; recomputed layers' views point into scratch_
  std::vector<LayerActs> scratch_; // full recomputation: one group's activations
  Tensor att_scratch_, lse_scratch_;  // selective recomputation: (B, T, NH·HS), (B, NH, T) f32
  Tensor lnf_;                     // (B, T, C)
  Norm::Saved lnf_saved_;
  Tensor logits_;                  // (B, T, Vp / TP), dlogits in place after a training forward
  Tensor losses_;                  // (B, T) f32
  Tensor pipe_grad_;               // stage boundary: output_grad() on entry of backward, input_grad() on exit
  // Shared scratch: MLP activation output (forward and recomputed in backward); branch_ holds a residual
  // branch's output (attention projection, consumed at once by the fused residual + norm) in forward and a
  // branch's gradient through its dropout in backward; activation gradients; the qk-norm's two scratch
  // buffers (B, T, NH·HS) (--qk-layernorm only).
  Tensor act_, branch_, dres_, dln_, datt_, dqkv_, dfc_, qk_a_, qk_b_;
  // TP > 1: SP's all-gathered column input and full-row input gradient (N, C); the vocabulary-parallel
  // cross-entropy's (2, N) statistics; the embedding's local token ids and positions (host i32 (B, T)).
  Tensor sp_gathered_, sp_grad_, ce_stats_, tp_tokens_, tp_positions_;
  std::vector<int64_t> tp_outside_;  // flat indices of tokens outside this rank's vocabulary range
  // CP > 1: this rank's two chunks of the batch tensors (B, T / CP) and the global positions of its tokens.
  Tensor cp_tokens_, cp_targets_, cp_loss_mask_, cp_position_ids_, cp_segment_ids_, cp_positions_;
  GPTBatch local_batch(const GPTBatch& batch);  // the batch as this CP rank sees it (batch itself at CP = 1)
  // MoE: the micro-batch's tokens over the SP/CP ranks (null when this rank has all of them); the router
  // losses' gradient scale of the last forward (see forward()); units of the layers.
  std::unique_ptr<RoutingGroup> make_routing_group(int64_t B, int64_t T) const;
  std::unique_ptr<RoutingGroup> routing_group_;
  double moe_aux_grad_scale_ = 0;
  double loss_token_count(TensorView loss_mask, int64_t B, int64_t T) const;
  std::vector<int> layer_unit_;  // units_ index of each local layer
};

}  // namespace loom
