# The PyTorch reference of bench/moe_bench.sh: forward + backward of one sparse MoE block written the way
# Hugging Face's Mixtral block is (an independent implementation, not HF's code): gate Linear(C, E, no
# bias), softmax in f32, top-k, renormalise, a one-hot expert mask, then per expert: the tokens routed to
# it (torch.where on the mask), the expert MLP w2(silu(w1 x) * w3 x) (or w2(gelu_tanh(w1 x)) with --gelu),
# times the routing weight, index_add_ into the output. Backward by autograd from a fixed random dy
# (y.backward(dy)), with x requiring grad so the input gradient of both paths (experts and gate) is
# computed, as loom_bench_moe does. Parameter gradients are dropped (set to None) between iterations,
# outside the clock.
# Every iteration routes fresh random tokens x ~ N(0, 1) (generated before the clock starts); weights
# N(0, 0.02). --bf16: forward under torch.autocast("cpu", torch.bfloat16) (the linears in BF16 through
# oneDNN, routing softmax in f32, as HF casts it), backward outside it; parameters and gradients f32.
# Prints per-iteration times on stderr and one JSON line on stdout (keys as loom_bench_moe's).

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


class Expert(torch.nn.Module):
    def __init__(self, C, Fh, gated):
        super().__init__()
        self.gated = gated
        self.w1 = torch.nn.Linear(C, Fh, bias=False)
        self.w2 = torch.nn.Linear(Fh, C, bias=False)
        self.w3 = torch.nn.Linear(C, Fh, bias=False) if gated else None

    def forward(self, x):
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class SparseMoeBlock(torch.nn.Module):
    def __init__(self, C, Fh, E, k, gated):
        super().__init__()
        self.E, self.k = E, k
        self.gate = torch.nn.Linear(C, E, bias=False)
        self.experts = torch.nn.ModuleList(Expert(C, Fh, gated) for _ in range(E))

    def forward(self, x):  # x (N, C)
        N, C = x.shape
        logits = self.gate(x)  # (N, E)
        weights = F.softmax(logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros((N, C), dtype=x.dtype, device=x.device)
        mask = F.one_hot(chosen, num_classes=self.E).permute(2, 1, 0)  # (E, k, N)
        for e in range(self.E):
            slot, tokens = torch.where(mask[e])
            if tokens.numel() == 0:
                continue
            h = self.experts[e](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, h.to(x.dtype))
        return out, chosen


def main():
    p = argparse.ArgumentParser(description="forward + backward of one HF-Mixtral-style sparse MoE block")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3584)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--gelu", action="store_true", help="GeLU (tanh) experts instead of SwiGLU")
    p.add_argument("--bf16", action="store_true", help="forward under CPU autocast to bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args()
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if not 2 <= a.topk <= a.experts:
        p.error("--topk must be in [2, experts]")

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    N, C, Fh, E, k = a.tokens, a.hidden, a.ffn, a.experts, a.topk
    block = SparseMoeBlock(C, Fh, E, k, not a.gelu)
    with torch.no_grad():
        for w in block.parameters():
            w.normal_(0.0, 0.02)
    gen = torch.Generator().manual_seed(a.seed)
    dy = torch.randn(N, C, generator=gen)
    precision = "bf16" if a.bf16 else "fp32"

    times, group_ranges = [], []
    for it in range(a.warmup + a.steps):
        x = torch.randn(N, C, generator=gen).requires_grad_(True)
        t0 = time.perf_counter()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=a.bf16):
            y, chosen = block(x)
        y.backward(dy.to(y.dtype))
        ms = (time.perf_counter() - t0) * 1e3
        counts = torch.bincount(chosen.flatten(), minlength=E)
        if it == 0:
            with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=a.bf16):
                h = block.experts[0].w1(x[:4].detach())
            want = torch.bfloat16 if a.bf16 else torch.float32
            print(f"precision {precision}: expert linear output dtype {h.dtype}, y {y.dtype}, "
                  f"dx {x.grad.dtype}, grads {block.gate.weight.grad.dtype}", file=sys.stderr, flush=True)
            if h.dtype != want:
                sys.exit(f"pytorch_moe.py: expected {want} matmul outputs in {precision} mode, got {h.dtype}")
        block.zero_grad(set_to_none=True)
        timed = it >= a.warmup
        print(f"iter {it + 1}/{a.warmup + a.steps} ({'timed' if timed else 'warmup'}) ms {ms:.1f}  "
              f"groups {int(counts.min())}..{int(counts.max())} rows", file=sys.stderr, flush=True)
        if timed:
            times.append(ms)

    M = N * k
    f1 = Fh if a.gelu else 2 * Fh
    flops = 3.0 * (2.0 * N * C * E + 2.0 * M * C * (f1 + Fh))
    ms_med = statistics.median(times)
    print(json.dumps({
        "impl": "pytorch", "N": N, "C": C, "F": Fh, "E": E, "topk": k, "act": "gelu" if a.gelu else "swiglu",
        "precision": precision, "threads": a.threads, "warmup": a.warmup, "steps": a.steps,
        "ms": round(ms_med, 3), "ms_min": round(min(times), 3), "ms_max": round(max(times), 3),
        "gflops": round(flops / (ms_med / 1e3) / 1e9, 3), "torch": torch.__version__,
    }), flush=True)


if __name__ == "__main__":
    main()
