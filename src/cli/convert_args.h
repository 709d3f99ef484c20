// Flag parsing for `loom convert`: --from KIND:DIR --to KIND:DIR with KIND hf (a Hugging Face model
// directory) or loom (a Loom checkpoint), one of each; plus the options of each direction.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "loom/train/model_io.h"

namespace loom {

struct ConvertConfig {
  bool hf_to_loom = true;       // --from hf:... --to loom:... (else the reverse)
  std::string from_dir, to_dir;
  HfToLoomOptions to_loom;      // --make-vocab-size-divisible-by, --rotary-interleaved
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
