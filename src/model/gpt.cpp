// GPTModel: buffers (one layout shared by the static memory plan and the allocation, gpt_layout.cpp),
// forward, backward, pipeline slots and activation recomputation. Invariant: a recomputed forward runs the
// very same ops on the very same inputs with the same dropout masks as the original forward, so it
// reproduces every bit.
#include "loom/parallel/context_parallel.h"
#include "loom/parallel/tensor_parallel.h"
#include "model/gpt_impl.h"

namespace loom {

// The tokens a micro-batch's mean loss runs over: the sum of its loss mask (B, T), B·T without one.
double GPTModel::loss_token_count(TensorView loss_mask, int64_t B, int64_t T) const {
  if (!loss_mask.defined()) return double(B * T);
  Tensor host;
  if (!loss_mask.device().is_cpu()) {
    host = Tensor::empty(loss_mask.shape(), DType::kF32);
    ctx_.copy(host, loss_mask);
    ctx_.synchronize();
  }
  const float* m = host.defined() ? host.data<float>() : loss_mask.data<float>();
  double sum = 0;
  for (int64_t i = 0; i < loss_mask.numel(); ++i) sum += double(m[i]);
  return sum;
}

GPTModel::GPTModel(const GPTConfig& cfg, const DeviceContext& ctx, const ModelOptions& opts)
    : cfg_(cfg), opts_(opts), ctx_(ctx) {
  cfg_.validate();
  opts_.validate(cfg_);
  Declared d = declare_parameters(params_, lora_params_, cfg_, opts_);
  embedding_ = std::move(d.embedding);
  layers_ = std::move(d.layers);
  final_ln_ = std::move(d.final_ln);
  output_layer_ = std::move(d.output_layer);
  tied_copy_ = d.tied_copy;
  if (opts_.lora) {
    // The frozen base: whole on every rank, in the compute dtype only, no gradients; the adapters take the
    // run's storage strategy.
    params_.allocate(ctx, opts_.compute_dtype, opts_.grad_dtype, /*with_grads=*/false, ParamStorage::kFrozen);
    lora_params_.allocate(ctx, opts_.compute_dtype, opts_.grad_dtype, opts_.with_grads, opts_.param_storage);
  } else {
    params_.allocate(ctx, opts_.compute_dtype, opts_.grad_dtype, opts_.with_grads, opts_.param_storage);
  }
  const ParameterSet& ts = trainable();
  int64_t covered = 0;  // an empty unit (LoRA: the embedding, the head) sits where the previous one ended
  for (const auto& [name, range] : d.units) {
    ParamUnit u;
    u.name = name;
    u.offset = covered;
    if (range.second > range.first) {
      const Parameter& first = ts.all()[range.first];
      const Parameter& last = ts.all()[range.second - 1];
      u.offset = first.offset;
      u.numel = last.offset + last.shape.numel() - first.offset;
      covered = u.offset + u.numel;
    }
    if (name == "embedding") embedding_unit_ = int(units_.size());
    if (name == "head") head_unit_ = int(units_.size());
    units_.push_back(std::move(u));
  }
  first_layer_unit_ = embedding_unit_ >= 0 ? 1 : 0;
  // Each layer's unit; a MoE layer's experts form the next unit, which the layer's unit reads (its hooks
  // cover both; the experts' gradients are reduced over the expert-data-parallel group).
  for (int u = 0; u < int(units_.size()); ++u) {
    const std::string& n = units_[size_t(u)].name;
    if (n.starts_with("decoder.layers.") && !n.ends_with(".mlp.experts")) layer_unit_.push_back(u);
    if (n.ends_with(".mlp.experts")) {
      units_[size_t(u)].expert = true;
      units_[size_t(u - 1)].reads.push_back(u);
    }
  }
  LOOM_CHECK(layer_unit_.size() == layers_.size(), "[GPTModel] ", layer_unit_.size(), " layer units for ",
             layers_.size(), " layers");
  if (opts_.fp8) {
    // Sites: qkv, proj, fc1, fc2 of every local layer, then the output layer (post_process); each linear
    // owns its Fp8Gemm, with slots (2s, 2s + 1) of the forward group and s of the backward group.
    const int sites = int(4 * int64_t(layers_.size())) + (output_layer_ ? 1 : 0);
    fp8_ = std::make_unique<Fp8State>();
    if (sites > 0) {
      fp8_->fwd = std::make_unique<Fp8ScalingGroup>(ctx, opts_.fp8->forward_dtype(), 2 * sites, *opts_.fp8);
      fp8_->bwd = std::make_unique<Fp8ScalingGroup>(ctx, opts_.fp8->backward_dtype(), sites, *opts_.fp8);
      auto add = [&](auto& linear) {
        const int s = int(fp8_->sites.size());
        linear.enable_fp8(ctx, linear.weight().shape, fp8_->fwd.get(), 2 * s, 2 * s + 1, fp8_->bwd.get(), s,
                          opts_.fp8->wgrad);
        fp8_->sites.push_back({linear.name(), linear.fp8()});
      };
      for (const auto& L : layers_) {
        add(L->qkv);
        add(L->proj);
        LOOM_CHECK(L->fc1 && L->fc2, "[GPTModel] FP8 GEMMs on mixture-of-experts layers are not built");
        add(*L->fc1);
        add(*L->fc2);
      }
      if (output_layer_) add(*output_layer_);
    } else {
      fp8_.reset();  // an embedding-only stage has no GEMM
    }
  }
  // A tied output layer in the same instance reads (and its backward writes) the word embedding.
  if (!cfg_.untie_embeddings_and_output_weights && head_unit_ >= 0 && embedding_unit_ >= 0)
    units_[size_t(head_unit_)].reads = {embedding_unit_};
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

void GPTModel::initialize(uint64_t seed) {
  params_.initialize(seed);
  if (opts_.lora && lora_params_.storage() != ParamStorage::kExternal) lora_params_.initialize(seed);
}

void GPTModel::sync_compute() const {
  params_.sync_compute(ctx_);
  if (opts_.lora && lora_params_.storage() == ParamStorage::kFull) lora_params_.sync_compute(ctx_);
}

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
  if (cfg_.is_moe()) {  // each (slot, layer) its own MoE buffers; recomputed layers share their scratch's
    for (LayerActs& a : scratch_) a.moe = std::make_shared<MoeLayerSaved>();
    for (SlotState& S : slots_)
      for (LayerActs& a : S.acts) a.moe = std::make_shared<MoeLayerSaved>();
  }
  routing_group_ = make_routing_group(B, T);
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
  return {cfg_.hidden_dropout, fwd_.dropout_seed, dropout_stream(site, fwd_.micro_batch_index), 0};
}

// Hidden dropout over this rank's B x T_l tokens (rows of C), always the whole (B, T, C) tensor's mask of
// one process: under CP the rank's tokens are chunks cp_rank and 2·CP−1−cp_rank of each sequence, so every
// (sequence, chunk) run draws the mask at its global element offset.
template <typename F>
void GPTModel::for_hidden_dropout_runs(TensorView out, TensorView inp, const DropoutMask& d, F apply) const {
  const ModelParallel& mp = opts_.parallel;
  if (!d.active() || mp.cp_size() == 1) {
    apply(out, inp, d);
    return;
  }
  const int64_t CP = mp.cp_size(), c = T_ / (2 * CP), C = cfg_.hidden_size, Tl = T_ / CP;
  LOOM_CHECK(out.numel() == B_ * Tl * C && inp.numel() == out.numel(), "[GPTModel] hidden dropout expects ",
             B_ * Tl * C, " elements (B x T/CP x C), got ", out.desc(), " and ", inp.desc());
  const TensorView o = out.reshape({out.numel()}), x = inp.reshape({inp.numel()});
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t k = 0; k < 2; ++k) {
      const int64_t chunk = k == 0 ? mp.cp_rank() : 2 * CP - 1 - mp.cp_rank();
      const int64_t local = (b * Tl + k * c) * C, global = (b * T_ + chunk * c) * C;
      DropoutMask run = d;
      run.offset = d.offset + uint64_t(global);
      apply(o.slice_flat(local, Shape{c * C}), x.slice_flat(local, Shape{c * C}), run);
    }
}

void GPTModel::hidden_dropout_forward(TensorView out, TensorView inp, const DropoutMask& d) const {
  for_hidden_dropout_runs(out, inp, d, [&](TensorView o, TensorView x, const DropoutMask& m) {
    dropout_forward(ctx_, o, x, m);
  });
}

void GPTModel::hidden_dropout_backward(TensorView dinp, TensorView dout, const DropoutMask& d) const {
  for_hidden_dropout_runs(dinp, dout, d, [&](TensorView o, TensorView x, const DropoutMask& m) {
    dropout_backward(ctx_, o, x, m);
  });
}

DropoutMask GPTModel::attention_mask(uint64_t site) const {
  if (!fwd_.training || cfg_.attention_dropout <= 0.0f) return {};
  // With TP > 1 a rank draws the probabilities of its own heads from a stream of its own (Megatron's
  // model-parallel RNG tracker): the masks differ from a single process's (the attention op indexes
  // local heads), the dropout rate and the expectation do not.
  const int tp = opts_.parallel.tp_size();
  const uint64_t s = tp > 1 ? site ^ mix64(0x7470ull + uint64_t(opts_.parallel.tp_rank())) : site;
  return {cfg_.attention_dropout, fwd_.dropout_seed, dropout_stream(s, fwd_.micro_batch_index), 0};
}

TensorView GPTModel::layer_input(int64_t l) const {
  return l == 0 ? TensorView(x0_) : TensorView(acts_[size_t(l - 1)].out);
}

RowEpilogue GPTModel::hidden_dropout_epilogue(uint64_t site) const {
  const DropoutMask drop = hidden_mask(site);
  RowEpilogue e;
  e.active = drop.active();
  if (e.active) {
    e.forward = [this, drop](TensorView out, TensorView inp) { hidden_dropout_forward(out, inp, drop); };
    e.backward = [this, drop](TensorView dinp, TensorView dout) { hidden_dropout_backward(dinp, dout, drop); };
  }
  return e;
}

TransformerLayerContext GPTModel::layer_context(TensorView segment_ids) const {
  TransformerLayerContext c{ctx_};
  c.act = act_;
  c.branch = branch_;
  c.dln = dln_;
  c.dres = dres_;
  c.datt = datt_;
  c.dqkv = dqkv_;
  c.dfc = dfc_;
  c.qk_a = qk_a_;
  c.qk_b = qk_b_;
  c.sp_gathered = sp_gathered_;
  c.sp_grad = sp_grad_;
  c.rope = rope_.get();
  c.positions = cp_positions_;
  c.recompute_attention = opts_.recompute_granularity == RecomputeGranularity::kSelective;
  c.moe.group = routing_group_.get();
  c.moe.seq_length = T_;
  c.moe.training = fwd_.training;
  c.moe.aux_grad_scale = moe_aux_grad_scale_;
  c.moe.sp_gathered = sp_gathered_;
  c.moe.sp_grad = sp_grad_;
  c.moe.overlap_shared = opts_.parallel.moe_shared_expert_overlap;
  c.hidden_dropout = [this](uint64_t site) { return hidden_dropout_epilogue(site); };
  c.lora_dropout = [this](uint64_t site) {
    if (!fwd_.training || !opts_.lora || opts_.lora->config.dropout <= 0.0f) return DropoutMask{};
    return DropoutMask{opts_.lora->config.dropout, fwd_.dropout_seed, dropout_stream(site, fwd_.micro_batch_index), 0};
  };
  // The attention core over this rank's tokens: the CP ring over the whole sequence when CP > 1.
  c.attend = [this, segment_ids](const TransformerLayer& L, LayerActs& a, bool recompute) {
    const DropoutMask drop = recompute ? a.attn_saved.dropout : attention_mask(L.attn_dropout_site);
    if (opts_.parallel.cp_size() == 1) {
      L.attn.forward(ctx_, a.att, a.attn_saved, a.qkv, segment_ids, drop);
      return;
    }
    a.attn_saved.dropout = drop;
    ContextParallelAttention::forward(ctx_, a.att, a.attn_saved.lse, a.qkv, L.attn.with_dropout(drop),
                                      *opts_.parallel.cp, segment_ids);
  };
  c.attend_backward = [this, segment_ids](const TransformerLayer& L, LayerActs& a) {
    if (opts_.parallel.cp_size() > 1)
      ContextParallelAttention::backward(ctx_, dqkv_, datt_, a.qkv, a.att, a.attn_saved.lse,
                                         L.attn.with_dropout(a.attn_saved.dropout), *opts_.parallel.cp,
                                         segment_ids);
    else
      L.attn.backward(ctx_, dqkv_, datt_, a.qkv, a.att, a.attn_saved, segment_ids);
  };
  return c;
}

void GPTModel::forward_layer(int64_t l, const TransformerLayerContext& c) {
  LayerActs& a = acts_[size_t(l)];
  layers_[size_t(l)]->forward(c, a.out, a, layer_input(l));
}

// Enters with dres_ = d(layer output), leaves with dres_ = d(layer input).
void GPTModel::backward_layer(int64_t l, const TransformerLayerContext& c) {
  layers_[size_t(l)]->backward(c, acts_[size_t(l)], layer_input(l));
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
  Tensor host_pos = ctx_.device().is_cpu() ? cp_positions_ : Tensor::empty(cp_positions_.shape(), DType::kI32);
  for (int64_t b = 0; b < B_; ++b) std::copy(pos.begin(), pos.end(), host_pos.data<int32_t>() + b * Tl);
  if (!ctx_.device().is_cpu()) ctx_.copy(cp_positions_, host_pos);
  lb.position_ids = batch.position_ids.defined() ? slice(cp_position_ids_, batch.position_ids) : TensorView(cp_positions_);
  return lb;
}

// Embedding output (after dropout) into x0_. TP > 1: vocabulary-parallel lookup (rows of other ranks'
// tokens are 0; the positions added by TP rank 0), summed over the group (reduce-scattered to the token
// shard under SP, with dropout before, on the full tensor, as for row-parallel layers).
void GPTModel::embedding_forward(const GPTBatch& batch) {
  const ModelParallel& mp = opts_.parallel;
  const DropoutMask drop = hidden_mask(embedding_dropout_site());
  if (mp.tp_size() == 1) {
    embedding_->forward(ctx_, x0_, batch.tokens, batch.position_ids);
    hidden_dropout_forward(x0_, x0_, drop);
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
    hidden_dropout_forward(out, out, drop);
    sp_reduce_scatter(mp.tp, x0_, out);
  } else {
    tp_all_reduce(mp.tp, x0_);
    hidden_dropout_forward(x0_, x0_, drop);
  }
}

// Enters with dres_ = d(x0_).
void GPTModel::embedding_backward(const GPTBatch& batch) {
  if (opts_.lora) return;  // a frozen embedding: nothing to compute (its input is the tokens)
  const ModelParallel& mp = opts_.parallel;
  const DropoutMask drop = hidden_mask(embedding_dropout_site());
  if (mp.tp_size() == 1) {
    hidden_dropout_backward(dres_, dres_, drop);
    embedding_->backward(ctx_, dres_, batch.tokens, batch.position_ids);
    return;
  }
  const Dims d = make_dims(cfg_, opts_, B_, T_);
  TensorView dout = dres_;
  if (mp.sequence_parallel) {
    dout = TensorView(branch_);
    sp_all_gather(mp.tp, dout, dres_);
  }
  hidden_dropout_backward(dout, dout, drop);
  Parameter* wpe = embedding_->position_embeddings();
  vocab_local_tokens(tp_tokens_, tp_outside_, batch.tokens, d.vocab_start, d.Vl);
  if (wpe) embedding_positions(tp_positions_, batch.position_ids);
  // A scatter-add into the word embedding's gradient, which a tied output layer's matmul may write too: any
  // later matmul write this step must add to it.
  clear_grad_zero(embedding_->word_embeddings());
  if (wpe) clear_grad_zero(*wpe);
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
  // MoE: the router losses' gradients enter with the main loss's backward scale as Megatron's
  // MoEAuxLossAutoScaler has it (loss scale / micro-batches), given by the caller (the trainer), or else the
  // factor on d(mean loss): dloss_scale times the tokens the mean runs over (dloss_scale is the factor on
  // d(sum of losses)). Times CP as for the main loss below (each CP rank holds its tokens' share;
  // gradients are averaged over DP x CP).
  moe_aux_grad_scale_ = 0;
  if (cfg_.is_moe() && dloss_scale != 0.0f)
    moe_aux_grad_scale_ = (std::isnan(opts.moe_aux_loss_scale) ? double(dloss_scale) * loss_token_count(batch.loss_mask, B, T)
                                                                : double(opts.moe_aux_loss_scale)) *
                          double(mp.cp_size());
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
  const TransformerLayerContext lc = layer_context(batch.segment_ids);  // once per pass: the buffers are set
  for (int64_t l = 0; l < nl; ++l) {
    call_hook(&ParamHooks::before_forward, layer_unit_[size_t(l)]);
    forward_layer(l, lc);
    call_hook(&ParamHooks::after_forward, layer_unit_[size_t(l)]);
  }
  if (!mp.post_process) {
    backward_ready_ = opts.training && opts_.with_grads;
    return 0.0f;
  }
  call_hook(&ParamHooks::before_forward, head_unit_);
  const Dims d = make_dims(cfg_, opts_, B, T);
  final_ln_->forward(ctx_, lnf_, lnf_saved_, layer_input(nl));
  output_layer_->forward(ctx_, logits_, lnf_, sp_gathered_);
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
  // The mean loss is a host value (the log, the loss scaler): on a GPU, bring the per-token losses back.
  Tensor host_losses, host_mask;
  if (!ctx_.device().is_cpu()) {
    host_losses = Tensor::empty({N}, DType::kF32);
    ctx_.copy(host_losses, losses_.reshape({N}));
    if (mask.defined()) {
      host_mask = Tensor::empty({N}, DType::kF32);
      ctx_.copy(host_mask, mask);
    }
  }
  const float* lp = host_losses.defined() ? host_losses.data<float>() : losses_.data<float>();
  const float* mp_ = host_mask.defined() ? host_mask.data<float>() : mask.defined() ? mask.data<float>() : nullptr;
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
    output_layer_->backward(ctx_, dln_, logits_.reshape({d.N, d.Vl}), lnf_, sp_gathered_, sp_grad_);
    ops.fill_(dres_, 0.0f);
    final_ln_->backward(ctx_, dres_, dln_, layer_input(nl), lnf_saved_);
    call_hook(&ParamHooks::after_backward, head_unit_);
  } else {
    ops.cast(dres_, pipe_grad_);  // output_grad()
  }
  const TransformerLayerContext lc = layer_context(batch.segment_ids);
  for (int64_t l = nl; l-- > 0;) {
    const LayerRole& r = roles_[size_t(l)];
    const int u = layer_unit_[size_t(l)];
    // Entering a recomputed group from its top: re-run it from its kept input into the scratch slots
    // (its units' parameters are needed from here on: before_backward for all of them first).
    if (r.recomputed && l == r.group_end - 1) {
      for (int64_t g = r.group_end; g-- > r.group_begin;) call_hook(&ParamHooks::before_backward, layer_unit_[size_t(g)]);
      for (int64_t g = r.group_begin; g < r.group_end; ++g) forward_layer(g, lc);
    } else if (!r.recomputed) {
      call_hook(&ParamHooks::before_backward, u);
    }
    backward_layer(l, lc);
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
