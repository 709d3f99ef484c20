// Incremental (KV-cached) forward over a GPTModel's weights, for text generation (`loom generate`).
//
// An InferenceSession reads the model's compute-dtype parameters by name (it holds references: the
// weights must outlive the session and not change while it is used) and owns the key/value cache:
// per layer K and V (B, NKV, capacity, HS) in f32 (a bf16/f16 key is exact in f32), so a decode step
// reads one contiguous (length, HS) block per key/value head. forward() feeds Tn new tokens per row at
// positions [length(), length() + Tn): every op of the training forward runs on just those rows
// (norms, qkv, qk-norm, RoPE / learned positions at the true positions, projections, MLP, residuals),
// their rotated keys and values are appended to the cache, and each new query attends over the cached
// keys it may see (causal, sliding window, one K/V head per query group). Only the last new position's
// logits are computed. A prefill is one forward() over the prompt; each decode step is a forward() of
// one token. All rows advance together (the cache has one length); rows are independent of each other.
//
// Numerics: the same ops on the same inputs as GPTModel::forward (evaluation, no dropout) except the
// attention core, which here is an exact f32 softmax over the visible keys (the training core's online
// softmax agrees to rounding), so logits match a full forward over the whole prefix to ~1e-6 in f32.
// CPU backend only (the cached attention reads host memory).
#pragma once
#include <memory>
#include <vector>

#include "loom/model/gpt.h"

namespace loom {

class InferenceSession {
 public:
  // batch B rows, room for `capacity` positions (>= 1; at most max_position_embeddings unless the model
  // has no position embedding). The cache is allocated here, zero-length.
  InferenceSession(const GPTModel& model, const DeviceContext& ctx, int64_t batch, int64_t capacity);
  ~InferenceSession();
  InferenceSession(const InferenceSession&) = delete;
  InferenceSession& operator=(const InferenceSession&) = delete;

  int64_t batch() const { return B_; }
  int64_t capacity() const { return capacity_; }
  int64_t length() const { return length_; }  // positions cached so far
  void reset() { length_ = 0; }                // forget the cache (the buffers stay)
  // Bytes of the key/value cache (2 · L · B · NKV · capacity · HS · 4).
  int64_t cache_bytes() const;

  // Feeds tokens (B, Tn) i32 (host memory), Tn >= 1 and length() + Tn <= capacity(). Returns the
  // logits of the last new position of each row, (B, Vp) f32, valid until the next call.
  TensorView forward(TensorView tokens);

 private:
  const Parameter& param(const std::string& name) const;
  void norm(TensorView out, TensorView inp, const Parameter& w, const Parameter* b) const;
  void append_kv(int64_t layer, TensorView qkv, int64_t Tn) const;
  void cached_attention(int64_t layer, TensorView out, TensorView qkv, int64_t Tn) const;
  void ensure_step_buffers(int64_t Tn);

  const GPTModel& model_;
  const GPTConfig& cfg_;
  const DeviceContext& ctx_;
  int64_t B_, capacity_, length_ = 0;
  AttentionParams attn_;
  const RotaryEmbedding* rope_ = nullptr;  // the model's tables (null without RoPE)
  const Parameter* wte_ = nullptr;
  const Parameter* wpe_ = nullptr;
  const Parameter* lnf_w_ = nullptr;
  const Parameter* lnf_b_ = nullptr;
  const Parameter* out_w_ = nullptr;
  std::vector<Tensor> k_cache_, v_cache_;  // per layer (B, NKV, capacity, HS) f32

  // Per-step buffers, sized for Tn new tokens per row (N = B·Tn rows); reallocated when Tn changes.
  int64_t step_tn_ = 0;
  Tensor positions_;        // (B, Tn) i32
  Tensor tokens_;           // (B, Tn) i32 on the context's device
  Tensor x_, h_, qkv_, att_, branch_, res2_, fc_, act_;  // compute dtype
  Tensor qk_scratch_;       // (N·NH·HS) the qk-norm's scratch (--qk-layernorm)
  Tensor mean_, rstd_;      // (N) f32 final-norm statistics (unused by the caller)
  Tensor last_, lnf_;       // (B, C) the last new position's hidden state, and after the final norm
  Tensor logits_c_;         // (B, Vp) compute dtype
  Tensor logits_;           // (B, Vp) f32
};

}  // namespace loom
