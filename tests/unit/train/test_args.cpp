// Flag parsing and validation: Megatron names, defaults, and clear errors naming the flag.
#include <gtest/gtest.h>

#include <tuple>

#include "loom/train/args.h"

using namespace loom;

namespace {
std::vector<std::string> base() {
  return {"--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
          "--micro-batch-size", "2", "--train-iters", "5", "--lr", "1e-3", "--mock-data", "--vocab-size", "100"};
}
std::string error_of(std::vector<std::string> args) {
  try {
    parse_train_args(args).validate(1);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Args, ParsesMegatronFlagsAndDefaults) {
  auto a = base();
  a.insert(a.end(), {"--global-batch-size=8", "--lr-decay-style", "cosine", "--clip-grad", "0.5", "--seed", "7"});
  const TrainConfig c = parse_train_args(a);
  EXPECT_EQ(c.model.num_layers, 2);
  EXPECT_EQ(c.model.hidden_size, 64);
  EXPECT_EQ(c.batch.seq_length, 32);
  EXPECT_EQ(c.model.max_position_embeddings, 32);  // defaults to --seq-length
  EXPECT_EQ(*c.batch.global_batch_size, 8);
  EXPECT_EQ(c.num_micro_batches(1), 4);
  EXPECT_EQ(c.optim.lr_decay_style, LRDecayStyle::kCosine);
  EXPECT_DOUBLE_EQ(c.optim.clip_grad, 0.5);
  EXPECT_EQ(c.seed, 7u);
  EXPECT_DOUBLE_EQ(c.optim.weight_decay, 0.01);  // Megatron defaults
  EXPECT_FLOAT_EQ(c.optim.adam.beta2, 0.999f);
  EXPECT_EQ(c.data.make_vocab_size_divisible_by, 128);
  EXPECT_EQ(c.logging.log_interval, 100);
  EXPECT_NO_THROW(c.validate(1));
}

TEST(Args, UnknownFlagSuggestsClosest) {
  auto a = base();
  a.push_back("--hiden-size");
  a.push_back("3");
  const std::string e = error_of(a);
  EXPECT_NE(e.find("unknown flag --hiden-size"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean --hidden-size?"), std::string::npos) << e;
}

TEST(Args, InvalidLayoutsNameTheFlags) {
  auto a = base();
  a.insert(a.end(), {"--global-batch-size", "5"});
  std::string e = error_of(a);
  EXPECT_NE(e.find("--global-batch-size (5) must be divisible by --micro-batch-size (2)"), std::string::npos) << e;
  a = base();
  a[5] = "5";  // --num-attention-heads 5 with hidden 64
  e = error_of(a);
  EXPECT_NE(e.find("--hidden-size (64) must be divisible by --num-attention-heads (5)"), std::string::npos) << e;
  a = base();
  a[1] = "two";
  e = error_of(a);
  EXPECT_NE(e.find("--num-layers: expected an integer, got 'two'"), std::string::npos) << e;
  EXPECT_NE(error_of({"--num-layers"}).find("--num-layers needs a value"), std::string::npos);
  a = base();
  a.erase(a.begin() + 14);  // drop --mock-data
  e = error_of(a);
  EXPECT_NE(e.find("no training data"), std::string::npos) << e;
  a = base();
  a[14] = "--data-path";  // replace --mock-data: a prefix needs a tokenizer
  a.insert(a.begin() + 15, "corpus_text_document");
  e = error_of(a);
  EXPECT_NE(e.find("--tokenizer-type is required"), std::string::npos) << e;
  a = base();
  a.insert(a.end(), {"--lr-warmup-iters", "5"});
  e = error_of(a);
  EXPECT_NE(e.find("--lr-warmup-iters (5) must be smaller than --lr-decay-iters"), std::string::npos) << e;
  a = base();
  a.insert(a.end(), {"--lr-decay-style", "cosin"});
  EXPECT_NE(error_of(a).find("--lr-decay-style"), std::string::npos);
}

TEST(Args, DataPathTakesSeveralValues) {
  auto a = base();
  a.erase(a.begin() + 14);
  a.insert(a.end(), {"--data-path", "0.3", "a_text_document", "0.7", "b_text_document", "--split", "98,2,0",
                     "--tokenizer-type", "NullTokenizer", "--eod-mask-loss"});
  const TrainConfig c = parse_train_args(a);
  EXPECT_EQ(c.data.data_path, (std::vector<std::string>{"0.3", "a_text_document", "0.7", "b_text_document"}));
  EXPECT_EQ(c.data.split, "98,2,0");
  EXPECT_TRUE(c.data.eod_mask_loss);
  EXPECT_EQ(c.data.tokenizer.type, "NullTokenizer");
  EXPECT_EQ(*c.data.tokenizer.vocab_size, 100);
  EXPECT_NE(error_of({"--data-path", "--split", "1"}).find("--data-path needs at least one value"), std::string::npos);
}

TEST(Args, VocabPaddingIsMegatrons) {
  EXPECT_EQ(padded_vocab_size(50257, 128, 1), 50304);
  EXPECT_EQ(padded_vocab_size(256, 128, 1), 256);
  EXPECT_EQ(padded_vocab_size(97, 128, 1), 128);
  EXPECT_EQ(padded_vocab_size(50257, 128, 2), 50432);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
}

TEST(TrainArgs, RepeatedMultiValueFlagKeepsTheLastOccurrence) {
  // argparse (Megatron's parser) stores the values of the last occurrence of a flag.
  const TrainConfig c = parse_train_args({"--data-path", "a", "b", "--seq-length", "8", "--data-path", "c"});
  ASSERT_EQ(c.data.data_path.size(), 1u);
  EXPECT_EQ(c.data.data_path[0], "c");
}

// Megatron launch scripts' spellings: the legacy recomputation / scheduler names set what the current ones
// set; --data-impl, --distributed-backend and --transformer-impl accept Megatron's values and name the
// valid ones otherwise; kernel-choice flags are recorded (the run logs them once).
TEST(Args, MegatronScriptSpellings) {
  auto legacy = base();
  legacy.insert(legacy.end(), {"--checkpoint-activations", "--activations-checkpoint-method", "block",
                               "--checkpoint-num-layers", "2", "--override-lr-scheduler", "--data-impl", "mmap",
                               "--distributed-backend", "nccl", "--local_rank", "0"});
  auto current = base();
  current.insert(current.end(), {"--recompute-granularity", "full", "--recompute-method", "block",
                                 "--recompute-num-layers", "2", "--override-opt-param-scheduler"});
  const TrainConfig l = parse_train_args(legacy), c = parse_train_args(current);
  EXPECT_EQ(l.recompute.granularity, c.recompute.granularity);
  EXPECT_EQ(l.recompute.method, "block");
  EXPECT_EQ(*l.recompute.num_layers, 2);
  EXPECT_TRUE(l.optim.override_opt_param_scheduler);
  EXPECT_EQ(l.dist.backend, "nccl");
  EXPECT_EQ(*l.dist.local_rank, 0);
  EXPECT_NO_THROW(l.validate(1));
  auto sched = base();
  sched.insert(sched.end(), {"--use-checkpoint-lr-scheduler"});
  EXPECT_TRUE(parse_train_args(sched).optim.use_checkpoint_opt_param_scheduler);
  sched = base();
  sched.insert(sched.end(), {"--use-checkpoint-opt_param-scheduler"});
  EXPECT_TRUE(parse_train_args(sched).optim.use_checkpoint_opt_param_scheduler);

  auto kernels = base();
  kernels.insert(kernels.end(), {"--use-flash-attn", "--no-masked-softmax-fusion", "--transformer-impl",
                                 "transformer_engine", "--use-mcore-models"});
  EXPECT_EQ(parse_train_args(kernels).kernel_choice_flags,
            (std::vector<std::string>{"--use-flash-attn", "--no-masked-softmax-fusion",
                                      "--transformer-impl transformer_engine", "--use-mcore-models"}));
  for (const auto& [flag, value, want] :
       {std::tuple{"--data-impl", "lazy", "--data-impl lazy: Loom reads Megatron's .bin/.idx datasets by memory map "
                                          "only; use --data-impl mmap"},
        std::tuple{"--distributed-backend", "ucc", "--distributed-backend ucc: choose nccl (GPU ranks), gloo or mpi"},
        std::tuple{"--transformer-impl", "apex", "--transformer-impl apex: Megatron's choices are local and "
                                                 "transformer_engine"}}) {
    auto a = base();
    a.insert(a.end(), {flag, value});
    EXPECT_NE(error_of(a).find(want), std::string::npos) << error_of(a);
  }
}

// The expert grid exists (ParallelState) but no model has MoE layers yet: the expert flags parse, their
// defaults pass, and anything that would need experts is refused naming the flags.
TEST(Args, ExpertParallelFlagsNeedNumExperts) {
  auto a = base();
  EXPECT_EQ(parse_train_args(a).parallel.expert_model_parallel_size, 1);
  EXPECT_EQ(parse_train_args(a).parallel.expert_tensor_parallel_size, 0);  // unset: the TP size
  a.insert(a.end(), {"--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1"});
  EXPECT_EQ(error_of(a), "");
  a = base();
  a.insert(a.end(), {"--expert-model-parallel-size", "2"});
  std::string e = error_of(a);
  EXPECT_NE(e.find("--expert-model-parallel-size 2 needs --num-experts"), std::string::npos) << e;
  a = base();
  a.insert(a.end(), {"--expert-tensor-parallel-size", "2"});
  e = error_of(a);
  EXPECT_NE(e.find("--expert-tensor-parallel-size 2 needs --num-experts"), std::string::npos) << e;
  a = base();
  a.insert(a.end(), {"--expert-tensor-parallel-size", "0"});
  EXPECT_NE(error_of(a).find("--expert-tensor-parallel-size must be >= 1, got 0"), std::string::npos);
}
