// Pre-tokenizer: hand-written scanners equivalent to the split regexes of GPT-2, cl100k_base and
// Megatron's TikTokenizer v1/v2 (the patterns are spelled out in tokenizers_impl.h). Each scanner
// reproduces the backtracking engine's leftmost-first choice among the alternatives at one position;
// every position matches some alternative, so the pieces tile the text.
// Character classes come from ICU: \p{L} = Lu Ll Lt Lm Lo, \p{N} = Nd Nl No, \p{M} = Mn Mc Me,
// \s = the White_Space property (what Python `regex` and Rust `regex`/fancy-regex use; note JavaScript's
// \s differs on U+0085 and U+FEFF). Bytes that are not valid UTF-8 are single "other" code points.
#include <unicode/uchar.h>

#include <array>

#include "data/bpe.h"

namespace loom {

namespace {

enum Cls : uint8_t { kLu, kLl, kLt, kLm, kLo, kMark, kNum, kSpace, kOther };

struct Cp {
  uint32_t cp;
  uint32_t len;  // bytes
  Cls cls;
};

constexpr std::array<Cls, 128> make_ascii_table() {
  std::array<Cls, 128> t{};
  for (int c = 0; c < 128; ++c) {
    if (c >= 'A' && c <= 'Z') t[c] = kLu;
    else if (c >= 'a' && c <= 'z') t[c] = kLl;
    else if (c >= '0' && c <= '9') t[c] = kNum;
    else if ((c >= 9 && c <= 13) || c == ' ') t[c] = kSpace;  // White_Space; 0x1C-0x1F are not
    else t[c] = kOther;
  }
  return t;
}
constexpr std::array<Cls, 128> kAscii = make_ascii_table();

Cls classify(uint32_t cp) {
  switch (u_charType(UChar32(cp))) {
    case U_UPPERCASE_LETTER: return kLu;
    case U_LOWERCASE_LETTER: return kLl;
    case U_TITLECASE_LETTER: return kLt;
    case U_MODIFIER_LETTER: return kLm;
    case U_OTHER_LETTER: return kLo;
    case U_NON_SPACING_MARK:
    case U_ENCLOSING_MARK:
    case U_COMBINING_SPACING_MARK: return kMark;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER: return kNum;
    default: return u_isUWhiteSpace(UChar32(cp)) ? kSpace : kOther;
  }
}

inline bool is_cont(uint8_t b) { return (b & 0xC0) == 0x80; }

inline bool is_letter(Cls c) { return c <= kLo; }
inline bool is_otherish(Cls c) { return c == kMark || c == kOther; }  // [^\s\p{L}\p{N}]
inline bool is_newline(const Cp& c) { return c.cp == '\r' || c.cp == '\n'; }
// [^\r\n\p{L}\p{N}]: the optional one-character prefix of a letter run.
inline bool is_prefix(const Cp& c) { return !is_newline(c) && !is_letter(c.cls) && c.cls != kNum; }
inline bool is_upperish(Cls c) { return c == kLu || c == kLt || c == kLm || c == kLo || c == kMark; }
inline bool is_lowerish(Cls c) { return c == kLl || c == kLm || c == kLo || c == kMark; }

constexpr size_t kNoMatch = ~size_t(0);

class Scanner {
 public:
  explicit Scanner(std::string_view t) : s_(reinterpret_cast<const uint8_t*>(t.data())), n_(t.size()) {}

  // The code point at byte offset i (< n_); invalid UTF-8 -> the single byte as kOther.
  Cp at(size_t i) const {
    const uint8_t b0 = s_[i];
    if (b0 < 0x80) return {b0, 1, kAscii[b0]};
    const size_t left = n_ - i;
    uint32_t cp = 0, len = 0;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      if (left >= 2 && is_cont(s_[i + 1])) cp = ((b0 & 0x1Fu) << 6) | (s_[i + 1] & 0x3Fu), len = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      if (left >= 3 && is_cont(s_[i + 1]) && is_cont(s_[i + 2])) {
        const uint8_t b1 = s_[i + 1];
        const bool ok = (b0 == 0xE0) ? b1 >= 0xA0 : (b0 == 0xED) ? b1 <= 0x9F : true;  // overlong, surrogates
        if (ok) cp = ((b0 & 0x0Fu) << 12) | ((b1 & 0x3Fu) << 6) | (s_[i + 2] & 0x3Fu), len = 3;
      }
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      if (left >= 4 && is_cont(s_[i + 1]) && is_cont(s_[i + 2]) && is_cont(s_[i + 3])) {
        const uint8_t b1 = s_[i + 1];
        const bool ok = (b0 == 0xF0) ? b1 >= 0x90 : (b0 == 0xF4) ? b1 <= 0x8F : true;  // overlong, > U+10FFFF
        if (ok)
          cp = ((b0 & 0x07u) << 18) | ((b1 & 0x3Fu) << 12) | ((s_[i + 2] & 0x3Fu) << 6) | (s_[i + 3] & 0x3Fu),
          len = 4;
      }
    }
    if (len == 0) return {b0, 1, kOther};
    return {cp, len, classify(cp)};
  }

  template <typename Pred>
  size_t run(size_t i, Pred pred) const {  // end of the longest run of code points satisfying pred
    while (i < n_) {
      const Cp c = at(i);
      if (!pred(c)) break;
      i += c.len;
    }
    return i;
  }
  size_t letters(size_t i) const { return run(i, [](const Cp& c) { return is_letter(c.cls); }); }
  size_t otherish(size_t i) const { return run(i, [](const Cp& c) { return is_otherish(c.cls); }); }

  // Whitespace alternatives at i (a whitespace code point). With `newline_alt`, first \s*[\r\n]+
  // (equivalently \s*[\r\n]): greedy \s* backs off to the last newline of the run. Then \s+(?!\S):
  // the whole run at the end of the text, else all but its last code point; then \s+ (one code point).
  size_t whitespace(size_t i, bool newline_alt) const {
    size_t j = i, last_start = i, after_newline = kNoMatch;
    int count = 0;
    while (j < n_) {
      const Cp c = at(j);
      if (c.cls != kSpace) break;
      if (is_newline(c)) after_newline = j + c.len;
      last_start = j;
      j += c.len;
      ++count;
    }
    if (newline_alt && after_newline != kNoMatch) return after_newline;
    if (j == n_ || count == 1) return j;
    return last_start;
  }

  // ' ?X+' where X = [^\s\p{L}\p{N}]: optional space, run of "other"; kNoMatch if none.
  size_t space_otherish(size_t i, const Cp& c0) const {
    if (c0.cp == ' ' && i + 1 < n_ && is_otherish(at(i + 1).cls)) return otherish(i + 1);
    if (is_otherish(c0.cls)) return otherish(i);
    return kNoMatch;
  }

  size_t gpt2(size_t i) const {
    if (s_[i] == '\'' && i + 1 < n_) {  // 's|'t|'re|'ve|'m|'ll|'d, case-sensitive
      const uint8_t b1 = s_[i + 1];
      if (b1 == 's' || b1 == 't' || b1 == 'm' || b1 == 'd') return i + 2;
      if (i + 2 < n_) {
        const uint8_t b2 = s_[i + 2];
        if ((b1 == 'r' && b2 == 'e') || (b1 == 'v' && b2 == 'e') || (b1 == 'l' && b2 == 'l')) return i + 3;
      }
    }
    const Cp c0 = at(i);
    size_t p = i;
    Cp c = c0;
    if (c0.cp == ' ' && i + 1 < n_) {  // ' ?' then \p{L}+ | \p{N}+ | [^\s\p{L}\p{N}]+
      const Cp c1 = at(i + 1);
      if (c1.cls != kSpace) p = i + 1, c = c1;
    }
    if (is_letter(c.cls)) return letters(p);
    if (c.cls == kNum) return run(p, [](const Cp& x) { return x.cls == kNum; });
    if (c.cls != kSpace) return otherish(p);
    return whitespace(i, false);
  }

  // (?i:'s|'t|'re|'ve|'m|'ll|'d) with Unicode simple case folding (s ~ S ~ U+017F).
  size_t contraction_ci(size_t i) const {
    const Cp c1 = at(i + 1);
    const uint32_t a = c1.cp;
    const size_t j = i + 1 + c1.len;
    if (a == 's' || a == 'S' || a == 0x17F || a == 't' || a == 'T' || a == 'm' || a == 'M' || a == 'd' ||
        a == 'D')
      return j;
    if (j < n_) {
      const uint8_t b = s_[j];
      if ((a == 'r' || a == 'R' || a == 'v' || a == 'V') && (b == 'e' || b == 'E')) return j + 1;
      if ((a == 'l' || a == 'L') && (b == 'l' || b == 'L')) return j + 1;
    }
    return kNoMatch;
  }

  // [^\r\n\p{L}\p{N}]?\p{L}+ (cl100k, Megatron v1; v1's possessive ?+ cannot change the result).
  size_t prefixed_letters(size_t i, const Cp& c0) const {
    if (is_letter(c0.cls)) return letters(i);
    if (is_prefix(c0) && i + c0.len < n_ && is_letter(at(i + c0.len).cls)) return letters(i + c0.len);
    return kNoMatch;
  }

  size_t cl100k(size_t i) const {
    if (s_[i] == '\'' && i + 1 < n_) {
      const size_t e = contraction_ci(i);
      if (e != kNoMatch) return e;
    }
    const Cp c0 = at(i);
    size_t e = prefixed_letters(i, c0);
    if (e != kNoMatch) return e;
    if (c0.cls == kNum) {  // \p{N}{1,3}
      e = i + c0.len;
      for (int k = 1; k < 3 && e < n_; ++k) {
        const Cp c = at(e);
        if (c.cls != kNum) break;
        e += c.len;
      }
      return e;
    }
    e = space_otherish(i, c0);  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    if (e != kNoMatch) return run(e, [](const Cp& c) { return is_newline(c); });
    return whitespace(i, true);
  }

  size_t megatron_v1(size_t i) const {
    const Cp c0 = at(i);
    size_t e = prefixed_letters(i, c0);
    if (e != kNoMatch) return e;
    if (c0.cls == kNum) return i + c0.len;  // \p{N}
    e = space_otherish(i, c0);              // ' ?[^\s\p{L}\p{N}]++[\r\n]*'
    if (e != kNoMatch) return run(e, [](const Cp& c) { return is_newline(c); });
    return whitespace(i, true);
  }

  // U*W+ from p with U = [Lu Lt Lm Lo M], W = [Ll Lm Lo M]. Greedy U* then W+, backing U* off one code
  // point at a time: if the code point after the U-run is in W (then it is Ll), W+ runs on from there;
  // otherwise the match ends after the last U-run code point that is also in W.
  size_t upper_lower(size_t p) const {
    size_t q = p, after_last_w = kNoMatch;
    while (q < n_) {
      const Cp c = at(q);
      if (!is_upperish(c.cls)) break;
      if (is_lowerish(c.cls)) after_last_w = q + c.len;
      q += c.len;
    }
    if (q < n_ && is_lowerish(at(q).cls)) return run(q, [](const Cp& c) { return is_lowerish(c.cls); });
    return after_last_w;
  }
  // U+W*; kNoMatch when the U-run is empty.
  size_t upper_run_lower(size_t p) const {
    const size_t q = run(p, [](const Cp& c) { return is_upperish(c.cls); });
    if (q == p) return kNoMatch;
    return run(q, [](const Cp& c) { return is_lowerish(c.cls); });
  }

  size_t megatron_v2(size_t i) const {
    const Cp c0 = at(i);
    const bool prefix = is_prefix(c0) && i + c0.len < n_;
    size_t e;
    if (prefix && (e = upper_lower(i + c0.len)) != kNoMatch) return e;  // P?U*W+, with the prefix
    if ((e = upper_lower(i)) != kNoMatch) return e;                      // ... and without
    if (prefix && (e = upper_run_lower(i + c0.len)) != kNoMatch) return e;  // P?U+W*
    if ((e = upper_run_lower(i)) != kNoMatch) return e;
    if (c0.cls == kNum) return i + c0.len;  // \p{N}
    e = space_otherish(i, c0);              // ' ?[^\s\p{L}\p{N}]+[\r\n/]*'
    if (e != kNoMatch) return run(e, [](const Cp& c) { return is_newline(c) || c.cp == '/'; });
    return whitespace(i, true);
  }

 private:
  const uint8_t* s_;
  size_t n_;
};

}  // namespace

namespace bpe {

size_t next_piece_end(std::string_view text, size_t pos, PretokenPattern pattern) {
  const Scanner sc(text);
  switch (pattern) {
    case PretokenPattern::kGpt2: return sc.gpt2(pos);
    case PretokenPattern::kCl100k: return sc.cl100k(pos);
    case PretokenPattern::kMegatronV1: return sc.megatron_v1(pos);
    case PretokenPattern::kMegatronV2: return sc.megatron_v2(pos);
  }
  return text.size();
}

}  // namespace bpe

void pretokenize(std::string_view text, PretokenPattern pattern, std::vector<std::string_view>& pieces) {
  size_t i = 0;
  while (i < text.size()) {
    const size_t e = bpe::next_piece_end(text, i, pattern);
    pieces.push_back(text.substr(i, e - i));
    i = e;
  }
}

}  // namespace loom
