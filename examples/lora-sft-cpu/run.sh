#!/usr/bin/env bash
# LoRA supervised fine-tuning on a CPU: the MLPerf llama2_70b_lora workflow at toy scale, end to end.
#   1. Data from the State of the Union addresses that scripts/setup.sh fetched (data/sotu.txt), as word
#      ids (the 2,000 most frequent lower-cased words and punctuation, NullTokenizer): a small vocabulary
#      keeps the output layer cheap enough for a few minutes on 2 cores. Pretraining documents repeat some
#      of their sentences ("S S"), so the base model learns to copy (induction heads), as real pretrained
#      models can.
#   2. Pretrain a tiny Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention) on them: the frozen base.
#   3. An SFT set from held-out sentences: prompt "<repeat> A B <answer>", answer "B" (repeat the second of
#      two sentences: the base can copy, the adapters teach it the prompt format and which sentence);
#      `loom preprocess --sft` with answer-only loss.
#   4. LoRA fine-tuning (rank 16, alpha 32, dropout 0.1 on linear_qkv and linear_proj, the MLPerf reference's
#      modules, its optimizer settings: AdamW, cosine, no warmup, weight decay 1e-4, clip 0.3) on packed
#      sequences, evaluating MLPerf's metric (mean per-sequence answer loss) every EVAL_INTERVAL steps and
#      stopping at --target-eval-loss 0.925 (MLPerf's target for the benchmark), with an MLPerf :::MLLOG
#      log (closed division).
#   5. Loom's own check of the log (tests/e2e/check_mllog.py): structure, keys, run_stop status success.
# Knobs (environment): BUILD_DIR (build), OUT (out/lora-sft-cpu), PRETRAIN_ITERS (2500; copying appears
# after ~1,200), LORA_ITERS (400), TARGET (0.925), EVAL_INTERVAL (5). About 3 minutes on 2 idle cores. The MLCommons compliance checker (github.com/mlcommons/logging) reads
# the log too: `python3 -m mlperf_logging.compliance_checker --usage training --ruleset 5.0.0 $OUT/mllog.txt`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

BUILD_DIR="${BUILD_DIR:-build}"
OUT="${OUT:-out/lora-sft-cpu}"
PRETRAIN_ITERS="${PRETRAIN_ITERS:-2500}"
LORA_ITERS="${LORA_ITERS:-400}"
TARGET="${TARGET:-0.925}"
EVAL_INTERVAL="${EVAL_INTERVAL:-5}"
LOOM="$BUILD_DIR/loom"
PYTHON="${PYTHON:-/usr/bin/python3}"
[[ -x "$LOOM" ]] || { echo "lora-sft-cpu: $LOOM not found; run 'make build' first" >&2; exit 1; }
[[ -s data/sotu.txt ]] || { echo "lora-sft-cpu: data/sotu.txt not found; run 'bash scripts/setup.sh' first" >&2; exit 1; }
mkdir -p "$OUT"
VOCAB=2048  # word ids 0..1999, <unk> 2000, <repeat> 2001, <answer> 2002; NullTokenizer's EOD is 2048
TOK=(--tokenizer-type NullTokenizer --vocab-size "$VOCAB")
MODEL=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4 --group-query-attention
       --num-query-groups 2 --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
       --untie-embeddings-and-output-weights --seq-length 128 --max-position-embeddings 128
       --make-vocab-size-divisible-by 64 --hidden-dropout 0 --attention-dropout 0)

echo "lora-sft-cpu: data/sotu.txt -> word ids, pretraining documents and SFT pairs"
"$PYTHON" - data/sotu.txt "$OUT" <<'PY'
import collections, json, random, re, sys
text, out = sys.argv[1], sys.argv[2]
docs = [d.strip() for d in open(text, encoding="utf-8").read().split("\n\n") if d.strip()]
split = lambda d: [s for s in re.split(r"(?<=[.!?])\s+", d) if s]
words = lambda s: re.findall(r"[a-z]+(?:'[a-z]+)?|[.,;:!?]", s.lower())
counts = collections.Counter(w for d in docs for w in words(d))
ids = {w: i for i, (w, _) in enumerate(counts.most_common(2000))}
enc = lambda s: [ids.get(w, 2000) for w in words(s)]
REPEAT, ANSWER = 2001, 2002
rng = random.Random(1)
sentences = [enc(s) for d in docs for s in split(d)]
held = set(rng.sample(range(len(sentences)), 4000))  # SFT sentences are not in the pretraining text
with open(f"{out}/pretrain.jsonl", "w") as f:
    for d in docs:
        toks = []
        for s in split(d):
            e = enc(s)
            toks += e + (e if rng.random() < 0.8 else [])  # some sentences twice: copying is worth learning
        f.write(json.dumps({"text": " ".join(map(str, toks))}) + "\n")
pairs = [sentences[i] for i in sorted(held) if 4 <= len(sentences[i]) <= 24]
with open(f"{out}/sft.jsonl", "w") as f:
    for a, b in zip(pairs[0::2], pairs[1::2]):  # repeat the second of two sentences
        f.write(json.dumps({"input": " ".join(map(str, [REPEAT] + a + b + [ANSWER])),
                            "output": " ".join(map(str, b))}) + "\n")
print(f"lora-sft-cpu: {len(docs)} documents, {len(ids)} words, {sum(1 for _ in open(f'{out}/sft.jsonl'))} SFT pairs")
PY
"$LOOM" preprocess --input "$OUT/pretrain.jsonl" --output-prefix "$OUT/pretrain" --json-keys text "${TOK[@]}" \
  --append-eod --workers 2 --log-interval 1000 >/dev/null
"$LOOM" preprocess --sft --input "$OUT/sft.jsonl" --output-prefix "$OUT/sft" "${TOK[@]}" --append-eod \
  --answer-only-loss true --log-interval 10000 >/dev/null

if [[ ! -s "$OUT/base/latest_checkpointed_iteration.txt" ]]; then
  echo "lora-sft-cpu: pretraining the base for $PRETRAIN_ITERS iterations (log: $OUT/pretrain.log)"
  "$LOOM" train "${MODEL[@]}" "${TOK[@]}" --data-path "$OUT/pretrain_text_document" --split 99,1,0 \
    --data-cache-path "$OUT/cache" --micro-batch-size 16 --global-batch-size 16 --train-iters "$PRETRAIN_ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 30 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --seed 1234 --log-interval 50 --eval-iters 0 --save "$OUT/base" >"$OUT/pretrain.log" 2>&1 ||
    { tail -n 20 "$OUT/pretrain.log" >&2; exit 1; }
  grep -o "iteration *$PRETRAIN_ITERS/.*lm loss: [0-9.E+-]*" "$OUT/pretrain.log" | sed 's/|.*|/.../'
fi

echo "lora-sft-cpu: LoRA fine-tuning to validation loss $TARGET (log: $OUT/lora.log, MLPerf log: $OUT/mllog.txt)"
rm -rf "$OUT/lora" "$OUT/mllog.txt"
"$LOOM" train "${MODEL[@]}" "${TOK[@]}" --sft --data-path "$OUT/sft_sft_document" --split 90,10,0 \
  --data-cache-path "$OUT/cache" --load "$OUT/base" --save "$OUT/lora" \
  --lora-rank 16 --lora-alpha 32 --lora-dropout 0.1 --lora-target-modules linear_qkv linear_proj \
  --micro-batch-size 8 --global-batch-size 8 --train-iters "$LORA_ITERS" --lr 4e-3 --min-lr 0 \
  --lr-decay-style cosine --weight-decay 1e-4 --clip-grad 0.3 --seed 1 --log-interval 10 \
  --eval-interval "$EVAL_INTERVAL" --eval-iters 4 --target-eval-loss "$TARGET" \
  --mlperf-log "$OUT/mllog.txt" >"$OUT/lora.log" 2>&1 || { tail -n 20 "$OUT/lora.log" >&2; exit 1; }
grep "MLPerf validation metric" "$OUT/lora.log" | sed -n '1s/^ > /lora-sft-cpu: first evaluation: /p'
grep -E "target reached" "$OUT/lora.log" || grep "MLPerf validation metric" "$OUT/lora.log" | tail -n 1
# Loom's structure check; run_stop must say success (the target reached before --train-iters).
"$PYTHON" tests/e2e/check_mllog.py "$OUT/mllog.txt" --status success --target "$TARGET" --lora ||
  { echo "lora-sft-cpu: the MLPerf log fails the check (target $TARGET not reached?)" >&2; exit 1; }
echo "lora-sft-cpu: PASS: reached validation loss <= $TARGET; adapters in $OUT/lora, MLPerf log $OUT/mllog.txt"
