// The TFLOPs figure of the log line: FLOPs the iteration executes, checked against Megatron's closed forms
// for GPT-2 124M (72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) without recomputation, the paper's
// 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full uniform recomputation).
#include <gtest/gtest.h>

#include "loom/train/trainer.h"

using namespace loom;

TEST(IterationFlops, Gpt2MatchesMegatronFormulas) {
  GPTConfig m;  // GPT-2 124M
  m.num_layers = 12;
  m.hidden_size = 768;
  m.num_attention_heads = 12;
  m.vocab_size = 50257;
  m.padded_vocab_size = 50304;
  const double B = 64, s = 1024, l = 12, h = 768, V = 50304;
  RecomputeConfig none;
  const double model = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
  EXPECT_NEAR(iteration_flops(m, 64, 1024, none), model, model * 1e-12);

  RecomputeConfig full{"full", "uniform", 1};
  const double paper = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
  EXPECT_NEAR(iteration_flops(m, 64, 1024, full), paper, paper * 1e-12);

  // block: only the first N layers run forward twice.
  RecomputeConfig block{"full", "block", 3};
  const double layer_fwd = 24 * B * s * h * h + 4 * B * s * s * h;
  EXPECT_NEAR(iteration_flops(m, 64, 1024, block), model + 3 * layer_fwd, model * 1e-12);

  RecomputeConfig selective{"selective", "", std::nullopt};
  EXPECT_NEAR(iteration_flops(m, 64, 1024, selective), model + l * 4 * B * s * s * h, model * 1e-12);
}
