// `loom data check` (loom/data/data_check.h): IndexedDataset::inspect for the structure, then one pass
// over the tokens, document by document, in blocks of at most kBlock ids (memory stays bounded whatever
// the document lengths). The id range of a block is a branch-free min/max; positions are looked at one by
// one only in a block that holds a bad id. Offsets are counted as the pass goes, so locating a bad id costs
// nothing extra.
#include "loom/data/data_check.h"

#include <algorithm>
#include <bit>
#include <filesystem>
#include <limits>
#include <memory>
#include <sstream>

#include "loom/core/check.h"
#include "loom/data/indexed_dataset.h"
#include "loom/data/sft_dataset.h"

namespace loom {

namespace {

constexpr int64_t kBlock = int64_t(1) << 20;

std::string strip_suffix(const std::string& p) {
  for (const char* ext : {".bin", ".idx"})
    if (p.size() > 4 && p.ends_with(ext)) return p.substr(0, p.size() - 4);
  return p;
}

int bucket_of(int64_t length) { return length == 0 ? 0 : int(std::bit_width(uint64_t(length))); }

// The SFT loss mask next to the tokens: the same sequences, values 0 or 1.
void check_loss_mask(const IndexedDataset& tokens, const std::string& mask_prefix, DataCheckReport& r) {
  IndexInspection in = IndexedDataset::inspect(mask_prefix);
  r.loss_mask_checked = true;
  for (std::string& p : in.problems) r.problems.push_back(std::move(p));
  if (!in.dataset) return;
  const IndexedDataset& mask = *in.dataset;
  if (mask.num_sequences() != tokens.num_sequences()) {
    r.problems.push_back(mask_prefix + ".idx holds " + std::to_string(mask.num_sequences()) + " sequences, " +
                         tokens.prefix() + ".idx " + std::to_string(tokens.num_sequences()) +
                         ": the loss mask does not belong to these tokens");
    return;
  }
  const auto tl = tokens.sequence_lengths(), ml = mask.sequence_lengths();
  int64_t bad_lengths = 0, bad_values = 0;
  std::vector<int32_t> buf;
  for (int64_t s = 0; s < tokens.num_sequences(); ++s) {
    if (tl[size_t(s)] != ml[size_t(s)]) {
      if (++bad_lengths <= 5)
        r.problems.push_back(mask_prefix + ": sequence " + std::to_string(s) + " has " + std::to_string(ml[size_t(s)]) +
                             " mask entries for " + std::to_string(tl[size_t(s)]) + " tokens");
      continue;
    }
    buf.resize(size_t(ml[size_t(s)]));
    mask.read(s, 0, ml[size_t(s)], buf.data());
    for (size_t j = 0; j < buf.size(); ++j) {
      if (buf[j] == 0 || buf[j] == 1 || ++bad_values > 5) continue;
      r.problems.push_back(mask_prefix + ".bin: sequence " + std::to_string(s) + ", entry " + std::to_string(j) +
                           " is " + std::to_string(buf[j]) + " (a loss mask holds 0 or 1)");
    }
  }
  if (bad_lengths > 5) r.problems.push_back(mask_prefix + ": " + std::to_string(bad_lengths - 5) + " more sequences whose length differs from the tokens'");
  if (bad_values > 5) r.problems.push_back(mask_prefix + ".bin: " + std::to_string(bad_values - 5) + " more entries other than 0 and 1");
}

}  // namespace

DataCheckReport check_indexed_dataset(const std::string& prefix_arg, const DataCheckOptions& opt) {
  DataCheckReport r;
  r.prefix = strip_suffix(prefix_arg);
  IndexInspection in = IndexedDataset::inspect(r.prefix);
  r.problems = std::move(in.problems);
  if (!in.dataset) return r;
  const IndexedDataset& ds = *in.dataset;
  r.dtype = index_dtype_name(ds.dtype());
  const auto lengths = ds.sequence_lengths();
  const auto docs = ds.document_indices();
  r.documents = int64_t(docs.size()) - 1;
  r.sequences = ds.num_sequences();
  r.scanned = true;

  int32_t lo = std::numeric_limits<int32_t>::max(), hi = std::numeric_limits<int32_t>::min();
  bool scanned_ids = false;  // some block was read (an int64 file's blocks may all fail)
  std::vector<int32_t> block;
  std::vector<int64_t> empty_docs;
  int64_t file_offset = 0;  // tokens of the file before the current sequence
  for (int64_t d = 0; d < r.documents; ++d) {
    int64_t doc_offset = 0;  // tokens of the document before the current sequence
    for (int64_t s = docs[size_t(d)]; s < docs[size_t(d) + 1]; ++s) {
      const int64_t len = lengths[size_t(s)];
      if (len == 0) ++r.empty_sequences;
      for (int64_t at = 0; at < len; at += kBlock) {
        const int64_t n = std::min(kBlock, len - at);
        block.resize(size_t(n));
        try {
          ds.read(s, at, n, block.data());
        } catch (const UserError& e) {  // an int64 id that does not fit int32
          if (++r.ids_outside <= opt.max_listed) r.problems.push_back(e.what());
          continue;
        }
        int32_t blo = lo, bhi = hi;
        for (int64_t i = 0; i < n; ++i) {
          blo = std::min(blo, block[size_t(i)]);
          bhi = std::max(bhi, block[size_t(i)]);
        }
        lo = blo, hi = bhi;
        scanned_ids = true;
        if (blo >= 0 && (opt.vocab_size <= 0 || int64_t(bhi) < opt.vocab_size)) continue;
        for (int64_t i = 0; i < n; ++i) {
          const int32_t id = block[size_t(i)];
          if (id >= 0 && (opt.vocab_size <= 0 || int64_t(id) < opt.vocab_size)) continue;
          if (++r.ids_outside > opt.max_listed) continue;
          std::ostringstream os;
          os << r.prefix << ".bin: document " << d << ", token " << doc_offset + at + i << " of the document (token "
             << file_offset + at + i << " of the file): id " << id;
          if (id < 0)
            os << " is negative";
          else
            os << " >= " << opt.vocab_size << ", outside the vocabulary"
               << (opt.vocab_source.empty() ? "" : " of " + opt.vocab_source);
          r.problems.push_back(os.str());
        }
      }
      doc_offset += len;
      file_offset += len;
    }
    if (doc_offset == 0) {
      ++r.empty_documents;
      if (empty_docs.size() < size_t(std::max<int64_t>(opt.max_listed, 0))) empty_docs.push_back(d);
    }
    r.longest_document = std::max(r.longest_document, doc_offset);
    const int b = bucket_of(doc_offset);
    if (r.length_histogram.size() <= size_t(b)) r.length_histogram.resize(size_t(b) + 1, 0);
    ++r.length_histogram[size_t(b)];
  }
  r.tokens = file_offset;
  if (scanned_ids) r.min_id = lo, r.max_id = hi;
  if (r.ids_outside > opt.max_listed)
    r.problems.push_back(std::to_string(r.ids_outside - opt.max_listed) + " more ids outside the vocabulary in " +
                         r.prefix + ".bin (" + std::to_string(r.ids_outside) + " in all)");

  std::vector<std::string>& soft = opt.strict ? r.problems : r.warnings;
  if (r.empty_documents > 0) {
    std::string list;
    for (int64_t d : empty_docs) list += (list.empty() ? "" : ", ") + std::to_string(d);
    if (r.empty_documents > int64_t(empty_docs.size())) list += ", ...";
    soft.push_back(r.prefix + ".idx: " + std::to_string(r.empty_documents) + " empty document" +
                   (r.empty_documents == 1 ? "" : "s") + " (no tokens): " + list);
  }
  if (r.empty_sequences > 0)
    soft.push_back(r.prefix + ".idx: " + std::to_string(r.empty_sequences) + " empty sequence" +
                   (r.empty_sequences == 1 ? "" : "s") + " (length 0)");
  if (r.documents == 0 || r.tokens == 0)
    r.problems.push_back(r.prefix + ": the dataset holds no tokens (" + std::to_string(r.documents) +
                         " documents); there is nothing to train on");

  // An SFT token file (`loom preprocess --sft`) comes with its loss mask.
  const std::string mask = sft_loss_mask_prefix(r.prefix);
  std::error_code ec;
  if (!r.prefix.ends_with("_loss_mask") && std::filesystem::exists(mask + ".idx", ec)) check_loss_mask(ds, mask, r);
  return r;
}

void print_data_check(const DataCheckReport& r, const DataCheckOptions& opt, std::ostream& os) {
  os << r.prefix << ":\n";
  if (r.scanned) {
    os << "  documents: " << r.documents << "\n  sequences: " << r.sequences << "\n  tokens:    " << r.tokens << " ("
       << r.dtype << ")\n";
    if (r.tokens > 0) os << "  ids:       min " << r.min_id << ", max " << r.max_id << "\n";
    os << "  vocabulary: ";
    if (opt.vocab_size > 0)
      os << (opt.vocab_source.empty() ? "" : opt.vocab_source + ": ") << "ids < " << opt.vocab_size << ", "
         << (r.ids_outside ? std::to_string(r.ids_outside) + " outside" : "all inside") << "\n";
    else
      os << "not given (--vocab-size or --tokenizer-type): ids checked for >= 0 only\n";
    if (r.loss_mask_checked) os << "  loss mask: " << sft_loss_mask_prefix(r.prefix) << " compared\n";
    os << "  document lengths (tokens; longest " << r.longest_document << "):\n";
    for (size_t b = 0; b < r.length_histogram.size(); ++b) {
      const int64_t lo = b == 0 ? 0 : int64_t(1) << (b - 1), hi = b == 0 ? 0 : (int64_t(1) << b) - 1;
      std::ostringstream range;
      range << lo;
      if (hi > lo) range << " .. " << hi;
      os << "    " << range.str() << std::string(range.str().size() < 24 ? 24 - range.str().size() : 1, ' ')
         << r.length_histogram[b] << "\n";
    }
  } else {
    os << "  tokens not scanned: the index is unreadable or inconsistent\n";
  }
  for (const std::string& w : r.warnings) os << "  warning: " << w << "\n";
  for (const std::string& p : r.problems) os << "  problem: " << p << "\n";
  os << "  " << (r.ok() ? "ok" : std::to_string(r.problems.size()) + " problem" + (r.problems.size() == 1 ? "" : "s"))
     << "\n";
}

}  // namespace loom
