// `loom calc` arithmetic against hand-computed values: GPT-2 124M, the 18.4B model of Megatron-LM's
// weak-scaling table and the 175B example of Narayanan et al. (2021); the activation formulas of
// Korthikanti et al. (2022) for every TP/SP/CP/PP case; ZeRO model states per rank for each sharding
// strategy (exact bytes of a small model); validation messages naming the flag.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "loom/core/check.h"
#include "loom/train/calc.h"

using namespace loom;

namespace {

// l layers, hidden size h, a heads, sequence length s = max positions; everything else at its default.
TrainConfig model_config(int64_t l, int64_t h, int64_t a, int64_t s) {
  TrainConfig c;
  c.model.num_layers = l;
  c.model.hidden_size = h;
  c.model.num_attention_heads = a;
  c.model.max_position_embeddings = s;
  c.batch.seq_length = s;
  return c;
}

// The setup of Megatron-LM's published large runs: s = 2048, micro-batch 1, vocabulary 51200, TP 8, BF16.
TrainConfig megatron_run_config(int64_t l, int64_t h, int64_t a, int64_t global_batch) {
  TrainConfig c = model_config(l, h, a, 2048);
  c.batch.micro_batch_size = 1;
  c.batch.global_batch_size = global_batch;
  c.data.vocab_size = 51200;
  c.parallel.tensor_model_parallel_size = 8;
  c.precision.bf16 = true;
  return c;
}

// GPT-2 124M: l = 12, h = 768, a = 12, s = 1024, b = 4, B = 32, vocabulary 50257 (padded to 50304).
TrainConfig gpt2_config() {
  TrainConfig c = model_config(12, 768, 12, 1024);
  c.batch.micro_batch_size = 4;
  c.batch.global_batch_size = 32;
  c.precision.bf16 = true;
  return c;
}

CalcReport gpt2(const std::function<void(TrainConfig&, CalcOptions&)>& edit = {}) {
  TrainConfig c = gpt2_config();
  CalcOptions o;
  o.num_gpus = 8;
  if (edit) edit(c, o);
  return compute_calc(make_calc_input(c, o));
}

std::string calc_error(const std::function<void(TrainConfig&, CalcOptions&)>& edit) {
  TrainConfig c = gpt2_config();
  CalcOptions o;
  edit(c, o);
  try {
    make_calc_input(c, o);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// GPT-2 with `edit` applied is rejected with a message containing `needle`.
void expect_calc_error(const std::function<void(TrainConfig&, CalcOptions&)>& edit, const std::string& needle) {
  const std::string err = calc_error(edit);
  EXPECT_NE(err.find(needle), std::string::npos) << "message: '" << err << "'";
}

// s*b*h for GPT-2 with b = 4: 1024 * 4 * 768.
constexpr double kSBH = 3145728.0;

}  // namespace

TEST(Calc, Gpt2Parameters) {
  const CalcReport r = gpt2();
  EXPECT_EQ(r.input.model.vocab_size, 50257);
  EXPECT_EQ(r.input.model.padded_vocab_size, 50304);  // next multiple of 128
  // Per layer 12*768^2 + 13*768 = 7,087,872; x 12 = 85,054,464.
  // Embeddings (50304 + 1024) * 768 = 39,419,904; final norm 2 * 768 = 1,536.  Sum 124,475,904.
  EXPECT_EQ(r.params, 124475904);
  // Formula 12*l*h^2 + 13*l*h + (V+s)*h = 84,934,656 + 119,808 + 39,419,904 = 124,474,368
  // (the exact count minus the final norm's 2h).
  EXPECT_DOUBLE_EQ(r.params_formula, 124474368.0);
  EXPECT_EQ(r.params_first_stage, r.params);  // TP 1, PP 1: the rank holds everything
  EXPECT_EQ(r.params_last_stage, r.params);
}

TEST(Calc, Gpt2Flops) {
  const CalcReport r = gpt2();
  // Per sequence: 72*s*l*h^2 = 521,838,526,464; 12*s^2*l*h = 115,964,116,992; 6*s*h*V = 237,364,051,968.
  // Sum 875,166,695,424; x B = 32 -> 28,005,334,253,568.
  EXPECT_DOUBLE_EQ(r.flops_model, 28005334253568.0);
  // The paper's factored form gives the same number.
  const double B = 32, s = 1024, l = 12, h = 768, V = 50304;
  EXPECT_NEAR(r.flops_model, 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)), 1e-3 * 1e3);
  // Selective adds 4*B*s^2*h*l = 1,236,950,581,248.
  EXPECT_DOUBLE_EQ(r.flops_selective, 29242284834816.0);
  // Full: per sequence 96*s*l*h^2 = 695,784,701,952 + 16*s^2*l*h = 154,618,822,656 + 6*s*h*V; x 32.
  EXPECT_DOUBLE_EQ(r.flops_full, 34808562450432.0);
  EXPECT_NEAR(r.flops_full, 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)), 1e3);
  EXPECT_DOUBLE_EQ(r.flops_run, r.flops_model);  // no recomputation
  EXPECT_EQ(r.run_row, 0u);
}

TEST(Calc, Gpt2MemoryBf16) {
  const CalcReport r = gpt2();
  EXPECT_EQ(r.weight_bytes, 124475904LL * 6);     // 746,855,424: FP32 master + BF16 copy
  EXPECT_EQ(r.grad_bytes, 124475904LL * 4);       // FP32 main grads
  EXPECT_EQ(r.optimizer_bytes, 124475904LL * 8);  // Adam m, v
  ASSERT_EQ(r.activations.size(), 3u);
  EXPECT_EQ(r.micro_batches, 1);  // 32 / (4 x DP 8)
  EXPECT_EQ(r.micro_batches_in_flight, 1);
  // none: s*b*h*(34 + 5*a*s/h) = 3,145,728 * (34 + 80) = 358,612,992.
  EXPECT_DOUBLE_EQ(r.activations[0].per_layer, 358612992.0);
  EXPECT_DOUBLE_EQ(r.activations[1].per_layer, 106954752.0);  // 34*s*b*h
  EXPECT_DOUBLE_EQ(r.activations[2].per_layer, 6291456.0);    // 2*s*b*h
  // Extra with PP 1: dropout mask s*b*h + norm/output inputs 4*s*b*h + FP32 logits 4*s*b*V = 839,909,376.
  EXPECT_DOUBLE_EQ(r.activations[0].extra, 839909376.0);
  EXPECT_DOUBLE_EQ(r.activations[0].total(), 12 * 358612992.0 + 839909376.0);  // 5,143,265,280
  EXPECT_DOUBLE_EQ(r.activations[2].total(), 12 * 6291456.0 + 839909376.0);
}

TEST(Calc, PrecisionChangesBytesPerParameter) {
  const CalcReport f32 = gpt2([](TrainConfig& c, CalcOptions&) { c.precision.bf16 = false; });
  EXPECT_EQ(f32.weight_bytes, 124475904LL * 4);  // no 16-bit copy
  EXPECT_EQ(f32.grad_bytes, 124475904LL * 4);
  EXPECT_DOUBLE_EQ(f32.activations[0].per_layer, 2 * 358612992.0);  // FP32 activations: twice the paper's
  EXPECT_DOUBLE_EQ(f32.peak_tflops, 495);                            // the TF32 peak
  // One rank: the grad dtype follows the precision flags (more ranks: always FP32, see CalcZero).
  const CalcReport f16 = gpt2([](TrainConfig& c, CalcOptions& o) {
    c.precision.bf16 = false;
    c.precision.fp16 = true;
    o.num_gpus = 1;
  });
  EXPECT_EQ(f16.weight_bytes, 124475904LL * 6);
  EXPECT_EQ(f16.grad_bytes, 124475904LL * 2);  // FP16 main grads without the flag below
  const CalcReport f16acc = gpt2([](TrainConfig& c, CalcOptions& o) {
    c.precision.bf16 = false;
    c.precision.fp16 = true;
    c.precision.accumulate_allreduce_grads_in_fp32 = true;
    o.num_gpus = 1;
  });
  EXPECT_EQ(f16acc.grad_bytes, 124475904LL * 4);
}

TEST(Calc, Gpt2TrainingTime) {
  const CalcReport r = gpt2([](TrainConfig&, CalcOptions& o) { o.train_tokens = 10e9; });
  EXPECT_DOUBLE_EQ(r.peak_tflops, 989);
  EXPECT_DOUBLE_EQ(r.achieved_tflops, 0.4 * 989);  // default MFU on the default H100
  // 6*T*P/(n*X) = 6 * 1e10 * 124,475,904 / (8 * 395.6e12) = 2,359.88 s; 8*T*P/(n*X) = 3,146.51 s.
  EXPECT_NEAR(r.seconds_6tp, 2359.8819, 1e-3);
  EXPECT_NEAR(r.seconds_8tp, 3146.5092, 1e-3);
  // From the FLOPs per iteration: 1e10 / 32,768 iterations x 2.8005e13 FLOP / (n*X) = 2,700.50 s.
  EXPECT_NEAR(r.iterations, 305175.78125, 1e-6);
  EXPECT_NEAR(r.seconds_run, 2700.5023, 1e-3);
  EXPECT_NEAR(r.seconds_per_iteration, 28005334253568.0 / (8 * 395.6e12), 1e-12);
}

TEST(Calc, TrainItersGiveTheTokens) {
  const CalcReport r = gpt2([](TrainConfig& c, CalcOptions&) { c.batch.train_iters = 1000; });
  ASSERT_TRUE(r.input.train_tokens.has_value());
  EXPECT_DOUBLE_EQ(*r.input.train_tokens, 1000.0 * 32 * 1024);
  EXPECT_NEAR(r.iterations, 1000.0, 1e-9);
}

TEST(Calc, Megatron18BWeakScalingRow) {
  // Megatron-LM README: 18.4B = 40 layers, hidden 6144, 48 heads, TP 8, 256 GPUs, batch 1024; s 2048, V 51200.
  const TrainConfig c = megatron_run_config(40, 6144, 48, 1024);
  CalcOptions o;
  o.num_gpus = 256;
  const CalcReport r = compute_calc(make_calc_input(c, o));
  EXPECT_EQ(r.input.model.padded_vocab_size, 51200);  // already a multiple of 128 x 8
  EXPECT_EQ(r.input.data_parallel_size(), 32);
  // 12*40*6144^2 = 18,119,393,280; 13*40*6144 = 3,194,880; (51200 + 2048)*6144 = 327,155,712.
  // Sum 18,449,743,872 -> "18.4B".
  EXPECT_DOUBLE_EQ(r.params_formula, 18449743872.0);
  EXPECT_EQ(r.params, 18449743872LL + 2 * 6144);
  // One TP rank: 40 * ((12h^2 + 7h)/8 + 6h) + 51200*h/8 + 2048*h + 2h.
  EXPECT_EQ(r.params_first_stage, 40LL * ((12LL * 6144 * 6144 + 7 * 6144) / 8 + 6 * 6144) + 51200LL * 6144 / 8 +
                                      2048LL * 6144 + 2 * 6144);
}

TEST(Calc, Gpt3_175BExampleOfTheMegatronPaper) {
  // Narayanan et al. (2021): P = 175B, T = 300B tokens, n = 1024 A100s at X = 140 TFLOP/s -> about 34 days.
  TrainConfig c = megatron_run_config(96, 12288, 96, 1536);
  c.parallel.pipeline_model_parallel_size = 16;
  c.recompute.granularity = "full";
  c.recompute.method = "uniform";
  c.recompute.num_layers = 1;
  CalcOptions o;
  o.num_gpus = 1024;
  o.train_tokens = 300e9;
  o.gpu = "a100";  // case-insensitive
  o.gpu_tflops = 140;
  const CalcReport r = compute_calc(make_calc_input(c, o));
  // 12*96*12288^2 = 173,946,175,488; 13*96*12288 = 15,335,424; (51200 + 2048)*12288 = 654,311,424.
  EXPECT_DOUBLE_EQ(r.params_formula, 174615822336.0);
  // 8*T*P/(n*X) = 8 * 3e11 * 174,615,846,912 / (1024 * 1.4e14) s = 33.83 days.
  EXPECT_NEAR(r.seconds_8tp / 86400, 33.834, 1e-3);
  EXPECT_NEAR(r.seconds_8tp / 86400, 34, 0.5);
  EXPECT_EQ(r.recomputed_layers, 96);
  EXPECT_DOUBLE_EQ(r.flops_run, r.flops_full);
  EXPECT_EQ(r.run_row, 2u);
  // First stage of 16: 6 layers of (12h^2 + 7h)/8 + 6h, the word embedding / 8 and the position table.
  EXPECT_EQ(r.params_first_stage, 1463270400);
  EXPECT_EQ(r.params_last_stage, 1463270400 - 2048LL * 12288 + 2 * 12288);
  EXPECT_EQ(r.micro_batches, 192);  // 1536 / (1 x DP 8)
  EXPECT_EQ(r.micro_batches_in_flight, 16);
  EXPECT_DOUBLE_EQ(r.achieved_tflops, 140);
}

TEST(Calc, TensorAndSequenceParallelActivations) {
  const auto tp4 = [](bool sp) {
    return gpt2([sp](TrainConfig& c, CalcOptions& o) {
      c.parallel.tensor_model_parallel_size = 4;
      o.sequence_parallel = sp;
    });
  };
  const CalcReport no_sp = tp4(false), sp = tp4(true);
  // TP only: s*b*h*(10 + 24/t + 5*a*s/(h*t)) = sbh * (10 + 6 + 20).
  EXPECT_DOUBLE_EQ(no_sp.activations[0].per_layer, kSBH * 36);
  EXPECT_DOUBLE_EQ(no_sp.activations[1].per_layer, kSBH * 16);  // s*b*h*(10 + 24/t)
  EXPECT_DOUBLE_EQ(no_sp.activations[2].per_layer, kSBH * 2);
  // TP + SP: everything divides by t.
  EXPECT_DOUBLE_EQ(sp.activations[0].per_layer, kSBH / 4 * 114);
  EXPECT_DOUBLE_EQ(sp.activations[1].per_layer, kSBH / 4 * 34);
  EXPECT_DOUBLE_EQ(sp.activations[2].per_layer, kSBH / 4 * 2);
  // Padded for TP 4: multiple of 512 -> 50688. Layer weights split, proj/fc2 biases and norms not.
  EXPECT_EQ(no_sp.input.model.padded_vocab_size, 50688);
  EXPECT_EQ(no_sp.params_first_stage,
            12LL * ((12 * 768 * 768 + 7 * 768) / 4 + 6 * 768) + 50688LL * 768 / 4 + 1024LL * 768 + 2 * 768);
  // Extra: the logits are vocabulary-parallel either way; SP also splits the dropout mask and norm inputs.
  EXPECT_DOUBLE_EQ(no_sp.activations[0].extra, kSBH + 4 * kSBH + 4.0 * 1024 * 4 * 50688 / 4);
  EXPECT_DOUBLE_EQ(sp.activations[0].extra, (kSBH + 4 * kSBH) / 4 + 4.0 * 1024 * 4 * 50688 / 4);
}

TEST(Calc, ContextParallelSplitsTheSequence) {
  const CalcReport r = gpt2([](TrainConfig& c, CalcOptions&) { c.parallel.context_parallel_size = 2; });
  // s/CP = 512: 512*4*768*(34 + 5*12*512/768) = 1,572,864 * 74.
  EXPECT_DOUBLE_EQ(r.activations[0].per_layer, 1572864.0 * 74);
  EXPECT_DOUBLE_EQ(r.flops_model, 28005334253568.0);  // FLOPs do not depend on the layout
  EXPECT_EQ(r.input.data_parallel_size(), 4);         // 8 GPUs / CP 2
}

TEST(Calc, PipelineKeepsMicroBatchesInFlight) {
  const CalcReport r = gpt2([](TrainConfig& c, CalcOptions& o) {
    c.parallel.pipeline_model_parallel_size = 4;
    c.batch.global_batch_size = 64;
    o.num_gpus = 8;  // DP 2: 64 / (4 x 2) = 8 micro-batches
  });
  EXPECT_EQ(r.micro_batches, 8);
  EXPECT_EQ(r.micro_batches_in_flight, 4);
  // 3 layers per stage x 4 micro-batches; extra is the dropout mask of each (no output layer here).
  EXPECT_DOUBLE_EQ(r.activations[0].layers_total, 4 * 3 * 358612992.0);
  EXPECT_DOUBLE_EQ(r.activations[0].extra, 4 * kSBH);
  EXPECT_EQ(r.params_first_stage, 3LL * (12 * 768 * 768 + 13 * 768) + 50304LL * 768 + 1024LL * 768);
  EXPECT_EQ(r.params_last_stage, 3LL * (12 * 768 * 768 + 13 * 768) + 50304LL * 768 + 2 * 768);
  const CalcReport few = gpt2([](TrainConfig& c, CalcOptions& o) {
    c.parallel.pipeline_model_parallel_size = 4;
    c.batch.global_batch_size = 16;
    o.num_gpus = 8;  // 2 micro-batches: only 2 can be in flight
  });
  EXPECT_EQ(few.micro_batches_in_flight, 2);
}

TEST(Calc, RecomputeSettings) {
  const double layer_forward = 24.0 * 32 * 1024 * 768 * 768 + 4.0 * 32 * 1024 * 1024 * 768;
  const CalcReport sel = gpt2([](TrainConfig& c, CalcOptions&) { c.recompute.granularity = "selective"; });
  EXPECT_DOUBLE_EQ(sel.flops_run, sel.flops_selective);
  EXPECT_EQ(sel.run_row, 1u);
  const CalcReport block = gpt2([](TrainConfig& c, CalcOptions&) {
    c.recompute.granularity = "full";
    c.recompute.method = "block";
    c.recompute.num_layers = 4;
  });
  EXPECT_EQ(block.recomputed_layers, 4);
  EXPECT_DOUBLE_EQ(block.flops_run, block.flops_model + 4 * layer_forward);
  // 4 layers keep their input, 8 keep everything.
  EXPECT_DOUBLE_EQ(block.activations[2].layers_total, 4 * 6291456.0 + 8 * 358612992.0);
  const CalcReport uniform = gpt2([](TrainConfig& c, CalcOptions&) {
    c.recompute.granularity = "full";
    c.recompute.method = "uniform";
    c.recompute.num_layers = 4;
  });
  EXPECT_EQ(uniform.recomputed_layers, 12);
  EXPECT_DOUBLE_EQ(uniform.flops_run, uniform.flops_full);
  EXPECT_DOUBLE_EQ(uniform.activations[2].layers_total, 3 * 6291456.0);  // one checkpoint per group of 4
}

TEST(Calc, OnlyModelFlagsNeeded) {
  const CalcInput in = make_calc_input(model_config(2, 64, 4, 32), {});
  EXPECT_EQ(in.model.vocab_size, 50257);
  EXPECT_EQ(in.model.padded_vocab_size, 50304);
  EXPECT_EQ(in.micro_batch_size, 1);
  EXPECT_EQ(in.global_batch_size, 1);
  EXPECT_EQ(in.num_gpus, 1);
  EXPECT_FALSE(in.train_tokens.has_value());
  EXPECT_EQ(in.gpu.name, "H100");
  ASSERT_EQ(in.notes.size(), 3u);  // micro-batch, vocabulary and GPU assumptions are stated
  const CalcReport r = compute_calc(in);
  EXPECT_EQ(r.seconds_8tp, 0);
  EXPECT_NE(format_calc_report(r).find("give --train-tokens T"), std::string::npos);
}

TEST(Calc, VocabularyFromTheTokenizer) {
  TrainConfig c = gpt2_config();
  c.data.tokenizer.type = "NullTokenizer";
  c.data.tokenizer.vocab_size = 1000;
  const CalcInput in = make_calc_input(c, {});
  EXPECT_EQ(in.model.vocab_size, 1001);  // NullTokenizer adds the EOD id, as in `loom train`
  EXPECT_EQ(in.model.padded_vocab_size, 1024);
}

TEST(Calc, ValidationNamesTheFlag) {
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.model.num_layers = 0; }, "--num-layers");
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.batch.seq_length = 0; }, "--seq-length");
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.parallel.tensor_model_parallel_size = 5; },
                    "--num-attention-heads (12) must be divisible by --tensor-model-parallel-size (5)");
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.parallel.pipeline_model_parallel_size = 5; },
                    "--pipeline-model-parallel-size");
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.parallel.context_parallel_size = 3; },
                    "--context-parallel-size");
  expect_calc_error(
      [](TrainConfig& c, CalcOptions& o) {
        c.parallel.tensor_model_parallel_size = 2;
        o.num_gpus = 3;
      },
      "--num-gpus (3) must be a positive multiple of TP x PP x CP = 2");
  expect_calc_error([](TrainConfig&, CalcOptions& o) { o.num_gpus = 3; }, "--global-batch-size (32)");
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.precision.fp16 = true; },
                    "--bf16 and --fp16 are mutually exclusive");
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.recompute.granularity = "full"; }, "--recompute-method");
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.recompute.granularity = "most"; },
                    "--recompute-granularity must be full or selective");
  expect_calc_error(
      [](TrainConfig& c, CalcOptions& o) {
        c.batch.train_iters = 10;
        o.train_tokens = 1e9;
      },
      "--train-tokens and --train-iters");
  expect_calc_error(
      [](TrainConfig&, CalcOptions& o) {
        o.mfu = 0.5;
        o.gpu_tflops = 300;
      },
      "--mfu and --gpu-tflops");
  expect_calc_error([](TrainConfig&, CalcOptions& o) { o.mfu = 1.5; }, "--mfu must be in (0, 1]");
  expect_calc_error([](TrainConfig&, CalcOptions& o) { o.gpu = "V100"; },
                    "--gpu: unknown GPU 'V100' (valid: A100, H100, H200, B200");
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.model.max_position_embeddings = 512; },
                    "--max-position-embeddings (512) must be >= --seq-length (1024)");
  EXPECT_EQ(calc_error([](TrainConfig&, CalcOptions&) {}), "");
}

TEST(Calc, TokenCounts) {
  EXPECT_DOUBLE_EQ(parse_token_count("--train-tokens", "300B"), 300e9);
  EXPECT_DOUBLE_EQ(parse_token_count("--train-tokens", "1.5T"), 1.5e12);
  EXPECT_DOUBLE_EQ(parse_token_count("--train-tokens", "300e9"), 300e9);
  EXPECT_DOUBLE_EQ(parse_token_count("--train-tokens", "50M"), 50e6);
  EXPECT_DOUBLE_EQ(parse_token_count("--train-tokens", "20k"), 20e3);
  EXPECT_DOUBLE_EQ(parse_token_count("--train-tokens", "2G"), 2e9);
  EXPECT_DOUBLE_EQ(parse_token_count("--train-tokens", "12345"), 12345);
  for (const char* bad : {"", "B", "abc", "0", "-5", "1.5X", "1e9B7", "inf", "nan", " 5"}) {
    try {
      parse_token_count("--train-tokens", bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("--train-tokens"), std::string::npos);
    }
  }
}

TEST(Calc, ReportLabels) {
  const std::string out = format_calc_report(gpt2([](TrainConfig& c, CalcOptions& o) {
    c.recompute.granularity = "selective";
    o.train_tokens = 10e9;
    o.gpu = "B200";
  }));
  const auto line_with = [&](const std::string& label) {
    const size_t at = out.find(label);
    if (at == std::string::npos) return std::string();
    return out.substr(at, out.find('\n', at) - at);
  };
  EXPECT_NE(line_with("parameters (exact):").find("124,475,904  (124.48M)"), std::string::npos) << out;
  EXPECT_NE(line_with("parameters (formula):").find("124,474,368  (124.47M)"), std::string::npos) << out;
  EXPECT_NE(line_with("selective recomputation:").find("2.9242e+13 FLOP"), std::string::npos) << out;
  EXPECT_NE(line_with("selective recomputation:").find("<- this run"), std::string::npos) << out;
  EXPECT_EQ(line_with("model (no recomputation):").find("<- this run"), std::string::npos) << out;
  EXPECT_NE(line_with("    selective ").find("106,954,752 B"), std::string::npos) << out;
  EXPECT_NE(line_with("    selective ").find("<- this run"), std::string::npos) << out;
  EXPECT_NE(line_with("  weights:").find("746,855,424 B  (0.70 GiB)"), std::string::npos) << out;
  EXPECT_NE(line_with("  B200 (HGX)").find("<- --gpu"), std::string::npos) << out;
  EXPECT_NE(line_with("achieved per GPU:").find("900.0 TFLOP/s"), std::string::npos) << out;  // 0.4 x 2250
}

namespace {

// A small model for the ZeRO figures: l = 3, h = 36, a = 4, s = 32, vocabulary 1000 -> 1024.
// P = 3*(12*36^2 + 13*36) + (1024 + 32)*36 + 2*36 = 48,060 + 38,016 + 72 = 86,148 (divisible by 4, not by 8:
// ceil(P/4) = 21,537, ceil(P/8) = 10,769).
constexpr int64_t kSmallP = 86148, kSmallS4 = 21537, kSmallS8 = 10769, kSmallLayer = 16020;

// CP 2 and DP = d/2; `strategy` as --data-parallel-sharding-strategy ("" = unset).
CalcReport small_zero(const std::string& strategy, bool bf16, int64_t d,
                      const std::function<void(TrainConfig&, CalcOptions&)>& edit = {}) {
  TrainConfig c = model_config(3, 36, 4, 32);
  c.data.vocab_size = 1000;
  c.precision.bf16 = bf16;
  c.parallel.context_parallel_size = 2;
  c.dist.sharding_strategy = strategy;
  CalcOptions o;
  o.num_gpus = d;
  if (edit) edit(c, o);
  return compute_calc(make_calc_input(c, o));
}

struct States {
  int64_t weights, grads, optimizer;
};

void expect_states(const CalcReport& r, const States& want) {
  EXPECT_EQ(r.weight_bytes, want.weights);
  EXPECT_EQ(r.grad_bytes, want.grads);
  EXPECT_EQ(r.optimizer_bytes, want.optimizer);
}

std::string report_line(const std::string& out, const std::string& label) {
  const size_t at = out.find(label);
  if (at == std::string::npos) return std::string();
  return out.substr(at, out.find('\n', at) - at);
}

}  // namespace

TEST(CalcZero, SmallModelParameters) {
  const CalcReport r = small_zero("", true, 4);
  EXPECT_EQ(r.params, kSmallP);
  EXPECT_EQ(r.params_first_stage, kSmallP);
  EXPECT_EQ(r.layer_params, kSmallLayer);
  EXPECT_EQ(r.input.data_parallel_size(), 2);
  EXPECT_EQ(r.zero_group, 4);  // DP 2 x CP 2
  EXPECT_EQ(r.input.sharding, ShardingStrategy::kNone);
}

TEST(CalcZero, Bf16EachStrategy) {
  // no_shard: 6 + 4 + 8 B/param, whatever d.
  for (int64_t d : {4, 8}) expect_states(small_zero("no_shard", true, d), {6 * kSmallP, 4 * kSmallP, 8 * kSmallP});
  // optim (ZeRO-1): full BF16 copy + FP32 master shard; full FP32 grads; Adam shard.
  expect_states(small_zero("optim", true, 4), {2 * kSmallP + 4 * kSmallS4, 4 * kSmallP, 8 * kSmallS4});
  expect_states(small_zero("optim", true, 8), {172296 + 43076, 344592, 86152});
  // optim_grads (ZeRO-2): gradients sharded too.
  const CalcReport z2 = small_zero("optim_grads", true, 8);
  expect_states(z2, {215372, 43076, 86152});
  expect_states(small_zero("optim_grads", true, 4), {258444, 86148, 172296});
  // Default bucket max(40M, 1M*d) = 40M > P: two buckets' worth is the whole model's FP32 gradients.
  EXPECT_EQ(z2.bucket_size, 40000000);
  EXPECT_EQ(z2.transient_bytes, 4 * kSmallP);
  // optim_grads_params (ZeRO-3): everything sharded, 18/d B/param.
  const CalcReport z3 = small_zero("optim_grads_params", true, 4);
  expect_states(z3, {6 * kSmallS4, 4 * kSmallS4, 8 * kSmallS4});  // 129,222 + 86,148 + 172,296
  expect_states(small_zero("optim_grads_params", true, 8), {64614, 43076, 86152});
  // Two layers gathered: 2 * 16,020 * (2 B BF16 params + 4 B FP32 grads).
  EXPECT_EQ(z3.transient_bytes, 192240);
  EXPECT_EQ(z3.states_bytes(), 18 * kSmallS4);
}

TEST(CalcZero, Fp32EachStrategy) {
  expect_states(small_zero("no_shard", false, 8), {4 * kSmallP, 4 * kSmallP, 8 * kSmallP});
  // FP32: the weights are the masters; only Adam's state shrinks under ZeRO-1.
  expect_states(small_zero("optim", false, 4), {344592, 344592, 172296});
  expect_states(small_zero("optim", false, 8), {344592, 344592, 86152});
  expect_states(small_zero("optim_grads", false, 4), {344592, 86148, 172296});
  expect_states(small_zero("optim_grads", false, 8), {344592, 43076, 86152});
  const CalcReport z3 = small_zero("optim_grads_params", false, 8);
  expect_states(z3, {43076, 43076, 86152});  // 16/d B/param
  expect_states(small_zero("optim_grads_params", false, 4), {86148, 86148, 172296});
  EXPECT_EQ(z3.transient_bytes, 2 * kSmallLayer * 8);  // FP32 params and grads of two layers
}

TEST(CalcZero, BucketSizeFlag) {
  const CalcReport r = small_zero("optim_grads", true, 8, [](TrainConfig& c, CalcOptions&) {
    c.dist.ddp_bucket_size = 10000;
  });
  EXPECT_EQ(r.bucket_size, 10000);
  EXPECT_EQ(r.transient_bytes, 4 * 20000);  // 2 buckets < P
  // Large groups raise the default: max(40M, 1M * d).
  const CalcReport big = small_zero("optim_grads", true, 64, [](TrainConfig& c, CalcOptions&) {
    c.batch.global_batch_size = 32;
  });
  EXPECT_EQ(big.bucket_size, 64000000);
  EXPECT_EQ(small_zero("optim", true, 8).transient_bytes, 0);
}

TEST(CalcZero, DistributedOptimizerFlagResolvesLikeTheTrainer) {
  const auto dist_opt = [](const std::string& strategy) {
    return small_zero(strategy, true, 8, [](TrainConfig& c, CalcOptions&) { c.dist.use_distributed_optimizer = true; });
  };
  EXPECT_EQ(dist_opt("").input.sharding, ShardingStrategy::kOptim);
  EXPECT_EQ(dist_opt("optim_grads").input.sharding, ShardingStrategy::kOptimGrads);  // the strategy wins
  expect_states(dist_opt(""), {215372, 344592, 86152});
  expect_calc_error(
      [](TrainConfig& c, CalcOptions&) {
        c.dist.use_distributed_optimizer = true;
        c.dist.sharding_strategy = "no_shard";
      },
      "--use-distributed-optimizer contradicts --data-parallel-sharding-strategy no_shard");
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.dist.sharding_strategy = "zero2"; },
                    "--data-parallel-sharding-strategy must be no_shard, optim, optim_grads or optim_grads_params, "
                    "got 'zero2'");
  expect_calc_error([](TrainConfig& c, CalcOptions&) { c.dist.ddp_bucket_size = -1; }, "--ddp-bucket-size");
}

TEST(CalcZero, OneRankGroupEqualsNoShard) {
  // d = 1: S(P) = P, so every strategy gives no_shard's bytes (BF16 grads are FP32 anyway), with a note.
  TrainConfig c = model_config(3, 36, 4, 32);
  c.data.vocab_size = 1000;
  c.precision.bf16 = true;
  for (const char* strategy : {"optim", "optim_grads", "optim_grads_params"}) {
    c.dist.sharding_strategy = strategy;
    const CalcInput in = make_calc_input(c, {});
    const CalcReport r = compute_calc(in);
    expect_states(r, {6 * kSmallP, 4 * kSmallP, 8 * kSmallP});
    bool noted = false;
    for (const std::string& n : in.notes) noted = noted || n.find("ZeRO shards over 1 rank: no saving") == 0;
    EXPECT_TRUE(noted) << strategy;
  }
  c.dist.sharding_strategy = "no_shard";
  for (const std::string& n : make_calc_input(c, {}).notes) EXPECT_EQ(n.find("ZeRO"), std::string::npos) << n;
}

TEST(CalcZero, GradientsAreFp32WithMoreThanOneRank) {
  const auto fp16 = [](int64_t gpus) {
    return gpt2([gpus](TrainConfig& c, CalcOptions& o) {
      c.precision.bf16 = false;
      c.precision.fp16 = true;
      o.num_gpus = gpus;
    });
  };
  EXPECT_EQ(fp16(1).grad_bytes, 124475904LL * 2);  // one rank: --fp16's FP16 main grads
  EXPECT_EQ(fp16(8).grad_bytes, 124475904LL * 4);  // the trainer forces FP32 main grads when distributed
  EXPECT_NE(report_line(format_calc_report(fp16(8)), "  gradients:").find("always FP32 with more than one rank"),
            std::string::npos);
}

TEST(CalcZero, LastPipelineStage) {
  // PP 3 (one layer per stage), CP 1, DP 4: d = 4. First stage 16,020 + 1024*36 + 32*36 = 54,036 params,
  // last 16,020 + 1024*36 + 72 = 52,956.
  const CalcReport r = small_zero("optim", true, 12, [](TrainConfig& c, CalcOptions&) {
    c.parallel.context_parallel_size = 1;
    c.parallel.pipeline_model_parallel_size = 3;
  });
  EXPECT_EQ(r.zero_group, 4);
  EXPECT_EQ(r.params_first_stage, 54036);
  EXPECT_EQ(r.params_last_stage, 52956);
  expect_states(r, {2 * 54036 + 4 * 13509, 4 * 54036, 8 * 13509});
  EXPECT_EQ(r.last_weight_bytes, 2 * 52956 + 4 * 13239);
  EXPECT_EQ(r.last_grad_bytes, 4 * 52956);
  EXPECT_EQ(r.last_optimizer_bytes, 8 * 13239);
  EXPECT_EQ(r.last_states_bytes(), 158868 + 211824 + 105912);
  EXPECT_NE(report_line(format_calc_report(r), "last stage states:").find("476,604 B"), std::string::npos);
}

TEST(CalcZero, ReportNamesTheStrategyAndFormulas) {
  const std::string z1 = format_calc_report(small_zero("optim", true, 8));
  EXPECT_NE(report_line(z1, "data-parallel sharding:").find("optim (ZeRO-1) over d = 8 ranks (DP 4 x CP 2)"),
            std::string::npos)
      << z1;
  EXPECT_NE(report_line(z1, "data-parallel sharding:").find("ceil(P/d) = 10,769 params"), std::string::npos) << z1;
  EXPECT_NE(report_line(z1, "  weights:").find("215,372 B  (0.00 GiB)  2 + 4/d B/param (ZeRO-1, d = 8)"),
            std::string::npos)
      << z1;
  EXPECT_NE(report_line(z1, "  gradients:").find("4 B/param (ZeRO-1, d = 8)"), std::string::npos) << z1;
  EXPECT_NE(report_line(z1, "  optimizer state:").find("8/d B/param (ZeRO-1, d = 8)"), std::string::npos) << z1;
  EXPECT_NE(report_line(z1, "  model states:").find("6 + 12/d B/param (ZeRO-1, d = 8)"), std::string::npos) << z1;
  const std::string z2 = format_calc_report(small_zero("optim_grads", true, 4));
  EXPECT_NE(report_line(z2, "  model states:").find("2 + 16/d B/param (ZeRO-2, d = 4)"), std::string::npos) << z2;
  EXPECT_NE(report_line(z2, "gradient buckets:").find("344,592 B"), std::string::npos) << z2;
  const std::string z3 = format_calc_report(small_zero("optim_grads_params", true, 4));
  EXPECT_NE(report_line(z3, "  model states:").find("18/d B/param (ZeRO-3, d = 4)"), std::string::npos) << z3;
  EXPECT_NE(report_line(z3, "gathered layers:").find("192,240 B"), std::string::npos) << z3;
  const std::string z3f = format_calc_report(small_zero("optim_grads_params", false, 8));
  EXPECT_NE(report_line(z3f, "  model states:").find("16/d B/param (ZeRO-3, d = 8)"), std::string::npos) << z3f;
  const std::string none = format_calc_report(small_zero("", true, 8));
  EXPECT_NE(report_line(none, "data-parallel sharding:").find("no_shard (no ZeRO)"), std::string::npos) << none;
  EXPECT_NE(report_line(none, "  model states:").find("18 B/param"), std::string::npos) << none;
  EXPECT_NE(report_line(none, "  optimizer state:").find("8 B/param: Adam m and v in FP32 (no ZeRO sharding)"),
            std::string::npos)
      << none;
}
