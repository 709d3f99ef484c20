// `loom preprocess` (see include/loom/data/preprocess.h for the behaviour). Pipeline: the calling
// thread cuts the input into chunks of whole lines, worker threads parse and tokenize chunks, and the
// calling thread writes finished chunks strictly in input order, so the output does not depend on
// --workers or on timing. At most 2 * workers + 2 chunks are in flight, bounding memory. Any error
// unwinds through the writers' destructors, which delete their temporaries: nothing is left behind.
#include "loom/data/preprocess.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <iomanip>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "loom/core/check.h"
#include "data/chat_template.h"
#include "loom/data/indexed_dataset.h"

namespace loom {

namespace {

constexpr size_t kChunkBytes = size_t(1) << 20;  // a chunk ends after this many bytes ...
constexpr size_t kChunkLines = 256;               // ... or this many lines, whichever comes first

// Lines [first_line, first_line + spans.size()) of the input, and after a worker ran, their tokens.
struct Chunk {
  int64_t first_line = 1;  // 1-based line number of spans[0]
  std::string text;
  std::vector<std::pair<size_t, size_t>> spans;  // (offset, length) of each line in text, without '\n'
  size_t bytes = 0;                              // input bytes, newlines included (Megatron's count)

  // Results, filled by a worker. For line i and key k (slot i * K + k): n_seqs[slot] sequences whose
  // lengths follow in seq_lens, whose tokens follow in tokens. A bad line has error[i] non-empty.
  std::vector<int32_t> tokens;
  std::vector<int32_t> mask;  // --sft: per token, 1 in the loss (parallel to tokens)
  std::vector<int32_t> seq_lens;
  std::vector<uint32_t> n_seqs;
  std::vector<std::string> error;
  std::exception_ptr fatal;  // an internal error, rethrown by the writing thread
  bool done = false;
};

// Parses and tokenizes every line of a chunk.
class LineEncoder {
 public:
  LineEncoder(const PreprocessConfig& cfg, const Tokenizer& tok, const ChatTemplate* chat)
      : cfg_(cfg), tok_(tok), chat_(chat) {}

  void encode_chunk(Chunk& c) const {
    const size_t K = cfg_.sft ? 1 : cfg_.json_keys.size();  // --sft: one output
    c.error.assign(c.spans.size(), std::string());
    c.n_seqs.assign(c.spans.size() * K, 0);
    std::vector<int32_t> scratch;
    for (size_t i = 0; i < c.spans.size(); ++i) {
      const size_t tok0 = c.tokens.size(), len0 = c.seq_lens.size();
      const std::string_view line = std::string_view(c.text).substr(c.spans[i].first, c.spans[i].second);
      std::string err = cfg_.sft ? encode_sft_line(line, c, &c.n_seqs[i * K], scratch)
                                 : encode_line(line, c, &c.n_seqs[i * K], scratch);
      if (!err.empty()) {  // roll back what the line added, so the chunk holds only good lines
        c.tokens.resize(tok0);
        c.mask.resize(std::min(c.mask.size(), tok0));
        c.seq_lens.resize(len0);
        std::fill(c.n_seqs.begin() + i * K, c.n_seqs.begin() + (i + 1) * K, 0u);
        c.error[i] = std::move(err);
      }
    }
  }

 private:
  static std::string parse_object(std::string_view line, nlohmann::json& doc) {
    try {
      doc = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      return line.find_first_not_of(" \t\r") == std::string_view::npos ? "empty line (expected a JSON object)"
                                                                       : std::string("invalid JSON: ") + e.what();
    }
    if (!doc.is_object()) return std::string("expected a JSON object, got a JSON ") + doc.type_name();
    return {};
  }

  // --sft: prompt then answer tokens as one sequence, with the answer mask. "" or why the line is bad.
  std::string encode_sft_line(std::string_view line, Chunk& c, uint32_t* n_seqs, std::vector<int32_t>& scratch) const {
    nlohmann::json doc;
    if (std::string err = parse_object(line, doc); !err.empty()) return err;
    const size_t start = c.tokens.size();
    if (chat_) {
      const std::string& key = cfg_.json_keys[0];
      if (!doc.contains(key)) return "missing key '" + key + "' (a chat conversation)";
      std::string err;
      try {
        err = chat_->render(doc[key], c.tokens, c.mask);
      } catch (const UserError& e) {
        err = e.what();
      }
      if (!err.empty()) return "key '" + key + "': " + err;
      if (!cfg_.answer_only_loss) std::fill(c.mask.begin() + long(start), c.mask.end(), 1);
    }
    for (size_t k = 0; k < (chat_ ? 0u : 2u); ++k) {
      const std::string& key = cfg_.json_keys[k];
      const auto it = doc.find(key);
      if (it == doc.end()) return "missing key '" + key + "' (from --json-keys)";
      if (!it->is_string()) return "key '" + key + "' is a JSON " + std::string(it->type_name()) + ", expected a string";
      scratch.clear();
      try {
        tok_.encode(it->get_ref<const std::string&>(), scratch);
      } catch (const UserError& e) {
        return "key '" + key + "': " + e.what();
      }
      if (k == 1 && scratch.empty()) return "key '" + key + "' has no tokens (an SFT sample needs an answer)";
      c.tokens.insert(c.tokens.end(), scratch.begin(), scratch.end());
      c.mask.insert(c.mask.end(), scratch.size(), k == 1 || !cfg_.answer_only_loss ? 1 : 0);
    }
    if (cfg_.append_eod) {
      c.tokens.push_back(tok_.eod());
      c.mask.push_back(1);  // the model learns to end its answer
    }
    c.seq_lens.push_back(int32_t(c.tokens.size() - start));
    n_seqs[0] = 1;
    return {};
  }

  // Returns "" on success, else why the line is bad.
  std::string encode_line(std::string_view line, Chunk& c, uint32_t* n_seqs, std::vector<int32_t>& scratch) const {
    nlohmann::json doc;
    if (std::string err = parse_object(line, doc); !err.empty()) return err;
    for (size_t k = 0; k < cfg_.json_keys.size(); ++k) {
      const std::string& key = cfg_.json_keys[k];
      const auto it = doc.find(key);
      if (it == doc.end()) return "missing key '" + key + "' (from --json-keys)";
      const nlohmann::json& v = *it;
      if (v.is_array()) {
        for (const auto& s : v)
          if (!s.is_string())
            return "key '" + key + "' is a list holding a JSON " + s.type_name() + ", expected strings";
      } else if (!v.is_string()) {
        return "key '" + key + "' is a JSON " + std::string(v.type_name()) + ", expected a string or a list of strings";
      }
      // Megatron: each non-empty sentence (the string itself, or each list element) is one sequence.
      auto add_sentence = [&](const std::string& s) {
        scratch.clear();
        tok_.encode(s, scratch);
        if (scratch.empty()) return;
        c.tokens.insert(c.tokens.end(), scratch.begin(), scratch.end());
        c.seq_lens.push_back(int32_t(scratch.size()));
        ++n_seqs[k];
      };
      try {
        if (v.is_string()) {
          add_sentence(v.get_ref<const std::string&>());
        } else {
          for (const auto& s : v) add_sentence(s.get_ref<const std::string&>());
        }
      } catch (const UserError& e) {
        return "key '" + key + "': " + e.what();
      }
      if (cfg_.append_eod && n_seqs[k] > 0) {  // Megatron appends EOD only to non-empty documents
        c.tokens.push_back(tok_.eod());
        ++c.seq_lens.back();
      }
    }
    return {};
  }

  const PreprocessConfig& cfg_;
  const Tokenizer& tok_;
  const ChatTemplate* chat_;
};

// Worker threads taking chunks from a queue; the destructor stops and joins them.
class WorkerPool {
 public:
  WorkerPool(int n, const LineEncoder& enc) : enc_(enc) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(m_);
      closing_ = true;
      pending_.clear();
    }
    cv_work_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void submit(Chunk* c) {
    {
      std::lock_guard<std::mutex> lock(m_);
      pending_.push_back(c);
    }
    cv_work_.notify_one();
  }
  void wait(const Chunk& c) {
    std::unique_lock<std::mutex> lock(m_);
    cv_done_.wait(lock, [&] { return c.done; });
  }

 private:
  void run() {
    for (;;) {
      Chunk* c = nullptr;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_work_.wait(lock, [&] { return closing_ || !pending_.empty(); });
        if (pending_.empty()) return;
        c = pending_.front();
        pending_.pop_front();
      }
      try {
        enc_.encode_chunk(*c);
      } catch (...) {
        c->fatal = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(m_);
        c->done = true;
      }
      cv_done_.notify_all();
    }
  }

  const LineEncoder& enc_;
  std::mutex m_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<Chunk*> pending_;
  bool closing_ = false;
  std::vector<std::thread> threads_;
};

// Cuts the input into chunks of whole lines; the last line may lack its '\n'.
class ChunkReader {
 public:
  explicit ChunkReader(const std::string& path) : path_(path) {
    f_ = std::fopen(path.c_str(), "rb");
    if (!f_) user_error("--input: cannot open ", path, ": ", std::strerror(errno));
    struct stat st {};
    if (::fstat(::fileno(f_), &st) == 0 && S_ISDIR(st.st_mode)) {
      std::fclose(f_);
      f_ = nullptr;
      user_error("--input: ", path, " is a directory, expected a JSONL file");
    }
    if (S_ISREG(st.st_mode)) file_size_ = size_t(st.st_size);
  }
  ~ChunkReader() {
    if (f_) std::fclose(f_);
  }

  // Fills c with the next lines; false at the end of the input.
  bool next(Chunk& c) {
    c.first_line = next_line_;
    c.text = std::move(carry_);
    carry_.clear();
    c.spans.clear();
    size_t start = 0, scan = 0;
    for (;;) {
      const size_t nl = c.text.find('\n', scan);
      if (nl != std::string::npos) {
        c.spans.emplace_back(start, nl - start);
        start = scan = nl + 1;
        if (c.spans.size() >= kChunkLines || start >= kChunkBytes) break;
        continue;
      }
      scan = c.text.size();
      if (eof_) {
        if (start < c.text.size()) c.spans.emplace_back(start, c.text.size() - start);
        start = c.text.size();
        break;
      }
      // Reads of 64 KiB, or of what a regular file still holds (+1 to meet its end; at least 4 KiB in case
      // it grows): a small input does not zero-fill a 64 KiB buffer.
      const size_t want =
          file_size_ ? std::clamp<size_t>(*file_size_ - std::min(read_, *file_size_) + 1, 4096, kRead) : kRead;
      const size_t at = c.text.size();
      c.text.resize(at + want);
      const size_t got = std::fread(c.text.data() + at, 1, want, f_);
      c.text.resize(at + got);
      read_ += got;
      if (got == 0) {
        if (std::ferror(f_)) user_error("--input: cannot read ", path_, ": ", std::strerror(errno));
        eof_ = true;
      }
    }
    carry_.assign(c.text, start, std::string::npos);
    c.text.resize(start);
    c.bytes = start;
    next_line_ += int64_t(c.spans.size());
    return !c.spans.empty();
  }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
  static constexpr size_t kRead = size_t(1) << 16;
  std::string carry_;
  int64_t next_line_ = 1;
  std::optional<size_t> file_size_;  // a regular file's size when opened (none for a pipe)
  size_t read_ = 0;                  // bytes read so far
  bool eof_ = false;
};

const char* dtype_label(IndexDType dt) { return dt == IndexDType::kU16 ? "uint16" : "int32"; }

}  // namespace

void PreprocessConfig::validate() const {
  if (input.empty()) user_error("--input is required (a JSONL file, one JSON object per line)");
  if (output_prefix.empty()) user_error("--output-prefix is required");
  if (json_keys.empty()) user_error("--json-keys needs at least one key");
  std::set<std::string> seen;
  for (const auto& k : json_keys) {
    if (k.empty()) user_error("--json-keys: empty key");
    if (!seen.insert(k).second) user_error("--json-keys: key '", k, "' given twice");
  }
  if (workers < 1 || workers > 1024) user_error("--workers must be in [1, 1024], got ", workers);
  if (!chat_template.empty() && !sft) user_error("--chat-template renders --sft conversations: add --sft");
  if (sft && chat_template.empty() && json_keys.size() != 2)
    user_error("--sft takes --json-keys PROMPT ANSWER (two keys, default input output), got ", json_keys.size());
  if (sft && !chat_template.empty() && json_keys.size() != 1)
    user_error("--sft --chat-template takes one --json-keys key (the messages list, default messages), got ",
               json_keys.size());
  if (log_interval < 1) user_error("--log-interval must be >= 1, got ", log_interval);
}

PreprocessStats run_preprocess(const PreprocessConfig& cfg, std::ostream& log) {
  using Clock = std::chrono::steady_clock;
  cfg.validate();
  const auto tok = make_tokenizer(cfg.tokenizer);
  if (cfg.append_eod && tok->eod() < 0)
    user_error("--append-eod: tokenizer ", tok->name(), " has no end-of-document token");
  ChunkReader reader(cfg.input);
  log << "Opening " << cfg.input << "\n";

  // --sft writes one output (the samples) and its loss mask; otherwise one output per key.
  const size_t K = cfg.sft ? 1 : cfg.json_keys.size();
  const IndexDType dtype = index_dtype_for_vocab(tok->vocab_size());
  PreprocessStats stats;
  stats.tokens.assign(K, 0);
  std::vector<int64_t> sequences(K, 0);
  std::vector<std::unique_ptr<IndexedDatasetWriter>> writers;
  if (cfg.sft) {
    stats.outputs.push_back(cfg.output_prefix + "_sft_document");
    writers.push_back(std::make_unique<IndexedDatasetWriter>(stats.outputs.back(), dtype));
    stats.outputs.push_back(stats.outputs.back() + "_loss_mask");
    writers.push_back(std::make_unique<IndexedDatasetWriter>(stats.outputs.back(), IndexDType::kU8));
  } else {
    for (const auto& key : cfg.json_keys) {
      stats.outputs.push_back(cfg.output_prefix + "_" + key + "_document");
      writers.push_back(std::make_unique<IndexedDatasetWriter>(stats.outputs.back(), dtype));
    }
  }
  int64_t loss_tokens = 0;

  const auto t0 = Clock::now();
  auto rates = [&](std::ostream& os) {
    const double s = std::max(1e-9, std::chrono::duration<double>(Clock::now() - t0).count());
    os << std::fixed << std::setprecision(2) << double(stats.documents) / s << " docs/s, "
       << double(stats.bytes) / s / 1024 / 1024 << " MB/s";
    os.unsetf(std::ios::floatfield);
  };

  auto write_chunk = [&](Chunk& c) {
    if (c.fatal) std::rethrow_exception(c.fatal);
    size_t tok_at = 0, len_at = 0;
    for (size_t i = 0; i < c.spans.size(); ++i) {
      if (!c.error[i].empty()) {
        if (!cfg.skip_bad_lines)
          user_error(cfg.input, ":", c.first_line + int64_t(i), ": ", c.error[i],
                     "; --skip-bad-lines skips such lines");
        ++stats.skipped_lines;
        continue;
      }
      for (size_t k = 0; k < K; ++k) {
        for (uint32_t s = 0; s < c.n_seqs[i * K + k]; ++s) {
          const int32_t n = c.seq_lens[len_at++];
          writers[k]->add_sequence(std::span<const int32_t>(c.tokens.data() + tok_at, size_t(n)));
          if (cfg.sft) {
            writers[1]->add_sequence(std::span<const int32_t>(c.mask.data() + tok_at, size_t(n)));
            for (int32_t j = 0; j < n; ++j) loss_tokens += c.mask[tok_at + size_t(j)];
          }
          tok_at += size_t(n);
          stats.tokens[k] += n;
        }
        sequences[k] += c.n_seqs[i * K + k];
        writers[k]->end_document();
        if (cfg.sft) writers[1]->end_document();
      }
      ++stats.documents;
      if (stats.documents % cfg.log_interval == 0) {
        log << "Processed " << stats.documents << " documents (";
        rates(log);
        log << ").\n";
      }
    }
    LOOM_CHECK(tok_at == c.tokens.size() && len_at == c.seq_lens.size(), "[preprocess] chunk of lines ",
               c.first_line, "+ has ", c.tokens.size(), " tokens, wrote ", tok_at);
  };

  {
    const std::optional<ChatTemplate> chat =
        cfg.chat_template.empty() ? std::nullopt : std::optional<ChatTemplate>(std::in_place, cfg.chat_template, *tok);
    const LineEncoder encoder(cfg, *tok, chat ? &*chat : nullptr);
    std::deque<std::unique_ptr<Chunk>> inflight;  // declared before the pool: the pool joins first
    WorkerPool pool(cfg.workers, encoder);
    const size_t max_inflight = 2 * size_t(cfg.workers) + 2;
    auto retire_front = [&] {
      pool.wait(*inflight.front());
      stats.bytes += int64_t(inflight.front()->bytes);
      write_chunk(*inflight.front());
      inflight.pop_front();
    };
    for (;;) {
      auto c = std::make_unique<Chunk>();
      if (!reader.next(*c)) break;
      pool.submit(c.get());
      inflight.push_back(std::move(c));
      while (inflight.size() >= max_inflight) retire_front();
    }
    while (!inflight.empty()) retire_front();
  }

  // An empty dataset would only fail later, far from its cause (training: "fewer than 2 tokens"); the
  // writers' destructors remove the temporaries, so nothing is left behind.
  if (stats.documents == 0)
    user_error("--input ", cfg.input, " holds no documents (",
               stats.bytes == 0 ? std::string("the file is empty")
                                : std::to_string(stats.skipped_lines) + " bad lines skipped, no good one",
               "); nothing was written");
  for (size_t k = 0; k < K; ++k)
    if (stats.tokens[k] == 0)
      user_error("--input ", cfg.input, ": all ", stats.documents, " documents are empty after tokenization (key '",
                 cfg.json_keys[k], "' holds no text); nothing was written");

  // Rename every pair only after the whole input succeeded; undo earlier pairs if a later one fails.
  size_t finalized = 0;
  try {
    for (; finalized < writers.size(); ++finalized) writers[finalized]->finalize();
  } catch (...) {
    for (size_t k = 0; k < finalized; ++k) {
      std::remove((stats.outputs[k] + ".bin").c_str());
      std::remove((stats.outputs[k] + ".idx").c_str());
    }
    throw;
  }

  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  log << "Processed " << stats.documents << " documents in " << std::fixed << std::setprecision(2) << secs << " s (";
  rates(log);
  log << ")";
  if (cfg.skip_bad_lines) log << "; skipped " << stats.skipped_lines << " bad lines";
  log << ".\n";
  for (size_t k = 0; k < K; ++k)
    log << "Wrote " << stats.outputs[k] << ".bin/.idx: " << stats.documents << " documents, " << sequences[k]
        << " sequences, " << stats.tokens[k] << " tokens (" << dtype_label(dtype) << ")\n";
  if (cfg.sft)
    log << "Wrote " << stats.outputs[1] << ".bin/.idx: the loss mask (uint8), " << loss_tokens << " of "
        << stats.tokens[0] << " tokens in the loss" << (cfg.answer_only_loss ? " (answer only)" : "") << "\n";
  return stats;
}

}  // namespace loom
