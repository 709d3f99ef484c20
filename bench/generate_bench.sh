#!/usr/bin/env bash
# Generation-speed benchmark for Llama models on CPU (run by hand): trains a small Llama checkpoint for a
# couple of iterations on random tokens (`loom train --mock-data --save`), then runs `loom generate` greedily
# (--temperature 0) on one prompt with the KV cache and again with --no-kv-cache, each under
# `/usr/bin/time -v`, and prints a markdown table of the tokens/s `loom generate` reports on stderr
# (prefill and decode), the end-to-end rate (new tokens / generation time), peak RSS and the KV-cache
# speedup. Greedy decoding must give the same tokens with and without the cache; the table says whether
# it did. The weights are barely trained (speed does not depend on them).
#
# Models (GEN_BENCH_MODELS, default "tiny 100m"):
#   tiny  configs/llama-tiny.yaml (2 layers, hidden 64, GQA 4/2, vocab 512), --max-position-embeddings 512
#         so that prompt + new tokens fit (RoPE has no position table to grow)
#   100m  a ~100M-class Llama: 12 layers, hidden 768, 12 heads sharing 4 KV heads, SwiGLU 2048,
#         vocab 32000 (Llama 2's), RoPE base 10000, RMSNorm, untied, no biases (125M parameters)
# Prompt: GEN_PROMPT_TOKENS (16) token ids "1 2 ... N" for the NullTokenizer; GEN_NEW_TOKENS (128) new
# tokens; OMP_NUM_THREADS=$BENCH_THREADS (2); fp32 (GEN_BF16=1 adds --bf16 runs).
#
# Environment: LOOM_BIN [build/loom] BENCH_THREADS [2] GEN_BENCH_MODELS GEN_PROMPT_TOKENS GEN_NEW_TOKENS
#   GEN_BF16 [0] GEN_BENCH_OUT [out/generate_bench_latest.md]. Exit status 0 when every run finished.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-/usr/bin/python3}"
LOOM_BIN="${LOOM_BIN:-$ROOT/build/loom}"
THREADS="${BENCH_THREADS:-2}"
MODELS="${GEN_BENCH_MODELS:-tiny 100m}"
NPROMPT="${GEN_PROMPT_TOKENS:-16}"
NNEW="${GEN_NEW_TOKENS:-128}"
MD_OUT="${GEN_BENCH_OUT:-$ROOT/out/generate_bench_latest.md}"
PRECISIONS=(fp32)
[[ "${GEN_BF16:-0}" == 1 ]] && PRECISIONS+=(bf16)

[[ -x "$LOOM_BIN" ]] || { echo "[gen-bench] ERROR: Loom binary not found: $LOOM_BIN (set LOOM_BIN)" >&2; exit 1; }
[[ -x /usr/bin/time ]] || { echo "[gen-bench] ERROR: /usr/bin/time missing (apt-get install time)" >&2; exit 1; }
[[ "$NPROMPT" =~ ^[1-9][0-9]*$ && "$NNEW" =~ ^[1-9][0-9]*$ ]] ||
  { echo "[gen-bench] ERROR: GEN_PROMPT_TOKENS and GEN_NEW_TOKENS must be positive integers" >&2; exit 1; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/gen_bench.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
failed=0
PROMPT="$(seq -s ' ' 1 "$NPROMPT")"

# Parses `loom generate`'s statistics line, e.g.
#   generated 128 tokens for 1 prompt in 0.012 s (KV cache): prefill 8 prompt tokens, 1153.5 tokens/s; decode 26249.6 tokens/s
read -r -d '' HELPER <<'PY' || true
import json, re, sys

def rss_mb(path):
    for line in open(path, errors="replace"):
        if "Maximum resident set size" in line:
            return round(int(line.rsplit(":", 1)[1]) / 1024, 1)
    sys.exit(f"[gen-bench] no 'Maximum resident set size' in {path}")

STATS = re.compile(r"generated (\d+) tokens for (\d+) prompts? in ([0-9.]+) s \(([^)]*)\): prefill (\d+) prompt "
                   r"tokens, ([0-9.]+) tokens/s; decode ([0-9.]+) tokens/s")
LOADED = re.compile(r"loaded .*?\((\d+) layers, hidden (\d+), (\d+) parameters")

def parse(err, timefile, model, prec, mode):
    text = open(err, errors="replace").read()
    m = STATS.search(text)
    if not m:
        sys.exit(f"[gen-bench] no 'generated N tokens ... tokens/s' line in {err}")
    lm = LOADED.search(text)
    n, secs = int(m.group(1)), float(m.group(3))
    return {"model": model, "precision": prec, "mode": mode, "params": int(lm.group(3)) if lm else None,
            "new_tokens": n, "seconds": secs, "prefill_tokens": int(m.group(5)),
            "prefill_tps": float(m.group(6)), "decode_tps": float(m.group(7)),
            "e2e_tps": n / secs if secs > 0 else None, "peak_rss_mb": rss_mb(timefile)}

def report(results, md_path, header):
    rows = [json.loads(l) for l in open(results) if l.strip()]
    f = lambda x, nd=1: "-" if x is None else f"{x:,.{nd}f}"
    cols = ["model", "params", "precision", "generation", "new tokens", "seconds", "prefill tokens/s",
            "decode tokens/s", "end-to-end tokens/s", "peak RSS MB", "KV-cache decode speedup", "same tokens"]
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for key in dict.fromkeys((r["model"], r["precision"]) for r in rows):
        by = {r["mode"]: r for r in rows if (r["model"], r["precision"]) == key}
        kv, nokv = by.get("kv-cache"), by.get("no-kv-cache")
        ok = lambda r: r is not None and not r.get("failed")
        speed = f"{kv['decode_tps'] / nokv['decode_tps']:.1f}x" if ok(kv) and ok(nokv) else "-"
        same = by.get("same_tokens", {}).get("value", "-")
        for mode in ("kv-cache", "no-kv-cache"):
            r = by.get(mode)
            tail = [speed, same] if mode == "kv-cache" else ["", ""]
            if not ok(r):
                out.append("| " + " | ".join([key[0], "-", key[1], mode, "FAILED"] + ["-"] * 5 + tail) + " |")
                continue
            p = r["params"]
            out.append("| " + " | ".join([key[0], "-" if p is None else f"{p / 1e6:,.2f}M", key[1], mode,
                                          str(r["new_tokens"]), f(r["seconds"], 3), f(r["prefill_tps"]),
                                          f(r["decode_tps"]), f(r["e2e_tps"]), f(r["peak_rss_mb"])] + tail) + " |")
    text = "\n".join("- " + h for h in header.splitlines()) + "\n\n" + "\n".join(out) + "\n"
    print("\n" + text)
    with open(md_path, "w") as fh:
        fh.write("# Loom generation speed, Llama on CPU, with and without the KV cache (latest run)\n\n" + text)
    print(f"[gen-bench] markdown written to {md_path}")

def same(a, b, nprompt):
    ta, tb = open(a).read().split()[nprompt:], open(b).read().split()[nprompt:]
    if ta == tb:
        return f"yes ({len(ta)}/{len(ta)})"
    agree = next(i for i in range(min(len(ta), len(tb)) + 1)
                 if i == min(len(ta), len(tb)) or ta[i] != tb[i])
    return f"no: first {agree} of {max(len(ta), len(tb))} equal"

mode = sys.argv[1]
if mode == "same":      # OUT_A OUT_B PROMPT_TOKENS
    print(same(sys.argv[2], sys.argv[3], int(sys.argv[4])))
elif mode == "parse":     # ERR TIMEFILE MODEL PRECISION MODE
    print(json.dumps(parse(*sys.argv[2:7])))
elif mode == "report":  # RESULTS MD HEADER
    report(*sys.argv[2:5])
else:
    sys.exit(f"[gen-bench] unknown helper mode {mode}")
PY
helper() { "$PYTHON" -c "$HELPER" "$@"; }

TRAIN_COMMON=(--mock-data --micro-batch-size 1 --global-batch-size 1 --train-iters 2 --lr 6e-4
  --lr-warmup-iters 0 --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0
  --seed 1234 --no-save-optim)

for model in $MODELS; do
  case "$model" in
    tiny) V=512 train_args=(--config "$ROOT/configs/llama-tiny.yaml" --max-position-embeddings 512) ;;
    100m) V=32000 train_args=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --group-query-attention
            --num-query-groups 4 --ffn-hidden-size 2048 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
            --position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights
            --disable-bias-linear --vocab-size 32000 --make-vocab-size-divisible-by 1 --seq-length 128
            --max-position-embeddings 512) ;;
    *) echo "[gen-bench] ERROR: unknown model '$model' (tiny | 100m)" >&2; exit 1 ;;
  esac
  ckpt="$WORK/ckpt_$model"
  echo "[gen-bench] $model: training 2 iterations and saving to $ckpt"
  echo "  $LOOM_BIN train ${TRAIN_COMMON[*]} ${train_args[*]} --save $ckpt"
  if ! OMP_NUM_THREADS="$THREADS" "$LOOM_BIN" train "${TRAIN_COMMON[@]}" "${train_args[@]}" --save "$ckpt" \
      >"$WORK/train_$model.log" 2>&1; then
    echo "[gen-bench] ERROR: training $model failed:" >&2; tail -n 15 "$WORK/train_$model.log" >&2
    failed=1; continue
  fi
  for prec in "${PRECISIONS[@]}"; do
    prec_args=(); [[ "$prec" == bf16 ]] && prec_args=(--bf16)
    for mode in kv-cache no-kv-cache; do
      mode_args=(); [[ "$mode" == no-kv-cache ]] && mode_args=(--no-kv-cache)
      tag="${model}_${prec}_$mode"
      # NullTokenizer: ids as text, EOD = --vocab-size, so V-1 keeps EOD inside the model's vocabulary.
      gen=("$LOOM_BIN" generate --load "$ckpt" --tokenizer-type NullTokenizer --vocab-size "$((V - 1))"
           --prompt "$PROMPT" --max-new-tokens "$NNEW" --temperature 0
           ${prec_args[@]+"${prec_args[@]}"} ${mode_args[@]+"${mode_args[@]}"})
      echo "[gen-bench] $model $prec $mode: ${gen[*]}"
      if OMP_NUM_THREADS="$THREADS" /usr/bin/time -v -o "$WORK/$tag.time" "${gen[@]}" \
          >"$WORK/$tag.out" 2>"$WORK/$tag.err" &&
         helper parse "$WORK/$tag.err" "$WORK/$tag.time" "$model" "$prec" "$mode" >>"$RESULTS"; then
        tail -n 1 "$RESULTS"
      else
        echo "[gen-bench] ERROR: $tag failed:" >&2; tail -n 10 "$WORK/$tag.err" >&2
        echo "{\"model\": \"$model\", \"precision\": \"$prec\", \"mode\": \"$mode\", \"failed\": true}" >>"$RESULTS"
        failed=1
      fi
    done
    a="$WORK/${model}_${prec}_kv-cache.out" b="$WORK/${model}_${prec}_no-kv-cache.out"
    if [[ -s "$a" && -s "$b" ]]; then
      # In f32 the cached path matches the full forward to ~1e-6, so greedy tokens must agree; in bf16 the
      # two round differently and a barely trained model's near-tied logits may pick another argmax, so
      # there the table reports how many new tokens agree before the first difference and nothing fails.
      same="$(helper same "$a" "$b" "$NPROMPT")"
      if [[ "$same" != yes* ]]; then
        if [[ "$prec" == fp32 ]]; then failed=1
          echo "[gen-bench] ERROR: $model fp32: greedy tokens differ with and without the KV cache ($same)" >&2
        else echo "[gen-bench] note: $model $prec: greedy tokens with and without the KV cache: $same"; fi
      fi
      echo "{\"model\": \"$model\", \"precision\": \"$prec\", \"mode\": \"same_tokens\", \"value\": \"$same\"}" >>"$RESULTS"
    fi
  done
done

cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
header="loom generate, greedy (--temperature 0), 1 prompt of $NPROMPT tokens + $NNEW new tokens, NullTokenizer, $THREADS threads, $(date -u '+%Y-%m-%d %H:%M UTC'); load average: $(cut -d' ' -f1-3 /proc/loadavg)
CPU: ${cpu:-unknown} ($(nproc) cores visible); Loom $LOOM_BIN
tiny = configs/llama-tiny.yaml (max positions 512); 100m = 12 layers, hidden 768, 12 heads / 4 KV heads, SwiGLU 2048, vocab 32000, untied
prefill/decode tokens/s are what loom generate prints; end-to-end = new tokens / generation seconds (model loading excluded)"
mkdir -p "$(dirname "$MD_OUT")"
helper report "$RESULTS" "$MD_OUT" "$header"
exit "$failed"
