// Text generation (`loom generate`): token sampling (greedy, temperature, top-k, top-p with Philox), the
// decoding loop over a batch of prompts (KV-cached InferenceSession, or a full forward per step for
// checking), loading a model for inference, and the command itself.
//
// Decoding loop: all rows advance one position per step, so a batch of prompts of different lengths needs
// no padding: a row still inside its prompt is fed its next prompt token (its logits are not used), a row
// past it samples its next token from the logits of its last position and is fed that token. A row stops
// at EOD (the EOD token is part of its output) or after max_new_tokens; the loop stops when every row has
// stopped or the model's positions (--max-position-embeddings) run out.
// Randomness: the token a row samples at its k-th new token is a pure function of (seed, row, k) (Philox
// stream = the row, index = k), so the same seed gives the same tokens, with or without the KV cache.
#pragma once
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "loom/data/tokenizer.h"
#include "loom/model/gpt.h"

namespace loom {

struct SamplingOptions {
  float temperature = 1.0f;  // --temperature >= 0; 0: greedy (argmax, the lowest id on ties)
  int64_t top_k = 0;         // --top-k >= 0: keep the k most likely tokens (0: all; 1: greedy)
  float top_p = 1.0f;        // --top-p in [0, 1]: keep the smallest most-likely set with probability >= p (0, 1: off)
  uint64_t seed = 1234;      // --seed
  void validate() const;     // UserError naming the flag
  bool greedy() const { return temperature == 0.0f || top_k == 1; }
};

// The next-token distribution over logits[0, n): logits / temperature, then top-k, then top-p (nucleus:
// the smallest prefix of the tokens sorted by probability, ties by id, whose cumulative probability after
// top-k is >= top_p), renormalised; a one-hot at the argmax when greedy. Computed in f64.
std::vector<double> sampling_probabilities(std::span<const float> logits, const SamplingOptions& o);
// Draws from sampling_probabilities(logits, o) with the uniform philox_uniform(seed, row, step) (inverse CDF
// in token-id order). Greedy options draw nothing.
int32_t sample_token(std::span<const float> logits, const SamplingOptions& o, uint64_t row, uint64_t step);

struct GenerateOptions {
  int64_t max_new_tokens = 64;  // per row, >= 0
  SamplingOptions sampling;
  bool use_kv_cache = true;     // false: a full forward over the whole prefix every step (for checking)
  int32_t eod = -1;             // a row stops after sampling this id; -1: never
  int64_t sample_vocab = 0;     // sample from ids [0, sample_vocab) (the tokenizer's); 0: the model's vocab_size
};

struct GenerateResult {
  std::vector<std::vector<int32_t>> tokens;  // per row: the new tokens (EOD included when sampled)
  int64_t prompt_tokens = 0;                 // sum of the prompt lengths
  int64_t generated_tokens = 0;              // sum of tokens[b].size()
  int64_t prefill_tokens = 0;                // B x the shortest prompt: what the first forward processes
  double prefill_seconds = 0;                // the first forward (the common prompt prefix of every row)
  double decode_seconds = 0;                 // everything after it, sampling included
  bool out_of_positions = false;             // stopped because --max-position-embeddings was reached
};

// Called with each new token as soon as it is sampled.
using TokenCallback = std::function<void(int64_t row, int32_t token)>;

// Generates from `prompts` (each non-empty, ids < the padded vocabulary, no longer than the model's
// positions; the caller reports violations as UserErrors first). The model's compute weights must be in
// sync (sync_compute()). The no-cache path runs GPTModel::forward (evaluation) and so reuses its buffers.
GenerateResult generate(GPTModel& model, const DeviceContext& ctx, const std::vector<std::vector<int32_t>>& prompts,
                        const GenerateOptions& o, const TokenCallback& on_token = {});

// --load DIR for inference: a Loom checkpoint root (latest_checkpointed_iteration.txt), one of its
// iter_NNNNNNN dirs, or a Hugging Face model dir (read by loom/train/model_io.h).
// Builds the model with the saved architecture and loads its weights; compute_dtype f32 or bf16 (--bf16).
// A LoRA checkpoint (adapters only) loads its base (`lora_base`, else the one its metadata names) with the
// adapters merged into the weights (loom/train/lora_io.h): the same model as base + adapters, without the
// adapters' extra GEMMs. `log`, when set, gets a line saying so.
std::unique_ptr<GPTModel> load_model_for_inference(const std::string& dir, const DeviceContext& ctx,
                                                   DType compute_dtype, const std::string& lora_base = "",
                                                   std::ostream* log = nullptr);

// `loom generate` flags.
struct GenerateConfig {
  std::string load;                 // --load DIR (required)
  std::string pretrained_checkpoint;  // --pretrained-checkpoint DIR: the base of a LoRA --load (default: its metadata's)
  TokenizerConfig tokenizer;        // --tokenizer-type ... (required)
  std::string prompt;               // --prompt TEXT
  std::string prompt_file;          // --prompt-file FILE: one prompt per line (empty lines skipped), a batch
  bool has_prompt = false;          // --prompt was given (it may be the empty string: an error)
  GenerateOptions generation;       // --max-new-tokens, --temperature, --top-k, --top-p, --seed, --no-kv-cache
  bool bf16 = false;                // --bf16: bf16 compute copy of the weights
  void validate() const;            // UserError naming the flag
};

// Runs `loom generate`: validates everything (files, prompt lengths, tokenizer vs model vocabulary) before
// generating, streams the text to `out` (one prompt: the decoded prompt, then the new text as each token
// comes, flushed; a batch: each row's decoded prompt + completion when all are done, one per line; EOD is
// not printed) and the statistics (tokens/s) to `log`.
void run_generate(const GenerateConfig& cfg, std::ostream& out, std::ostream& log);

}  // namespace loom
