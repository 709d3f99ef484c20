// `--config FILE` end to end through the built binary: the GPT-2 presets give `loom calc` the published
// parameter counts, explicit flags override the file, and a bad file or key is one error line, exit 2,
// naming the file.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fs = std::filesystem;

namespace {

struct LoomRun {
  int code = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

LoomRun loom(const std::string& args) {
  const std::string tag = std::to_string(::getpid());
  const fs::path out = fs::temp_directory_path() / ("loom_cfgcli_stdout_" + tag),
                 err = fs::temp_directory_path() / ("loom_cfgcli_stderr_" + tag);
  const std::string cmd = std::string("cd ") + LOOM_SOURCE_DIR + " && " + LOOM_BINARY + " " + args + " >" +
                          out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  LoomRun r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  fs::remove(out);
  fs::remove(err);
  return r;
}

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
    const LoomRun r = loom(std::string("calc --config configs/") + name + ".yaml");
    EXPECT_EQ(r.code, 0) << name << ": " << r.err;
    EXPECT_EQ(exact_params(r.out), params) << name << "\n" << r.out;
  }
}

TEST(ConfigCli, ExplicitFlagsOverrideThePreset) {
  // gpt2-124m's file with gpt2-350m's shape on the command line is gpt2-350m.
  const LoomRun r = loom("calc --config=configs/gpt2-124m.yaml --num-layers 24 --hidden-size 1024 --num-attention-heads 16");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(exact_params(r.out), "354,871,296") << r.out;
  // Calc's own flags may come after the file too.
  const LoomRun g = loom("calc --config configs/gpt2-124m.yaml --num-gpus 8");
  EXPECT_EQ(g.code, 0) << g.err;
  EXPECT_NE(g.out.find("DP 8"), std::string::npos) << g.out;
}

TEST(ConfigCli, BadFilesAndKeysAreOneErrorLine) {
  const fs::path dir = fs::temp_directory_path() / ("loom_cfgcli_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string unknown = (dir / "unknown.yaml").string(), broken = (dir / "broken.yaml").string();
  std::ofstream(unknown) << "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\nmicro-batch-sizes: 3\n";
  std::ofstream(broken) << "num-layers: 2\nhidden-size: [64\n";
  for (const char* cmd : {"calc", "train"}) {
    SCOPED_TRACE(cmd);
    LoomRun r = loom(std::string(cmd) + " --config " + unknown);
    EXPECT_EQ(r.code, 2);
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("unknown flag --micro-batch-sizes (did you mean --micro-batch-size?)"), std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("set in config file '" + unknown + "', line 4"), std::string::npos) << r.err;
    r = loom(std::string(cmd) + " --config " + broken);
    EXPECT_EQ(r.code, 2);
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("config file '" + broken + "', line "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("invalid YAML"), std::string::npos) << r.err;
  }
  fs::remove_all(dir);
}

}  // namespace
