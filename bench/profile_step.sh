#!/usr/bin/env bash
# Where a CPU training step's time goes, per op: samples `loom train` (GPT-2 124M by default, the flags of
# bench/run_bench.sh) with `perf record` over the timed iterations only (perf starts after the warm-up),
# groups the samples by op (every oneDNN JIT kernel is a GEMM; Loom's kernels by their function names)
# and prints each group's share of the samples and its ms per step (share x the median step time), then how
# busy each thread was. The window ends at the last sample of an OpenMP worker thread, so the process's exit
# (the kernel unmapping its memory) is not counted as part of a step.
# Run by hand, on an idle machine:
#
#   bash bench/profile_step.sh                    # fp32, 8x256
#   PROFILE_PRECISION=bf16 bash bench/profile_step.sh
#
# Environment: LOOM_BIN [build/loom] PROFILE_PRECISION [fp32 | bf16] PROFILE_SHAPE [8x256]
#   PROFILE_WARMUP [2] PROFILE_STEPS [4] BENCH_THREADS [2] BENCH_LAYERS/HIDDEN/HEADS/VOCAB [12/768/12/50257]
#   PROFILE_OUT [out/profile_latest_<precision>.md]
#   PROFILE_GEMMS [0]  1: also time every oneDNN product of a step by oneDNN's own clock (ONEDNN_VERBOSE=1;
#                      two more runs, W and W + N iterations, subtracted) and list them per kernel and shape,
#                      to set beside loom_bench_ceiling's table (bf16: matmul primitives; fp32's sgemm pieces
#                      are not primitives and do not appear)
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
# One sample per 1 ms of a thread's CPU time (task-clock, fixed period).
OMP_NUM_THREADS="$THREADS" perf record -q -e task-clock -c 1000000 -D "$delay_ms" -o "$WORK/perf.data" -- \
  "$LOOM_BIN" "${ARGS[@]}" --train-iters "$((W + N))" >"$WORK/run.log" 2>&1 ||
  { tail -n 20 "$WORK/run.log" >&2; exit 1; }
# The window the report covers: from perf's start to the last sample of an OpenMP worker thread, the end of
# the last step's parallel work. After it the main thread alone tears the process down (unmapping a few GB:
# kernel time of no step, 3-4% of a 4-step window on GPT-2). Per thread: its samples inside the window (one
# per ms of CPU time) and the window's length, for the share of it each thread was busy.
perf script -i "$WORK/perf.data" -F pid,tid,time 2>/dev/null >"$WORK/samples.txt"
python3 - "$WORK/samples.txt" >"$WORK/window.txt" <<'PY'
import re, sys
rows = [(int(m.group(1)), int(m.group(2)), float(m.group(3))) for m in
        (re.match(r"\s*(\d+)/(\d+)\s+([0-9.]+):", l) for l in open(sys.argv[1])) if m]
if not rows:
    sys.exit("[profile] ERROR: perf recorded no samples")
start = min(t for _, _, t in rows)
workers = [t for pid, tid, t in rows if tid != pid]
end = max(workers) if workers else max(t for _, _, t in rows)
counts = {}
for pid, tid, t in rows:
    if t <= end:
        counts[tid] = counts.get(tid, 0) + 1
print(f"{start:.6f},{end:.6f}")
print(" ".join(str(c) for c in sorted(counts.values(), reverse=True)))
PY
window="$(sed -n 1p "$WORK/window.txt")"
perf report -i "$WORK/perf.data" --time "$window" --no-children --sort dso,sym -F overhead,dso,sym --stdio 2>/dev/null \
  | grep -v '^#' | grep -v '^$' >"$WORK/report.txt"

if [[ "${PROFILE_GEMMS:-0}" == 1 ]]; then
  echo "[profile] timing the step's oneDNN products (ONEDNN_VERBOSE=1, $W and $((W + N)) iterations)"
  for it in "$W" "$((W + N))"; do
    ONEDNN_VERBOSE=1 OMP_NUM_THREADS="$THREADS" "$LOOM_BIN" "${ARGS[@]}" --train-iters "$it" >"$WORK/verbose_$it.log" 2>&1 ||
      { tail -n 20 "$WORK/verbose_$it.log" >&2; exit 1; }
  done
  python3 - "$WORK/verbose_$W.log" "$WORK/verbose_$((W + N)).log" "$N" >"$WORK/gemms.md" <<'PY'
import sys
def totals(path):  # (kernel, problem) -> (ms, calls) over the run's "exec" lines
    t = {}
    for line in open(path, errors="replace"):
        f = line.rstrip().split(",")
        if len(f) < 6 or f[0] not in ("onednn_verbose", "dnnl_verbose") or f[1] != "exec":
            continue
        try:
            ms = float(f[-1])
        except ValueError:
            continue
        key = (f[3] + " " + f[4], f[-2])
        ms0, n0 = t.get(key, (0.0, 0))
        t[key] = (ms0 + ms, n0 + 1)
    return t
a, b, n = totals(sys.argv[1]), totals(sys.argv[2]), int(sys.argv[3])
rows = []
for key, (ms, calls) in b.items():
    ms0, calls0 = a.get(key, (0.0, 0))
    if calls > calls0:
        rows.append((key, (ms - ms0) / n, (calls - calls0) / n))
rows.sort(key=lambda r: -r[1])
print("oneDNN products per step (oneDNN's own exec times; problem = src:weights:dst dims, * = given at run time)")
print("")
print("| kernel | problem | calls per step | ms per step |")
print("|---|---|---:|---:|")
for (kern, prob), ms, calls in rows:
    print(f"| {kern} | {prob} | {calls:g} | {ms:,.1f} |")
print(f"| total | | {sum(r[2] for r in rows):g} | {sum(r[1] for r in rows):,.1f} |")
PY
fi

python3 - "$WORK/report.txt" "$WORK/run.log" "$W" "$OUT" "$PREC" "$SHAPE" "$THREADS" "$WORK/window.txt" <<'PY'
import re, statistics, sys, os
report, log, warmup, out, prec, shape, threads, window_file = sys.argv[1:9]
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
    # Before the norms: the bias gradient runs on norm_common's row-block reduction.
    ("bias (add, column sums)", r"bias"),
    ("LayerNorm / RMSNorm", r"layernorm|rmsnorm|norm_common|backward_group|forward_task"),
    ("cross-entropy + softmax of the logits", r"cross_entropy|sum_exp|log_softmax"),
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
# How much of the window each thread was busy (its samples = its CPU ms, over the window's length): what a
# thread did not use it slept (serial sections, waiting at barriers, blocking I/O) or was preempted.
span_line, counts_line = open(window_file).read().split("\n")[:2]
t0, t1 = (float(v) for v in span_line.split(","))
span_ms = (t1 - t0) * 1000.0
busy = [int(c) / span_ms for c in counts_line.split()][: int(threads)] if span_ms > 0 else []
if busy:
    lines += ["", f"sampled window {span_ms / 1000:,.2f} s (to the last worker-thread sample; the process's exit is left "
              "out); busy share of it by thread: " + ", ".join(f"{min(b, 1.0):.1%}" for b in busy) +
              f" (unused: {max(0.0, 1 - sum(min(b, 1.0) for b in busy) / len(busy)) * step:,.0f} ms per step per thread)"]
gemms = os.path.join(os.path.dirname(window_file), "gemms.md")
if os.path.exists(gemms):
    lines += ["", open(gemms).read().rstrip()]
text = "\n".join(lines)
print(text)
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
open(out, "w").write(text + "\n")
print(f"\n[profile] written to {out}")
PY
