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
#include "model/transformer_layer.h"

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
