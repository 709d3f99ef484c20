#!/usr/bin/python3
"""Distributed-training benchmark on CPU ranks (mpirun on one machine): prints markdown tables for
bench/RESULTS.md.

  1. memory per rank for ZeRO stages 0/1/2/3 (what `loom train` reports it allocated, its bucket buffers,
     its max resident set) against `loom calc` with the same flags;
  2. communication volume per iteration per parallel mode (what the printing rank's communicators counted,
     `--timing-log-level 2`) against the analytic volume;
  3. exposed communication time: the time blocked waiting for data-parallel reductions and parameter
     gathers with and without --overlap-grad-reduce / --overlap-param-gather.

Usage: /usr/bin/python3 bench/dist_bench.py [path/to/loom] [--quick]
"""
import os
import re
import subprocess
import sys
import time

LOOM = next((a for a in sys.argv[1:] if not a.startswith("--")), "build/loom")
QUICK = "--quick" in sys.argv
MPI = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-x", "OMP_NUM_THREADS=1"]


def run(np_, args):
    cmd = (MPI + ["-np", str(np_)] if np_ > 1 else []) + [LOOM] + args
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit("failed: " + " ".join(cmd) + "\n" + r.stdout[-3000:] + r.stderr[-3000:])
    return r.stdout, time.time() - t0


def flags(s):
    return s.split()


# ---------------------------------------------------------------------------------------------------
# 1. Memory per rank, ZeRO 0/1/2/3
# ---------------------------------------------------------------------------------------------------
MEM_MODEL = ("--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 128 "
             "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 8 --lr 1e-4 "
             "--mock-data --vocab-size 50257 --eval-iters 0 --log-interval 2 --train-iters 2")
STRATEGIES = [("ZeRO-0 (no_shard)", ""), ("ZeRO-1 (optim)", "--use-distributed-optimizer"),
              ("ZeRO-2 (optim_grads)", "--data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"),
              ("ZeRO-3 (optim_grads_params)",
               "--data-parallel-sharding-strategy optim_grads_params --overlap-grad-reduce")]


def calc_states(extra, np_):
    out, _ = run(1, ["calc"] + flags(MEM_MODEL) + flags(extra) + ["--num-gpus", str(np_)])
    assert "data-parallel sharding" in out or not extra, out
    vals = {}
    for key in ("weights", "gradients", "optimizer state", "model states"):
        m = re.search(r"^\s*" + key + r":\s+([\d,]+) B", out, re.M)
        vals[key] = int(m.group(1).replace(",", "")) if m else None
    return vals, out


def memory_table(np_=4, precision="--bf16"):
    rows = []
    for name, extra in STRATEGIES:
        extra = (extra + " " + precision).strip()
        out, secs = run(np_, ["train"] + flags(MEM_MODEL) + flags(extra))
        states = int(re.search(r"model states (\d+) bytes", out).group(1))
        p = int(re.search(r"model parallel rank \(0, 0\): (\d+)", out).group(1))
        buf = re.search(r"ZeRO bucket buffers \(MB\) \| max allocated: ([\d.]+)", out)
        rss = float(re.search(r"max resident: ([\d.]+)", out).group(1))
        calc, _ = calc_states(extra, np_)
        rows.append((name, p, states, calc["model states"], float(buf.group(1)) if buf else 0.0, rss))
    label = precision.lstrip("-").upper() or "FP32"
    print(f"\n### Memory per rank, DP{np_}, {label} (GPT 8x512, vocab 50257: parameters per rank below)\n")
    print("| strategy | params/rank | model states (train) | model states (calc) | train − calc | "
          "B/param | bucket buffers peak MB | max RSS MB (printing rank) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, p, st, ca, buf, rss in rows:
        diff = st - ca if ca is not None else "n/a"
        print(f"| {name} | {p:,} | {st:,} | {ca:,} | {diff} | {st / p:.2f} | {buf:.1f} | {rss:.0f} |")


# ---------------------------------------------------------------------------------------------------
# 2. Communication volume per iteration per parallel mode
# ---------------------------------------------------------------------------------------------------
L, H, HEADS, S, B, V = 4, 256, 8, 256, 2, 1024
COMM_MODEL = (f"--num-layers {L} --hidden-size {H} --num-attention-heads {HEADS} --seq-length {S} "
              f"--max-position-embeddings {S} --micro-batch-size {B} --global-batch-size 8 --lr 1e-4 "
              f"--mock-data --vocab-size {V} --make-vocab-size-divisible-by 128 --eval-iters 0 --bf16 "
              "--train-iters 3 --log-interval 3 --timing-log-level 2")
C = 2  # bf16 activations / parameters


def comm_block(out):
    """{(group, op): (calls, MB, ms)} from the last 'communication on rank' block."""
    blocks = out.split("communication on rank")
    res = {}
    for line in blocks[-1].splitlines()[1:]:
        m = re.match(r"\s+(.+) (\w+): ([\d.]+) \| ([\d.]+) \| ([\d.]+)$", line)
        if not m:
            break
        res[(m.group(1), m.group(2))] = (float(m.group(3)), float(m.group(4)), float(m.group(5)))
    return res


def timer(out, name):
    m = re.findall(r"^\s+" + name + r" \.+: \(([\d.]+), ([\d.]+)\)", out, re.M)
    return float(m[-1][1]) if m else 0.0


def params_per_rank(out):
    return int(re.search(r"model parallel rank \(\d+, \d+\): (\d+)", out).group(1))


MB = 1048576.0


def comm_table():
    bsh = B * S * H * C  # one activation tensor of a micro-batch, bytes
    cases = [
        ("DP2", 2, "", lambda p, nmb: {("data-parallel (with context-parallel)", "all_reduce"): 4 * p}),
        ("DP2 ZeRO-1", 2, "--use-distributed-optimizer",
         lambda p, nmb: {("data-parallel (with context-parallel)", "reduce_scatter"): 4 * p,
                         ("data-parallel (with context-parallel)", "all_gather"): C * p}),
        ("DP2 ZeRO-2", 2, "--data-parallel-sharding-strategy optim_grads",
         lambda p, nmb: {("data-parallel (with context-parallel)", "reduce_scatter"): nmb * 4 * p,
                         ("data-parallel (with context-parallel)", "all_gather"): C * p}),
        # Forward and backward gather every unit once per micro-batch, and the tied head gathers the
        # embedding unit (word + position embeddings) again in both.
        ("DP2 ZeRO-3", 2, "--data-parallel-sharding-strategy optim_grads_params",
         lambda p, nmb: {("data-parallel (with context-parallel)", "reduce_scatter"): nmb * 4 * p,
                         ("data-parallel (with context-parallel)", "all_gather"):
                             nmb * 2 * C * (p + (EMB_ROWS + S) * H)}),
        # 2 all-reduces per layer forward (attention, MLP outputs), 2 backward (their input gradients),
        # the vocab-parallel embedding's output and the output layer's input gradient; the vocab-parallel
        # cross-entropy adds 2 small f32 all-reduces: the max (B·S values), then the sum of exponentials and
        # the target logit together (2·B·S values).
        ("TP2", 2, "--tensor-model-parallel-size 2",
         lambda p, nmb: {("tensor-model-parallel", "all_reduce"): nmb * ((4 * L + 2) * bsh + 3 * B * S * 4)}),
        # Each all-reduce becomes a reduce-scatter (forward: after row-parallel layers and the embedding;
        # backward: column-parallel input gradients) with a matching all-gather, and backward all-gathers
        # every column-parallel input once more for its weight gradient (as Megatron, which does not keep
        # the gathered input): 2 per layer + the output layer.
        ("TP2+SP", 2, "--tensor-model-parallel-size 2 --sequence-parallel",
         lambda p, nmb: {("tensor-model-parallel", "reduce_scatter"): nmb * (4 * L + 2) * bsh,
                         ("tensor-model-parallel", "all_gather"): nmb * (6 * L + 3) * bsh}),
        # The last stage receives every micro-batch's activations and sends their gradients back; the tied
        # word embedding's gradient is summed once per step between the first and the last stage (f32).
        ("PP2", 2, "--pipeline-model-parallel-size 2",
         lambda p, nmb: {("pipeline-model-parallel", "recv"): nmb * bsh,
                         ("pipeline-model-parallel", "send"): nmb * bsh,
                         ("embedding", "all_reduce"): EMB_ROWS * H * 4}),
        # Ring attention, per layer and micro-batch: forward sends its K/V block (compute dtype) CP-1 times;
        # backward sends it again CP-1 times and the f32 dK/dV block CP times (the last step returns it to
        # its owner). The data-parallel reduction runs over DP x CP.
        ("CP2", 2, "--context-parallel-size 2",
         lambda p, nmb: {("context-parallel", "send"): nmb * L * cp_layer_bytes(2),
                         ("context-parallel", "recv"): nmb * L * cp_layer_bytes(2),
                         ("data-parallel (with context-parallel)", "all_reduce"): 4 * p}),
    ]
    print(f"\n### Communication per iteration on the printing (last) rank — GPT {L}x{H}, {HEADS} heads, "
          f"s={S}, b={B}, global batch 8, BF16\n")
    print("| layout | group | op | calls/iter | measured MB/iter | analytic MB/iter | ms waiting/iter |")
    print("|---|---|---|---:|---:|---:|---:|")
    results = {}
    for name, np_, extra, analytic in cases:
        out, _ = run(np_, ["train"] + flags(COMM_MODEL) + flags(extra))
        p = params_per_rank(out)
        dp = 2 if name.startswith("DP2") else 1
        nmb = 8 // (B * dp)
        want = analytic(p, nmb) if analytic else {}
        stats = comm_block(out)
        results[name] = (stats, out)
        for (g, op), (calls, mb, ms) in sorted(stats.items()):
            if op == "all_reduce_scalar":
                continue
            a = want.get((g, op))
            print(f"| {name} | {g} | {op} | {calls:.0f} | {mb:.3f} | "
                  f"{'%.3f' % (a / MB) if a is not None else '—'} | {ms:.1f} |")
    return results


EMB_ROWS = 1024  # the padded vocabulary (1024 is a multiple of 128)


def cp_layer_bytes(cp):
    kv = B * (S // cp) * 2 * H  # K and V of this rank's tokens (no GQA in this model)
    return 2 * (cp - 1) * kv * C + cp * kv * 4


# ---------------------------------------------------------------------------------------------------
# 3. Exposed communication time with and without overlap
# ---------------------------------------------------------------------------------------------------
def overlap_table(reps=3):
    model = COMM_MODEL.replace("--train-iters 3 --log-interval 3", "--train-iters 20 --log-interval 20")
    cases = [("DP2 no_shard", ""), ("DP2 no_shard", "--overlap-grad-reduce"),
             ("DP2 ZeRO-1", "--use-distributed-optimizer"),
             ("DP2 ZeRO-1", "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"),
             ("DP2 ZeRO-3", "--data-parallel-sharding-strategy optim_grads_params"),
             ("DP2 ZeRO-3", "--data-parallel-sharding-strategy optim_grads_params --overlap-grad-reduce "
                            "--overlap-param-gather")]
    print(f"\n### Exposed data-parallel communication (ms per iteration on the printing rank, median of {reps} "
          "runs of 20 iterations; --ddp-bucket-size 200000: several buckets)\n")
    print("| layout | overlap flags | ms waiting in DP reductions | ms waiting in parameter gathers | "
          "grads-all-reduce timer (max over ranks) | elapsed ms/iter |")
    print("|---|---|---:|---:|---:|---:|")
    g = "data-parallel (with context-parallel)"
    for name, extra in cases:
        cols = []
        for _ in range(reps):
            out, _ = run(2, ["train"] + flags(model) + flags(extra) + ["--ddp-bucket-size", "200000"])
            st = comm_block(out)
            red = sum(v[2] for (gg, op), v in st.items() if gg == g and op in ("all_reduce", "reduce_scatter"))
            gat = sum(v[2] for (gg, op), v in st.items() if gg == g and op == "all_gather")
            el = float(re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", out)[-1])
            cols.append((red, gat, timer(out, "grads-all-reduce"), el))
        med = [sorted(c[i] for c in cols)[reps // 2] for i in range(4)]
        shown = " ".join(f for f in extra.split() if f.startswith("--overlap")) or "—"
        print(f"| {name} | {shown} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} | {med[3]:.1f} |")


if __name__ == "__main__":
    print(f"loom: {LOOM}; machine: {os.cpu_count()} cores; ranks are OpenMPI processes with 1 thread each")
    memory_table(4, "--bf16")
    memory_table(4, "")
    comm_table()
    overlap_table()
