#!/usr/bin/env bash
# Demo: the Megatron workflow end to end on real English text. The State of the Union addresses
# (data/sotu.txt from scripts/setup.sh, one address per paragraph) become a JSONL file, `loom preprocess`
# tokenizes it with the GPT-2 BPE vocabulary into Megatron .bin/.idx files, and `loom train` trains a
# small GPT (4 layers, C=256, 4 heads, T=128) on them. The demo then checks that the model learned
# something: the last logged lm loss must be below the unigram entropy of the tokens (the best loss a
# model that ignores context can reach). Exits non-zero otherwise.
# Knobs (environment): TRAIN_ITERS (default 400, ~3 minutes on 2 cores), BUILD_DIR (default build),
# TEXT (default data/sotu.txt), OUT (default out/demo). Finally `loom generate` samples 40 tokens from
# the checkpoint.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TRAIN_ITERS="${TRAIN_ITERS:-400}"
BUILD_DIR="${BUILD_DIR:-build}"
TEXT="${TEXT:-data/sotu.txt}"
OUT="${OUT:-out/demo}"
LOG="$OUT/train.log"
LOOM="$BUILD_DIR/loom"
PYTHON="${PYTHON:-/usr/bin/python3}"

[[ "$TRAIN_ITERS" =~ ^[0-9]+$ && "$TRAIN_ITERS" -gt 20 ]] ||
  { echo "demo: TRAIN_ITERS must be an integer above the 20 warmup iterations, got '$TRAIN_ITERS'" >&2; exit 1; }
[[ -x "$LOOM" ]] || { echo "demo: $LOOM not found; run 'make build' first" >&2; exit 1; }
for f in "$TEXT" data/encoder.json data/vocab.bpe; do
  [[ -s "$f" ]] || { echo "demo: $f not found; run 'bash scripts/setup.sh' first" >&2; exit 1; }
done
mkdir -p "$OUT"

echo "demo: $TEXT -> $OUT/sotu.jsonl (one document per address)"
"$PYTHON" - "$TEXT" "$OUT/sotu.jsonl" <<'PY'
import json, sys
docs = [d.strip() for d in open(sys.argv[1], encoding="utf-8").read().split("\n\n") if d.strip()]
with open(sys.argv[2], "w", encoding="utf-8") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
print(f"demo: {len(docs)} documents")
PY

echo "demo: loom preprocess (GPT-2 BPE) -> $OUT/sotu_text_document.bin/.idx"
pre_start=$(date +%s)
"$LOOM" preprocess --input "$OUT/sotu.jsonl" --output-prefix "$OUT/sotu" --json-keys text \
  --tokenizer-type GPT2BPETokenizer --vocab-file data/encoder.json --merge-file data/vocab.bpe \
  --append-eod --workers 2 --log-interval 50
t_preprocess=$(($(date +%s) - pre_start))

# Unigram entropy of the token stream (nats/token): the loss floor for a model without context.
entropy=$("$PYTHON" -c '
import numpy as np, sys
t = np.fromfile(sys.argv[1], dtype=np.uint16)
p = np.bincount(t).astype(np.float64); p = p[p > 0] / t.size
print(f"{-(p * np.log(p)).sum():.4f}")' "$OUT/sotu_text_document.bin")

echo "demo: training a 4-layer GPT for $TRAIN_ITERS iterations (log: $LOG)"
start=$(date +%s)
"$LOOM" train \
  --data-path "$OUT/sotu_text_document" --split 98,2,0 --data-cache-path "$OUT/cache" \
  --tokenizer-type GPT2BPETokenizer --vocab-file data/encoder.json --merge-file data/vocab.bpe \
  --num-layers 4 --hidden-size 256 --num-attention-heads 4 \
  --seq-length 128 --max-position-embeddings 128 \
  --micro-batch-size 8 --global-batch-size 8 \
  --train-iters "$TRAIN_ITERS" \
  --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 20 --lr-decay-iters "$TRAIN_ITERS" --lr-decay-style cosine \
  --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --log-interval 10 \
  --eval-interval 100 --eval-iters 10 --save "$OUT/checkpoints" --save-interval 200 2>&1 | tee "$LOG"
elapsed=$(($(date +%s) - start))

# Megatron iteration lines: "... iteration   10/  500 | ... | lm loss: 2.345678E+00 | ..."
losses=$(sed -n 's/.*| lm loss: \([0-9.eE+-]*\) |.*/\1/p; s/.*| lm loss: \([0-9.eE+-]*\)$/\1/p' "$LOG")
[[ -n "$losses" ]] || { echo "demo: no 'lm loss' iteration lines in $LOG" >&2; exit 1; }
valid=$(sed -n 's/.*on validation set | lm loss value: \([0-9.eE+-]*\) |.*/\1/p' "$LOG" | tail -n1)
first=$(head -n1 <<<"$losses")
last=$(tail -n1 <<<"$losses")

awk -v h="$entropy" -v f="$first" -v l="$last" -v v="${valid:-nan}" -v n="$(wc -l <<<"$losses")" -v s="$elapsed" 'BEGIN {
  printf "\n==== demo summary ====\n"
  printf "unigram entropy of the data : %.4f nats/token (%.3f bits/token)\n", h, h / log(2)
  printf "first logged lm loss        : %.4f nats/token\n", f
  printf "last logged lm loss         : %.4f nats/token (%.3f bits/token, %d log lines, %d s)\n", l, l / log(2), n, s
  printf "final validation lm loss    : %s nats/token (held-out 2%% split)\n", v
  if (l + 0 < h + 0) {
    printf "PASS: final loss is %.4f nats (%.0f%%) below the unigram entropy: the model uses context\n", h - l, 100 * (h - l) / h
    exit 0
  }
  printf "FAIL: final loss %.4f is not below the unigram entropy %.4f\n", l, h
  exit 1
}'

# Sampling from the trained model: `loom generate` reads the checkpoint --save wrote (KV-cached decoding,
# text streamed to stdout, tokens/s on stderr).
echo
echo "demo: loom generate (40 tokens) from $OUT/checkpoints"
gen_start=$(date +%s)
"$LOOM" generate --load "$OUT/checkpoints" \
  --tokenizer-type GPT2BPETokenizer --vocab-file data/encoder.json --merge-file data/vocab.bpe \
  --prompt "Fellow citizens of the Senate and House of Representatives:" \
  --max-new-tokens 40 --temperature 0.8 --top-k 40 --seed 1234
t_generate=$(($(date +%s) - gen_start))

# The time of each phase; `make demo` passes its own (setup, build) in DEMO_PHASES ("name:seconds;...")
# and its start in DEMO_START.
echo
echo "==== demo phases ===="
phases="${DEMO_PHASES:+$DEMO_PHASES;}preprocess:$t_preprocess;train ($TRAIN_ITERS iterations):$elapsed;generate:$t_generate"
IFS=';' read -ra parts <<<"$phases"
for p in "${parts[@]}"; do printf "%-52s %5d s\n" "${p%:*}" "${p##*:}"; done
if [[ -n "${DEMO_START:-}" ]]; then
  total=$(($(date +%s) - DEMO_START))
  printf "%-52s %5d s (%d min %02d s)\n" "total (make demo)" "$total" $((total / 60)) $((total % 60))
fi
