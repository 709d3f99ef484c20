#!/usr/bin/env python3
# Reads what `loom train` wrote (its Megatron log or its --metrics-jsonl file) for scripts/gpu_check.sh.
# Standard library only (runs under any python3).
#
#   parse_loom_log.py timing FILE --warmup W --batch B --seq T --layers L --hidden C --vocab V [--peak TF]
#       ms/iter = median of "elapsed time per iteration (ms)" over iterations > W (log with
#       --log-interval 1); tokens/s, model TFLOP/s and MFU from the formula of `flops`. One JSON line.
#   parse_loom_log.py compare CPU_FILE GPU_FILE [--rtol R]
#       per-iteration "lm loss" of two runs, max relative difference, PASS when every one is within R
#       and both ran the same iterations. One JSON line; a table on stderr.
#       --from-iter K compares only iterations >= K (a resumed run against the straight one); --rtol 0
#       asks for bit-identical losses.
#   parse_loom_log.py falls FILE [--min-drop D]
#       the loss fell: first logged lm loss minus the mean of the last three >= D (default 0.5), all finite.
#   parse_loom_log.py kernels NCU_CSV --out TABLE
#       per-kernel GPU time from `ncu --csv --metrics gpu__time_duration.sum` (kernels grouped by name);
#       the table (largest first) to TABLE, a JSON summary (total, top six shares) on stdout.
#   parse_loom_log.py flops --layers L --hidden C --seq T --vocab V
#       FLOPs per token: 6*N + 12*L*C*T (PaLM appendix B / nanoGPT's estimate_mfu), N = parameters
#       without the position embedding (the tied word embedding counted once, as the LM head). For GPT-2
#       this equals Megatron's 72*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) per sequence up to biases and norms,
#       i.e. the TFLOPs field of Loom's log line.
#   parse_loom_log.py device LOG
#       the "device: ..." line Loom prints at start-up (empty when none).
#
# FILE may be a log (Megatron lines, values rounded as printed) or a metrics JSONL (full precision): a
# file whose first non-blank character is "{" is read as JSONL.

import argparse
import json
import math
import re
import statistics
import sys

ITER_RE = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)\s*\|")
FIELD_RE = re.compile(r"\|\s*([A-Za-z][A-Za-z0-9 ()/_-]*?)\s*:\s*([-+0-9.eE]+|nan|inf|-inf)\s*(?=\|)")


def padded_vocab(V, multiple=128):
    return (V + multiple - 1) // multiple * multiple


def flops_per_token(L, C, T, V):
    Vp = padded_vocab(V)
    N = L * (12 * C * C + 13 * C) + Vp * C + 2 * C
    return 6 * N + 12 * L * C * T, N


def read_iterations(path):
    """{iteration: {field: value}} from a log or a metrics JSONL."""
    with open(path, errors="replace") as f:
        text = f.read()
    out = {}
    if text.lstrip().startswith("{"):
        for line in text.splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run
            if "iteration" in rec:
                out[int(rec["iteration"])] = {k: (math.nan if v is None else v) for k, v in rec.items()}
        return out
    for line in text.splitlines():
        m = ITER_RE.search(line)
        if not m:
            continue
        fields = {k.strip(): float(v) for k, v in FIELD_RE.findall(line + "|")}
        fields["iteration"] = int(m.group(1))
        out[int(m.group(1))] = fields
    return out


def cmd_timing(a):
    its = read_iterations(a.file)
    key = "elapsed time per iteration (ms)"
    timed = [(i, r[key]) for i, r in sorted(its.items()) if i > a.warmup and key in r]
    if not timed:
        print(json.dumps({"ok": False, "error": f"no iterations after warm-up {a.warmup} in {a.file} "
                                                  f"({len(its)} logged)"}))
        return 1
    ms = statistics.median(v for _, v in timed)
    fpt, n = flops_per_token(a.layers, a.hidden, a.seq, a.vocab)
    tokens_per_s = a.batch * a.seq / (ms / 1e3)
    tflops = fpt * tokens_per_s / 1e12
    logged = [r["TFLOPs"] for i, r in its.items() if i > a.warmup and "TFLOPs" in r]
    losses = [r["lm loss"] for _, r in sorted(its.items()) if "lm loss" in r]
    print(json.dumps({
        "ok": True, "iters": len(timed), "warmup": a.warmup, "ms_per_iter": round(ms, 3),
        "ms_min": round(min(v for _, v in timed), 3), "ms_max": round(max(v for _, v in timed), 3),
        "tokens_per_s": round(tokens_per_s, 1), "params_N": n, "flops_per_token": fpt,
        "model_tflops": round(tflops, 2), "mfu": round(tflops / a.peak, 4),
        "loom_logged_tflops": round(statistics.median(logged), 2) if logged else None,
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}))
    return 0


def cmd_compare(a):
    cpu, gpu = read_iterations(a.cpu), read_iterations(a.gpu)
    cpu = {i: r for i, r in cpu.items() if i >= a.from_iter}
    gpu = {i: r for i, r in gpu.items() if i >= a.from_iter}
    key = "lm loss"
    worst, worst_it, rows, problems = 0.0, None, [], []
    its = sorted(set(cpu) | set(gpu))
    for i in its:
        c, g = cpu.get(i, {}).get(key), gpu.get(i, {}).get(key)
        if c is None or g is None:
            problems.append(f"iteration {i} missing from the {'cpu' if c is None else 'gpu'} run")
            continue
        if not (math.isfinite(c) and math.isfinite(g)):
            problems.append(f"iteration {i}: non-finite loss (cpu {c}, gpu {g})")
            continue
        rel = abs(g - c) / max(abs(c), 1e-30)
        rows.append((i, c, g, rel))
        if rel > worst:
            worst, worst_it = rel, i
    if not rows:
        problems.append("no iteration with a loss in both runs")
    print(f"{'iter':>5} {'cpu lm loss':>16} {'gpu lm loss':>16} {'rel diff':>10}", file=sys.stderr)
    for i, c, g, rel in rows:
        flag = "  <-- over tolerance" if rel > a.rtol else ""
        print(f"{i:>5} {c:>16.9g} {g:>16.9g} {rel:>10.2e}{flag}", file=sys.stderr)
    ok = not problems and worst <= a.rtol
    print(json.dumps({"ok": ok, "iters": len(rows), "max_rel_diff": worst, "worst_iter": worst_it,
                      "rtol": a.rtol, "problems": problems[:5]}))
    return 0 if ok else 1


def cmd_falls(a):
    its = read_iterations(a.file)
    losses = [r["lm loss"] for _, r in sorted(its.items()) if "lm loss" in r]
    if len(losses) < 4 or not all(math.isfinite(v) for v in losses):
        print(json.dumps({"ok": False, "error": f"{len(losses)} losses logged, finite: "
                                                  f"{all(math.isfinite(v) for v in losses)}"}))
        return 1
    first, last = losses[0], statistics.fmean(losses[-3:])
    ok = last <= first - a.min_drop
    print(json.dumps({"ok": ok, "first_loss": first, "last3_mean": last, "drop": first - last,
                      "min_drop": a.min_drop, "iters": len(losses)}))
    return 0 if ok else 1


def cmd_kernels(a):
    """ncu --csv --metrics gpu__time_duration.sum output -> time per kernel name, largest first."""
    import csv
    with open(a.file, errors="replace") as f:
        lines = f.read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        print(json.dumps({"ok": False, "error": f"no ncu CSV header in {a.file}"}))
        return 1
    rows = list(csv.DictReader(lines[start:]))
    per = {}
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            ns = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        name = r.get("Kernel Name", "?")
        short = re.sub(r"\(.*", "", name)  # drop the argument list
        short = re.sub(r"^void ", "", short)
        t, n = per.get(short, (0.0, 0))
        per[short] = (t + ns, n + 1)
    total = sum(t for t, _ in per.values())
    top = sorted(per.items(), key=lambda kv: -kv[1][0])
    with open(a.out, "w") as f:
        f.write(f"{'ms':>9} {'share':>6} {'calls':>6}  kernel\n")
        for k, (t, n) in top:
            f.write(f"{t / 1e6:9.3f} {t / total:6.1%} {n:6d}  {k[:150]}\n")
        f.write(f"{total / 1e6:9.3f} {1:6.1%} {sum(n for _, n in per.values()):6d}  total\n")
    print(json.dumps({"ok": bool(per), "total_ms": round(total / 1e6, 3), "kernels": sum(n for _, n in per.values()),
                      "top": [[k[:60], round(t / total, 3)] for k, (t, n) in top[:6]]}))
    return 0


def cmd_flops(a):
    fpt, n = flops_per_token(a.layers, a.hidden, a.seq, a.vocab)
    print(json.dumps({"flops_per_token": fpt, "params_N": n, "padded_vocab": padded_vocab(a.vocab)}))
    return 0


def cmd_device(a):
    with open(a.log, errors="replace") as f:
        for line in f:
            if line.startswith("device: "):
                print(line[len("device: "):].strip())
                return 0
    return 0


def main():
    ap = argparse.ArgumentParser(description="read loom train logs for scripts/gpu_check.sh")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model_args(p):
        p.add_argument("--layers", type=int, required=True)
        p.add_argument("--hidden", type=int, required=True)
        p.add_argument("--seq", type=int, required=True)
        p.add_argument("--vocab", type=int, required=True)

    p = sub.add_parser("timing")
    p.add_argument("file")
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--peak", type=float, default=989.4, help="dense BF16 peak TFLOP/s (H100 SXM)")
    model_args(p)
    p = sub.add_parser("compare")
    p.add_argument("cpu")
    p.add_argument("gpu")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--from-iter", type=int, default=0, help="compare only iterations >= this one")
    p = sub.add_parser("falls")
    p.add_argument("file")
    p.add_argument("--min-drop", type=float, default=0.5)
    p = sub.add_parser("kernels")
    p.add_argument("file")
    p.add_argument("--out", required=True, help="table: ms, share, calls, kernel")
    p = sub.add_parser("flops")
    model_args(p)
    p = sub.add_parser("device")
    p.add_argument("log")
    a = ap.parse_args()
    return {"timing": cmd_timing, "compare": cmd_compare, "falls": cmd_falls, "kernels": cmd_kernels, "flops": cmd_flops, "device": cmd_device}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
