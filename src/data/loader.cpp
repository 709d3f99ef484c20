// Megatron-order micro-batch loader with a bounded prefetch queue (see include/loom/data/loader.h).
// The producer thread computes micro-batches strictly in order into a deque of at most
// prefetch_depth entries; next() pops the front. Because every batch is a pure function of its step
// number, prefetching changes timing only, never content.
#include "loom/data/loader.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "loom/core/check.h"

namespace loom {

void token_extras(std::span<const int32_t> tokens, const BatchOptions& opt, float* loss_mask, int32_t* position_ids,
                  int32_t* segment_ids) {
  int32_t pos = 0, seg = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    const bool is_eod = opt.eod >= 0 && tokens[t] == opt.eod;
    loss_mask[t] = (opt.eod_mask_loss && is_eod) ? 0.0f : 1.0f;
    position_ids[t] = opt.reset_position_ids ? pos : int32_t(t);
    segment_ids[t] = opt.reset_attention_mask ? seg : 0;
    // The EOD belongs to the document it ends; the next token starts a new one.
    if (is_eod) {
      pos = 0;
      ++seg;
    } else {
      ++pos;
    }
  }
}

int64_t first_id_outside(const int32_t* ids, int64_t n, int64_t vocab_size) {
  // As unsigned, a negative id is above every vocabulary: one max covers both ends, and the loop has no
  // branch, so it vectorises; the search runs only once something is out of range.
  uint32_t hi = 0;
  for (int64_t i = 0; i < n; ++i) hi = std::max(hi, uint32_t(ids[i]));
  if (int64_t(hi) < vocab_size) return -1;
  for (int64_t i = 0; i < n; ++i)
    if (int64_t(uint32_t(ids[i])) >= vocab_size) return i;
  return -1;
}

namespace {

[[noreturn]] void id_outside_vocabulary(const SampleDataset& ds, int64_t sample, int64_t pos, int32_t id,
                                        const BatchOptions& opt) {
  const std::string where = ds.locate(sample, pos);
  user_error("token id ", id, " at position ", pos, " of sample ", sample, where.empty() ? "" : " (" + where + ")",
             " is outside the vocabulary [0, ", opt.vocab_size, ")",
             opt.vocab_source.empty() ? "" : " of " + opt.vocab_source, ": valid ids are 0 .. ", opt.vocab_size - 1);
}

}  // namespace

void fill_batch(const SampleDataset& ds, int64_t first, int64_t B, const BatchOptions& opt, Batch& out) {
  const int64_t T = ds.seq_length();
  out.first_sample = first;
  out.tokens = Tensor::empty(Shape{B, T}, DType::kI32);
  out.labels = Tensor::empty(Shape{B, T}, DType::kI32);
  out.loss_mask = Tensor::empty(Shape{B, T}, DType::kF32);
  out.position_ids = Tensor::empty(Shape{B, T}, DType::kI32);
  out.segment_ids = Tensor::empty(Shape{B, T}, DType::kI32);
  std::vector<int32_t> window(size_t(T + 1));
  for (int64_t b = 0; b < B; ++b) {
    ds.sample(first + b, window.data());
    if (opt.vocab_size > 0)
      if (const int64_t bad = first_id_outside(window.data(), T + 1, opt.vocab_size); bad >= 0)
        id_outside_vocabulary(ds, first + b, bad, window[size_t(bad)], opt);
    int32_t* tok = out.tokens.data<int32_t>() + b * T;
    std::memcpy(tok, window.data(), size_t(T) * sizeof(int32_t));
    std::memcpy(out.labels.data<int32_t>() + b * T, window.data() + 1, size_t(T) * sizeof(int32_t));
    if (!ds.extras(first + b, out.loss_mask.data<float>() + b * T, out.position_ids.data<int32_t>() + b * T,
                   out.segment_ids.data<int32_t>() + b * T))
      token_extras(std::span<const int32_t>(tok, size_t(T)), opt, out.loss_mask.data<float>() + b * T,
                   out.position_ids.data<int32_t>() + b * T, out.segment_ids.data<int32_t>() + b * T);
  }
}

struct Loader::Prefetcher {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::optional<Batch>> queue;  // nullopt entry: end of data
  std::exception_ptr error;
  bool stop = false;
  bool done = false;  // producer finished (end of data or error)
  std::thread thread;
};

Loader::Loader(std::shared_ptr<const SampleDataset> dataset, const LoaderConfig& cfg)
    : dataset_(std::move(dataset)), cfg_(cfg), consumed_(cfg.consumed_samples) {
  LOOM_CHECK(dataset_ != nullptr, "[Loader] null dataset");
  if (cfg_.micro_batch_size < 1) user_error("--micro-batch-size must be >= 1, got ", cfg_.micro_batch_size);
  LOOM_CHECK(cfg_.dp_size >= 1 && cfg_.dp_rank >= 0 && cfg_.dp_rank < cfg_.dp_size, "[Loader] data-parallel rank ",
             cfg_.dp_rank, " of ", cfg_.dp_size);
  const int64_t group = cfg_.micro_batch_size * cfg_.dp_size;
  if (cfg_.global_batch_size < group || cfg_.global_batch_size % group != 0)
    user_error("--global-batch-size ", cfg_.global_batch_size, " must be a positive multiple of --micro-batch-size (",
               cfg_.micro_batch_size, ") x data-parallel size (", cfg_.dp_size, ")");
  if ((cfg_.batch.reset_position_ids || cfg_.batch.reset_attention_mask || cfg_.batch.eod_mask_loss) &&
      cfg_.batch.eod < 0)
    user_error("--reset-position-ids, --reset-attention-mask and --eod-mask-loss need a tokenizer with an "
               "end-of-document token");
  if (cfg_.consumed_samples < 0) LOOM_FAIL("[Loader] negative consumed_samples ", cfg_.consumed_samples);
  if (cfg_.consumed_samples >= dataset_->size())
    user_error("no samples left to consume: ", cfg_.consumed_samples, " consumed of ", dataset_->size(), " in ",
               dataset_->description(), " (was the data built for fewer --train-iters?)");
  if (cfg_.prefetch_depth <= 0) return;

  prefetcher_ = std::make_unique<Prefetcher>();
  Prefetcher& p = *prefetcher_;
  p.thread = std::thread([this, &p] {
    for (int64_t step = 0;; ++step) {
      std::optional<Batch> b;
      try {
        b = produce(step);
      } catch (...) {
        std::lock_guard lock(p.mu);
        p.error = std::current_exception();
        p.done = true;
        p.cv.notify_all();
        return;
      }
      std::unique_lock lock(p.mu);
      p.cv.wait(lock, [&] { return p.stop || int64_t(p.queue.size()) < cfg_.prefetch_depth; });
      if (p.stop) return;
      const bool end = !b.has_value();
      p.queue.push_back(std::move(b));
      if (end) p.done = true;
      p.cv.notify_all();
      if (end) return;
    }
  });
}

Loader::~Loader() {
  if (!prefetcher_) return;
  {
    std::lock_guard lock(prefetcher_->mu);
    prefetcher_->stop = true;
  }
  prefetcher_->cv.notify_all();
  // The producer checks `stop` after each micro-batch, so this waits for at most one batch.
  if (prefetcher_->thread.joinable()) prefetcher_->thread.join();
}

std::optional<Batch> Loader::produce(int64_t step) const {
  const int64_t group = cfg_.micro_batch_size * cfg_.dp_size;
  const int64_t start = cfg_.consumed_samples + step * group;
  if (start + group > dataset_->size()) return std::nullopt;  // drop_last
  Batch b;
  try {
    fill_batch(*dataset_, start + cfg_.dp_rank * cfg_.micro_batch_size, cfg_.micro_batch_size, cfg_.batch, b);
  } catch (const UserError& e) {
    // Name the batch the way the user counts: training batches by iteration (samples are consumed in
    // order, global_batch_size per iteration) and micro-batch.
    const int64_t gbs = cfg_.global_batch_size > 0 ? cfg_.global_batch_size : group;
    if (cfg_.role == "training")
      user_error("the training batch of iteration ", start / gbs + 1, " (micro-batch ", (start % gbs) / group,
                 ", ", dataset_->description(), "): ", e.what(),
                 ". The data holds ids the model cannot embed: was it tokenised with a larger vocabulary? Check "
                 "--vocab-size / --tokenizer-type / --vocab-file against the data (`loom data check PREFIX "
                 "--vocab-size N` lists every such id)");
    user_error("a ", cfg_.role, " batch (", dataset_->description(), "): ", e.what(),
               ". The data holds ids the model cannot embed: check the tokenizer flags against the data (`loom "
               "data check PREFIX --vocab-size N` lists every such id)");
  }
  return b;
}

std::optional<Batch> Loader::next() {
  std::optional<Batch> b;
  if (!prefetcher_) {
    b = produce(step_);
  } else {
    Prefetcher& p = *prefetcher_;
    std::unique_lock lock(p.mu);
    p.cv.wait(lock, [&] { return !p.queue.empty() || (p.done && p.error); });
    if (p.queue.empty()) std::rethrow_exception(p.error);
    if (!p.queue.front().has_value()) return std::nullopt;  // the end marker stays: next() keeps answering nullopt
    b = std::move(p.queue.front());
    p.queue.pop_front();
    p.cv.notify_all();
  }
  if (!b) return b;
  ++step_;
  consumed_ += cfg_.micro_batch_size * cfg_.dp_size;
  return b;
}

}  // namespace loom
