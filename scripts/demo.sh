#!/usr/bin/env bash
# Demo: trains a small byte-level GPT (4 layers, C=256, 4 heads, T=128) on the State of the Union
# addresses (data/sotu.txt, made by scripts/setup.sh) with the loom CLI, then checks that the model
# learned something: the last logged lm loss must be below the unigram entropy of the bytes, which
# is the best loss a model that ignores context can reach. Exits non-zero otherwise.
# Knobs (environment): TRAIN_ITERS (default 1000, ~3 minutes on 2 cores), BUILD_DIR (default build),
# DATA (default data/sotu.txt), LOG (default out/demo/train.log).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TRAIN_ITERS="${TRAIN_ITERS:-1000}"
BUILD_DIR="${BUILD_DIR:-build}"
DATA="${DATA:-data/sotu.txt}"
LOG="${LOG:-out/demo/train.log}"
LOOM="$BUILD_DIR/loom"

[[ "$TRAIN_ITERS" =~ ^[0-9]+$ && "$TRAIN_ITERS" -gt 20 ]] ||
  { echo "demo: TRAIN_ITERS must be an integer above the 20 warmup iterations, got '$TRAIN_ITERS'" >&2; exit 1; }
[[ -x "$LOOM" ]] || { echo "demo: $LOOM not found; run 'make build' first" >&2; exit 1; }
[[ -s "$DATA" ]] || { echo "demo: $DATA not found; run 'bash scripts/setup.sh' first" >&2; exit 1; }
mkdir -p "$(dirname "$LOG")"

echo "demo: training a 4-layer byte-level GPT on $DATA for $TRAIN_ITERS iterations (log: $LOG)"
start=$(date +%s)
"$LOOM" train \
  --data-path "$DATA" \
  --num-layers 4 --hidden-size 256 --num-attention-heads 4 \
  --seq-length 128 --max-position-embeddings 128 \
  --micro-batch-size 16 --global-batch-size 16 \
  --train-iters "$TRAIN_ITERS" \
  --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 20 --lr-decay-iters "$TRAIN_ITERS" --lr-decay-style cosine \
  --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --log-interval 10 2>&1 | tee "$LOG"
elapsed=$(($(date +%s) - start))

# "data: data/sotu.txt: <n> tokens (bytes), unigram entropy <x> nats/token"
entropy=$(sed -n 's/^data: .*unigram entropy \([0-9.eE+-]*\) nats\/token.*/\1/p' "$LOG" | head -n1)
# Megatron iteration lines: "... iteration   10/  500 | ... | lm loss: 2.345678E+00 | ..."
losses=$(sed -n 's/.*| lm loss: \([0-9.eE+-]*\) |.*/\1/p; s/.*| lm loss: \([0-9.eE+-]*\)$/\1/p' "$LOG")
[[ -n "$entropy" ]] || { echo "demo: no 'unigram entropy' line in $LOG" >&2; exit 1; }
[[ -n "$losses" ]] || { echo "demo: no 'lm loss' iteration lines in $LOG" >&2; exit 1; }
first=$(head -n1 <<<"$losses")
last=$(tail -n1 <<<"$losses")

awk -v h="$entropy" -v f="$first" -v l="$last" -v n="$(wc -l <<<"$losses")" -v s="$elapsed" 'BEGIN {
  printf "\n==== demo summary ====\n"
  printf "unigram entropy of the data : %.4f nats/byte (%.3f bits/byte)\n", h, h / log(2)
  printf "first logged lm loss        : %.4f nats/byte\n", f
  printf "last logged lm loss         : %.4f nats/byte (%.3f bits/byte, %d log lines, %d s)\n", l, l / log(2), n, s
  if (l + 0 < h + 0) {
    printf "PASS: final loss is %.4f nats (%.0f%%) below the unigram entropy: the model uses context\n", h - l, 100 * (h - l) / h
    exit 0
  }
  printf "FAIL: final loss %.4f is not below the unigram entropy %.4f\n", l, h
  exit 1
}'
