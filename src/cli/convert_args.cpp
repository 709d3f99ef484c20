// Flag table of `loom convert` (the shared argparse-style parser in train/flags.h). Options that only
// make sense in one direction are errors in the other, never silently ignored.
// Dispatch: hf -> loom and loom -> hf (model_io.h), LoRA checkpoints to and from PEFT and --merge-lora
// (lora_io.h).
#include "cli/convert_args.h"

#include <cctype>
#include <cstdint>
#include <ostream>

#include "loom/core/check.h"
#include "loom/train/flags.h"
#include "loom/train/lora_io.h"

namespace loom {

namespace {

struct Parsed {
  std::string from, to;
  std::vector<std::string> given;  // flags seen, for the direction checks
  ConvertConfig cfg;
};

using Flag = FlagSpec<Parsed>;

const std::vector<Flag>& flags() {
  using V = const std::vector<std::string>&;
  static const std::vector<Flag> table = {
      {{"--from", Arity::kOne, "KIND:DIR",
        "source: hf:DIR (Hugging Face model directory), loom:DIR (Loom checkpoint, LoRA ones included) or "
        "peft:DIR (Hugging Face PEFT LoRA adapter directory)"},
       [](Parsed& p, V v) { p.from = v[0]; }},
      {{"--to", Arity::kOne, "KIND:DIR",
        "destination: loom:DIR (new checkpoint root), hf:DIR or peft:DIR (new directory)"},
       [](Parsed& p, V v) { p.to = v[0]; }},
      {{"--merge-lora", Arity::kSwitch, "",
        "from a LoRA checkpoint: write its base with the adapters merged (W += alpha/rank * B A), to loom: or hf:"},
       [](Parsed& p, V) {
         p.given.push_back("--merge-lora");
         p.cfg.merge_lora = true;
       }},
      {{"--base", Arity::kOne, "DIR",
        "the base model: from peft: the model the adapters belong to (default: base_model_name_or_path when it is "
        "a local directory); --merge-lora: overrides the LoRA checkpoint's base; to peft: base_model_name_or_path"},
       [](Parsed& p, V v) {
         p.given.push_back("--base");
         p.cfg.base = v[0];
       }},
      {{"--dtype", Arity::kOne, "f32|bf16|f16", "to hf: dtype of the written weights (default f32: the exact masters)"},
       [](Parsed& p, V v) {
         p.given.push_back("--dtype");
         if (v[0] == "f32" || v[0] == "fp32" || v[0] == "float32") p.cfg.to_hf.dtype = DType::kF32;
         else if (v[0] == "bf16" || v[0] == "bfloat16") p.cfg.to_hf.dtype = DType::kBF16;
         else if (v[0] == "f16" || v[0] == "fp16" || v[0] == "float16") p.cfg.to_hf.dtype = DType::kF16;
         else user_error("--dtype must be f32, bf16 or f16, got '", v[0], "'");
       }},
      {{"--max-shard-size", Arity::kOne, "BYTES", "to hf: largest shard, e.g. 5GB (default), 500MB, 10KiB or a byte count"},
       [](Parsed& p, V v) {
         p.given.push_back("--max-shard-size");
         p.cfg.to_hf.max_shard_bytes = parse_byte_size(v[0]);
       }},
      {{"--bos-token-id", Arity::kOne, "ID", "to hf: bos_token_id of config.json (default: the one the model came with)"},
       [](Parsed& p, V v) {
         p.given.push_back("--bos-token-id");
         p.cfg.to_hf.bos_token_id = parse_int_flag("--bos-token-id", v[0]);
       }},
      {{"--eos-token-id", Arity::kOne, "ID", "to hf: eos_token_id of config.json (default: the one the model came with)"},
       [](Parsed& p, V v) {
         p.given.push_back("--eos-token-id");
         p.cfg.to_hf.eos_token_ids = {parse_int_flag("--eos-token-id", v[0])};
       }},
      {{"--make-vocab-size-divisible-by", Arity::kOne, "N",
        "to loom from hf: or peft: with an HF base: pad the vocabulary to a multiple of N (default 128, as `loom train`)"},
       [](Parsed& p, V v) {
         p.given.push_back("--make-vocab-size-divisible-by");
         p.cfg.vocab_divisor_given = true;
         p.cfg.to_loom.make_vocab_size_divisible_by = parse_int_flag("--make-vocab-size-divisible-by", v[0]);
       }},
      {{"--rotary-interleaved", Arity::kSwitch, "",
        "to loom from hf: or peft: with an HF base: for training with --rotary-interleaved (q/k rows permuted to pairs (2i, 2i+1))"},
       [](Parsed& p, V) {
         p.given.push_back("--rotary-interleaved");
         p.cfg.to_loom.rotary_interleaved = true;
       }},
  };
  return table;
}

const char* format_name(ConvertFormat f) {
  switch (f) {
    case ConvertFormat::kHf: return "hf";
    case ConvertFormat::kLoom: return "loom";
    case ConvertFormat::kPeft: return "peft";
  }
  return "?";
}

// "hf:DIR" / "loom:DIR" / "peft:DIR" -> (format, DIR)
std::pair<ConvertFormat, std::string> parse_endpoint(const char* flag, const std::string& v) {
  const size_t colon = v.find(':');
  const std::string kind = colon == std::string::npos ? "" : v.substr(0, colon);
  const std::string dir = colon == std::string::npos ? "" : v.substr(colon + 1);
  ConvertFormat f = ConvertFormat::kHf;
  if (kind == "hf") f = ConvertFormat::kHf;
  else if (kind == "loom") f = ConvertFormat::kLoom;
  else if (kind == "peft") f = ConvertFormat::kPeft;
  else
    user_error(flag, " must be hf:DIR (Hugging Face model directory), loom:DIR (Loom checkpoint) or peft:DIR "
               "(Hugging Face PEFT adapter directory), got '", v, "'");
  if (dir.empty()) user_error(flag, " ", kind, ": needs a directory after the colon");
  return {f, dir};
}

}  // namespace

int64_t parse_byte_size(const std::string& s) {
  size_t i = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
  const std::string digits = s.substr(0, i), unit = s.substr(i);
  struct Unit {
    const char* name;
    int64_t bytes;
  };
  const Unit units[] = {{"", 1},          {"B", 1},           {"KB", 1000},       {"MB", 1000 * 1000},
                        {"GB", 1000'000'000}, {"KIB", 1024}, {"MIB", 1024 * 1024}, {"GIB", 1024 * 1024 * 1024}};
  std::string upper;
  for (char c : unit) upper += char(std::toupper(static_cast<unsigned char>(c)));
  for (const Unit& u : units)
    if (upper == u.name && !digits.empty() && digits.size() <= 12) {
      const int64_t n = std::stoll(digits);
      if (n < 1 || n > INT64_MAX / u.bytes) break;
      return n * u.bytes;
    }
  user_error("--max-shard-size must be a positive byte count, optionally with KB, MB, GB, KiB, MiB or GiB "
             "(e.g. 5GB), got '", s, "'");
}

ConvertConfig parse_convert_args(const std::vector<std::string>& args) {
  Parsed p;
  apply_flags(flags(), args, p);
  if (p.from.empty()) user_error("missing required flag --from (hf:DIR or loom:DIR)");
  if (p.to.empty()) user_error("missing required flag --to (loom:DIR or hf:DIR)");
  const auto [from, from_dir] = parse_endpoint("--from", p.from);
  const auto [to, to_dir] = parse_endpoint("--to", p.to);
  using F = ConvertFormat;
  const bool pair_ok = (from == F::kHf && to == F::kLoom) || (from == F::kLoom && to == F::kHf) ||
                       (from == F::kLoom && to == F::kLoom) || (from == F::kLoom && to == F::kPeft) ||
                       (from == F::kPeft && to == F::kLoom);
  if (!pair_ok)
    user_error("loom convert does not go from ", format_name(from), ": to ", format_name(to), ":; it converts hf: -> "
               "loom:, loom: -> hf:, a LoRA checkpoint loom: -> peft: or (--merge-lora) -> loom: | hf:, and peft: -> loom:");
  ConvertConfig cfg = p.cfg;
  cfg.from = from;
  cfg.to = to;
  cfg.from_dir = from_dir;
  cfg.to_dir = to_dir;
  if (from == F::kLoom && to == F::kLoom && !cfg.merge_lora)
    user_error("--from loom: and --to loom: copy nothing; add --merge-lora to merge a LoRA checkpoint's adapters "
               "into its base");
  const bool hf_source = from == F::kHf || from == F::kPeft;  // an HF model (or base) becomes a Loom config
  for (const std::string& f : p.given) {
    const bool hf_only = f == "--dtype" || f == "--max-shard-size" || f == "--bos-token-id" || f == "--eos-token-id";
    const bool loom_only = f == "--make-vocab-size-divisible-by" || f == "--rotary-interleaved";
    if (hf_only && to != F::kHf) user_error(f, " applies to --to hf:DIR only");
    if (loom_only && !(to == F::kLoom && hf_source))
      user_error(f, " applies to --to loom:DIR from hf:DIR or peft:DIR only (a Loom checkpoint's model_config says it)");
    if (f == "--merge-lora" && from != F::kLoom)
      user_error("--merge-lora applies to --from loom:DIR (a LoRA checkpoint) only");
    if (f == "--merge-lora" && to == F::kPeft)
      user_error("--merge-lora writes a full model (--to loom:DIR or hf:DIR); --to peft:DIR writes the adapters as "
                 "they are");
    if (f == "--base" && from == F::kHf) user_error("--base applies to LoRA conversions (peft:, --merge-lora) only");
    if (f == "--base" && from == F::kLoom && to != F::kPeft && !cfg.merge_lora)
      user_error("--base applies to LoRA conversions (peft:, --merge-lora) only");
  }
  if (cfg.to_loom.make_vocab_size_divisible_by < 1)
    user_error("--make-vocab-size-divisible-by must be >= 1, got ", cfg.to_loom.make_vocab_size_divisible_by);
  if (cfg.to_hf.bos_token_id && *cfg.to_hf.bos_token_id < 0)
    user_error("--bos-token-id must be >= 0, got ", *cfg.to_hf.bos_token_id);
  for (const int64_t id : cfg.to_hf.eos_token_ids)
    if (id < 0) user_error("--eos-token-id must be >= 0, got ", id);
  return cfg;
}

std::string convert_help() {
  return specs_help(
      "usage: loom convert --from hf:DIR --to loom:DIR [flags]\n"
      "       loom convert --from loom:DIR --to hf:DIR [--dtype f32|bf16|f16] [--max-shard-size 5GB]\n"
      "       loom convert --from loom:LORA_DIR --to peft:DIR [--base NAME]\n"
      "       loom convert --from peft:DIR --to loom:DIR --base BASE_DIR\n"
      "       loom convert --from loom:LORA_DIR --merge-lora --to loom:DIR | hf:DIR [--base BASE_DIR]\n"
      "Converts GPT-2 and Llama-family (Llama, Mistral) models between Hugging Face model directories\n"
      "(config.json + safetensors) and Loom checkpoints, LoRA checkpoints of Llama-family models to and from\n"
      "Hugging Face PEFT adapter directories, and merges LoRA adapters into their base (docs/convert.md).",
      flags());
}

void run_convert(const ConvertConfig& cfg, std::ostream& log) {
  using F = ConvertFormat;
  if (cfg.from == F::kHf) return convert_hf_to_loom(cfg.from_dir, cfg.to_dir, cfg.to_loom, log);
  if (cfg.from == F::kPeft) {
    PeftImportOptions o;
    o.base = cfg.base;
    if (cfg.vocab_divisor_given) o.make_vocab_size_divisible_by = cfg.to_loom.make_vocab_size_divisible_by;
    o.rotary_interleaved = cfg.to_loom.rotary_interleaved;
    return convert_peft_to_loom(cfg.from_dir, cfg.to_dir, o, log);
  }
  if (cfg.merge_lora) return convert_merge_lora(cfg.from_dir, cfg.base, cfg.to_dir, cfg.to == F::kHf, cfg.to_hf, log);
  if (cfg.to == F::kPeft) return convert_loom_to_peft(cfg.from_dir, cfg.to_dir, cfg.base, log);
  if (is_lora_checkpoint(cfg.from_dir))
    user_error("--from loom:", cfg.from_dir, " is a LoRA checkpoint (adapters only): add --merge-lora to write its base "
               "with the adapters merged, or use --to peft:DIR to export the adapters");
  convert_loom_to_hf(cfg.from_dir, cfg.to_dir, cfg.to_hf, log);
}

}  // namespace loom
