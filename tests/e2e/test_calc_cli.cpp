// `loom calc` end to end: the built binary takes `loom train`'s flags (data flags and --train-iters
// included, none required) plus calc's own, prints the report with exit 0, and answers bad flags with
// exit 2 and one error line. With LoRA flags its model-state bytes are the ones `loom train` logs; a MoE preset
// gives its total and active parameters and the expert-parallel split.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "e2e_util.h"

using namespace loom::e2e;

namespace {

CliResult calc(const std::string& args) { return run_loom("calc " + args); }

// The rest of the line that starts with `label` (after leading spaces), or "" when there is none.
std::string line(const std::string& text, const std::string& label) {
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) {
    const size_t start = l.find_first_not_of(' ');
    if (start != std::string::npos && l.compare(start, label.size(), label) == 0) return l.substr(start + label.size());
  }
  return "";
}

// Exit 2 and one stderr line "loom calc: error: <needle>...".
void expect_calc_error(const CliResult& r, const std::string& needle) {
  expect_one_line_error(r, "loom calc: error: " + needle);
}

const std::string kGpt2 =
    "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024 "
    "--micro-batch-size 4 --global-batch-size 32 --bf16 ";

}  // namespace

TEST(CalcCli, Gpt2Report) {
  const CliResult r = calc(kGpt2 + "--num-gpus 8 --train-tokens 10B --gpu H100 --mfu 0.4");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;
  EXPECT_NE(line(r.out, "parameters (exact):").find("124,475,904  (124.48M)"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "parameters (formula):").find("124,474,368"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "model (no recomputation):").find("2.8005e+13 FLOP"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "model (no recomputation):").find("<- this run"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "weights:").find("746,855,424 B"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "none      ").find("358,612,992 B"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "achieved per GPU:").find("395.6 TFLOP/s"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "6*T*P/(n*X) (no recomputation):").find("2,360 s"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "note:").find("GPT-2's vocabulary of 50257 assumed"), std::string::npos) << r.out;
}

TEST(CalcCli, MegatronLaunchScriptFlagsWork) {
  // A pretrain_gpt.py command line: data, tokenizer, optimizer, checkpoint and logging flags are accepted and
  // nothing is read or written (the data prefix does not exist). The tokenizer gives the vocabulary.
  const CliResult r = calc(
      "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --sequence-parallel "
      "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
      "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1536 --train-iters 95367 "
      "--lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 "
      "--clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 "
      "--data-path /nonexistent/my-gpt3_00_text_document --split 949,50,1 "
      "--tokenizer-type NullTokenizer --vocab-size 51199 --save /nonexistent/ckpt --save-interval 1000 "
      "--log-interval 100 --eval-interval 1000 --eval-iters 10 --bf16 "
      "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
      "--num-gpus 1024 --gpu A100 --gpu-tflops 140");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(line(r.out, "vocabulary:").find("51200, padded to 51200"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "parameters (formula):").find("174,615,822,336"), std::string::npos) << r.out;
  // 95,367 iterations x 1536 x 2048 tokens ~ 300B; 8*T*P/(n*X) ~ 34 days as in Narayanan et al. (2021).
  EXPECT_NE(line(r.out, "8*T*P/(n*X) (full recomputation):").find("33.83 days"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "8*T*P/(n*X) (full recomputation):").find("<- this run"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "full      ").find("2*s*b*h/t   <- this run"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "layout:").find("1024 GPUs = TP 8 x PP 16 x CP 1 x DP 8; sequence parallel on"),
            std::string::npos)
      << r.out;
}

TEST(CalcCli, ZeroMemoryPerRank) {
  // GPT-2 124M, BF16, P = 124,475,904 on each rank, 8 GPUs. ZeRO-1 over d = 8: a shard is 15,559,488
  // params; weights 2*P + 4*shard, gradients 4*P, Adam 8*shard = (6 + 12/8) * P in all.
  const CliResult z1 = calc(kGpt2 + "--num-gpus 8 --use-distributed-optimizer");
  ASSERT_EQ(z1.code, 0) << z1.err;
  EXPECT_NE(line(z1.out, "data-parallel sharding:").find("optim (ZeRO-1) over d = 8 ranks (DP 8 x CP 1)"),
            std::string::npos)
      << z1.out;
  EXPECT_NE(line(z1.out, "weights:").find("311,189,760 B"), std::string::npos) << z1.out;
  EXPECT_NE(line(z1.out, "weights:").find("2 + 4/d B/param (ZeRO-1, d = 8)"), std::string::npos) << z1.out;
  EXPECT_NE(line(z1.out, "gradients:").find("497,903,616 B"), std::string::npos) << z1.out;
  EXPECT_NE(line(z1.out, "optimizer state:").find("124,475,904 B"), std::string::npos) << z1.out;
  EXPECT_NE(line(z1.out, "model states:").find("933,569,280 B"), std::string::npos) << z1.out;
  EXPECT_NE(line(z1.out, "model states:").find("6 + 12/d B/param (ZeRO-1, d = 8)"), std::string::npos) << z1.out;

  // ZeRO-3 over DP 4 x CP 2 = 8 (untied, as `loom train` needs: P = 124,475,904 + 50,304 * 768 output
  // layer = 163,109,376, a shard 20,388,672): 18 B per parameter of the shard.
  const CliResult z3 = calc(kGpt2 + "--num-gpus 8 --context-parallel-size 2 --untie-embeddings-and-output-weights "
                                    "--data-parallel-sharding-strategy optim_grads_params");
  ASSERT_EQ(z3.code, 0) << z3.err;
  EXPECT_NE(line(z3.out, "data-parallel sharding:").find("optim_grads_params (ZeRO-3) over d = 8 ranks (DP 4 x CP 2)"),
            std::string::npos)
      << z3.out;
  EXPECT_NE(line(z3.out, "parameters on the rank:").find("163,109,376"), std::string::npos) << z3.out;
  EXPECT_NE(line(z3.out, "weights:").find("122,332,032 B"), std::string::npos) << z3.out;  // 6 * shard
  EXPECT_NE(line(z3.out, "model states:").find("366,996,096 B"), std::string::npos) << z3.out;
  EXPECT_NE(line(z3.out, "model states:").find("18/d B/param (ZeRO-3, d = 8)"), std::string::npos) << z3.out;
  // Two layers of 7,087,872 params gathered: BF16 params + FP32 grads, 6 B each.
  EXPECT_NE(line(z3.out, "gathered layers:").find("85,054,464 B"), std::string::npos) << z3.out;

  // DP x CP = 1: the same figures as no sharding, and a note says so.
  const CliResult one = calc(kGpt2 + "--data-parallel-sharding-strategy optim_grads");
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_NE(one.out.find("note: ZeRO shards over 1 rank: no saving"), std::string::npos) << one.out;
  EXPECT_NE(line(one.out, "model states:").find("2,240,566,272 B"), std::string::npos) << one.out;  // 18 * P
}

// --fp8-format: the throughput uses the GPU's dense FP8 peak (H100: 1979 TFLOP/s, so MFU 0.4 gives
// 791.6), an A100 (no FP8) is refused naming --gpu, and FP8 sub-flags are validated as by `loom train`.
TEST(CalcCli, Fp8UsesTheFp8Peak) {
  const CliResult r = calc(kGpt2 + "--num-gpus 8 --gpu H100 --mfu 0.4 --fp8-format hybrid");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(line(r.out, "achieved per GPU:").find("791.6 TFLOP/s (X) = MFU 0.40 x H100 SXM dense FP8 peak 1979"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("with FP8 GEMMs (hybrid)"), std::string::npos) << r.out;
  expect_calc_error(calc(kGpt2 + "--gpu A100 --fp8-format e4m3"),
                    "--fp8-format: the A100 SXM (--gpu A100) has no FP8 tensor cores; choose --gpu H100");
  expect_calc_error(calc(kGpt2 + "--fp8-margin 2"), "--fp8-margin has no effect without --fp8-format");
}

// LoRA (issue 17): calc prints the trainable adapter count and the frozen base's weight bytes, and its
// model states are the bytes `loom train` logs for the same flags (a tiny Llama, one iteration of mock
// data; the base is random, which changes no size). Base: 2 layers of 64*32 + 32*32 + 96*32 + 32*48 + 2*32
// = 7,744, embedding and output layer 128*32 each, final norm 32: 23,712. Adapters (rank 4) per layer:
// q_proj 4*(32 + 32), v_proj 4*(32 + 16), linear_proj 4*(32 + 32), linear_fc1 4*(32 + 96), down_proj
// 4*(48 + 32) = 1,536; 3,072 in all.
TEST(CalcCli, LoraModelStatesAreTheTrainers) {
  const std::string flags =
      "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
      "--normalization RMSNorm --swiglu --ffn-hidden-size 48 --position-embedding-type rope --disable-bias-linear "
      "--untie-embeddings-and-output-weights --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 "
      "--global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data --vocab-size 100 --log-interval 1 --eval-iters 0 "
      "--lora-rank 4 --lora-alpha 8 --lora-dropout 0.1 --lora-target-modules q_proj v_proj linear_proj linear_fc1 "
      "down_proj";
  struct Case {
    std::string precision, frozen, states;
  };
  // BF16: the base's 2 B/param copy = 47,424 B, the adapters' 18 B/param = 55,296 B. FP32: 4 and 16 B/param.
  for (const Case& c : {Case{" --bf16", "47,424 B", "102,720 B"}, Case{"", "94,848 B", "144,000 B"}}) {
    const CliResult r = calc(flags + c.precision);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_NE(line(r.out, "LoRA adapters (exact):").find("3,072"), std::string::npos) << r.out;
    EXPECT_NE(line(r.out, "LoRA adapters on it:").find("3,072"), std::string::npos) << r.out;
    EXPECT_NE(line(r.out, "parameters on the rank:").find("23,712"), std::string::npos) << r.out;
    EXPECT_NE(line(r.out, "frozen base weights:").find(c.frozen), std::string::npos) << r.out;
    EXPECT_NE(line(r.out, "model states:").find(c.states), std::string::npos) << r.out;
    EXPECT_NE(line(r.out, "convention:").find("hardware FLOPs of a LoRA step"), std::string::npos) << r.out;

    std::string log;
    std::istringstream words(flags + c.precision);
    Args args;
    for (std::string w; words >> w;) args.push_back(w);
    ASSERT_EQ(train(args, &log).final_iteration, 1);
    const size_t at = log.find("(model states ");
    ASSERT_NE(at, std::string::npos) << log;
    const int64_t states = std::stoll(log.substr(at + 14));
    std::string with_commas = std::to_string(states);
    for (int i = int(with_commas.size()) - 3; i > 0; i -= 3) with_commas.insert(with_commas.begin() + i, ',');
    EXPECT_NE(line(r.out, "model states:").find(" " + with_commas + " B"), std::string::npos)
        << "trainer: " << states << "\n" << r.out;
    EXPECT_NE(log.find("3072 trainable adapter parameters on this rank"), std::string::npos) << log;
    EXPECT_NE(log.find("frozen base weights "), std::string::npos) << log;
  }
}

TEST(CalcCli, MixtureOfExpertsPreset) {
  // configs/mixtral-8x7b.yaml on 64 GPUs with EP 8: exact total and active parameters, one expert per layer
  // on each rank, the routed experts' ZeRO shards over d_e = 64 / 8.
  const CliResult r = calc("--config " + std::string(LOOM_SOURCE_DIR) +
                           "/configs/mixtral-8x7b.yaml --bf16 --num-gpus 64 --expert-model-parallel-size 8 "
                           "--use-distributed-optimizer --train-tokens 1T");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(line(r.out, "parameters (exact):").find("46,702,792,704  (46.70B)"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "active parameters:").find("12,879,925,248  (12.88B)"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "parameters on the rank:").find("7,242,780,672"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "of which routed experts:").find("5,637,144,576"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "expert data parallel:").find("= 8 ranks"), std::string::npos) << r.out;
  EXPECT_NE(line(r.out, "model states:").find("(ZeRO-1, d = 64; routed experts d_e = 8)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(P = the 12,879,925,248 active parameters"), std::string::npos) << r.out;
  expect_calc_error(calc("--config " + std::string(LOOM_SOURCE_DIR) +
                         "/configs/mixtral-8x7b.yaml --num-gpus 12 --expert-model-parallel-size 3"),
                    "--num-experts (8) must be divisible by --expert-model-parallel-size (3)");
}

TEST(CalcCli, Help) {
  const CliResult r = calc("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("--train-tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--gpu-tflops"), std::string::npos) << r.out;
}

TEST(CalcCli, BadFlags) {
  expect_calc_error(calc(""), "missing required flag --num-layers");
  expect_calc_error(calc(kGpt2 + "--num-gpuz 8"), "unknown flag --num-gpuz (did you mean --num-gpus?)");
  expect_calc_error(calc(kGpt2 + "--micro-bach-size 2"),
                    "unknown flag --micro-bach-size (did you mean --micro-batch-size?)");
  expect_calc_error(calc(kGpt2 + "--num-gpu 8"), "ambiguous or abbreviated flag --num-gpu");
  expect_calc_error(calc(kGpt2 + "--train-tokens 12X"), "--train-tokens: expected a token count");
  expect_calc_error(calc(kGpt2 + "--train-tokens"), "--train-tokens needs a value");
  expect_calc_error(calc(kGpt2 + "--gpu V100"), "--gpu: unknown GPU 'V100'");
  expect_calc_error(calc(kGpt2 + "--num-gpus 6"), "--global-batch-size (32) must be a positive multiple");
  expect_calc_error(calc(kGpt2 + "--apply-layernorm-1p"), "--apply-layernorm-1p (a flag of");
  expect_calc_error(calc(kGpt2 + "--num-gpus 8 --use-distributed-optimizer --data-parallel-sharding-strategy no_shard"),
                    "--use-distributed-optimizer contradicts --data-parallel-sharding-strategy no_shard");
  expect_calc_error(calc(kGpt2 + "--num-gpus 8 --data-parallel-sharding-strategy zero3"),
                    "--data-parallel-sharding-strategy must be no_shard, optim, optim_grads or optim_grads_params, "
                    "got 'zero3'");
  expect_calc_error(calc(kGpt2 + "--tokenizer-type GPT2BPETokenizer --vocab-file /nonexistent/encoder.json "
                                 "--merge-file /nonexistent/vocab.bpe"),
                    "--vocab-file '/nonexistent/encoder.json': cannot open");
}
