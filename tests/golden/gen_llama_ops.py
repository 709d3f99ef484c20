"""PyTorch golden references for the Llama-family ops of the op table (include/loom/backend/ops.h): RMSNorm,
the gated MLP activations (SwiGLU, GeGLU, ReGLU) and rotary position embeddings, checked by
tests/golden/test_golden_llama_ops.cpp against the CPU backend.

Run:  /usr/bin/python3 tests/golden/gen_llama_ops.py      (torch 1.13 + numpy; about a second)
Writes tests/golden/fixtures/ops_llama.safetensors.

Numerics and layout are those of gen_ops.py (whose Writer and helpers this script uses): float32 inputs,
float64 references from exactly those values (torch autograd), stored as float32; "__metadata__" holds the
case list and integer parameters "<case>.<param>"; float parameters the op receives as float (eps) are F32
tensors; every case has its own generator seeded with crc32("llama/<case>"), so regeneration is byte-identical
and adding a case never changes the others.

References (transformers is not installed, so the formulas are written out here):
  - RMSNorm: Llama's x * rsqrt(mean(x^2) + eps) * weight (all in float64 here);
  - GLU: [gate | up] = chunk(fc1 output, 2, dim=-1) as Megatron's fused fc1; out = act(gate) * up with
    act = F.silu, F.gelu(approximate="tanh"), F.relu;
  - RoPE: Hugging Face Llama's apply_rotary_pos_emb, q * cos + rotate_half(q) * sin with cos = cat(freqs,
    freqs).cos(), on the first rotary_dim channels of each q and k head of Megatron's grouped qkv
    (partial rotary as GPT-NeoX/Phi: the rest pass through); interleaved pairs use the GPT-J /
    Megatron --rotary-interleaved form rotate_every_two with cos repeated per pair. Tables
    (max_positions, rotary_dim/2) come from inv_freq = 1 / base^(2i / rotary_dim), angles pos * inv_freq in
    float64, stored as float32 (those float32 values are what both the op and the reference use).
"""
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_ops  # noqa: E402
import safetensors_py as st  # noqa: E402
from gen_ops import f64, leaf, randn  # noqa: E402
from gen_llama_model import apply_rope  # noqa: E402  (HF rotate_half / GPT-J rotate_every_two, partial)


class Writer(gen_ops.Writer):
    def save(self):
        self.meta["cases"] = ",".join(self.cases)
        self.meta["generator"] = "tests/golden/gen_llama_ops.py"
        self.meta["reference"] = "float64 math on the float32 inputs, stored as float32"
        path = os.path.join(gen_ops.FIXTURES, f"ops_{self.family}.safetensors")
        n = st.save(path, self.tensors, self.meta)
        print(f"  {os.path.relpath(path)}: {len(self.cases)} cases, {n / 1024:.1f} KiB")
        return n


def f32_scalar(x):
    """A float parameter as the op receives it (float32), for both sides."""
    return float(np.float32(x))


# ---- RMSNorm (and the fused residual + RMSNorm) -----------------------------------------------------
def gen_rmsnorm(w):
    # C == 1 is forward-only: the input gradient is rstd * w * dout * eps / (x^2 + eps), a cancellation an
    # f32 backward cannot resolve (same reasoning as layernorm in gen_ops.py).
    for name, lead, C, eps in [("rms1", (1,), 8, 1e-5), ("rms5", (5,), 33, 1e-6), ("rms217", (7, 31), 24, 1e-5),
                               ("rms_c1", (3,), 1, 1e-5)]:
        g = w.case(name, op_rmsnorm=1, C=C, backward=C > 1)
        eps = f32_scalar(eps)
        a32 = randn(g, *lead, C, scale=1.5, shift=0.4).to(torch.float32)
        b32 = randn(g, *lead, C, scale=0.7).to(torch.float32)
        x32 = a32 + b32  # the input is a + b rounded to f32 (the test forms it the same way; not stored)
        x = leaf(x32.to(f64))
        weight = leaf(randn(g, C, scale=0.1, shift=1.0))
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        out = x * rstd * weight
        dout = randn(g, *out.shape)
        out.backward(dout)
        for k, v in [("a", a32), ("b", b32), ("weight", weight), ("eps", torch.tensor([eps], dtype=f64)),
                     ("out", out), ("rstd", rstd.squeeze(-1)), ("dout", dout), ("dinp", x.grad),
                     ("dweight", weight.grad)]:
            w.put(name, k, v)


# ---- gated MLP activations --------------------------------------------------------------------------
GLU_ACTS = {"swiglu": (0, F.silu), "geglu": (1, lambda x: F.gelu(x, approximate="tanh")), "reglu": (2, F.relu)}


def gen_glu(w):
    for kind, (kind_id, act) in GLU_ACTS.items():
        for suffix, lead, Ff in [("1", (1,), 1), ("5", (5,), 37), ("217", (7, 31), 5)]:
            name = kind + suffix
            g = w.case(name, op_glu=1, kind=kind_id, F=Ff)
            inp = randn(g, *lead, 2 * Ff, scale=2.5)
            gates = inp.view(-1, 2 * Ff)[:, :Ff]  # a view: writes go into inp
            if gates.numel() == 1:
                # A lone element is judged by its own relative error; keep it away from the far negative tail,
                # where act' cancels in f32 (the tails are covered in the larger cases).
                gates.fill_(0.75)
            if gates.numel() >= 6:  # tails where the sigmoid saturates, and ReLU's kink at exactly 0
                for i, v in enumerate([0.0, -20.0, 20.0, -6.5, 9.25, -0.5]):
                    gates[i // Ff, i % Ff] = v
            inp = leaf(inp)
            gate, up = inp.chunk(2, dim=-1)
            out = act(gate) * up
            dout = randn(g, *out.shape)
            out.backward(dout)
            for k, v in [("inp", inp), ("out", out), ("dout", dout), ("dinp", inp.grad)]:
                w.put(name, k, v)


# ---- rotary position embedding ----------------------------------------------------------------------
def rope_tables(max_pos, rotary_dim, base):
    """(max_pos, rotary_dim/2) cos and sin as float32 values (returned as float64 tensors)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=f64) / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=f64), inv_freq)
    return freqs.cos().to(torch.float32).to(f64), freqs.sin().to(torch.float32).to(f64)


def rope_reference(qkv, cos_t, sin_t, pos, B, T, NH, NKV, HS, rotary_dim, interleaved):
    """qkv (B, T, NKV*(G+2)*HS) in the grouped layout; pos (B, T) int64 indexes the tables."""
    G = NH // NKV
    v5 = qkv.view(B, T, NKV, G + 2, HS)
    cos = cos_t[pos].view(B, T, 1, 1, -1)
    sin = sin_t[pos].view(B, T, 1, 1, -1)
    qk = apply_rope(v5[:, :, :, : G + 1], cos, sin, rotary_dim, interleaved)  # the G q heads and the k head
    return torch.cat((qk, v5[:, :, :, G + 1:]), dim=3).reshape(B, T, -1)


def gen_rope(w):
    # (case, B, T, NH, NKV, HS, rotary_dim, interleaved, base, max_pos, position ids: "t" | "reset")
    for name, B, T, NH, NKV, HS, rd, inter, base, max_pos, ids in [
            ("rope_t1", 1, 1, 1, 1, 4, 4, False, 10000.0, 1, "t"),
            ("rope_mha5", 2, 5, 3, 3, 8, 8, False, 10000.0, 8, "t"),
            ("rope_gqa37_partial", 1, 37, 4, 2, 10, 6, False, 10000.0, 40, "t"),
            ("rope_mqa_interleaved", 2, 7, 3, 1, 8, 4, True, 10000.0, 9, "t"),
            ("rope_llama3_ids", 2, 9, 4, 2, 16, 16, False, 500000.0, 64, "reset"),
            ("rope_interleaved_partial_ids", 1, 11, 2, 1, 12, 8, True, 10000.0, 16, "reset")]:
        g = w.case(name, op_rope=1, B=B, T=T, NH=NH, NKV=NKV, HS=HS, rotary_dim=rd, interleaved=inter,
                   max_pos=max_pos, has_ids=ids != "t")
        cos_t, sin_t = rope_tables(max_pos, rd, base)
        if ids == "t":
            pos = torch.arange(T, dtype=torch.int64).expand(B, T)
        else:  # --reset-position-ids: positions restart at document starts; large ones reach the table's end
            pos = torch.randint(0, max_pos, (B, T), generator=g, dtype=torch.int64)
            pos[0, : min(T, 4)] = torch.arange(min(T, 4))
            pos[-1, -1] = max_pos - 1
        qkv = leaf(randn(g, B, T, NKV * (NH // NKV + 2) * HS, scale=1.3))
        out = rope_reference(qkv, cos_t, sin_t, pos, B, T, NH, NKV, HS, rd, inter)
        dout = randn(g, *out.shape)
        out.backward(dout)
        for k, v in [("cos", cos_t), ("sin", sin_t), ("qkv", qkv), ("out", out), ("dout", dout),
                     ("dqkv", qkv.grad)]:
            w.put(name, k, v)
        if ids != "t":
            w.put(name, "position_ids", pos)


def main():
    torch.set_num_threads(1)  # fixed reduction order -> byte-identical fixtures on regeneration
    os.makedirs(gen_ops.FIXTURES, exist_ok=True)
    print(f"torch {torch.__version__}: writing Llama op fixtures")
    w = Writer("llama")
    gen_rmsnorm(w)
    gen_glu(w)
    gen_rope(w)
    w.save()


if __name__ == "__main__":
    main()
