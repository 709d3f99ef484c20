// --config FILE: YAML to command-line tokens (switches, omitted keys, lists, text kept as written), the
// file's tokens going before the command line so explicit flags win, YAML and structure errors naming the
// file and line, parse errors annotated with where the config sets the flag, and every preset in configs/
// expanding cleanly (the GPT-2 ones parsing into the published shapes).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "loom/train/args.h"
#include "loom/train/config_file.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_cfg_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& text, const std::string& name = "run.yaml") const {
    const std::string p = (dir_ / name).string();
    std::ofstream(p) << text;
    return p;
  }
  fs::path dir_;
};

template <typename F>
std::string user_error_of(F&& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a UserError";
  return "";
}

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nmissing: " << (part)

TEST_F(ConfigFileTest, YamlBecomesTokensBeforeTheCommandLine) {
  const std::string p = write(
      "# a comment\n"
      "num-layers: 12\n"
      "hidden_size: 768\n"          // '_' spelling
      "--lr: 1e-4\n"                // leading dashes tolerated; the number's text kept
      "min-lr: 0.000015\n"
      "bf16: true\n"
      "fp16: false\n"               // left out
      "load:\n"                     // null: left out
      "save: ~\n"
      "tokenizer-type: GPT2BPETokenizer\n"
      "split: \"949,50,1\"\n"
      "data-path: [0.3, a/b, 0.7, 'c d']\n"
      "valid-data-path:\n"
      "  - v1\n"
      "  - v2\n"
      "exit-signal-handler: True\n"
      "seed: 'true'\n");            // quoted: text, not a switch
  // --bf16 on the command line drops the file's (the same here; see ExplicitFlagsOverrideTheFile).
  const ConfigFileExpansion ex = expand_config_file_traced({"--micro-batch-size", "4", "--config", p, "--bf16"});
  const Args expect = {"--num-layers=12", "--hidden-size=768", "--lr=1e-4", "--min-lr=0.000015",
                       "--tokenizer-type=GPT2BPETokenizer", "--split=949,50,1", "--data-path", "0.3", "a/b", "0.7",
                       "c d", "--valid-data-path", "v1", "v2", "--exit-signal-handler", "--seed=true",
                       "--micro-batch-size", "4", "--bf16"};
  const Args expect_alone = {"--num-layers=12", "--hidden-size=768", "--lr=1e-4", "--min-lr=0.000015", "--bf16",
                             "--tokenizer-type=GPT2BPETokenizer", "--split=949,50,1", "--data-path", "0.3", "a/b",
                             "0.7", "c d", "--valid-data-path", "v1", "v2", "--exit-signal-handler", "--seed=true"};
  EXPECT_EQ(ex.args, expect);
  EXPECT_EQ(ex.path, p);
  ASSERT_EQ(ex.keys.size(), 14u);
  EXPECT_EQ(ex.keys[0].flag, "--num-layers");
  EXPECT_EQ(ex.keys[0].line, 2);
  EXPECT_EQ(ex.keys[1].flag, "--hidden-size");
  EXPECT_EQ(ex.keys[11].flag, "--valid-data-path");
  EXPECT_EQ(ex.keys[11].line, 13);
  EXPECT_TRUE(ex.keys[4].overridden);  // bf16
  EXPECT_FALSE(ex.keys[0].overridden);
  EXPECT_EQ(ex.command_line_flags, (std::set<std::string>{"--micro-batch-size", "--bf16"}));
  EXPECT_EQ(expand_config_file({"--config=" + p}), expect_alone);
}

TEST_F(ConfigFileTest, WithoutConfigArgsAreUntouchedAndEmptyFilesAreFine) {
  const Args args = {"--num-layers", "2", "--configure-me"};
  EXPECT_EQ(expand_config_file(args), args);
  EXPECT_TRUE(expand_config_file_traced(args).path.empty());
  const std::string p = write("# nothing but comments\n\n");
  EXPECT_EQ(expand_config_file({"--config", p, "--num-layers", "2"}), (Args{"--num-layers", "2"}));
}

TEST_F(ConfigFileTest, ExplicitFlagsOverrideTheFile) {
  const std::string p = write("num-layers: 12\nhidden-size: 768\nnum-attention-heads: 12\nseq-length: 1024\n");
  const TrainConfig a = parse_with_config_file(Args{"--config", p}, parse_train_args);
  EXPECT_EQ(a.model.num_layers, 12);
  EXPECT_EQ(a.batch.seq_length, 1024);
  const TrainConfig b =
      parse_with_config_file(Args{"--num-layers", "3", "--config", p, "--seq-length=64"}, parse_train_args);
  EXPECT_EQ(b.model.num_layers, 3);
  EXPECT_EQ(b.model.hidden_size, 768);
  EXPECT_EQ(b.batch.seq_length, 64);
  EXPECT_EQ(b.model.max_position_embeddings, 64);  // follows --seq-length as without a file

  // A list flag on the command line replaces the file's list instead of adding to it.
  const std::string q = write("data-path: [0.5, a, 0.5, b]\nnum-layers: abc\n", "q.yaml");
  const TrainConfig c = parse_with_config_file(
      Args{"--config", q, "--data-path", "c", "--num_layers", "2"}, parse_train_args);
  EXPECT_EQ(c.data.data_path, std::vector<std::string>{"c"});
  EXPECT_EQ(c.model.num_layers, 2);  // the file's bad value is never parsed
}

TEST_F(ConfigFileTest, BadFilesNameTheFileAndLine) {
  {
    const std::string p = write("num-layers: 12\nhidden-size: [1, 2\nseq-length: 3\n");
    const std::string msg = user_error_of([&] { expand_config_file({"--config", p}); });
    EXPECT_HAS(msg, "config file '" + p + "', line ");
    EXPECT_HAS(msg, "invalid YAML");
  }
  {
    const std::string p = write("num-layers: 12\n  bad indent: 3\n");
    const std::string msg = user_error_of([&] { expand_config_file({"--config", p}); });
    EXPECT_HAS(msg, "config file '" + p + "', line 2");
  }
  struct Case {
    const char* text;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"- num-layers\n- 12\n", {"line 1", "top level must be a mapping"}},
      {"num-layers: 12\nmodel:\n  hidden-size: 768\n", {"line 2", "--model", "not a mapping"}},
      {"num-layers: 12\ndata-path: []\n", {"line 2", "--data-path", "empty list"}},
      {"data-path:\n  - a\n  - [b]\n", {"line 3", "list items must be plain values"}},
      {"data-path: [a, --b]\n", {"line 1", "'--b' would be read as a flag"}},
      {"num-layers: 12\nnum_layers: 13\n", {"line 2", "--num-layers is set twice"}},
      {"config: other.yaml\n", {"line 1", "cannot include another"}},
      {"-x: 1\n", {"line 1", "'-x' is not a flag name"}},
      {"num layers: 1\n", {"line 1", "'num layers' is not a flag name"}},
      {"? [a, b]\n: 1\n", {"line 1", "a key must be a flag name"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    const std::string p = write(c.text);
    const std::string msg = user_error_of([&] { expand_config_file({"--config", p}); });
    EXPECT_HAS(msg, "config file '" + p + "', ");
    for (const std::string& part : c.expect) EXPECT_HAS(msg, part);
  }
  const std::string missing = (dir_ / "missing.yaml").string();
  EXPECT_HAS(user_error_of([&] { expand_config_file({"--config", missing}); }), "--config: config file '" + missing + "': cannot open");
  const std::string p = write("num-layers: 1\n");
  EXPECT_HAS(user_error_of([&] { expand_config_file({"--config", p, "--config", p}); }), "--config given twice");
  EXPECT_HAS(user_error_of([&] { expand_config_file({"--config"}); }), "--config needs a value");
  EXPECT_HAS(user_error_of([&] { expand_config_file({"--config", "--num-layers", "2"}); }), "--config needs a value");
  EXPECT_HAS(user_error_of([&] { expand_config_file({"--config="}); }), "--config needs a value");
}

TEST_F(ConfigFileTest, ParseErrorsSayWhereTheConfigSetsTheFlag) {
  const std::string p = write("num-layers: 2\nnum-layerz: 3\n");
  std::string msg = user_error_of([&] { parse_with_config_file(Args{"--config", p}, parse_train_args); });
  EXPECT_HAS(msg, "unknown flag --num-layerz (did you mean --num-layers?)");
  EXPECT_HAS(msg, "(--num-layerz is set in config file '" + p + "', line 2)");

  const std::string q = write("hidden-size: 64\nseq-length: abc\n", "q.yaml");
  msg = user_error_of([&] { parse_with_config_file(Args{"--config", q}, parse_train_args); });
  EXPECT_HAS(msg, "--seq-length: expected an integer, got 'abc'");
  EXPECT_HAS(msg, "(--seq-length is set in config file '" + q + "', line 2)");
  // Given on the command line too: the file's value is dropped, so an error is the command line's.
  msg = user_error_of([&] { parse_with_config_file(Args{"--config", q, "--seq-length", "x"}, parse_train_args); });
  EXPECT_HAS(msg, "--seq-length: expected an integer, got 'x'");
  EXPECT_EQ(msg.find("config file"), std::string::npos) << msg;

  const std::string r = write("bf16: 1\n", "r.yaml");
  msg = user_error_of([&] { parse_with_config_file(Args{"--config", r}, parse_train_args); });
  EXPECT_HAS(msg, "--bf16 takes no value");
  EXPECT_HAS(msg, "line 1)");

  // An error about a flag the file does not set is left alone.
  msg = user_error_of([&] { parse_with_config_file(Args{"--config", q, "--nonsense-flag"}, parse_train_args); });
  EXPECT_HAS(msg, "unknown flag --nonsense-flag");
  EXPECT_EQ(msg.find("config file"), std::string::npos) << msg;
  // A key that is a prefix of the flag named in the message does not count as naming it.
  EXPECT_EQ(annotate_config_error("--seq-length-x is bad", expand_config_file_traced({"--config", q})),
            "--seq-length-x is bad");
}

// ---- the presets in configs/ --------------------------------------------------------------------

std::string preset(const std::string& name) { return std::string(LOOM_SOURCE_DIR) + "/configs/" + name + ".yaml"; }

TEST(ConfigPresets, Gpt2PresetsParseIntoThePublishedShapes) {
  struct Shape {
    const char* name;
    int64_t layers, hidden, heads;
  };
  for (const Shape& s : {Shape{"gpt2-124m", 12, 768, 12}, Shape{"gpt2-350m", 24, 1024, 16},
                         Shape{"gpt2-774m", 36, 1280, 20}, Shape{"gpt2-1.5b", 48, 1600, 25}}) {
    SCOPED_TRACE(s.name);
    const TrainConfig c = parse_with_config_file(Args{"--config", preset(s.name)}, parse_train_args);
    EXPECT_EQ(c.model.num_layers, s.layers);
    EXPECT_EQ(c.model.hidden_size, s.hidden);
    EXPECT_EQ(c.model.num_attention_heads, s.heads);
    EXPECT_EQ(c.model.max_position_embeddings, 1024);
    EXPECT_EQ(c.batch.seq_length, 1024);
    EXPECT_EQ(c.data.vocab_size, 50257);
    EXPECT_EQ(c.data.make_vocab_size_divisible_by, 128);
    EXPECT_FLOAT_EQ(c.model.layernorm_epsilon, 1e-5f);
  }
}

TEST(ConfigPresets, LlamaPresetsExpandToMegatronFlags) {
  struct Expect {
    const char* name;
    std::vector<std::string> tokens;
  };
  const std::vector<Expect> all = {
      {"llama2-7b", {"--num-layers=32", "--hidden-size=4096", "--ffn-hidden-size=11008", "--num-attention-heads=32",
                     "--rotary-base=10000", "--vocab-size=32000", "--seq-length=4096"}},
      {"llama2-13b", {"--num-layers=40", "--hidden-size=5120", "--ffn-hidden-size=13824", "--num-attention-heads=40"}},
      {"llama2-70b", {"--num-layers=80", "--hidden-size=8192", "--ffn-hidden-size=28672", "--num-attention-heads=64",
                      "--group-query-attention", "--num-query-groups=8"}},
      {"llama3-8b", {"--num-layers=32", "--ffn-hidden-size=14336", "--num-query-groups=8", "--rotary-base=500000",
                     "--vocab-size=128256", "--seq-length=8192"}},
      {"llama3-70b", {"--num-layers=80", "--hidden-size=8192", "--ffn-hidden-size=28672", "--num-query-groups=8",
                      "--rotary-base=500000"}},
      {"llama3.1-405b", {"--num-layers=126", "--hidden-size=16384", "--ffn-hidden-size=53248",
                         "--num-attention-heads=128", "--num-query-groups=8", "--max-position-embeddings=131072",
                         "--use-rope-scaling", "--rope-scaling-factor=8.0"}},
      {"mistral-7b", {"--num-layers=32", "--ffn-hidden-size=14336", "--num-query-groups=8", "--window-size=4096,0",
                      "--max-position-embeddings=32768"}},
      {"llama-tiny", {"--num-layers=2", "--hidden-size=64", "--num-query-groups=2", "--vocab-size=512"}},
  };
  for (const Expect& e : all) {
    SCOPED_TRACE(e.name);
    const Args args = expand_config_file({"--config", preset(e.name)});
    for (const std::string& t : e.tokens) EXPECT_NE(std::find(args.begin(), args.end(), t), args.end()) << t;
    for (const char* t : {"--position-embedding-type=rope", "--normalization=RMSNorm", "--swiglu",
                          "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--norm-epsilon=1.0e-5"})
      EXPECT_NE(std::find(args.begin(), args.end(), t), args.end()) << t;
  }
}

}  // namespace
}  // namespace loom
