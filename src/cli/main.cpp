// `loom` entry point: dispatches subcommands; a UserError is printed as one line and exits 2.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "cli/calc_args.h"
#include "cli/convert_args.h"
#include "cli/data_args.h"
#include "cli/generate_args.h"
#include "cli/preprocess_args.h"
#include "loom/core/exit_signals.h"
#include "loom/data/preprocess.h"
#include "loom/dist/communicator.h"
#include "loom/train/args.h"
#include "loom/train/calc.h"
#include "loom/train/config_file.h"
#include "loom/train/trainer.h"

namespace {

// GOMP_SPINCOUNT Loom runs with (bench/RESULTS.md, "OpenMP waiting under contention"); the tests run with
// the same (tests/CMakeLists.txt: LOOM_TEST_GOMP_SPINCOUNT). 10,000 kept a 2-thread fp32 step within 1.3x of
// its fair share beside a busy process on a Xeon VM, but not a bf16 one on a Zen 5 VM (1.55x; its steps have
// more, shorter parallel regions); 1,000 gives 1.25x in both there, ~1% below the idle speed of libgomp's
// default (a worker that fell asleep starts the next GEMM late; session 15).
constexpr const char* kLoomSpinCount = "1000";

const char* kUsage =
    "usage: loom <command> [flags]   (train and calc also take --config FILE.yaml: flags as YAML keys)\n"
    "commands:\n"
    "  train       pretrain a GPT model (Megatron-LM flags; `loom train --help`)\n"
    "  preprocess  tokenize JSONL into Megatron .bin/.idx files (`loom preprocess --help`)\n"
    "  data check  scan .bin/.idx datasets: counts, id range, lengths, every problem (`loom data --help`)\n"
    "  calc        parameters, FLOPs, memory per rank and training time from train flags (`loom calc --help`)\n"
    "  generate    continue a prompt with a trained checkpoint, KV-cached (`loom generate --help`)\n"
    "  convert     Hugging Face GPT-2 / Llama directories <-> Loom checkpoints (`loom convert --help`)\n";

int cmd_train(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << loom::train_help();
      return 0;
    }
  const loom::TrainConfig cfg = loom::parse_with_config_file(args, loom::parse_train_args);
  loom::run_training(cfg, std::cout);
  return 0;
}

int cmd_preprocess(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << loom::preprocess_help();
      return 0;
    }
  const loom::PreprocessConfig cfg = loom::parse_preprocess_args(args);
  loom::run_preprocess(cfg, std::cout);
  return 0;
}

int cmd_calc(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << loom::calc_help();
      return 0;
    }
  const loom::CalcReport r = loom::parse_with_config_file(
      args, [](const std::vector<std::string>& a) { return loom::compute_calc(loom::parse_calc_args(a)); });
  std::cout << loom::format_calc_report(r);
  return 0;
}

int cmd_generate(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << loom::generate_help();
      return 0;
    }
  loom::run_generate(loom::parse_generate_args(args), std::cout, std::cerr);
  return 0;
}

int cmd_convert(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << loom::convert_help();
      return 0;
    }
  loom::run_convert(loom::parse_convert_args(args), std::cout);
  return 0;
}

// OpenMP's idle worker threads spin (GNU libgomp: 300,000 iterations) before they sleep. On a machine
// whose cores are shared with another busy process a spinning thread burns the time slice its partner
// needs, and a 2-thread step ran 3x slower beside one competitor. A short spin keeps the wake-up latency
// of back-to-back parallel regions on an idle machine and yields the cores quickly when they are
// contended. libgomp reads its settings when it is loaded, before main, so the process re-executes
// itself once with the setting in its environment. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins;
// LOOM_OPENMP_SPIN=default keeps libgomp's default.
void tune_openmp_waiting(char** argv) {
  constexpr const char* kMarker = "LOOM_OPENMP_TUNED";
  if (std::getenv(kMarker) || std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  const char* want = std::getenv("LOOM_OPENMP_SPIN");
  if (want && std::strcmp(want, "default") == 0) return;
  setenv("GOMP_SPINCOUNT", want && *want ? want : kLoomSpinCount, 1);
  setenv(kMarker, "1", 1);
  execv("/proc/self/exe", argv);  // returns only on failure: carry on with libgomp's defaults
  unsetenv("GOMP_SPINCOUNT");
}

}  // namespace

int main(int argc, char** argv) {
  tune_openmp_waiting(argv);
  // Before any thread exists: SIGTERM/SIGINT go to one waiting thread, never into a computing one.
  loom::route_exit_signals();
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (cmd == "train") return cmd_train(args);
    if (cmd == "preprocess") return cmd_preprocess(args);
    if (cmd == "data") return loom::run_data_command(args, std::cout);
    if (cmd == "calc") return cmd_calc(args);
    if (cmd == "convert") return cmd_convert(args);
    if (cmd == "generate") return cmd_generate(args);
    std::cerr << "loom: error: unknown command '" << cmd << "'\n" << kUsage;
    return 2;
  } catch (const loom::UserError& e) {
    std::cout.flush();  // the log so far, before a multi-rank job is ended (end_after_error)
    return loom::end_after_error("loom " + cmd + ": error: " + e.what(), 2);
  } catch (const std::exception& e) {
    std::cout.flush();
    return loom::end_after_error("loom " + cmd + ": internal error: " + e.what(), 1);
  }
}
