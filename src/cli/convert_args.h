// Flag parsing for `loom convert`: --from KIND:DIR --to KIND:DIR with KIND hf (a Hugging Face model
// directory), loom (a Loom checkpoint) or peft (a Hugging Face PEFT adapter directory), plus the options of
// each direction. The pairs: hf -> loom, loom -> hf, loom (LoRA) -> peft, peft -> loom (LoRA, with --base),
// and loom (LoRA) --merge-lora -> loom | hf.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "loom/train/model_io.h"

namespace loom {

enum class ConvertFormat { kHf, kLoom, kPeft };

struct ConvertConfig {
  ConvertFormat from = ConvertFormat::kHf, to = ConvertFormat::kLoom;
  std::string from_dir, to_dir;
  bool merge_lora = false;      // --merge-lora: a LoRA checkpoint's adapters merged into its base
  std::string base;             // --base: the base model (peft -> loom, --merge-lora) or its name (-> peft)
  HfToLoomOptions to_loom;      // --make-vocab-size-divisible-by, --rotary-interleaved (an HF source or base)
  bool vocab_divisor_given = false;  // --make-vocab-size-divisible-by was given
  HfExportOptions to_hf;        // --dtype, --max-shard-size, --bos-token-id, --eos-token-id
};

// Parses the arguments after `loom convert`. Throws UserError naming the flag.
ConvertConfig parse_convert_args(const std::vector<std::string>& args);
std::string convert_help();
// Runs the conversion, logging to `log`.
void run_convert(const ConvertConfig& cfg, std::ostream& log);

// "5GB", "500MB", "10KiB", "123" -> bytes (transformers' max_shard_size spelling: KB/MB/GB are powers of
// 1000, KiB/MiB/GiB of 1024). UserError naming --max-shard-size.
int64_t parse_byte_size(const std::string& s);

}  // namespace loom
