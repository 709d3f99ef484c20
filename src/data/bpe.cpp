// Byte-level BPE core shared by GPT2BPETokenizer and TikTokenizer: merge table, merge loop (linear scan
// for short words, lazy-deletion heap for long ones), word cache, and file helpers.
// Heap merge invariants: node indices are the initial symbol positions, so index order is text order
// and (rank, position) heap order is "lowest rank, leftmost first". A heap entry records the ids it saw;
// it is stale (skipped) once either node has been merged into something else.
#include "data/bpe.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>

#include "loom/core/check.h"

namespace loom::bpe {

// ---- PairTable ------------------------------------------------------------------------------------

void PairTable::reserve(size_t n) {
  size_t cap = 16;
  while (cap < 2 * n) cap <<= 1;
  if (cap <= slots_.size()) return;
  std::vector<Entry> old;
  old.swap(slots_);
  slots_.assign(cap, Entry{kEmpty, 0, 0});
  mask_ = cap - 1;
  shift_ = 64 - __builtin_ctzll(cap);
  size_ = 0;
  for (const Entry& e : old)
    if (e.key != kEmpty) insert(int32_t(e.key >> 32), int32_t(uint32_t(e.key)), e.rank, e.merged);
}

void PairTable::grow() { reserve(std::max<size_t>(16, size_ + 1)); }

void PairTable::insert(int32_t left, int32_t right, int32_t rank, int32_t merged) {
  if (2 * (size_ + 1) > slots_.size()) reserve(2 * (size_ + 1));
  const uint64_t key = pack(left, right);
  for (size_t i = slot_of(key);; i = (i + 1) & mask_) {
    Entry& e = slots_[i];
    if (e.key == key) {
      e.rank = rank, e.merged = merged;
      return;
    }
    if (e.key == kEmpty) {
      e = Entry{key, rank, merged};
      ++size_;
      return;
    }
  }
}

// ---- merge ----------------------------------------------------------------------------------------

namespace {

// Linear-scan merge: ranks[k] is the rank of pair (syms[k], syms[k+1]) or INT_MAX.
void merge_scan(std::vector<int32_t>& syms, const PairTable& pairs, MergeOrder order, MergeScratch& s) {
  auto& ranks = s.ranks;
  auto& merged = s.merged;
  size_t n = syms.size();
  ranks.resize(n);
  merged.resize(n);
  auto rank_at = [&](size_t k) {
    const PairTable::Entry* e = pairs.find(syms[k], syms[k + 1]);
    ranks[k] = e ? e->rank : INT_MAX;
    merged[k] = e ? e->merged : -1;
  };
  for (size_t k = 0; k + 1 < n; ++k) rank_at(k);
  while (n > 1) {
    size_t best = 0;
    for (size_t k = 1; k + 1 < n; ++k)
      if (ranks[k] < ranks[best]) best = k;
    if (ranks[best] == INT_MAX) break;
    if (order == MergeOrder::kLeftmostSingle) {
      syms[best] = merged[best];
      syms.erase(syms.begin() + ptrdiff_t(best) + 1);
      ranks.erase(ranks.begin() + ptrdiff_t(best) + 1);
      merged.erase(merged.begin() + ptrdiff_t(best) + 1);
      --n;
      if (best + 1 < n) rank_at(best);
      if (best > 0) rank_at(best - 1);
      continue;
    }
    // kAllOccurrences: merge every (a, b) left to right without overlaps, then rescan all pairs.
    const int32_t a = syms[best], b = syms[best + 1], m = merged[best];
    size_t w = best;
    for (size_t r = best; r < n;) {
      if (r + 1 < n && syms[r] == a && syms[r + 1] == b) {
        syms[w++] = m;
        r += 2;
      } else {
        syms[w++] = syms[r++];
      }
    }
    n = w;
    syms.resize(n);
    for (size_t k = (best > 0 ? best - 1 : 0); k + 1 < n; ++k) rank_at(k);
  }
}

void merge_heap(std::vector<int32_t>& syms, const PairTable& pairs, MergeOrder order, MergeScratch& s) {
  const int32_t n = int32_t(syms.size());
  auto& prev = s.prev;
  auto& next = s.next;
  auto& heap = s.heap;
  prev.resize(size_t(n));
  next.resize(size_t(n));
  for (int32_t i = 0; i < n; ++i) prev[size_t(i)] = i - 1, next[size_t(i)] = i + 1 < n ? i + 1 : -1;
  heap.clear();
  // Min-heap on (rank, pos) through std::push_heap with a "greater" comparator.
  auto greater = [](const MergeScratch::HeapEntry& x, const MergeScratch::HeapEntry& y) {
    return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
  };
  auto push_pair = [&](int32_t p) {
    const int32_t q = next[size_t(p)];
    if (q < 0) return;
    const PairTable::Entry* e = pairs.find(syms[size_t(p)], syms[size_t(q)]);
    if (!e) return;
    heap.push_back({e->rank, p, syms[size_t(p)], q, syms[size_t(q)]});
    std::push_heap(heap.begin(), heap.end(), greater);
  };
  auto pop = [&] {
    std::pop_heap(heap.begin(), heap.end(), greater);
    const MergeScratch::HeapEntry e = heap.back();
    heap.pop_back();
    return e;
  };
  // Dead nodes get id -1, so a stale entry never matches them.
  auto valid = [&](const MergeScratch::HeapEntry& e) {
    return syms[size_t(e.pos)] == e.left_id && next[size_t(e.pos)] == e.right_pos &&
           syms[size_t(e.right_pos)] == e.right_id;
  };
  auto merge_at = [&](const MergeScratch::HeapEntry& e) {
    const PairTable::Entry* pe = pairs.find(e.left_id, e.right_id);
    const int32_t p = e.pos, q = e.right_pos, r = next[size_t(q)];
    syms[size_t(p)] = pe->merged;
    syms[size_t(q)] = -1;
    next[size_t(p)] = r;
    if (r >= 0) prev[size_t(r)] = p;
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    const MergeScratch::HeapEntry top = pop();
    if (!valid(top)) continue;
    if (order == MergeOrder::kLeftmostSingle) {
      merge_at(top);
      if (prev[size_t(top.pos)] >= 0) push_pair(prev[size_t(top.pos)]);
      push_pair(top.pos);
      continue;
    }
    // kAllOccurrences: one round = every valid entry of this rank, in position order; the pairs the
    // round creates enter the heap only after it, as OpenAI's encoder rescans once per round.
    auto& pending = s.pending;
    pending.clear();
    MergeScratch::HeapEntry e = top;
    for (;;) {
      merge_at(e);
      if (prev[size_t(e.pos)] >= 0) pending.push_back(prev[size_t(e.pos)]);
      pending.push_back(e.pos);
      bool more = false;
      while (!heap.empty() && heap.front().rank == top.rank) {
        e = pop();
        if (valid(e)) {
          more = true;
          break;
        }
      }
      if (!more) break;
    }
    for (const int32_t p : pending)
      if (syms[size_t(p)] >= 0) push_pair(p);
  }
  size_t w = 0;
  for (int32_t p = 0; p >= 0; p = next[size_t(p)]) syms[w++] = syms[size_t(p)];
  syms.resize(w);
}

}  // namespace

void merge(std::vector<int32_t>& syms, const PairTable& pairs, MergeOrder order, MergeScratch& scratch,
           bool force_heap) {
  if (syms.size() < 2) return;
  if (force_heap || syms.size() > kHeapThreshold)
    merge_heap(syms, pairs, order, scratch);
  else
    merge_scan(syms, pairs, order, scratch);
}

// ---- WordCache ------------------------------------------------------------------------------------

WordCache::WordCache(size_t max_entries)
    : max_per_shard_(std::max<size_t>(1, max_entries / kShards)),
      shards_(std::make_unique<std::array<Shard, kShards>>()) {}

bool WordCache::find(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() > kMaxWordBytes) return false;
  Shard& sh = (*shards_)[Hash{}(word) % kShards];
  std::lock_guard<std::mutex> lock(sh.mu);
  const auto it = sh.map.find(word);
  if (it == sh.map.end()) return false;
  out.insert(out.end(), it->second.begin(), it->second.end());
  return true;
}

void WordCache::insert(std::string_view word, std::span<const int32_t> ids) {
  if (word.size() > kMaxWordBytes) return;
  Shard& sh = (*shards_)[Hash{}(word) % kShards];
  std::lock_guard<std::mutex> lock(sh.mu);
  if (sh.map.size() >= max_per_shard_) sh.map.clear();
  sh.map.try_emplace(std::string(word), ids.begin(), ids.end());
}

// ---- helpers --------------------------------------------------------------------------------------

std::pair<size_t, size_t> line_col(std::string_view text, size_t offset) {
  offset = std::min(offset, text.size());
  size_t line = 1, col = 1;
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') ++line, col = 1;
    else ++col;
  }
  return {line, col};
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

namespace {
// Printable bytes map to themselves; the other 68 bytes, in increasing order, to U+0100, U+0101, ...
bool byte_is_printable(int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE); }

struct ByteTables {
  uint32_t to_cp[256];
  int16_t from_cp[0x144];
  ByteTables() {
    std::fill(std::begin(from_cp), std::end(from_cp), int16_t(-1));
    uint32_t extra = 0;
    for (int b = 0; b < 256; ++b) {
      to_cp[b] = byte_is_printable(b) ? uint32_t(b) : 0x100 + extra++;
      from_cp[to_cp[b]] = int16_t(b);
    }
  }
};
const ByteTables& byte_tables() {
  static const ByteTables t;
  return t;
}
}  // namespace

uint32_t byte_to_unicode(uint8_t b) { return byte_tables().to_cp[b]; }

int unicode_to_byte(uint32_t cp) { return cp < 0x144 ? byte_tables().from_cp[cp] : -1; }

bool base64_decode(std::string_view in, std::string& out) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  out.clear();
  if (in.size() % 4 != 0) return false;
  for (size_t i = 0; i < in.size(); i += 4) {
    const bool last = i + 4 == in.size();
    const int pad = (last && in[i + 3] == '=') ? (in[i + 2] == '=' ? 2 : 1) : 0;
    int v[4];
    for (int k = 0; k < 4 - pad; ++k)
      if ((v[k] = val(in[i + size_t(k)])) < 0) return false;
    for (int k = 4 - pad; k < 4; ++k) v[k] = 0;
    const uint32_t x = (uint32_t(v[0]) << 18) | (uint32_t(v[1]) << 12) | (uint32_t(v[2]) << 6) | uint32_t(v[3]);
    out += char(x >> 16);
    if (pad < 2) out += char((x >> 8) & 0xFF);
    if (pad < 1) out += char(x & 0xFF);
  }
  return true;
}

}  // namespace loom::bpe
