#!/usr/bin/env bash
# Mixture-of-experts training throughput on CPU (run by hand): a tiny Mixtral-style model against a dense
# model with the same ACTIVE parameters per token, both trained by `loom train --mock-data` one after the
# other on the same shapes. The MoE model has E experts of FFN width F, top-k routing; the dense model has
# one MLP of width k·F, so every token runs the same matmul FLOPs in its MLP; what the MoE run pays on top
# is routing, permutation and grouped GEMMs over uneven groups. Prints a markdown table (ms/step, tokens/s,
# MoE/dense ratio).
#
# Shape (MOE_BENCH_*): 4 layers, hidden 512, 8 heads (GQA 2 groups), SwiGLU, RoPE, RMSNorm, vocab 8192,
# seq 256, micro-batch 4, global batch 4; MoE: 8 experts of 896, top-2, aux loss 1e-2 (dense: FFN 1792).
# Precisions: fp32 and --bf16. 2 warm-up + 6 timed iterations; ms/step = median of the timed ones.
# Environment: LOOM_BIN [build/loom] BENCH_THREADS [2] MOE_BENCH_PRECISIONS ["fp32 bf16"]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOOM_BIN="${LOOM_BIN:-$ROOT/build/loom}"
THREADS="${BENCH_THREADS:-2}"
PRECISIONS="${MOE_BENCH_PRECISIONS:-fp32 bf16}"
[[ -x "$LOOM_BIN" ]] || { echo "[moe-train-bench] ERROR: Loom binary not found: $LOOM_BIN (set LOOM_BIN)" >&2; exit 1; }

COMMON="--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2
  --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
  --untie-embeddings-and-output-weights --seq-length 256 --max-position-embeddings 256 --micro-batch-size 4
  --global-batch-size 4 --train-iters 8 --lr 1e-4 --mock-data --vocab-size 8192 --tokenizer-type NullTokenizer
  --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 --seed 1"
MOE="--ffn-hidden-size 1792 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 896 --moe-aux-loss-coeff 1e-2"
DENSE="--ffn-hidden-size 1792"

median_ms() {  # the median elapsed ms of iterations 3.. of a loom log
  grep -oE "elapsed time per iteration \(ms\): [0-9.]+" "$1" | awk '{print $NF}' | tail -n +3 | sort -n |
    awk '{a[NR]=$1} END {if (NR % 2) print a[(NR+1)/2]; else printf "%.1f\n", (a[NR/2]+a[NR/2+1])/2}'
}

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "| precision | model | ms/step | tokens/s | MoE / dense tokens/s |"
echo "|---|---|---:|---:|---:|"
for p in $PRECISIONS; do
  flag=""
  [[ "$p" == "bf16" ]] && flag="--bf16"
  for kind in dense moe; do
    extra="$DENSE"
    [[ "$kind" == "moe" ]] && extra="$MOE"
    # shellcheck disable=SC2086
    OMP_NUM_THREADS="$THREADS" "$LOOM_BIN" train $COMMON $extra $flag >"$tmp/$p-$kind.log" 2>&1 ||
      { echo "[moe-train-bench] ERROR: $p $kind failed:" >&2; tail -5 "$tmp/$p-$kind.log" >&2; exit 1; }
  done
  d="$(median_ms "$tmp/$p-dense.log")"
  m="$(median_ms "$tmp/$p-moe.log")"
  awk -v p="$p" -v d="$d" -v m="$m" 'BEGIN {
    tok = 4 * 256
    printf "| %s | dense (FFN 1792) | %.1f | %.0f | |\n", p, d, tok / (d / 1000)
    printf "| %s | MoE (8 x 896, top-2) | %.1f | %.0f | %.2f |\n", p, m, tok / (m / 1000), d / m }'
done
