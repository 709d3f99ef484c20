// Mixture of experts in `loom calc` and in checkpoints: the MoE presets in configs/ give the published
// parameter counts, total and active (Mixtral 8x7B 46,702,792,704 and 12,879,925,248, checked here from the
// shapes), Megatron's FLOPs (top-k experts), the 6*T*P times with P the active parameters, and memory per
// rank under expert parallelism (experts over EP, their ZeRO shards over the expert-data-parallel group,
// the rest over TP and DP); the expert layout's errors name the flag. configs/moe-tiny.yaml trains, saves
// its MoE architecture in model_config, resumes bit-exact, refuses a different one naming the flag, and
// `loom generate`'s loader rebuilds it from the checkpoint (KV-cached greedy = full-forward greedy).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "loom/train/args.h"
#include "loom/train/calc.h"
#include "loom/train/config_file.h"
#include "loom/train/generate.h"
#include "loom/train/trainer.h"
#include "model_io_test_util.h"

using namespace loom;
namespace fs = std::filesystem;

namespace {

using Args = std::vector<std::string>;

Args cat(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string preset(const std::string& name) { return std::string(LOOM_SOURCE_DIR) + "/configs/" + name + ".yaml"; }

TrainConfig preset_config(const std::string& name, const Args& extra = {}) {
  return parse_with_config_file(cat({"--config", preset(name)}, extra), parse_train_args);
}

CalcReport calc_preset(const std::string& name, const Args& extra = {}, const CalcOptions& o = {}) {
  return compute_calc(make_calc_input(preset_config(name, extra), o));
}

std::string calc_error(const std::string& name, const Args& extra, const CalcOptions& o = {}) {
  try {
    calc_preset(name, extra, o);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// Mixtral 8x7B's shapes (configs/mixtral-8x7b.yaml, HF config.json).
constexpr int64_t kL = 32, kH = 4096, kV = 32000, kE = 8, kK = 2, kF = 14336;
constexpr int64_t kQkv = (32 + 2 * 8) * 128 * kH;  // q 32 heads, k and v 8 heads each, of 128
constexpr int64_t kProj = kH * kH, kNorms = 2 * kH, kRouter = kE * kH;
constexpr int64_t kExpert = 3 * kH * kF;           // w1, w3 (the [gate | up] fc1) and w2
constexpr int64_t kEmbeddings = 2 * kV * kH + kH;  // untied embedding and output layer, the final norm
constexpr int64_t kDenseLayer = kNorms + kQkv + kProj + kRouter;

}  // namespace

TEST(CalcMoe, Mixtral8x7bParametersFromTheShapes) {
  // 32 x (norms 8,192 + qkv 25,165,824 + proj 16,777,216 + router 32,768 + 8 x 176,160,768) + 262,148,096.
  static_assert(kL * (kDenseLayer + kE * kExpert) + kEmbeddings == 46'702'792'704);
  static_assert(kL * (kDenseLayer + kK * kExpert) + kEmbeddings == 12'879'925'248);
  const CalcReport r = calc_preset("mixtral-8x7b");
  EXPECT_EQ(r.params, 46'702'792'704);
  ASSERT_TRUE(r.moe);
  EXPECT_EQ(r.moe->active_params, 12'879'925'248);
  EXPECT_EQ(r.moe->expert_params, kL * kE * kExpert);
  EXPECT_EQ(r.params_first_stage, r.params);  // one rank holds everything
  EXPECT_EQ(r.input.model.padded_vocab_size, kV);
  // Megatron's num_floating_point_operations with num_experts_routed_to = 2 (gated: x 1.5), B = 1.
  const double B = 1, s = 4096, l = kL, h = kH;
  const double megatron =
      12 * B * s * l * h * h * ((1 + 8.0 / 32 + s / h) + double(kF) / h * kK * 1.5 + double(kV) / (2 * l * h));
  const CalcReport one = calc_preset("mixtral-8x7b", {"--global-batch-size", "1", "--micro-batch-size", "1"});
  EXPECT_NEAR(one.flops_model, megatron, 1e-12 * megatron);
  EXPECT_NEAR(one.flops_full - one.flops_model, l * one.input.model.layer_forward_flops(1, 4096, 0), 1e-9 * megatron);
  const std::string report = format_calc_report(r);
  EXPECT_NE(report.find("46,702,792,704"), std::string::npos) << report;
  const size_t active = report.find("active parameters:");
  ASSERT_NE(active, std::string::npos) << report;
  EXPECT_EQ(report.find("12,879,925,248  (12.88B)"), report.find_first_not_of(' ', active + 18)) << report;
  EXPECT_NE(report.find("mixture of experts: 8 experts (E) of FFN 14336, top-2 (k), 32 of 32 layers; routing softmax"),
            std::string::npos)
      << report;
}

TEST(CalcMoe, OtherPresetsGiveThePublishedCounts) {
  const CalcReport x22 = calc_preset("mixtral-8x22b");
  EXPECT_EQ(x22.params, 140'620'634'112);  // "141B"
  EXPECT_EQ(x22.moe->active_params, 39'152'031'744);  // "39B active"
  const CalcReport qwen = calc_preset("qwen1.5-moe-a2.7b");
  EXPECT_EQ(qwen.params, 14'315'784'192);  // "14.3B"
  EXPECT_EQ(qwen.moe->active_params, 2'689'173'504);  // "2.7B activated"
  // OLMoE: the HF checkpoint's 6,919,161,856 less the q/k norms over the full projections (2 x 2048 per layer)
  // plus Loom's per-head ones (2 x 128): 16 x 3840 = 61,440 fewer.
  const CalcReport olmoe = calc_preset("olmoe-1b-7b");
  EXPECT_EQ(olmoe.params, 6'919'161'856 - 61'440);
  EXPECT_EQ(olmoe.moe->active_params, 6'919'100'416 - int64_t(16) * 56 * 3 * 2048 * 1024);  // 1,281,955,840
  const TrainConfig o = preset_config("olmoe-1b-7b");
  EXPECT_TRUE(o.model.moe.router.pre_softmax);
  EXPECT_DOUBLE_EQ(o.model.moe.router.z_loss_coeff, 1e-3);
  const TrainConfig q = preset_config("qwen1.5-moe-a2.7b");
  EXPECT_TRUE(q.model.moe.shared_expert_gate);
  EXPECT_TRUE(q.model.add_qkv_bias);
  EXPECT_FALSE(q.model.add_bias_linear);
  EXPECT_EQ(calc_preset("moe-tiny").moe->layers_first_stage, 2);
}

TEST(CalcMoe, TimeUsesTheActiveParameters) {
  CalcOptions o;
  o.num_gpus = 64;
  o.train_tokens = 1e12;
  o.mfu = 0.4;
  const CalcReport r = calc_preset("mixtral-8x7b", {"--expert-model-parallel-size", "8", "--bf16"}, o);
  const double X = 0.4 * 989e12 * 64;
  EXPECT_NEAR(r.seconds_6tp, 6.0 * 1e12 * 12'879'925'248.0 / X, 1e-9 * r.seconds_6tp);
  EXPECT_NEAR(r.seconds_8tp, 8.0 * 1e12 * 12'879'925'248.0 / X, 1e-9 * r.seconds_8tp);
}

TEST(CalcMoe, ExpertParallelMemorySplit) {
  // 64 GPUs, EP 8, TP 1, PP 1, BF16, distributed optimizer (ZeRO-1): each rank holds one expert per layer;
  // the dense part is whole. Dense states shard over d = DP x CP = 64, the experts' over d_e = 64 / 8 = 8.
  CalcOptions o;
  o.num_gpus = 64;
  const CalcReport r =
      calc_preset("mixtral-8x7b", {"--expert-model-parallel-size", "8", "--bf16", "--use-distributed-optimizer"}, o);
  ASSERT_TRUE(r.moe);
  const int64_t dense = kL * kDenseLayer + kEmbeddings, experts = kL * kExpert;  // one expert per layer
  EXPECT_EQ(dense, 1'605'636'096);
  EXPECT_EQ(r.moe->ep, 8);
  EXPECT_EQ(r.moe->etp, 1);
  EXPECT_EQ(r.moe->expert_dp, 8);
  EXPECT_EQ(r.zero_group, 64);
  EXPECT_EQ(r.moe->experts_first_stage, experts);
  EXPECT_EQ(r.params_first_stage, dense + experts);
  const auto shard = [](int64_t P, int64_t d) { return (P + d - 1) / d; };
  // 16-bit copy whole + FP32 master shard; FP32 grads whole; Adam m, v shards.
  EXPECT_EQ(r.weight_bytes, 2 * (dense + experts) + 4 * shard(dense, 64) + 4 * shard(experts, 8));
  EXPECT_EQ(r.grad_bytes, 4 * (dense + experts));
  EXPECT_EQ(r.optimizer_bytes, 8 * shard(dense, 64) + 8 * shard(experts, 8));
  EXPECT_FALSE(r.loom_plan);  // EP > 1: no single-process plan

  // TP 2 (sequence parallel), EP 4, ETP 1, PP 2 on 64 GPUs: attention, embeddings and the router follow TP;
  // each rank holds 2 whole experts of each of its 16 layers; d = 64 / (2 x 2) = 16, d_e = 64 / (1 x 4 x 2) = 8.
  o.sequence_parallel = true;
  const CalcReport t = calc_preset("mixtral-8x7b",
                                   {"--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
                                    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                    "--bf16", "--use-distributed-optimizer"},
                                   o);
  const int64_t layer_dense = kNorms + (kQkv + kProj) / 2 + kRouter, stage_experts = 16 * 2 * kExpert;
  EXPECT_EQ(t.moe->layer_experts_per_rank, 2 * kExpert);
  EXPECT_EQ(t.moe->experts_first_stage, stage_experts);
  EXPECT_EQ(t.params_first_stage, 16 * layer_dense + stage_experts + kV * kH / 2);
  EXPECT_EQ(t.params_last_stage, 16 * layer_dense + stage_experts + kV * kH / 2 + kH);
  EXPECT_EQ(t.zero_group, 16);
  EXPECT_EQ(t.moe->expert_dp, 8);
  const int64_t d1 = t.params_first_stage - stage_experts;
  EXPECT_EQ(t.optimizer_bytes, 8 * shard(d1, 16) + 8 * shard(stage_experts, 8));
  // Activations: n = s*b/TP = 2048 tokens routed per rank (SP), M = 2n rows; the rows move (EP 4).
  EXPECT_EQ(t.moe->tokens, 2048);
  EXPECT_EQ(t.moe->rows, 4096);
  EXPECT_TRUE(t.moe->rows_move);
  const double layer = 2.0 * 4096 * (2 * kH + 3 * kF) + 2.0 * 2 * 4096 * kH + 8.0 * 2048 * kE;
  EXPECT_DOUBLE_EQ(t.moe->layer_bytes, layer);
  EXPECT_DOUBLE_EQ(t.moe->dense_mlp_bytes, 16.0 * 4096 * kH / 2);
  const std::string report = format_calc_report(t);
  EXPECT_NE(report.find("expert data parallel:   d_e = n / (ETP x EP x PP) = 8"), std::string::npos) << report;
  EXPECT_NE(report.find("of which routed experts:"), std::string::npos) << report;
}

TEST(CalcMoe, SingleProcessBuffersAndDenseLayers) {
  // moe-tiny in one process: Loom's plan adds the MoE layers' per-call buffers; a dense layer among MoE
  // layers (--moe-layer-freq) counts a dense layer's FLOPs and parameters.
  const CalcReport r = calc_preset("moe-tiny", {"--micro-batch-size", "2", "--seq-length", "32"});
  ASSERT_TRUE(r.loom_plan);
  EXPECT_EQ(r.moe->loom_layers, 2);
  EXPECT_EQ(r.loom_plan->moe_bytes, 2 * std::llround(r.moe->layer_bytes));
  // n = 64 tokens, M = 128 rows, FP32: 4*M*(2h + 2F + F) + 8*n*E.
  EXPECT_DOUBLE_EQ(r.moe->layer_bytes, 4.0 * 128 * (2 * 64 + 3 * 96) + 8.0 * 64 * 4);
  const CalcReport mixed = calc_preset("moe-tiny", {"--moe-layer-freq", "[0,1]", "--ffn-hidden-size", "96"});
  const GPTConfig& m = mixed.input.model;
  EXPECT_EQ(mixed.moe->layers_first_stage, 1);
  const double f0 = m.layer_forward_flops(mixed.input.global_batch_size, 128, 0),
               f1 = m.layer_forward_flops(mixed.input.global_batch_size, 128, 1);
  EXPECT_LT(f0, f1);  // the dense layer's MLP is one 96-wide MLP, the MoE layer's two (top-2)
  EXPECT_NEAR(mixed.flops_full - mixed.flops_model, f0 + f1, 1e-12 * mixed.flops_model);
  EXPECT_EQ(mixed.params, m.num_parameters());
  EXPECT_EQ(mixed.params_first_stage, m.num_parameters());
}

TEST(CalcMoe, ExpertLayoutErrorsNameTheFlag) {
  const auto has = [](const std::string& msg, const std::string& needle) {
    EXPECT_NE(msg.find(needle), std::string::npos) << "message: '" << msg << "'";
  };
  CalcOptions o;
  o.num_gpus = 16;
  has(calc_error("mixtral-8x7b", {"--expert-model-parallel-size", "3"}, o), "--expert-model-parallel-size (3)");
  has(calc_error("mixtral-8x7b", {"--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "4"}, o),
      "--num-gpus (16) must be divisible by --expert-tensor-parallel-size");
  has(calc_error("qwen1.5-moe-a2.7b", {"--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
                                       "--expert-tensor-parallel-size", "2", "--moe-ffn-hidden-size", "1407"},
                 o),
      "--moe-ffn-hidden-size (1407)");
  has(calc_error("llama-tiny", {"--expert-model-parallel-size", "2"}, o), "needs --num-experts");
  has(calc_error("moe-tiny", {"--lora-rank", "4"}), "--lora-rank with --num-experts");
  // An ETP other than TP is a layout `loom train` runs too: no note about it.
  o.num_gpus = 64;
  const CalcReport r = calc_preset("mixtral-8x7b",
                                   {"--tensor-model-parallel-size", "4", "--sequence-parallel",
                                    "--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "4", "--bf16"},
                                   o);
  for (const std::string& n : r.input.notes) EXPECT_EQ(n.find("expert-tensor-parallel"), std::string::npos) << n;
  EXPECT_EQ(r.moe->layer_experts_per_rank, 2 * kExpert / 2);  // 2 experts, each's FFN over ETP 2
  // Without --sequence-parallel `loom train` refuses that layout; calc gives its figures with a note.
  const CalcReport no_sp = calc_preset("mixtral-8x7b",
                                       {"--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "2",
                                        "--expert-model-parallel-size", "4", "--bf16"},
                                       o);
  bool noted = false;
  for (const std::string& n : no_sp.input.notes) noted |= n.find("needs --sequence-parallel") != std::string::npos;
  EXPECT_TRUE(noted);
  EXPECT_EQ(no_sp.moe->layer_experts_per_rank, r.moe->layer_experts_per_rank);
}

namespace {

class TempDir : public test::ModelIoTempDir {  // tmpfs when there is one: checkpoint fsyncs cost nothing
 public:
  TempDir() : test::ModelIoTempDir("moe_train") {}
};

TrainResult train_moe_tiny(const Args& extra) {
  const TrainConfig c = preset_config(
      "moe-tiny", cat({"--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32",
                       "--lr", "3e-3", "--log-interval", "100", "--eval-iters", "0", "--moe-layer-freq", "[1,0,1]",
                       "--num-layers", "3", "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
                       "--moe-router-pre-softmax", "--add-qkv-bias"},
                  extra));
  std::ostringstream log;
  return run_training(c, log);
}

std::string train_error(const Args& extra) {
  try {
    train_moe_tiny(extra);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(MoeCheckpoint, RecordsTheArchitectureResumesAndGenerates) {
  const TrainResult full = train_moe_tiny({"--train-iters", "4"});
  ASSERT_EQ(full.losses.size(), 4u);
  TempDir dir;
  const TrainResult first = train_moe_tiny({"--train-iters", "4", "--exit-interval", "2", "--save", dir.str()});
  EXPECT_EQ(first.final_iteration, 2);
  std::ifstream meta_file(dir.str() + "/iter_0000002/metadata.json");
  ASSERT_TRUE(meta_file.good());
  const nlohmann::json mc = nlohmann::json::parse(meta_file).at("model_config");
  EXPECT_EQ(mc.at("num_experts"), 4);
  EXPECT_EQ(mc.at("moe_ffn_hidden_size"), 96);
  EXPECT_EQ(mc.at("moe_router_topk"), 2);
  EXPECT_EQ(mc.at("moe_shared_expert_intermediate_size"), 32);
  EXPECT_EQ(mc.at("moe_shared_expert_gate"), true);
  EXPECT_EQ(mc.at("moe_layer_pattern"), nlohmann::json::array({1, 0, 1}));
  EXPECT_EQ(mc.at("moe_router_score_function"), "softmax");
  EXPECT_EQ(mc.at("moe_router_pre_softmax"), true);
  EXPECT_EQ(mc.at("moe_router_enable_expert_bias"), false);

  const TrainResult resumed = train_moe_tiny({"--train-iters", "4", "--load", dir.str()});
  ASSERT_EQ(resumed.losses.size(), 2u);
  EXPECT_EQ(resumed.losses[0], full.losses[2]);
  EXPECT_EQ(resumed.losses[1], full.losses[3]);
  // A different MoE architecture is refused naming the flag; fine-tuning may change the routing, not shapes.
  const Args resume = {"--train-iters", "4", "--load", dir.str()};
  EXPECT_NE(train_error(cat(resume, {"--moe-router-topk", "3"})).find("--moe-router-topk"), std::string::npos);
  EXPECT_NE(train_error(cat(resume, {"--moe-layer-freq", "[1,1,1]"})).find("--moe-layer-freq"), std::string::npos);
  EXPECT_NE(train_error({"--train-iters", "4", "--load", dir.str(), "--finetune", "--num-experts", "8"})
                .find("--num-experts"),
            std::string::npos);
  EXPECT_EQ(train_error({"--train-iters", "1", "--load", dir.str(), "--finetune", "--moe-router-topk", "3"}), "");

  // `loom generate --load` rebuilds the MoE model from model_config; the KV cache agrees with full forwards.
  const auto ctx = make_cpu_context();
  const std::unique_ptr<GPTModel> model = load_model_for_inference(dir.str(), *ctx, DType::kF32);
  const GPTConfig& cfg = model->config();
  EXPECT_EQ(cfg.moe.layer_pattern, (std::vector<int>{1, 0, 1}));
  EXPECT_TRUE(cfg.moe.router.pre_softmax);
  EXPECT_TRUE(cfg.moe.shared_expert_gate);
  GenerateOptions o;
  o.max_new_tokens = 12;
  o.sampling.temperature = 0.0f;
  const std::vector<std::vector<int32_t>> prompts = {{3, 17, 8, 40, 2}, {11, 5}};
  const GenerateResult cached = generate(*model, *ctx, prompts, o);
  o.use_kv_cache = false;
  EXPECT_EQ(generate(*model, *ctx, prompts, o).tokens, cached.tokens);
  EXPECT_EQ(cached.generated_tokens, 24);
}
