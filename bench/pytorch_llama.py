#!/usr/bin/env python3
# PyTorch reference for the Llama training-speed benchmark (bench/llama_bench.sh): a Llama-architecture
# decoder trained on random tokens on CPU, fp32 or (--bf16) BF16 mixed precision, built to match what
# `loom train --mock-data` does with Megatron's Llama flags step for step (same architecture, optimizer and
# clipping), so that ms/step and peak RSS compare one to one. Plain torch 1.13 (/usr/bin/python3), no
# transformers; the model is written out from Hugging Face's LlamaModel the way
# tests/golden/gen_llama_model.py does.
#
# Invariants kept equal to Loom's Llama (--normalization RMSNorm --swiglu --position-embedding-type rope
# --group-query-attention --disable-bias-linear): pre-norm blocks with RMSNorm x * rsqrt(mean(x^2) + eps) * w,
# RoPE on every query/key channel with rotate_half pairs (c, c + HS/2) and an optional Llama 3.1 frequency
# scaling (--use-rope-scaling: low/high frequency factors 1 and 4, original context 8192, as Loom),
# grouped-query attention by repeat_kv, attention as explicit matmuls + causal mask + softmax (torch 1.13
# has no scaled_dot_product_attention), SwiGLU MLP down(silu(gate(x)) * up(x)), no biases, an untied
# lm_head unless --tie-embeddings (Llama 3.2 1B/3B tie), vocabulary padded to a multiple of
# --make-vocab-size-divisible-by with the loss over the first V logits only, AdamW with weight decay on
# 2-D tensors only, clip by global norm 1.0.
# --bf16 is PyTorch's standard CPU mixed-precision recipe, as in bench/pytorch_gpt2.py: forward and loss
# under torch.autocast("cpu", bfloat16), backward outside it, parameters, gradients and AdamW state fp32.
# --lora-rank R: LoRA fine-tuning written the way Hugging Face PEFT's LoraLayer does it (issue 17's
# comparison): every nn.Linear of the blocks (the fused qkv, proj, gate, up, down) is frozen and gets a
# lora_A (R x in, Kaiming-uniform) / lora_B (out x R, zero) pair behind nn.Dropout(--lora-dropout), the
# update scaled by --lora-alpha / R; embeddings, norms and lm_head are frozen too; AdamW sees the adapters
# only. --base-bf16 stores the frozen base in BF16 (PEFT on a model loaded with torch_dtype=bfloat16),
# the adapters stay fp32 under autocast.
# Prints one JSON line on stdout at the end (the keys of pytorch_gpt2.py's plus NKV, HS, F, tied);
# per-step progress goes to stderr.

import argparse
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from pytorch_bench_common import add_run_args, check_run_args, padded_vocab, print_result, train_and_time


def rope_inv_freq(HS, base, scaling_factor):
    """1 / base^(2i/HS); with scaling_factor > 0, Llama 3.1's rope_type "llama3" rescaling."""
    inv = 1.0 / (base ** (torch.arange(0, HS, 2, dtype=torch.float64) / HS))
    if scaling_factor <= 0:
        return inv
    low_freq_factor, high_freq_factor, old_context = 1.0, 4.0, 8192.0
    low_wavelen, high_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = (1 - smooth) * inv / scaling_factor + smooth * inv
    return torch.where(wavelen > low_wavelen, inv / scaling_factor,
                       torch.where(wavelen < high_wavelen, inv, mid))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, C, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(C))

    def forward(self, x):
        # Normalise in fp32 whatever the input dtype (what Loom and HF's LlamaRMSNorm do).
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)) * self.weight


class Attention(nn.Module):
    def __init__(self, C, NH, NKV, HS):
        super().__init__()
        self.NH, self.NKV, self.HS = NH, NKV, HS
        # One fused projection, as Loom's linear_qkv (one GEMM); the split order does not affect speed.
        self.qkv = nn.Linear(C, (NH + 2 * NKV) * HS, bias=False)
        self.proj = nn.Linear(NH * HS, C, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        NH, NKV, HS = self.NH, self.NKV, self.HS
        q, k, v = self.qkv(x).split([NH * HS, NKV * HS, NKV * HS], dim=2)
        q = q.view(B, T, NH, HS).transpose(1, 2)  # (B, NH, T, HS)
        k = k.view(B, T, NKV, HS).transpose(1, 2)  # (B, NKV, T, HS)
        v = v.view(B, T, NKV, HS).transpose(1, 2)
        # Tables cast to the activations' dtype so RoPE does not promote BF16 q/k back to fp32.
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if NKV != NH:  # repeat_kv: query head h = g*(NH/NKV) + j reads key/value head g
            k = k.repeat_interleave(NH // NKV, dim=1)
            v = v.repeat_interleave(NH // NKV, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))  # (B, NH, T, T)
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, NH, T, HS)
        y = y.transpose(1, 2).contiguous().view(B, T, NH * HS)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, C, FF):
        super().__init__()
        self.gate = nn.Linear(C, FF, bias=False)
        self.up = nn.Linear(C, FF, bias=False)
        self.down = nn.Linear(FF, C, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, C, NH, NKV, HS, FF, eps):
        super().__init__()
        self.input_norm = RMSNorm(C, eps)
        self.attn = Attention(C, NH, NKV, HS)
        self.post_attention_norm = RMSNorm(C, eps)
        self.mlp = MLP(C, FF)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.input_norm(x), cos, sin, mask)
        x = x + self.mlp(self.post_attention_norm(x))
        return x


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        C, NH, NKV = a.hidden_size, a.num_attention_heads, a.num_query_groups
        HS = C // NH
        self.V = a.vocab_size
        self.Vp = padded_vocab(a.vocab_size, a.make_vocab_size_divisible_by)
        self.embed = nn.Embedding(self.Vp, C)
        self.blocks = nn.ModuleList([Block(C, NH, NKV, HS, a.ffn_hidden_size, a.norm_epsilon)
                                     for _ in range(a.num_layers)])
        self.final_norm = RMSNorm(C, a.norm_epsilon)
        self.lm_head = nn.Linear(C, self.Vp, bias=False)
        if a.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # cos/sin tables for positions 0..seq-1 (float64 math, stored fp32), as Loom's RoPE tables.
        inv = rope_inv_freq(HS, a.rotary_base, a.rope_scaling_factor if a.use_rope_scaling else 0.0)
        freqs = torch.outer(torch.arange(a.seq_length, dtype=torch.float64), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)
        T = a.seq_length
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool)).view(1, 1, T, T)
        self.register_buffer("mask", mask, persistent=False)
        # Megatron's init: N(0, std) for every matrix, the residual outputs (proj, down) with std/sqrt(2L).
        std = a.init_method_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                s = std / math.sqrt(2 * a.num_layers) if name.endswith(("proj.weight", "down.weight")) else std
                nn.init.normal_(p, mean=0.0, std=s)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.embed(idx)
        cos, sin, mask = self.cos[:T], self.sin[:T], self.mask[:, :, :T, :T]
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        logits = self.lm_head(self.final_norm(x))  # (B, T, Vp)
        # Padded rows are never targets and must not enter the softmax normaliser.
        logits = logits[..., : self.V]
        return F.cross_entropy(logits.reshape(-1, self.V), targets.reshape(-1))


class LoraLinear(nn.Module):
    """PEFT's LoraLayer around a frozen nn.Linear: base(x) + lora_B(lora_A(dropout(x))) * alpha / r."""

    def __init__(self, base, r, alpha, dropout):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def add_lora(model, r, alpha, dropout, base_bf16):
    for p in model.parameters():
        p.requires_grad_(False)
    if base_bf16:
        model.to(torch.bfloat16)
    for block in model.blocks:
        for owner, name in ((block.attn, "qkv"), (block.attn, "proj"), (block.mlp, "gate"), (block.mlp, "up"),
                            (block.mlp, "down")):
            setattr(owner, name, LoraLinear(getattr(owner, name), r, alpha, dropout))


def flops_per_step(B, T, L, C, NH, NKV, FF, Vp):
    # Shared with bench/llama_bench.sh (Loom side): forward matmul FLOPs times 3 (forward + 2x backward);
    # the attention core is counted causally halved, as bench/pytorch_gpt2.py does.
    HS = C // NH
    weights = C * (NH + 2 * NKV) * HS + NH * HS * C + 3 * C * FF
    layer_matmuls = 2 * B * T * L * weights
    lm_head = 2 * B * T * C * Vp
    attention = 2 * B * L * T * T * NH * HS
    return 3 * (layer_matmuls + lm_head + attention)


def parse_args(argv):
    p = argparse.ArgumentParser(description="PyTorch Llama CPU training benchmark (Loom reference)")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads (default: --num-attention-heads, i.e. no grouping)")
    p.add_argument("--ffn-hidden-size", type=int, default=176)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--rotary-base", type=float, default=10000.0)
    p.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.1 RoPE frequency scaling")
    p.add_argument("--rope-scaling-factor", type=float, default=8.0)
    p.add_argument("--norm-epsilon", type=float, default=1e-5)
    p.add_argument("--init-method-std", type=float, default=0.02)
    p.add_argument("--tie-embeddings", action="store_true",
                   help="lm_head shares the word embedding (Llama 3.2 1B/3B); default untied")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA fine-tuning with adapters of this rank (PEFT-style)")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--base-bf16", action="store_true", help="with --lora-rank: keep the frozen base in bf16")
    add_run_args(p)
    a = p.parse_args(argv)
    if a.lora_rank < 0:
        p.error(f"--lora-rank must be >= 0, got {a.lora_rank}")
    if a.base_bf16 and not (a.lora_rank and a.bf16):
        p.error("--base-bf16 needs --lora-rank and --bf16")
    if a.num_query_groups is None:
        a.num_query_groups = a.num_attention_heads
    check_run_args(p, a)
    if a.hidden_size % a.num_attention_heads:
        p.error(f"--hidden-size {a.hidden_size} must be divisible by --num-attention-heads "
                f"{a.num_attention_heads}")
    if (a.hidden_size // a.num_attention_heads) % 2:
        p.error(f"RoPE needs an even head size, got {a.hidden_size // a.num_attention_heads}")
    if a.num_query_groups < 1 or a.num_attention_heads % a.num_query_groups:
        p.error(f"--num-attention-heads {a.num_attention_heads} must be a multiple of --num-query-groups "
                f"{a.num_query_groups}")
    if a.make_vocab_size_divisible_by < 1:
        p.error(f"--make-vocab-size-divisible-by must be >= 1, got {a.make_vocab_size_divisible_by}")
    return a


def main(argv):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    B, T = args.micro_batch_size, args.seq_length
    L, C, NH, NKV = args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups
    V, FF = args.vocab_size, args.ffn_hidden_size

    model = Llama(args)
    Vp = model.Vp
    if args.lora_rank:
        add_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.base_bf16)
    probe = model.blocks[0].attn.qkv if L > 0 else model.lm_head
    ms_per_step, params = train_and_time(model, probe, args, B, T, V, "pytorch_llama.py")
    shape = {"B": B, "T": T, "L": L, "C": C, "NH": NH, "NKV": NKV, "HS": C // NH, "F": FF, "V": V, "Vp": Vp,
             "tied": bool(args.tie_embeddings), "lora_rank": args.lora_rank}
    print_result(shape, args, B, T, ms_per_step, flops_per_step(B, T, L, C, NH, NKV, FF, Vp), params)


if __name__ == "__main__":
    main(sys.argv[1:])
