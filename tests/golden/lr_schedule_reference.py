#!/usr/bin/env python3
"""Independent reference for Megatron's OptimizerParamScheduler formulas (lr and weight decay, in
samples), used by tests/unit/optim/test_scheduler.cpp. Given one schedule on the command line it prints,
for each requested num_steps, one line "<lr> <wd>" with Python's repr (shortest round-trip), so the C++
side can compare to within a few ULP. Written from the formulas, standard library only.
"""
import argparse
import math


def lr_at(a, n):
    if a.warmup > 0 and n <= a.warmup:
        return a.init_lr + (a.max_lr - a.init_lr) * float(n) / float(a.warmup)
    if a.style == "constant":
        return a.max_lr
    if n > a.decay:
        return a.min_lr
    if a.style == "inverse-square-root":
        w = max(a.warmup, 1)
        s = max(n, 1)
        return max(a.min_lr, a.max_lr * w ** 0.5 / (s ** 0.5))
    ratio = float(n - a.warmup) / float(a.decay - a.warmup)
    assert 0.0 <= ratio <= 1.0
    if a.style == "linear":
        c = 1.0 - ratio
    elif a.style == "cosine":
        c = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif a.style == "WSD":
        start = a.decay - a.wsd
        if n <= start:
            c = 1.0
        else:
            r = float(n - start) / float(a.wsd)
            c = {
                "linear": lambda: 1.0 - r,
                "cosine": lambda: 0.5 * (math.cos(math.pi * r) + 1.0),
                "exponential": lambda: 2.0 * math.pow(0.5, r) - 1.0,
                "minus_sqrt": lambda: 1.0 - math.sqrt(r),
            }[a.wsd_style]()
    else:
        raise SystemExit("unknown style " + a.style)
    return a.min_lr + c * (a.max_lr - a.min_lr)


def wd_at(a, n):
    if n > a.wd_steps:
        return a.end_wd
    if a.wd_style == "constant":
        assert a.start_wd == a.end_wd
        return a.end_wd
    ratio = float(n) / float(a.wd_steps)
    if a.wd_style == "linear":
        c = ratio
    elif a.wd_style == "cosine":
        c = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    else:
        raise SystemExit("unknown wd style " + a.wd_style)
    return a.start_wd + c * (a.end_wd - a.start_wd)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--init-lr", type=float, default=0.0)
    p.add_argument("--max-lr", type=float, required=True)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--decay", type=int, required=True)
    p.add_argument("--style", default="linear")
    p.add_argument("--wsd", type=int, default=0)
    p.add_argument("--wsd-style", default="exponential")
    p.add_argument("--start-wd", type=float, default=0.0)
    p.add_argument("--end-wd", type=float, default=0.0)
    p.add_argument("--wd-steps", type=int, default=0)
    p.add_argument("--wd-style", default="constant")
    p.add_argument("--steps", required=True, help="comma-separated num_steps values")
    a = p.parse_args()
    for n in (int(x) for x in a.steps.split(",")):
        print(repr(lr_at(a, n)), repr(wd_at(a, n)))


if __name__ == "__main__":
    main()
