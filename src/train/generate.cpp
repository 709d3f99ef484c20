// Sampling, the batched decoding loop and `loom generate` (see loom/train/generate.h for the contracts).
// The KV-cached path runs InferenceSession steps; the no-cache path re-runs GPTModel::forward over the
// whole prefix every step and exists to check the cache (same tokens, same sampling stream).
#include "loom/train/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <numeric>
#include <ostream>
#include <sstream>

#include "loom/core/allocator.h"
#include "loom/core/rng.h"
#include "loom/model/inference.h"
#include "loom/train/lora_io.h"
#include "loom/train/model_io.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

int32_t argmax(std::span<const float> logits) {
  int64_t best = 0;
  for (int64_t i = 1; i < int64_t(logits.size()); ++i)
    if (logits[size_t(i)] > logits[size_t(best)]) best = i;
  return int32_t(best);
}

}  // namespace

void SamplingOptions::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature))
    user_error("--temperature must be >= 0 (0: greedy), got ", temperature);
  if (top_k < 0) user_error("--top-k must be >= 0 (0: off), got ", top_k);
  if (!(top_p >= 0.0f && top_p <= 1.0f)) user_error("--top-p must be in [0, 1] (0 or 1: off), got ", top_p);
}

std::vector<double> sampling_probabilities(std::span<const float> logits, const SamplingOptions& o) {
  const int64_t n = int64_t(logits.size());
  LOOM_CHECK(n >= 1, "[sampling] no logits to sample from");
  std::vector<double> probs(size_t(n), 0.0);
  if (o.greedy()) {
    probs[size_t(argmax(logits))] = 1.0;
    return probs;
  }
  const double inv_t = 1.0 / double(o.temperature);
  // Token ids by decreasing logit, ties by id: top-k and top-p keep prefixes of this order.
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const int64_t k = o.top_k > 0 ? std::min(o.top_k, n) : n;
  const bool nucleus = o.top_p > 0.0f && o.top_p < 1.0f;
  auto before = [&](int32_t a, int32_t b) {
    return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
  };
  if (nucleus || k < n) std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
  int64_t keep = k;
  double mx = -INFINITY;
  for (int64_t r = 0; r < keep; ++r) mx = std::max(mx, double(logits[size_t(order[size_t(r)])]) * inv_t);
  double sum = 0;
  for (int64_t r = 0; r < keep; ++r) {
    const int32_t i = order[size_t(r)];
    probs[size_t(i)] = std::exp(double(logits[size_t(i)]) * inv_t - mx);
    sum += probs[size_t(i)];
  }
  for (int64_t r = 0; r < keep; ++r) probs[size_t(order[size_t(r)])] /= sum;
  if (nucleus) {
    double cum = 0;
    int64_t r = 0;
    while (r < keep) {
      cum += probs[size_t(order[size_t(r)])];
      ++r;
      if (cum >= double(o.top_p)) break;
    }
    for (int64_t d = r; d < keep; ++d) probs[size_t(order[size_t(d)])] = 0.0;
    for (int64_t d = 0; d < r; ++d) probs[size_t(order[size_t(d)])] /= cum;
  }
  return probs;
}

int32_t sample_token(std::span<const float> logits, const SamplingOptions& o, uint64_t row, uint64_t step) {
  if (o.greedy()) return argmax(logits);
  const std::vector<double> probs = sampling_probabilities(logits, o);
  const double u = double(philox_uniform(o.seed, row, step));
  double cum = 0;
  int32_t last = -1;
  for (int64_t i = 0; i < int64_t(probs.size()); ++i) {
    if (probs[size_t(i)] <= 0.0) continue;
    cum += probs[size_t(i)];
    last = int32_t(i);
    if (u < cum) return int32_t(i);
  }
  return last;  // u above the rounded total: the last token with mass
}

GenerateResult generate(GPTModel& model, const DeviceContext& ctx, const std::vector<std::vector<int32_t>>& prompts,
                        const GenerateOptions& o, const TokenCallback& on_token) {
  const GPTConfig& cfg = model.config();
  const int64_t B = int64_t(prompts.size()), Vp = cfg.padded_vocab_size;
  LOOM_CHECK(B >= 1, "[generate] no prompts");
  LOOM_CHECK(o.max_new_tokens >= 0, "[generate] max_new_tokens must be >= 0, got ", o.max_new_tokens);
  int64_t min_len = INT64_MAX, max_len = 0;
  GenerateResult res;
  res.tokens.resize(size_t(B));
  for (const auto& p : prompts) {
    LOOM_CHECK(!p.empty(), "[generate] empty prompt");
    min_len = std::min(min_len, int64_t(p.size()));
    max_len = std::max(max_len, int64_t(p.size()));
    res.prompt_tokens += int64_t(p.size());
  }
  const bool positional = cfg.position_embedding_type != PositionEmbeddingType::kNone;
  LOOM_CHECK(!positional || max_len <= cfg.max_position_embeddings, "[generate] a prompt of ", max_len,
             " tokens exceeds --max-position-embeddings ", cfg.max_position_embeddings);
  if (o.max_new_tokens == 0) return res;
  const int64_t vocab = o.sample_vocab > 0 ? std::min(o.sample_vocab, cfg.vocab_size) : cfg.vocab_size;
  int64_t capacity = max_len + o.max_new_tokens - 1;  // the last sampled token is never fed
  if (positional) capacity = std::min(capacity, cfg.max_position_embeddings);

  std::vector<std::vector<int32_t>> seq = prompts;  // prompt + new tokens per row
  std::vector<char> done(size_t(B), 0);
  std::unique_ptr<InferenceSession> session;
  if (o.use_kv_cache) session = std::make_unique<InferenceSession>(model, ctx, B, capacity);
  Tensor full_logits;  // (B, Vp) f32: the no-cache path's last-position logits
  // Logits (B, Vp) f32 of position `to` - 1 after feeding positions [from, to) (everything when no cache).
  auto run = [&](int64_t from, int64_t to) -> TensorView {
    const int64_t begin = session ? from : 0, T = to - begin;
    Tensor tokens = Tensor::empty({B, T}, DType::kI32);
    int32_t* tp = tokens.data<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const size_t pos = size_t(begin + t);
        tp[b * T + t] = pos < seq[size_t(b)].size() ? seq[size_t(b)][pos] : 0;  // 0: a stopped row's filler
      }
    if (session) return session->forward(tokens);
    Tensor targets = Tensor::zeros({B, T}, DType::kI32);
    ForwardOptions fo;
    fo.training = false;
    model.forward(GPTBatch{tokens, targets, {}, {}, {}}, 0.0f, fo);
    if (!full_logits.defined()) full_logits = Tensor::empty({B, Vp}, DType::kF32);
    Tensor host = Tensor::empty({B, T, Vp}, model.logits().dtype());
    ctx.copy(host, model.logits());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t v = 0; v < Vp; ++v) {
        const int64_t i = (b * T + T - 1) * Vp + v;
        float x = 0;
        switch (host.dtype()) {
          case DType::kF32: x = host.data<float>()[i]; break;
          case DType::kBF16: x = bf16_to_f32(host.data<uint16_t>()[i]); break;
          case DType::kF16: x = f16_to_f32(host.data<uint16_t>()[i]); break;
          default: LOOM_CHECK(false, "[generate] unexpected logits dtype ", dtype_name(host.dtype()));
        }
        full_logits.data<float>()[b * Vp + v] = x;
      }
    return full_logits;
  };

  const auto t0 = Clock::now();
  int64_t len = min_len;
  TensorView logits = run(0, min_len);
  res.prefill_seconds = seconds_since(t0);
  res.prefill_tokens = B * min_len;
  const auto t1 = Clock::now();
  for (;;) {
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int32_t>& mine = res.tokens[size_t(b)];
      if (done[size_t(b)] || len < int64_t(prompts[size_t(b)].size())) continue;
      const std::span<const float> row(logits.data<float>() + b * Vp, size_t(vocab));
      const int32_t tok = sample_token(row, o.sampling, uint64_t(b), uint64_t(mine.size()));
      mine.push_back(tok);
      seq[size_t(b)].push_back(tok);
      ++res.generated_tokens;
      if (on_token) on_token(b, tok);
      if (tok == o.eod || int64_t(mine.size()) >= o.max_new_tokens) done[size_t(b)] = 1;
    }
    if (std::all_of(done.begin(), done.end(), [](char d) { return d != 0; })) break;
    if (len >= capacity) {
      res.out_of_positions = true;
      break;
    }
    logits = run(len, len + 1);
    ++len;
  }
  res.decode_seconds = seconds_since(t1);
  return res;
}

namespace {

void check_load_dir(const std::string& dir) {
  if (!std::filesystem::is_directory(dir))
    user_error("--load: ", dir,
               " is not a directory (a `loom train --save` directory or a Hugging Face model directory)");
}

std::vector<std::string> read_prompt_lines(const std::string& path) {
  std::ifstream f(path);
  if (!f) user_error("--prompt-file: cannot read ", path);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(f, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) out.push_back(line);
  }
  if (out.empty()) user_error("--prompt-file: ", path, " holds no prompt (one per line, empty lines skipped)");
  return out;
}

}  // namespace

std::unique_ptr<GPTModel> load_model_for_inference(const std::string& dir, const DeviceContext& ctx,
                                                   DType compute_dtype, const std::string& lora_base,
                                                   std::ostream* log) {
  check_load_dir(dir);
  const bool lora = is_lora_checkpoint(dir);
  if (!lora && !lora_base.empty())
    user_error("--pretrained-checkpoint ", lora_base, " is the base of a LoRA checkpoint, but --load ", dir,
               " is a full model; drop it, or --load the LoRA adapters");
  ModelOptions mo;
  mo.compute_dtype = compute_dtype;
  mo.with_grads = false;  // generation never runs backward
  auto model = std::make_unique<GPTModel>(read_model_config(dir), ctx, mo);
  if (lora) {
    // The merge works on the f32 masters on the host, before any device copy.
    LOOM_CHECK(ctx.device().is_cpu(), "[load_model_for_inference] LoRA merging needs a CPU model, got ",
               ctx.device().str());
    load_merged_lora(read_lora_checkpoint(dir), lora_base, "--pretrained-checkpoint", model->params(), log);
  } else {
    HfImportOptions io;
    io.ctx = &ctx;
    io.expert_biases = model->expert_biases();
    io.notes = log;
    load_model_weights(dir, model->params(), io);
  }
  model->sync_compute();
  return model;
}

void GenerateConfig::validate() const {
  if (load.empty()) user_error("--load DIR is required (a `loom train --save` checkpoint directory)");
  if (tokenizer.type.empty())
    user_error("--tokenizer-type is required (e.g. GPT2BPETokenizer with --vocab-file/--merge-file, or "
               "NullTokenizer with --vocab-size)");
  if (has_prompt == !prompt_file.empty()) user_error("give exactly one of --prompt TEXT and --prompt-file FILE");
  if (has_prompt && prompt.empty()) user_error("--prompt is empty; give some text to continue");
  if (generation.max_new_tokens < 1) user_error("--max-new-tokens must be >= 1, got ", generation.max_new_tokens);
  generation.sampling.validate();
}

void run_generate(const GenerateConfig& cfg, std::ostream& out, std::ostream& log) {
  cfg.validate();
  // Everything that can fail on user input is checked before the model is built.
  const std::unique_ptr<Tokenizer> tok = make_tokenizer(cfg.tokenizer);
  const std::vector<std::string> texts =
      cfg.has_prompt ? std::vector<std::string>{cfg.prompt} : read_prompt_lines(cfg.prompt_file);
  check_load_dir(cfg.load);
  const GPTConfig mcfg = read_model_config(cfg.load);
  if (tok->vocab_size() > mcfg.vocab_size)
    user_error("the tokenizer ", tok->name(), " has ", tok->vocab_size(), " tokens but the model in ", cfg.load,
               " was trained with a vocabulary of ", mcfg.vocab_size, "; use the tokenizer it was trained with");
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < texts.size(); ++i) {
    std::vector<int32_t> ids = tok->encode(texts[i]);
    const std::string which =
        cfg.has_prompt ? std::string("--prompt") : "prompt " + std::to_string(i + 1) + " of --prompt-file";
    if (ids.empty()) user_error(which, " encodes to no tokens");
    if (mcfg.position_embedding_type != PositionEmbeddingType::kNone &&
        int64_t(ids.size()) > mcfg.max_position_embeddings)
      user_error(which, " is ", ids.size(), " tokens long but the model has ", mcfg.max_position_embeddings,
                 " positions (--max-position-embeddings)");
    prompts.push_back(std::move(ids));
  }

  const std::unique_ptr<DeviceContext> ctx = make_cpu_context();
  const auto t_load = Clock::now();
  std::unique_ptr<GPTModel> model =
      load_model_for_inference(cfg.load, *ctx, cfg.bf16 ? DType::kBF16 : DType::kF32, cfg.pretrained_checkpoint, &log);
  cpu_allocator().empty_cache();  // the load's large temporaries are not asked for again
  log << "loaded " << cfg.load << " (" << mcfg.num_layers << " layers, hidden " << mcfg.hidden_size << ", "
      << mcfg.num_parameters() << " parameters, "
      << (mcfg.is_moe() ? std::to_string(mcfg.num_active_parameters()) + " active (" +
                              std::to_string(mcfg.moe.num_experts) + " experts, top-" +
                              std::to_string(mcfg.moe.router.topk) + "), "
                        : std::string())
      << (cfg.bf16 ? "bf16" : "f32") << ") in " << std::fixed
      << std::setprecision(2) << seconds_since(t_load) << " s\n"
      << std::defaultfloat << std::flush;

  GenerateOptions go = cfg.generation;
  go.eod = tok->eod();
  go.sample_vocab = tok->vocab_size();
  const int64_t B = int64_t(prompts.size());
  // One prompt streams: decode the prompt plus everything generated so far and print what is new, so
  // tokenizers whose pieces depend on their neighbours (SentencePiece's leading-space marker, the
  // NullTokenizer's separators) print exactly what decoding the whole sequence gives.
  std::vector<int32_t> shown_ids = B == 1 ? prompts[0] : std::vector<int32_t>{};
  std::string shown;
  auto stream = [&]() {
    const std::string text = tok->decode(shown_ids);
    if (text.size() > shown.size() && text.compare(0, shown.size(), shown) == 0) {
      out << text.substr(shown.size()) << std::flush;
      shown = text;
    }
  };
  if (B == 1) stream();
  TokenCallback on_token = [&](int64_t, int32_t t) {
    if (B != 1 || t == go.eod) return;
    shown_ids.push_back(t);
    stream();
  };
  const GenerateResult r = generate(*model, *ctx, prompts, go, on_token);
  for (int64_t b = 0; b < B; ++b) {
    if (B == 1) {
      out << "\n";
      break;
    }
    std::vector<int32_t> ids = prompts[size_t(b)];
    for (int32_t t : r.tokens[size_t(b)])
      if (t != go.eod) ids.push_back(t);
    out << tok->decode(ids) << "\n";
  }
  out << std::flush;
  const double total = r.prefill_seconds + r.decode_seconds;
  log << std::fixed << std::setprecision(1) << "generated " << r.generated_tokens << " tokens for " << B
      << (B == 1 ? " prompt" : " prompts") << " in " << std::setprecision(3) << total << " s ("
      << (go.use_kv_cache ? "KV cache" : "no KV cache") << "): prefill " << r.prefill_tokens << " prompt tokens, "
      << std::setprecision(1) << (r.prefill_seconds > 0 ? double(r.prefill_tokens) / r.prefill_seconds : 0.0)
      << " tokens/s; decode " << (r.decode_seconds > 0 ? double(r.generated_tokens) / r.decode_seconds : 0.0)
      << " tokens/s\n";
  if (r.out_of_positions)
    log << "stopped early: the model's " << mcfg.max_position_embeddings
        << " positions (--max-position-embeddings) are used up\n";
  log << std::defaultfloat << std::flush;
}

}  // namespace loom
