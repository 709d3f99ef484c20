// Shared core of the byte-level BPE tokenizers (GPT2BPETokenizer, TikTokenizer): the pre-tokenizer
// step, the merge table keyed by (left id, right id), the merge loop, a bounded thread-safe word cache
// and the small file-parsing helpers both loaders use. Internal to the data layer.
// Invariants: symbols are token ids; a merge (left, right) -> merged has a rank, lower merges first;
// merge() never allocates on the short-word path once its scratch vectors have grown.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "data/tokenizers_impl.h"

namespace loom::bpe {

// End (byte offset) of the pre-token starting at `pos` (< text.size()); pretokenize() loops over it.
size_t next_piece_end(std::string_view text, size_t pos, PretokenPattern pattern);

// Open-addressing map (left id, right id) -> (rank, merged id); read-only after construction.
class PairTable {
 public:
  struct Entry {
    uint64_t key;
    int32_t rank;
    int32_t merged;
  };
  PairTable() = default;
  void reserve(size_t n);
  // A second insert of the same pair replaces rank and merged id.
  void insert(int32_t left, int32_t right, int32_t rank, int32_t merged);
  const Entry* find(int32_t left, int32_t right) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = pack(left, right);
    for (size_t i = slot_of(key);; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  static uint64_t pack(int32_t l, int32_t r) { return (uint64_t(uint32_t(l)) << 32) | uint32_t(r); }
  size_t slot_of(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  void grow();
  std::vector<Entry> slots_;
  size_t mask_ = 0, size_ = 0;
  int shift_ = 64;
};

// Which pair merges next. kAllOccurrences is OpenAI's GPT-2 encoder (and Megatron's copy): take the
// lowest-ranked pair and merge every occurrence of it, left to right, before looking again.
// kLeftmostSingle is tiktoken: merge only the leftmost lowest-ranked pair, then look again.
enum class MergeOrder { kAllOccurrences, kLeftmostSingle };

// Scratch space of merge(); one per thread (thread_local in the tokenizers).
struct MergeScratch {
  std::vector<int32_t> ranks, merged, tmp;
  struct HeapEntry {
    int32_t rank, pos, left_id, right_pos, right_id;
  };
  std::vector<HeapEntry> heap;
  std::vector<int32_t> prev, next, pending;
};

// Merges `syms` (initially one id per byte) in place. Words longer than kHeapThreshold symbols use a
// heap (O(n log n)); shorter ones a linear scan per merge. Both give identical results; `force_heap`
// exists so tests can compare them.
inline constexpr size_t kHeapThreshold = 48;
void merge(std::vector<int32_t>& syms, const PairTable& pairs, MergeOrder order, MergeScratch& scratch,
           bool force_heap = false);

// Bounded cache word -> ids, sharded by hash, each shard behind its own mutex (encode is called from
// many threads). A full shard is cleared, which bounds memory without LRU bookkeeping.
class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 64;  // longer words are rare and not worth caching
  explicit WordCache(size_t max_entries = size_t(1) << 17);
  // Appends the cached ids of `word` to `out` and returns true, or returns false.
  bool find(std::string_view word, std::vector<int32_t>& out) const;
  void insert(std::string_view word, std::span<const int32_t> ids);

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  struct Eq {
    using is_transparent = void;
    bool operator()(std::string_view a, std::string_view b) const { return a == b; }
  };
  struct Shard {
    mutable std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, Hash, Eq> map;
  };
  static constexpr size_t kShards = 32;
  size_t max_per_shard_;
  std::unique_ptr<std::array<Shard, kShards>> shards_;
};

// Knobs the benchmarks and tests need; the public factory uses the defaults.
struct BpeOptions {
  bool cache = true;
};
std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const TokenizerConfig& cfg, const BpeOptions& opts);
std::unique_ptr<Tokenizer> make_tiktoken_tokenizer(const TokenizerConfig& cfg, const BpeOptions& opts);

// ---- helpers for the loaders -------------------------------------------------------------------

// 1-based line and column of byte `offset` in `text`.
std::pair<size_t, size_t> line_col(std::string_view text, size_t offset);
// Appends the UTF-8 encoding of `cp` (< 0x110000) to `out`.
void append_utf8(uint32_t cp, std::string& out);
// GPT-2's byte <-> printable code point table (bytes_to_unicode in OpenAI's encoder.py).
uint32_t byte_to_unicode(uint8_t b);
int unicode_to_byte(uint32_t cp);  // -1 if cp is not in the table
// Decodes strict base64 (with padding); false if malformed.
bool base64_decode(std::string_view in, std::string& out);

}  // namespace loom::bpe
