#!/usr/bin/env bash
# SFT packing benchmark (issue 17): real (non-padding) tokens per second of `loom train --sft` with
# first-fit-decreasing packing against one padded sample per sequence, same model, same --seq-length, on a
# skewed-length SFT set (most samples short, a long tail: lengths ~ 16 + lognormal, capped at seq + 1).
# Real tokens per iteration = the split's sample tokens / its sequences x the global batch (from the
# run's "data: train SFT ..." line); ms/iteration = median of the timed iterations. Prints a markdown
# table (also written to $OUT/sft_packing.md).
#
# Environment: LOOM_BIN [build/loom]  PYTHON [/usr/bin/python3]  OMP_NUM_THREADS [2]
#   SFT_SAMPLES [2000]  SFT_SEQ [512]  SFT_LAYERS [4]  SFT_HIDDEN [256]  SFT_HEADS [4]  SFT_ITERS [12]
#   SFT_WARMUP [2]  OUT [out/sft_bench]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOOM_BIN="${LOOM_BIN:-$ROOT/build/loom}"
PYTHON="${PYTHON:-/usr/bin/python3}"
OUT="${OUT:-$ROOT/out/sft_bench}"
N="${SFT_SAMPLES:-2000}" SEQ="${SFT_SEQ:-512}" ITERS="${SFT_ITERS:-12}" WARMUP="${SFT_WARMUP:-2}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
[[ -x "$LOOM_BIN" ]] || { echo "sft_packing_bench: $LOOM_BIN not found (make build)" >&2; exit 1; }
mkdir -p "$OUT"

"$PYTHON" - "$OUT/sft.jsonl" "$N" "$SEQ" <<'PY'
import json, random, sys
path, n, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(1234)
with open(path, "w") as f:
    for _ in range(n):
        total = min(seq, 16 + int(rng.lognormvariate(3.6, 0.9)))  # median ~53 tokens, long tail
        prompt = max(1, total // 3)
        ids = [str(rng.randrange(1000)) for _ in range(total)]
        f.write(json.dumps({"input": " ".join(ids[:prompt]), "output": " ".join(ids[prompt:])}) + "\n")
PY
"$LOOM_BIN" preprocess --sft --input "$OUT/sft.jsonl" --output-prefix "$OUT/sft" --append-eod \
  --tokenizer-type NullTokenizer --vocab-size 1000 >"$OUT/preprocess.log"

run() {  # MODE LOG
  "$LOOM_BIN" train --sft --data-path "$OUT/sft_sft_document" --tokenizer-type NullTokenizer --vocab-size 1000 \
    --num-layers "${SFT_LAYERS:-4}" --hidden-size "${SFT_HIDDEN:-256}" --num-attention-heads "${SFT_HEADS:-4}" \
    --seq-length "$SEQ" --micro-batch-size 4 --global-batch-size 8 --train-iters "$ITERS" --lr 1e-4 \
    --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 --split 100,0,0 \
    --data-cache-path "$OUT/cache" $1 >"$2" 2>&1
}
run "" "$OUT/packed.log"
run "--no-sft-packing" "$OUT/padded.log"

"$PYTHON" - "$OUT/packed.log" "$OUT/padded.log" "$WARMUP" "$OUT/sft_packing.md" <<'PY'
import re, statistics, sys
def parse(path, warmup):
    text = open(path).read()
    m = re.search(r"data: train SFT train .*?: (\d+) samples (?:packed into|padded to) (\d+) sequences of (\d+) tokens \((\d+) sample tokens, (\d+) in the loss", text)
    samples, seqs, width, tokens, loss = map(int, m.groups())
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)][warmup:]
    gbs = int(re.search(r"global batch size:\s+(\d+)", text).group(1))
    med = statistics.median(ms)
    real = tokens / seqs * gbs
    return dict(samples=samples, seqs=seqs, width=width, fill=tokens / (seqs * width), ms=med, real_tps=real / (med / 1000))
p, q = parse(sys.argv[1], int(sys.argv[3])), parse(sys.argv[2], int(sys.argv[3]))
rows = ["| mode | sequences (per epoch) | fill (real tokens / slots) | ms/iteration | real tokens/s |", "|---|---|---|---|---|"]
for name, r in (("packed (first-fit decreasing)", p), ("padded (one sample per sequence)", q)):
    rows.append(f"| {name} | {r['seqs']} | {r['fill']:.3f} | {r['ms']:.1f} | {r['real_tps']:.0f} |")
rows.append(f"\n{p['samples']} samples, sequences of {p['width']} tokens; packed/padded real tokens/s: {p['real_tps'] / q['real_tps']:.2f}x")
out = "\n".join(rows)
print(out)
open(sys.argv[4], "w").write(out + "\n")
PY
