# The training-speed harness shared by bench/pytorch_gpt2.py and bench/pytorch_llama.py: run-control
# flags, the timed AdamW loop (mock data, clipping, first-step dtype probe) and the one-line JSON result.
# Invariants kept equal to `loom train --mock-data`: T+1 random tokens per sample shifted for targets,
# AdamW(lr 6e-4, betas 0.9/0.95, eps 1e-8) with weight decay 0.1 on 2-D tensors only, clip by global
# norm 1.0; --bf16 runs forward + loss under torch.autocast("cpu", bfloat16) and backward outside it.
# Each step's timing covers forward, backward, clipping and the optimizer step, not data generation.

import json
import resource
import statistics
import sys
import time

import torch


def padded_vocab(V, multiple=128):
    # Megatron's --make-vocab-size-divisible-by (default 128 at TP=1): 50257 -> 50304, as in Loom.
    return ((V + multiple - 1) // multiple) * multiple


def add_run_args(p):
    """Adds the flags every benchmark takes: --steps, --warmup, --threads, --seed, --bf16."""
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bf16", action="store_true",
                   help="forward + loss under torch.autocast('cpu', torch.bfloat16); fp32 params and AdamW")


def check_run_args(p, a):
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")


def train_and_time(model, probe, args, B, T, V, script):
    """Trains `model` (forward(idx, targets) -> loss) for args.warmup + args.steps steps on random tokens.

    `probe` is the model's first linear: autocast on CPU only covers ops on its lower-precision list and
    a torch build may lack the BF16 GEMM path, so the first step checks that it really ran in the
    requested dtype rather than trusting the flag. Returns (median timed ms per step, parameter list).
    """
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once; LoRA: adapters
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=6e-4, betas=(0.9, 0.95), eps=1e-8)

    precision = "bf16" if args.bf16 else "fp32"
    seen_dtype = {}

    def record_dtype(module, inputs, output):  # a forward hook that returns None keeps the output
        seen_dtype.setdefault("out", output.dtype)

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
                sys.exit(f"{script}: expected {want} matmul outputs in {precision} mode, got {got}")
        tag = "warmup" if step < args.warmup else "timed"
        print(f"step {step + 1}/{total} ({tag}) loss {loss_v:.4f} grad_norm {float(grad_norm):.4f} "
              f"ms {ms:.1f}", file=sys.stderr, flush=True)
        if step >= args.warmup:
            times_ms.append(ms)
    return statistics.median(times_ms), params


def print_result(shape, args, B, T, ms_per_step, flops, params):
    """Prints the JSON result line: "impl", the model's `shape` keys in order, then the run's numbers."""
    result = {"impl": "pytorch", **shape}
    result.update({
        "params": sum(p.numel() for p in params),
        "threads": args.threads,
        "precision": "bf16" if args.bf16 else "fp32",
        "warmup": args.warmup,
        "steps": args.steps,
        "ms_per_step": round(ms_per_step, 3),
        "tokens_per_s": round(B * T / (ms_per_step / 1e3), 3),
        "gflops": round(flops / (ms_per_step / 1e3) / 1e9, 3),
        # ru_maxrss is KiB on Linux; the bench scripts use /usr/bin/time -v for both sides instead.
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch": torch.__version__,
    })
    print(json.dumps(result), flush=True)
