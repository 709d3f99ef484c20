#!/usr/bin/env bash
# Activation-recomputation benchmark: GPT-2 124M (the model of bench/run_bench.sh) trained on random
# tokens by `loom train --mock-data` three times, with no recomputation, with
# --recompute-granularity selective, and with --recompute-granularity full --recompute-method uniform
# --recompute-num-layers 1, each a separate process under `/usr/bin/time -v`. Prints a markdown table of
# ms/step, peak allocated memory (Loom's "[after training is done] memory (MB) | ... | max allocated: Y"
# line), peak RSS and each figure's ratio to the no-recomputation run, and writes it to
# out/recompute_latest.md.
#
# Invariant checked: recomputation replays the same kernels on the same inputs (and the same dropout
# masks), so the per-iteration lm loss and grad norm must be bit-identical across the three modes. They
# are compared exactly as Loom writes them to --metrics-jsonl (full double precision, not the rounded
# log line); the table is followed by PASS or FAIL.
#
# Environment overrides (defaults in brackets):
#   LOOM_BIN [$BUILD_DIR/loom, BUILD_DIR defaults to build]   PYTHON [/usr/bin/python3]   BENCH_THREADS [2]
#   BENCH_SHAPE [8x256]      micro-batch x sequence length
#   BENCH_PRECISION [bf16]   bf16 | fp32
#   BENCH_WARMUP [1] BENCH_STEPS [3]   warm-up / timed iterations (ms/step = median of the timed ones)
#   BENCH_LAYERS [12] BENCH_HIDDEN [768] BENCH_HEADS [12] BENCH_VOCAB [50257]   (model; 124M by default)
#   BENCH_DROPOUT [0]        --hidden-dropout and --attention-dropout (0 as in run_bench.sh; set e.g.
#                            0.1 to check that recomputation also replays the dropout masks)
#   BENCH_OUT [out/recompute_latest.md]
# Exit status: 0 when all three runs finished and their losses are identical, 1 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-/usr/bin/python3}"
BUILD_DIR="${BUILD_DIR:-build}"
[[ "$BUILD_DIR" == /* ]] || BUILD_DIR="$ROOT/$BUILD_DIR"
LOOM_BIN="${LOOM_BIN:-$BUILD_DIR/loom}"
THREADS="${BENCH_THREADS:-2}"
SHAPE="${BENCH_SHAPE:-8x256}"
PRECISION="${BENCH_PRECISION:-bf16}"
W="${BENCH_WARMUP:-1}" N="${BENCH_STEPS:-3}"
L="${BENCH_LAYERS:-12}" C="${BENCH_HIDDEN:-768}" NH="${BENCH_HEADS:-12}" V="${BENCH_VOCAB:-50257}"
DROPOUT="${BENCH_DROPOUT:-0}"
MD_OUT="${BENCH_OUT:-$ROOT/out/recompute_latest.md}"

[[ "$SHAPE" =~ ^([0-9]+)x([0-9]+)$ ]] ||
  { echo "[recompute] ERROR: BENCH_SHAPE '$SHAPE' is not BxT (e.g. 8x256)" >&2; exit 1; }
B="${BASH_REMATCH[1]}" T="${BASH_REMATCH[2]}"
case "$PRECISION" in
  fp32) PREC_FLAGS=() ;;
  bf16) PREC_FLAGS=(--bf16) ;;
  *) echo "[recompute] ERROR: BENCH_PRECISION must be bf16 or fp32, got '$PRECISION'" >&2; exit 1 ;;
esac
[[ "$W" =~ ^[0-9]+$ && "$N" =~ ^[1-9][0-9]*$ ]] ||
  { echo "[recompute] ERROR: BENCH_WARMUP must be >= 0 and BENCH_STEPS >= 1 (got '$W', '$N')" >&2; exit 1; }
if [[ ! -x "$LOOM_BIN" ]]; then
  echo "[recompute] ERROR: Loom binary not found or not executable: $LOOM_BIN (build it, or set LOOM_BIN)" >&2
  exit 1
fi
[[ -x /usr/bin/time ]] || { echo "[recompute] ERROR: /usr/bin/time missing (apt-get install time)" >&2; exit 1; }

# Stdlib-only Python for parsing and the report; kept inline so the bench is one file.
read -r -d '' HELPER <<'PY' || true
import json, os, re, statistics, sys

MEM_RE = re.compile(r"\[after training is done\] memory \(MB\) \|.*?max allocated:\s*([0-9.eE+-]+)")

def result(mode, flags, log, jsonl, time_file, warmup):
    iters = []
    with open(jsonl) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                iters.append((r["iteration"], r["elapsed time per iteration (ms)"], r.get("lm loss"),
                              r.get("grad norm")))
    if not iters:
        sys.exit(f"[recompute] {mode}: no iterations in {jsonl}")
    timed = [ms for it, ms, _, _ in iters if it > warmup]
    if not timed:
        sys.exit(f"[recompute] {mode}: {len(iters)} iterations logged, none after the {warmup} warm-up ones")
    max_alloc = None
    with open(log, errors="replace") as f:
        for line in f:
            m = MEM_RE.search(line)
            if m:
                max_alloc = float(m.group(1))
    if max_alloc is None:
        sys.exit(f"[recompute] {mode}: no '[after training is done] memory (MB) | ... max allocated' line in {log}")
    rss = None
    with open(time_file, errors="replace") as f:
        for line in f:
            if "Maximum resident set size" in line:
                rss = int(line.rsplit(":", 1)[1]) / 1024
    if rss is None:
        sys.exit(f"[recompute] {mode}: no 'Maximum resident set size' in {time_file}")
    return {"mode": mode, "flags": flags, "ms_per_step": statistics.median(timed), "steps": len(timed),
            "max_allocated_mb": max_alloc, "peak_rss_mb": round(rss, 1),
            "losses": [[it, loss, gn] for it, _, loss, gn in iters]}

def report(results_path, md_path, header, modes):
    rows = {}
    for line in open(results_path):
        if line.strip():
            r = json.loads(line)
            rows[r["mode"]] = r
    ok = lambda r: r is not None and not r.get("failed")
    base = rows.get("none")
    ratio = lambda r, k: (f"{r[k] / base[k]:.2f}x" if ok(r) and ok(base) and base[k] else "-")
    cols = ["mode", "flags", "ms/step", "vs none", "peak allocated MB", "vs none", "peak RSS MB", "vs none"]
    body = []
    for mode in modes:
        r = rows.get(mode)
        if not ok(r):
            body.append([mode, (r or {}).get("flags") or "-", "FAILED", "-", "-", "-", "-", "-"])
            continue
        body.append([mode, r["flags"] or "-", f"{r['ms_per_step']:,.1f}", ratio(r, "ms_per_step"),
                     f"{r['max_allocated_mb']:,.1f}", ratio(r, "max_allocated_mb"),
                     f"{r['peak_rss_mb']:,.1f}", ratio(r, "peak_rss_mb")])

    # Bit-identical losses: every mode must have run and logged the same (iteration, loss, grad norm).
    problems = []
    ran = [m for m in modes if ok(rows.get(m))]
    for m in modes:
        if m not in ran:
            problems.append(f"{m} did not run")
    if base is not None and ok(base):
        for m in ran:
            if m == "none":
                continue
            a, b = base["losses"], rows[m]["losses"]
            if len(a) != len(b):
                problems.append(f"{m} logged {len(b)} iterations, none logged {len(a)}")
            for (ia, la, ga), (ib, lb, gb) in zip(a, b):
                if ia != ib or la != lb or ga != gb:
                    problems.append(f"{m} iteration {ib}: lm loss {lb!r} grad norm {gb!r}, "
                                    f"none: lm loss {la!r} grad norm {ga!r}")
                    break
    n_iters = len(base["losses"]) if ok(base) else 0
    verdict = ("PASS: lm loss and grad norm bit-identical across " + ", ".join(modes) +
               f" for all {n_iters} iterations" if not problems else "FAIL: " + "; ".join(problems))

    def md(cols, body):
        out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        return "\n".join(out + ["| " + " | ".join(str(x) for x in r) + " |" for r in body])

    text = (f"# Loom activation recomputation (latest run)\n\n" +
            "\n".join("- " + h for h in header.splitlines()) + "\n\n" + md(cols, body) + "\n\n" +
            "Losses: " + verdict + "\n")
    if ok(base):
        text += ("\nPer-iteration lm loss (none): " +
                 ", ".join(f"{it}: {loss!r}" for it, loss, _ in base["losses"]) + "\n")
    print()
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
    with open(md_path, "w") as f:
        f.write(text)
    print(f"[recompute] markdown written to {md_path}")
    return not problems

cmd = sys.argv[1]
if cmd == "result":      # MODE FLAGS LOG JSONL TIMEFILE WARMUP
    print(json.dumps(result(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], int(sys.argv[7]))))
elif cmd == "report":    # RESULTS.jsonl MD HEADER MODE...
    sys.exit(0 if report(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]) else 1)
else:
    sys.exit(f"[recompute] unknown helper mode {cmd}")
PY
helper() { "$PYTHON" -c "$HELPER" "$@"; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/loom_recompute.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
failed=0

MODES=(none selective full-uniform-1)
flags_for() {
  case "$1" in
    none) echo "" ;;
    selective) echo "--recompute-granularity selective" ;;
    full-uniform-1) echo "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" ;;
  esac
}

for mode in "${MODES[@]}"; do
  flags="$(flags_for "$mode")"
  read -r -a mode_flags <<<"$flags"
  echo "[recompute] $SHAPE $PRECISION, $mode: $W warm-up + $N timed iterations, $THREADS threads"
  log="$WORK/$mode.log" jsonl="$WORK/$mode.jsonl" tf="$WORK/$mode.time"
  if OMP_NUM_THREADS="$THREADS" /usr/bin/time -v -o "$tf" "$LOOM_BIN" train --mock-data \
      --vocab-size "$V" --num-layers "$L" --hidden-size "$C" --num-attention-heads "$NH" \
      --seq-length "$T" --max-position-embeddings 1024 --micro-batch-size "$B" --global-batch-size "$B" \
      --train-iters "$((W + N))" --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 0 --lr-decay-style cosine \
      --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --log-interval 1 \
      --hidden-dropout "$DROPOUT" --attention-dropout "$DROPOUT" --eval-iters 0 --seed 1234 \
      --metrics-jsonl "$jsonl" ${PREC_FLAGS[@]+"${PREC_FLAGS[@]}"} ${mode_flags[@]+"${mode_flags[@]}"} \
      >"$log" 2>&1 &&
     helper result "$mode" "$flags" "$log" "$jsonl" "$tf" "$W" >>"$RESULTS"; then
    "$PYTHON" -c 'import json, sys; r = json.loads(sys.argv[1]); r.pop("losses"); print(json.dumps(r))' \
      "$(tail -n 1 "$RESULTS")"
  else
    echo "[recompute] ERROR: $mode failed; last lines of its output:" >&2
    tail -n 20 "$log" >&2 || true
    grep -E "Command (exited|terminated)" "$tf" >&2 || true
    "$PYTHON" -c 'import json, sys; print(json.dumps({"mode": sys.argv[1], "flags": sys.argv[2], "failed": True}))' \
      "$mode" "$flags" >>"$RESULTS"
    failed=1
  fi
done

model_desc="GPT-2 L=$L C=$C NH=$NH V=$V"
[[ "$L/$C/$NH/$V" == "12/768/12/50257" ]] && model_desc="GPT-2 124M (L=12 C=768 NH=12 V=50257)"
cpu="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')"
header="$model_desc, shape ${B}x${T} (micro-batch x sequence), $PRECISION, dropout $DROPOUT, random tokens, $THREADS threads, $(date -u '+%Y-%m-%d %H:%M UTC')
CPU: ${cpu:-unknown} ($(nproc) cores visible); $W warm-up + $N timed iterations, ms/step = median of the timed ones
peak allocated = Loom's 'max allocated' at the end of training; peak RSS = /usr/bin/time -v maximum resident set size"
helper report "$RESULTS" "$MD_OUT" "$header" "${MODES[@]}" || failed=1
exit "$failed"
