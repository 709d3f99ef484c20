// The training-path fixture (issue 15): the per-iteration losses of a fixed list of runs — single process
// FP32/BF16/FP16/FP8-emulated, full and selective recompute with dropout, and the distributed layouts —
// recorded before the trainer was reshaped, so any refactor of the step, the model or the optimizer can
// be checked to keep every loss bit for bit. Bits depend on the CPU's kernels (AVX-512/AMX vs AVX2
// paths in oneDNN and Loom), so the fixture holds one record per ISA it was made on, and the test skips
// on a CPU with none. Recording replaces only this CPU's record (or adds it):
//   LOOM_RECORD_LOSS_FIXTURE=1 ./build/tests/dist/test_dist_train --gtest_filter='LossFixture.*'
// An intended numerical change (said so in the commit) re-records this CPU's record and deletes, in the same
// commit, the records of the ISAs it could not re-record: they would fail there; without them the test skips
// on those CPUs until a session on one records it again.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>

#include "e2e/e2e_util.h"

namespace loom::e2e {
namespace {

// The instruction sets this build's own kernels were compiled for (tests and loom share the compile flags).
constexpr std::pair<const char*, bool> kBuiltFor[] = {
#ifdef __AVX2__
    {"avx2", true},
#else
    {"avx2", false},
#endif
#ifdef __FMA__
    {"fma", true},
#else
    {"fma", false},
#endif
#ifdef __AVX512F__
    {"avx512f", true},
#else
    {"avx512f", false},
#endif
#ifdef __AVX512BW__
    {"avx512bw", true},
#else
    {"avx512bw", false},
#endif
#ifdef __AVX512VL__
    {"avx512vl", true},
#else
    {"avx512vl", false},
#endif
#ifdef __AVX512BF16__
    {"avx512_bf16", true},
#else
    {"avx512_bf16", false},
#endif
};

const char* kFixture = LOOM_SOURCE_DIR "/tests/golden/fixtures/train_losses.json";

const std::string kModel =
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --clip-grad 1.0 --weight-decay 0.1 --mock-data --vocab-size 97 --log-interval 1 "
    "--eval-iters 0 --seed 7 --train-iters 12 ";
const std::string kGpt = kModel + "--hidden-dropout 0 --attention-dropout 0 ";
const std::string kGptDropout = kModel + "--hidden-dropout 0.1 --attention-dropout 0.1 ";
const std::string kLlama =
    kModel + "--group-query-attention --num-query-groups 2 --normalization RMSNorm --swiglu --ffn-hidden-size 64 "
             "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
             "--hidden-dropout 0 --attention-dropout 0 ";

struct FixtureRun {
  const char* name;
  int np;
  std::string flags;
};

std::vector<FixtureRun> runs() {
  return {
      {"single_fp32_gpt", 1, kGpt},
      {"single_fp32_llama", 1, kLlama},
      {"single_bf16_gpt", 1, kGpt + "--bf16"},
      {"single_bf16_llama", 1, kLlama + "--bf16"},
      {"single_fp16_gpt", 1, kGpt + "--fp16 --initial-loss-scale 4096"},
      {"single_fp16_fp32grads_gpt", 1, kGpt + "--fp16 --initial-loss-scale 4096 --accumulate-allreduce-grads-in-fp32"},
      {"single_fp8_hybrid_gpt", 1, kGpt + "--bf16 --fp8-format hybrid --fp8-amax-history-len 4"},
      {"single_dropout_gpt", 1, kGptDropout},
      {"single_recompute_full_gpt", 1,
       kGptDropout + "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"},
      {"single_recompute_selective_gpt", 1, kGptDropout + "--recompute-granularity selective"},
      {"dp2_gpt", 2, kGpt},
      {"dp2_bf16_gpt", 2, kGpt + "--bf16"},
      {"dp2_zero3_gpt", 2, kGpt + "--data-parallel-sharding-strategy optim_grads_params"},
      {"dp2_zero1_llama", 2, kLlama + "--use-distributed-optimizer"},
      {"tp2_sp_gpt", 2, kGpt + "--tensor-model-parallel-size 2 --sequence-parallel"},
      {"tp2_sp_llama", 2, kLlama + "--tensor-model-parallel-size 2 --sequence-parallel"},
      {"pp2_interleaved_gpt", 2,
       kGpt + "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"},
      {"cp2_llama", 2, kLlama + "--context-parallel-size 2"},
      {"tp2_pp2_gpt", 4, kGpt + "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"},
      {"tp2_pp2_dropout_fp16_gpt", 4,
       kGptDropout + "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --fp16 --initial-loss-scale 4096"},
  };
}

// The CPU features that choose Loom's and oneDNN's kernel paths: the CPU's, then any this build was not
// compiled for (Loom's own kernels take the paths the compiler was allowed: a -march=x86-64-v3 build on an
// AVX-512 CPU runs its AVX2 forms) and any cap on oneDNN's ISA (DNNL_MAX_CPU_ISA). An AVX2 build on this
// CPU, or oneDNN capped to AVX2, differs from the native build in the last bits of the losses.
std::string isa_signature() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, flags;
  while (std::getline(f, line))
    if (line.rfind("flags", 0) == 0) {
      flags = line;
      break;
    }
  std::set<std::string> have;
  std::istringstream ss(flags);
  for (std::string w; ss >> w;) have.insert(w);
  std::string sig;
  auto add = [&sig](const std::string& w) { sig += (sig.empty() ? "" : " ") + w; };
  for (const char* k : {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_bf16",
                        "amx_tile"})
    if (have.count(k)) add(k);
  for (const auto& [k, built] : kBuiltFor)
    if (have.count(k) && !built) add(std::string("build-without-") + k);
  const char* cap = std::getenv("DNNL_MAX_CPU_ISA");
  if (cap && *cap && std::string(cap) != "ALL" && std::string(cap) != "all") add(std::string("dnnl-max-") + cap);
  return sig;
}

// The "lm loss" of every iteration as JSON (a number, or null where the loss was not finite).
std::vector<nlohmann::json> run_losses(const FixtureRun& r) {
  TempDir tmp("lossfix");
  const std::string jsonl = tmp / "m.jsonl";
  std::string cmd = r.np > 1 ? std::string(LOOM_MPIEXEC) +
                                   " --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 -np " +
                                   std::to_string(r.np) + " "
                             : std::string("OMP_NUM_THREADS=1 ");
  cmd += std::string(LOOM_BINARY) + " train " + r.flags + " --metrics-jsonl " + jsonl + " >" + (tmp / "out") +
         " 2>&1";
  const int st = std::system(cmd.c_str());
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << cmd << "\n" << read_file(tmp / "out");
  std::vector<nlohmann::json> out;
  for (const std::string& line : lines_of(read_file(jsonl))) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("lm loss") && j.contains("consumed samples")) out.push_back(j["lm loss"]);
  }
  return out;
}

// The fixture: {"records": [{"isa": signature, "runs": {name: {np, flags, losses}}}, ...]}, one record per ISA.
TEST(LossFixture, EveryRunKeepsItsLossesBitForBit) {
  const bool record = std::getenv("LOOM_RECORD_LOSS_FIXTURE") != nullptr;
  const std::string isa = isa_signature();
  nlohmann::json fix = {{"records", nlohmann::json::array()}};
  if (std::ifstream f(kFixture); f.good() || !record) {  // recording may start the file
    ASSERT_TRUE(f.good()) << kFixture;
    fix = nlohmann::json::parse(f);
  }
  ASSERT_TRUE(fix.contains("records") && fix["records"].is_array()) << kFixture << " has no \"records\" list";
  nlohmann::json* mine = nullptr;
  std::string recorded;
  for (nlohmann::json& rec : fix["records"]) {
    recorded += (recorded.empty() ? "[" : ", [") + rec["isa"].get<std::string>() + "]";
    if (rec["isa"].get<std::string>() == isa) mine = &rec;
  }
  if (record) {
    if (!mine) mine = &fix["records"].emplace_back(nlohmann::json{{"isa", isa}});
    (*mine)["runs"] = nlohmann::json::object();
  } else if (!mine) {
    GTEST_SKIP() << "the fixture holds records for CPUs with " << (recorded.empty() ? "no ISA" : recorded)
                 << ", this one has [" << isa << "]: losses are bit-exact only on the same kernels";
  }
  nlohmann::json& want_runs = (*mine)["runs"];
  for (const FixtureRun& r : runs()) {
    const std::vector<nlohmann::json> got = run_losses(r);
    ASSERT_EQ(got.size(), 12u) << r.name;
    if (record) {
      want_runs[r.name] = {{"np", r.np}, {"flags", r.flags}, {"losses", got}};
      continue;
    }
    ASSERT_TRUE(want_runs.contains(r.name)) << r.name << " is not in " << kFixture << "'s record for [" << isa << "]";
    EXPECT_EQ(want_runs[r.name]["flags"].get<std::string>(), r.flags) << r.name;
    const nlohmann::json& want = want_runs[r.name]["losses"];
    ASSERT_EQ(want.size(), got.size()) << r.name;
    for (size_t i = 0; i < got.size(); ++i)  // doubles compare exactly (to_chars round-trips every bit)
      EXPECT_EQ(got[i], want[i]) << r.name << ": iteration " << i + 1 << ": got " << got[i].dump() << ", recorded "
                                 << want[i].dump();
  }
  if (!record) {
    EXPECT_EQ(want_runs.size(), runs().size()) << "the record for [" << isa << "] holds runs no longer run";
  } else {
    std::ofstream(kFixture) << fix.dump(1) << "\n";
    GTEST_SKIP() << "recorded [" << isa << "] in " << kFixture;
  }
}

// The single-file checkpoint of Loom 0.1.0 (tests/golden/fixtures/legacy_single_ckpt, written by the build
// that first recorded the losses above, on the CPU its expected.json names): today's trainer resumes it to the
// very losses that build resumed to,
// and to those of an uninterrupted run, on a CPU with the recording one's kernels; on others it resumes to
// within 1e-5 of this CPU's uninterrupted run.
TEST(LossFixture, SingleFileCheckpointOfTheFirstReleaseResumesBitForBit) {
  const std::string dir = LOOM_SOURCE_DIR "/tests/golden/fixtures/legacy_single_ckpt";
  std::ifstream f(dir + "/expected.json");
  ASSERT_TRUE(f.good()) << dir;
  const nlohmann::json want = nlohmann::json::parse(f);
  const std::string flags = want["flags"].get<std::string>();
  TempDir tmp("legacy");
  std::filesystem::copy(dir + "/ck", tmp / "ck", std::filesystem::copy_options::recursive);  // loading writes nothing
  const std::vector<nlohmann::json> resumed = run_losses({"legacy_resume", 1, flags + " --load " + (tmp / "ck")});
  const std::vector<nlohmann::json> full = run_losses({"legacy_full", 1, flags});
  ASSERT_EQ(resumed.size(), 4u);
  ASSERT_EQ(full.size(), 8u);
  if (want["isa"].get<std::string>() != isa_signature()) {
    // The checkpoint holds the weights the recording CPU's kernels reached after 4 iterations; this CPU's
    // uninterrupted run reaches slightly different ones, so the two agree to rounding, not bit for bit.
    for (size_t i = 0; i < 4; ++i)
      EXPECT_NEAR(resumed[i].get<double>(), full[4 + i].get<double>(), 1e-5 * std::abs(full[4 + i].get<double>()))
          << "iteration " << i + 5;
    GTEST_SKIP() << "the first release's losses were recorded on another CPU's kernels: resumed within 1e-5 of "
                    "the uninterrupted run, bit-exact checks skipped";
  }
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed[i], full[4 + i]) << "iteration " << i + 5;
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed[i], want["resumed_losses"][i]) << "iteration " << i + 5;
}

}  // namespace
}  // namespace loom::e2e
