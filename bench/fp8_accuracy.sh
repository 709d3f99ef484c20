#!/usr/bin/env bash
# FP8 vs BF16 accuracy (issue: CUDA backend / FP8): the same small GPT, the same data (data/sotu.txt,
# GPT-2 BPE), the same steps, trained once with --bf16 and once with --bf16 --fp8-format hybrid (and
# e4m3); prints the final training and validation losses and their relative difference (target: FP8
# within 1% of BF16, Transformer Engine's published FP8-vs-16-bit agreement). On a machine without FP8
# tensor cores Loom emulates the FP8 GEMMs (quantise, dequantise, f32 GEMM), so this checks the
# recipe's numerics, not FP8 speed.
# Env: BUILD_DIR (build), OUT (out/fp8), ITERS (300), THREADS (2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
OUT=${OUT:-out/fp8}
ITERS=${ITERS:-300}
THREADS=${THREADS:-2}
LOOM="$BUILD_DIR/loom"
for f in data/sotu.txt data/encoder.json data/vocab.bpe "$LOOM"; do
  [[ -s "$f" ]] || { echo "fp8_accuracy: $f not found (run scripts/setup.sh and make)" >&2; exit 1; }
done
mkdir -p "$OUT"
if [[ ! -s "$OUT/sotu_text_document.idx" ]]; then
  /usr/bin/python3 - data/sotu.txt "$OUT/sotu.jsonl" <<'PY'
import json, sys
docs = [d.strip() for d in open(sys.argv[1], encoding="utf-8").read().split("\n\n") if d.strip()]
with open(sys.argv[2], "w", encoding="utf-8") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
PY
  "$LOOM" preprocess --input "$OUT/sotu.jsonl" --output-prefix "$OUT/sotu" --json-keys text \
    --tokenizer-type GPT2BPETokenizer --vocab-file data/encoder.json --merge-file data/vocab.bpe \
    --append-eod --workers 2 --log-interval 1000 >/dev/null
fi
run() {  # name, extra flags...
  local name=$1; shift
  local start=$(date +%s)
  OMP_NUM_THREADS=$THREADS "$LOOM" train \
    --data-path "$OUT/sotu_text_document" --split 98,2,0 --data-cache-path "$OUT/cache" \
    --tokenizer-type GPT2BPETokenizer --vocab-file data/encoder.json --merge-file data/vocab.bpe \
    --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 8 --global-batch-size 8 --train-iters "$ITERS" \
    --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 20 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --seed 1234 --log-interval 10 --eval-interval "$ITERS" --eval-iters 10 --bf16 "$@" >"$OUT/$name.log" 2>&1
  local train valid
  train=$(sed -n 's/.*| lm loss: \([0-9.eE+-]*\) |.*/\1/p' "$OUT/$name.log" | tail -n 5 | awk '{s += $1} END {printf "%.5f", s / NR}')
  valid=$(sed -n 's/.*on validation set | lm loss value: \([0-9.eE+-]*\) |.*/\1/p' "$OUT/$name.log" | tail -n 1)
  echo "$name $train $valid $(( $(date +%s) - start ))"
}
{
  run bf16
  run fp8_hybrid --fp8-format hybrid
  run fp8_e4m3 --fp8-format e4m3
  run fp8_hybrid_h16max --fp8-format hybrid --fp8-amax-history-len 16 --fp8-amax-compute-algo max
} | awk '
  NR == 1 { bt = $2; bv = $3 }
  { rows[NR] = $0 }
  END {
    printf "| run | train loss (mean of last 5 logs) | validation loss | vs BF16 (train) | vs BF16 (valid) | seconds |\n|---|---:|---:|---:|---:|---:|\n"
    for (i = 1; i <= NR; ++i) {
      split(rows[i], f, " ")
      printf "| %s | %.4f | %.4f | %+.2f%% | %+.2f%% | %d |\n", f[1], f[2], f[3], 100 * (f[2] - bt) / bt, 100 * (f[3] - bv) / bv, f[4]
    }
  }'
