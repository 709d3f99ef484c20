// Loader: Megatron's sampler order per data-parallel rank, resume from a consumed-sample count,
// prefetch depth never changes the batches, errors (token ids outside the vocabulary name the batch, the
// place the dataset read them from and the valid range),
// exception propagation and clean shutdown; and the
// per-token extras of --reset-position-ids / --reset-attention-mask / --eod-mask-loss.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "loom/core/check.h"
#include "loom/data/loader.h"

using namespace loom;

namespace {

// Sample i, position t holds i * 1000 + t, so a row names its sample and the label shift is visible.
class IotaDataset final : public SampleDataset {
 public:
  IotaDataset(int64_t n, int64_t T, int64_t throw_at = -1, int sleep_ms = 0)
      : n_(n), T_(T), throw_at_(throw_at), sleep_ms_(sleep_ms) {}
  int64_t size() const override { return n_; }
  int64_t seq_length() const override { return T_; }
  void sample(int64_t i, int32_t* out) const override {
    calls.fetch_add(1);
    if (sleep_ms_) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms_));
    if (i == throw_at_) throw std::runtime_error("sample read failed");
    for (int64_t t = 0; t <= T_; ++t) out[t] = int32_t(i * 1000 + t);
  }
  std::string description() const override { return "iota"; }
  mutable std::atomic<int64_t> calls{0};

 private:
  int64_t n_, T_, throw_at_;
  int sleep_ms_;
};

LoaderConfig config(int64_t gbs, int64_t mbs, int rank, int dp, int64_t consumed, int depth = 2) {
  LoaderConfig c;
  c.global_batch_size = gbs;
  c.micro_batch_size = mbs;
  c.dp_rank = rank;
  c.dp_size = dp;
  c.consumed_samples = consumed;
  c.prefetch_depth = depth;
  return c;
}

std::vector<int64_t> row_samples(const Batch& b) {
  std::vector<int64_t> out;
  const int64_t T = b.tokens.size(1);
  for (int64_t r = 0; r < b.tokens.size(0); ++r) out.push_back(b.tokens.data<int32_t>()[r * T] / 1000);
  return out;
}

template <typename F>
std::string user_error_text(F&& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "<no UserError>";
}

}  // namespace

TEST(LoaderExtras, PositionsSegmentsAndLossMaskFollowEods) {
  const std::vector<int32_t> tok = {5, 0, 7, 8, 0, 0, 9};  // EOD = 0
  std::vector<float> mask(tok.size());
  std::vector<int32_t> pos(tok.size()), seg(tok.size());
  BatchOptions all{true, true, true, 0};
  token_extras(tok, all, mask.data(), pos.data(), seg.data());
  EXPECT_EQ(mask, (std::vector<float>{1, 0, 1, 1, 0, 0, 1}));
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 0, 1, 2, 0, 0}));
  EXPECT_EQ(seg, (std::vector<int32_t>{0, 0, 1, 1, 1, 2, 3}));

  BatchOptions none{false, false, false, 0};
  token_extras(tok, none, mask.data(), pos.data(), seg.data());
  EXPECT_EQ(mask, std::vector<float>(tok.size(), 1.0f));
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(seg, std::vector<int32_t>(tok.size(), 0));

  // Each flag alone changes only its own output.
  BatchOptions only_pos{true, false, false, 0};
  token_extras(tok, only_pos, mask.data(), pos.data(), seg.data());
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 0, 1, 2, 0, 0}));
  EXPECT_EQ(seg, std::vector<int32_t>(tok.size(), 0));
  EXPECT_EQ(mask, std::vector<float>(tok.size(), 1.0f));
  BatchOptions only_seg{false, true, false, 0};
  token_extras(tok, only_seg, mask.data(), pos.data(), seg.data());
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(seg, (std::vector<int32_t>{0, 0, 1, 1, 1, 2, 3}));
  BatchOptions only_mask{false, false, true, 0};
  token_extras(tok, only_mask, mask.data(), pos.data(), seg.data());
  EXPECT_EQ(mask, (std::vector<float>{1, 0, 1, 1, 0, 0, 1}));
  EXPECT_EQ(seg, std::vector<int32_t>(tok.size(), 0));
}

TEST(Loader, MegatronSamplerOrderPerRank) {
  // 50 samples, micro 2 x dp 3 = 6 per step; resume at 7: steps start at 7, 13, ..., 43 (7 steps).
  auto ds = std::make_shared<IotaDataset>(50, 5);
  const int dp = 3;
  for (int rank = 0; rank < dp; ++rank) {
    Loader l(ds, config(12, 2, rank, dp, 7));
    EXPECT_EQ(l.micro_batches_per_step(), 2);
    int64_t step = 0;
    while (auto b = l.next()) {
      const int64_t first = 7 + step * 6 + rank * 2;
      EXPECT_EQ(b->first_sample, first);
      EXPECT_EQ(row_samples(*b), (std::vector<int64_t>{first, first + 1})) << "rank " << rank << " step " << step;
      ASSERT_EQ(b->tokens.shape(), (Shape{2, 5}));
      ASSERT_EQ(b->labels.shape(), (Shape{2, 5}));
      for (int64_t r = 0; r < 2; ++r)
        for (int64_t t = 0; t < 5; ++t) {
          EXPECT_EQ(b->tokens.data<int32_t>()[r * 5 + t], int32_t((first + r) * 1000 + t));
          EXPECT_EQ(b->labels.data<int32_t>()[r * 5 + t], int32_t((first + r) * 1000 + t + 1));
          EXPECT_EQ(b->position_ids.data<int32_t>()[r * 5 + t], t);
          EXPECT_EQ(b->segment_ids.data<int32_t>()[r * 5 + t], 0);
          EXPECT_EQ(b->loss_mask.data<float>()[r * 5 + t], 1.0f);
        }
      ++step;
      EXPECT_EQ(l.consumed_samples(), 7 + step * 6);
    }
    EXPECT_EQ(step, 7);  // (50 - 7) / 6; the last 1 sample is dropped
    EXPECT_FALSE(l.next().has_value());  // stays at the end
  }
}

TEST(Loader, ResumeAndPrefetchDepthGiveIdenticalBatches) {
  auto ds = std::make_shared<IotaDataset>(200, 4);
  auto collect = [&](int64_t consumed, int depth, int rank, int n) {
    Loader l(ds, config(16, 4, rank, 2, consumed, depth));
    std::vector<std::vector<int64_t>> out;
    for (int i = 0; i < n; ++i) out.push_back(row_samples(*l.next()));
    return out;
  };
  for (int rank = 0; rank < 2; ++rank) {
    const auto full = collect(0, 2, rank, 20);
    const auto resumed = collect(5 * 8, 2, rank, 15);  // 5 micro-batches of 8 samples consumed
    for (int i = 0; i < 15; ++i) EXPECT_EQ(resumed[size_t(i)], full[size_t(i + 5)]) << "rank " << rank;
    EXPECT_EQ(collect(0, 0, rank, 20), full);
    EXPECT_EQ(collect(0, 1, rank, 20), full);
    EXPECT_EQ(collect(0, 7, rank, 20), full);
  }
  // The two ranks of a step together cover one contiguous range.
  const auto r0 = collect(0, 2, 0, 1)[0], r1 = collect(0, 2, 1, 1)[0];
  EXPECT_EQ(r0, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(r1, (std::vector<int64_t>{4, 5, 6, 7}));
}

TEST(Loader, ExtrasFromTheTokenizersEod) {
  // Sample i's tokens are i*1000 + t, so with eod = 2003 only sample 2, position 3 is an EOD.
  auto ds = std::make_shared<IotaDataset>(8, 6);
  LoaderConfig c = config(2, 2, 0, 1, 2);
  c.batch = BatchOptions{true, true, true, 2003};
  Loader l(ds, c);
  const auto b = l.next();
  ASSERT_TRUE(b.has_value());
  const std::vector<int32_t> pos(b->position_ids.data<int32_t>(), b->position_ids.data<int32_t>() + 6);
  const std::vector<int32_t> seg(b->segment_ids.data<int32_t>(), b->segment_ids.data<int32_t>() + 6);
  const std::vector<float> mask(b->loss_mask.data<float>(), b->loss_mask.data<float>() + 6);
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 3, 0, 1}));
  EXPECT_EQ(seg, (std::vector<int32_t>{0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(mask, (std::vector<float>{1, 1, 1, 0, 1, 1}));
  const std::vector<int32_t> pos1(b->position_ids.data<int32_t>() + 6, b->position_ids.data<int32_t>() + 12);
  EXPECT_EQ(pos1, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));  // sample 3 has no EOD
}

TEST(Loader, UserErrors) {
  auto ds = std::make_shared<IotaDataset>(20, 4);
  EXPECT_NE(user_error_text([&] { Loader(ds, config(10, 4, 0, 1, 0)); }).find("--global-batch-size"),
            std::string::npos);
  EXPECT_NE(user_error_text([&] { Loader(ds, config(4, 4, 0, 2, 0)); }).find("--global-batch-size"),
            std::string::npos);
  EXPECT_NE(user_error_text([&] { Loader(ds, config(4, 0, 0, 1, 0)); }).find("--micro-batch-size"),
            std::string::npos);
  EXPECT_NE(user_error_text([&] { Loader(ds, config(4, 4, 0, 1, 20)); }).find("no samples left"), std::string::npos);
  LoaderConfig c = config(4, 4, 0, 1, 0);
  c.batch.eod_mask_loss = true;  // eod = -1
  EXPECT_NE(user_error_text([&] { Loader(ds, c); }).find("--eod-mask-loss"), std::string::npos);
}

TEST(Loader, TokenIdsOutsideTheVocabularyNameTheBatch) {
  // Sample i holds i*1000 + t for t = 0..4 (the last one is the label of position 3).
  auto ds = std::make_shared<IotaDataset>(40, 4);
  LoaderConfig c = config(4, 2, 0, 1, 0);
  c.batch.vocab_size = 5000;  // samples 0..4 fit; sample 5 starts with 5000
  {
    Loader l(ds, c);
    EXPECT_EQ(row_samples(*l.next()), (std::vector<int64_t>{0, 1}));
    EXPECT_EQ(row_samples(*l.next()), (std::vector<int64_t>{2, 3}));
    const std::string e = user_error_text([&] { l.next(); });
    EXPECT_NE(e.find("the training batch of iteration 2 (micro-batch 0"), std::string::npos) << e;
    EXPECT_NE(e.find("token id 5000 at position 0 of sample 5 is outside the vocabulary [0, 5000)"),
              std::string::npos) << e;
    EXPECT_NE(e.find("--vocab-size"), std::string::npos) << e;
  }
  c.batch.vocab_size = 4004;  // sample 4's label (position 4) is the first id out of range
  c.role = "validation";
  c.prefetch_depth = 0;
  Loader l(ds, c);
  l.next();
  l.next();
  const std::string e = user_error_text([&] { l.next(); });
  EXPECT_NE(e.find("a validation batch"), std::string::npos) << e;
  EXPECT_NE(e.find("token id 4004 at position 4 of sample 4"), std::string::npos) << e;
  c.batch.vocab_size = 0;  // unchecked
  Loader unchecked(ds, c);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(unchecked.next().has_value());
}

// A dataset that can say where its tokens come from: the error carries that place and the valid range.
TEST(Loader, TokenIdsOutsideTheVocabularyNameTheirSource) {
  class Located final : public SampleDataset {
   public:
    int64_t size() const override { return 8; }
    int64_t seq_length() const override { return 6; }
    void sample(int64_t i, int32_t* out) const override {
      for (int64_t t = 0; t <= 6; ++t) out[t] = (i == 5 && t == 3) ? 60000 : int32_t(t);
    }
    std::string description() const override { return "located"; }
    std::string locate(int64_t i, int64_t t) const override {
      return "x.bin: document " + std::to_string(10 + i) + ", token " + std::to_string(t);
    }
  };
  LoaderConfig c = config(2, 1, 0, 1, 0);
  c.batch.vocab_size = 50257;
  c.batch.vocab_source = "GPT2BPETokenizer";
  Loader l(std::make_shared<Located>(), c);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(l.next().has_value());
  const std::string e = user_error_text([&] { l.next(); });
  EXPECT_NE(e.find("the training batch of iteration 3 (micro-batch 1, located): token id 60000 at position 3 of "
                   "sample 5 (x.bin: document 15, token 3) is outside the vocabulary [0, 50257) of GPT2BPETokenizer: "
                   "valid ids are 0 .. 50256"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("loom data check"), std::string::npos) << e;
}

TEST(Loader, FirstIdOutsideFindsBothEnds) {
  std::vector<int32_t> ids(1000, 7);
  EXPECT_EQ(first_id_outside(ids.data(), 1000, 8), -1);
  EXPECT_EQ(first_id_outside(ids.data(), 1000, 7), 0);
  ids[217] = -1;
  EXPECT_EQ(first_id_outside(ids.data(), 1000, 8), 217);
  ids[217] = 7;
  ids[999] = 2147483647;
  EXPECT_EQ(first_id_outside(ids.data(), 1000, int64_t(1) << 31), -1);
  EXPECT_EQ(first_id_outside(ids.data(), 1000, 2147483647), 999);
  ids[5] = int32_t(0x80000000u);  // INT32_MIN: negative, not a large id
  EXPECT_EQ(first_id_outside(ids.data(), 1000, int64_t(1) << 31), 5);
  EXPECT_EQ(first_id_outside(ids.data(), 0, 1), -1);
}

TEST(Loader, ProducerErrorIsRethrownAfterEarlierBatches) {
  auto ds = std::make_shared<IotaDataset>(40, 4, /*throw_at=*/9);
  Loader l(ds, config(4, 4, 0, 1, 0, 3));
  EXPECT_EQ(row_samples(*l.next()), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(row_samples(*l.next()), (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_THROW(l.next(), std::runtime_error);
}

TEST(Loader, DestructionStopsThePrefetchThread) {
  auto ds = std::make_shared<IotaDataset>(100000, 4, -1, /*sleep_ms=*/2);
  const auto t0 = std::chrono::steady_clock::now();
  {
    Loader never_read(ds, config(8, 8, 0, 1, 0, 4));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  {
    Loader l(ds, config(8, 8, 0, 1, 0, 4));
    ASSERT_TRUE(l.next().has_value());
  }
  const int64_t calls = ds->calls.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(ds->calls.load(), calls) << "a producer kept reading after its Loader was destroyed";
  // Bounded queue: at most depth + 1 micro-batches (8 samples each) were ever read per loader.
  EXPECT_LE(calls, 2 * (4 + 2) * 8);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}
