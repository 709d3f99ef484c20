// libFuzzer target: the SFT record path end to end. Arbitrary bytes are the JSONL input of
// `loom preprocess --sft` (prompt/answer pairs, or "messages" conversations through a chat template),
// tokenized with a small SentencePiece model that has byte fallback (any text encodes) and the templates'
// special tokens (tests/fuzz/fixtures/sft_chat.model, made by make_sft_seeds.py); what it writes is read
// back by SftDataset, packed or padded, and every sample is drawn.
// Byte 0 picks options: bits 0-1 the template (0: --json-keys input output, 1 llama2, 2 llama3,
// 3 chatml), bit2 --append-eod, bit3 --answer-only-loss false, bit4 --workers 3, bit5 --skip-bad-lines,
// bit6 --no-sft-packing, bit7 --sft-overlong skip (else truncate). The rest is the file.
// A UserError (a bad line, a split without samples) must leave no files behind; a run that succeeds must
// give datasets that open, agree with the returned statistics, and samples whose ids, loss mask,
// positions and segments keep SftDataset's invariants.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fuzz_preprocess.h"
#include "fuzz_util.h"
#include "loom/core/check.h"
#include "loom/data/indexed_dataset.h"
#include "loom/data/preprocess.h"
#include "loom/data/sft_dataset.h"
#include "loom/data/tokenizer.h"

namespace fs = std::filesystem;

namespace {

using fuzz_util::require;

constexpr int64_t kSeq = 24;  // SftDataset --seq-length: short, so truncation and packing both happen

const fs::path& dir() { return fuzz_util::scratch_dir("sft"); }

struct ScratchDir : fuzz_util::Scratch {
  ScratchDir() : Scratch(dir()) {}
};

void check_dataset(const loom::PreprocessStats& stats, const loom::PreprocessConfig& cfg, bool packing,
                   loom::SftOverlong overlong) {
  require(stats.outputs.size() == 2, "--sft writes the samples and their loss mask");
  std::shared_ptr<const loom::IndexedDataset> tokens = loom::IndexedDataset::open(stats.outputs[0]);
  std::shared_ptr<const loom::IndexedDataset> mask = loom::IndexedDataset::open(stats.outputs[1]);
  const int64_t docs = int64_t(tokens->document_indices().size()) - 1;
  require(docs == stats.documents && tokens->num_sequences() == docs, "one sequence per sample");
  require(mask->num_sequences() == docs && mask->dtype() == loom::IndexDType::kU8, "mask beside the tokens");
  static const int64_t V = loom::make_tokenizer(cfg.tokenizer)->vocab_size();  // one model for every input
  loom::SftConfig sc;
  sc.seq_length = kSeq;
  sc.packing = packing;
  sc.overlong = overlong;
  sc.pad_id = 2;  // the model's </s>
  sc.use_cache = false;
  std::unique_ptr<loom::SftDataset> ds;
  try {
    ds = std::make_unique<loom::SftDataset>(tokens, mask, 0, docs, std::nullopt, sc, "train");
  } catch (const loom::UserError&) {
    return;  // every sample skipped or shorter than 2 tokens
  }
  const loom::SftStats& st = ds->stats();
  require(st.samples == docs && st.sequences == ds->size() && st.sequences > 0, "statistics");
  std::vector<int32_t> w(static_cast<size_t>(kSeq + 1)), pos(static_cast<size_t>(kSeq)), seg(static_cast<size_t>(kSeq));
  std::vector<float> lm(static_cast<size_t>(kSeq));
  int64_t in_loss = 0, sample_tokens = 0;
  for (int64_t i = 0; i < ds->size(); ++i) {
    ds->sample(i, w.data());
    require(ds->extras(i, lm.data(), pos.data(), seg.data()), "SFT samples carry extras");
    for (int64_t j = 0; j <= kSeq; ++j) require(w[size_t(j)] >= 0 && w[size_t(j)] < V, "token id in the vocabulary");
    for (int64_t j = 0; j < kSeq; ++j) {
      require(lm[size_t(j)] == 0.0f || lm[size_t(j)] == 1.0f, "loss mask is 0 or 1");
      in_loss += lm[size_t(j)] != 0.0f;
      const bool new_segment = j > 0 && seg[size_t(j)] != seg[size_t(j - 1)];
      require(j == 0 ? seg[0] == 0 && pos[0] == 0 : seg[size_t(j)] >= seg[size_t(j - 1)], "segments grow from 0");
      if (j > 0) require(pos[size_t(j)] == (new_segment ? 0 : pos[size_t(j - 1)] + 1), "positions restart per segment");
    }
    for (const int64_t d : ds->sequence_documents(i)) {
      require(d >= 0 && d < docs, "a packed sample is a document");
      sample_tokens += std::min<int64_t>(tokens->sequence_lengths()[size_t(d)], kSeq + 1);
    }
    require(!ds->locate(i, 0).empty() && !ds->locate(i, kSeq).empty(), "every position has a source");
  }
  require(in_loss == st.loss_tokens, "labels in the loss match the statistics");
  require(sample_tokens == st.tokens, "sample tokens match the statistics");
}

}  // namespace

// run_preprocess hands every input to worker threads: one CPU for all of them (fuzz_util.h).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz_util::pin_to_current_cpu();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t opt = data[0];
  const ScratchDir scratch;
  static const char* kTemplates[] = {"", "llama2", "llama3", "chatml"};
  loom::PreprocessConfig cfg = fuzz_util::jsonl_input(dir(), data + 1, size - 1);
  cfg.tokenizer.type = "Llama2Tokenizer";
  cfg.tokenizer.tokenizer_model = LOOM_SOURCE_DIR "/tests/fuzz/fixtures/sft_chat.model";
  cfg.sft = true;
  cfg.chat_template = kTemplates[opt & 3];
  cfg.json_keys = cfg.chat_template.empty() ? std::vector<std::string>{"input", "output"}
                                            : std::vector<std::string>{"messages"};
  cfg.append_eod = opt & 4;
  cfg.answer_only_loss = !(opt & 8);
  cfg.workers = (opt & 16) ? 3 : 1;
  cfg.skip_bad_lines = opt & 32;
  cfg.log_interval = 5;
  const bool packing = !(opt & 64);
  const loom::SftOverlong overlong = (opt & 128) ? loom::SftOverlong::kSkip : loom::SftOverlong::kTruncate;

  loom::PreprocessStats stats;
  if (!fuzz_util::run_preprocess_checked(cfg, dir(), stats)) return 0;
  check_dataset(stats, cfg, packing, overlong);
  return 0;
}
