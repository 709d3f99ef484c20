#!/usr/bin/env python3
# PyTorch reference for the training-speed benchmark: GPT-2 trained on random tokens on CPU, fp32 or
# (--bf16) BF16 mixed precision, built to match what `loom train --mock-data` does step for step (same architecture, same optimizer,
# same clipping) so that ms/step and peak RSS can be compared one to one. Run with Debian's torch 1.13
# (/usr/bin/python3) and OPENBLAS_CORETYPE unset; bench/run_bench.sh does both.
#
# Invariants kept equal to Loom: pre-LN blocks, LayerNorm eps 1e-5, attention written as explicit
# matmuls + causal mask + softmax (torch 1.13 has no scaled_dot_product_attention), GeLU tanh, vocab
# padded to a multiple of 128 with the loss taken over the first V logits only, output tied to the word
# embedding, AdamW with weight decay on 2-D tensors only, clip by global norm 1.0.
# --bf16 is PyTorch's standard CPU mixed-precision recipe, the counterpart of `loom train --bf16`: forward
# and loss under torch.autocast("cpu", bfloat16) (matmuls/linears in BF16; LayerNorm, the fp32 residual
# stream and cross-entropy stay fp32 by autocast's own policy), backward outside autocast, parameters,
# gradients and AdamW state fp32. No loss scaling: BF16 has fp32's exponent range.
# Prints one JSON line on stdout at the end; per-step progress goes to stderr.

import argparse
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from pytorch_bench_common import add_run_args, check_run_args, padded_vocab, print_result, train_and_time


class CausalSelfAttention(nn.Module):
    def __init__(self, C, NH, max_T):
        super().__init__()
        assert C % NH == 0, f"hidden size {C} must be divisible by heads {NH}"
        self.NH = NH
        self.qkv = nn.Linear(C, 3 * C, bias=True)
        self.proj = nn.Linear(C, C, bias=True)
        mask = torch.tril(torch.ones(max_T, max_T, dtype=torch.bool)).view(1, 1, max_T, max_T)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        HS = C // self.NH
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.NH, HS).transpose(1, 2)  # (B, NH, T, HS)
        k = k.view(B, T, self.NH, HS).transpose(1, 2)
        v = v.view(B, T, self.NH, HS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))  # (B, NH, T, T)
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, NH, T, HS)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.fc = nn.Linear(C, 4 * C, bias=True)
        self.proj = nn.Linear(4 * C, C, bias=True)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C, NH, max_T):
        super().__init__()
        self.ln1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = CausalSelfAttention(C, NH, max_T)
        self.ln2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(self, L, C, NH, V, max_T):
        super().__init__()
        self.V = V
        self.Vp = padded_vocab(V)
        self.wte = nn.Embedding(self.Vp, C)
        self.wpe = nn.Embedding(max_T, C)
        self.blocks = nn.ModuleList([Block(C, NH, max_T) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C, eps=1e-5)
        self.lm_head = nn.Linear(C, self.Vp, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        # GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2L).
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, Vp)
        # Padded rows are never targets and must not enter the softmax normaliser.
        logits = logits[..., : self.V]
        return F.cross_entropy(logits.reshape(-1, self.V), targets.reshape(-1))


def flops_per_step(B, T, L, C, Vp):
    # Shared with bench/run_bench.sh (Loom side): forward matmul FLOPs times 3 (fwd + 2x bwd).
    layer_matmuls = 2 * B * T * (12 * L * C * C)
    lm_head = 2 * B * T * C * Vp
    attention = 2 * B * L * T * T * C
    return 3 * (layer_matmuls + lm_head + attention)


def parse_args(argv):
    p = argparse.ArgumentParser(description="PyTorch GPT-2 CPU training benchmark (Loom reference)")
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-attention-heads", type=int, default=12)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=50257)
    add_run_args(p)
    args = p.parse_args(argv)
    check_run_args(p, args)
    if args.seq_length > args.max_position_embeddings:
        p.error(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                f"{args.max_position_embeddings}")
    return args


def main(argv):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    B, T = args.micro_batch_size, args.seq_length
    L, C, NH, V = args.num_layers, args.hidden_size, args.num_attention_heads, args.vocab_size

    model = GPT(L, C, NH, V, args.max_position_embeddings)
    Vp = model.Vp
    probe = model.blocks[0].attn.qkv if L > 0 else model.lm_head
    ms_per_step, params = train_and_time(model, probe, args, B, T, V, "pytorch_gpt2.py")
    shape = {"B": B, "T": T, "L": L, "C": C, "NH": NH, "V": V, "Vp": Vp}
    print_result(shape, args, B, T, ms_per_step, flops_per_step(B, T, L, C, Vp), params)


if __name__ == "__main__":
    main(sys.argv[1:])
