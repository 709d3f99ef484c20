"""PyTorch golden references for the op table (include/loom/backend/ops.h), checked by
tests/golden/test_golden_ops.cpp against the CPU backend.

Run:  /usr/bin/python3 tests/golden/gen_ops.py      (torch 1.13 + numpy; about a second)
Writes tests/golden/fixtures/ops_<family>.safetensors, one file per op family.

Numerics: inputs are float32 (what the op sees); references are computed in float64 from exactly those
float32 values, with torch autograd (or, for attention, an explicit masked softmax) as the reference
math, then rounded once to float32 for storage. The storage rounding (2^-24 relative) is far below the
test tolerances (>= 1e-6 relative to the largest reference magnitude), and float32 keeps the fixtures
small (all op files together ~0.7 MB).

Layout of every file: `__metadata__` holds "cases" (comma-separated case names) and per-case integer
parameters as "<case>.<param>"; tensors are "<case>.<name>". Float parameters the op receives as
float (scales, learning rates) are stored as F32 tensors so both sides use the identical value.

Determinism: each case draws from its own torch.Generator seeded with crc32("<file>/<case>"), and all
math runs single-threaded, so regenerating reproduces the files byte for byte and adding a case never
changes the others.
"""
import math
import os
import sys
import zlib

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_py as st  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
f64 = torch.float64


class Writer:
    """Collects one fixture file's cases."""

    def __init__(self, family):
        self.family, self.tensors, self.meta, self.cases = family, {}, {}, []

    def case(self, name, **params):
        self.cases.append(name)
        for k, v in params.items():
            self.meta[f"{name}.{k}"] = str(int(v))
        return torch.Generator().manual_seed(zlib.crc32(f"{self.family}/{name}".encode()))

    def put(self, case, name, t):
        t = t.detach()
        if t.dtype in (torch.float64, torch.float32):
            a = t.to(torch.float32).contiguous().numpy()
        elif t.dtype in (torch.int32, torch.int64):
            a = t.to(torch.int32).contiguous().numpy()
        else:
            raise TypeError(t.dtype)
        self.tensors[f"{case}.{name}"] = a

    def save(self):
        self.meta["cases"] = ",".join(self.cases)
        self.meta["generator"] = "tests/golden/gen_ops.py"
        self.meta["reference"] = "float64 math on the float32 inputs, stored as float32"
        path = os.path.join(FIXTURES, f"ops_{self.family}.safetensors")
        n = st.save(path, self.tensors, self.meta)
        print(f"  {os.path.relpath(path)}: {len(self.cases)} cases, {n / 1024:.1f} KiB")
        return n


def randn(g, *shape, scale=1.0, shift=0.0):
    """float32 sample, returned as the float64 tensor of exactly those float32 values."""
    return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale + shift).to(torch.float32).to(f64)


def f32(x):
    """Rounds a float64 tensor to float32 values (kept as float64) after arithmetic on inputs."""
    return x.to(torch.float32).to(f64)


def leaf(x):
    return x.clone().requires_grad_(True)


# ---- matmul: out = inp W^T + b; dinp = dout W; dW += dout^T inp; db += colsum(dout) ----------------
def gen_matmul():
    w = Writer("matmul")
    # (case, leading dims of inp, K, N, has bias)
    for name, lead, K, N, bias in [("m1", (1,), 1, 1, True), ("m5", (5,), 7, 3, True),
                                   ("m217", (7, 31), 20, 16, True), ("nobias", (5,), 9, 6, False)]:
        g = w.case(name, K=K, N=N, bias=bias)
        inp, W = leaf(randn(g, *lead, K)), leaf(randn(g, N, K, scale=0.5))
        b = leaf(randn(g, N, scale=0.3)) if bias else None
        out = F.linear(inp, W, b)
        dout = randn(g, *out.shape)
        out.backward(dout)
        for k, v in [("inp", inp), ("weight", W), ("dout", dout), ("out", out), ("dinp", inp.grad),
                     ("dweight", W.grad)]:
            w.put(name, k, v)
        if bias:
            w.put(name, "bias", b)
            w.put(name, "dbias", b.grad)
    return w.save()


# ---- embedding: out = wte[tok] + wpe[t]; dwte[tok] += dout; dwpe[t] += sum_b dout ---------------------
def gen_embedding():
    w = Writer("embedding")
    # (case, B, T, V, C, maxpos or 0 for no position table)
    for name, B, T, V, C, maxpos in [("e1", 1, 1, 3, 4, 1), ("e5", 3, 5, 7, 5, 8), ("e217", 7, 31, 217, 12, 40),
                                     ("nowpe", 2, 5, 11, 6, 0)]:
        g = w.case(name, B=B, T=T, V=V, C=C, maxpos=maxpos)
        tok = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
        tok[0, 0] = V - 1  # the last row of the table is reachable
        if B * T > 2:
            tok.view(-1)[-1] = tok.view(-1)[1]  # a repeated token: its gradient rows must add up
        wte = leaf(randn(g, V, C))
        out = F.embedding(tok, wte)
        if maxpos:
            wpe = leaf(randn(g, maxpos, C, scale=0.5))
            out = out + wpe[:T].unsqueeze(0)
        dout = randn(g, B, T, C)
        out.backward(dout)
        for k, v in [("tokens", tok), ("wte", wte), ("out", out), ("dout", dout), ("dwte", wte.grad)]:
            w.put(name, k, v)
        if maxpos:
            w.put(name, "wpe", wpe)
            w.put(name, "dwpe", wpe.grad)
    return w.save()


# ---- layernorm (and the fused residual + layernorm) -----------------------------------------------
def gen_layernorm():
    w = Writer("layernorm")
    eps = 1e-5
    # C == 1 is forward-only: there the true input gradient is exactly 0 and what an f32 backward
    # returns is rounding noise amplified by rstd = 1/sqrt(eps) ~ 316, not something to compare.
    for name, lead, C in [("ln1", (1,), 8), ("ln5", (5,), 33), ("ln217", (7, 31), 24), ("c1", (3,), 1)]:
        g = w.case(name, C=C, backward=C > 1)
        a32 = randn(g, *lead, C, scale=1.5, shift=0.4).to(torch.float32)
        b32 = randn(g, *lead, C, scale=0.7).to(torch.float32)
        x32 = a32 + b32  # the input is a + b rounded to f32 (the test forms it the same way; not stored)
        x = leaf(x32.to(f64))
        weight, bias = leaf(randn(g, C, scale=0.1, shift=1.0)), leaf(randn(g, C, scale=0.1))
        out = F.layer_norm(x, (C,), weight, bias, eps)
        mean = x.detach().mean(-1)
        rstd = 1.0 / torch.sqrt(x.detach().var(-1, unbiased=False) + eps)
        dout = randn(g, *out.shape)
        out.backward(dout)
        for k, v in [("a", a32), ("b", b32), ("weight", weight), ("bias", bias), ("out", out),
                     ("mean", mean), ("rstd", rstd), ("dout", dout), ("dinp", x.grad), ("dweight", weight.grad),
                     ("dbias", bias.grad)]:
            w.put(name, k, v)
    return w.save()


# ---- elementwise: gelu (tanh), residual, bias add / bias grad, sum of squares --------------------------
def gen_elementwise():
    w = Writer("elementwise")
    for name, shape in [("g1", (1,)), ("g5", (5,)), ("g217", (7, 31, 3))]:
        g = w.case(name, op_gelu=1)
        x = randn(g, *shape, scale=2.5)
        if x.numel() == 1:
            # A lone element is judged by its own relative error; keep it out of the x << 0 region where
            # gelu' = 0.5 (1 + tanh(u)) + ... cancels in f32 (that region is covered in the larger cases).
            x.fill_(0.75)
        if x.numel() >= 5:  # the tails, where tanh saturates and the cubic term dominates
            x.view(-1)[:5] = torch.tensor([0.0, -20.0, 20.0, -6.5, 9.25], dtype=f64)
        x = leaf(x)
        out = F.gelu(x, approximate="tanh")
        dout = randn(g, *shape)
        out.backward(dout)
        for k, v in [("inp", x), ("out", out), ("dout", dout), ("dinp", x.grad)]:
            w.put(name, k, v)
    for name, shape in [("r1", (1,)), ("r5", (5,)), ("r217", (7, 31, 3))]:
        g = w.case(name, op_residual=1)
        a, b = randn(g, *shape), randn(g, *shape, scale=3.0)
        for k, v in [("a", a), ("b", b), ("out", a + b)]:
            w.put(name, k, v)
    for name, N, C in [("b1", 1, 1), ("b5", 5, 3), ("b217", 217, 13)]:
        g = w.case(name, op_bias=1, N=N, C=C)
        x, bias, dout = randn(g, N, C), randn(g, C), randn(g, N, C)
        for k, v in [("x", x), ("bias", bias), ("out", x + bias), ("dout", dout), ("dbias", dout.sum(0))]:
            w.put(name, k, v)
    for name, n in [("s1", 1), ("s5", 5), ("s217", 217 * 37)]:
        g = w.case(name, op_sumsq=1)
        x = randn(g, n, scale=2.0)
        # f64 result; stored as an F32 pair (hi, lo) whose sum is the value to ~2^-48 relative.
        s = float((x * x).sum())
        hi = np.float32(s)
        lo = np.float32(s - float(hi))
        w.put(name, "x", x)
        w.put(name, "sumsq_hi_lo", torch.tensor([float(hi), float(lo)], dtype=f64))
    return w.save()


# ---- attention core (grouped qkv layout, causal, optional sliding window) ----------------------------
def attention_reference(qkv, B, T, NH, NKV, HS, window):
    """Explicit masked softmax in float64. qkv (B, T, NKV*(G+2)*HS), grouped per query group."""
    G = NH // NKV
    v5 = qkv.view(B, T, NKV, G + 2, HS)
    q = v5[:, :, :, :G].reshape(B, T, NH, HS).permute(0, 2, 1, 3)               # (B, NH, T, HS)
    k = v5[:, :, :, G].repeat_interleave(G, dim=2).permute(0, 2, 1, 3)           # head h uses group h//G
    v = v5[:, :, :, G + 1].repeat_interleave(G, dim=2).permute(0, 2, 1, 3)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(HS))                        # (B, NH, T, T)
    i = torch.arange(T).view(T, 1)
    j = torch.arange(T).view(1, T)
    visible = j <= i
    if window > 0:
        visible = visible & (j > i - window)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                             # (B, NH, T)
    p = torch.softmax(s, dim=-1)
    out = (p @ v).permute(0, 2, 1, 3).reshape(B, T, NH * HS)
    return out, lse


def gen_attention():
    w = Writer("attention")
    # (case, B, T, NH, NKV, HS, window (-1: none))
    for name, B, T, NH, NKV, HS, window in [
            ("t1", 1, 1, 1, 1, 4, -1), ("mha5", 2, 5, 3, 3, 8, -1), ("mqa5", 1, 5, 3, 1, 5, -1),
            ("gqa37", 2, 37, 4, 2, 8, -1), ("mha217", 1, 217, 2, 2, 8, -1), ("gqa217", 1, 217, 2, 1, 8, -1),
            ("window67", 1, 67, 2, 1, 8, 5)]:
        g = w.case(name, B=B, T=T, NH=NH, NKV=NKV, HS=HS, window=window)
        qkv = leaf(randn(g, B, T, NKV * (NH // NKV + 2) * HS, scale=1.3))
        out, lse = attention_reference(qkv, B, T, NH, NKV, HS, window)
        dout = randn(g, *out.shape)
        out.backward(dout)
        for k, v in [("qkv", qkv), ("out", out), ("lse", lse), ("dout", dout), ("dqkv", qkv.grad)]:
            w.put(name, k, v)
    return w.save()


# ---- cross-entropy over the first V of Vp columns, loss mask, in-place dlogits ------------------------
def gen_cross_entropy():
    w = Writer("cross_entropy")
    # (case, N, Vp, V, mask kind, backward)
    for name, N, Vp, V, mask_kind, backward in [
            ("ce1", 1, 8, 5, "none", True), ("ce5", 5, 64, 50, "fractional", True),
            ("ce217", 217, 64, 50, "binary", True), ("fwd_only", 5, 16, 13, "binary", False)]:
        g = w.case(name, N=N, Vp=Vp, V=V, has_mask=mask_kind != "none")
        logits = randn(g, N, Vp, scale=3.0)
        # Padded columns hold large values: any use of them would change every loss and gradient.
        logits[:, V:] = f32(25.0 + randn(g, N, Vp - V))
        targets = torch.randint(0, V, (N,), generator=g, dtype=torch.int64)
        targets[0] = V - 1
        if mask_kind == "none":
            mask = torch.ones(N, dtype=f64)
        elif mask_kind == "binary":
            mask = (torch.rand(N, generator=g, dtype=f64) < 0.8).to(f64)
            mask[-1] = 0.0
        else:
            mask = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0][:N], dtype=f64)
        scale = float(np.float32(1.0 / max(float(mask.sum()), 1.0))) if backward else 0.0
        x = leaf(logits)
        losses = F.cross_entropy(x[:, :V], targets, reduction="none")
        (losses * mask * scale).sum().backward()
        for k, v in [("logits", logits), ("targets", targets), ("losses", losses), ("dlogits", x.grad),
                     ("scale", torch.tensor([scale], dtype=f64))]:
            w.put(name, k, v)
        if mask_kind != "none":
            w.put(name, "mask", mask)
    return w.save()


# ---- AdamW: several steps of torch.optim.AdamW (decoupled weight decay) -------------------------------
def gen_adamw():
    w = Writer("adamw")
    # (case, N, steps, (beta1, beta2), weight decay, grad_scale, zero_grad); eps 1e-8 throughout.
    # "hyper" stores [beta1, beta2, eps, weight_decay, grad_scale] (as float32, what the op receives).
    for name, N, steps, betas, wd, grad_scale, zero_grad in [
            ("a1", 1, 3, (0.9, 0.999), 0.0, 1.0, False), ("a217", 217, 6, (0.9, 0.95), 0.1, 1.0, False),
            ("scaled5", 5, 4, (0.8, 0.99), 0.05, 0.5, True)]:
        g = w.case(name, N=N, steps=steps, zero_grad=zero_grad)
        p0 = randn(g, N, scale=0.5)
        grads = randn(g, steps, N, scale=0.3)
        grads[1] = f32(grads[1] * 1e-3)  # a tiny-gradient step, where eps matters
        lrs = torch.tensor([np.float32(1e-2 * (0.5 + 0.3 * k)) for k in range(steps)], dtype=f64)
        # torch gets the values as written (Python floats, as Megatron passes them); the op receives
        # them as float and must reproduce that: with beta2 = 0.999 the f32 rounding of beta2 alone
        # changes 1 - beta2, and so v, by 1.3e-5 relative.
        hyper = torch.tensor([betas[0], betas[1], 1e-8, wd, grad_scale], dtype=f64)
        p = p0.clone().requires_grad_(True)
        opt = torch.optim.AdamW([p], lr=float(lrs[0]), betas=betas, eps=1e-8, weight_decay=wd)
        params_after = []
        for k in range(steps):
            for group in opt.param_groups:
                group["lr"] = float(lrs[k])
            p.grad = grads[k] * grad_scale
            opt.step()
            params_after.append(p.detach().clone())
        state = opt.state[p]
        for k, v in [("param0", p0), ("grads", grads), ("lrs", lrs), ("hyper", hyper),
                     ("params", torch.stack(params_after)), ("m", state["exp_avg"]), ("v", state["exp_avg_sq"])]:
            w.put(name, k, v)
    return w.save()


def main():
    torch.set_num_threads(1)  # fixed reduction order -> byte-identical fixtures on regeneration
    os.makedirs(FIXTURES, exist_ok=True)
    print(f"torch {torch.__version__}: writing op fixtures")
    total = sum(gen() for gen in (gen_matmul, gen_embedding, gen_layernorm, gen_elementwise, gen_attention,
                                  gen_cross_entropy, gen_adamw))
    print(f"  total {total / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
