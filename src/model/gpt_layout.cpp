// GPTModel's static side: which parameters a layout declares (and with which shards), the one list of
// activation buffers that memory_plan() reports and ensure_buffers() allocates, and the recompute roles.
#include "model/gpt_impl.h"

namespace loom {

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
  const int64_t L = opts.parallel.layer_count(cfg.num_layers), N = opts.recompute_num_layers;
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
  const int64_t first = mp.first_layer, nl = mp.layer_count(cfg.num_layers);
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
  // A MoE layer's MLP buffers are its own (per call, sized by the routing): no dense fc1 output.
  auto emit_acts = [&](const std::string& p, LayerActs* a, bool with_att, bool with_out, bool dense_mlp) {
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
    if (dense_mlp) emit(p + "fc1", d.full(d.F1l), cd, a ? &a->fc : nullptr);
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
        emit_acts(p, a, !selective, true, !cfg.is_moe_layer(first + l));
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
              s + 1 < slots, cfg.num_moe_layers() < cfg.num_layers);
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

GPTModel::Declared GPTModel::declare_parameters(ParameterSet& ps, ParameterSet& lora_ps, const GPTConfig& cfg,
                                                const ModelOptions& opts) {
  const ModelParallel& mp = opts.parallel;
  const int tp = mp.tp_size(), r = mp.tp_rank();
  const int64_t nl = mp.layer_count(cfg.num_layers);
  const ShardRange vocab = even_shard(cfg.padded_vocab_size, tp, r);
  const TpRegion region{mp.tp, mp.sequence_parallel};
  Declared d;
  const ParameterSet& trained = opts.lora ? lora_ps : ps;  // what the units address
  auto unit = [&](std::string name, auto&& build) {
    const size_t begin = trained.all().size();
    build();
    d.units.push_back({std::move(name), {begin, trained.all().size()}});
  };
  if (mp.pre_process) {
    unit("embedding", [&] {
      const bool learned = cfg.position_embedding_type == PositionEmbeddingType::kLearnedAbsolute;
      const int64_t P = learned ? cfg.max_position_embeddings : 0;
      d.embedding = tp == 1 ? std::make_unique<Embedding>(ps, cfg.padded_vocab_size, cfg.hidden_size, P,
                                                          cfg.init_method_std)
                            : std::make_unique<Embedding>(ps, cfg.padded_vocab_size, cfg.hidden_size, P,
                                                          cfg.init_method_std, vocab);
      d.embedding->word_embeddings().tied_embedding = !cfg.untie_embeddings_and_output_weights;
    });
  }
  for (int64_t l = 0; l < nl; ++l) {
    const int64_t g = mp.first_layer + l;
    unit("decoder.layers." + std::to_string(g),
         [&] {
           d.layers.push_back(std::make_unique<Layer>(ps, cfg, g, region, &lora_ps, opts.lora ? &*opts.lora : nullptr,
                                                      &mp.expert));
         });
    if (d.layers.back()->moe) {
      // The routed experts (declared last) form their own unit: reduced over the expert-data-parallel group.
      auto& [name, range] = d.units.back();
      const size_t experts = d.layers.back()->moe->experts.fc1().size() * 2;
      d.units.push_back({name + ".mlp.experts", {range.second - experts, range.second}});
      d.units[d.units.size() - 2].second.second -= experts;
    }
  }
  if (mp.post_process) {
    unit("head", [&] {
      d.final_ln = std::make_unique<Norm>(ps, "decoder.final_layernorm", cfg.hidden_size, cfg.layernorm_epsilon,
                                          cfg.normalization);
      // Megatron initialises the untied output layer with init_method (not the scaled one).
      if (cfg.untie_embeddings_and_output_weights) {
        d.output_layer = std::make_unique<ColumnParallelLinear>(ps, "output_layer", cfg.hidden_size,
                                                                cfg.padded_vocab_size, false, cfg.init_method_std,
                                                                region, std::vector<ShardRange>{vocab});
      } else if (!mp.pre_process) {
        // The last stage's copy of the tied word embedding: the same name, so it initialises to the same
        // values as the first stage's; its gradient is summed with that one over the embedding group.
        const Shape g{cfg.padded_vocab_size, cfg.hidden_size};
        d.tied_copy = tp == 1 ? &ps.add("embedding.word_embeddings.weight", g, InitKind::kNormal,
                                        cfg.init_method_std, false, 0)
                              : &ps.add_sharded("embedding.word_embeddings.weight", g, 0, {vocab}, InitKind::kNormal,
                                                cfg.init_method_std, false);
        d.tied_copy->tied_embedding_copy = true;
        d.tied_copy->tied_embedding = true;
      }
      // A tied output layer borrows the word embedding (this chunk's, or the last stage's copy).
      if (!cfg.untie_embeddings_and_output_weights)
        d.output_layer = std::make_unique<ColumnParallelLinear>(
            "output_layer", d.tied_copy ? *d.tied_copy : d.embedding->word_embeddings(), region);
    });
  }
  // The final norm sees this rank's token shard only under SP (the layers mark their own norms).
  if (d.final_ln && mp.sequence_parallel)
    for (Parameter* p : d.final_ln->parameters()) p->sequence_parallel = true;
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
  ParameterSet declared, declared_lora;  // the local parameters, declared but never allocated
  declare_parameters(declared, declared_lora, cfg, opts);
  // What ParameterSet::allocate creates for the storage mode (sharded modes: the optimizer's shards and
  // bucket buffers are not the model's). With LoRA the frozen base is whole without gradients and the
  // adapters take the storage mode.
  const bool b16 = opts.compute_dtype != DType::kF32;
  auto plan_set = [&](const std::string& prefix, int64_t n, ParamStorage st, bool grads) {
    if (st == ParamStorage::kExternal) return;
    if (st == ParamStorage::kFull || !b16)  // kFrozen: values only in f32, where they are the compute copy
      plan.parameters.push_back({prefix + ".values", {n}, DType::kF32});
    if (b16) plan.parameters.push_back({prefix + ".compute", {n}, opts.compute_dtype});
    if (st == ParamStorage::kFrozen) return;
    if (grads && st != ParamStorage::kShardedMasterGrads) plan.parameters.push_back({prefix + ".grads", {n}, opts.grad_dtype});
  };
  if (opts.lora) {
    plan_set("params", declared.numel(), ParamStorage::kFrozen, false);
    plan_set("lora", declared_lora.numel(), opts.param_storage, opts.with_grads);
  } else {
    plan_set("params", declared.numel(), opts.param_storage, opts.with_grads);
  }
  if (cfg.position_embedding_type == PositionEmbeddingType::kRope) {
    const Shape table{cfg.max_position_embeddings, cfg.rotary_dim() / 2};
    plan.parameters.push_back({"rope.cos", table, DType::kF32});
    plan.parameters.push_back({"rope.sin", table, DType::kF32});
  }
  if (opts.fp8) {
    // FP8 (emulated): every GEMM site keeps its dequantised weight (f32) for the step, and the scaling
    // state: amax history (L, sites) and scale, scale_inv per tensor (2 forward, 1 backward per site).
    int64_t weights = 0, sites = 0;
    const auto ends_with = [](const std::string& a, const std::string& b) {
      return a.size() >= b.size() && a.compare(a.size() - b.size(), b.size(), b) == 0;
    };
    for (const Parameter& p : declared.all())
      for (const char* w : {"linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight",
                            "output_layer.weight"})
        if (ends_with(p.name, w)) {
          weights += p.shape.numel();
          ++sites;
        }
    // A tied output layer reads the word embedding (or the last stage's copy of it).
    if (opts.parallel.post_process && !cfg.untie_embeddings_and_output_weights) {
      const Parameter* e = declared.find("embedding.word_embeddings.weight");
      if (e) {
        weights += e->shape.numel();
        ++sites;
      }
    }
    if (sites > 0) {
      // q(W) and its transpose (the dgrad GEMM's K-contiguous operand), 1 byte per element each.
      plan.parameters.push_back({"fp8.weight_cache", {2 * weights}, DType::kF8E4M3});
      const int64_t L = opts.fp8->amax_history_len;
      plan.parameters.push_back({"fp8.forward_state", {(L + 2) * 2 * sites}, DType::kF32});
      plan.parameters.push_back({"fp8.backward_state", {(L + 2) * sites}, DType::kF32});
    }
  }
  for (BufferSlot& s : activation_layout(cfg, opts, B, T, nullptr)) plan.activations.push_back(std::move(s.buffer));
  return plan;
}

}  // namespace loom
