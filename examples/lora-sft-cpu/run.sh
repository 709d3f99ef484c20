#!/usr/bin/env bash
# LoRA supervised fine-tuning on a CPU, the MLPerf llama2_70b_lora workflow at toy scale:
#   1. pretrain a tiny Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention) on the State of the Union
#      addresses that scripts/setup.sh fetched (data/sotu.txt, GPT-2 BPE vocabulary);
#   2. build an SFT set from the same text: prompt "Repeat: <sentence>", answer "<sentence>" (a task the
#      base cannot do yet and attention adapters learn quickly), `loom preprocess --sft` with answer-only loss;
#   3. fine-tune LoRA adapters (rank 8, alpha 16, dropout 0.1 on linear_qkv and linear_proj, the MLPerf
#      reference's modules) on packed sequences, evaluating the MLPerf metric (mean per-sequence answer loss)
#      every EVAL_INTERVAL steps, stopping at --target-eval-loss, and writing an MLPerf :::MLLOG file;
#   4. check the log: Loom's own structure check (tests/e2e/check_mllog.py), and run_stop must be "success".
# Knobs (environment): BUILD_DIR (build), OUT (out/lora-sft-cpu), PRETRAIN_ITERS (300), LORA_ITERS (300),
# TARGET (the target validation loss, 1.5), EVAL_INTERVAL (20). About 5 minutes on 2 cores.
# The MLCommons compliance checker (github.com/mlcommons/logging) can be run on $OUT/mllog.txt with
# `python3 -m mlperf_logging.compliance_checker --usage training --ruleset 5.0.0 $OUT/mllog.txt`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

BUILD_DIR="${BUILD_DIR:-build}"
OUT="${OUT:-out/lora-sft-cpu}"
PRETRAIN_ITERS="${PRETRAIN_ITERS:-300}"
LORA_ITERS="${LORA_ITERS:-300}"
TARGET="${TARGET:-1.5}"
EVAL_INTERVAL="${EVAL_INTERVAL:-20}"
LOOM="$BUILD_DIR/loom"
PYTHON="${PYTHON:-/usr/bin/python3}"
[[ -x "$LOOM" ]] || { echo "lora-sft-cpu: $LOOM not found; run 'make build' first" >&2; exit 1; }
for f in data/sotu.txt data/encoder.json data/vocab.bpe; do
  [[ -s "$f" ]] || { echo "lora-sft-cpu: $f not found; run 'bash scripts/setup.sh' first" >&2; exit 1; }
done
mkdir -p "$OUT"
TOK=(--tokenizer-type GPT2BPETokenizer --vocab-file data/encoder.json --merge-file data/vocab.bpe)
MODEL=(--num-layers 4 --hidden-size 192 --ffn-hidden-size 512 --num-attention-heads 6 --group-query-attention
       --num-query-groups 2 --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
       --untie-embeddings-and-output-weights --seq-length 128 --max-position-embeddings 128
       --hidden-dropout 0 --attention-dropout 0)

echo "lora-sft-cpu: data/sotu.txt -> pretraining documents and SFT pairs"
"$PYTHON" - data/sotu.txt "$OUT" <<'PY'
import json, random, re, sys
text, out = sys.argv[1], sys.argv[2]
docs = [d.strip() for d in open(text, encoding="utf-8").read().split("\n\n") if d.strip()]
with open(f"{out}/sotu.jsonl", "w", encoding="utf-8") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
sentences = [s.strip() for d in docs for s in re.split(r"(?<=[.!?])\s+", d)]
sentences = [s for s in sentences if 6 <= len(s.split()) <= 14]
random.Random(1).shuffle(sentences)
with open(f"{out}/sft.jsonl", "w", encoding="utf-8") as f:
    for s in sentences[:6000]:
        f.write(json.dumps({"input": f"Repeat: {s}\nAnswer:", "output": f" {s}"}) + "\n")
print(f"lora-sft-cpu: {len(docs)} documents, {min(len(sentences), 6000)} SFT pairs")
PY
"$LOOM" preprocess --input "$OUT/sotu.jsonl" --output-prefix "$OUT/sotu" --json-keys text "${TOK[@]}" \
  --append-eod --workers 2 --log-interval 100 >/dev/null
"$LOOM" preprocess --sft --input "$OUT/sft.jsonl" --output-prefix "$OUT/sft" "${TOK[@]}" --append-eod \
  --answer-only-loss true --log-interval 1000 >/dev/null

if [[ ! -s "$OUT/base/latest_checkpointed_iteration.txt" ]]; then
  echo "lora-sft-cpu: pretraining the base for $PRETRAIN_ITERS iterations (log: $OUT/pretrain.log)"
  "$LOOM" train "${MODEL[@]}" "${TOK[@]}" --data-path "$OUT/sotu_text_document" --split 99,1,0 \
    --data-cache-path "$OUT/cache" --micro-batch-size 16 --global-batch-size 16 --train-iters "$PRETRAIN_ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 20 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --seed 1234 --log-interval 50 --eval-iters 0 --save "$OUT/base" >"$OUT/pretrain.log" 2>&1
fi

echo "lora-sft-cpu: LoRA fine-tuning to validation loss $TARGET (log: $OUT/lora.log, MLPerf log: $OUT/mllog.txt)"
rm -rf "$OUT/lora" "$OUT/mllog.txt"
"$LOOM" train "${MODEL[@]}" "${TOK[@]}" --sft --data-path "$OUT/sft_sft_document" --split 95,5,0 \
  --data-cache-path "$OUT/cache" --load "$OUT/base" --save "$OUT/lora" \
  --lora-rank 8 --lora-alpha 16 --lora-dropout 0.1 --lora-target-modules linear_qkv linear_proj \
  --micro-batch-size 8 --global-batch-size 8 --train-iters "$LORA_ITERS" --lr 4e-3 --min-lr 0 \
  --lr-decay-style cosine --weight-decay 1e-4 --clip-grad 0.3 --seed 1 --log-interval 10 \
  --eval-interval "$EVAL_INTERVAL" --eval-iters 4 --target-eval-loss "$TARGET" \
  --mlperf-log "$OUT/mllog.txt" --mlperf-submission-division open >"$OUT/lora.log" 2>&1 || {
  tail -n 20 "$OUT/lora.log" >&2
  exit 1
}
grep -E "target reached|validation metric" "$OUT/lora.log" | tail -n 3
# Loom's structure check; run_stop must say success (the target reached before --train-iters).
"$PYTHON" tests/e2e/check_mllog.py "$OUT/mllog.txt" --status success --target "$TARGET" --lora ||
  { echo "lora-sft-cpu: the MLPerf log fails the check (target $TARGET not reached?)" >&2; exit 1; }
echo "lora-sft-cpu: PASS: reached validation loss <= $TARGET; adapters in $OUT/lora, MLPerf log $OUT/mllog.txt"
