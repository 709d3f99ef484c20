#!/usr/bin/env bash
# Where a CPU training step's time goes, per op: samples `loom train` (GPT-2 124M by default, the flags of
# bench/run_bench.sh) with `perf record` over the timed iterations only (perf starts after the warm-up),
# groups the samples by op (every oneDNN JIT kernel is a GEMM; Loom's kernels by their function names)
# and prints each group's share of the samples and its ms per step (share x the median step time).
# Run by hand, on an idle machine:
#
#   bash bench/profile_step.sh                    # fp32, 8x256
#   PROFILE_PRECISION=bf16 bash bench/profile_step.sh
#
# Environment: LOOM_BIN [build/loom] PROFILE_PRECISION [fp32 | bf16] PROFILE_SHAPE [8x256]
#   PROFILE_WARMUP [2] PROFILE_STEPS [4] BENCH_THREADS [2] BENCH_LAYERS/HIDDEN/HEADS/VOCAB [12/768/12/50257]
#   PROFILE_OUT [out/profile_latest_<precision>.md]
# Needs perf (Debian: linux-perf, installed by scripts/setup.sh) and perf_event_paranoid <= 2.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOOM_BIN="${LOOM_BIN:-$ROOT/build/loom}"
PREC="${PROFILE_PRECISION:-fp32}"
SHAPE="${PROFILE_SHAPE:-8x256}"
W="${PROFILE_WARMUP:-2}" N="${PROFILE_STEPS:-4}" THREADS="${BENCH_THREADS:-2}"
L="${BENCH_LAYERS:-12}" C="${BENCH_HIDDEN:-768}" NH="${BENCH_HEADS:-12}" V="${BENCH_VOCAB:-50257}"
OUT="${PROFILE_OUT:-$ROOT/out/profile_latest_$PREC.md}"
[[ "$SHAPE" =~ ^([0-9]+)x([0-9]+)$ ]] || { echo "[profile] ERROR: PROFILE_SHAPE '$SHAPE' is not BxT" >&2; exit 1; }
B="${BASH_REMATCH[1]}" T="${BASH_REMATCH[2]}"
case "$PREC" in fp32) PF=() ;; bf16) PF=(--bf16) ;;
  *) echo "[profile] ERROR: PROFILE_PRECISION must be fp32 or bf16, got '$PREC'" >&2; exit 1 ;; esac
[[ -x "$LOOM_BIN" ]] || { echo "[profile] ERROR: Loom binary not found: $LOOM_BIN" >&2; exit 1; }
command -v perf >/dev/null || { echo "[profile] ERROR: perf missing (apt-get install linux-perf)" >&2; exit 1; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/loom_profile.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
ARGS=(train --mock-data --vocab-size "$V" --num-layers "$L" --hidden-size "$C" --num-attention-heads "$NH"
  --seq-length "$T" --max-position-embeddings 1024 --micro-batch-size "$B" --global-batch-size "$B"
  --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 0 --lr-decay-style cosine --weight-decay 0.1 --adam-beta1 0.9
  --adam-beta2 0.95 --clip-grad 1.0 --log-interval 1 --hidden-dropout 0 --attention-dropout 0 --eval-iters 0
  --seed 1234 ${PF[@]+"${PF[@]}"})

# A first run without perf times start-up plus the warm-up iterations, so the profiled run can start
# sampling after them (perf --delay) and see steady-state steps only.
echo "[profile] timing start-up + $W warm-up iterations"
t0=$(date +%s%N)
OMP_NUM_THREADS="$THREADS" "$LOOM_BIN" "${ARGS[@]}" --train-iters "$W" >"$WORK/warm.log" 2>&1 ||
  { tail -n 20 "$WORK/warm.log" >&2; exit 1; }
delay_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
echo "[profile] sampling iterations $((W + 1))..$((W + N)) (perf starts after ${delay_ms} ms)"
# One sample per 1 ms of a thread's CPU time (task-clock, fixed period): a thread's sample count is its busy
# time in ms.
OMP_NUM_THREADS="$THREADS" perf record -q -e task-clock -c 1000000 -D "$delay_ms" -o "$WORK/perf.data" -- \
  "$LOOM_BIN" "${ARGS[@]}" --train-iters "$((W + N))" >"$WORK/run.log" 2>&1 ||
  { tail -n 20 "$WORK/run.log" >&2; exit 1; }
perf report -i "$WORK/perf.data" --no-children --sort dso,sym -F overhead,dso,sym --stdio 2>/dev/null \
  | grep -v '^#' | grep -v '^$' >"$WORK/report.txt"
# Samples per thread = its busy ms; what the threads did not use of threads x wall time they slept
# (serial sections, waiting at barriers, blocking I/O).
perf report -i "$WORK/perf.data" --no-children --sort pid -n --stdio 2>/dev/null | grep -v '^#' | grep -v '^$' \
  >"$WORK/threads.txt"

python3 - "$WORK/report.txt" "$WORK/run.log" "$W" "$OUT" "$PREC" "$SHAPE" "$THREADS" "$WORK/threads.txt" "$N" <<'PY'
import re, statistics, sys, os
report, log, warmup, out, prec, shape, threads, threads_file, steps = sys.argv[1:10]
times = {int(m.group(1)): float(m.group(2)) for m in
         (re.search(r"iteration\s+(\d+)\s*/.*?elapsed time per iteration \(ms\):\s*([0-9.]+)", l)
          for l in open(log, errors="replace")) if m}
timed = [t for i, t in sorted(times.items()) if i > int(warmup)]
step = statistics.median(timed)
# First matching rule wins; the patterns are matched against "dso symbol".
RULES = [
    ("GEMM (oneDNN JIT kernels, sgemm/brgemm, Loom's weight packing)", r"\[JIT\]|libdnnl|sgemm|jit_|brgemm|pack_b"),
    ("attention (scores, softmax, values; fwd + bwd)",
     r"cpu::attn::|attention|backward_group|forward_task|grad_tile|block_stats|OnlineSoftmax|stage_block|"
     r"scale_scores|HeadRows"),
    ("AdamW", r"adamw"),
    ("gradient norm (sum of squares)", r"sum_squares"),
    ("GeLU / SwiGLU", r"gelu|glu|swiglu"),
    ("LayerNorm / RMSNorm", r"layernorm|rmsnorm|norm_common|backward_group|forward_task"),
    ("cross-entropy + softmax of the logits", r"cross_entropy|sum_exp|log_softmax"),
    ("bias (add, column sums)", r"bias"),
    ("residual, cast, copy, fill, embedding", r"residual|do_cast|copy_rows|fill_|memmove|memset|memcpy|scatter_add|embedding|transpose"),
    ("kernel (page faults, scheduling)", r"\[kernel"),
    ("OpenMP runtime (libgomp)", r"libgomp"),
]
groups = {name: 0.0 for name, _ in RULES}
groups["other"] = 0.0
other_syms = {}
for line in open(report):
    m = re.match(r"\s*([0-9.]+)%\s+(\S+(?: tid \d+)?)\s+\[[.k]\]\s+(.*)", line)
    if not m:
        continue
    pct, dso, sym = float(m.group(1)), m.group(2), m.group(3)
    key = f"{dso} {sym}"
    for name, pat in RULES:
        if re.search(pat, key, re.I):
            groups[name] += pct
            break
    else:
        groups["other"] += pct
        other_syms[sym[:60]] = other_syms.get(sym[:60], 0) + pct
rows = sorted(groups.items(), key=lambda kv: -kv[1])
lines = [f"# Per-op profile of a Loom training step ({prec}, {shape}, {threads} threads)", "",
         f"median step {step:,.1f} ms over {len(timed)} timed iterations; perf samples of those iterations", "",
         "| op | share of samples | ms per step |", "|---|---:|---:|"]
lines += [f"| {name} | {pct:.1f}% | {pct / 100 * step:,.1f} |" for name, pct in rows if pct > 0]
top = sorted(other_syms.items(), key=lambda kv: -kv[1])[:8]
if top:
    lines += ["", "largest symbols in 'other': " + "; ".join(f"{s} {p:.1f}%" for s, p in top)]
# Busy ms per step per thread: one sample per ms of CPU time (the window is the timed iterations plus the
# process's exit, a few ms).
busy = sorted((int(m.group(1)) / int(steps) for m in
               (re.match(r"\s*[0-9.]+%\s+(\d+)\s", l) for l in open(threads_file)) if m), reverse=True)
if busy:
    t = int(threads)
    idle = max(0.0, t * step - sum(busy[:t])) / t
    lines += ["", "busy ms per step by thread (from sample counts): " + ", ".join(f"{b:,.0f}" for b in busy[:t]) +
              f"; unused thread time = {idle:,.0f} ms per step per thread (serial sections, barriers)"]
text = "\n".join(lines)
print(text)
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
open(out, "w").write(text + "\n")
print(f"\n[profile] written to {out}")
PY
