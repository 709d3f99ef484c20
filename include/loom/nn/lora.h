// LoRA (Hu et al. 2021; PEFT's LoraLayer, NeMo's ParallelLinearAdapter): a low-rank update added to a
// frozen linear layer's output, y = W x (+ b) + scale · B (A · dropout(x)), A (rank, in), B (out, rank),
// scale = alpha / rank. Initialised as PEFT does: A from kaiming_uniform_(a = sqrt(5)), i.e.
// U(-1/sqrt(in), 1/sqrt(in)), and B zero, so the adapted layer starts equal to the base. The parameters are
// <prefix>.lora_A.weight and <prefix>.lora_B.weight (no weight decay exemption: PEFT trains them with the
// optimizer's weight decay). Dropout uses the hidden-dropout Philox masks (seed, stream), regenerated in
// backward. Single-device building block with explicit forward/backward like the other modules
// (loom/nn/modules.h); the model wires it to its linears.
#pragma once
#include <cstdint>
#include <string>

#include "loom/param/parameter.h"

namespace loom {

struct LoraConfig {
  int64_t rank = 0;      // --lora-rank
  float alpha = 32.0f;   // --lora-alpha (scale = alpha / rank)
  float dropout = 0.0f;  // --lora-dropout, on the adapter's input
  float scale() const { return alpha / float(rank); }
};

class LoraAdapter {
 public:
  struct Saved {
    Tensor dropped;  // (N, in) dropout(x); empty without dropout (x itself is used)
    Tensor h;        // (N, rank) scale · A · dropout(x)
  };
  // UserError for a rank < 1 or > min(in, out) (the update would not be low rank), or a dropout
  // outside [0, 1).
  LoraAdapter(ParameterSet& ps, const std::string& prefix, int64_t in_features, int64_t out_features,
              const LoraConfig& cfg);
  // out (N, out) += scale · dropout(inp) A^T B^T; inp (N, in), both in the compute dtype. The dropout
  // mask is (seed, stream) over the flat (N, in) index.
  void forward(const DeviceContext& ctx, TensorView out, Saved& s, TensorView inp, uint64_t seed = 0,
               uint64_t stream = 0) const;
  // dA, dB accumulate; dinp ACCUMULATES (+=) the adapter's input gradient (the base layer wrote its own
  // first); dinp empty skips it.
  void backward(const DeviceContext& ctx, TensorView dinp, TensorView dout, TensorView inp, const Saved& s,
                uint64_t seed = 0, uint64_t stream = 0) const;
  Parameter& a() const { return *a_; }
  Parameter& b() const { return *b_; }
  const LoraConfig& config() const { return cfg_; }

 private:
  int64_t in_, out_;
  LoraConfig cfg_;
  Parameter* a_;
  Parameter* b_;
};

}  // namespace loom
