// Megatron-DeepSpeed's --deepspeed / --deepspeed_config FILE (train/deepspeed_config.h), through
// parse_train_args so that the set of given flags is a real command line's: the Megatron-DeepSpeed template
// config, which value wins where the file and a flag disagree (and the note that says so), DeepSpeed's
// defaults for the fp16 and optimizer sections, ZeRO stage to sharding strategy, the scheduler section,
// every refused key and section (message names the key and the file), unknown keys with the closest known
// one, type and file errors, the DeepSpeed flags without --deepspeed, and DeepSpeed's batch rules
// (resolve_deepspeed_batch).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <optional>

#include "loom/core/check.h"
#include "loom/train/args.h"
#include "train/deepspeed_config.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

// A ds_config.json in the temp directory, removed when it goes out of scope.
class DsConfigFile {
 public:
  explicit DsConfigFile(const std::string& text) {
    static std::atomic<int> count{0};
    path_ = (fs::temp_directory_path() /
             ("loom_ds_config_" + std::to_string(::getpid()) + "_" + std::to_string(count++) + ".json"))
                .string();
    std::ofstream(path_) << text;
  }
  ~DsConfigFile() {
    std::error_code ec;
    fs::remove(path_, ec);
  }
  DsConfigFile(const DsConfigFile&) = delete;
  DsConfigFile& operator=(const DsConfigFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A minimal valid Megatron command line.
Args base_flags() {
  return {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"};
}

// parse_train_args with --deepspeed --deepspeed_config FILE, then `extra` (a repeated flag: the last wins).
TrainConfig parse_ds(const DsConfigFile& f, const Args& extra = {}) {
  Args a = base_flags();
  a.insert(a.end(), {"--deepspeed", "--deepspeed_config", f.path()});
  a.insert(a.end(), extra.begin(), extra.end());
  return parse_train_args(a);
}

template <typename F>
std::string user_error_of(F&& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no UserError)";
}

std::string ds_error(const DsConfigFile& f, const Args& extra = {}) {
  return user_error_of([&] { parse_ds(f, extra); });
}

std::string notes_of(const TrainConfig& c) {
  std::string s;
  for (const std::string& n : c.deepspeed.notes) s += n + "\n";
  return s;
}

// Every part occurs in `text`.
void expect_has(const std::string& text, std::initializer_list<std::string> parts) {
  for (const std::string& p : parts) EXPECT_NE(text.find(p), std::string::npos) << "no '" << p << "' in:\n" << text;
}

constexpr const char* kTemplate = R"({
  "train_batch_size": 16,
  "train_micro_batch_size_per_gpu": 2,
  "steps_per_print": 5,
  "zero_optimization": {"stage": 1},
  "gradient_clipping": 1.0,
  "prescale_gradients": false,
  "fp16": {"enabled": true, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
           "initial_scale_power": 11},
  "wall_clock_breakdown": false
})";

TEST(DeepSpeedConfig, MegatronDeepSpeedTemplate) {
  DsConfigFile f(kTemplate);
  TrainConfig c = parse_ds(f, {"--fp16"});
  EXPECT_TRUE(c.deepspeed.enabled);
  EXPECT_EQ(c.deepspeed.config_path, f.path());
  EXPECT_TRUE(c.precision.fp16);
  EXPECT_FALSE(c.precision.bf16);
  EXPECT_FALSE(c.precision.loss_scale.has_value());  // loss_scale 0: dynamic
  EXPECT_DOUBLE_EQ(c.precision.initial_loss_scale, 2048.0);  // 2^11, not the flag default 2^32
  EXPECT_EQ(c.precision.loss_scale_window, 500);
  EXPECT_EQ(c.precision.hysteresis, 2);
  EXPECT_DOUBLE_EQ(c.precision.min_loss_scale, 1.0);
  EXPECT_EQ(c.dist.sharding_strategy, "optim");
  EXPECT_FALSE(c.dist.use_distributed_optimizer);
  EXPECT_DOUBLE_EQ(c.optim.clip_grad, 1.0);
  EXPECT_EQ(c.logging.log_interval, 5);  // steps_per_print, --log-interval not given
  EXPECT_EQ(c.logging.timing_log_level, 0);
  EXPECT_FALSE(c.optim.deepspeed_schedule.enabled());

  resolve_deepspeed_batch(c, 2);
  EXPECT_EQ(c.batch.micro_batch_size, 2);
  ASSERT_TRUE(c.batch.global_batch_size.has_value());
  EXPECT_EQ(*c.batch.global_batch_size, 16);
  EXPECT_EQ(c.num_micro_batches(2), 4);  // gradient accumulation 16 / (2 x 2)

  const TrainConfig l = parse_ds(f, {"--fp16", "--log-interval", "10"});
  EXPECT_EQ(l.logging.log_interval, 10);
  expect_has(notes_of(l), {"--log-interval 10 wins over steps_per_print = 5"});
}

TEST(DeepSpeedConfig, OptimizerSectionWinsOverFlags) {
  DsConfigFile f(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.95], "eps": 1e-6,
                                                               "weight_decay": 0.05}}})");
  const TrainConfig c = parse_ds(f, {"--lr", "5e-4"});
  EXPECT_EQ(c.optim.optimizer, OptimizerKind::kAdam);
  EXPECT_DOUBLE_EQ(c.optim.lr, 1e-3);
  EXPECT_FLOAT_EQ(c.optim.adam.beta1, 0.8f);
  EXPECT_FLOAT_EQ(c.optim.adam.beta2, 0.95f);
  EXPECT_FLOAT_EQ(c.optim.adam.eps, 1e-6f);
  EXPECT_DOUBLE_EQ(c.optim.weight_decay, 0.05);
  expect_has(notes_of(c), {"optimizer.params.lr = ", "wins over --lr"});

  // No params: DeepSpeed's Adam defaults, not the flags'.
  DsConfigFile bare(R"({"optimizer": {"type": "AdamW"}})");
  const TrainConfig d = parse_ds(bare, {"--lr", "5e-4", "--weight-decay", "0.1", "--adam-beta1", "0.7", "--adam-eps", "1e-5"});
  EXPECT_DOUBLE_EQ(d.optim.lr, 1e-3);
  EXPECT_DOUBLE_EQ(d.optim.weight_decay, 0.0);
  EXPECT_FLOAT_EQ(d.optim.adam.beta1, 0.9f);
  EXPECT_FLOAT_EQ(d.optim.adam.beta2, 0.999f);
  EXPECT_FLOAT_EQ(d.optim.adam.eps, 1e-8f);

  for (const char* type : {"adam", "Adam", "adamw"}) {
    DsConfigFile t(std::string(R"({"optimizer": {"type": ")") + type + R"("}})");
    EXPECT_EQ(ds_error(t), "(no UserError)") << type;
  }
}

TEST(DeepSpeedConfig, Fp16SectionDefaultsAreDeepSpeeds) {
  DsConfigFile f(R"({"fp16": {"enabled": true}})");
  const TrainConfig c = parse_ds(f, {"--initial-loss-scale", "1024", "--loss-scale-window", "200", "--hysteresis",
                                     "5", "--min-loss-scale", "4"});
  EXPECT_TRUE(c.precision.fp16);  // the section alone turns fp16 on
  EXPECT_FALSE(c.precision.loss_scale.has_value());
  EXPECT_DOUBLE_EQ(c.precision.initial_loss_scale, 65536.0);
  EXPECT_EQ(c.precision.loss_scale_window, 1000);
  EXPECT_EQ(c.precision.hysteresis, 2);
  EXPECT_DOUBLE_EQ(c.precision.min_loss_scale, 1.0);
  expect_has(notes_of(c), {"fp16.enabled turns on --fp16", "wins over --loss-scale-window 200"});

  // A dynamic file scale wins over a static --loss-scale.
  const TrainConfig d = parse_ds(f, {"--fp16", "--loss-scale", "64"});
  EXPECT_FALSE(d.precision.loss_scale.has_value());
  expect_has(notes_of(d), {"fp16.loss_scale = 0 (dynamic) wins over --loss-scale 64"});

  DsConfigFile s(R"({"fp16": {"enabled": true, "loss_scale": 128}})");
  const TrainConfig st = parse_ds(s, {"--fp16"});
  ASSERT_TRUE(st.precision.loss_scale.has_value());
  EXPECT_DOUBLE_EQ(*st.precision.loss_scale, 128.0);
}

TEST(DeepSpeedConfig, PrecisionMustAgreeWithTheFlags) {
  DsConfigFile none(R"({})");
  expect_has(ds_error(none, {"--fp16"}), {none.path(), "\"fp16\"", "--fp16"});
  DsConfigFile off(R"({"fp16": {"enabled": false}})");
  expect_has(ds_error(off, {"--fp16"}), {off.path(), "\"fp16\""});
  DsConfigFile fp16(R"({"fp16": {"enabled": true}})");
  expect_has(ds_error(fp16, {"--bf16"}), {fp16.path(), "\"fp16.enabled\"", "--bf16"});  // names the conflicting key
  DsConfigFile both(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})");
  expect_has(ds_error(both), {both.path(), "\"bf16.enabled\"", "cannot both be enabled"});

  DsConfigFile bf16(R"({"bf16": {"enabled": true}})");
  const TrainConfig c = parse_ds(bf16);
  EXPECT_TRUE(c.precision.bf16);
  EXPECT_FALSE(c.precision.fp16);
  EXPECT_TRUE(parse_ds(bf16, {"--bf16"}).precision.bf16);
}

TEST(DeepSpeedConfig, NoGradientClippingMeansNone) {
  DsConfigFile f(R"({})");
  const TrainConfig c = parse_ds(f);
  EXPECT_DOUBLE_EQ(c.optim.clip_grad, 0.0);  // the flag default 1.0 yields to DeepSpeed's 0
  EXPECT_EQ(notes_of(c).find("wins over --clip-grad"), std::string::npos) << notes_of(c);
  const TrainConfig g = parse_ds(f, {"--clip-grad", "1.0"});
  EXPECT_DOUBLE_EQ(g.optim.clip_grad, 0.0);
  expect_has(notes_of(g), {"no gradient_clipping", "wins over --clip-grad 1"});
}

TEST(DeepSpeedConfig, ZeroStageMapsToShardingStrategy) {
  const char* want[] = {"no_shard", "optim", "optim_grads", "optim_grads_params"};
  for (int s = 0; s < 4; ++s) {
    DsConfigFile f(R"({"zero_optimization": {"stage": )" + std::to_string(s) + "}}");
    const TrainConfig c = parse_ds(f);
    EXPECT_EQ(c.dist.sharding_strategy, want[s]) << "stage " << s;
    EXPECT_FALSE(c.dist.use_distributed_optimizer);
  }
  DsConfigFile one(R"({"zero_optimization": {"stage": 1}})");
  const TrainConfig c = parse_ds(one, {"--zero-stage", "2"});
  EXPECT_EQ(c.dist.sharding_strategy, "optim");
  expect_has(notes_of(c), {"wins over --zero-stage 2"});
  EXPECT_EQ(parse_ds(one, {"--use-distributed-optimizer"}).dist.sharding_strategy, "optim");  // they agree

  DsConfigFile none(R"({})");
  EXPECT_EQ(parse_ds(none, {"--zero-stage", "3"}).dist.sharding_strategy, "optim_grads_params");
  EXPECT_EQ(parse_ds(none).dist.sharding_strategy, "no_shard");  // DeepSpeed's default stage 0

  DsConfigFile two(R"({"zero_optimization": {"stage": 2}})");
  expect_has(ds_error(two, {"--use-distributed-optimizer"}), {two.path(), "\"zero_optimization.stage\""});
}

TEST(DeepSpeedConfig, ZeroBucketsAndOverlap) {
  DsConfigFile f(R"({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                                           "overlap_comm": true, "contiguous_gradients": true}})");
  const TrainConfig c = parse_ds(f);
  EXPECT_EQ(c.dist.ddp_bucket_size, 500000000);
  EXPECT_TRUE(c.dist.overlap_grad_reduce);
  EXPECT_EQ(c.dist.sharding_strategy, "optim_grads");

  DsConfigFile differ(R"({"zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8}})");
  expect_has(ds_error(differ), {differ.path(), "\"zero_optimization.allgather_bucket_size\""});
}

TEST(DeepSpeedConfig, SchedulerSections) {
  using T = DeepSpeedScheduleType;
  DsConfigFile w(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3,
                                   "warmup_num_steps": 50, "warmup_type": "linear", "last_batch_iteration": -1}}})");
  const DeepSpeedSchedule a = parse_ds(w).optim.deepspeed_schedule;
  EXPECT_EQ(a.type, T::kWarmupLR);
  EXPECT_DOUBLE_EQ(a.warmup_min_lr, 1e-4);
  EXPECT_DOUBLE_EQ(a.warmup_max_lr, 2e-3);
  EXPECT_EQ(a.warmup_num_steps, 50);
  EXPECT_FALSE(a.log_warmup);

  DsConfigFile d(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 3e-3,
                                   "warmup_num_steps": 10, "total_num_steps": 100}}})");
  const TrainConfig dc = parse_ds(d, {"--lr-decay-style", "cosine"});
  const DeepSpeedSchedule b = dc.optim.deepspeed_schedule;
  EXPECT_EQ(b.type, T::kWarmupDecayLR);
  EXPECT_DOUBLE_EQ(b.warmup_max_lr, 3e-3);
  EXPECT_EQ(b.warmup_num_steps, 10);
  EXPECT_EQ(b.total_num_steps, 100);
  EXPECT_TRUE(b.log_warmup);  // DeepSpeed's default warmup_type "log"
  expect_has(notes_of(dc), {"wins over --lr-decay-style"});

  DsConfigFile cs(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 200,
                                    "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_num_steps": 20}}})");
  const DeepSpeedSchedule k = parse_ds(cs).optim.deepspeed_schedule;
  EXPECT_EQ(k.type, T::kWarmupCosineLR);
  EXPECT_EQ(k.total_num_steps, 200);
  EXPECT_DOUBLE_EQ(k.warmup_min_ratio, 0.1);
  EXPECT_DOUBLE_EQ(k.cos_min_ratio, 0.01);
  EXPECT_EQ(k.warmup_num_steps, 20);
}

TEST(DeepSpeedConfig, SchedulerErrorsNameTheKey) {
  const std::pair<const char*, std::vector<std::string>> cases[] = {
      {R"({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}})",
       {"\"scheduler.params.total_num_steps\"", "required by WarmupDecayLR"}},
      {R"({"type": "OneCycle", "params": {}})", {"\"scheduler.type\"", "OneCycle"}},
      {R"({"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}})",
       {"\"scheduler.params.cos_min_ratio\"", "not a parameter of WarmupLR"}},
      {R"({"type": "WarmupLR", "params": {"warmup_type": "exp"}})", {"\"scheduler.params.warmup_type\"", "exp"}},
      {R"({"type": "WarmupLR", "params": {"last_batch_iteration": 5}})", {"\"scheduler.params.last_batch_iteration\""}},
  };
  for (const auto& [section, parts] : cases) {
    DsConfigFile f(std::string(R"({"scheduler": )") + section + "}");
    const std::string e = ds_error(f);
    expect_has(e, {f.path()});
    for (const std::string& p : parts) EXPECT_NE(e.find(p), std::string::npos) << section << "\n" << e;
  }
}

// Keys Loom cannot honour: the message names the key and the file and says "not supported".
struct Refused {
  std::string json, key;
};

std::vector<Refused> refused_cases() {
  std::vector<Refused> v = {
      {R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})", "zero_optimization.offload_optimizer"},
      {R"({"zero_optimization": {"offload_param": {"device": "nvme"}}})", "zero_optimization.offload_param"},
      {R"({"zero_optimization": {"cpu_offload": true}})", "zero_optimization.cpu_offload"},
      {R"({"zero_optimization": {"cpu_offload_params": true}})", "zero_optimization.cpu_offload_params"},
      {R"({"activation_checkpointing": {"cpu_checkpointing": true}})", "activation_checkpointing.cpu_checkpointing"},
      {R"({"fp16": {"enabled": true, "consecutive_hysteresis": true}})", "fp16.consecutive_hysteresis"},
      {R"({"fp16": {"enabled": true, "auto_cast": true}})", "fp16.auto_cast"},
      {R"({"fp16": {"enabled": true, "fp16_master_weights_and_grads": true}})", "fp16.fp16_master_weights_and_grads"},
      {R"({"prescale_gradients": true})", "prescale_gradients"},
      {R"({"gradient_predivide_factor": 2.0})", "gradient_predivide_factor"},
      {R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})", "optimizer.params.adam_w_mode"},
      {R"({"optimizer": {"type": "Adam", "params": {"bias_correction": false}}})", "optimizer.params.bias_correction"},
      {R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})", "optimizer.params.amsgrad"},
      {R"({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})", "optimizer.type"},
  };
  for (const char* s : {"amp", "aio", "compression_training", "data_efficiency", "curriculum_learning",
                        "flops_profiler", "tensorboard", "csv_monitor", "comms_logger", "elasticity", "autotuning",
                        "sparse_attention", "pipeline", "checkpoint", "nebula", "moe"})
    v.push_back({"{\"" + std::string(s) + "\": {\"enabled\": true}}", s});
  return v;
}

// The MoE section points at the flags Loom builds mixture-of-experts layers from.
TEST(DeepSpeedConfig, MoeSectionNamesTheMegatronFlags) {
  DsConfigFile f(R"({"moe": {"enabled": true}})");
  expect_has(ds_error(f), {"\"moe\"", "not supported", "--num-experts", "--expert-model-parallel-size"});
}

class DeepSpeedRefusedKey : public ::testing::TestWithParam<Refused> {};

TEST_P(DeepSpeedRefusedKey, NamesKeyAndFile) {
  DsConfigFile f(GetParam().json);
  expect_has(ds_error(f), {"\"" + GetParam().key + "\"", f.path(), "not supported"});
}

INSTANTIATE_TEST_SUITE_P(DeepSpeedConfig, DeepSpeedRefusedKey, ::testing::ValuesIn(refused_cases()),
                         [](const ::testing::TestParamInfo<Refused>& info) {
                           std::string n = info.param.key;
                           for (char& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

TEST(DeepSpeedConfig, RefusedFeaturesSwitchedOffAreAccepted) {
  for (const char* json : {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}})",
                           R"({"zero_optimization": {"offload_param": {"device": "none"}}})",
                           R"({"zero_optimization": {"cpu_offload": false, "cpu_offload_params": false}})",
                           R"({"moe": {"enabled": false}, "amp": {"enabled": false}})",
                           R"({"fp16": {"enabled": true, "auto_cast": false}, "prescale_gradients": false,
                               "gradient_predivide_factor": 1.0})",
                           R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": true, "amsgrad": false}}})"}) {
    DsConfigFile f(json);
    EXPECT_EQ(ds_error(f), "(no UserError)") << json;
  }
}

TEST(DeepSpeedConfig, UnknownKeysSuggestTheClosest) {
  const std::pair<const char*, std::string> cases[] = {
      {R"({"zero_optimisation": {"stage": 1}})", "did you mean \"zero_optimization\""},
      {R"({"zero_optimization": {"stag": 1}})", "did you mean \"zero_optimization.stage\""},
      {R"({"stage": 1})", "did you mean \"zero_optimization.stage\""},
      {R"({"fp16": {"enable": true}})", "did you mean \"fp16.enabled\""},
  };
  for (const auto& [json, hint] : cases) {
    DsConfigFile f(json);
    expect_has(ds_error(f), {"unknown key", hint, f.path()});
  }
}

// A zero batch value is refused when the file is read (it would divide DeepSpeed's batch rules by zero).
TEST(DeepSpeedConfig, ZeroBatchValuesAreErrors) {
  for (const char* k : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}) {
    DsConfigFile f(std::string(R"({"train_batch_size": 32, ")") + k + R"(": 0})");
    expect_has(ds_error(f), {f.path(), std::string("\"") + k + "\"", "has to be greater than 0"});
  }
}

TEST(DeepSpeedConfig, TypeAndFileErrors) {
  DsConfigFile str(R"({"train_batch_size": "16"})");
  expect_has(ds_error(str), {str.path(), "\"train_batch_size\"", "expected an integer"});
  DsConfigFile yes(R"({"fp16": {"enabled": "yes"}})");
  expect_has(ds_error(yes), {yes.path(), "\"fp16.enabled\"", "expected true or false"});
  DsConfigFile bad("{\"train_batch_size\": 16,");
  expect_has(ds_error(bad), {bad.path(), "not valid JSON"});

  const std::string missing = (fs::temp_directory_path() / "loom_ds_config_does_not_exist.json").string();
  Args a = base_flags();
  a.insert(a.end(), {"--deepspeed", "--deepspeed_config", missing});
  expect_has(user_error_of([&] { parse_train_args(a); }), {missing});
}

TEST(DeepSpeedConfig, DeepSpeedFlagsWithoutDeepSpeed) {
  DsConfigFile f(R"({"steps_per_print": 7})");
  Args a = base_flags();
  a.insert(a.end(), {"--deepspeed_config", f.path()});
  expect_has(user_error_of([&] { parse_train_args(a); }), {f.path(), "add --deepspeed"});

  a = base_flags();
  a.push_back("--deepspeed");
  expect_has(user_error_of([&] { parse_train_args(a); }), {"--deepspeed_config"});

  a = base_flags();
  a.insert(a.end(), {"--zero-stage", "1"});
  const TrainConfig z = parse_train_args(a);
  EXPECT_EQ(z.dist.sharding_strategy, "");  // no ZeRO without --deepspeed
  expect_has(notes_of(z), {"--zero-stage 1", "no effect without --deepspeed"});

  a = base_flags();
  a.push_back("--checkpoint-in-cpu");
  expect_has(user_error_of([&] { parse_train_args(a); }), {"--checkpoint-in-cpu"});

  a = base_flags();
  a.insert(a.end(), {"--deepspeed", "--deepspeed-config", f.path()});
  const TrainConfig h = parse_train_args(a);
  EXPECT_EQ(h.deepspeed.config_path, f.path());
  EXPECT_EQ(h.logging.log_interval, 7);  // the file was read
}

// resolve_deepspeed_batch on a config whose file gave these batch keys.
TrainConfig with_batch(std::optional<int64_t> tb, std::optional<int64_t> mb, std::optional<int64_t> gas) {
  TrainConfig c;
  c.deepspeed.enabled = true;
  c.deepspeed.config_path = "x.json";
  c.deepspeed.train_batch_size = tb;
  c.deepspeed.micro_batch_size = mb;
  c.deepspeed.gradient_accumulation_steps = gas;
  c.batch.micro_batch_size = 1;
  return c;
}

TEST(DeepSpeedConfig, BatchRulesDeriveTheMissingValue) {
  const std::nullopt_t no = std::nullopt;
  struct Case {
    std::optional<int64_t> tb, mb, gas;
    int dp;
    int64_t micro, global;
  };
  for (const Case& k : {Case{32, 2, no, 4, 2, 32}, Case{32, no, 2, 4, 4, 32}, Case{no, 2, 3, 2, 2, 12},
                        Case{8, no, no, 2, 4, 8}, Case{no, 3, no, 2, 3, 6}, Case{32, 2, 4, 4, 2, 32}}) {
    TrainConfig c = with_batch(k.tb, k.mb, k.gas);
    resolve_deepspeed_batch(c, k.dp);
    EXPECT_EQ(c.batch.micro_batch_size, k.micro) << k.tb.value_or(-1) << " " << k.mb.value_or(-1) << " " << k.gas.value_or(-1);
    ASSERT_TRUE(c.batch.global_batch_size.has_value());
    EXPECT_EQ(*c.batch.global_batch_size, k.global);
  }
  TrainConfig c = with_batch(32, 2, no);
  resolve_deepspeed_batch(c, 4);
  EXPECT_EQ(c.num_micro_batches(4), 4);  // gradient accumulation 32 / 2 / 4
}

TEST(DeepSpeedConfig, BatchRulesRejectInconsistentValues) {
  TrainConfig c = with_batch(32, 2, 3);
  expect_has(user_error_of([&] { resolve_deepspeed_batch(c, 4); }),
             {"x.json", "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size",
              "32 != 2 * 3 * 4"});
  TrainConfig small = with_batch(2, std::nullopt, std::nullopt);
  expect_has(user_error_of([&] { resolve_deepspeed_batch(small, 4); }), {"x.json", "has to be greater than 0"});
}

TEST(DeepSpeedConfig, FileBatchWinsOverGlobalBatchFlag) {
  TrainConfig c = with_batch(32, 2, std::nullopt);
  c.deepspeed.global_batch_flag_given = true;
  c.batch.global_batch_size = 64;
  resolve_deepspeed_batch(c, 4);
  ASSERT_TRUE(c.batch.global_batch_size.has_value());
  EXPECT_EQ(*c.batch.global_batch_size, 32);
  expect_has(notes_of(c), {"wins over --global-batch-size 64"});
}

TEST(DeepSpeedConfig, NoBatchKeysLeaveTheFlags) {
  TrainConfig c = with_batch(std::nullopt, std::nullopt, std::nullopt);
  c.batch.micro_batch_size = 5;
  resolve_deepspeed_batch(c, 2);
  EXPECT_EQ(c.batch.micro_batch_size, 5);
  EXPECT_FALSE(c.batch.global_batch_size.has_value());
  ASSERT_EQ(c.deepspeed.notes.size(), 1u);
  expect_has(c.deepspeed.notes[0], {"x.json", "no batch keys"});

  TrainConfig off = with_batch(32, 2, 3);  // without --deepspeed: nothing to resolve, even inconsistent keys
  off.deepspeed.enabled = false;
  EXPECT_NO_THROW(resolve_deepspeed_batch(off, 4));
  EXPECT_EQ(off.batch.micro_batch_size, 1);
}

TEST(DeepSpeedConfig, WallClockBreakdownAndWandb) {
  DsConfigFile f(R"({"wall_clock_breakdown": true, "wandb": {"enabled": true, "project": "p"}})");
  const TrainConfig c = parse_ds(f);
  EXPECT_EQ(c.logging.timing_log_level, 2);
  expect_has(notes_of(c), {"WARNING", "wandb.enabled"});
  const TrainConfig t = parse_ds(f, {"--timing-log-level", "1"});
  EXPECT_EQ(t.logging.timing_log_level, 1);
  expect_has(notes_of(t), {"--timing-log-level 1 wins over wall_clock_breakdown"});
}

}  // namespace
}  // namespace loom
