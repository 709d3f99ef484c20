#!/usr/bin/env python3
"""Checks the structure of a `loom train --mlperf-log` file (Loom's own check; standard library only).

usage: check_mllog.py LOG --status success|aborted [--target X] [--lora]

Every line must be ':::MLLOG ' + a JSON object with namespace, time_ms (integer, never decreasing),
event_type, key, value and metadata (file, lineno); *_start keys are INTERVAL_START, *_stop keys
INTERVAL_END, the rest POINT. The run must read: cache_clear, init_start, the submission and hyperparameter
keys (each once), init_stop, run_start, then blocks of training (block_start .. block_stop, with train_loss
inside) and evaluations (eval_start, eval_accuracy, eval_stop) outside the blocks, and run_stop last, with
samples_count on every block, eval and run_stop event, never decreasing. run_stop's status must be --status;
with --target, a success ends at the first eval_accuracy <= X and an aborted run has none. --lora: the
lora_rank/lora_alpha keys are there (else they must be absent). Prints the problems and exits 1 on failure.
"""
import argparse
import json
import sys

PREFIX = ":::MLLOG "
SUBMISSION = ["submission_benchmark", "submission_division", "submission_org", "submission_platform",
              "submission_status"]
HYPERPARAMETERS = ["global_batch_size", "gradient_accumulation_steps", "max_sequence_length", "train_samples",
                   "eval_samples", "seed", "opt_base_learning_rate", "opt_adamw_beta_1", "opt_adamw_beta_2",
                   "opt_adamw_epsilon", "opt_adamw_weight_decay", "opt_gradient_clip_norm",
                   "opt_learning_rate_warmup_factor", "opt_learning_rate_training_steps"]
LORA = ["lora_rank", "lora_alpha"]
SAMPLE_EVENTS = {"block_start", "block_stop", "eval_start", "eval_stop", "eval_accuracy", "run_stop", "train_loss"}


def check(path, status, target, lora):
    problems = []
    events = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.startswith(PREFIX):
                problems.append(f"line {n}: does not start with '{PREFIX}'")
                continue
            try:
                e = json.loads(line[len(PREFIX):])
            except ValueError as err:
                problems.append(f"line {n}: not JSON ({err})")
                continue
            if sorted(e) != sorted(["namespace", "time_ms", "event_type", "key", "value", "metadata"]):
                problems.append(f"line {n}: fields {sorted(e)}")
                continue
            e["line"] = n
            events.append(e)
    if problems:
        return problems
    if not events:
        return ["the log is empty"]

    last_time = 0
    for e in events:
        n, key, md = e["line"], e["key"], e["metadata"]
        if e["namespace"] != "":
            problems.append(f"line {n}: namespace {e['namespace']!r}")
        if not isinstance(e["time_ms"], int) or e["time_ms"] < last_time:
            problems.append(f"line {n}: time_ms {e['time_ms']!r} is not an integer >= {last_time}")
        last_time = e["time_ms"]
        want = "INTERVAL_START" if key.endswith("_start") else "INTERVAL_END" if key.endswith("_stop") else "POINT"
        if e["event_type"] != want:
            problems.append(f"line {n}: {key} has event_type {e['event_type']}, expected {want}")
        if not isinstance(md, dict) or not isinstance(md.get("file"), str) or not isinstance(md.get("lineno"), int):
            problems.append(f"line {n}: metadata needs file and lineno: {md!r}")
            continue
        if key in SAMPLE_EVENTS:
            if not isinstance(md.get("samples_count"), int) or md["samples_count"] < 0:
                problems.append(f"line {n}: {key} needs an integer samples_count >= 0")
            if "epoch_num" not in md:
                problems.append(f"line {n}: {key} needs epoch_num")

    keys = [e["key"] for e in events]
    once = ["init_start", "init_stop", "run_start", "run_stop"] + SUBMISSION + HYPERPARAMETERS + (LORA if lora else [])
    for k in once:
        if keys.count(k) != 1:
            problems.append(f"{k} appears {keys.count(k)} times, expected once")
    if not lora:
        for k in LORA:
            if k in keys:
                problems.append(f"{k} is logged but the run has no LoRA adapters")
    if problems:
        return problems

    value = {e["key"]: e["value"] for e in events}
    if keys[0] != "cache_clear" or keys[1] != "init_start":
        problems.append(f"the log must open with cache_clear, init_start, not {keys[:2]}")
    pos = {k: keys.index(k) for k in once}
    for k in SUBMISSION + HYPERPARAMETERS:
        if not pos["init_start"] < pos[k] < pos["init_stop"]:
            problems.append(f"{k} is not between init_start and init_stop")
    if not pos["init_stop"] < pos["run_start"] < pos["run_stop"] == len(keys) - 1:
        problems.append("init_stop, run_start and run_stop (last) are out of order")
    if value["submission_benchmark"] != "llama2_70b_lora":
        problems.append(f"submission_benchmark is {value['submission_benchmark']!r}")
    if value["submission_division"] not in ("closed", "open"):
        problems.append(f"submission_division is {value['submission_division']!r}")
    for k in ("global_batch_size", "gradient_accumulation_steps", "max_sequence_length", "eval_samples"):
        if not isinstance(value[k], int) or value[k] < 1:
            problems.append(f"{k} must be an integer >= 1, got {value[k]!r}")

    # The timed part: blocks of training and evaluations, then run_stop.
    in_block = in_eval = False
    last_samples = 0
    accuracies = []
    for e in events[pos["run_start"] + 1:]:
        key, n = e["key"], e["line"]
        samples = e["metadata"].get("samples_count")
        if samples is not None:
            if samples < last_samples:
                problems.append(f"line {n}: samples_count {samples} < {last_samples}")
            last_samples = samples
        if key == "block_start":
            if in_block or in_eval:
                problems.append(f"line {n}: block_start inside a block or an evaluation")
            in_block = True
        elif key == "block_stop":
            if not in_block:
                problems.append(f"line {n}: block_stop without block_start")
            in_block = False
        elif key == "eval_start":
            if in_block or in_eval:
                problems.append(f"line {n}: eval_start inside a block or an evaluation")
            in_eval = True
        elif key == "eval_accuracy":
            if not in_eval:
                problems.append(f"line {n}: eval_accuracy outside eval_start .. eval_stop")
            accuracies.append(e["value"])
        elif key == "eval_stop":
            if not in_eval:
                problems.append(f"line {n}: eval_stop without eval_start")
            in_eval = False
        elif key == "train_loss":
            if not in_block:
                problems.append(f"line {n}: train_loss outside a block")
        elif key == "run_stop":
            if in_block or in_eval:
                problems.append(f"line {n}: run_stop inside an open block or evaluation")
        else:
            problems.append(f"line {n}: unexpected key {key} after run_start")
    if not accuracies and status == "success":
        problems.append("a successful run needs an eval_accuracy")
    got = events[-1]["metadata"].get("status")
    if got != status:
        problems.append(f"run_stop status is {got!r}, expected {status!r}")
    if target is not None and accuracies:
        reached = [i for i, a in enumerate(accuracies) if a is not None and a <= target]
        if status == "success" and reached != [len(accuracies) - 1]:
            problems.append(f"a success must end at the first eval_accuracy <= {target}: {accuracies}")
        if status == "aborted" and reached:
            problems.append(f"an aborted run reached eval_accuracy <= {target}: {accuracies}")
    return problems


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--status", required=True, choices=["success", "aborted"])
    p.add_argument("--target", type=float)
    p.add_argument("--lora", action="store_true")
    a = p.parse_args()
    problems = check(a.log, a.status, a.target, a.lora)
    for msg in problems:
        print(f"{a.log}: {msg}")
    if problems:
        sys.exit(1)
    print(f"{a.log}: OK")


if __name__ == "__main__":
    main()
