// `loom train` with Megatron's Llama flags: parsing and validation (errors name the flag), the presets in
// configs/ giving the published parameter counts through `loom calc`'s arithmetic, and a tiny Llama
// (configs/llama-tiny.yaml) training on mock data, with recomputation bit-identical, a save and a bit-exact
// resume, the architecture recorded in the checkpoint and checked on load.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "loom/train/args.h"
#include "loom/train/calc.h"
#include "loom/train/config_file.h"
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

const Args kShape = {"--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                     "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
                     "--vocab-size", "100"};

std::string parse_error(const Args& extra) {
  try {
    parse_train_args(cat(kShape, extra)).validate(1);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

std::string preset(const std::string& name) { return std::string(LOOM_SOURCE_DIR) + "/configs/" + name + ".yaml"; }

// A preset through `loom calc`'s resolution (vocabulary padded as `loom train` pads it).
CalcReport calc_preset(const std::string& name, const Args& extra = {}) {
  const TrainConfig c = parse_with_config_file(cat({"--config", preset(name)}, extra), parse_train_args);
  return compute_calc(make_calc_input(c, CalcOptions{}));
}

}  // namespace

TEST(LlamaArgs, FlagsSetTheModelConfig) {
  const TrainConfig c = parse_train_args(cat(
      kShape, {"--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--ffn-hidden-size", "176",
               "--kv-channels", "24", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
               "--add-qkv-bias", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
               "--rotary-base", "500000", "--rotary-percent", "0.5", "--rotary-interleaved", "--use-rope-scaling",
               "--rope-scaling-factor", "16", "--window-size", "(7, 0)", "--qk-layernorm"}));
  const GPTConfig& m = c.model;
  EXPECT_EQ(m.normalization, NormKind::kRMSNorm);
  EXPECT_FLOAT_EQ(m.layernorm_epsilon, 1e-6f);
  EXPECT_EQ(m.activation, MlpActivation::kSwiGLU);
  EXPECT_EQ(m.ffn_hidden_size(), 176);
  EXPECT_EQ(m.head_dim(), 24);
  EXPECT_EQ(m.num_kv_heads(), 2);
  EXPECT_FALSE(m.add_bias_linear);
  EXPECT_TRUE(m.qkv_bias());
  EXPECT_TRUE(m.untie_embeddings_and_output_weights);
  EXPECT_EQ(m.position_embedding_type, PositionEmbeddingType::kRope);
  EXPECT_EQ(m.rotary_base, 500000.0);
  EXPECT_EQ(m.rotary_dim(), 12);
  EXPECT_TRUE(m.rotary_interleaved);
  EXPECT_TRUE(m.use_rope_scaling);
  EXPECT_FLOAT_EQ(m.rope_scaling_factor, 16.0f);
  EXPECT_EQ(m.window_size_left, 7);
  EXPECT_EQ(m.attention_params().window, 8);
  EXPECT_TRUE(m.qk_layernorm);
  EXPECT_NO_THROW(c.validate(1));
  // Without --group-query-attention every head has its own keys and values (Megatron's default).
  EXPECT_EQ(parse_train_args(kShape).model.num_kv_heads(), 4);
  EXPECT_EQ(parse_train_args(cat(kShape, {"--use-rotary-position-embeddings"})).model.position_embedding_type,
            PositionEmbeddingType::kRope);
  EXPECT_EQ(parse_train_args(cat(kShape, {"--window-size", "-1,0"})).model.attention_params().window, -1);
}

TEST(LlamaArgs, ErrorsNameTheFlag) {
  EXPECT_NE(parse_error({"--normalization", "BatchNorm"}).find("--normalization"), std::string::npos);
  EXPECT_NE(parse_error({"--position-embedding-type", "mrope"}).find("--position-embedding-type"), std::string::npos);
  EXPECT_NE(parse_error({"--window-size", "4096,4"}).find("--window-size"), std::string::npos);
  EXPECT_NE(parse_error({"--window-size", "4096"}).find("--window-size"), std::string::npos);
  EXPECT_NE(parse_error({"--num-query-groups", "2"}).find("--group-query-attention"), std::string::npos);
  EXPECT_NE(parse_error({"--group-query-attention", "--num-query-groups", "3"}).find("--num-query-groups"),
            std::string::npos);
  EXPECT_NE(parse_error({"--position-embedding-type", "rope", "--rotary-percent", "0.01"}).find("--rotary-percent"),
            std::string::npos);
  EXPECT_NE(parse_error({"--use-rope-scaling"}).find("--use-rope-scaling"), std::string::npos);
  // Megatron architecture flags Loom does not build are errors, not silently ignored.
  EXPECT_NE(parse_error({"--squared-relu"}).find("--squared-relu"), std::string::npos);
  EXPECT_NE(parse_error({"--apply-layernorm-1p"}).find("--apply-layernorm-1p"), std::string::npos);
  // --kv-channels lifts the hidden-size / heads divisibility rule, as in Megatron.
  EXPECT_NE(parse_error({"--hidden-size", "66"}).find("--num-attention-heads"), std::string::npos);
  EXPECT_EQ(parse_error({"--hidden-size", "66", "--kv-channels", "16"}), "");
}

TEST(LlamaPresets, PublishedParameterCountsAndFlops) {
  const CalcReport l2 = calc_preset("llama2-7b");
  EXPECT_EQ(l2.params, 6738415616);
  const CalcReport l3 = calc_preset("llama3-8b");
  EXPECT_EQ(l3.params, 8030261248);
  EXPECT_EQ(l3.params_first_stage, l3.params);  // one rank holds everything
  // Megatron's num_floating_point_operations for Llama 3 8B (GQA 8 of 32 heads, SwiGLU 14336).
  const double B = 1, s = 8192, l = 32, h = 4096;
  const double megatron = 12 * B * s * l * h * h * ((1 + 8.0 / 32 + s / h) + 14336 / h * 1.5 + 128256 / (2 * l * h));
  EXPECT_NEAR(l3.flops_model, megatron, 1e-12 * megatron);
  EXPECT_NEAR(l3.flops_full - l3.flops_model, l * l3.input.model.layer_forward_flops(1, 8192), 1e-9 * megatron);
  // TP 8: the weight matrices and both vocabulary tables split (the vocabulary padded to a multiple of
  // 128 x 8 = 1024: 129024), the RMSNorm weights replicate.
  const CalcReport tp = calc_preset("llama3-8b", {"--tensor-model-parallel-size", "8"});
  const int64_t layer_split = 4096LL * 6144 + 4096LL * 4096 + 3LL * 4096 * 14336;
  EXPECT_EQ(tp.params_first_stage, 32 * (layer_split / 8 + 2 * 4096) + 2 * (129024LL * 4096 / 8) + 4096);
  // Mistral's window-size 4096,0 and Llama 3.1's RoPE scaling come through the presets.
  const TrainConfig mistral = parse_with_config_file({"--config", preset("mistral-7b")}, parse_train_args);
  EXPECT_EQ(mistral.model.window_size_left, 4096);
  const TrainConfig l31 = parse_with_config_file({"--config", preset("llama3.1-405b")}, parse_train_args);
  EXPECT_TRUE(l31.model.use_rope_scaling);
  EXPECT_FLOAT_EQ(l31.model.rope_scaling_factor, 8.0f);
  const std::string report = format_calc_report(l3);
  EXPECT_NE(report.find("8,030,261,248"), std::string::npos);
  EXPECT_NE(report.find("architecture: RMSNorm, swiglu MLP 14336 wide, 8 key/value heads"), std::string::npos);
}

namespace {

class TempDir : public test::ModelIoTempDir {  // tmpfs when there is one: checkpoint fsyncs cost nothing
 public:
  TempDir() : test::ModelIoTempDir("llama_train") {}
};

TrainResult train_tiny(const Args& extra) {
  const TrainConfig c = parse_with_config_file(
      cat({"--config", preset("llama-tiny"), "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--seq-length", "32", "--lr", "3e-3", "--log-interval", "100", "--eval-iters", "0", "--hidden-dropout",
           "0.1", "--attention-dropout", "0.1", "--window-size", "20,0", "--qk-layernorm"},
          extra),
      parse_train_args);
  std::ostringstream log;
  return run_training(c, log);
}

std::string train_error(const Args& extra) {
  try {
    train_tiny(extra);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// The tiny Llama trains; selective and full recomputation give bit-identical losses; a run stopped at
// iteration 3 and resumed reproduces the uninterrupted run's losses bit for bit; the checkpoint records
// the architecture and refuses a run whose architecture differs, naming the flag.
TEST(LlamaTrain, TrainsRecomputesSavesAndResumesBitExact) {
  const TrainResult full = train_tiny({"--train-iters", "5"});
  ASSERT_EQ(full.losses.size(), 5u);
  for (double l : full.losses) EXPECT_TRUE(std::isfinite(l) && l > 5.0 && l < 7.5) << l;  // ~ln(512) = 6.24
  EXPECT_EQ(train_tiny({"--train-iters", "5", "--recompute-granularity", "selective"}).losses, full.losses);
  EXPECT_EQ(train_tiny({"--train-iters", "5", "--recompute-granularity", "full", "--recompute-method", "uniform",
                        "--recompute-num-layers", "1"})
                .losses,
            full.losses);

  TempDir dir;
  const TrainResult first = train_tiny({"--train-iters", "5", "--exit-interval", "3", "--save", dir.str()});
  EXPECT_EQ(first.final_iteration, 3);
  std::ifstream meta_file(dir.str() + "/iter_0000003/metadata.json");
  ASSERT_TRUE(meta_file.good());
  const nlohmann::json meta = nlohmann::json::parse(meta_file);
  const nlohmann::json& mc = meta.at("model_config");
  EXPECT_EQ(mc.at("normalization"), "RMSNorm");
  EXPECT_EQ(mc.at("activation"), "swiglu");
  EXPECT_EQ(mc.at("num_query_groups"), 2);
  EXPECT_EQ(mc.at("kv_channels"), 16);
  EXPECT_EQ(mc.at("ffn_hidden_size"), 176);
  EXPECT_EQ(mc.at("position_embedding_type"), "rope");
  EXPECT_EQ(mc.at("add_bias_linear"), false);
  EXPECT_EQ(mc.at("untie_embeddings_and_output_weights"), true);
  EXPECT_EQ(mc.at("qk_layernorm"), true);
  EXPECT_EQ(mc.at("window_size"), nlohmann::json::array({20, 0}));

  const TrainResult resumed = train_tiny({"--train-iters", "5", "--load", dir.str()});
  EXPECT_EQ(resumed.start_iteration, 3);
  ASSERT_EQ(resumed.losses.size(), 2u);
  EXPECT_EQ(resumed.losses[0], full.losses[3]);
  EXPECT_EQ(resumed.losses[1], full.losses[4]);

  // A different architecture is refused with the flag that sets it.
  EXPECT_NE(train_error({"--train-iters", "5", "--load", dir.str(), "--num-query-groups", "4"})
                .find("--num-query-groups"),
            std::string::npos);
  EXPECT_NE(train_error({"--train-iters", "5", "--load", dir.str(), "--rotary-base", "20000"}).find("--rotary-base"),
            std::string::npos);
  EXPECT_NE(train_error({"--train-iters", "5", "--load", dir.str(), "--normalization", "LayerNorm"})
                .find("--normalization"),
            std::string::npos);
  // Fine-tuning may change the RoPE base (context extension), not the shapes.
  EXPECT_EQ(train_error({"--train-iters", "1", "--load", dir.str(), "--finetune", "--rotary-base", "20000"}), "");
  EXPECT_NE(train_error({"--train-iters", "1", "--load", dir.str(), "--finetune", "--ffn-hidden-size", "192"})
                .find("--ffn-hidden-size"),
            std::string::npos);
}
