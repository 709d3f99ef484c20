// One transformer layer (Megatron's TransformerLayer, dense): the pre-norm attention branch and MLP branch,
// each closed by a bias-dropout-add into the residual stream. The same layer object runs in training
// (GPTModel: whole-sequence attention or the context-parallel ring, tensor/sequence parallelism through
// its parallel linears, dropout, recomputation) and in generation (InferenceSession: attention over a
// key/value cache): the caller supplies the attention and the hidden-dropout epilogues through the
// context, so the layer's op sequence exists once. Private to the model layer.
#pragma once
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loom/model/gpt.h"
#include "loom/nn/modules.h"
#include "loom/parallel/parallel_linear.h"
#include "loom/core/rng.h"
#include "loom/parallel/tensor_parallel.h"
#include "model/moe_mlp.h"

namespace loom {

namespace gpt_detail {

// The attention core's parameters on one TP rank: its NH/TP query heads and NKV/TP query groups.
inline AttentionParams local_attention_params(const GPTConfig& c, int tp) {
  AttentionParams p = c.attention_params();
  p.num_heads /= tp;
  p.num_kv_heads /= tp;
  return p;
}

}  // namespace gpt_detail
using gpt_detail::local_attention_params;

// What one layer's forward keeps for its backward (views into buffers its caller owns).
struct TransformerLayerSaved {
  Tensor ln1;        // (B, T, C)
  Norm::Saved ln1_saved;
  Tensor qkv;        // (B, T, (NH + 2·NKV)·HS) after the qk-norm and RoPE: what the attention core reads
  QKNorm::Saved qk_saved;  // --qk-layernorm: the q/k heads before the norm and its statistics
  Tensor att;        // (B, T, NH·HS) attention core output
  AttentionCore::Saved attn_saved;
  Tensor residual2;  // (B, T, C) x + attention branch
  Tensor ln2;        // (B, T, C)
  Norm::Saved ln2_saved;
  Tensor fc;         // (B, T, F), or (B, T, 2F) = [gate | up] for a gated MLP: fc1's output (dense MLP)
  Tensor out;        // (B, T, C) layer output = next layer's input
  std::shared_ptr<MoeLayerSaved> moe;  // a MoE layer's buffers of this call (sized by the routing)
};

class TransformerLayer;

// Everything a layer's forward or backward needs besides its input and its saved activations.
struct TransformerLayerContext {
  const DeviceContext& ctx;
  // Scratch shared by the layers (each at least the layer's size): the MLP activation (B, T, F/TP); a
  // branch output / its gradient through dropout (full rows); the residual-layout gradients of a norm's
  // input and of the stream; the attention output's and qkv's gradients; fc2's input gradient; the
  // qk-norm's two scratch buffers; SP's all-gathered column input and its gradient (N, C).
  TensorView act{}, branch{}, dln{}, dres{}, datt{}, dqkv{}, dfc{}, qk_a{}, qk_b{}, sp_gathered{}, sp_grad{};
  const RotaryEmbedding* rope = nullptr;  // RoPE tables (null without RoPE)
  TensorView positions{};                 // (B, T) i32 positions for RoPE
  // The attention of `layer` from s.qkv into s.att (and whatever its backward needs in s.attn_saved);
  // `recompute`: selective recomputation in backward, with the saved dropout mask.
  std::function<void(const TransformerLayer& layer, TransformerLayerSaved& s, bool recompute)> attend{};
  // d(qkv) into dqkv from d(att) in datt (training only).
  std::function<void(const TransformerLayer& layer, TransformerLayerSaved& s)> attend_backward{};
  bool recompute_attention = false;  // --recompute-granularity selective
  // The hidden dropout of a bias-dropout-add at a dropout site (null: none, as in generation).
  std::function<RowEpilogue(uint64_t site)> hidden_dropout{};
  // The LoRA dropout mask of a linear's adapters (null or inactive: none, as in evaluation).
  std::function<DropoutMask(uint64_t site)> lora_dropout{};
  MoeCall moe{};  // MoE layers: the routing group, T, training, the aux-loss gradient scale
};

class TransformerLayer {
 public:
  // Declaration order is parameter order in the flat buffers: norms, attention, MLP (GPT-2's order, with
  // the qk-norms after the attention projections). With TP > 1: linear_qkv holds this rank's query groups
  // (one contiguous row range of the grouped layout), fc1 its FFN rows (a gated fc1 its gate rows and its
  // up rows), linear_proj / fc2 their input columns; norms and the row-parallel biases are whole.
  Norm ln1, ln2;
  ColumnParallelLinear qkv;
  RowParallelLinear proj;
  std::optional<QKNorm> qk_norm;
  std::optional<ColumnParallelLinear> fc1;  // the dense MLP (absent in a MoE layer)
  std::optional<RowParallelLinear> fc2;
  std::unique_ptr<MoeMlp> moe;              // a MoE layer's MLP (GPTConfig::is_moe_layer)
  AttentionCore attn;
  uint64_t attn_dropout_site, proj_dropout_site, mlp_dropout_site;
  uint64_t qkv_lora_site, proj_lora_site, fc1_lora_site, fc2_lora_site;  // LoRA dropout
  // lora: the adapters, declared into `lora_ps` after the layer's own parameters (null: none).
  // ep: the expert layout of a MoE layer (null: EP = ETP = 1, every expert here).
  TransformerLayer(ParameterSet& ps, const GPTConfig& c, int64_t i, const TpRegion& region,
                   ParameterSet* lora_ps = nullptr, const LoraOptions* lora = nullptr,
                   const ExpertParallel* ep = nullptr)
      : ln1(ps, prefix(i) + "input_layernorm", c.hidden_size, c.layernorm_epsilon, c.normalization),
        ln2(ps, prefix(i) + "pre_mlp_layernorm", c.hidden_size, c.layernorm_epsilon, c.normalization),
        qkv(ps, prefix(i) + "self_attention.linear_qkv", c.hidden_size, c.qkv_size(), c.qkv_bias(),
            c.init_method_std, region, {even_shard(c.qkv_size(), region.size(), region.rank())}),
        proj(ps, prefix(i) + "self_attention.linear_proj", c.num_attention_heads * c.head_dim(), c.hidden_size,
             c.add_bias_linear, scaled_std(c), region,
             even_shard(c.num_attention_heads * c.head_dim(), region.size(), region.rank())),
        qk_norm(c.qk_layernorm ? std::optional<QKNorm>(std::in_place, ps, prefix(i) + "self_attention",
                                                       local_attention_params(c, region.size()),
                                                       c.layernorm_epsilon, c.normalization)
                               : std::nullopt),
        fc1(c.is_moe_layer(i) ? std::nullopt
                              : std::optional<ColumnParallelLinear>(
                                    std::in_place, ps, prefix(i) + "mlp.linear_fc1", c.hidden_size,
                                    (c.gated_mlp() ? 2 : 1) * c.ffn_hidden_size(), c.add_bias_linear,
                                    c.init_method_std, region, fc1_shard(c, region.size(), region.rank()))),
        fc2(c.is_moe_layer(i) ? std::nullopt
                              : std::optional<RowParallelLinear>(
                                    std::in_place, ps, prefix(i) + "mlp.linear_fc2", c.ffn_hidden_size(),
                                    c.hidden_size, c.add_bias_linear, scaled_std(c), region,
                                    even_shard(c.ffn_hidden_size(), region.size(), region.rank()))),
        moe(c.is_moe_layer(i) ? std::make_unique<MoeMlp>(ps, c, i, region, ep ? *ep : ExpertParallel{}) : nullptr),
        attn(local_attention_params(c, region.size())),
        attn_dropout_site(hash_stream(prefix(i) + "self_attention.core_attention.attention_dropout")),
        proj_dropout_site(hash_stream(prefix(i) + "self_attention.hidden_dropout")),
        mlp_dropout_site(hash_stream(prefix(i) + "mlp.hidden_dropout")),
        qkv_lora_site(hash_stream(prefix(i) + "self_attention.linear_qkv.lora_dropout")),
        proj_lora_site(hash_stream(prefix(i) + "self_attention.linear_proj.lora_dropout")),
        fc1_lora_site(hash_stream(prefix(i) + "mlp.linear_fc1.lora_dropout")),
        fc2_lora_site(hash_stream(prefix(i) + "mlp.linear_fc2.lora_dropout")),
        activation_(c.activation),
        ffn_local_(c.ffn_hidden_size() / region.size()) {
    // Gradients that are partial sums over the TP group (completed there before the optimizer, see
    // Parameter::sequence_parallel): with SP the norms see this rank's token shard only; with TP the
    // qk-norms see this rank's heads only. (The row-parallel biases mark themselves.)
    if (region.sequence_parallel)
      for (const Norm* n : {&ln1, &ln2})
        for (Parameter* p : n->parameters()) p->sequence_parallel = true;
    if (qk_norm && region.size() > 1)
      for (Parameter* p : qk_norm->parameters()) p->sequence_parallel = true;
    if (lora != nullptr) add_lora(*lora_ps, c, i, region, *lora);
  }
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

  // out = layer(x) (the residual layout); `out` may alias `x` (generation). Saves into s.
  void forward(const TransformerLayerContext& c, TensorView out, TransformerLayerSaved& s, TensorView x) const;
  // Enters with c.dres = d(out), leaves with c.dres = d(x); parameter gradients accumulate.
  void backward(const TransformerLayerContext& c, TransformerLayerSaved& s, TensorView x) const;
  // act = act(fc): GeLU, or the GLU of a gated MLP's [gate | up].
  void mlp_activation(const DeviceContext& ctx, TensorView act, TensorView fc) const;

 private:
  void mlp_backward(const TransformerLayerContext& c, TransformerLayerSaved& s) const;
  void attention_backward(const TransformerLayerContext& c, TransformerLayerSaved& s, TensorView x) const;
  // The adapters of `lora`'s targets (transformer_layer_lora.cpp): placement on the fused layouts and TP.
  void add_lora(ParameterSet& ps, const GPTConfig& c, int64_t i, const TpRegion& region, const LoraOptions& lora);
  RowEpilogue epilogue(const TransformerLayerContext& c, uint64_t site) const {
    return c.hidden_dropout ? c.hidden_dropout(site) : RowEpilogue{};
  }
  static DropoutMask lora_mask(const TransformerLayerContext& c, uint64_t site) {
    return c.lora_dropout ? c.lora_dropout(site) : DropoutMask{};
  }
  MlpActivation activation_;
  int64_t ffn_local_;  // this rank's FFN width (F / TP)
};

}  // namespace loom
