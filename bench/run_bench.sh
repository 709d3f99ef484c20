#!/usr/bin/env bash
# Training-speed benchmark behind `make bench`: GPT-2 124M trained on random tokens on CPU, fp32 (default)
# or BF16 mixed precision, by `loom train --mock-data` and by bench/pytorch_gpt2.py, one after the other
# on the same machine, each a separate process under `/usr/bin/time -v` so peak RSS is measured the same
# way for both. Prints a
# side-by-side table with the Loom/PyTorch ratios against the targets and writes it as markdown to
# out/bench_latest.md (out/bench_latest_bf16.md for bf16).
#
# Precision: BENCH_PRECISION=fp32 runs both sides in fp32; bf16 runs `loom train --bf16` against
# pytorch_gpt2.py --bf16 (torch.autocast cpu/bfloat16 around forward + loss, fp32 params and AdamW).
# Loom runs with --hidden-dropout 0 --attention-dropout 0 (its Megatron defaults are 0.1; the PyTorch
# reference has no dropout) and --eval-iters 0 (no end-of-training validation), so both do the same work.
#
# Both sides run with OMP_NUM_THREADS=$BENCH_THREADS (2). PyTorch runs with the fastest OPENBLAS_CORETYPE
# (or $BENCH_TORCH_CORETYPE); Loom runs in the caller's environment. Before timing, a probe
# reports which BLAS torch really loads (and OpenBLAS's core type) and warns when it is the netlib
# reference BLAS or OpenBLAS's generic kernels, since the ratios would then flatter Loom.
# ms/step is the median over the timed iterations (the first WARMUP iterations are dropped); tokens/s
# and GFLOP/s are derived from it with one FLOP formula shared by both sides (see bench/README.md).
# Before each shape, $CEILING_BIN (build/bench/loom_bench_ceiling) times the step's GEMMs through oneDNN
# alone at the model's shapes (the GEMM ceiling, same FLOP count); the report gives each side's step as a
# fraction of it, with the target >= 85% for GPT-2 124M at 8x256. Without the binary it warns and skips.
#
# Environment overrides (defaults in brackets):
#   LOOM_BIN [$BUILD_DIR/loom, BUILD_DIR defaults to build]   PYTHON [/usr/bin/python3]   BENCH_THREADS [2]
#   BENCH_PRECISION [fp32]  fp32 | bf16
#   BENCH_SHAPES ["4x64 8x256"]  (BxT pairs)
#   BENCH_WARMUP / BENCH_STEPS        warm-up / timed iterations for every shape
#   BENCH_WARMUP_<BxT> / BENCH_STEPS_<BxT>  per shape, e.g. BENCH_STEPS_8x256=5
#                                     [4x64: 2 + 8, 8x256: 1 + 5, others: 1 + 3]
#   BENCH_LAYERS [12] BENCH_HIDDEN [768] BENCH_HEADS [12] BENCH_VOCAB [50257]  (model; 124M by default)
#   BENCH_OUT [out/bench_latest.md; out/bench_latest_bf16.md with bf16]
#   BENCH_TORCH_CORETYPE [auto]   OPENBLAS_CORETYPE for the PyTorch side: auto = fastest of unset/SkylakeX/Haswell
#   CEILING_BIN [$BUILD_DIR/bench/loom_bench_ceiling]
#   BENCH_PAIRS [3]  times the (GEMM ceiling, Loom) pair is run, in turn, per shape: the "Loom of ceiling" is
#                    then the median of the pairs' fractions, each pair's listed under the table (on a
#                    shared VM both sides drift by a few % within minutes, so one pair decides a close
#                    verdict by chance). The PyTorch side and the main table use the first pair's Loom run.
# Exit status: 0 when every run finished (PASS or MISS alike), 1 when a run failed or Loom is missing.
#
# Helper modes (used internally and by tests):
#   run_bench.sh --parse-loom-log LOG WARMUP B T   -> prints the Loom result as one JSON line
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-/usr/bin/python3}"

# One Python helper (stdlib only) for parsing logs and formatting; kept inline so the bench is one file.
read -r -d '' HELPER <<'PY' || true
import json, os, re, statistics, sys

# speed = PyTorch ms / Loom ms, at least this; per precision (bf16: against PyTorch's autocast)
ALL_TARGETS = {"fp32": {(4, 64): 2.0, (8, 256): 1.4}, "bf16": {(8, 256): 1.4}}
PRECISION = os.environ.get("BENCH_PRECISION", "fp32")
TARGETS = ALL_TARGETS.get(PRECISION, {})
MEM_TARGET = 1.0                          # memory = Loom RSS / PyTorch RSS, at most this
CEILING_TARGET = {(8, 256): 0.85}         # Loom's step time at the GEMM ceiling / its measured step time

def env_int(name, default):
    return int(os.environ.get(name, default))

def model():
    return dict(L=env_int("BENCH_LAYERS", 12), C=env_int("BENCH_HIDDEN", 768),
                NH=env_int("BENCH_HEADS", 12), V=env_int("BENCH_VOCAB", 50257))

def padded_vocab(V, multiple=128):
    return (V + multiple - 1) // multiple * multiple

def flops_per_step(B, T, L, C, Vp):
    # Same formula as bench/pytorch_gpt2.py: forward matmul FLOPs x 3 (forward + backward).
    return 3 * (2 * B * T * (12 * L * C * C) + 2 * B * T * C * Vp + 2 * B * L * T * T * C)

ITER_RE = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)\s*\|.*?elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)")

def parse_loom_log(path, warmup, B, T):
    times = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = ITER_RE.search(line)
            if m:
                times[int(m.group(1))] = float(m.group(3))
    if not times:
        sys.exit(f"[bench] no 'iteration ... elapsed time per iteration (ms): X' lines in {path}")
    timed = [ms for it, ms in sorted(times.items()) if it > warmup]
    if not timed:
        sys.exit(f"[bench] {path}: {len(times)} iterations logged, none after the {warmup} warm-up ones")
    ms = statistics.median(timed)
    mdl = model()
    flops = flops_per_step(B, T, mdl["L"], mdl["C"], padded_vocab(mdl["V"]))
    return {"impl": "loom", "precision": PRECISION, "B": B, "T": T, "warmup": warmup, "steps": len(timed),
            "ms_per_step": round(ms, 3), "tokens_per_s": round(B * T / (ms / 1e3), 3),
            "gflops": round(flops / (ms / 1e3) / 1e9, 3)}

def rss_mb(time_file):
    with open(time_file, errors="replace") as f:
        for line in f:
            if "Maximum resident set size" in line:
                return round(int(line.rsplit(":", 1)[1]) / 1024, 1)
    sys.exit(f"[bench] no 'Maximum resident set size' in {time_file}")

def read_pytorch(path):
    last = None
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{") and '"impl"' in line:
                last = line
    if last is None:
        sys.exit(f"[bench] no JSON result line in {path}")
    r = json.loads(last)
    if r.get("precision", "fp32") != PRECISION:
        sys.exit(f"[bench] {path}: PyTorch ran in {r.get('precision')}, expected {PRECISION}")
    return r

def fmt(x, nd=1):
    return "-" if x is None else f"{x:,.{nd}f}"

def report(results_path, md_path, header):
    rows = [json.loads(l) for l in open(results_path) if l.strip()]
    shapes = []
    for r in rows:
        if (r["B"], r["T"]) not in shapes:
            shapes.append((r["B"], r["T"]))
    # Pair k > 1 of BENCH_PAIRS: rows with "round": k; the main table uses the first.
    by = {(r["B"], r["T"], r["impl"]): r for r in rows if r.get("round", 1) == 1}
    rounds = {}
    for r in rows:
        rounds.setdefault((r["B"], r["T"], r.get("round", 1)), {})[r["impl"]] = r
    cols = ["shape", "impl", "precision", "ms/step", "tokens/s", "GFLOP/s", "of GEMM ceiling", "peak RSS MB"]
    ceilings = []
    pair_notes = []
    table = []
    verdicts = []
    for B, T in shapes:
        lo, pt, ce = by.get((B, T, "loom")), by.get((B, T, "pytorch")), by.get((B, T, "ceiling"))
        ok = lambda r: r is not None and not r.get("failed")
        # Fraction of the GEMM ceiling: the time the step's GEMMs take at oneDNN's best / the step's time.
        frac = lambda r: ce["ceiling_ms"] / r["ms_per_step"] if ok(ce) and ok(r) else None
        # Loom's fraction: its pair's, or with BENCH_PAIRS > 1 the median over the pairs.
        loom_frac = frac(lo)
        pairs = []
        for k in sorted(k for (b, t, k) in rounds if (b, t) == (B, T)):
            c2, l2 = rounds[(B, T, k)].get("ceiling"), rounds[(B, T, k)].get("loom")
            if ok(c2) and ok(l2):
                pairs.append((c2["ceiling_ms"], l2["ms_per_step"]))
        if len(pairs) > 1:
            loom_frac = statistics.median(c / s for c, s in pairs)
            pair_notes.append(f"{B}x{T}: Loom of ceiling per pair (ceiling ms / Loom ms/step): " +
                              ", ".join(f"{100 * c / s:.1f}% ({c:,.1f} / {s:,.1f})" for c, s in pairs) +
                              f"; median {100 * loom_frac:.1f}% (the tables' Loom figure)")
        for r, name in ((lo, "loom"), (pt, "pytorch")):
            if r is None or r.get("failed"):
                table.append([f"{B}x{T}", name, PRECISION, "FAILED", "-", "-", "-", "-"])
            else:
                f = loom_frac if name == "loom" else frac(r)
                table.append([f"{B}x{T}", name, PRECISION, fmt(r["ms_per_step"]), fmt(r["tokens_per_s"]),
                              fmt(r["gflops"]), "-" if f is None else f"{100 * f:.1f}%",
                              fmt(r.get("peak_rss_mb"))])
        if ok(ce):
            # The target is for GPT-2 124M (the default model), not for the quick-check models.
            ctgt = CEILING_TARGET.get((B, T)) if model() == dict(L=12, C=768, NH=12, V=50257) else None
            f = loom_frac
            ceilings.append([f"{B}x{T}", fmt(ce["ceiling_ms"]), fmt(ce["ceiling_gflops"]),
                             "-" if f is None else f"{100 * f:.1f}%",
                             "-" if ctgt is None else f">= {100 * ctgt:.0f}%",
                             "-" if ctgt is None else ("MISS" if f is None or f < ctgt else "PASS")])
        speed = pt["ms_per_step"] / lo["ms_per_step"] if ok(lo) and ok(pt) else None
        mem = (lo["peak_rss_mb"] / pt["peak_rss_mb"]
               if ok(lo) and ok(pt) and lo.get("peak_rss_mb") and pt.get("peak_rss_mb") else None)
        tgt = TARGETS.get((B, T))
        sp_status = "-" if tgt is None else ("MISS" if speed is None or speed < tgt else "PASS")
        mem_status = "MISS" if mem is None or mem > MEM_TARGET else "PASS"
        verdicts.append([f"{B}x{T}", "-" if speed is None else f"{speed:.2f}x",
                         "-" if tgt is None else f">= {tgt:.1f}x", sp_status,
                         "-" if mem is None else f"{mem:.2f}", f"<= {MEM_TARGET:.1f}", mem_status])
    vcols = ["shape", "speed (PyTorch ms / Loom ms)", "target", "status",
             "memory (Loom RSS / PyTorch RSS)", "target", "status"]

    def text(cols, body, nleft):  # the first nleft columns are labels (left-aligned)
        w = [max(len(str(x)) for x in col) for col in zip(cols, *body)]
        line = lambda row: "  ".join(str(x).rjust(n) if i >= nleft else str(x).ljust(n)
                                     for i, (x, n) in enumerate(zip(row, w)))
        return "\n".join([line(cols), line(["-" * n for n in w])] + [line(r) for r in body])

    def md(cols, body):
        out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        return "\n".join(out + ["| " + " | ".join(str(x) for x in r) + " |" for r in body])

    print()
    print(header)
    print()
    print(text(cols, table, 3))
    print()
    print(text(vcols, verdicts, 2))
    ccols = ["shape", "GEMM ceiling ms/step", "ceiling GFLOP/s", "Loom of ceiling", "target", "status"]
    if ceilings:
        print()
        print(text(ccols, ceilings, 1))
        for n in pair_notes:
            print(n)
    os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
    with open(md_path, "w") as f:
        f.write(f"# Loom vs PyTorch training speed, {PRECISION} (latest run)\n\n")
        f.write("\n".join("- " + h for h in header.splitlines()) + "\n\n")
        f.write(md(cols, table) + "\n\n" + md(vcols, verdicts) + "\n")
        if ceilings:
            f.write("\n" + md(ccols, ceilings) + "\n")
            for n in pair_notes:
                f.write("\n- " + n + "\n")
    print(f"\n[bench] markdown written to {md_path}")

mode = sys.argv[1]
if mode == "parse-loom-log":
    print(json.dumps(parse_loom_log(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
elif mode == "loom-result":       # LOG WARMUP B T TIMEFILE [PAIR]
    r = parse_loom_log(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    r["peak_rss_mb"] = rss_mb(sys.argv[6])
    r["round"] = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    print(json.dumps(r))
elif mode == "pytorch-result":    # STDOUT TIMEFILE
    r = read_pytorch(sys.argv[2])
    r["peak_rss_in_process_mb"] = r.get("peak_rss_mb")
    r["peak_rss_mb"] = rss_mb(sys.argv[3])
    print(json.dumps(r))
elif mode == "ceiling-result":    # PROBE_STDOUT B T [PAIR]
    last = [l for l in open(sys.argv[2]) if l.startswith("{")]
    if not last:
        sys.exit(f"[bench] no JSON line in the GEMM ceiling probe's output {sys.argv[2]}")
    r = json.loads(last[-1])
    r.update(impl="ceiling", B=int(sys.argv[3]), T=int(sys.argv[4]),
             round=int(sys.argv[5]) if len(sys.argv) > 5 else 1)
    mdl = model()
    want = flops_per_step(r["B"], r["T"], mdl["L"], mdl["C"], padded_vocab(mdl["V"]))
    if r["flop"] != want:
        sys.exit(f"[bench] the ceiling probe counted {r['flop']} FLOPs per step, the bench formula {want}")
    print(json.dumps(r))
elif mode == "report":            # RESULTS.jsonl MD HEADER
    report(sys.argv[2], sys.argv[3], sys.argv[4])
else:
    sys.exit(f"[bench] unknown helper mode {mode}")
PY

helper() { "$PYTHON" -c "$HELPER" "$@"; }

if [[ "${1:-}" == "--parse-loom-log" ]]; then
  [[ $# -eq 5 ]] || { echo "usage: $0 --parse-loom-log LOG WARMUP B T" >&2; exit 2; }
  helper parse-loom-log "$2" "$3" "$4" "$5"
  exit
fi

BUILD_DIR="${BUILD_DIR:-build}"
[[ "$BUILD_DIR" == /* ]] || BUILD_DIR="$ROOT/$BUILD_DIR"
LOOM_BIN="${LOOM_BIN:-$BUILD_DIR/loom}"
PRECISION="${BENCH_PRECISION:-fp32}"
case "$PRECISION" in
  fp32) LOOM_PREC=() TORCH_PREC=() ;;
  bf16) LOOM_PREC=(--bf16) TORCH_PREC=(--bf16) ;;
  *) echo "[bench] ERROR: BENCH_PRECISION must be fp32 or bf16, got '$PRECISION'" >&2; exit 1 ;;
esac
export BENCH_PRECISION="$PRECISION"
THREADS="${BENCH_THREADS:-2}"
SHAPES="${BENCH_SHAPES:-4x64 8x256}"
PAIRS="${BENCH_PAIRS:-3}"
[[ "$PAIRS" =~ ^[1-9][0-9]*$ ]] || { echo "[bench] ERROR: BENCH_PAIRS must be a positive integer, got '$PAIRS'" >&2; exit 1; }
PAIRS_NOTE=""; [[ $PAIRS -eq 1 ]] || PAIRS_NOTE=1
L="${BENCH_LAYERS:-12}" C="${BENCH_HIDDEN:-768}" NH="${BENCH_HEADS:-12}" V="${BENCH_VOCAB:-50257}"
export BENCH_LAYERS="$L" BENCH_HIDDEN="$C" BENCH_HEADS="$NH" BENCH_VOCAB="$V"
if [[ "$PRECISION" == fp32 ]]; then MD_OUT="${BENCH_OUT:-$ROOT/out/bench_latest.md}"
else MD_OUT="${BENCH_OUT:-$ROOT/out/bench_latest_$PRECISION.md}"; fi

if [[ ! -x "$LOOM_BIN" ]]; then
  echo "[bench] ERROR: Loom binary not found or not executable: $LOOM_BIN" >&2
  echo "[bench] build it first (make, or cmake --build build --target loom), or set LOOM_BIN" >&2
  exit 1
fi
CEILING_BIN="${CEILING_BIN:-$BUILD_DIR/bench/loom_bench_ceiling}"
CEILING_DTYPE="f32"; [[ "$PRECISION" == bf16 ]] && CEILING_DTYPE="bf16"
[[ -x "$CEILING_BIN" ]] || echo "[bench] WARNING: $CEILING_BIN missing (cmake --build $BUILD_DIR --target loom_bench_ceiling): no GEMM ceiling in the report" >&2
[[ -x /usr/bin/time ]] || { echo "[bench] ERROR: /usr/bin/time missing (apt-get install time)" >&2; exit 1; }
"$PYTHON" -c "import torch" 2>/dev/null ||
  { echo "[bench] ERROR: $PYTHON cannot import torch (apt-get install python3-torch)" >&2; exit 1; }

# PyTorch's environment: the fastest OPENBLAS_CORETYPE, or $BENCH_TORCH_CORETYPE (bench/torch_coretype.sh).
source "$ROOT/bench/torch_coretype.sh"
pick_torch_coretype bench

# Which BLAS does torch run on here? Debian's torch uses whatever libblas.so.3 the alternatives
# system points at: the netlib reference BLAS is ~40x slower than OpenBLAS, and OpenBLAS falls back to
# its generic "Prescott" kernels on CPUs it does not recognise (~2x slower than SkylakeX kernels).
probe="$("${TORCH_ENV[@]}" OPENBLAS_VERBOSE=2 OMP_NUM_THREADS=1 "$PYTHON" -c '
import os, torch
torch.ones(4, 4) @ torch.ones(4, 4)
libs = sorted({os.path.realpath(l.split()[-1]) for l in open("/proc/self/maps")
               if len(l.split()) >= 6 and "blas" in os.path.basename(l.split()[-1]).lower()})
print("BLAS_LIBS", " ".join(libs))' 2>&1 || true)"
blas_libs="$(sed -n 's/^BLAS_LIBS //p' <<<"$probe")"
blas_core="$(sed -n 's/^Core: *//p' <<<"$probe" | head -n 1)"
blas_warn=""
case "$blas_libs" in
  *openblas*)
    blas_desc="OpenBLAS, core ${blas_core:-unknown}"
    case "$blas_core" in
      Prescott | Core2 | Katmai | Coppermine | Northwood | Banias | Atom | "")
        blas_warn="PyTorch runs on OpenBLAS's generic '${blas_core:-unknown}' kernels; set BENCH_TORCH_CORETYPE (e.g. SkylakeX or Haswell) for a fair comparison" ;;
    esac ;;
  */blas/libblas.so*)
    blas_desc="netlib reference BLAS ($blas_libs)"
    blas_warn="PyTorch runs on the netlib reference BLAS (tens of times slower than OpenBLAS); install libopenblas0-pthread or put its directory on LD_LIBRARY_PATH" ;;
  "") blas_desc="no separate BLAS library found" ;;
  *) blas_desc="$blas_libs" ;;
esac
torch_coretype="$BENCH_TORCH_CORETYPE"
echo "[bench] PyTorch BLAS: $blas_desc (OPENBLAS_CORETYPE=$torch_coretype)"
[[ -z "$blas_warn" ]] || echo "[bench] WARNING: $blas_warn; speed ratios will overstate Loom" >&2

# With bf16, torch 1.13 runs autocast's BF16 matmuls through oneDNN (mkldnn), not OpenBLAS, and only on
# CPUs with AVX512-BF16/AMX is that path fast; elsewhere it falls back to slow reference kernels. Time it
# against fp32 in one process so a missing fast path is visible in the table header.
bf16_desc=""
if [[ "$PRECISION" == bf16 ]]; then
  bf16_probe="$("${TORCH_ENV[@]}" OMP_NUM_THREADS="$THREADS" "$PYTHON" -c '
import time, torch
torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
res = []
for dt in (torch.float32, torch.bfloat16):
    a, b = torch.randn(2048, 768).to(dt), torch.randn(768, 3072).to(dt)
    a @ b
    t = time.perf_counter()
    for _ in range(5): a @ b
    res.append((time.perf_counter() - t) / 5 * 1e3)
print(f"{res[0]:.2f} {res[1]:.2f}")' 2>/dev/null || echo "")"
  read -r f32_ms bf16_ms <<<"$bf16_probe"
  if [[ -n "${bf16_ms:-}" ]]; then
    bf16_desc="torch bf16 matmul 2048x768x3072: $bf16_ms ms (fp32: $f32_ms ms)"
    echo "[bench] probe: $bf16_desc"
    if awk -v a="$bf16_ms" -v b="$f32_ms" 'BEGIN{exit !(a>=b)}'; then
      blas_warn="${blas_warn:+$blas_warn; }PyTorch's bf16 matmul is no faster than its fp32 one (no fast oneDNN BF16 path on this CPU?)"
      echo "[bench] WARNING: PyTorch's bf16 matmul is no faster than fp32; speed ratios will overstate Loom" >&2
    fi
  else
    echo "[bench] WARNING: the torch bf16 matmul probe failed" >&2
  fi
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/loom_bench.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
failed=0

# Default iteration counts keep the whole run at about 4-5 minutes on 2 cores with three (ceiling, Loom)
# pairs per shape (PyTorch takes about 1.9 s/step at 4x64 and 7.3 s/step at 8x256).
counts_for() {  # SHAPE -> "WARMUP STEPS"
  local shape="$1" w s
  case "$shape" in
    4x64) w=2 s=8 ;;
    8x256) w=1 s=5 ;;
    *) w=1 s=3 ;;
  esac
  local wv="BENCH_WARMUP_$shape" sv="BENCH_STEPS_$shape"
  w="${!wv:-${BENCH_WARMUP:-$w}}"
  s="${!sv:-${BENCH_STEPS:-$s}}"
  echo "$w $s"
}

show_failure() {  # LABEL LOG TIMEFILE
  echo "[bench] ERROR: $1 failed; last lines of its output:" >&2
  tail -n 20 "$2" >&2 || true
  grep -E "Command (exited|terminated)" "$3" >&2 || true
}

for shape in $SHAPES; do
  [[ "$shape" =~ ^([0-9]+)x([0-9]+)$ ]] ||
    { echo "[bench] ERROR: BENCH_SHAPES entry '$shape' is not BxT (e.g. 4x64)" >&2; exit 1; }
  B="${BASH_REMATCH[1]}" T="${BASH_REMATCH[2]}"
  read -r W N <<<"$(counts_for "$shape")"

  for ((pair = 1; pair <= PAIRS; pair++)); do
    sfx="$shape"; [[ $pair -eq 1 ]] || sfx="${shape}_pair$pair"
    if [[ -x "$CEILING_BIN" ]]; then
      echo "[bench] $shape: GEMM ceiling, $PRECISION ($CEILING_BIN, $THREADS threads)${PAIRS_NOTE:+, pair $pair of $PAIRS}"
      log="$WORK/ceiling_$sfx.log"
      if OMP_NUM_THREADS="$THREADS" "$CEILING_BIN" --dtype "$CEILING_DTYPE" --batch "$B" --seq "$T" --hidden "$C" \
          --layers "$L" --heads "$NH" --vocab "$(( (V + 127) / 128 * 128 ))" >"$log" 2>"$log.table" &&
         helper ceiling-result "$log" "$B" "$T" "$pair" >>"$RESULTS"; then
        [[ $pair -gt 1 ]] || cat "$log.table"
      else
        show_failure "the GEMM ceiling probe at $shape" "$log.table" /dev/null
        failed=1
      fi
    fi

    echo "[bench] $shape: loom $PRECISION ($W warm-up + $N timed iterations, $THREADS threads)${PAIRS_NOTE:+, pair $pair of $PAIRS}"
    log="$WORK/loom_$sfx.log" tf="$WORK/loom_$sfx.time"
    if OMP_NUM_THREADS="$THREADS" /usr/bin/time -v -o "$tf" "$LOOM_BIN" train --mock-data \
        --vocab-size "$V" --num-layers "$L" --hidden-size "$C" --num-attention-heads "$NH" \
        --seq-length "$T" --max-position-embeddings 1024 --micro-batch-size "$B" --global-batch-size "$B" \
        --train-iters "$((W + N))" --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 0 --lr-decay-style cosine \
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --log-interval 1 \
        --hidden-dropout 0 --attention-dropout 0 --eval-iters 0 ${LOOM_PREC[@]+"${LOOM_PREC[@]}"} \
        --seed 1234 >"$log" 2>&1 &&
       helper loom-result "$log" "$W" "$B" "$T" "$tf" "$pair" >>"$RESULTS"; then
      tail -n 1 "$RESULTS"
    else
      show_failure "loom at $shape" "$log" "$tf"
      echo "{\"impl\": \"loom\", \"B\": $B, \"T\": $T, \"round\": $pair, \"failed\": true}" >>"$RESULTS"
      failed=1
    fi
  done

  echo "[bench] $shape: pytorch $PRECISION ($W warm-up + $N timed steps, $THREADS threads)"
  log="$WORK/pytorch_$shape.log" tf="$WORK/pytorch_$shape.time"
  if "${TORCH_ENV[@]}" OMP_NUM_THREADS="$THREADS" /usr/bin/time -v -o "$tf" \
      "$PYTHON" "$ROOT/bench/pytorch_gpt2.py" --num-layers "$L" --hidden-size "$C" \
      --num-attention-heads "$NH" --seq-length "$T" --micro-batch-size "$B" --vocab-size "$V" \
      --steps "$N" --warmup "$W" --threads "$THREADS" ${TORCH_PREC[@]+"${TORCH_PREC[@]}"} >"$log" 2>&1 &&
     helper pytorch-result "$log" "$tf" >>"$RESULTS"; then
    tail -n 1 "$RESULTS"
  else
    show_failure "pytorch at $shape" "$log" "$tf"
    echo "{\"impl\": \"pytorch\", \"B\": $B, \"T\": $T, \"failed\": true}" >>"$RESULTS"
    failed=1
  fi
done

model_desc="GPT-2 L=$L C=$C NH=$NH V=$V"
[[ "$L/$C/$NH/$V" == "12/768/12/50257" ]] && model_desc="GPT-2 124M (L=12 C=768 NH=12 V=50257)"
cpu="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')"
if [[ "$PRECISION" == bf16 ]]; then
  prec_desc="bf16 mixed precision (Loom --bf16; PyTorch torch.autocast cpu/bfloat16 forward + loss; fp32 master weights and AdamW on both sides)"
  targets_desc="speed >= 1.4x at 8x256 (against PyTorch bf16 autocast); memory ratio <= 1.0"
else
  prec_desc="fp32"
  targets_desc="speed >= 2.0x at 4x64, >= 1.4x at 8x256; memory ratio <= 1.0"
fi
header="$model_desc, $prec_desc, random tokens, no dropout, $THREADS threads each, $(date -u '+%Y-%m-%d %H:%M UTC')
CPU: ${cpu:-unknown} ($(nproc) cores visible); ms/step = median over timed iterations
PyTorch $("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) on $blas_desc, OPENBLAS_CORETYPE=$torch_coretype${bf16_desc:+; $bf16_desc}
Targets: $targets_desc"
[[ -z "$blas_warn" ]] || header+="
WARNING: $blas_warn"
helper report "$RESULTS" "$MD_OUT" "$header"
exit "$failed"
