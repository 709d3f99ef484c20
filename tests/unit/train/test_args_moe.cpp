// The mixture-of-experts flags: Megatron's names and defaults, --moe-layer-freq's pattern language, and the
// clear errors for impossible settings and layouts (issue 18's bad-input list).
#include <gtest/gtest.h>

#include "loom/train/args.h"
#include "train/args_checks.h"

using namespace loom;

namespace {

std::vector<std::string> moe(std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                                "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "5", "--lr", "1e-3",
                                "--mock-data", "--vocab-size", "100", "--swiglu", "--disable-bias-linear",
                                "--num-experts", "8", "--moe-router-topk", "2"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

std::string error_of(const std::vector<std::string>& args, int world = 1) {
  try {
    parse_train_args(args).validate(world);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

void expect_error(const std::vector<std::string>& args, const std::string& part, int world = 1) {
  const std::string e = error_of(args, world);
  EXPECT_NE(e.find(part), std::string::npos) << "expected '" << part << "' in: " << e;
}

}  // namespace

TEST(ArgsMoe, ParsesMegatronFlags) {
  const TrainConfig c = parse_train_args(moe({"--moe-ffn-hidden-size", "96", "--moe-aux-loss-coeff", "1e-2",
                                              "--moe-z-loss-coeff", "1e-3", "--moe-router-load-balancing-type",
                                              "seq_aux_loss", "--moe-shared-expert-intermediate-size", "128",
                                              "--moe-shared-expert-gate", "--moe-expert-capacity-factor", "1.25",
                                              "--moe-token-drop-policy", "position", "--moe-token-dispatcher-type",
                                              "alltoall", "--moe-grouped-gemm", "--moe-layer-freq", "[0,1,1,1]"}));
  const MoeConfig& m = c.model.moe;
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.router.num_experts, 8);
  EXPECT_EQ(m.router.topk, 2);
  EXPECT_EQ(c.model.moe_ffn_hidden_size(), 96);
  EXPECT_DOUBLE_EQ(m.router.aux_loss_coeff, 1e-2);
  EXPECT_DOUBLE_EQ(m.router.z_loss_coeff, 1e-3);
  EXPECT_EQ(m.router.load_balancing, MoeLoadBalancing::kSeqAuxLoss);
  EXPECT_EQ(m.shared_expert_intermediate_size, 128);
  EXPECT_TRUE(m.shared_expert_gate);
  ASSERT_TRUE(m.router.capacity_factor.has_value());
  EXPECT_DOUBLE_EQ(*m.router.capacity_factor, 1.25);
  EXPECT_EQ(m.router.drop_policy, MoeDropPolicy::kPosition);
  EXPECT_EQ(c.moe.dispatcher, MoeDispatcher::kAllToAll);
  EXPECT_EQ(m.layer_pattern, (std::vector<int>{0, 1, 1, 1}));
  EXPECT_EQ(c.model.num_moe_layers(), 3);
  EXPECT_FALSE(c.model.is_moe_layer(0));
  EXPECT_TRUE(c.model.is_moe_layer(3));
  EXPECT_EQ(c.kernel_choice_flags, std::vector<std::string>{"--moe-grouped-gemm"});  // logged, changes nothing
  EXPECT_EQ(error_of(moe()), "");
  // Megatron's defaults: top-2, aux_loss with coefficient 0, softmax, allgather, every layer.
  const TrainConfig d = parse_train_args(moe());
  EXPECT_EQ(d.model.moe.router.load_balancing, MoeLoadBalancing::kAuxLoss);
  EXPECT_EQ(d.model.moe.router.aux_loss_coeff, 0.0);
  EXPECT_EQ(d.model.moe.router.score_function, MoeScoreFunction::kSoftmax);
  EXPECT_EQ(d.moe.dispatcher, MoeDispatcher::kAllGather);
  EXPECT_EQ(d.model.num_moe_layers(), 4);
  EXPECT_EQ(d.model.moe_ffn_hidden_size(), d.model.ffn_hidden_size());
}

TEST(ArgsMoe, LayerFreqPatterns) {
  EXPECT_EQ(parse_moe_layer_freq("2", 5), (std::vector<int>{1, 0, 1, 0, 1}));
  EXPECT_EQ(parse_moe_layer_freq("1", 3), (std::vector<int>{1, 1, 1}));
  EXPECT_EQ(parse_moe_layer_freq("[1, 0,1]", 3), (std::vector<int>{1, 0, 1}));
  EXPECT_EQ(parse_moe_layer_freq("([0]+[1]*3)*2", 8), (std::vector<int>{0, 1, 1, 1, 0, 1, 1, 1}));
  EXPECT_EQ(parse_moe_layer_freq("[0]*3+[1]*2", 5), (std::vector<int>{0, 0, 0, 1, 1}));
  auto err = [](const std::string& v, int64_t n) {
    try {
      parse_moe_layer_freq(v, n);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err("[1,0]", 3).find("describes 2 layers but --num-layers is 3"), std::string::npos);
  EXPECT_NE(err("[1,2]", 2).find("0 (dense) or 1 (MoE)"), std::string::npos);
  EXPECT_NE(err("[1,0", 2).find("expected ']'"), std::string::npos);
  EXPECT_NE(err("0", 2).find("must be >= 1"), std::string::npos);
  EXPECT_NE(err("[1]*x", 2).find("expected an integer"), std::string::npos);
  expect_error(moe({"--moe-layer-freq", "[0,0,0,0]"}), "marks no layer as a MoE layer");
  std::vector<std::string> dense = moe();
  dense.erase(dense.end() - 4, dense.end());  // no --num-experts / --moe-router-topk
  dense.insert(dense.end(), {"--moe-layer-freq", "2"});
  expect_error(dense, "--moe-layer-freq needs --num-experts");
}

TEST(ArgsMoe, BadSettingsAreClearErrors) {
  expect_error(moe({"--moe-router-topk", "9"}), "--moe-router-topk must be between 1 and --num-experts (8), got 9");
  expect_error(moe({"--moe-expert-capacity-factor", "0"}), "--moe-expert-capacity-factor must be > 0");
  expect_error(moe({"--moe-expert-capacity-factor", "-1"}), "--moe-expert-capacity-factor must be > 0");
  expect_error(moe({"--moe-pad-expert-input-to-capacity"}), "needs --moe-expert-capacity-factor");
  expect_error(moe({"--moe-router-enable-expert-bias"}), "needs --moe-router-score-function sigmoid");
  expect_error(moe({"--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "1e-2"}),
               "sinkhorn does not take an aux loss");
  EXPECT_EQ(error_of(moe({"--moe-router-load-balancing-type", "sinkhorn"})), "");
  expect_error(moe({"--moe-token-dispatcher-type", "flex"}), "valid: allgather, alltoall");
  expect_error(moe({"--moe-shared-expert-gate"}), "needs shared experts");
  expect_error(moe({"--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"}),
               "--moe-token-dispatcher-type alltoall");
  std::vector<std::string> biased = moe();
  biased.erase(std::find(biased.begin(), biased.end(), "--disable-bias-linear"));
  expect_error(biased, "add --disable-bias-linear");
  expect_error(moe({"--num-experts", "0"}), "--num-experts must be >= 1");
  expect_error(moe({"--fp8-format", "hybrid", "--bf16"}), "--fp8-format with --num-experts");
  expect_error(moe({"--lora-rank", "4"}), "--lora-rank with --num-experts");
  // Megatron MoE flags Loom does not build: named as such, not "unknown flag".
  const std::string e = error_of(moe({"--moe-router-dtype", "fp32"}));
  EXPECT_NE(e.find("--moe-router-dtype"), std::string::npos) << e;
  EXPECT_EQ(e.find("unknown flag"), std::string::npos) << e;
}

TEST(ArgsMoe, ImpossibleExpertLayoutsAreClearErrors) {
  expect_error(moe({"--expert-model-parallel-size", "3"}), "--num-experts (8) must be divisible by "
                                                          "--expert-model-parallel-size (3)", 3);
  // EP x ETP x PP must divide the world (the expert grid).
  expect_error(moe({"--expert-model-parallel-size", "4"}), "world size 2 is not divisible by --expert-tensor-parallel-size (1) x --expert-model-parallel-size (4)", 2);
  // Any ETP the expert grid divides: more or fewer ranks than TP, also without TP.
  EXPECT_EQ(error_of(moe({"--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size",
                          "4"}), 4), "");
  EXPECT_EQ(error_of(moe({"--expert-tensor-parallel-size", "2"}), 2), "");
  expect_error(moe({"--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2"}),
               "world size 2 is not divisible by --expert-tensor-parallel-size (2) x --expert-model-parallel-size (2)", 2);
  // Without SP the TP ranks share their tokens, which only an ETP group equal to the TP group may.
  expect_error(moe({"--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "4"}),
               "needs --sequence-parallel", 4);
  expect_error(moe({"--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"}),
               "needs --sequence-parallel", 4);
  EXPECT_EQ(error_of(moe({"--tensor-model-parallel-size", "2"}), 2), "");  // ETP = TP, EP 1: replicated tokens
  EXPECT_EQ(error_of(moe({"--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                          "2", "--expert-tensor-parallel-size", "1"}), 4), "");
  expect_error(moe({"--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-ffn-hidden-size", "33"}),
               "--moe-ffn-hidden-size (33) must be divisible by --expert-tensor-parallel-size (2)", 2);
  expect_error(moe({"--expert-model-parallel-size", "2", "--fp16"}), "does not support --fp16", 2);
}
