// `loom calc` with LoRA against `loom train` under mpirun (2 CPU ranks): the adapters a rank holds (TP 2:
// column-parallel A whole and B split, row-parallel A split and B whole, on PEFT slices and whole layers)
// and the model-state bytes the trainer logs (the frozen base whole on every rank, the adapters' states
// ZeRO-sharded) are the ones calc prints for the same flags, under TP 2, DP 2 with ZeRO-1 and TP 2 with
// sequence parallelism and ZeRO-3.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include "e2e/e2e_util.h"

namespace loom::e2e {
namespace {

const char* kLoraLlama =
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--normalization RMSNorm --swiglu --ffn-hidden-size 48 --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 "
    "--global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data --vocab-size 100 --log-interval 1 --eval-iters 0 "
    "--lora-rank 4 --lora-dropout 0.1 --lora-target-modules q_proj v_proj linear_proj gate_proj down_proj --bf16 "
    "--device cpu";

// The integer after `key` in `text`, without its thousands separators; -1 when `key` is absent.
int64_t number_after(const std::string& text, const std::string& key) {
  const size_t k = text.find(key);
  if (k == std::string::npos) return -1;
  std::string digits;
  for (size_t i = text.find_first_not_of(' ', k + key.size()); i < text.size(); ++i) {
    if (text[i] == ',') continue;
    if (text[i] < '0' || text[i] > '9') break;
    digits += text[i];
  }
  return digits.empty() ? -1 : std::stoll(digits);
}

}  // namespace

TEST(DistCalcLora, ModelStatesAreTheTrainers) {
  for (const std::string layout : {"--tensor-model-parallel-size 2", "--use-distributed-optimizer",
                                   "--tensor-model-parallel-size 2 --sequence-parallel "
                                   "--data-parallel-sharding-strategy optim_grads_params"}) {
    const std::string flags = std::string(kLoraLlama) + " " + layout;
    TempDir tmp("dist_calc_lora");
    const std::string cmd = std::string(LOOM_MPIEXEC) + " --allow-run-as-root --oversubscribe --bind-to none -np 2 " +
                            "-x OMP_NUM_THREADS=1 " + LOOM_BINARY + " train " + flags + " >" + (tmp / "out") + " 2>" +
                            (tmp / "err");
    const int st = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << cmd << "\n" << read_file(tmp / "err");
    const std::string log = read_file(tmp / "out");
    const CliResult calc = run_loom("calc " + flags + " --num-gpus 2");
    ASSERT_EQ(calc.code, 0) << calc.err;
    const int64_t adapters = number_after(log, "gate_proj: ");  // "... on <targets>: N trainable adapter ..."
    EXPECT_GT(adapters, 0) << log;
    EXPECT_EQ(number_after(calc.out, "LoRA adapters on it:"), adapters) << layout << "\n" << calc.out;
    const int64_t states = number_after(log, "(model states ");
    EXPECT_GT(states, 0) << log;
    EXPECT_EQ(number_after(calc.out, "  model states:"), states) << layout << "\n" << calc.out << log;
    // " > number of parameters on (tensor, pipeline) model parallel rank (t, p): N", the frozen base.
    const size_t rank_line = log.find("model parallel rank (");
    ASSERT_NE(rank_line, std::string::npos) << log;
    EXPECT_EQ(number_after(calc.out, "parameters on the rank:"), number_after(log.substr(rank_line), "): ")) << layout;
  }
}

}  // namespace loom::e2e
