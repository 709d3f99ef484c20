#!/usr/bin/env bash
# MoE layer benchmark on CPU (run by hand, not by `make bench`): forward + backward of one mixture-of-experts
# layer, Loom (build/bench/loom_bench_moe: Router + moe_permute + GroupedMLP + moe_unpermute and their
# backwards) against bench/pytorch_moe.py (a Hugging Face Mixtral-style sparse MoE block under autograd),
# one process after the other on the same shapes, threads and precision. Prints a markdown table with the
# speed ratio (PyTorch ms / Loom ms) and the >= 2x target per shape and precision, then Loom's time per
# phase, and writes both to $MOE_BENCH_OUT.
#
# Shapes (MOE_BENCH_SHAPES, default "mixtral-512 mixtral-2048 fine-2048"; tokens N = B·T):
#   mixtral-512, mixtral-2048   N = 512 / 2048, hidden C 1024, SwiGLU ffn F 3584, E 8 experts, top-2
#   fine-2048                   N = 2048, C 1024, F 512, E 64, top-8 (fine-grained experts, Qwen-MoE/OLMoE style)
# Precisions (MOE_BENCH_PRECISIONS, default "fp32 bf16"): fp32 on both sides; bf16 = Loom's bf16 compute
# (bf16 activations and weight copy, f32 main grads) against PyTorch's forward under
# torch.autocast("cpu", torch.bfloat16) with f32 parameters and gradients (the two standard recipes).
# Each run: MOE_BENCH_WARMUP (2) warm-up + MOE_BENCH_STEPS (5) timed iterations, fresh random tokens each
# iteration; ms = median of the timed ones. MOE_BENCH_REPEATS (1) > 1 runs every pair that many times,
# alternating Loom and PyTorch, and reports the median of the per-run medians with their range.
#
# Next to them, the experts' GEMM ceiling (when $CEILING_BIN exists): loom_bench_ceiling times the six products
# of one expert (fc1 = gate and up projections together, fc2 = down; forward, input gradient, weight gradient)
# over the mean group of N·k/E rows at oneDNN's best variant, with the weights hot in cache; E times that is
# what the layer's expert GEMMs take at best, before routing, activation, permutation, or the cold weights
# of the real layer (the groups' sizes vary around the mean: an approximation). The report gives Loom's
# fraction of it and the fraction a 2x-faster-than-PyTorch layer would need; above 100% no implementation on
# these GEMMs can be twice as fast as PyTorch on this machine.
#
# PyTorch runs at its best: its fp32 matmuls on the fastest OPENBLAS_CORETYPE (bench/torch_coretype.sh's
# probe) and with OMP_WAIT_POLICY=passive. Debian's torch runs its own ops on OpenMP threads and its fp32
# matmuls on OpenBLAS's pthreads; with the default (active) policy the OpenMP workers keep spinning on the
# cores OpenBLAS's threads need after every parallel region, and the fp32 MoE block takes ~2.5x as long
# (mixtral-512: ~1,300 ms against ~520 ms; bf16, on oneDNN's OpenMP, is unaffected). Loom keeps the default.
#
# Environment: LOOM_MOE_BIN [build/bench/loom_bench_moe] CEILING_BIN [build/bench/loom_bench_ceiling]
#   PYTHON [/usr/bin/python3] BENCH_THREADS [2]
#   MOE_BENCH_SHAPES MOE_BENCH_PRECISIONS MOE_BENCH_WARMUP MOE_BENCH_STEPS MOE_BENCH_REPEATS
#   MOE_BENCH_OUT [out/moe_bench_latest.md] BENCH_TORCH_CORETYPE [auto] (see bench/torch_coretype.sh)
#   BENCH_TORCH_OMP_WAIT_POLICY [passive] (PyTorch's OMP_WAIT_POLICY; "unset" leaves the environment's)
# Exit status 0 when every run finished (whether the targets PASS or FAIL), 1 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-/usr/bin/python3}"
LOOM_MOE_BIN="${LOOM_MOE_BIN:-$ROOT/build/bench/loom_bench_moe}"
CEILING_BIN="${CEILING_BIN:-$(dirname "$LOOM_MOE_BIN")/loom_bench_ceiling}"
THREADS="${BENCH_THREADS:-2}"
SHAPES="${MOE_BENCH_SHAPES:-mixtral-512 mixtral-2048 fine-2048}"
PRECISIONS="${MOE_BENCH_PRECISIONS:-fp32 bf16}"
WARMUP="${MOE_BENCH_WARMUP:-2}"
STEPS="${MOE_BENCH_STEPS:-5}"
REPEATS="${MOE_BENCH_REPEATS:-1}"
MD_OUT="${MOE_BENCH_OUT:-$ROOT/out/moe_bench_latest.md}"

[[ -x "$CEILING_BIN" ]] ||
  echo "[moe-bench] WARNING: $CEILING_BIN missing (cmake --build build --target loom_bench_ceiling): no GEMM ceiling in the report" >&2
[[ -x "$LOOM_MOE_BIN" ]] ||
  { echo "[moe-bench] ERROR: $LOOM_MOE_BIN not found (cmake --build build --target loom_bench_moe; or set LOOM_MOE_BIN)" >&2; exit 1; }
"$PYTHON" -c "import torch" 2>/dev/null ||
  { echo "[moe-bench] ERROR: $PYTHON cannot import torch (apt-get install python3-torch)" >&2; exit 1; }

shape_args() {  # NAME -> the size flags both programs take
  case "$1" in
    mixtral-512) echo "--tokens 512 --hidden 1024 --ffn 3584 --experts 8 --topk 2" ;;
    mixtral-2048) echo "--tokens 2048 --hidden 1024 --ffn 3584 --experts 8 --topk 2" ;;
    fine-2048) echo "--tokens 2048 --hidden 1024 --ffn 512 --experts 64 --topk 8" ;;
    *) echo "[moe-bench] ERROR: unknown shape '$1' (mixtral-512 | mixtral-2048 | fine-2048)" >&2; return 1 ;;
  esac
}

read -r -d '' REPORT <<'PY' || true
import json, statistics, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
md_path, header = sys.argv[2], sys.argv[3]
runs = list(dict.fromkeys((r["shape"], r["precision"]) for r in rows))

def agg(shape, prec, impl):
    rs = [r for r in rows if r["shape"] == shape and r["precision"] == prec and r["impl"] == impl]
    if not rs or any(r.get("failed") for r in rs):
        return None
    meds = [r["ms"] for r in rs]
    return {"ms": statistics.median(meds), "lo": min(r["ms_min"] for r in rs), "hi": max(r["ms_max"] for r in rs),
            "meds": meds, "gflops": statistics.median(r["gflops"] for r in rs), "rs": rs}

f = lambda x: f"{x:,.1f}"
out = ["| shape | precision | Loom ms | PyTorch ms | Loom GFLOP/s | PyTorch GFLOP/s | speed (PyTorch / Loom) | target >= 2x |",
       "|---|---|---:|---:|---:|---:|---:|---|"]
ceil_rows = []
for shape, prec in runs:
    ce = next((r for r in rows if r["shape"] == shape and r["precision"] == prec and r["impl"] == "ceiling"), None)
    lo, pt = agg(shape, prec, "loom"), agg(shape, prec, "pytorch")
    if ce and not ce.get("failed") and lo and pt:
        need = pt["ms"] / 2
        frac = ce["experts_ms"] / need
        ceil_rows.append(f"| {shape} | {prec} | {ce['rows']} | {f(ce['experts_ms'])} | {ce['experts_ms'] / lo['ms']:.0%} "
                         f"| {f(need)} | {frac:.0%} | {'beyond the ceiling' if frac > 1 else 'within it'} |")
for shape, prec in runs:
    lo, pt = agg(shape, prec, "loom"), agg(shape, prec, "pytorch")
    cell = lambda a: "FAILED" if a is None else f"{f(a['ms'])} ({f(a['lo'])}-{f(a['hi'])})"
    gf = lambda a: "-" if a is None else f(a["gflops"])
    if lo and pt:
        ratio = pt["ms"] / lo["ms"]
        speed, verdict = f"**{ratio:.2f}x**", "PASS" if ratio >= 2.0 else "FAIL"
    else:
        speed, verdict = "-", "-"
    out.append(f"| {shape} | {prec} | {cell(lo)} | {cell(pt)} | {gf(lo)} | {gf(pt)} | {speed} | {verdict} |")
out.append("")
out.append("ms = median of the timed iterations (of the per-run medians when repeated); in brackets the fastest "
           "and slowest single iteration.")
reps = max(len(agg(s, p, "loom")["meds"]) for s, p in runs if agg(s, p, "loom")) if runs else 0
if reps > 1:
    out.append("")
    out.append("Per-run medians (ms), Loom / PyTorch:")
    out.append("")
    for shape, prec in runs:
        lo, pt = agg(shape, prec, "loom"), agg(shape, prec, "pytorch")
        if lo and pt:
            out.append(f"- {shape} {prec}: " + ", ".join(f(x) for x in lo["meds"]) + " / "
                       + ", ".join(f(x) for x in pt["meds"]))
if ceil_rows:
    out += ["", "The experts' GEMM ceiling (E x one expert's six products over the mean group, weights hot; see the script's "
            "header) against Loom and against what 2x PyTorch would take:", "",
            "| shape | precision | rows per expert | expert GEMMs at the ceiling ms | Loom of it | 2x PyTorch needs ms "
            "| 2x needs of the ceiling | |", "|---|---|---:|---:|---:|---:|---:|---|"] + ceil_rows
phases = ["router_fwd", "permute_fwd", "experts_fwd", "unpermute_fwd", "unpermute_bwd", "experts_bwd",
          "permute_bwd", "router_bwd"]
out += ["", "Loom by phase (median ms over the timed iterations; of the first run when repeated):", "",
        "| shape | precision | " + " | ".join(phases) + " |", "|---|---|" + "---:|" * len(phases)]
for shape, prec in runs:
    lo = agg(shape, prec, "loom")
    if lo:
        ph = lo["rs"][0]["phases_ms"]
        out.append(f"| {shape} | {prec} | " + " | ".join(f(ph[p]) for p in phases) + " |")
text = "\n".join("- " + h for h in header.splitlines()) + "\n\n" + "\n".join(out) + "\n"
print("\n" + text)
with open(md_path, "w") as fh:
    fh.write("# Loom vs PyTorch, one MoE layer forward + backward on CPU (latest run)\n\n" + text)
print(f"[moe-bench] markdown written to {md_path}")
PY

# PyTorch's fp32 matmuls use OpenBLAS: run them on the fastest kernel set, or $BENCH_TORCH_CORETYPE.
source "$ROOT/bench/torch_coretype.sh"
pick_torch_coretype moe-bench
TORCH_WAIT="${BENCH_TORCH_OMP_WAIT_POLICY:-passive}"
[[ "$TORCH_WAIT" == unset ]] || TORCH_ENV+=("OMP_WAIT_POLICY=$TORCH_WAIT")

WORK="$(mktemp -d "${TMPDIR:-/tmp}/moe_bench.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
failed=0

# Appends the last JSON line of LOG, tagged with the shape name, to $RESULTS; else a failure record.
record() {  # IMPL SHAPE PREC LOG STATUS
  local line
  line="$(grep '^{' "$4" | tail -n 1 || true)"
  if [[ "$5" == 0 && -n "$line" ]]; then
    "$PYTHON" -c 'import json, sys; r = json.loads(sys.argv[1]); r["shape"] = sys.argv[2]; print(json.dumps(r))' \
      "$line" "$2" | tee -a "$RESULTS"
  else
    echo "[moe-bench] ERROR: $1 $2 $3 failed:" >&2; tail -n 15 "$4" >&2
    echo "{\"shape\": \"$2\", \"precision\": \"$3\", \"impl\": \"$1\", \"failed\": true}" >>"$RESULTS"; failed=1
  fi
}

# The experts' GEMM ceiling of SHAPE in PREC (see the header), one JSON record in $RESULTS.
ceiling() {  # SHAPE PREC --tokens N --hidden C --ffn F --experts E --topk K
  local shape="$1" prec="$2" n c f e k
  shift 2
  while (($#)); do
    case "$1" in --tokens) n="$2" ;; --hidden) c="$2" ;; --ffn) f="$2" ;; --experts) e="$2" ;; --topk) k="$2" ;; esac
    shift 2
  done
  local rows=$(((n * k + e - 1) / e)) dt=f32 log="$WORK/ceiling_${shape}_${prec}.log"
  [[ "$prec" == bf16 ]] && dt=bf16
  echo "[moe-bench] $shape $prec: expert GEMM ceiling, OMP_NUM_THREADS=$THREADS $CEILING_BIN --dtype $dt --batch 1 --seq $rows --hidden $c --ffn $f --glu --layers 1 --heads 8 --vocab 1024 --reps 5"
  if OMP_NUM_THREADS="$THREADS" "$CEILING_BIN" --dtype "$dt" --batch 1 --seq "$rows" --hidden "$c" --ffn "$f" --glu \
      --layers 1 --heads 8 --vocab 1024 --reps 5 >"$log" 2>"$log.table" && grep -q '^{' "$log"; then
    "$PYTHON" -c '
import json, sys
r = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
ms = sum(p["ms"] for p in r["products"] if p["name"].split()[0] in ("fc1", "fc2"))
print(json.dumps({"shape": sys.argv[2], "precision": sys.argv[3], "impl": "ceiling", "rows": int(sys.argv[4]),
                  "experts_ms": ms * int(sys.argv[5])}))' "$log" "$shape" "$prec" "$rows" "$e" | tee -a "$RESULTS"
  else
    echo "[moe-bench] WARNING: the ceiling probe failed for $shape $prec:" >&2; tail -n 5 "$log.table" >&2
  fi
}

for shape in $SHAPES; do
  read -r -a sizes <<<"$(shape_args "$shape")"
  for prec in $PRECISIONS; do
    case "$prec" in
      fp32) loom_prec=(--dtype f32) torch_prec=() ;;
      bf16) loom_prec=(--dtype bf16) torch_prec=(--bf16) ;;
      *) echo "[moe-bench] ERROR: unknown precision '$prec' (fp32 | bf16)" >&2; exit 1 ;;
    esac
    if [[ -x "$CEILING_BIN" ]]; then
      ceiling "$shape" "$prec" "${sizes[@]}"
    fi
    for ((rep = 1; rep <= REPEATS; ++rep)); do
      log="$WORK/loom_${shape}_${prec}_$rep.log"
      echo "[moe-bench] $shape $prec run $rep/$REPEATS: OMP_NUM_THREADS=$THREADS $LOOM_MOE_BIN ${sizes[*]} ${loom_prec[*]} --warmup $WARMUP --steps $STEPS"
      st=0
      OMP_NUM_THREADS="$THREADS" "$LOOM_MOE_BIN" "${sizes[@]}" "${loom_prec[@]}" --warmup "$WARMUP" --steps "$STEPS" \
        >"$log" 2>&1 || st=$?
      record loom "$shape" "$prec" "$log" "$st"
      log="$WORK/pytorch_${shape}_${prec}_$rep.log"
      echo "[moe-bench] $shape $prec run $rep/$REPEATS: ${TORCH_ENV[*]} OMP_NUM_THREADS=$THREADS $PYTHON bench/pytorch_moe.py ${sizes[*]} ${torch_prec[*]} --warmup $WARMUP --steps $STEPS --threads $THREADS"
      st=0
      "${TORCH_ENV[@]}" OMP_NUM_THREADS="$THREADS" "$PYTHON" "$ROOT/bench/pytorch_moe.py" "${sizes[@]}" \
        "${torch_prec[@]}" --warmup "$WARMUP" --steps "$STEPS" --threads "$THREADS" >"$log" 2>&1 || st=$?
      record pytorch "$shape" "$prec" "$log" "$st"
    done
  done
done

cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
header="One MoE layer forward + backward on CPU, fresh random tokens each iteration, $THREADS threads each, $WARMUP warm-up + $STEPS timed iterations x $REPEATS run(s), $(date -u '+%Y-%m-%d %H:%M UTC'); load average before the report: $(cut -d' ' -f1-3 /proc/loadavg)
CPU: ${cpu:-unknown} ($(nproc) cores visible); GFLOP/s = 3 x forward matmul FLOPs (router + both expert GEMMs) / ms
PyTorch $("$PYTHON" -c 'import torch; print(torch.__version__)') (fp32 matmuls on OpenBLAS, OPENBLAS_CORETYPE=$BENCH_TORCH_CORETYPE, OMP_WAIT_POLICY=$TORCH_WAIT; bf16 = torch.autocast cpu/bfloat16 via oneDNN); Loom $LOOM_MOE_BIN (OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-unset})
mixtral-N: N tokens, C 1024, SwiGLU F 3584, E 8, top-2; fine-2048: 2048 tokens, C 1024, SwiGLU F 512, E 64, top-8"
mkdir -p "$(dirname "$MD_OUT")"
"$PYTHON" -c "$REPORT" "$RESULTS" "$MD_OUT" "$header"
exit "$failed"
