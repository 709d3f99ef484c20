// LoRA checkpoints out of and into Loom (issue 17), end to end through the binary: tiny Llama bases are
// pretrained by `loom train`, LoRA adapters trained on them with a large learning rate (B far from zero) on
// PEFT slices (q/k/v/o/gate/up/down_proj) and on whole Megatron layers (linear_qkv ... linear_fc2, on a
// --rotary-interleaved base so that the q/k row permutation is exercised). Checked:
//   loom -> peft -> loom reproduces the adapters bit for bit (whole layers through their repeated A);
//   an independent PyTorch script applies the PEFT directory to the HF export of the base the PEFT way and
//     gets Loom's --merge-lora --to hf: weights (tests/golden/peft_merge_check.py);
//   the merged model's loss is the base + adapters model's, an imported PEFT adapter trains on with
//     `loom train --lora-rank ... --load OUT --finetune` exactly like the checkpoint it came from;
//   `loom generate --load <LoRA checkpoint>` generates what the merged checkpoint generates, and not what
//     the base alone does;
//   bad PEFT directories and flag combinations fail with one line naming the file, tensor or flag.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "e2e_util.h"
#include "loom/ckpt/safetensors.h"
#include "loom/ckpt/sharded.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::e2e;
using nlohmann::json;

namespace {

Args llama(int64_t iters, const std::string& lr = "1e-2") {
  return {"--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
          "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "48",
          "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
          "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size",
          "4", "--train-iters", std::to_string(iters), "--lr", lr, "--mock-data", "--vocab-size", "100",
          "--log-interval", "1", "--eval-iters", "0", "--seed", "5", "--hidden-dropout", "0", "--attention-dropout",
          "0"};
}

const Args kSlices = {"--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--lora-target-modules",
                      "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
const Args kWhole = {"--lora-rank", "4", "--lora-alpha", "6", "--lora-target-modules", "all"};
const Args kInterleaved = {"--rotary-interleaved"};


// The checkpoints every test reads, trained once per process.
struct Trained {
  TempDir tmp{"lora_io"};
  std::string base = tmp / "base", base_ri = tmp / "base_ri", slices = tmp / "slices", whole = tmp / "whole";
  Trained() {
    EXPECT_EQ(train(cat(llama(4), {"--save", base})).final_iteration, 4);
    EXPECT_EQ(train(cat(cat(llama(4), kInterleaved), {"--save", base_ri})).final_iteration, 4);
    EXPECT_EQ(train(cat(cat(llama(4, "5e-2"), kSlices), {"--load", base, "--save", slices})).final_iteration, 4);
    EXPECT_EQ(train(cat(cat(cat(llama(4, "5e-2"), kInterleaved), kWhole), {"--load", base_ri, "--save", whole}))
                  .final_iteration,
              4);
  }
};

Trained& trained() {
  static std::unique_ptr<Trained> t;
  if (!t) t = std::make_unique<Trained>();
  return *t;
}

void convert_ok(const std::string& args) {
  const CliResult r = run_loom("convert " + args);
  ASSERT_EQ(r.code, 0) << "convert " << args << "\n" << r.out << r.err;
}

// One error line from `loom convert` containing every needle.
void convert_fails(const std::string& args, const std::vector<std::string>& needles) {
  const CliResult r = run_loom("convert " + args);
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  for (const std::string& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << "'" << n << "' in: " << r.err;
}

std::string bytes_of(const Tensor& t) { return std::string(static_cast<const char*>(t.raw()), size_t(t.nbytes())); }

// The tensors of a checkpoint (not the optimizer state) as bytes, by name.
std::map<std::string, std::string> weights_of(const std::string& root) {
  const ShardedCheckpoint ck = ShardedCheckpoint::open(root + "/iter_0000000");
  std::map<std::string, std::string> out;
  for (const std::string& n : ck.tensor_names())
    if (n.rfind("optimizer.", 0) != 0) out[n] = bytes_of(ck.read_full(n, DType::kF32));
  return out;
}

std::map<std::string, std::string> adapters_of(const std::string& lora_root) {
  const ShardedCheckpoint ck = ShardedCheckpoint::open(lora_root + "/iter_0000004");
  std::map<std::string, std::string> out;
  for (const std::string& n : ck.tensor_names())
    if (n.rfind("optimizer.", 0) != 0) out[n] = bytes_of(ck.read_full(n, DType::kF32));
  return out;
}

json lora_block(const std::string& iter_dir) {
  std::ifstream f(iter_dir + "/metadata.json");
  return json::parse(f)["lora"];
}

std::string abs_path(const std::string& p) { return fs::absolute(p).lexically_normal().string(); }

const std::string kNull = " --tokenizer-type NullTokenizer --vocab-size 99 --prompt '1 2 3 4' --max-new-tokens 12 "
                          "--temperature 0";

}  // namespace

TEST(LoraIo, PeftRoundTripOfSliceAdaptersIsBitExact) {
  Trained& t = trained();
  TempDir tmp("peft_slices");
  convert_ok("--from loom:" + t.slices + " --to peft:" + (tmp / "peft"));
  const json cfg = json::parse(read_file(tmp / "peft/adapter_config.json"));
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_EQ(cfg["lora_alpha"], 8);
  EXPECT_EQ(cfg["lora_dropout"], 0.1);
  EXPECT_EQ(cfg["bias"], "none");
  EXPECT_EQ(cfg["fan_in_fan_out"], false);
  EXPECT_EQ(cfg["use_rslora"], false);
  EXPECT_TRUE(cfg["modules_to_save"].is_null());
  EXPECT_EQ(cfg["base_model_name_or_path"], abs_path(t.base));
  EXPECT_EQ(cfg["target_modules"],
            json({"down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"}));
  const SafetensorsFile st = SafetensorsFile::open(tmp / "peft/adapter_model.safetensors");
  EXPECT_EQ(st.names().size(), 2u * 7 * 2);
  EXPECT_TRUE(st.contains("base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"));
  EXPECT_EQ(st.info("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight").shape, Shape({4, 48}));
  EXPECT_EQ(st.info("base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight").shape, Shape({16, 4}));

  const CliResult back = run_loom("convert --from peft:" + (tmp / "peft") + " --to loom:" + (tmp / "back") + " --base " +
                                  t.base);
  ASSERT_EQ(back.code, 0) << back.err;
  EXPECT_NE(back.out.find("--lora-target-modules linear_proj linear_fc2 q_proj k_proj v_proj gate_proj up_proj"),
            std::string::npos) << back.out;
  EXPECT_EQ(weights_of(tmp / "back"), adapters_of(t.slices));
  json want = lora_block(t.slices + "/iter_0000004"), got = lora_block(tmp / "back/iter_0000000");
  EXPECT_EQ(got, want);
}

TEST(LoraIo, PeftRoundTripOfWholeLayersRepeatsA) {
  Trained& t = trained();
  TempDir tmp("peft_whole");
  convert_ok("--from loom:" + t.whole + " --to peft:" + (tmp / "peft"));
  const SafetensorsFile st = SafetensorsFile::open(tmp / "peft/adapter_model.safetensors");
  EXPECT_EQ(st.names().size(), 2u * 7 * 2);
  const std::string L = "base_model.model.model.layers.1.";
  EXPECT_EQ(bytes_of(st.read(L + "self_attn.q_proj.lora_A.weight")), bytes_of(st.read(L + "self_attn.k_proj.lora_A.weight")));
  EXPECT_EQ(bytes_of(st.read(L + "self_attn.q_proj.lora_A.weight")), bytes_of(st.read(L + "self_attn.v_proj.lora_A.weight")));
  EXPECT_EQ(bytes_of(st.read(L + "mlp.gate_proj.lora_A.weight")), bytes_of(st.read(L + "mlp.up_proj.lora_A.weight")));
  EXPECT_EQ(st.info(L + "self_attn.q_proj.lora_B.weight").shape, Shape({32, 4}));
  EXPECT_EQ(json::parse(read_file(tmp / "peft/adapter_config.json"))["lora_alpha"], 6);

  // Back as whole layers (the export recorded them and A still repeats): the very same adapters.
  convert_ok("--from peft:" + (tmp / "peft") + " --to loom:" + (tmp / "back") + " --base " + t.base_ri);
  EXPECT_EQ(weights_of(tmp / "back"), adapters_of(t.whole));
  EXPECT_EQ(lora_block(tmp / "back/iter_0000000"), lora_block(t.whole + "/iter_0000004"));

  // Without that record (as PEFT saves it) the modules come back as slices, which merge to the same weights.
  fs::create_directories(tmp / "plain");
  fs::copy_file(tmp / "peft/adapter_config.json", tmp / "plain/adapter_config.json");
  std::vector<Tensor> keep;
  NamedTensors all;
  for (const std::string& n : st.names()) {
    keep.push_back(st.read(n));
    all.emplace_back(n, keep.back());
  }
  write_safetensors(tmp / "plain/adapter_model.safetensors", all, {{"format", "pt"}});
  convert_ok("--from peft:" + (tmp / "plain") + " --to loom:" + (tmp / "sliced") + " --base " + t.base_ri);
  EXPECT_EQ(lora_block(tmp / "sliced/iter_0000000")["target_modules"],
            json({"linear_proj", "linear_fc2", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}));
  convert_ok("--from loom:" + t.whole + " --merge-lora --to loom:" + (tmp / "merged_whole"));
  convert_ok("--from loom:" + (tmp / "sliced") + " --merge-lora --to loom:" + (tmp / "merged_sliced"));
  EXPECT_EQ(weights_of(tmp / "merged_whole"), weights_of(tmp / "merged_sliced"));
}

TEST(LoraIo, PeftAdaptersOnTheHfBaseGiveLoomsMergedWeights) {
  Trained& t = trained();
  if (access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "/usr/bin/python3 not found";
  TempDir tmp("peft_py");
  const std::pair<std::string, std::string> cases[] = {{t.slices, t.base}, {t.whole, t.base_ri}};
  int i = 0;
  for (const auto& [lora, base] : cases) {
    const std::string d = tmp / std::to_string(i++);
    convert_ok("--from loom:" + lora + " --to peft:" + d + "/peft");
    convert_ok("--from loom:" + base + " --to hf:" + d + "/base_hf");
    const CliResult m = run_loom("convert --from loom:" + lora + " --merge-lora --to hf:" + d + "/merged_hf");
    ASSERT_EQ(m.code, 0) << m.err;
    EXPECT_NE(m.out.find("merged LoRA adapters of"), std::string::npos) << m.out;
    const std::string cmd = "/usr/bin/python3 " LOOM_SOURCE_DIR "/tests/golden/peft_merge_check.py " + d + "/peft " +
                            d + "/base_hf " + d + "/merged_hf > " + d + "/py.log 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << read_file(d + "/py.log");
    EXPECT_NE(read_file(d + "/py.log").find("ok: 14 adapted weights"), std::string::npos) << read_file(d + "/py.log");
  }
}

TEST(LoraIo, MergedModelAndImportedAdaptersTrainLikeTheAdapters) {
  Trained& t = trained();
  TempDir tmp("merged_loss");
  convert_ok("--from loom:" + t.slices + " --merge-lora --to loom:" + (tmp / "merged"));
  // First-iteration losses: the forward before any update, on the same batch.
  const Args one = llama(1);
  const Args slices_eval = {"--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0", "--lora-target-modules",
                            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  const double adapted = train(cat(cat(one, slices_eval), {"--load", t.slices, "--finetune"})).losses.at(0);
  const double merged = train(cat(one, {"--load", tmp / "merged", "--finetune"})).losses.at(0);
  const double base = train(cat(one, {"--load", t.base, "--finetune"})).losses.at(0);
  EXPECT_NEAR(merged, adapted, 1e-5 * std::abs(adapted));
  EXPECT_GT(std::abs(base - adapted), 1e-3) << "the adapters changed nothing: base " << base << ", adapted " << adapted;

  // A PEFT adapter imported as a Loom LoRA checkpoint trains on from exactly where the original stands.
  convert_ok("--from loom:" + t.slices + " --to peft:" + (tmp / "peft"));
  convert_ok("--from peft:" + (tmp / "peft") + " --to loom:" + (tmp / "imported") + " --base " + t.base);
  const Args three = cat(llama(3), slices_eval);
  std::string log;
  const TrainResult from_import = train(cat(three, {"--load", tmp / "imported", "--finetune"}), &log);
  EXPECT_NE(log.find("LoRA base (frozen)"), std::string::npos) << log;
  const TrainResult from_original = train(cat(three, {"--load", t.slices, "--finetune"}));
  ASSERT_EQ(from_import.losses.size(), 3u);
  EXPECT_EQ(from_import.losses, from_original.losses);
  EXPECT_EQ(from_import.losses[0], adapted);
  // The same adapters imported onto the base's Hugging Face export (the checkpoint's base is then an HF
  // directory, loaded with the training run's vocabulary padding): the same run again.
  convert_ok("--from loom:" + t.base + " --to hf:" + (tmp / "base_hf"));
  convert_ok("--from peft:" + (tmp / "peft") + " --to loom:" + (tmp / "imported_hf") + " --base " + (tmp / "base_hf"));
  EXPECT_EQ(lora_block(tmp / "imported_hf/iter_0000000")["base"], abs_path(tmp / "base_hf"));
  EXPECT_EQ(train(cat(three, {"--load", tmp / "imported_hf", "--finetune"})).losses, from_original.losses);
  // Without --finetune the missing optimizer state is named.
  EXPECT_NE(train_error(cat(three, {"--load", tmp / "imported"})).find("--no-load-optim"), std::string::npos);
}

TEST(LoraIo, GenerateMergesAdaptersIntoTheBase) {
  Trained& t = trained();
  TempDir tmp("lora_generate");
  for (const auto& [lora, base] : {std::pair{t.slices, t.base}, std::pair{t.whole, t.base_ri}}) {
    const std::string d = tmp / fs::path(lora).filename().string();
    convert_ok("--from loom:" + lora + " --merge-lora --to loom:" + d + "/merged");
    const CliResult with = run_loom("generate --load " + lora + kNull);
    ASSERT_EQ(with.code, 0) << with.err;
    EXPECT_NE(with.err.find("merged LoRA adapters of"), std::string::npos) << with.err;
    const CliResult merged = run_loom("generate --load " + d + "/merged" + kNull);
    const CliResult plain = run_loom("generate --load " + base + kNull);
    ASSERT_EQ(merged.code, 0) << merged.err;
    EXPECT_EQ(with.out, merged.out);
    EXPECT_NE(with.out, plain.out) << "the adapters did not change the greedy continuation";
    // The base named explicitly, here as its Hugging Face export (bit-exact weights): the same tokens.
    convert_ok("--from loom:" + base + " --to hf:" + d + "/base_hf");
    EXPECT_EQ(run_loom("generate --load " + lora + " --pretrained-checkpoint " + d + "/base_hf" + kNull).out, with.out);
  }
  expect_one_line_error(run_loom("generate --load " + t.base + " --pretrained-checkpoint " + t.base + kNull),
                        "is a full model");
}

TEST(LoraIo, BadPeftDirectoriesAndFlagsFailWithOneLine) {
  Trained& t = trained();
  TempDir tmp("peft_errors");
  const std::string peft = tmp / "peft";
  convert_ok("--from loom:" + t.slices + " --to peft:" + peft);
  const json cfg = json::parse(read_file(peft + "/adapter_config.json"));
  const SafetensorsFile st = SafetensorsFile::open(peft + "/adapter_model.safetensors");
  int n = 0;
  // A copy of the PEFT directory with its config edited and its tensors renamed / added.
  auto variant = [&](const json& c, const std::string& rename_from = "", const std::string& rename_to = "") {
    const std::string d = tmp / ("v" + std::to_string(n++));
    fs::create_directories(d);
    std::ofstream(d + "/adapter_config.json") << c.dump(2);
    std::vector<Tensor> keep;
    NamedTensors all;
    for (const std::string& name : st.names()) {
      keep.push_back(st.read(name));
      all.emplace_back(name == rename_from ? rename_to : name, keep.back());
    }
    write_safetensors(d + "/adapter_model.safetensors", all, {{"format", "pt"}});
    return d;
  };
  const std::string to = " --to loom:" + (tmp / "out") + " --base " + t.base;
  const std::string q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";

  fs::create_directories(tmp / "empty");
  convert_fails("--from peft:" + (tmp / "empty") + to, {"has no adapter_config.json"});
  convert_fails("--from peft:" + variant(cfg, q_a, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") + to,
                {"unknown key", "lora_A.default.weight", "'.default'"});
  json c = cfg;
  c["r"] = 8;
  convert_fails("--from peft:" + variant(c) + to, {"adapter_model.safetensors", "has rank 4", "r = 8"});
  c = cfg;
  c["target_modules"] = {"q_proj", "lm_head"};
  convert_fails("--from peft:" + variant(c) + to, {"adapter_config.json", "'lm_head'", "no LoRA place"});
  c = cfg;
  c["use_rslora"] = true;
  convert_fails("--from peft:" + variant(c) + to, {"use_rslora", "alpha / r"});
  c = cfg;
  c["target_modules"] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"};
  convert_fails("--from peft:" + variant(c) + to, {"unknown key", "down_proj"});
  c = cfg;
  c["base_model_name_or_path"] = "meta-llama/Llama-3.2-1B";
  convert_fails("--from peft:" + variant(c) + " --to loom:" + (tmp / "out"), {"needs --base", "meta-llama/Llama-3.2-1B"});
  // Adapters of another shape than the base's: a wider model.
  Args wide = llama(1);
  wide[3] = "48";  // --hidden-size
  ASSERT_EQ(train(cat(wide, {"--save", tmp / "wide"})).final_iteration, 1);
  convert_fails("--from peft:" + peft + " --to loom:" + (tmp / "out") + " --base " + (tmp / "wide"),
                {"adapter_model.safetensors", "down_proj.lora_B.weight", "has shape (32, 4)", "(48, 4)"});
  convert_fails("--from peft:" + peft + " --to loom:" + (tmp / "out") + " --base " + t.base +
                    " --make-vocab-size-divisible-by 64",
                {"--make-vocab-size-divisible-by applies to a Hugging Face base"});

  // Flag combinations and checkpoints of the wrong kind.
  convert_fails("--from loom:" + t.slices + " --to hf:" + (tmp / "x"), {"LoRA checkpoint", "--merge-lora"});
  convert_fails("--from loom:" + t.base + " --merge-lora --to hf:" + (tmp / "x"), {"full model checkpoint"});
  convert_fails("--from loom:" + t.slices + " --to loom:" + (tmp / "x"), {"add --merge-lora"});
  convert_fails("--from hf:" + t.base + " --to peft:" + (tmp / "x"), {"does not go from hf: to peft:"});
  convert_fails("--from loom:" + t.slices + " --to peft:" + (tmp / "x") + " --dtype bf16", {"--dtype applies to --to hf:DIR"});
  convert_fails("--from loom:" + t.slices + " --merge-lora --to peft:" + (tmp / "x"), {"--merge-lora writes a full model"});
  convert_fails("--from peft:" + peft + " --to loom:" + (tmp / "x") + " --base " + t.slices, {"is a LoRA checkpoint"});
  convert_fails("--from loom:" + t.slices + " --to peft:" + peft, {"already exists"});

  // GPT-2 adapters have no PEFT mapping here (its attention is one Conv1D c_attn); merging them works.
  const Args gpt2 = {"--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                     "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "1", "--mock-data",
                     "--vocab-size", "50", "--eval-iters", "0", "--lr", "1e-3"};
  ASSERT_EQ(train(cat(gpt2, {"--save", tmp / "g_base"})).final_iteration, 1);
  ASSERT_EQ(train(cat(gpt2, {"--lora-rank", "2", "--load", tmp / "g_base", "--save", tmp / "g_lora"})).final_iteration, 1);
  convert_fails("--from loom:" + (tmp / "g_lora") + " --to peft:" + (tmp / "g_peft"), {"GPT-2", "c_attn", "--merge-lora"});
  convert_ok("--from loom:" + (tmp / "g_lora") + " --merge-lora --to hf:" + (tmp / "g_hf"));
}
