// Hugging Face model directories: single-file and sharded round trips (every tensor's bytes identical,
// transformers' shard names, split rule and index format), config.json parsing for gpt2/llama/mistral
// (defaults, rope_scaling, errors naming the file and the field), and an index that disagrees with its
// shards in each way the reader must catch.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ckpt_test_util.h"
#include "loom/ckpt/hf_dir.h"

namespace loom {
namespace {

using namespace ckpt_test;

namespace fs = std::filesystem;

const char* kGpt2Config = R"({
  "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50, "n_positions": 16,
  "n_embd": 8, "n_layer": 2, "n_head": 2, "n_inner": null, "layer_norm_epsilon": 1e-05,
  "activation_function": "gelu_new", "bos_token_id": 49, "eos_token_id": 49, "torch_dtype": "float32"
})";

const char* kLlama31Config = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu",
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false, "torch_dtype": "bfloat16",
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]
})";

class HfDirTest : public ckpt_test::TempDirTest {};

// A config.json text with `key` replaced (or removed when value is empty).
std::string edit_config(const std::string& base, const std::string& key, const std::string& value_json) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(base);
  if (value_json.empty()) j.erase(key);
  else j[key] = nlohmann::ordered_json::parse(value_json);
  return j.dump();
}

struct Owned {
  std::vector<std::pair<std::string, Tensor>> tensors;
  NamedTensors views() const {
    NamedTensors v;
    for (const auto& [n, t] : tensors) v.emplace_back(n, t.view());
    return v;
  }
};

void expect_same_contents(const HfCheckpoint& ck, const Owned& owned) {
  ASSERT_EQ(ck.names().size(), owned.tensors.size());
  for (const auto& [name, t] : owned.tensors) {
    ASSERT_TRUE(ck.contains(name)) << name;
    EXPECT_EQ(ck.info(name).shape, t.shape()) << name;
    EXPECT_TRUE(same_bytes(ck.read(name, t.dtype()), t)) << name;
    Tensor dst = Tensor::empty(t.shape(), t.dtype());
    ck.read_into(name, dst);
    EXPECT_TRUE(same_bytes(dst, t)) << name;
  }
}

TEST_F(HfDirTest, SingleFileRoundTrip) {
  Owned owned{{{"transformer.wte.weight", make_bytes({50, 8}, DType::kF32, 1)},
               {"transformer.h.0.attn.c_attn.weight", make_bytes({8, 24}, DType::kBF16, 2)},
               {"transformer.h.0.ln_1.bias", make_bytes({8}, DType::kF16, 3)},
               {"scalar", make_bytes({}, DType::kF32, 4)},
               {"empty", Tensor::empty({0, 3}, DType::kF32)},
               {"ids", make_bytes({3}, DType::kI64, 5)}}};
  const std::string dir = file("gpt2");
  write_hf_dir(dir, kGpt2Config, owned.views(), kHfDefaultMaxShardBytes,
               {{"generation_config.json", "{\"do_sample\": false}\n"}});
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir + ".loom-staging"));
  EXPECT_EQ(read_file(dir + "/config.json"), kGpt2Config);
  EXPECT_EQ(read_file(dir + "/generation_config.json"), "{\"do_sample\": false}\n");
  EXPECT_EQ(SafetensorsFile::open(dir + "/model.safetensors").metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}}));

  const HfCheckpoint ck = HfCheckpoint::open(dir);
  EXPECT_FALSE(ck.sharded());
  EXPECT_EQ(ck.config().model_type, "gpt2");
  EXPECT_EQ(ck.config().raw_json, kGpt2Config);
  EXPECT_EQ(ck.file_of("ids"), dir + "/model.safetensors");
  int64_t total = 0;
  for (const auto& [n, t] : owned.tensors) total += t.nbytes();
  EXPECT_EQ(ck.total_bytes(), total);
  const std::vector<std::string> names = ck.names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  expect_same_contents(ck, owned);
  // A converting read goes through the shard's conversion rules.
  Tensor f32 = ck.read("transformer.h.0.ln_1.bias", DType::kF32);
  EXPECT_EQ(f32.data<float>()[1], f16_to_f32(owned.tensors[2].second.data<uint16_t>()[1]));
  expect_user_error([&] { ck.info("nope"); }, {dir, "no tensor named 'nope'"});
}

// Every shard Loom writes records checksums; a damaged tensor fails both reads with an error naming the
// directory, the file and the tensor; a directory from another tool (no checksums) reads with a note.
TEST_F(HfDirTest, ChecksumsAreVerifiedOnRead) {
  Owned owned{{{"transformer.wte.weight", make_bytes({50, 8}, DType::kF32, 1)},
               {"transformer.wpe.weight", make_bytes({16, 8}, DType::kF32, 2)},
               {"transformer.ln_f.bias", make_bytes({8}, DType::kF32, 3)}}};
  const std::string dir = file("gpt2");
  write_hf_dir(dir, kGpt2Config, owned.views(), 700);  // three shards
  HfCheckpoint ck = HfCheckpoint::open(dir);
  ASSERT_TRUE(ck.sharded());
  EXPECT_EQ(ck.checksum_note(), "");
  const std::string shard = ck.file_of("transformer.wpe.weight");
  ckpt_test::overwrite_tensor_bytes(shard, "transformer.wpe.weight", 100, ckpt_test::nan_bytes(4));
  for (int k = 0; k < 2; ++k) {
    try {
      if (k == 0) {
        ck.read("transformer.wpe.weight", DType::kBF16);
      } else {
        Tensor dst = Tensor::empty({16, 8}, DType::kF32);
        ck.read_into("transformer.wpe.weight", dst);
      }
      ADD_FAILURE() << "read a damaged tensor";
    } catch (const ChecksumError& e) {
      for (const std::string& p : {"Hugging Face model directory " + dir + " is damaged", shard,
                                   std::string("tensor 'transformer.wpe.weight'"), std::string("checksum mismatch")})
        EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(same_bytes(ck.read("transformer.wte.weight", DType::kF32), owned.tensors[0].second));

  ckpt_test::strip_checksums(shard);
  ck = HfCheckpoint::open(dir);
  EXPECT_NE(ck.checksum_note().find(fs::path(shard).filename().string() + " records no checksums"), std::string::npos)
      << ck.checksum_note();
  (void)ck.read("transformer.wpe.weight", DType::kF32);  // unverified: the NaNs come through
}

TEST_F(HfDirTest, ShardedRoundTripFollowsTransformersSplit) {
  // 40-byte tensors a, b, d, e and a 200-byte c with a 100-byte limit: transformers puts c alone
  // (bigger than the limit) as soon as it is seen, then [a, b] and [d, e].
  Owned owned{{{"a", make_bytes({10}, DType::kF32, 1)},
               {"b", make_bytes({20}, DType::kBF16, 2)},
               {"c", make_bytes({50}, DType::kF32, 3)},
               {"d", make_bytes({5}, DType::kI64, 4)},
               {"e", make_bytes({40}, DType::kF8E4M3, 5)}}};
  const std::string dir = file("llama");
  write_hf_dir(dir + "/", kLlama31Config, owned.views(), 100);
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir + ".loom-staging"));
  const std::string s1 = "model-00001-of-00003.safetensors", s2 = "model-00002-of-00003.safetensors",
                    s3 = "model-00003-of-00003.safetensors";
  for (const auto& s : {s1, s2, s3}) EXPECT_TRUE(fs::exists(dir + "/" + s)) << s;

  const std::string index_text = read_file(dir + "/model.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(index_text);
  EXPECT_EQ(index["metadata"]["total_size"], 200 + 4 * 40);
  EXPECT_EQ(index["weight_map"], (nlohmann::json{{"a", s2}, {"b", s2}, {"c", s1}, {"d", s3}, {"e", s3}}));
  // transformers' json.dumps(indent=2, sort_keys=True) + "\n".
  EXPECT_EQ(index_text.rfind("{\n  \"metadata\": {\n    \"total_size\": 360\n  },\n  \"weight_map\": {\n    \"a\": ", 0),
            0u)
      << index_text;
  EXPECT_EQ(index_text.back(), '\n');

  const HfCheckpoint ck = HfCheckpoint::open(dir);
  EXPECT_TRUE(ck.sharded());
  EXPECT_EQ(ck.total_bytes(), 360);
  EXPECT_EQ(ck.file_of("c"), dir + "/" + s1);
  EXPECT_EQ(ck.file_of("e"), dir + "/" + s3);
  expect_same_contents(ck, owned);
  EXPECT_EQ(ck.config().rope_scaling->original_max_position_embeddings, 8192);
}

TEST_F(HfDirTest, WriterRefusesToClobberAndLeavesNothingOnError) {
  Owned owned{{{"w", make_bytes({4}, DType::kF32, 1)}}};
  const std::string dir = file("out");
  fs::create_directories(dir);  // an empty directory may be replaced
  write_hf_dir(dir, kGpt2Config, owned.views());
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
  expect_user_error([&] { write_hf_dir(dir, kGpt2Config, owned.views()); }, {dir, "not an empty directory"});

  const std::string bad = file("bad");
  expect_user_error([&] { write_hf_dir(bad, edit_config(kGpt2Config, "n_embd", ""), owned.views()); },
                    {"config.json", "missing field 'n_embd'"});
  expect_user_error([&] { write_hf_dir(bad, kGpt2Config, {{"w", owned.tensors[0].second}, {"w", owned.tensors[0].second}}); },
                    {"'w'", "twice"});
  expect_user_error([&] { write_hf_dir(bad, kGpt2Config, owned.views(), 100, {{"config.json", "{}"}}); },
                    {"extra file 'config.json'"});
  expect_user_error([&] { write_hf_dir(bad, kGpt2Config, owned.views(), 0); }, {"max shard size"});
  EXPECT_FALSE(fs::exists(bad));
  EXPECT_FALSE(fs::exists(bad + ".loom-staging"));
}

// ---- config.json ------------------------------------------------------------------------------

TEST(HfConfigTest, Gpt2FieldsAndDefaults) {
  const HfConfig c = parse_hf_config(kGpt2Config);
  EXPECT_TRUE(c.is_gpt2());
  EXPECT_EQ(c.vocab_size, 50);
  EXPECT_EQ(c.max_position_embeddings, 16);
  EXPECT_EQ(c.hidden_size, 8);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 2);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_EQ(c.intermediate_size, 32);  // n_inner null -> 4 * n_embd
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_EQ(c.activation, "gelu_new");
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.attention_bias && c.mlp_bias);
  EXPECT_EQ(c.torch_dtype, "float32");
  EXPECT_EQ(c.bos_token_id, 49);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{49});
  EXPECT_FALSE(c.rope_scaling.has_value());

  const HfConfig d = parse_hf_config(edit_config(edit_config(kGpt2Config, "n_inner", "20"), "tie_word_embeddings",
                                                 "false"));
  EXPECT_EQ(d.intermediate_size, 20);
  EXPECT_FALSE(d.tie_word_embeddings);
  const HfConfig e = parse_hf_config(edit_config(edit_config(kGpt2Config, "layer_norm_epsilon", ""),
                                                 "activation_function", ""));
  EXPECT_DOUBLE_EQ(e.norm_eps, 1e-5);
  EXPECT_EQ(e.activation, "gelu_new");
}

TEST(HfConfigTest, LlamaAndMistral) {
  const HfConfig c = parse_hf_config(kLlama31Config);
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->rope_type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->high_freq_factor, 4.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));

  // Llama 2 style: no num_key_value_heads, no rope_theta, old "type" key, explicit head_dim.
  std::string l2 = edit_config(edit_config(kLlama31Config, "num_key_value_heads", ""), "rope_theta", "");
  l2 = edit_config(l2, "rope_scaling", "null");
  const HfConfig d = parse_hf_config(l2);
  EXPECT_EQ(d.num_key_value_heads, 32);
  EXPECT_DOUBLE_EQ(d.rope_theta, 10000.0);
  EXPECT_FALSE(d.rope_scaling.has_value());
  const HfConfig e = parse_hf_config(edit_config(
      edit_config(kLlama31Config, "head_dim", "64"), "rope_scaling",
      R"({"type": "llama3", "factor": 32, "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192})"));
  EXPECT_EQ(e.head_dim, 64);
  EXPECT_DOUBLE_EQ(e.rope_scaling->factor, 32.0);
  EXPECT_TRUE(parse_hf_config(edit_config(kLlama31Config, "attention_bias", "true")).attention_bias);

  std::string m = edit_config(kLlama31Config, "model_type", "\"mistral\"");
  m = edit_config(edit_config(m, "rope_scaling", ""), "sliding_window", "4096");
  EXPECT_EQ(parse_hf_config(m).sliding_window, 4096);
  EXPECT_FALSE(parse_hf_config(edit_config(m, "sliding_window", "null")).sliding_window.has_value());
  EXPECT_EQ(parse_hf_config(edit_config(m, "sliding_window", "")).sliding_window, 4096);  // MistralConfig default
  expect_user_error([&] { parse_hf_config(edit_config(m, "num_key_value_heads", "")); },
                    {"missing field 'num_key_value_heads'"});
}

TEST(HfConfigTest, MalformedConfigsNameTheField) {
  const std::string g = kGpt2Config, l = kLlama31Config;
  struct Case {
    const char* label;
    std::string text;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"invalid json", "{\"model_type\": \"gpt2\",", {"not valid JSON"}},
      {"not an object", "[1, 2]", {"JSON object"}},
      {"no model_type", edit_config(g, "model_type", ""), {"missing field 'model_type'"}},
      {"model_type not string", edit_config(g, "model_type", "7"), {"field 'model_type'", "expected a string"}},
      {"unknown model_type", edit_config(g, "model_type", "\"bert\""),
       {"field 'model_type'", "'bert' is not supported", "gpt2, llama, mistral"}},
      {"missing n_embd", edit_config(g, "n_embd", ""), {"missing field 'n_embd'"}},
      {"n_layer a string", edit_config(g, "n_layer", "\"12\""), {"field 'n_layer'", "expected an integer", "\"12\""}},
      {"n_head zero", edit_config(g, "n_head", "0"), {"field 'n_head'", "expected an integer in [1, "}},
      {"n_head float", edit_config(g, "n_head", "2.5"), {"field 'n_head'"}},
      {"vocab too big", edit_config(g, "vocab_size", "99999999999"), {"field 'vocab_size'"}},
      {"heads do not divide", edit_config(g, "n_head", "3"), {"field 'n_head'", "not divisible"}},
      {"null n_positions", edit_config(g, "n_positions", "null"), {"field 'n_positions'", "null"}},
      {"eps negative", edit_config(g, "layer_norm_epsilon", "-1"), {"field 'layer_norm_epsilon'", "positive"}},
      {"tie not bool", edit_config(g, "tie_word_embeddings", "1"), {"field 'tie_word_embeddings'", "true or false"}},
      {"activation not string", edit_config(g, "activation_function", "1"), {"field 'activation_function'"}},
      {"duplicate key", "{\"model_type\": \"gpt2\", \"model_type\": \"llama\"}", {"'model_type' appears twice"}},
      {"missing rms_norm_eps", edit_config(l, "rms_norm_eps", ""), {"missing field 'rms_norm_eps'"}},
      {"missing intermediate", edit_config(l, "intermediate_size", ""), {"missing field 'intermediate_size'"}},
      {"kv heads do not divide", edit_config(l, "num_key_value_heads", "5"), {"field 'num_key_value_heads'"}},
      {"rope_theta string", edit_config(l, "rope_theta", "\"1e4\""), {"field 'rope_theta'"}},
      {"rope scaling linear", edit_config(l, "rope_scaling", R"({"type": "linear", "factor": 2.0})"),
       {"field 'rope_scaling.type'", "'linear' is not supported"}},
      {"rope scaling no type", edit_config(l, "rope_scaling", R"({"factor": 2.0})"),
       {"field 'rope_scaling'", "rope_type"}},
      {"rope scaling missing factor",
       edit_config(l, "rope_scaling", R"({"rope_type": "llama3", "low_freq_factor": 1, "high_freq_factor": 4,
                                          "original_max_position_embeddings": 8192})"),
       {"missing field 'rope_scaling.factor'"}},
      {"rope scaling low >= high",
       edit_config(l, "rope_scaling", R"({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                                          "high_freq_factor": 4, "original_max_position_embeddings": 8192})"),
       {"field 'rope_scaling.high_freq_factor'"}},
      {"rope scaling not object", edit_config(l, "rope_scaling", "[1]"), {"field 'rope_scaling'"}},
      {"odd head_dim", edit_config(l, "head_dim", "127"), {"field 'head_dim'", "even"}},
      {"eos list of strings", edit_config(l, "eos_token_id", "[1, \"2\"]"), {"field 'eos_token_id'"}},
      {"bos negative", edit_config(l, "bos_token_id", "-1"), {"field 'bos_token_id'"}},
      {"torch_dtype number", edit_config(l, "torch_dtype", "16"), {"field 'torch_dtype'"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    try {
      parse_hf_config(c.text, "some/dir/config.json");
      ADD_FAILURE() << "accepted a malformed config";
    } catch (const UserError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("some/dir/config.json: ", 0), 0u) << msg;
      for (const std::string& p : c.expect) EXPECT_NE(msg.find(p), std::string::npos) << msg << "\nmissing: " << p;
    }
  }
}

// ---- directories that disagree with themselves --------------------------------------------------

class HfIndexTest : public HfDirTest {
 protected:
  // A valid three-shard directory (see ShardedRoundTripFollowsTransformersSplit for the layout).
  std::string make_sharded() {
    owned_ = Owned{{{"a", make_bytes({10}, DType::kF32, 1)},
                    {"b", make_bytes({20}, DType::kBF16, 2)},
                    {"c", make_bytes({50}, DType::kF32, 3)},
                    {"d", make_bytes({5}, DType::kI64, 4)},
                    {"e", make_bytes({40}, DType::kF8E4M3, 5)}}};
    const std::string dir = file("m");
    write_hf_dir(dir, kLlama31Config, owned_.views(), 100);
    return dir;
  }
  void set_map(const std::string& dir, const nlohmann::json& weight_map) {
    nlohmann::json idx = {{"metadata", {{"total_size", 360}}}, {"weight_map", weight_map}};
    write_file(dir + "/model.safetensors.index.json", idx.dump(2));
  }
  Owned owned_;
};

const std::string kS1 = "model-00001-of-00003.safetensors", kS2 = "model-00002-of-00003.safetensors",
                  kS3 = "model-00003-of-00003.safetensors";

TEST_F(HfIndexTest, MissingShard) {
  const std::string dir = make_sharded();
  fs::remove(dir + "/" + kS3);
  expect_user_error([&] { HfCheckpoint::open(dir); },
                    {"model.safetensors.index.json", "'" + kS3 + "'", "does not exist"});
}

TEST_F(HfIndexTest, TensorListedInTheWrongShard) {
  const std::string dir = make_sharded();
  set_map(dir, {{"a", kS3}, {"b", kS2}, {"c", kS1}, {"d", kS3}, {"e", kS3}});
  expect_user_error([&] { HfCheckpoint::open(dir); }, {"tensor 'a'", "in '" + kS3 + "'", "but it is in '" + kS2 + "'"});
  // Moved to a shard the index otherwise never names: that shard is not opened, so "not in any".
  set_map(dir, {{"a", kS2}, {"b", kS2}, {"c", kS3}, {"d", kS3}, {"e", kS3}});
  expect_user_error([&] { HfCheckpoint::open(dir); }, {"tensor 'c'", "in '" + kS3 + "'", "none of the shards"});
}

TEST_F(HfIndexTest, TensorListedTwiceInTheMap) {
  const std::string dir = make_sharded();
  write_file(dir + "/model.safetensors.index.json",
       "{\"weight_map\": {\"a\": \"" + kS2 + "\", \"b\": \"" + kS2 + "\", \"c\": \"" + kS1 + "\", \"d\": \"" + kS3 +
           "\", \"e\": \"" + kS3 + "\", \"a\": \"" + kS3 + "\"}}");
  expect_user_error([&] { HfCheckpoint::open(dir); }, {"model.safetensors.index.json", "'a' appears twice"});
}

TEST_F(HfIndexTest, TensorStoredInTwoShards) {
  const std::string dir = make_sharded();
  // Shard 3 rewritten to hold a copy of "a" as well.
  write_safetensors(dir + "/" + kS3, {{"d", owned_.tensors[3].second}, {"e", owned_.tensors[4].second},
                                      {"a", owned_.tensors[0].second}});
  expect_user_error([&] { HfCheckpoint::open(dir); }, {"tensor 'a' is stored twice", kS2, kS3});
}

TEST_F(HfIndexTest, ShardTensorMissingFromTheMap) {
  const std::string dir = make_sharded();
  set_map(dir, {{"a", kS2}, {"b", kS2}, {"c", kS1}, {"d", kS3}});
  expect_user_error([&] { HfCheckpoint::open(dir); }, {"shard '" + kS3 + "' holds tensor 'e'", "does not list"});
}

TEST_F(HfIndexTest, MappedTensorThatNoShardHolds) {
  const std::string dir = make_sharded();
  set_map(dir, {{"a", kS2}, {"b", kS2}, {"c", kS1}, {"d", kS3}, {"e", kS3}, {"f", kS3}});
  expect_user_error([&] { HfCheckpoint::open(dir); }, {"tensor 'f'", "none of the shards the index names holds it"});
}

TEST_F(HfIndexTest, MalformedIndexAndDirectory) {
  const std::string dir = make_sharded();
  const std::string idx = dir + "/model.safetensors.index.json";
  write_file(idx, "{\"weight_map\": ");
  expect_user_error([&] { HfCheckpoint::open(dir); }, {idx, "not valid JSON"});
  write_file(idx, "{\"metadata\": {}}");
  expect_user_error([&] { HfCheckpoint::open(dir); }, {idx, "missing field 'weight_map'"});
  write_file(idx, "{\"weight_map\": {}}");
  expect_user_error([&] { HfCheckpoint::open(dir); }, {idx, "lists no tensors"});
  write_file(idx, "{\"weight_map\": {\"a\": 3}}");
  expect_user_error([&] { HfCheckpoint::open(dir); }, {idx, "tensor 'a'", "expected a file name"});
  write_file(idx, "{\"weight_map\": {\"a\": \"../m/" + kS2 + "\"}}");
  expect_user_error([&] { HfCheckpoint::open(dir); }, {idx, "not a plain file name"});
  write_file(idx, "{\"metadata\": {\"total_size\": -5}, \"weight_map\": {\"a\": \"x\"}}");
  expect_user_error([&] { HfCheckpoint::open(dir); }, {idx, "metadata.total_size"});
  EXPECT_EQ(parse_hf_index("{\"metadata\": {\"total_size\": 7.0}, \"weight_map\": {\"a\": \"x\"}}").total_size, 7);

  // A shard that is not a safetensors file: the shard's own reader names it.
  set_map(dir, {{"a", kS2}, {"b", kS2}, {"c", kS1}, {"d", kS3}, {"e", kS3}});
  write_file(dir + "/" + kS1, "garbage!garbage!");
  expect_user_error([&] { HfCheckpoint::open(dir); }, {kS1, "header length"});

  fs::remove(idx);
  expect_user_error([&] { HfCheckpoint::open(dir); }, {"neither model.safetensors nor model.safetensors.index.json"});
  fs::remove(dir + "/config.json");
  expect_user_error([&] { HfCheckpoint::open(dir); }, {dir + "/config.json", "does not exist"});
  expect_user_error([&] { HfCheckpoint::open(file("nowhere")); }, {"nowhere", "does not exist"});
  write_file(dir + "/config.json", "{\"model_type\": \"gpt2\"}");
  expect_user_error([&] { HfCheckpoint::open(dir); }, {dir + "/config.json: missing field 'vocab_size'"});
}

}  // namespace
}  // namespace loom
