// `--config FILE` end to end through the built binary: the GPT-2 presets give `loom calc` the published
// parameter counts, explicit flags override the file, and a bad file or key is one error line, exit 2,
// naming the file.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "e2e_util.h"

using namespace loom::e2e;

namespace {

// `loom <args>` from the source root, where the presets' configs/*.yaml paths are relative to.
CliResult run(const std::string& args) { return run_loom(args, LOOM_SOURCE_DIR); }

std::string exact_params(const std::string& report) {
  std::istringstream in(report);
  for (std::string l; std::getline(in, l);)
    if (const size_t at = l.find("parameters (exact):"); at != std::string::npos) {
      std::istringstream rest(l.substr(at + 19));
      std::string n;
      rest >> n;
      return n;
    }
  return "";
}

TEST(ConfigCli, Gpt2PresetsGiveThePublishedParameterCounts) {
  const std::pair<const char*, const char*> expect[] = {{"gpt2-124m", "124,475,904"},
                                                        {"gpt2-350m", "354,871,296"},
                                                        {"gpt2-774m", "774,090,240"},
                                                        {"gpt2-1.5b", "1,557,686,400"}};
  for (const auto& [name, params] : expect) {
    const CliResult r = run(std::string("calc --config configs/") + name + ".yaml");
    EXPECT_EQ(r.code, 0) << name << ": " << r.err;
    EXPECT_EQ(exact_params(r.out), params) << name << "\n" << r.out;
  }
}

// Published parameter counts of the Llama-family checkpoints (Hugging Face model cards / safetensors
// metadata): the presets build exactly those architectures (vocabulary padding is a no-op for these
// vocabularies, which are multiples of 128).
TEST(ConfigCli, LlamaPresetsGiveThePublishedParameterCounts) {
  const std::pair<const char*, const char*> expect[] = {
      {"llama2-7b", "6,738,415,616"},      {"llama2-13b", "13,015,864,320"},   {"llama2-70b", "68,976,648,192"},
      {"llama3-8b", "8,030,261,248"},      {"llama3.1-8b", "8,030,261,248"},   {"llama3-70b", "70,553,706,496"},
      {"llama3.1-70b", "70,553,706,496"},  {"llama3.1-405b", "405,853,388,800"}, {"mistral-7b", "7,241,732,096"}};
  for (const auto& [name, params] : expect) {
    const CliResult r = run(std::string("calc --config configs/") + name + ".yaml");
    EXPECT_EQ(r.code, 0) << name << ": " << r.err;
    EXPECT_EQ(exact_params(r.out), params) << name << "\n" << r.out;
  }
}

TEST(ConfigCli, ExplicitFlagsOverrideThePreset) {
  // gpt2-124m's file with gpt2-350m's shape on the command line is gpt2-350m.
  const CliResult r = run("calc --config=configs/gpt2-124m.yaml --num-layers 24 --hidden-size 1024 --num-attention-heads 16");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(exact_params(r.out), "354,871,296") << r.out;
  // Calc's own flags may come after the file too.
  const CliResult g = run("calc --config configs/gpt2-124m.yaml --num-gpus 8");
  EXPECT_EQ(g.code, 0) << g.err;
  EXPECT_NE(g.out.find("DP 8"), std::string::npos) << g.out;
}

TEST(ConfigCli, BadFilesAndKeysAreOneErrorLine) {
  const TempDir dir("cfgcli");
  const std::string unknown = dir / "unknown.yaml", broken = dir / "broken.yaml";
  std::ofstream(unknown) << "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\nmicro-batch-sizes: 3\n";
  std::ofstream(broken) << "num-layers: 2\nhidden-size: [64\n";
  for (const char* cmd : {"calc", "train"}) {
    SCOPED_TRACE(cmd);
    CliResult r = run(std::string(cmd) + " --config " + unknown);
    expect_one_line_error(r, "unknown flag --micro-batch-sizes (did you mean --micro-batch-size?)");
    EXPECT_NE(r.err.find("set in config file '" + unknown + "', line 4"), std::string::npos) << r.err;
    r = run(std::string(cmd) + " --config " + broken);
    expect_one_line_error(r, "config file '" + broken + "', line ");
    EXPECT_NE(r.err.find("invalid YAML"), std::string::npos) << r.err;
  }
}

}  // namespace
