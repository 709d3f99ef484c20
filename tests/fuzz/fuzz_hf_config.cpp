// libFuzzer target: arbitrary bytes as the files of a Hugging Face model directory. Byte 0 picks what
// the rest is (mod 3):
//   0  config.json's text, parsed by parse_hf_config (and, when accepted, by HfCheckpoint::open of a
//      directory holding it next to a valid model.safetensors)
//   1  model.safetensors, next to a valid config.json
//   2  u16 LE n, n bytes of model.safetensors.index.json, u16 LE m, m bytes of shard 1, the rest shard 2
//      (files model-00001-of-00002.safetensors and model-00002-of-00002.safetensors)
// Bad input must end in a UserError. A directory that opens must be self-consistent (every listed tensor
// readable, sizes adding up), and writing its tensors back with write_hf_dir (shard limit from byte 1)
// must give a directory that opens to the same bytes.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "loom/ckpt/hf_dir.h"
#include "loom/core/check.h"
#include "fuzz_util.h"

namespace fs = std::filesystem;

namespace {

using fuzz_util::require;

const char* kConfig =
    R"({"model_type": "gpt2", "vocab_size": 8, "n_positions": 4, "n_embd": 4, "n_layer": 1, "n_head": 2})";

const fs::path& dir() { return fuzz_util::scratch_dir("hf"); }

struct ScratchDir : fuzz_util::Scratch {
  ScratchDir() : Scratch(dir(), "in") {}
};


bool same_bytes(const loom::Tensor& a, const loom::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())) == 0);
}

uint16_t u16(const uint8_t*& p, size_t& n) {
  if (n < 2) {
    n = 0;
    return 0;
  }
  const uint16_t v = uint16_t(p[0] | (p[1] << 8));
  p += 2;
  n -= 2;
  return v;
}

// Checks an opened directory and round-trips it through the writer.
void exercise(const std::string& in_dir, uint8_t shard_knob) {
  const loom::HfCheckpoint ck = loom::HfCheckpoint::open(in_dir);
  const loom::HfConfig& c = ck.config();
  require(c.vocab_size > 0 && c.hidden_size > 0 && c.num_hidden_layers > 0 && c.head_dim > 0, "positive shape");
  require(c.num_attention_heads % c.num_key_value_heads == 0, "kv heads divide heads");
  require(c.norm_eps > 0, "positive eps");
  int64_t total = 0;
  std::vector<std::pair<std::string, loom::Tensor>> owned;
  bool all_loom_types = true;
  for (const std::string& name : ck.names()) {
    const loom::SafetensorsInfo& info = ck.info(name);
    require(info.nbytes() >= 0, "non-negative size");
    total += info.nbytes();
    if (!info.dtype) {
      all_loom_types = false;
      try {
        (void)ck.read(name, loom::DType::kF32);  // F64 converts; integer types must refuse
      } catch (const loom::UserError&) {
      }
      continue;
    }
    loom::Tensor t = ck.read(name, *info.dtype);
    require(t.nbytes() == info.nbytes(), "read size");
    owned.emplace_back(name, std::move(t));
  }
  require(total == ck.total_bytes(), "total bytes");
  if (!all_loom_types) return;

  loom::NamedTensors views;
  for (const auto& [n, t] : owned) views.emplace_back(n, t.view());
  const std::string out = (dir() / "out").string();
  write_hf_dir(out, c.raw_json, views, 1 + shard_knob * 4);
  const loom::HfCheckpoint back = loom::HfCheckpoint::open(out);
  require(back.names() == ck.names(), "same names after writing");
  for (const auto& [n, t] : owned) require(same_bytes(back.read(n, t.dtype()), t), "same bytes after writing");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int mode = data[0] % 3;
  const uint8_t knob = data[1];
  const uint8_t* p = data + 2;
  size_t n = size - 2;
  const ScratchDir scratch;
  const fs::path in = dir() / "in";
  try {
    if (mode == 0) {
      const std::string text(reinterpret_cast<const char*>(p), n);
      const loom::HfConfig c = loom::parse_hf_config(text);
      require(c.raw_json == text, "raw json kept");
      fuzz_util::write_file(in / "config.json", p, n);
      const loom::Tensor w = loom::Tensor::zeros({2, 3}, loom::DType::kF32);
      loom::write_safetensors((in / "model.safetensors").string(), {{"w", w}});
    } else if (mode == 1) {
      fuzz_util::write_file(in / "config.json", reinterpret_cast<const uint8_t*>(kConfig), std::strlen(kConfig));
      fuzz_util::write_file(in / "model.safetensors", p, n);
    } else {
      fuzz_util::write_file(in / "config.json", reinterpret_cast<const uint8_t*>(kConfig), std::strlen(kConfig));
      size_t len = std::min<size_t>(u16(p, n), n);
      fuzz_util::write_file(in / "model.safetensors.index.json", p, len);
      p += len;
      n -= len;
      len = std::min<size_t>(u16(p, n), n);
      fuzz_util::write_file(in / "model-00001-of-00002.safetensors", p, len);
      p += len;
      n -= len;
      fuzz_util::write_file(in / "model-00002-of-00002.safetensors", p, n);
    }
    exercise(in.string(), knob);
  } catch (const loom::UserError&) {
  }
  return 0;
}
