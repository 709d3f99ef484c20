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
import json
import math
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def padded_vocab(V, multiple=128):
    # Megatron's --make-vocab-size-divisible-by default (128, TP=1): 50257 -> 50304, as in Loom.
    return ((V + multiple - 1) // multiple) * multiple


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
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bf16", action="store_true",
                   help="forward + loss under torch.autocast('cpu', torch.bfloat16); fp32 params and AdamW")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
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
    model.train()
    Vp = model.Vp
    params = list(model.parameters())  # tied weight appears once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=6e-4, betas=(0.9, 0.95), eps=1e-8)

    precision = "bf16" if args.bf16 else "fp32"
    # Autocast on CPU only covers ops on its lower-precision list, and a torch build may lack the BF16
    # GEMM path; so the first step checks that the model's first linear really ran in BF16 (and in
    # fp32 mode that nothing did) rather than trusting the flag.
    seen_dtype = {}

    def record_dtype(module, inputs, output):  # a forward hook that returns None keeps the output
        seen_dtype.setdefault("out", output.dtype)

    probe = model.blocks[0].attn.qkv if L > 0 else model.lm_head
    hook = probe.register_forward_hook(record_dtype)

    gen = torch.Generator().manual_seed(args.seed)
    times_ms = []
    total = args.warmup + args.steps
    for step in range(total):
        # Mock data: T+1 random tokens per sample, shifted for targets (as --mock-data does).
        tokens = torch.randint(0, V, (B, T + 1), generator=gen)
        idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        t0 = time.perf_counter()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(idx, targets)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()
        ms = (time.perf_counter() - t0) * 1e3
        if step == 0:
            hook.remove()
            want = torch.bfloat16 if args.bf16 else torch.float32
            got = seen_dtype.get("out")
            print(f"precision {precision}: first linear output dtype {got}, loss dtype {loss.dtype}, "
                  f"params {params[0].dtype}, AdamW exp_avg {opt.state[params[0]]['exp_avg'].dtype}",
                  file=sys.stderr, flush=True)
            if got != want:
                sys.exit(f"pytorch_gpt2.py: expected {want} matmul outputs in {precision} mode, got {got}")
        tag = "warmup" if step < args.warmup else "timed"
        print(f"step {step + 1}/{total} ({tag}) loss {loss_v:.4f} grad_norm {float(grad_norm):.4f} "
              f"ms {ms:.1f}", file=sys.stderr, flush=True)
        if step >= args.warmup:
            times_ms.append(ms)

    ms_per_step = statistics.median(times_ms)
    flops = flops_per_step(B, T, L, C, Vp)
    n_params = sum(p.numel() for p in params)
    result = {
        "impl": "pytorch",
        "B": B,
        "T": T,
        "L": L,
        "C": C,
        "NH": NH,
        "V": V,
        "Vp": Vp,
        "params": n_params,
        "threads": args.threads,
        "precision": precision,
        "warmup": args.warmup,
        "steps": args.steps,
        "ms_per_step": round(ms_per_step, 3),
        "tokens_per_s": round(B * T / (ms_per_step / 1e3), 3),
        "gflops": round(flops / (ms_per_step / 1e3) / 1e9, 3),
        # ru_maxrss is KiB on Linux; run_bench.sh uses /usr/bin/time -v for both sides instead.
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch": torch.__version__,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
