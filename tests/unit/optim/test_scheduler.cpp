// OptimizerParamScheduler: lr / wd values against an independent Python re-implementation of Megatron's
// formulas (tests/golden/lr_schedule_reference.py, to 4 ULP) and a hand-computed table;
// Megatron's constructor checks; checkpoint state round trip and the override / use-checkpoint /
// mismatch rules of load_state_dict.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "loom/optim/scheduler.h"

using namespace loom;

namespace {

// Expects `fn` to throw a UserError whose message contains every one of `needles`.
template <typename F>
void expect_user_error(F fn, std::initializer_list<const char*> needles) {
  try {
    fn();
    ADD_FAILURE() << "no UserError thrown";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// Runs the Python reference for cfg at `steps`; returns (lr, wd) pairs.
std::vector<std::pair<double, double>> python_reference(const SchedulerConfig& c, const std::vector<int64_t>& steps) {
  std::ostringstream cmd;
  cmd << "/usr/bin/python3 " << LOOM_SOURCE_DIR << "/tests/golden/lr_schedule_reference.py"
      << " --init-lr " << num(c.init_lr) << " --max-lr " << num(c.max_lr) << " --min-lr " << num(c.min_lr)
      << " --warmup " << c.lr_warmup_steps << " --decay " << c.lr_decay_steps << " --style "
      << lr_decay_style_name(c.lr_decay_style) << " --wsd " << c.wsd_decay_steps << " --wsd-style "
      << wsd_decay_style_name(c.lr_wsd_decay_style) << " --start-wd " << num(c.start_wd) << " --end-wd "
      << num(c.end_wd) << " --wd-steps " << c.wd_incr_steps << " --wd-style " << wd_incr_style_name(c.wd_incr_style)
      << " --steps ";
  for (size_t i = 0; i < steps.size(); ++i) cmd << (i ? "," : "") << steps[i];
  FILE* p = popen(cmd.str().c_str(), "r");
  EXPECT_NE(p, nullptr);
  std::vector<std::pair<double, double>> out;
  if (!p) return out;
  char line[256];
  while (std::fgets(line, sizeof line, p)) {
    char* end = nullptr;
    const double lr = std::strtod(line, &end);
    const double wd = std::strtod(end, nullptr);
    out.emplace_back(lr, wd);
  }
  EXPECT_EQ(pclose(p), 0) << cmd.str();
  return out;
}

SchedulerConfig base(LRDecayStyle style, int64_t warmup, int64_t decay) {
  SchedulerConfig c;
  c.max_lr = 1e-3;
  c.min_lr = 1e-5;
  c.lr_warmup_steps = warmup;
  c.lr_decay_steps = decay;
  c.lr_decay_style = style;
  return c;
}

}  // namespace

TEST(Scheduler, MatchesPythonReferenceForEveryStyle) {
  if (access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "/usr/bin/python3 not found";
  std::vector<SchedulerConfig> cases;
  {  // linear with warmup from --lr-warmup-init, linear wd increment
    SchedulerConfig c = base(LRDecayStyle::kLinear, 8, 40);
    c.init_lr = 1e-4;
    c.max_lr = 3e-3;
    c.min_lr = 3e-4;
    c.start_wd = 0.01, c.end_wd = 0.1, c.wd_incr_steps = 40, c.wd_incr_style = WDIncrStyle::kLinear;
    cases.push_back(c);
  }
  {  // cosine, cosine wd that ends before the lr decay
    SchedulerConfig c = base(LRDecayStyle::kCosine, 9, 30);
    c.start_wd = 0.0, c.end_wd = 0.1, c.wd_incr_steps = 25, c.wd_incr_style = WDIncrStyle::kCosine;
    cases.push_back(c);
  }
  {  // constant after warmup, constant wd
    SchedulerConfig c = base(LRDecayStyle::kConstant, 5, 20);
    c.init_lr = 2e-4;
    c.start_wd = c.end_wd = 0.1, c.wd_incr_steps = 20;
    cases.push_back(c);
  }
  {  // linear without warmup
    cases.push_back(base(LRDecayStyle::kLinear, 0, 17));
  }
  {  // inverse-square-root; min_lr floor reached before the decay ends
    SchedulerConfig c = base(LRDecayStyle::kInverseSquareRoot, 4, 50);
    c.max_lr = 1e-2;
    c.min_lr = 3e-3;
    cases.push_back(c);
    c.lr_warmup_steps = 0;  // max(warmup, 1) and max(num_steps, 1)
    c.min_lr = 0.0;
    cases.push_back(c);
  }
  for (WSDDecayStyle ws : {WSDDecayStyle::kLinear, WSDDecayStyle::kCosine, WSDDecayStyle::kExponential,
                           WSDDecayStyle::kMinusSqrt}) {
    SchedulerConfig c = base(LRDecayStyle::kWSD, 6, 40);
    c.wsd_decay_steps = 12;
    c.lr_wsd_decay_style = ws;
    cases.push_back(c);
    c.lr_warmup_steps = 0;  // anneal over the whole decay
    c.wsd_decay_steps = 40;
    cases.push_back(c);
  }

  for (const SchedulerConfig& c : cases) {
    const int64_t last = std::max(c.lr_decay_steps, c.wd_incr_steps) + 3;
    std::vector<int64_t> steps;
    for (int64_t n = 0; n <= last; ++n) steps.push_back(n);
    const auto ref = python_reference(c, steps);
    ASSERT_EQ(ref.size(), steps.size());
    const std::string what = std::string(lr_decay_style_name(c.lr_decay_style)) + "/" +
                             wsd_decay_style_name(c.lr_wsd_decay_style) + " warmup " +
                             std::to_string(c.lr_warmup_steps);
    // Driven the way the trainer drives it: step(increment) from 0, one sample at a time.
    OptimizerParamScheduler s(c);
    for (size_t i = 0; i < steps.size(); ++i) {
      if (i > 0) s.step(1);
      ASSERT_EQ(s.num_steps(), steps[i]);
      // Within 4 ULP, not bit-exact: -march=native lets the compiler fuse min + coeff · delta into an FMA.
      EXPECT_DOUBLE_EQ(s.lr(), ref[i].first) << what << " lr at " << steps[i];
      EXPECT_DOUBLE_EQ(s.wd(), ref[i].second) << what << " wd at " << steps[i];
    }
  }
}

TEST(Scheduler, HandComputedTable) {
  SchedulerConfig c = base(LRDecayStyle::kLinear, 10, 30);
  c.init_lr = 1e-4;
  OptimizerParamScheduler lin(c);
  EXPECT_DOUBLE_EQ(lin.lr_at(0), 1e-4);             // warmup starts at --lr-warmup-init
  EXPECT_DOUBLE_EQ(lin.lr_at(5), 1e-4 + 9e-4 / 2);  // halfway up
  EXPECT_EQ(lin.lr_at(10), 1e-3);                   // num_steps == warmup: the peak exactly
  EXPECT_DOUBLE_EQ(lin.lr_at(20), 1e-5 + 0.5 * (1e-3 - 1e-5));
  EXPECT_EQ(lin.lr_at(30), 1e-5);                   // num_steps == decay: coeff 0
  EXPECT_EQ(lin.lr_at(31), 1e-5);                   // past the decay: min_lr

  c.lr_decay_style = LRDecayStyle::kCosine;
  OptimizerParamScheduler cos(c);
  EXPECT_DOUBLE_EQ(cos.lr_at(20), 1e-5 + 0.5 * (1e-3 - 1e-5));
  EXPECT_DOUBLE_EQ(cos.lr_at(15), 1e-5 + 0.5 * (std::sqrt(0.5) + 1) * (1e-3 - 1e-5));
  EXPECT_EQ(cos.lr_at(30), 1e-5);

  c.lr_decay_style = LRDecayStyle::kConstant;
  OptimizerParamScheduler con(c);
  EXPECT_EQ(con.lr_at(500), 1e-3);  // constant ignores min_lr and the decay end

  SchedulerConfig isr = base(LRDecayStyle::kInverseSquareRoot, 4, 100);
  OptimizerParamScheduler inv(isr);
  EXPECT_DOUBLE_EQ(inv.lr_at(16), 1e-3 * 2 / 4);  // max · sqrt(4) / sqrt(16)
  EXPECT_DOUBLE_EQ(inv.lr_at(100), 1e-3 * 2 / 10);
  EXPECT_EQ(inv.lr_at(101), 1e-5);

  // WSD: 40-sample decay, the last 20 anneal; r = 0.5 at 30, r = 0.25 at 25.
  SchedulerConfig w = base(LRDecayStyle::kWSD, 0, 40);
  w.min_lr = 0.0;
  w.wsd_decay_steps = 20;
  const struct {
    WSDDecayStyle style;
    int64_t n;
    double coeff;
  } wsd[] = {{WSDDecayStyle::kLinear, 25, 0.75},
             {WSDDecayStyle::kCosine, 30, 0.5},
             {WSDDecayStyle::kExponential, 30, std::sqrt(2.0) - 1.0},  // 2 · 0.5^0.5 - 1
             {WSDDecayStyle::kExponential, 40, 0.0},
             {WSDDecayStyle::kMinusSqrt, 25, 0.5},
             {WSDDecayStyle::kMinusSqrt, 20, 1.0}};  // anneal start: still stable
  for (const auto& t : wsd) {
    w.lr_wsd_decay_style = t.style;
    OptimizerParamScheduler s(w);
    EXPECT_EQ(s.lr_at(5), 1e-3) << "stable phase";
    EXPECT_NEAR(s.lr_at(t.n), t.coeff * 1e-3, 1e-18) << wsd_decay_style_name(t.style) << " at " << t.n;
  }

  SchedulerConfig wd = base(LRDecayStyle::kLinear, 0, 10);
  wd.start_wd = 0.0;
  wd.end_wd = 0.2;
  wd.wd_incr_steps = 100;
  wd.wd_incr_style = WDIncrStyle::kLinear;
  OptimizerParamScheduler wl(wd);
  EXPECT_EQ(wl.wd(), 0.0);
  EXPECT_DOUBLE_EQ(wl.wd_at(25), 0.05);
  EXPECT_DOUBLE_EQ(wl.wd_at(100), 0.2);
  EXPECT_EQ(wl.wd_at(101), 0.2);
  wd.wd_incr_style = WDIncrStyle::kCosine;
  OptimizerParamScheduler wc(wd);
  EXPECT_NEAR(wc.wd_at(0), 0.0, 1e-17);
  EXPECT_DOUBLE_EQ(wc.wd_at(50), 0.1);
  EXPECT_DOUBLE_EQ(wc.wd_at(25), 0.2 * 0.5 * (1 - std::sqrt(0.5)));  // slow start: cos(0.75 pi)
}

TEST(Scheduler, StepAccumulatesSamples) {
  OptimizerParamScheduler s(base(LRDecayStyle::kLinear, 8, 64));
  EXPECT_EQ(s.num_steps(), 0);
  EXPECT_EQ(s.lr(), 0.0);  // iteration 1 with warmup trains at init_lr (Megatron)
  s.step(8);               // one iteration of global batch 8 = the whole warmup
  EXPECT_EQ(s.num_steps(), 8);
  EXPECT_EQ(s.lr(), 1e-3);
  s.step(0);
  EXPECT_EQ(s.num_steps(), 8);
}

TEST(Scheduler, ConstructorChecksNameMegatronFlags) {
  auto make = [](SchedulerConfig c) { return [c] { OptimizerParamScheduler s(c); }; };
  SchedulerConfig c = base(LRDecayStyle::kCosine, 10, 100);
  {
    SchedulerConfig b = c;
    b.min_lr = 2e-3;
    expect_user_error(make(b), {"--lr", "--min-lr"});
    b = c;
    b.min_lr = -1;
    expect_user_error(make(b), {"--min-lr"});
    b = c;
    b.init_lr = 2e-3;
    expect_user_error(make(b), {"--lr-warmup-init"});
    b = c;
    b.lr_decay_steps = 0;
    expect_user_error(make(b), {"--lr-decay-iters"});
    b = c;
    b.lr_warmup_steps = 100;  // warmup must be strictly shorter than the decay
    expect_user_error(make(b), {"--lr-warmup-iters", "--lr-warmup-fraction", "100"});
    b.lr_decay_style = LRDecayStyle::kConstant;  // Megatron asserts it for every style
    expect_user_error(make(b), {"--lr-warmup-iters"});
    b = c;
    b.lr_decay_style = LRDecayStyle::kWSD;  // no annealing phase given
    expect_user_error(make(b), {"--lr-wsd-decay-iters"});
    b.wsd_decay_steps = 101;
    expect_user_error(make(b), {"--lr-wsd-decay-iters"});
    b.wsd_decay_steps = 100;
    EXPECT_NO_THROW(make(b)());
    b = c;
    b.start_wd = 0.1;  // constant style with different start and end
    b.end_wd = 0.2;
    expect_user_error(make(b), {"--weight-decay-incr-style constant", "--start-weight-decay", "--end-weight-decay"});
    b.wd_incr_style = WDIncrStyle::kLinear;  // end < start
    b.wd_incr_steps = 10;
    b.end_wd = 0.05;
    expect_user_error(make(b), {"--end-weight-decay", "--start-weight-decay"});
    b.end_wd = 0.2;
    b.wd_incr_steps = 0;
    expect_user_error(make(b), {"--weight-decay-incr-style", "--train-iters"});
    b = c;
    b.override_opt_param_scheduler = b.use_checkpoint_opt_param_scheduler = true;
    expect_user_error(make(b), {"--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"});
  }
  EXPECT_NO_THROW(make(c)());
}

TEST(Scheduler, StyleNamesRoundTrip) {
  for (auto s : {LRDecayStyle::kConstant, LRDecayStyle::kLinear, LRDecayStyle::kCosine,
                 LRDecayStyle::kInverseSquareRoot, LRDecayStyle::kWSD})
    EXPECT_EQ(parse_lr_decay_style(lr_decay_style_name(s)), s);
  EXPECT_STREQ(lr_decay_style_name(LRDecayStyle::kInverseSquareRoot), "inverse-square-root");
  EXPECT_STREQ(lr_decay_style_name(LRDecayStyle::kWSD), "WSD");
  for (auto s : {WSDDecayStyle::kLinear, WSDDecayStyle::kCosine, WSDDecayStyle::kExponential,
                 WSDDecayStyle::kMinusSqrt})
    EXPECT_EQ(parse_wsd_decay_style(wsd_decay_style_name(s)), s);
  EXPECT_STREQ(wsd_decay_style_name(WSDDecayStyle::kMinusSqrt), "minus_sqrt");
  for (auto s : {WDIncrStyle::kConstant, WDIncrStyle::kLinear, WDIncrStyle::kCosine})
    EXPECT_EQ(parse_wd_incr_style(wd_incr_style_name(s)), s);
  expect_user_error([] { parse_lr_decay_style("wsd"); }, {"--lr-decay-style", "WSD"});
  expect_user_error([] { parse_wsd_decay_style("minus-sqrt"); }, {"--lr-wsd-decay-style", "minus_sqrt"});
  expect_user_error([] { parse_wd_incr_style("exponential"); }, {"--weight-decay-incr-style"});
}

TEST(Scheduler, PythonFloatRepr) {
  const struct {
    double v;
    const char* s;
  } table[] = {{0.0003, "0.0003"}, {3.0, "3.0"},       {1e-05, "1e-05"},       {0.0001, "0.0001"},
               {0.1, "0.1"},       {-2.5, "-2.5"},     {1e16, "1e+16"},        {1e15, "1000000000000000.0"},
               {1234.5, "1234.5"}, {1.5e-07, "1.5e-07"}, {4294967296.0, "4294967296.0"}, {0.0, "0.0"},
               {6e-4, "0.0006"},   {1.2345678901234567e+300, "1.2345678901234567e+300"}};
  for (const auto& t : table) EXPECT_EQ(python_float_repr(t.v), t.s);
}

// ---- checkpoint state ------------------------------------------------------------------------------

namespace {

SchedulerConfig ckpt_config() {
  SchedulerConfig c = base(LRDecayStyle::kWSD, 16, 320);
  c.init_lr = 1e-5;
  c.wsd_decay_steps = 64;
  c.lr_wsd_decay_style = WSDDecayStyle::kCosine;
  c.start_wd = 0.01;
  c.end_wd = 0.1;
  c.wd_incr_steps = 320;
  c.wd_incr_style = WDIncrStyle::kLinear;
  return c;
}

}  // namespace

TEST(SchedulerState, JsonRoundTripAndResumeMatchesUninterrupted) {
  const SchedulerConfig c = ckpt_config();
  OptimizerParamScheduler run(c);
  for (int i = 0; i < 7; ++i) run.step(16);
  const SchedulerState saved = run.state();
  EXPECT_EQ(saved.num_steps, 112);
  const std::string text = saved.to_json();
  EXPECT_NE(text.find("\"lr_decay_style\": \"WSD\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"lr_wsd_decay_style\": \"cosine\""), std::string::npos) << text;
  const SchedulerState back = SchedulerState::from_json(text);
  EXPECT_EQ(back, saved);

  OptimizerParamScheduler resumed(c);
  const std::vector<std::string> log = resumed.load_state(back);
  EXPECT_EQ(resumed.num_steps(), 112);
  EXPECT_EQ(resumed.lr(), run.lr());
  EXPECT_EQ(resumed.wd(), run.wd());
  ASSERT_EQ(log.size(), 11u);
  EXPECT_EQ(log[0], " > using checkpoint value 0.001 for learning rate");
  EXPECT_EQ(log[1], " > using checkpoint value 1e-05 for minimum learning rate");
  EXPECT_EQ(log[2], " > using checkpoint value 16 for warmup iterations");
  EXPECT_EQ(log[3], " > using checkpoint value 320 for total number of iterations");
  EXPECT_EQ(log[4], " > using checkpoint value WSD for learning rate decay style");
  EXPECT_EQ(log[8], " > using checkpoint value linear for weight decay incr style");
  // Both continue identically through the anneal and past the end.
  for (int i = 0; i < 16; ++i) {
    run.step(16);
    resumed.step(16);
    EXPECT_EQ(resumed.lr(), run.lr());
    EXPECT_EQ(resumed.wd(), run.wd());
  }
  EXPECT_EQ(run.lr(), 1e-5);
}

TEST(SchedulerState, MismatchWithoutFlagsIsAnErrorNamingBothValues) {
  OptimizerParamScheduler run(ckpt_config());
  run.step(48);
  const SchedulerState saved = run.state();

  SchedulerConfig c = ckpt_config();
  c.max_lr = 2e-3;
  expect_user_error([&] { OptimizerParamScheduler(c).load_state(saved); },
                    {"--lr", "0.002", "0.001", "learning rate", "--override-opt_param-scheduler",
                     "--use-checkpoint-opt_param-scheduler"});
  c = ckpt_config();
  c.lr_decay_steps = 640;  // e.g. --train-iters extended on resume
  expect_user_error([&] { OptimizerParamScheduler(c).load_state(saved); },
                    {"--lr-decay-iters", "640", "320", "total number of iterations"});
  c = ckpt_config();
  c.lr_wsd_decay_style = WSDDecayStyle::kLinear;
  expect_user_error([&] { OptimizerParamScheduler(c).load_state(saved); },
                    {"--lr-wsd-decay-style", "linear", "cosine"});
  c = ckpt_config();
  c.end_wd = 0.2;
  expect_user_error([&] { OptimizerParamScheduler(c).load_state(saved); }, {"--end-weight-decay", "0.2", "0.1"});
}

TEST(SchedulerState, UseCheckpointTakesTheCheckpointSettings) {
  OptimizerParamScheduler run(ckpt_config());
  run.step(48);
  const SchedulerState saved = run.state();

  SchedulerConfig c = ckpt_config();
  c.max_lr = 2e-3;
  c.lr_decay_steps = 640;
  c.lr_decay_style = LRDecayStyle::kCosine;  // checkpoint's WSD wins, so its WSD pair is checked and taken
  c.wsd_decay_steps = 0;
  c.end_wd = 0.3;
  c.use_checkpoint_opt_param_scheduler = true;
  OptimizerParamScheduler s(c);
  const auto log = s.load_state(saved);
  EXPECT_EQ(s.config().max_lr, 1e-3);
  EXPECT_EQ(s.config().lr_decay_steps, 320);
  EXPECT_EQ(s.config().lr_decay_style, LRDecayStyle::kWSD);
  EXPECT_EQ(s.config().wsd_decay_steps, 64);
  EXPECT_EQ(s.config().end_wd, 0.1);
  EXPECT_EQ(s.state(), saved);
  EXPECT_EQ(s.lr(), run.lr());
  EXPECT_EQ(s.wd(), run.wd());
  ASSERT_EQ(log.size(), 11u);
  EXPECT_EQ(log[0], " > using checkpoint value 0.001 for learning rate");
  EXPECT_EQ(log[9], " > using checkpoint value 64 for WSD decay iterations");
}

TEST(SchedulerState, OverrideKeepsCommandLineButRestoresNumSteps) {
  OptimizerParamScheduler run(ckpt_config());
  run.step(48);
  const SchedulerState saved = run.state();

  SchedulerConfig c = base(LRDecayStyle::kLinear, 0, 480);
  c.max_lr = 2e-3;
  c.min_lr = 0.0;
  c.override_opt_param_scheduler = true;
  OptimizerParamScheduler s(c);
  const auto log = s.load_state(saved);
  EXPECT_EQ(s.num_steps(), 48);
  EXPECT_EQ(s.config().max_lr, 2e-3);
  EXPECT_EQ(s.config().lr_decay_style, LRDecayStyle::kLinear);
  EXPECT_DOUBLE_EQ(s.lr(), 2e-3 * (1.0 - 48.0 / 480.0));
  ASSERT_EQ(log.size(), 9u);  // linear: the checkpoint's WSD pair is irrelevant and not reported
  EXPECT_EQ(log[0], " > overriding learning rate value to 0.002");
  EXPECT_EQ(log[4], " > overriding learning rate decay style value to linear");
}

TEST(SchedulerState, MegatronLegacyKeysAndMissingOptionalFields) {
  // Keys an old Megatron state_dict used, no weight-decay or WSD fields.
  const char* legacy = R"({"start_lr": 0.001, "min_lr": 1e-05, "warmup_iter": 16, "end_iter": 320,
                           "decay_style": "cosine", "num_iters": 64})";
  const SchedulerState s = SchedulerState::from_json(legacy);
  EXPECT_EQ(s.max_lr, 1e-3);
  EXPECT_EQ(s.lr_warmup_steps, 16);
  EXPECT_EQ(s.lr_decay_steps, 320);
  EXPECT_EQ(s.lr_decay_style, LRDecayStyle::kCosine);
  EXPECT_EQ(s.num_steps, 64);
  EXPECT_FALSE(s.has_wd);
  EXPECT_FALSE(s.has_wsd);
  SchedulerConfig c = base(LRDecayStyle::kCosine, 16, 320);
  c.start_wd = c.end_wd = 0.1;  // a weight-decay setting the old checkpoint cannot contradict
  OptimizerParamScheduler sch(c);
  const auto log = sch.load_state(s);
  EXPECT_EQ(log.size(), 5u);
  EXPECT_EQ(sch.num_steps(), 64);
  EXPECT_EQ(sch.wd(), 0.1);
  const SchedulerState round = SchedulerState::from_json(s.to_json());
  EXPECT_EQ(round, s);  // absent fields stay absent
}

TEST(SchedulerState, MalformedJsonNamesTheSource) {
  expect_user_error([] { SchedulerState::from_json("{", "ckpt/iter_0000010/scheduler.json"); },
                    {"ckpt/iter_0000010/scheduler.json", "JSON"});
  expect_user_error([] { SchedulerState::from_json(R"({"max_lr": 1})"); }, {"missing key", "min_lr"});
  expect_user_error(
      [] {
        SchedulerState::from_json(R"({"max_lr": 1e-3, "min_lr": 0, "lr_warmup_steps": 1.5, "lr_decay_steps": 9,
                                      "lr_decay_style": "linear", "num_steps": 0})");
      },
      {"lr_warmup_steps", "integer"});
  expect_user_error(
      [] {
        SchedulerState::from_json(R"({"max_lr": 1e-3, "min_lr": 0, "lr_warmup_steps": 1, "lr_decay_steps": 9,
                                      "lr_decay_style": "step", "num_steps": 0})");
      },
      {"scheduler state", "lr_decay_style", "step"});
}

namespace {

// The lr of optimizer steps 1..N under a DeepSpeed schedule, through the scheduler (4 samples per step).
std::vector<double> deepspeed_lrs(DeepSpeedSchedule d, int steps) {
  SchedulerConfig c = base(LRDecayStyle::kLinear, 0, 1000);
  d.samples_per_step = 4;
  c.deepspeed = d;
  OptimizerParamScheduler s(c);
  std::vector<double> out;
  for (int i = 0; i < steps; ++i) {
    out.push_back(s.lr());
    s.step(4);
  }
  return out;
}

void expect_lrs(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_DOUBLE_EQ(got[i], want[i]) << what << " step " << i + 1;
}

}  // namespace

// ds_config "scheduler": the lr each optimizer step trains with, against DeepSpeed's own WarmupLR /
// WarmupDecayLR / WarmupCosineLR classes (deepspeed/runtime/lr_schedules.py) driven as its engine drives
// them (constructed before the first step, step() after each applied step). Values printed by Python 3.11
// from those classes.
TEST(Scheduler, DeepSpeedSchedulesMatchDeepSpeed) {
  DeepSpeedSchedule w;
  w.type = DeepSpeedScheduleType::kWarmupLR;
  w.warmup_min_lr = 1e-4;
  w.warmup_max_lr = 1e-2;
  w.warmup_num_steps = 5;
  expect_lrs(deepspeed_lrs(w, 8), {0.0001, 0.0001, 0.004363697924926592, 0.006857801325411256, 0.008627395849853182, 0.01,
                                   0.01, 0.01}, "WarmupLR log");
  w.warmup_min_lr = 0.0;
  w.warmup_max_lr = 3e-3;
  w.warmup_num_steps = 4;
  w.log_warmup = false;
  expect_lrs(deepspeed_lrs(w, 7), {0.0, 0.0, 0.00075, 0.0015, 0.0022500000000000003, 0.003, 0.003}, "WarmupLR linear");
  DeepSpeedSchedule d;
  d.type = DeepSpeedScheduleType::kWarmupDecayLR;
  d.total_num_steps = 10;
  d.warmup_min_lr = 1e-5;
  d.warmup_max_lr = 2e-3;
  d.warmup_num_steps = 3;
  expect_lrs(deepspeed_lrs(d, 13),
             {1e-05, 1e-05, 0.0012655502096072001, 0.002, 0.002, 0.0017157142857142857, 0.0014314285714285716,
              0.0011471428571428572, 0.0008628571428571429, 0.0005785714285714286, 0.0002942857142857143, 1e-05, 1e-05},
             "WarmupDecayLR");
  DeepSpeedSchedule c;
  c.type = DeepSpeedScheduleType::kWarmupCosineLR;
  c.total_num_steps = 10;
  c.warmup_min_ratio = 0.1;
  c.warmup_num_steps = 3;
  c.cos_min_ratio = 0.01;
  c.log_warmup = false;
  c.base_lr = 6e-4;
  expect_lrs(deepspeed_lrs(c, 12),
             {0.0, 5.9999999999999995e-05, 0.00023999999999999998, 0.00041999999999999996, 0.0005705877537670184,
              0.00048817647115204386, 0.0003690887173850253, 0.00023691128261497463, 0.00011782352884795615,
              3.541224623298155e-05, 5.999999999999999e-06, 3.541224623298151e-05},
             "WarmupCosineLR linear");
  c.total_num_steps = 6;
  c.warmup_min_ratio = 0.0;
  c.warmup_num_steps = 1;  // DeepSpeed raises it to 2
  c.cos_min_ratio = 0.0001;
  c.log_warmup = true;
  c.base_lr = 1e-3;
  expect_lrs(deepspeed_lrs(c, 7), {0.0, 0.0, 0.001, 0.0008535680352542144, 0.00050005, 0.0001465319647457856, 1.0000000000000001e-07},
             "WarmupCosineLR log");
}

TEST(Scheduler, DeepSpeedScheduleChecksAndCheckpointRecord) {
  SchedulerConfig c = base(LRDecayStyle::kLinear, 0, 100);
  c.deepspeed.type = DeepSpeedScheduleType::kWarmupCosineLR;
  c.deepspeed.samples_per_step = 4;
  c.deepspeed.total_num_steps = 2;  // not more than the warmup (max(2, 1000))
  EXPECT_THROW(OptimizerParamScheduler{c}, UserError);
  c.deepspeed.total_num_steps = 2000;
  c.deepspeed.base_lr = 1e-3;
  OptimizerParamScheduler s(c);
  s.step(40);
  const SchedulerState st = SchedulerState::from_json(s.state().to_json());
  EXPECT_EQ(st.deepspeed, c.deepspeed);
  // Resuming without the DeepSpeed schedule is a mismatch like any other setting.
  OptimizerParamScheduler megatron(base(LRDecayStyle::kLinear, 0, 100));
  EXPECT_THROW(megatron.load_state(st), UserError);
  OptimizerParamScheduler again(c);
  again.load_state(st);
  EXPECT_EQ(again.lr(), s.lr());
}

// --lr-warmup-tokens / --lr-decay-tokens: Megatron-DeepSpeed's get_lr (megatron/optimizer_param_scheduler.py),
// stepped as its trainer steps it (increment = global batch 4, tokens = consumed samples x 64); values
// printed by Python from that code.
TEST(Scheduler, TokenScheduleMatchesMegatronDeepSpeed) {
  auto lrs = [](SchedulerConfig c) {
    c.tokens_per_sample = 64;
    OptimizerParamScheduler s(c);
    std::vector<double> out{s.lr()};
    for (int i = 0; i < 10; ++i) {
      s.step(4);
      out.push_back(s.lr());
    }
    return out;
  };
  SchedulerConfig a = base(LRDecayStyle::kCosine, 0, 40);
  a.lr_warmup_tokens = 700;
  a.lr_decay_tokens = 2300;
  expect_lrs(lrs(a),
             {0.0, 0.00036571428571428573, 0.0007314285714285715, 0.0009955943749461575, 0.0009031659394586918,
              0.000712236570081027, 0.0004700396419640726, 0.0002364914393517563, 6.93686673458897e-05, 1e-05, 1e-05},
             "token warmup, token cosine decay");
  SchedulerConfig b = base(LRDecayStyle::kLinear, 8, 40);
  b.max_lr = 2e-3;
  b.min_lr = 0.0;
  b.lr_decay_tokens = 2048;
  expect_lrs(lrs(b),
             {0.0, 0.001, 0.002, 0.0016666666666666668, 0.0013333333333333335, 0.001, 0.0006666666666666668,
              0.00033333333333333327, 0.0, 0.0, 0.0},
             "sample warmup, token linear decay");
  // Saved and checked on resume like Megatron-DeepSpeed's lr_warmup_tokens / lr_decay_tokens.
  a.tokens_per_sample = 64;
  OptimizerParamScheduler s(a);
  const SchedulerState st = SchedulerState::from_json(s.state().to_json());
  EXPECT_EQ(st.lr_decay_tokens, std::optional<int64_t>(2300));
  SchedulerConfig other = a;
  other.lr_decay_tokens = 4600;
  OptimizerParamScheduler t(other);
  EXPECT_THROW(t.load_state(st), UserError);
  SchedulerConfig wsd = a;
  wsd.lr_decay_style = LRDecayStyle::kWSD;
  wsd.wsd_decay_steps = 10;
  EXPECT_THROW(OptimizerParamScheduler{wsd}, UserError);
}
