// `loom calc` with LoRA against hand-computed counts: a small Llama (GQA, SwiGLU, RMSNorm, RoPE, untied, no
// biases) with PEFT slice targets (q_proj, v_proj, gate_proj) and whole targets (linear_qkv, linear_fc2)
// under TP 2 (column-parallel adapters: A whole, B split; row-parallel: A split, B whole), the frozen base's
// bytes next to the adapters' ZeRO-sharded model states, the hardware FLOPs of a LoRA step, the pipeline
// and ZeRO-3 figures, the single-process plan against GPTModel::memory_plan, and the flag errors.
#include <gtest/gtest.h>

#include <functional>

#include "loom/core/check.h"
#include "loom/train/calc.h"

using namespace loom;

namespace {

// l 2, h 64, a 4 heads of d 16, g 2 query groups, FFN 96 (SwiGLU: fc1 192 rows), s 32, vocabulary 256
// (a multiple of 128 x TP 2), b 2, B 8, BF16, TP 2 on 4 GPUs (DP 2), ZeRO-1, LoRA rank 4.
//   qkv width (4 + 2*2)*16 = 128, attention width 4*16 = 64.
//   Base per layer: 64*128 + 64*64 + 64*192 + 96*64 = 30,720 split by TP, 2 RMSNorms 128 replicated.
//   Base on one TP rank: 2*(15,360 + 128) + 256*64/2 (embedding) + 64 (final norm) + 8,192 (output) = 47,424;
//   the whole model: 2*(30,720 + 128) + 2*16,384 + 64 = 94,528.
constexpr int64_t kBaseRank = 47424, kBase = 94528;

TrainConfig llama(const std::vector<std::string>& targets) {
  TrainConfig c;
  c.model.num_layers = 2;
  c.model.hidden_size = 64;
  c.model.num_attention_heads = 4;
  c.model.group_query_attention = true;
  c.model.num_query_groups = 2;
  c.model.ffn_hidden = 96;
  c.model.normalization = NormKind::kRMSNorm;
  c.model.activation = MlpActivation::kSwiGLU;
  c.model.position_embedding_type = PositionEmbeddingType::kRope;
  c.model.add_bias_linear = false;
  c.model.untie_embeddings_and_output_weights = true;
  c.model.max_position_embeddings = 32;
  c.batch.seq_length = 32;
  c.batch.micro_batch_size = 2;
  c.batch.global_batch_size = 8;
  c.data.vocab_size = 256;
  c.precision.bf16 = true;
  c.parallel.tensor_model_parallel_size = 2;
  c.dist.use_distributed_optimizer = true;
  c.lora.rank = 4;
  c.lora.target_modules = targets;
  return c;
}

CalcReport calc(const std::vector<std::string>& targets,
                const std::function<void(TrainConfig&, CalcOptions&)>& edit = {}) {
  TrainConfig c = llama(targets);
  CalcOptions o;
  o.num_gpus = 4;
  if (edit) edit(c, o);
  return compute_calc(make_calc_input(c, o));
}

const std::vector<std::string> kSlices = {"q_proj", "v_proj", "gate_proj"};
const std::vector<std::string> kWhole = {"linear_qkv", "linear_fc2"};

std::string calc_error(const std::function<void(TrainConfig&, CalcOptions&)>& edit) {
  TrainConfig c = llama(kSlices);
  CalcOptions o;
  edit(c, o);
  try {
    make_calc_input(c, o);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

std::string report_line(const std::string& out, const std::string& label) {
  const size_t at = out.find(label);
  if (at == std::string::npos) return std::string();
  return out.substr(at, out.find('\n', at) - at);
}

// Base FLOPs of one iteration (B*s = 256 tokens): linears 2*256*30,720 per layer, the attention core
// 4*8*32^2*64 per layer, logits 2*256*64*256.
constexpr double kLinears = 15728640, kCore = 2097152, kLogits = 8388608;

}  // namespace

TEST(CalcLora, SliceTargetsParameters) {
  const CalcReport r = calc(kSlices);
  EXPECT_EQ(r.params, kBase);
  EXPECT_EQ(r.params_first_stage, kBaseRank);
  ASSERT_EQ(r.lora_adapters.size(), 3u);
  // q_proj: A (4, 64), B (64, 4) = 512; on a TP rank A whole + 32 of B's rows: 256 + 128 = 384.
  // v_proj: A (4, 64), B (32, 4) = 384; 256 + 16*4 = 320.
  // gate_proj: A (4, 64), B (96, 4) = 640; 256 + 48*4 = 448.
  EXPECT_EQ(r.lora_adapters[0].target, LoraTarget::kQ);
  EXPECT_EQ(r.lora_adapters[0].params_per_rank(4, 2), 384);
  EXPECT_EQ(r.lora_adapters[1].params_per_rank(4, 2), 320);
  EXPECT_EQ(r.lora_adapters[2].params_per_rank(4, 2), 448);
  // The up GEMM spans the fused layer: qkv's 128 rows for q and v, fc1's 192 for gate.
  EXPECT_EQ(r.lora_adapters[0].layer_out, 128);
  EXPECT_EQ(r.lora_adapters[2].layer_out, 192);
  EXPECT_EQ(r.lora_params, 2 * (512 + 384 + 640));  // 3,072
  EXPECT_EQ(r.lora_layer_params, 384 + 320 + 448);  // 1,152
  EXPECT_EQ(r.lora_params_stage, 2 * 1152);
}

TEST(CalcLora, WholeTargetsParameters) {
  const CalcReport r = calc(kWhole);
  ASSERT_EQ(r.lora_adapters.size(), 2u);
  // linear_qkv (column): A (4, 64) whole + B (128, 4) split: 256 + 256 = 512 of 768.
  // linear_fc2 (row): A (4, 96) split: 192, + B (64, 4) whole: 256 = 448 of 640.
  EXPECT_TRUE(r.lora_adapters[0].column_parallel);
  EXPECT_FALSE(r.lora_adapters[1].column_parallel);
  EXPECT_EQ(r.lora_adapters[0].params_per_rank(4, 2), 512);
  EXPECT_EQ(r.lora_adapters[1].params_per_rank(4, 2), 448);
  EXPECT_EQ(r.lora_params, 2 * (768 + 640));
  EXPECT_EQ(r.lora_params_stage, 2 * 960);
}

TEST(CalcLora, MemoryFrozenBaseAndShardedAdapters) {
  // BF16 ZeRO-1 over d = 2: the base 2 B/param whole; the adapters' 2*A + 4*ceil(A/2) weights, 4*A FP32
  // grads, 8*ceil(A/2) Adam.
  const CalcReport s = calc(kSlices);
  EXPECT_EQ(s.zero_group, 2);
  EXPECT_EQ(s.frozen_per_param, 2);
  EXPECT_EQ(s.frozen_bytes, 2 * kBaseRank);  // 94,848
  EXPECT_EQ(s.weight_bytes, 2 * 2304 + 4 * 1152);
  EXPECT_EQ(s.grad_bytes, 4 * 2304);
  EXPECT_EQ(s.optimizer_bytes, 8 * 1152);
  EXPECT_EQ(s.states_bytes(), 94848 + 27648);
  EXPECT_EQ(s.layer_params, 1152);  // what ZeRO-3 gathers per layer
  const CalcReport w = calc(kWhole);
  EXPECT_EQ(w.frozen_bytes, 94848);
  EXPECT_EQ(w.states_bytes(), 94848 + 3 * 7680);
  // FP32: the base's values are its compute copy, 4 B/param; no sharding: 16 B per adapter parameter.
  const CalcReport f = calc(kWhole, [](TrainConfig& c, CalcOptions&) {
    c.precision.bf16 = false;
    c.dist.use_distributed_optimizer = false;
  });
  EXPECT_EQ(f.frozen_per_param, 4);
  EXPECT_EQ(f.frozen_bytes, 4 * kBaseRank);
  EXPECT_EQ(f.weight_bytes + f.grad_bytes + f.optimizer_bytes, 16 * 1920);
  // ZeRO-3: 18/d per adapter parameter, the base still whole; two layers' adapters gathered (2 + 4 B each).
  const CalcReport z3 = calc(kSlices, [](TrainConfig& c, CalcOptions&) {
    c.dist.use_distributed_optimizer = false;
    c.dist.sharding_strategy = "optim_grads_params";
  });
  EXPECT_EQ(z3.states_bytes(), 94848 + 18 * 1152);
  EXPECT_EQ(z3.transient_bytes, 2 * 1152 * 6);
  // ZeRO-2: two buckets of FP32 gradients at most, here all of the adapters'.
  const CalcReport z2 = calc(kSlices, [](TrainConfig& c, CalcOptions&) {
    c.dist.use_distributed_optimizer = false;
    c.dist.sharding_strategy = "optim_grads";
  });
  EXPECT_EQ(z2.transient_bytes, 4 * 2304);
}

TEST(CalcLora, PipelineStagesHoldTheirLayersAdapters) {
  const CalcReport r = calc(kWhole, [](TrainConfig& c, CalcOptions& o) {
    c.parallel.pipeline_model_parallel_size = 2;
    o.num_gpus = 8;  // TP 2 x PP 2 x DP 2
  });
  EXPECT_EQ(r.lora_params_stage, 960);
  // First stage: one layer + the embedding; last: one layer + final norm + output layer.
  EXPECT_EQ(r.params_first_stage, 15488 + 8192);
  EXPECT_EQ(r.params_last_stage, 15488 + 8192 + 64);
  EXPECT_EQ(r.frozen_bytes, 2 * (15488 + 8192));
  EXPECT_EQ(r.last_frozen_bytes, 2 * (15488 + 8256));
  EXPECT_EQ(r.last_states_bytes() - r.last_frozen_bytes, r.states_bytes() - r.frozen_bytes);
}

TEST(CalcLora, HardwareFlops) {
  // Per token and layer over the TP group (t = 2, r = 4):
  //   q_proj, v_proj (column, in 64, the up GEMM over qkv's 128 rows): forward 2*(2*64*4) + 2*4*128 = 2,048,
  //     backward 2*3*(2*64*4) + 2*(2*4*128) = 5,120;
  //   gate_proj (over fc1's 192 rows): forward 1,024 + 1,536 = 2,560, backward 3,072 + 3,072 = 6,144.
  // 256 tokens, 2 layers: adapters 2*256*(6,656 + 16,384) = 11,796,480.
  const CalcReport s = calc(kSlices);
  EXPECT_DOUBLE_EQ(s.flops_adapters, 11796480.0);
  EXPECT_DOUBLE_EQ(s.flops_adapters_forward_layer, 256.0 * 6656);
  // Base: linears forward + input gradients (2x), attention core 3x, logits 2x.
  const double base = 2 * (2 * kLinears + 3 * kCore) + 2 * kLogits;
  EXPECT_DOUBLE_EQ(s.flops_lora, base + 11796480.0);  // 104,071,168
  EXPECT_DOUBLE_EQ(s.flops_run, s.flops_lora);
  EXPECT_DOUBLE_EQ(s.flops_model, 3 * (2 * (kLinears + kCore) + kLogits));  // full training, for reference
  EXPECT_DOUBLE_EQ(s.flops_selective, s.flops_lora + 2 * kCore);
  EXPECT_DOUBLE_EQ(s.flops_full, s.flops_lora + 2 * (kLinears + kCore + 256.0 * 6656));
  // linear_qkv as q_proj above; linear_fc2 (row, in 96, out 64): forward 2*96*4 + 2*4*64 (TP rank 0 only)
  // = 1,280, backward 3*(2*96*4) + 2*2*(2*4*64) (every rank) = 4,352.
  const CalcReport w = calc(kWhole);
  EXPECT_DOUBLE_EQ(w.flops_adapters, 2.0 * 256 * (2048 + 5120 + 1280 + 4352));
  // TP 1: every GEMM once, forward 2*N*(in + out)*r, backward twice that plus the recomputed down GEMM.
  const CalcReport one = calc(kWhole, [](TrainConfig& c, CalcOptions& o) {
    c.parallel.tensor_model_parallel_size = 1;
    o.num_gpus = 2;
  });
  const double qkv = 2 * 64 * 4 * 4 + 2 * 4 * 128 * 3, fc2 = 2 * 96 * 4 * 4 + 2 * 4 * 64 * 3;
  EXPECT_DOUBLE_EQ(one.flops_adapters, 2.0 * 256 * (qkv + fc2));
  // Block recomputation of 1 layer: one layer's forward again, its adapters' included.
  const CalcReport blk = calc(kSlices, [](TrainConfig& c, CalcOptions&) {
    c.recompute.granularity = "full";
    c.recompute.method = "block";
    c.recompute.num_layers = 1;
  });
  EXPECT_DOUBLE_EQ(blk.flops_run, blk.flops_lora + kLinears + kCore + 256.0 * 6656);
}

TEST(CalcLora, TimeUsesTheLoraFlops) {
  const CalcReport r = calc(kSlices, [](TrainConfig&, CalcOptions& o) {
    o.train_tokens = 1e9;
    o.gpu_tflops = 100;
  });
  const double cluster = 4 * 100e12;
  EXPECT_DOUBLE_EQ(r.seconds_per_iteration, r.flops_lora / cluster);
  EXPECT_DOUBLE_EQ(r.seconds_lora_4tp, 4.0 * 1e9 * double(kBase) / cluster);
  EXPECT_DOUBLE_EQ(r.seconds_lora_6tp, 6.0 * 1e9 * double(kBase) / cluster);
  EXPECT_DOUBLE_EQ(r.seconds_run, r.iterations * r.flops_lora / cluster);
}

TEST(CalcLora, SingleProcessPlanIsTheModelsOwn) {
  // TP 1, one GPU: the model's plan (GPTModel::memory_plan) holds the frozen base (params.*) and the
  // adapters (lora.*); calc's adapter count is the one the model declares.
  const CalcReport r = calc(kSlices, [](TrainConfig& c, CalcOptions& o) {
    c.parallel.tensor_model_parallel_size = 1;
    c.dist.use_distributed_optimizer = false;
    c.lora.dropout = 0.1f;
    o.num_gpus = 1;
  });
  ASSERT_TRUE(r.loom_plan.has_value());
  ModelOptions mo;
  mo.compute_dtype = DType::kBF16;
  mo.lora = r.input.lora;
  const GPTMemoryPlan plan = GPTModel::memory_plan(r.input.model, mo, 2, 32);
  int64_t base = -1, adapters = -1;
  for (const PlannedBuffer& b : plan.parameters) {
    if (b.name == "params.compute") base = b.shape.numel();
    if (b.name == "lora.values") adapters = b.shape.numel();
  }
  EXPECT_EQ(base, r.params);
  EXPECT_EQ(adapters, r.lora_params);
  EXPECT_EQ(r.lora_params, 3072);
  // The base's BF16 copy, the adapters' FP32 values, BF16 copy and FP32 grads, RoPE's cos/sin (32, 8) FP32.
  EXPECT_EQ(r.loom_plan->parameter_bytes, plan.parameter_bytes());
  EXPECT_EQ(r.loom_plan->parameter_bytes, 2 * kBase + (4 + 2 + 4) * 3072 + 2 * 32 * 8 * 4);
  EXPECT_EQ(r.loom_plan->optimizer_bytes, 8 * 3072);
  EXPECT_EQ(r.loom_plan->main_grad_bytes, 0);
  // The largest adapter scratch, N = 64 tokens, BF16, dropout on: gate_proj's forward holds the dropped
  // input (64, 64), h (64, 4), its spread B (192, 4) and the up GEMM's (64, 192) output:
  // 2*(4,096 + 256 + 768 + 12,288) = 34,816 B. Its backward holds less: the dropped input, h, dh and the
  // input gradient, 2*(4,096 + 256 + 256 + 4,096) = 17,408; q_proj's forward 2*(4,096 + 256 + 512 + 8,192).
  EXPECT_EQ(r.loom_plan->adapter_scratch_bytes, 34816);
}

TEST(CalcLora, ReportSaysWhatIsFrozenAndWhichFlops) {
  const std::string out = format_calc_report(calc(kSlices));
  EXPECT_NE(report_line(out, "LoRA: rank 4").find("q_proj v_proj gate_proj"), std::string::npos) << out;
  EXPECT_NE(report_line(out, "LoRA adapters (exact):").find("3,072"), std::string::npos) << out;
  EXPECT_NE(report_line(out, "LoRA adapters on it:").find("2,304"), std::string::npos) << out;
  EXPECT_NE(report_line(out, "frozen base weights:").find("94,848 B"), std::string::npos) << out;
  EXPECT_NE(report_line(out, "frozen base weights:").find("not ZeRO-sharded"), std::string::npos) << out;
  EXPECT_NE(report_line(out, "  model states:").find("122,496 B"), std::string::npos) << out;
  EXPECT_NE(report_line(out, "convention:").find("hardware FLOPs of a LoRA step"), std::string::npos) << out;
  EXPECT_NE(report_line(out, "LoRA (no recomputation):").find("1.0407e+08 FLOP"), std::string::npos) << out;
  EXPECT_NE(report_line(out, "LoRA (no recomputation):").find("<- this run"), std::string::npos) << out;
  EXPECT_NE(report_line(out, "full training (model FLOPs").find("1.3212e+08 FLOP"), std::string::npos) << out;
  EXPECT_EQ(out.find("model (no recomputation):"), std::string::npos) << out;
}

TEST(CalcLora, FlagErrorsNameTheFlag) {
  const auto expect_error = [](const std::function<void(TrainConfig&, CalcOptions&)>& edit, const std::string& needle) {
    const std::string err = calc_error(edit);
    EXPECT_NE(err.find(needle), std::string::npos) << "message: '" << err << "'";
  };
  expect_error([](TrainConfig& c, CalcOptions&) { c.lora.rank = 0; }, "--lora-target-modules needs --lora-rank");
  expect_error([](TrainConfig& c, CalcOptions&) {
    c.lora = {};
    c.lora.alpha_given = true;
  }, "--lora-alpha needs --lora-rank");
  expect_error([](TrainConfig& c, CalcOptions&) { c.lora.dropout = 1.0f; }, "--lora-dropout must be in [0, 1)");
  // v_proj is 64 -> 32: a rank of 33 is not low rank.
  expect_error([](TrainConfig& c, CalcOptions&) { c.lora.rank = 33; }, "--lora-rank must be in [1, 32] for v_proj");
  expect_error([](TrainConfig& c, CalcOptions&) { c.lora.target_modules = {"qkv"}; },
               "--lora-target-modules: unknown module 'qkv'");
  expect_error([](TrainConfig& c, CalcOptions&) { c.model.activation = MlpActivation::kGeLU; },
               "--lora-target-modules gate_proj: this model's MLP is not gated");
  expect_error([](TrainConfig& c, CalcOptions&) { c.model.ffn_hidden = 95; },
               "--ffn-hidden-size (95) must be divisible by --tensor-model-parallel-size (2)");
  // Without --lora-target-modules the trainer's default (all four linears) is used, with a note.
  const CalcReport r = calc({});
  EXPECT_EQ(r.lora_adapters.size(), 4u);
  bool noted = false;
  for (const std::string& n : r.input.notes) noted |= n.find("no --lora-target-modules") != std::string::npos;
  EXPECT_TRUE(noted);
}
