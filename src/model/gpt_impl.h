// Private to the model layer: the definitions of GPTModel's nested structs (layers, saved activations,
// recompute roles, buffer slots, pipeline slots) and the size/helper functions shared by gpt.cpp (forward,
// backward, slots) and gpt_layout.cpp (parameter declaration, activation layout, memory plan).
#pragma once
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "loom/core/rng.h"
#include "loom/model/gpt.h"
#include "loom/nn/fp8_gemm.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom {

namespace gpt_detail {

inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser: a bijection that spreads every input bit
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Philox stream of one dropout site for one micro-batch. The site hash names the tensor (layer index
// included); a tensor-parallel rank will mix its TP rank into the site hash for dropout inside TP regions
// (attention probabilities of its heads), as Megatron's model-parallel RNG tracker does, and leave it out
// for the replicated hidden dropout so all TP ranks drop the same elements.
inline uint64_t dropout_stream(uint64_t site, uint64_t micro_batch_index) { return mix64(site ^ mix64(micro_batch_index)); }

// The attention core's parameters on one TP rank: its NH/TP query heads and NKV/TP query groups.
inline AttentionParams local_attention_params(const GPTConfig& c, int tp) {
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

inline Dims make_dims(const GPTConfig& c, const ModelOptions& o, int64_t B, int64_t T) {
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

}  // namespace gpt_detail
using namespace gpt_detail;  // private header of the model layer

// FP8: two scaling groups (forward: input and weight of every GEMM site; backward: its output gradient);
// the sites are the linear layers' own Fp8Gemms, listed with their layer's name (checkpoint names) in
// slot order: qkv, proj, fc1, fc2 of every local layer, then the output layer.
struct GPTModel::Fp8State {
  std::unique_ptr<Fp8ScalingGroup> fwd, bwd;
  struct Site {
    std::string name;  // the linear layer's parameter prefix, e.g. decoder.layers.3.mlp.linear_fc1
    Fp8Gemm* gemm = nullptr;
  };
  std::vector<Site> sites;
};

struct GPTModel::Layer {
  // Declaration order is parameter order in the flat buffers: norms, attention, MLP (GPT-2's order, with
  // the qk-norms after the attention projections). With TP > 1: linear_qkv holds this rank's query groups
  // (one contiguous row range of the grouped layout), fc1 its FFN rows (a gated fc1 its gate rows and its
  // up rows), linear_proj / fc2 their input columns; norms and the row-parallel biases are whole.
  Norm ln1, ln2;
  ColumnParallelLinear qkv;
  RowParallelLinear proj;
  std::optional<QKNorm> qk_norm;
  ColumnParallelLinear fc1;
  RowParallelLinear fc2;
  AttentionCore attn;
  uint64_t attn_dropout_site, proj_dropout_site, mlp_dropout_site;
  Layer(ParameterSet& ps, const GPTConfig& c, int64_t i, const TpRegion& region)
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
        fc1(ps, prefix(i) + "mlp.linear_fc1", c.hidden_size, (c.gated_mlp() ? 2 : 1) * c.ffn_hidden_size(),
            c.add_bias_linear, c.init_method_std, region, fc1_shard(c, region.size(), region.rank())),
        fc2(ps, prefix(i) + "mlp.linear_fc2", c.ffn_hidden_size(), c.hidden_size, c.add_bias_linear, scaled_std(c),
            region, even_shard(c.ffn_hidden_size(), region.size(), region.rank())),
        attn(local_attention_params(c, region.size())),
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
  std::unique_ptr<ColumnParallelLinear> output_layer;
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

namespace gpt_detail {

inline uint64_t embedding_dropout_site() {
  static const uint64_t site = hash_stream("embedding.embedding_dropout");
  return site;
}
}  // namespace gpt_detail

}  // namespace loom
