#!/usr/bin/env bash
# Llama training-speed benchmark on CPU (run by hand, not by `make bench`): `loom train --mock-data` with
# Megatron's Llama flags against bench/pytorch_llama.py on the same shapes, one process after the other,
# each under `/usr/bin/time -v` so peak RSS is measured the same way for both. Prints a markdown table
# (ms/step, tokens/s, GFLOP/s, peak RSS, Loom/PyTorch ratios) and writes it to $LLAMA_BENCH_OUT.
#
# Runs (LLAMA_BENCH_RUNS, default "tiny-fp32 tiny-bf16 1b-bf16"):
#   tiny-fp32, tiny-bf16  configs/llama-tiny.yaml (loom train --config; 2 layers, hidden 64, GQA 4/2, SwiGLU
#                         176, vocab 512 unpadded, seq 128), micro-batch 4; 2 warm-up + 8 timed iterations
#   1b-lora-bf16          the same 1b model LoRA-fine-tuned (issue 17): Loom --lora-rank 16 --lora-alpha 32 on
#                         linear_qkv linear_proj gate_proj up_proj linear_fc2 against pytorch_llama.py
#                         --lora-rank 16 --base-bf16 (PEFT's LoraLayer on the same five linears, the frozen
#                         base in bf16, adapters fp32 under autocast); with 1b-bf16 in the same run the
#                         report adds LoRA vs full fine-tuning (Loom's step time and peak RSS ratios)
#   tiny-lora-fp32        llama-tiny with the same LoRA adapters (rank 8), fp32
#   1b-bf16               Llama-3.2-1B's layer shape (hidden 2048, 32 heads, 8 KV heads of 64, SwiGLU 8192,
#                         vocab 128256, RoPE base 500000 with Llama 3.1 scaling factor 32, tied embeddings,
#                         RMSNorm eps 1e-5, no biases) with LLAMA_1B_LAYERS layers, micro-batch 1, seq
#                         LLAMA_1B_SEQ, bf16; 1 warm-up + 3 timed iterations
#   1b-gemm-bf16          (not in the default runs) Loom only: the 1b layer shape with pretraining-sized steps
#                         (LLAMA_GEMM_LAYERS 4 layers, micro-batch LLAMA_GEMM_MBS 4 x seq LLAMA_GEMM_SEQ 512,
#                         global batch LLAMA_GEMM_GBS 8: 2 accumulated micro-batches), against its GEMM ceiling
# Every 1b run also times its GEMM ceiling (build/bench/loom_bench_ceiling: the step's matrix products through
# oneDNN directly at the model's shapes, the fastest variant each) and reports the step's fraction of it.
# The published Llama-3.2-1B has 16 layers (1.24B parameters). On a 23 GiB machine Loom trains it
# (peak RSS 20.9 GiB: fp32 master weights + bf16 copy + fp32 grads + AdamW m, v = 18 B/param), but
# PyTorch's autocast run needs ~1 GiB more (18.2 B/param measured at 14 layers) and does not fit, so the
# default keeps 14 of its layers (1.11B parameters; peak RSS Loom 18.0 GiB, PyTorch 18.8 GiB), the
# largest depth both fit. Set LLAMA_1B_LAYERS=16 on a machine with >= 32 GiB.
#
# Both sides: OMP_NUM_THREADS=$BENCH_THREADS (2), random tokens, no dropout (Loom --hidden-dropout 0
# --attention-dropout 0; the reference has none), no evaluation (--eval-iters 0), AdamW (betas 0.9/0.95,
# weight decay 0.1 on matrices only), clip 1.0. PyTorch runs with the fastest OPENBLAS_CORETYPE for its
# fp32 matmuls (a short probe, as bench/run_bench.sh does); its bf16 matmuls go through oneDNN.
# ms/step = median over the timed iterations; tokens/s and GFLOP/s derive from it with one FLOP formula
# (pytorch_llama.py's flops_per_step: forward matmuls x 3, causal attention counted halved).
#
# Environment: LOOM_BIN [build/loom] PYTHON [/usr/bin/python3] BENCH_THREADS [2] LLAMA_BENCH_RUNS
#   LLAMA_1B_LAYERS [14] LLAMA_1B_SEQ [128] LLAMA_1B_STEPS [3] LLAMA_BENCH_OUT [out/llama_bench_latest.md]
#   BENCH_TORCH_CORETYPE [auto] (see bench/torch_coretype.sh)
# Exit status 0 when every run finished, 1 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-/usr/bin/python3}"
LOOM_BIN="${LOOM_BIN:-$ROOT/build/loom}"
THREADS="${BENCH_THREADS:-2}"
RUNS="${LLAMA_BENCH_RUNS:-tiny-fp32 tiny-bf16 1b-bf16}"
L1B="${LLAMA_1B_LAYERS:-14}"
T1B="${LLAMA_1B_SEQ:-128}"
N1B="${LLAMA_1B_STEPS:-3}"
MD_OUT="${LLAMA_BENCH_OUT:-$ROOT/out/llama_bench_latest.md}"

[[ -x "$LOOM_BIN" ]] || { echo "[llama-bench] ERROR: Loom binary not found: $LOOM_BIN (set LOOM_BIN)" >&2; exit 1; }
[[ -x /usr/bin/time ]] || { echo "[llama-bench] ERROR: /usr/bin/time missing (apt-get install time)" >&2; exit 1; }
"$PYTHON" -c "import torch" 2>/dev/null ||
  { echo "[llama-bench] ERROR: $PYTHON cannot import torch (apt-get install python3-torch)" >&2; exit 1; }

read -r -d '' HELPER <<'PY' || true
import json, re, statistics, sys
sys.path.insert(0, sys.argv[1])
from pytorch_llama import flops_per_step  # one FLOP formula for both sides

ITER_RE = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)\s*\|.*?elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)")
PARAMS_RE = re.compile(r"number of parameters on .*?:\s*(\d+)")
LORA_RE = re.compile(r"LoRA: .*?: (\d+) trainable adapter parameters")  # LoRA runs: what trains, as PyTorch counts

def rss_mb(path):
    for line in open(path, errors="replace"):
        if "Maximum resident set size" in line:
            return round(int(line.rsplit(":", 1)[1]) / 1024, 1)
    sys.exit(f"[llama-bench] no 'Maximum resident set size' in {path}")

def loom(log, timefile, warmup, shape):
    times, params = {}, None
    for line in open(log, errors="replace"):
        m = ITER_RE.search(line)
        if m:
            times[int(m.group(1))] = float(m.group(3))
        m = PARAMS_RE.search(line)
        if m and params is None:
            params = int(m.group(1))
        m = LORA_RE.search(line)
        if m:
            params = int(m.group(1))
    timed = [ms for it, ms in sorted(times.items()) if it > warmup]
    if not timed:
        sys.exit(f"[llama-bench] {log}: no timed 'elapsed time per iteration' lines after {warmup} warm-up")
    ms = statistics.median(timed)
    s = shape
    fl = flops_per_step(s["B"], s["T"], s["L"], s["C"], s["NH"], s["NKV"], s["F"], s["Vp"])
    return {"impl": "loom", "params": params, "steps": len(timed), "ms_per_step": ms,
            "tokens_per_s": s["B"] * s["T"] / (ms / 1e3), "gflops": fl / (ms / 1e3) / 1e9,
            "peak_rss_mb": rss_mb(timefile)}

def pytorch(out, timefile):
    last = [l for l in open(out, errors="replace") if l.startswith("{") and '"impl"' in l]
    if not last:
        sys.exit(f"[llama-bench] no JSON result line in {out}")
    r = json.loads(last[-1])
    r["peak_rss_mb"] = rss_mb(timefile)
    return r

def report(results, md_path, header):
    rows = [json.loads(l) for l in open(results) if l.strip()]
    f = lambda x, nd=1: "-" if x is None else f"{x:,.{nd}f}"
    cols = ["run", "shape", "params", "impl", "ms/step", "tokens/s", "GFLOP/s", "of GEMM ceiling", "peak RSS MB",
            "speed (PyTorch ms / Loom ms)", "memory (Loom RSS / PyTorch RSS)"]
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out_notes = []
    for run in dict.fromkeys(r["run"] for r in rows):
        by = {r["impl"]: r for r in rows if r["run"] == run}
        lo, pt, ce = by.get("loom"), by.get("pytorch"), by.get("ceiling")
        ok = lambda r: r is not None and not r.get("failed")
        # The step's GEMMs at oneDNN's best (bench/ceiling/gemm_ceiling.cpp) / the measured step.
        frac = lambda r: f"{100 * ce['ceiling_ms'] / r['ms_per_step']:.1f}%" if ok(ce) else "-"
        speed = f"{pt['ms_per_step'] / lo['ms_per_step']:.2f}x" if ok(lo) and ok(pt) else "-"
        mem = f"{lo['peak_rss_mb'] / pt['peak_rss_mb']:.2f}" if ok(lo) and ok(pt) else "-"
        for name, r in (("loom", lo), ("pytorch", pt)):
            if name == "pytorch" and r is None and ok(lo):
                continue  # a Loom-only run (1b-gemm-bf16)
            tail = [speed, mem] if name == "loom" else ["", ""]
            if not ok(r):
                out.append(f"| {run} | - | - | {name} | FAILED | - | - | - | - | " + " | ".join(tail) + " |")
                continue
            p = r.get("params")
            out.append("| " + " | ".join([run, r["shape"], "-" if p is None else f"{p / 1e6:,.2f}M", name,
                                          f(r["ms_per_step"]), f(r["tokens_per_s"]), f(r["gflops"]), frac(r),
                                          f(r["peak_rss_mb"])] + tail) + " |")
        if ok(ce):
            out_notes.append(f"GEMM ceiling of {run}: {ce['ceiling_ms']:,.1f} ms/step = {ce['ceiling_gflops']:,.1f} GFLOP/s "
                             f"(oneDNN {ce['dtype']}, {ce['threads']} threads, {ce['micro_batches']} micro-batch(es) "
                             "of the probe's products)")
    out += [""] + out_notes if out_notes else []
    # LoRA vs full fine-tuning of the same model on Loom (issue 17: step <= 0.7x, peak memory <= 0.45x).
    for full, lora in (("1b-bf16", "1b-lora-bf16"), ("tiny-fp32", "tiny-lora-fp32")):
        a = next((r for r in rows if r["run"] == full and r["impl"] == "loom" and not r.get("failed")), None)
        b = next((r for r in rows if r["run"] == lora and r["impl"] == "loom" and not r.get("failed")), None)
        if a and b:
            out.append(f"\nLoom LoRA ({lora}) vs full fine-tuning ({full}): step time "
                       f"{b['ms_per_step'] / a['ms_per_step']:.2f}x, peak RSS {b['peak_rss_mb'] / a['peak_rss_mb']:.2f}x")
    text = "\n".join("- " + h for h in header.splitlines()) + "\n\n" + "\n".join(out) + "\n"
    print("\n" + text)
    with open(md_path, "w") as fh:
        fh.write("# Loom vs PyTorch, Llama training speed on CPU (latest run)\n\n" + text)
    print(f"[llama-bench] markdown written to {md_path}")

mode = sys.argv[2]
if mode == "loom":        # LOG TIMEFILE WARMUP SHAPE_JSON RUN
    shape = json.loads(sys.argv[6])
    r = loom(sys.argv[3], sys.argv[4], int(sys.argv[5]), shape)
elif mode == "pytorch":   # OUT TIMEFILE SHAPE_JSON RUN
    shape = json.loads(sys.argv[5])
    r = pytorch(sys.argv[3], sys.argv[4])
    want = "bf16" if sys.argv[-1].endswith("bf16") else "fp32"
    if r.get("precision") != want:  # the run's name promises a precision: hold the reference to it
        sys.exit(f"[llama-bench] {sys.argv[3]}: PyTorch ran in {r.get('precision')}, run {sys.argv[-1]} wants {want}")
elif mode == "ceiling":   # PROBE_OUT MICRO_BATCHES SHAPE_JSON RUN
    shape, micro = json.loads(sys.argv[5]), int(sys.argv[4])
    last = [l for l in open(sys.argv[3]) if l.startswith("{")]
    if not last:
        sys.exit(f"[llama-bench] no JSON line in the GEMM ceiling probe's output {sys.argv[3]}")
    r = json.loads(last[-1])
    s = shape
    want = flops_per_step(s["B"], s["T"], s["L"], s["C"], s["NH"], s["NKV"], s["F"], s["Vp"])
    if r["flop"] * micro != want:
        sys.exit(f"[llama-bench] the ceiling probe counted {r['flop']} x {micro} FLOPs per step, the FLOP formula {want}")
    r.update(impl="ceiling", micro_batches=micro, ceiling_ms=r["ceiling_ms"] * micro, flop=want)
elif mode == "report":    # RESULTS MD HEADER
    report(sys.argv[3], sys.argv[4], sys.argv[5])
    sys.exit(0)
else:
    sys.exit(f"[llama-bench] unknown helper mode {mode}")
r["run"] = sys.argv[-1]
r["shape"] = f"L{shape['L']} C{shape['C']} NH{shape['NH']}/{shape['NKV']} F{shape['F']} V{shape['Vp']}, {shape['B']}x{shape['T']}"
print(json.dumps(r))
PY
helper() { "$PYTHON" -c "$HELPER" "$ROOT/bench" "$@"; }

# PyTorch's fp32 matmuls use OpenBLAS: run them on the fastest kernel set, or $BENCH_TORCH_CORETYPE
# (bench/torch_coretype.sh, shared with run_bench.sh).
source "$ROOT/bench/torch_coretype.sh"
pick_torch_coretype llama-bench

CEILING_BIN="${CEILING_BIN:-$(dirname "$LOOM_BIN")/bench/loom_bench_ceiling}"
[[ -x "$CEILING_BIN" ]] || echo "[llama-bench] WARNING: $CEILING_BIN missing: no GEMM ceiling in the report" >&2
WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama_bench.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
failed=0
COMMON_LOOM=(--mock-data --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 0 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --log-interval 1
  --hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --seed 1234)

# The GEMM ceiling of a run's step (bench/ceiling/gemm_ceiling.cpp): one micro-batch's products through
# oneDNN at the model's shapes, times the micro-batches per step.
run_ceiling() {  # RUN SHAPE_JSON MICRO_BATCH MICRO_BATCHES DTYPE "PROBE ARGS"
  local run="$1" log="$WORK/ceiling_$1.log"
  [[ -x "$CEILING_BIN" ]] || return 0
  local -a args
  read -r -d '' -a args <<<"$6" || true
  echo "[llama-bench] $run: GEMM ceiling ($CEILING_BIN --dtype $5 --batch $3 ${args[*]}) x $4"
  if OMP_NUM_THREADS="$THREADS" "$CEILING_BIN" --dtype "$5" --batch "$3" "${args[@]}" >"$log" 2>"$log.table" &&
     helper ceiling "$log" "$4" "$2" "$run" >>"$RESULTS"; then
    cat "$log.table"
  else
    echo "[llama-bench] ERROR: the GEMM ceiling probe for $run failed:" >&2; tail -n 5 "$log.table" >&2; failed=1
  fi
}

run_pair() {  # RUN WARMUP STEPS SHAPE_JSON "LOOM ARGS" "PYTORCH ARGS" ("-": Loom only)
  local run="$1" w="$2" n="$3" shape="$4" log tf
  local -a loom_args torch_args
  # The argument strings span several lines: read every word, not just the first line.
  read -r -d '' -a loom_args <<<"$5" || true
  read -r -d '' -a torch_args <<<"$6" || true
  echo "[llama-bench] $run: loom ($w warm-up + $n timed, $THREADS threads; MemAvailable $(awk '/MemAvailable/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo))"
  log="$WORK/loom_$run.log" tf="$WORK/loom_$run.time"
  echo "  $LOOM_BIN train ${COMMON_LOOM[*]} ${loom_args[*]} --train-iters $((w + n))"
  if OMP_NUM_THREADS="$THREADS" /usr/bin/time -v -o "$tf" "$LOOM_BIN" train "${COMMON_LOOM[@]}" "${loom_args[@]}" \
      --train-iters "$((w + n))" >"$log" 2>&1 && helper loom "$log" "$tf" "$w" "$shape" "$run" >>"$RESULTS"; then
    tail -n 1 "$RESULTS"
  else
    echo "[llama-bench] ERROR: loom $run failed:" >&2; tail -n 15 "$log" >&2; grep -E "Command (exited|terminated)" "$tf" >&2 || true
    echo "{\"run\": \"$run\", \"impl\": \"loom\", \"failed\": true}" >>"$RESULTS"; failed=1
  fi
  [[ "$6" != "-" ]] || return 0
  echo "[llama-bench] $run: pytorch ($w warm-up + $n timed)"
  log="$WORK/pytorch_$run.log" tf="$WORK/pytorch_$run.time"
  echo "  ${TORCH_ENV[*]} $PYTHON bench/pytorch_llama.py ${torch_args[*]} --warmup $w --steps $n --threads $THREADS"
  if "${TORCH_ENV[@]}" OMP_NUM_THREADS="$THREADS" /usr/bin/time -v -o "$tf" "$PYTHON" "$ROOT/bench/pytorch_llama.py" \
      "${torch_args[@]}" --warmup "$w" --steps "$n" --threads "$THREADS" >"$log" 2>&1 &&
     helper pytorch "$log" "$tf" "$shape" "$run" >>"$RESULTS"; then
    tail -n 1 "$RESULTS"
  else
    echo "[llama-bench] ERROR: pytorch $run failed:" >&2; tail -n 15 "$log" >&2; grep -E "Command (exited|terminated)" "$tf" >&2 || true
    echo "{\"run\": \"$run\", \"impl\": \"pytorch\", \"failed\": true}" >>"$RESULTS"; failed=1
  fi
}

# llama-tiny's shape, spelled out for the PyTorch side (Loom reads the YAML).
TINY_TORCH="--num-layers 2 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 --num-query-groups 2
  --seq-length 128 --rotary-base 10000 --norm-epsilon 1e-5 --vocab-size 512 --make-vocab-size-divisible-by 1
  --micro-batch-size 4"
TINY_SHAPE='{"B": 4, "T": 128, "L": 2, "C": 64, "NH": 4, "NKV": 2, "F": 176, "Vp": 512}'
ONEB_LOOM="--num-layers $L1B --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --position-embedding-type rope --rotary-base 500000
  --use-rope-scaling --rope-scaling-factor 32 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --disable-bias-linear --vocab-size 128256 --seq-length $T1B --max-position-embeddings $T1B
  --micro-batch-size 1 --global-batch-size 1 --bf16"
ONEB_TORCH="--num-layers $L1B --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32
  --num-query-groups 8 --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 32 --norm-epsilon 1e-5
  --vocab-size 128256 --seq-length $T1B --micro-batch-size 1 --tie-embeddings --bf16"
# LoRA on the five linears pytorch_llama.py has (its qkv is fused, gate and up are separate); the rank follows.
LORA_LOOM="--lora-alpha 32 --lora-target-modules linear_qkv linear_proj gate_proj up_proj linear_fc2 --lora-rank"
ONEB_SHAPE="{\"B\": 1, \"T\": $T1B, \"L\": $L1B, \"C\": 2048, \"NH\": 32, \"NKV\": 8, \"F\": 8192, \"Vp\": 128256}"
ONEB_PROBE="--hidden 2048 --ffn 8192 --heads 32 --kv-heads 8 --glu --vocab 128256"
# 1b-gemm-bf16: the 1B layer shape with enough tokens per step for the GEMMs to dominate, as pretraining
# runs it (micro-batch x seq, accumulated): LLAMA_GEMM_LAYERS layers (memory), micro-batch LLAMA_GEMM_MBS,
# seq LLAMA_GEMM_SEQ, global batch LLAMA_GEMM_GBS. Loom only, measured against its GEMM ceiling.
GL="${LLAMA_GEMM_LAYERS:-4}" GMBS="${LLAMA_GEMM_MBS:-4}" GSEQ="${LLAMA_GEMM_SEQ:-512}" GGBS="${LLAMA_GEMM_GBS:-8}"
(( GGBS % GMBS == 0 )) || { echo "[llama-bench] ERROR: LLAMA_GEMM_GBS ($GGBS) must be a multiple of LLAMA_GEMM_MBS ($GMBS)" >&2; exit 1; }
GEMM_LOOM="${ONEB_LOOM//--num-layers $L1B/--num-layers $GL}"
GEMM_LOOM="${GEMM_LOOM//--seq-length $T1B --max-position-embeddings $T1B/--seq-length $GSEQ --max-position-embeddings $GSEQ}"
GEMM_LOOM="${GEMM_LOOM//--micro-batch-size 1 --global-batch-size 1/--micro-batch-size $GMBS --global-batch-size $GGBS}"
GEMM_SHAPE="{\"B\": $GGBS, \"T\": $GSEQ, \"L\": $GL, \"C\": 2048, \"NH\": 32, \"NKV\": 8, \"F\": 8192, \"Vp\": 128256}"

for run in $RUNS; do
  case "$run" in
    tiny-fp32) run_pair "$run" 2 8 "$TINY_SHAPE" \
      "--config $ROOT/configs/llama-tiny.yaml --micro-batch-size 4 --global-batch-size 4" "$TINY_TORCH" ;;
    tiny-bf16) run_pair "$run" 2 8 "$TINY_SHAPE" \
      "--config $ROOT/configs/llama-tiny.yaml --micro-batch-size 4 --global-batch-size 4 --bf16" "$TINY_TORCH --bf16" ;;
    1b-bf16) run_ceiling "$run" "$ONEB_SHAPE" 1 1 bf16 "--seq $T1B --layers $L1B $ONEB_PROBE"
      run_pair "$run" 1 "$N1B" "$ONEB_SHAPE" "$ONEB_LOOM" "$ONEB_TORCH" ;;
    1b-gemm-bf16) run_ceiling "$run" "$GEMM_SHAPE" "$GMBS" "$((GGBS / GMBS))" bf16 "--seq $GSEQ --layers $GL $ONEB_PROBE"
      run_pair "$run" 1 2 "$GEMM_SHAPE" "$GEMM_LOOM" "-" ;;
    1b-lora-bf16) run_pair "$run" 1 "$N1B" "$ONEB_SHAPE" "$ONEB_LOOM $LORA_LOOM 16" "$ONEB_TORCH --lora-rank 16 --base-bf16" ;;
    tiny-lora-fp32) run_pair "$run" 2 8 "$TINY_SHAPE" \
      "--config $ROOT/configs/llama-tiny.yaml --micro-batch-size 4 --global-batch-size 4 $LORA_LOOM 8" \
      "$TINY_TORCH --lora-rank 8" ;;
    *) echo "[llama-bench] ERROR: unknown run '$run' (tiny-fp32 | tiny-bf16 | tiny-lora-fp32 | 1b-bf16 | 1b-lora-bf16 | 1b-gemm-bf16)" >&2
       exit 1 ;;
  esac
done

cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
header="Llama on CPU, random tokens, no dropout, $THREADS threads each, $(date -u '+%Y-%m-%d %H:%M UTC'); load average before the report: $(cut -d' ' -f1-3 /proc/loadavg)
CPU: ${cpu:-unknown} ($(nproc) cores visible); ms/step = median over the timed iterations; GFLOP/s counts full training's FLOPs (3x forward) for the LoRA runs too (a frozen base skips its weight gradients: compare ms/step)
PyTorch $("$PYTHON" -c 'import torch; print(torch.__version__)') (fp32 matmuls on OpenBLAS, OPENBLAS_CORETYPE=$BENCH_TORCH_CORETYPE; bf16 = torch.autocast cpu/bfloat16 via oneDNN); Loom $LOOM_BIN
tiny = configs/llama-tiny.yaml; 1b = Llama-3.2-1B layer shape (meta-llama/Llama-3.2-1B config.json: hidden 2048, 32 heads, 8 KV heads, FFN 8192, vocab 128256, rope_theta 500000, llama3 rope scaling x32, tied embeddings) with $L1B of its 16 layers"
mkdir -p "$(dirname "$MD_OUT")"
helper report "$RESULTS" "$MD_OUT" "$header"
exit "$failed"
