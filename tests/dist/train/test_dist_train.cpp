// `loom train` under mpirun against the single-process run: the equivalence matrix (fp32, same
// global batch: per-iteration losses within 1e-5 relative for 20 iterations), resharding a checkpoint
// across layouts, and a killed rank. Losses come from --metrics-jsonl (full precision).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <filesystem>
#include <thread>
#include <tuple>

#include "e2e/e2e_util.h"
#include "dist/train/dist_train_util.h"

namespace loom::e2e {
namespace {

const char* kGpt =
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --clip-grad 1.0 --weight-decay 0.1 --mock-data --vocab-size 97 --log-interval 1 "
    "--hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --seed 7";
const char* kLlama =
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--normalization RMSNorm --swiglu --ffn-hidden-size 64 --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --clip-grad 1.0 --weight-decay 0.1 --mock-data --vocab-size 97 --log-interval 1 "
    "--hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --seed 7";

struct Layout {
  int np;
  const char* flags;
};

const Layout kLayouts[] = {
    {2, ""},                                                            // DP2
    {2, "--use-distributed-optimizer"},                                 // DP2 + ZeRO-1
    {2, "--data-parallel-sharding-strategy optim_grads_params"},        // DP2 + ZeRO-3
    {2, "--data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"},  // DP2 + ZeRO-2, overlapped
    {2, "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"},  // ZeRO-1, both overlaps
    {2, "--data-parallel-sharding-strategy optim_grads_params --overlap-grad-reduce --overlap-param-gather"},
    {2, "--tensor-model-parallel-size 2"},                              // TP2
    {2, "--tensor-model-parallel-size 2 --sequence-parallel"},          // TP2 + SP
    {2, "--pipeline-model-parallel-size 2"},                            // PP2 1F1B
    {2, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"},  // interleaved, 2 chunks
    {2, "--context-parallel-size 2"},                                   // CP2
    {4, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"},  // TP2 x PP2
    {8, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer"},  // DP2xTP2xPP2
    // ZeRO-2/3 with the other modes: the tied embedding's copy on the last stage, TP shards, SP sums.
    {4, "--pipeline-model-parallel-size 2 --data-parallel-sharding-strategy optim_grads_params "
        "--overlap-grad-reduce --overlap-param-gather"},
    {4, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"},
    {4, "--tensor-model-parallel-size 2 --sequence-parallel --data-parallel-sharding-strategy optim_grads_params"},
};

void check_matrix(const char* model, const std::string& name) {
  const std::vector<double> ref = train_losses(model, "", 1, 20);
  ASSERT_EQ(ref.size(), 20u);
  for (const Layout& l : kLayouts) {
    std::string log;
    const std::vector<double> got = train_losses(model, l.flags, l.np, 20, &log);
    expect_close(ref, got, 1e-5, name + " np " + std::to_string(l.np) + " " + l.flags);
  }
}

TEST(DistTrain, GptLayoutsMatchSingleProcess) { check_matrix(kGpt, "GPT"); }

// LoRA (issue 17): the frozen random base with adapters on whole layers and on the fused layers' PEFT
// slices, under every kind of layout (the adapters' TP placement, their units under PP and ZeRO-3, CP).
TEST(DistTrain, LoraLayoutsMatchSingleProcess) {
  const std::string lora = std::string(kLlama) + " --lr 3e-2 --lora-rank 4 --lora-alpha 8 ";
  const char* const targets[] = {"--lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj linear_fc2",
                                 "--lora-target-modules linear_qkv linear_proj linear_fc1 down_proj"};
  const Layout layouts[] = {
      {2, ""},
      {2, "--data-parallel-sharding-strategy optim_grads_params --overlap-grad-reduce --overlap-param-gather"},
      {2, "--tensor-model-parallel-size 2 --sequence-parallel"},
      {2, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"},
      {2, "--context-parallel-size 2"},
      {8, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer"},
  };
  for (const char* t : targets) {
    const std::string model = lora + t;
    const std::vector<double> ref = train_losses(model.c_str(), "", 1, 8);
    ASSERT_EQ(ref.size(), 8u);
    EXPECT_NE(ref.front(), ref.back()) << "the adapters did not train";
    for (const Layout& l : layouts)
      expect_close(ref, train_losses(model.c_str(), l.flags, l.np, 8), 1e-5,
                   std::string(t) + " np " + std::to_string(l.np) + " " + l.flags);
  }
}
TEST(DistTrain, LlamaGqaLayoutsMatchSingleProcess) { check_matrix(kLlama, "Llama"); }

// BF16 under DP2: ZeRO-1 gives the same bits as no sharding (its master shard is cast to bf16 before the
// all-gather, the same rounding as casting gathered f32 masters; two-rank sums do not depend on order),
// ZeRO-2/3 reduce every micro-batch (another summation order) and stay close. The model-state bytes each
// rank reports follow the per-parameter formulas (distributed_optimizer.h, `loom calc`).
TEST(DistTrain, Bf16ZeroStagesAgreeAndReportTheirMemory) {
  const std::string bf16 = " --bf16 --micro-batch-size 1";
  std::string log;
  const std::vector<double> ref = train_losses(kGpt, bf16, 2, 8, &log);
  ASSERT_EQ(ref.size(), 8u);
  const auto number_after = [](const std::string& text, const std::string& key) {
    const size_t k = text.find(key);
    EXPECT_NE(k, std::string::npos) << key << " not in\n" << text;
    return k == std::string::npos ? int64_t(-1) : int64_t(std::stoll(text.substr(k + key.size())));
  };
  const int64_t P = number_after(log, "model parallel rank (0, 0): ");
  const int64_t s = (P + 1) / 2;  // one bucket (the default size), padded to a multiple of DP = 2
  EXPECT_EQ(number_after(log, "(model states "), 18 * P) << log;
  struct Stage {
    const char* flags;
    int64_t states;   // bytes
    int64_t slack;    // ZeRO-3 pads every unit (6 units) instead of one bucket
    double rel;
  };
  const Stage stages[] = {
      {"--use-distributed-optimizer", 6 * P + 12 * s, 0, 0.0},
      {"--data-parallel-sharding-strategy optim_grads", 2 * P + 16 * s, 0, 2e-3},
      {"--data-parallel-sharding-strategy optim_grads_params", 18 * s, 18 * 6, 2e-3},
  };
  for (const Stage& st : stages) {
    std::string l;
    const std::vector<double> got = train_losses(kGpt, bf16 + " " + st.flags, 2, 8, &l);
    if (st.rel == 0.0)
      EXPECT_EQ(got, ref) << st.flags;
    else
      expect_close(ref, got, st.rel, st.flags);
    const int64_t states = number_after(l, "(model states ");
    EXPECT_GE(states, st.states) << st.flags;
    EXPECT_LE(states, st.states + st.slack) << st.flags;
  }
}

// A BF16 ZeRO-1/2 run has no full FP32 weights anywhere: its checkpoint holds the master shards, and it
// moves between strategies. ZeRO-1 -> no sharding is bit-exact (the two give the same bits, above);
// no sharding -> ZeRO-2 continues within the ZeRO-2 tolerance.
TEST(DistTrain, Bf16CheckpointsMoveBetweenZeroStages) {
  const std::string bf16 = " --bf16 --micro-batch-size 1";
  const std::vector<double> ref = train_losses(kGpt, bf16, 2, 8);
  ASSERT_EQ(ref.size(), 8u);
  for (const auto& [save_flags, load_flags, rel] :
       {std::tuple<std::string, std::string, double>{"--use-distributed-optimizer", "", 0.0},
        {"", "--data-parallel-sharding-strategy optim_grads", 2e-3}}) {
    TempDir ck("ckpt");
    const std::string dir = (ck / "c");
    const std::vector<double> first =
        train_losses(kGpt, bf16 + " " + save_flags + " --save " + dir + " --save-interval 4 --exit-interval 4", 2, 8);
    ASSERT_EQ(first.size(), 4u);
    const std::vector<double> rest = train_losses(kGpt, bf16 + " " + load_flags + " --load " + dir, 2, 8);
    const std::vector<double> want(ref.begin() + 4, ref.end());
    if (rel == 0.0)
      EXPECT_EQ(rest, want) << save_flags << " -> " << load_flags;
    else
      expect_close(want, rest, rel, save_flags + " -> " + load_flags);
  }
}

// FP8 (emulated) under TP, SP, DP and PP: the amaxes are reduced over TP and DP x CP, so every layout
// quantises with the single process's scales (BF16 summation order differs: 2e-3). The FP8 scaling state
// travels in sharded checkpoints: a TP2 run stopped and resumed is bit-identical.
TEST(DistTrain, Fp8LayoutsMatchSingleProcessAndResume) {
  const std::string fp8 = " --bf16 --fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max";
  const std::vector<double> ref = train_losses(kGpt, fp8, 1, 8);
  ASSERT_EQ(ref.size(), 8u);
  for (const auto& [np, flags] : {std::pair<int, std::string>{2, "--tensor-model-parallel-size 2 --sequence-parallel"},
                                  {2, ""},
                                  {2, "--pipeline-model-parallel-size 2"}}) {
    const std::vector<double> got = train_losses(kGpt, fp8 + " " + flags, np, 8);
    expect_close(ref, got, 2e-3, "FP8 np " + std::to_string(np) + " " + flags);
  }
  const std::string tp = fp8 + " --tensor-model-parallel-size 2";
  const std::vector<double> straight = train_losses(kGpt, tp, 2, 8);
  TempDir ck("fp8ckpt");
  const std::vector<double> first =
      train_losses(kGpt, tp + " --save " + (ck / "c") + " --save-interval 4 --exit-interval 4", 2, 8);
  ASSERT_EQ(first.size(), 4u);
  const std::vector<double> rest = train_losses(kGpt, tp + " --load " + (ck / "c"), 2, 8);
  EXPECT_EQ(rest, std::vector<double>(straight.begin() + 4, straight.end()));
}

TEST(DistTrain, PrintsTheLayoutOnce) {
  std::string log;
  train_losses(kGpt, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --timing-log-level 2", 8, 4,
               &log);
  EXPECT_EQ(count_of(log, "using world size: 8, data-parallel size: 2, context-parallel size: 1, "
                          "tensor-model-parallel size: 2, pipeline-model-parallel size: 2"), 1)
      << log;
  EXPECT_EQ(count_of(log, " iteration        1/"), 1) << log;
  // Timers are reduced over all ranks: the printing (last) stage never receives gradients, the first one
  // does, so "backward-recv" appears only through the reduction; min <= max on every line.
  EXPECT_EQ(count_of(log, "    backward-recv "), 4) << log;
  EXPECT_EQ(count_of(log, "    grads-all-reduce "), 4) << log;
  for (const std::string& l : lines_of(log)) {
    double lo = 0, hi = 0;
    const size_t k = l.find(": (");
    if (l.rfind("    ", 0) != 0 || k == std::string::npos || std::sscanf(l.c_str() + k, ": (%lf, %lf)", &lo, &hi) != 2)
      continue;
    EXPECT_LE(lo, hi) << l;
  }
}

TEST(DistTrain, ImpossibleLayoutsFailBeforeWork) {
  TempDir tmp("bad");
  const CliResult r = run_shell(mpirun(3) + loom_bin() + " train " + kGpt + " --train-iters 2 --tensor-model-parallel-size 2", tmp);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("world size 3 is not divisible by --tensor-model-parallel-size (2)"), std::string::npos) << r.err;
  const CliResult h = run_shell(mpirun(2) + loom_bin() + " train " + kLlama + " --train-iters 2 --tensor-model-parallel-size 2 --num-query-groups 1", tmp);
  EXPECT_NE(h.code, 0);
  EXPECT_NE(h.err.find("--num-query-groups (1) must be divisible by --tensor-model-parallel-size (2)"), std::string::npos)
      << h.err;
}

// Save under TP2 x PP2 at iteration 10 (--make-vocab-size-divisible-by 64: the padded vocabulary is 128 for
// TP 1 and 2 alike; layouts must agree on it), resume as one process and as DP4 with ZeRO-1: iterations 11-20
// match the uninterrupted single-process run.
TEST(DistTrain, CheckpointsReshardAcrossLayouts) {
  for (const char* model : {kGpt, kLlama}) {
    const std::string pad = " --make-vocab-size-divisible-by 64";
    const std::vector<double> ref = train_losses(model, pad, 1, 20);
    TempDir ck("ckpt");
    const std::string save = pad + " --save " + (ck / "c") + " --save-interval 10 --exit-interval 10";
    const std::vector<double> first =
        train_losses(model, std::string("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2") + save, 4, 20);
    ASSERT_EQ(first.size(), 10u);
    const std::string load = pad + " --load " + (ck / "c");
    const std::vector<double> single = train_losses(model, load, 1, 20);
    expect_close({ref.begin() + 10, ref.end()}, single, 1e-5, "TP2xPP2 -> 1 process");
    const std::vector<double> zero = train_losses(model, "--use-distributed-optimizer" + load, 4, 20);
    expect_close({ref.begin() + 10, ref.end()}, zero, 1e-5, "TP2xPP2 -> DP4 ZeRO-1");
    // Another padded vocabulary is another model: refused up front, naming the flags.
    TempDir tmp("pad");
    const CliResult bad = run_shell("OMP_NUM_THREADS=1 " + loom_bin() + " train " + model + " --train-iters 20 --load " +
                                        (ck / "c") + " --make-vocab-size-divisible-by 256",
                                    tmp);
    EXPECT_NE(bad.code, 0);
    EXPECT_NE(bad.err.find("was saved with padded_vocab_size = 128 but this run has the padded vocabulary size "
                           "(tokenizer / --vocab-size / --make-vocab-size-divisible-by) = 256"),
              std::string::npos)
        << bad.err;
  }
}

// The single-file checkpoint of Loom 0.1.0 (one process, model.safetensors + optimizer.safetensors) loads
// into every layout through the resharding reader and continues as the single process does.
TEST(DistTrain, SingleFileCheckpointOfTheFirstReleaseLoadsIntoAnyLayout) {
  const std::string dir = std::string(LOOM_SOURCE_DIR) + "/tests/golden/fixtures/legacy_single_ckpt";
  std::ifstream f(dir + "/expected.json");
  ASSERT_TRUE(f.good()) << dir;
  std::string flags = nlohmann::json::parse(f)["flags"].get<std::string>();
  // Dropout masks follow the data-parallel micro-batch order: compare the layouts without dropout.
  // (train_losses adds --train-iters itself.)
  for (const char* d : {"--hidden-dropout 0.1", "--attention-dropout 0.1", "--train-iters 8"}) {
    const size_t at = flags.find(d);
    ASSERT_NE(at, std::string::npos) << flags;
    flags.replace(at, std::strlen(d), d[2] == 't' ? "" : std::string(d, std::strlen(d) - 3) + "0");
  }
  TempDir tmp("legacy");
  std::filesystem::copy(dir + "/ck", tmp / "ck", std::filesystem::copy_options::recursive);
  const std::string load = " --load " + (tmp / "ck");
  const std::vector<double> ref = train_losses(flags, load, 1, 8);
  ASSERT_EQ(ref.size(), 4u);
  for (const char* layout : {"", "--use-distributed-optimizer", // TP2 pads the vocabulary to a multiple of 64 x 2 = 128, as the checkpoint was.
                             "--tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 64",
                             "--pipeline-model-parallel-size 2"}) {
    std::string log;
    expect_close(ref, train_losses(flags, std::string(layout) + load, 2, 8, &log), 1e-5,
                 std::string("single file -> np 2 ") + layout);
    EXPECT_NE(log.find("successfully loaded checkpoint"), std::string::npos) << log;
  }
}

// A rank killed mid-run takes the job down with a non-zero exit; restarting from the last checkpoint
// continues exactly (same layout: bit-identical losses).
TEST(DistTrain, KilledRankEndsTheJobAndRestartContinuesExactly) {
  const std::string layout = "--tensor-model-parallel-size 2 --use-distributed-optimizer";
  const int iters = 300;
  const std::vector<double> ref = train_losses(kGpt, layout, 4, iters);
  ASSERT_EQ(ref.size(), size_t(iters));
  TempDir ck("fault");
  const std::string dir = ck / "c", jsonl = ck / "m.jsonl";
  const std::string cmd = mpirun(4) + loom_bin() + " train " + kGpt + " " + layout + " --train-iters " +
                          std::to_string(iters) + " --save " + dir +
                          " --save-interval 5 --distributed-timeout-minutes 0.2 --metrics-jsonl " + jsonl;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen((cmd + " >" + (ck / "out") + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  // Kill one rank (found by its unique --save dir) as soon as the first checkpoint is committed.
  const std::string tracker_path = dir + "/latest_checkpointed_iteration.txt";
  for (int i = 0; i < 6000 && !std::filesystem::exists(tracker_path); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  TempDir q("pgrep");
  const CliResult pids = run_shell("pgrep -f -- '^" + loom_bin() + " train.*" + dir + "' | tail -n 1", q);
  const int victim = std::atoi(pids.out.c_str());
  ASSERT_GT(victim, 0) << pids.out;
  ::kill(victim, SIGKILL);
  const int st = pclose(p);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "the job must fail when a rank dies";
  EXPECT_LT(secs, 120.0);
  const int saved = std::atoi(read_file(tracker_path).c_str());
  ASSERT_GE(saved, 5);
  ASSERT_EQ(saved % 5, 0);
  if (saved >= iters) GTEST_SKIP() << "the run finished before the kill";
  // Restart from the last checkpoint: every later iteration equals the uninterrupted run's bit for bit.
  const std::vector<double> resumed = train_losses(kGpt, layout + " --load " + dir, 4, iters);
  ASSERT_EQ(resumed.size(), size_t(iters - saved));
  for (size_t i = 0; i < resumed.size(); ++i) EXPECT_EQ(resumed[i], ref[size_t(saved) + i]) << "iteration " << saved + 1 + int(i);
}

}  // namespace
}  // namespace loom::e2e
