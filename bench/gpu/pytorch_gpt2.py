#!/usr/bin/env python3
# GPU reference for Loom's training-speed figures: GPT-2 (nanoGPT-style) trained on synthetic tokens in
# plain PyTorch the way a practitioner would run it on an H100 today: BF16 autocast, torch.compile,
# F.scaled_dot_product_attention (flash / cuDNN kernels), fused AdamW. scripts/gpu_check.sh runs it next
# to `loom train --mock-data --bf16` with the same model, batch and optimizer, and compares tokens/s.
#
# Kept equal to Loom's GPT (so both sides do the same work): pre-LN blocks, LayerNorm eps 1e-5, fused
# qkv Linear(C, 3C) with bias, causal attention, GeLU (tanh), MLP 4C, final LayerNorm, output tied to the
# word embedding, vocabulary padded to a multiple of 128 with the loss over the first V logits only, no
# dropout, AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on 2-D tensors only), clip by global norm
# 1.0, zero_grad(set_to_none=True). FP32 parameters, gradients and AdamW state (autocast runs the matmuls
# in BF16), as in Loom's --bf16 (which keeps FP32 masters and main grads).
#
# ms/iter is the median of the timed iterations (the --warmup ones, which include compilation, are
# dropped), each closed by a device synchronize; tokens/s = batch * seq / ms/iter. The last line of stdout
# is always "pytorch tokens/s: X ms/iter: Y" (what gpu_check.sh parses); details go before it, per-step
# progress to stderr. Exits 3 on CUDA out-of-memory (the caller may retry with a smaller batch).
#
# Also runs on the CPU (device auto picks the CPU when no GPU is visible), with --no-compile on torch
# versions without torch.compile / scaled_dot_product_attention (Debian's 1.13), for checking the
# model code on a machine without a GPU:
#   env -u OPENBLAS_CORETYPE /usr/bin/python3 bench/gpu/pytorch_gpt2.py --layers 2 --hidden 64 --heads 4 \
#       --seq 32 --batch 2 --vocab 1000 --iters 3 --warmup 1 --no-compile --dtype fp32

import argparse
import inspect
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HAVE_SDPA = hasattr(F, "scaled_dot_product_attention")


class CausalSelfAttention(nn.Module):
    def __init__(self, C, NH, max_T, use_sdpa):
        super().__init__()
        assert C % NH == 0, f"hidden size {C} must be divisible by heads {NH}"
        self.NH = NH
        self.use_sdpa = use_sdpa
        self.qkv = nn.Linear(C, 3 * C, bias=True)
        self.proj = nn.Linear(C, C, bias=True)
        if not use_sdpa:  # explicit-matmul fallback (old torch only): needs the mask
            mask = torch.tril(torch.ones(max_T, max_T, dtype=torch.bool)).view(1, 1, max_T, max_T)
            self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        HS = C // self.NH
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.NH, HS).transpose(1, 2)  # (B, NH, T, HS)
        k = k.view(B, T, self.NH, HS).transpose(1, 2)
        v = v.view(B, T, self.NH, HS).transpose(1, 2)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
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
    def __init__(self, C, NH, max_T, use_sdpa):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = CausalSelfAttention(C, NH, max_T, use_sdpa)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, L, C, NH, V, Vp, max_T, use_sdpa):
        super().__init__()
        self.V = V
        self.wte = nn.Embedding(Vp, C)
        self.wpe = nn.Embedding(max_T, C)
        self.blocks = nn.ModuleList([Block(C, NH, max_T, use_sdpa) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C, eps=1e-5)
        # Megatron/Loom init: N(0, 0.02), output projections N(0, 0.02/sqrt(2L)), zero biases.
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output layer, (B, T, Vp)
        # Padded logits are not part of the loss (as in Loom); cross_entropy runs in FP32 under autocast.
        return F.cross_entropy(logits[..., : self.V].reshape(-1, self.V).float(), targets.reshape(-1))


def padded_vocab(V, multiple=128):
    return (V + multiple - 1) // multiple * multiple


def non_embedding_matmul_flops_per_token(L, C, Vp, T):
    # 6 * N (forward + backward of every matmul weight, the tied LM head counted once) + attention
    # scores and values 12 * L * C * T (PaLM's / nanoGPT's estimate_mfu). N leaves out the position
    # embedding (a lookup, no matmul); biases and norms are included (they are ~0.1% of N).
    N = L * (12 * C * C + 13 * C) + Vp * C + 2 * C
    return 6 * N + 12 * L * C * T, N


def make_optimizer(model, lr, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8}
    fused = device.type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    if fused:
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs), fused


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50257, help="V; padded to a multiple of 128 (50304)")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=10, help="untimed iterations first (compilation happens here)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the model")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16: autocast; fp32: none")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--sdpa-backend", choices=["auto", "flash", "cudnn", "efficient", "math"], default="auto",
                    help="pin scaled_dot_product_attention to one kernel (default: PyTorch's choice)")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 matmuls (off: exact fp32)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="for MFU: dense BF16 peak (H100 SXM)")
    args = ap.parse_args()

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    if args.compile and not hasattr(torch, "compile"):
        sys.exit(f"torch {torch.__version__} has no torch.compile: pass --no-compile")
    if args.sdpa_backend != "auto" and not HAVE_SDPA:
        sys.exit(f"torch {torch.__version__} has no scaled_dot_product_attention: --sdpa-backend needs it")

    L, C, NH, T, B = args.layers, args.hidden, args.heads, args.seq, args.batch
    V, Vp = args.vocab, padded_vocab(args.vocab)
    model = GPT(L, C, NH, V, Vp, T, HAVE_SDPA).to(device)
    opt, fused = make_optimizer(model, args.lr, device)
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token, n_matmul = non_embedding_matmul_flops_per_token(L, C, Vp, T)
    step_model = torch.compile(model) if args.compile else model

    # A few fixed batches on the device (random tokens, as loom --mock-data): no host work in the loop.
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    pool = [torch.randint(0, V, (B, T + 1), generator=g).to(device) for _ in range(4)]
    amp_dtype = torch.bfloat16 if args.dtype == "bf16" else None

    sdpa_ctx = None
    if args.sdpa_backend != "auto":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[args.sdpa_backend]
        sdpa_ctx = sdpa_kernel(backend)
        sdpa_ctx.__enter__()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(i):
        batch = pool[i % len(pool)]
        x, y = batch[:, :-1], batch[:, 1:]
        if amp_dtype is not None:
            with torch.autocast(device_type=device.type, dtype=amp_dtype):
                loss = step_model(x, y)
        else:
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, first_ms, loss = [], None, None
    try:
        for i in range(args.warmup + args.iters):
            sync()
            t0 = time.perf_counter()
            loss = step(i)
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            if i == 0:
                first_ms = ms
            if i >= args.warmup:
                times.append(ms)
            print(f"[pytorch] iter {i + 1}/{args.warmup + args.iters}: {ms:.2f} ms, loss {loss.item():.4f}",
                  file=sys.stderr, flush=True)
    except torch.cuda.OutOfMemoryError as e:  # the caller retries with a smaller batch
        print(f"[pytorch] CUDA out of memory at batch {B}: {e}", file=sys.stderr)
        sys.exit(3)
    if sdpa_ctx is not None:
        sdpa_ctx.__exit__(None, None, None)
    if not times:
        sys.exit("[pytorch] no timed iterations (--iters 0?)")

    ms = statistics.median(times)
    tokens_per_s = B * T / (ms / 1e3)
    tflops = flops_per_token * B * T / (ms / 1e3) / 1e12
    info = {
        "impl": "pytorch", "torch": torch.__version__, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "L": L, "C": C, "NH": NH, "T": T, "B": B, "V": V, "Vp": Vp, "params": n_params,
        "dtype": args.dtype, "compile": args.compile, "sdpa": HAVE_SDPA, "sdpa_backend": args.sdpa_backend,
        "fused_adamw": fused, "warmup": args.warmup, "iters": len(times),
        "first_iter_ms": round(first_ms, 1), "ms_per_iter": round(ms, 3),
        "ms_min": round(min(times), 3), "ms_max": round(max(times), 3),
        "tokens_per_s": round(tokens_per_s, 1), "model_tflops": round(tflops, 2),
        "mfu": round(tflops / args.peak_tflops, 4), "final_loss": round(loss.item(), 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }
    print(json.dumps(info))
    print(f"pytorch tokens/s: {tokens_per_s:.1f} ms/iter: {ms:.3f}", flush=True)


if __name__ == "__main__":
    main()
