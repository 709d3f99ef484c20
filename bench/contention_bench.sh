#!/usr/bin/env bash
# OpenMP waiting under contention (issue 19): a 2-thread `loom train` step on an idle machine and beside
# one busy single-threaded process, for each way OpenMP's idle workers can wait:
#   loom      Loom's default (src/cli/main.cpp: GOMP_SPINCOUNT=1000, set by re-executing itself)
#   gomp      libgomp's own default (LOOM_OPENMP_SPIN=default: 300,000 spins before sleeping)
#   passive   OMP_WAIT_POLICY=passive (sleep at once)
# The fair-share slowdown with 2 threads and one competitor on 2 cores is 1.5x (each thread gets 2/3 of a
# core); the target is <= 1.3 x that (1.95x) by default, with no loss of speed on an idle machine.
# Runs alternate idle/contended and the variants round-robin, REPS times, so drift hits all alike; each
# figure is the median over runs of the mean step time (ms) of the timed iterations.
#
#   bench/contention_bench.sh            (env: BUILD_DIR=build, REPS=3, ITERS=8, WARMUP=2, THREADS=2,
#                                         MODEL="gpt2-124m" or "small", PRECISION="fp32" or "bf16",
#                                         VARIANTS="loom gomp passive")
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOOM="${LOOM:-$ROOT/${BUILD_DIR:-build}/loom}"
REPS="${REPS:-3}" ITERS="${ITERS:-8}" WARMUP="${WARMUP:-2}" THREADS="${THREADS:-2}"
MODEL="${MODEL:-gpt2-124m}"
VARIANTS="${VARIANTS:-loom gomp passive}"
case "${PRECISION:-fp32}" in
  fp32) PREC=() ;;
  bf16) PREC=(--bf16) ;;
  *) echo "contention_bench: PRECISION must be fp32 or bf16" >&2; exit 1 ;;
esac
[[ -x "$LOOM" ]] || { echo "contention_bench: $LOOM not found (build first)" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT

case "$MODEL" in
  gpt2-124m) SHAPE=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --vocab-size 50257
                    --seq-length 256 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8) ;;
  small) SHAPE=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --vocab-size 50257
                --seq-length 128 --max-position-embeddings 128 --micro-batch-size 8 --global-batch-size 8) ;;
  *) echo "contention_bench: MODEL must be gpt2-124m or small" >&2; exit 1 ;;
esac

# Mean ms of the iterations after WARMUP ("elapsed time per iteration (ms): X" with --log-interval 1).
run_one() {  # run_one VARIANT -> prints the mean step ms
  local v="$1" log="$WORK/run.log"
  local -a envs=(OMP_NUM_THREADS="$THREADS")
  case "$v" in
    loom) ;;
    gomp) envs+=(LOOM_OPENMP_SPIN=default) ;;
    passive) envs+=(OMP_WAIT_POLICY=passive) ;;
    spin=*) envs+=(GOMP_SPINCOUNT="${v#spin=}") ;;
    *) echo "unknown variant $v" >&2; exit 1 ;;
  esac
  env "${envs[@]}" "$LOOM" train --mock-data "${SHAPE[@]}" --train-iters "$((WARMUP + ITERS))" --lr 6e-4 \
    --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 --seed 1234 ${PREC[@]+"${PREC[@]}"} >"$log" 2>&1 ||
    { echo "contention_bench: loom failed:" >&2; tail -n 5 "$log" >&2; exit 1; }
  sed -n 's/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p' "$log" | tail -n "$ITERS" |
    awk '{ s += $1; n++ } END { printf "%.1f\n", s / n }'
}

median() { sort -n | awk '{ a[NR] = $1 } END { print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }'; }

declare -A idle busy
for ((r = 0; r < REPS; r++)); do
  for v in $VARIANTS; do
    idle[$v]+="$(run_one "$v") "
    # One busy single-threaded competitor for the length of the contended run.
    ( while :; do :; done ) &
    hog=$!
    busy[$v]+="$(run_one "$v") "
    kill "$hog"; wait "$hog" 2>/dev/null || true
  done
done

echo "model $MODEL, ${PRECISION:-fp32}, $THREADS threads, $REPS reps x $ITERS timed iterations; $(nproc) cores: $(lscpu | sed -n 's/^Model name: *//p')"
printf "%-10s %12s %18s %10s %16s\n" variant "idle ms" "1 competitor ms" slowdown "vs fair (1.5x)"
for v in $VARIANTS; do
  i=$(tr ' ' '\n' <<<"${idle[$v]}" | grep . | median)
  b=$(tr ' ' '\n' <<<"${busy[$v]}" | grep . | median)
  awk -v v="$v" -v i="$i" -v b="$b" 'BEGIN { printf "%-10s %12.1f %18.1f %9.2fx %15.2fx\n", v, i, b, b / i, b / i / 1.5 }'
done
