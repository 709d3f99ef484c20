"""Independent check of `loom convert --to peft:` against `loom convert --merge-lora --to hf:`.

usage: peft_merge_check.py PEFT_DIR BASE_HF_DIR MERGED_HF_DIR

Applies a PEFT LoRA adapter directory the way PEFT's LoraLayer.merge does (W + (lora_alpha / r) · B @ A on
each adapted nn.Linear, PyTorch f32) to the Hugging Face export of the base model, and checks that the result
equals the merged model Loom wrote (within 1e-6), that every other tensor is unchanged, that the adapters are
not zero, and that adapter_config.json has the fields PEFT's LoraConfig writes. Knows nothing of Loom's fused
layouts: the PEFT directory must stand on its own. Prints one "ok" line; exits 1 with a message otherwise.
"""
import json
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_py  # noqa: E402

KEY = re.compile(r"^base_model\.model\.(model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj)"
                 r"\.lora_(A|B)\.weight$")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def main(peft_dir, base_dir, merged_dir):
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    want = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "modules_to_save": None, "use_rslora": False, "init_lora_weights": True,
            "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None}
    for k, v in want.items():
        if k not in cfg or cfg[k] != v:
            fail(f"adapter_config.json: {k} = {cfg.get(k, '<missing>')!r}, PEFT's LoraConfig writes {v!r}")
    for k in ("r", "lora_alpha", "lora_dropout", "target_modules", "base_model_name_or_path"):
        if k not in cfg:
            fail(f"adapter_config.json has no {k}")
    if list(cfg) != sorted(cfg):
        fail("adapter_config.json keys are not sorted (PEFT writes sort_keys=True)")
    r, scale = cfg["r"], cfg["lora_alpha"] / cfg["r"]

    adapters, _ = safetensors_py.load(os.path.join(peft_dir, "adapter_model.safetensors"))
    base, _ = safetensors_py.load(os.path.join(base_dir, "model.safetensors"))
    merged, _ = safetensors_py.load(os.path.join(merged_dir, "model.safetensors"))
    if sorted(base) != sorted(merged):
        fail("the merged model's tensors differ in name from the base's")
    modules = {}
    for name, t in adapters.items():
        m = KEY.match(name)
        if not m:
            fail(f"adapter key {name} is not PEFT's base_model.model.model.layers.N.<attn|mlp>.<proj>.lora_<A|B>.weight")
        if m.group(3) + "_proj" not in cfg["target_modules"]:
            fail(f"{name}: module not in target_modules {cfg['target_modules']}")
        modules.setdefault(m.group(1), {})[m.group(4)] = torch.from_numpy(t.astype(np.float32))
    expected = {k: torch.from_numpy(v.astype(np.float32)) for k, v in base.items()}
    biggest = 0.0
    for mod, ab in sorted(modules.items()):
        if set(ab) != {"A", "B"}:
            fail(f"{mod} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        w = expected[mod + ".weight"]
        if a.shape != (r, w.shape[1]) or b.shape != (w.shape[0], r):
            fail(f"{mod}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the weight {tuple(w.shape)} with r = {r}")
        delta = (b @ a) * scale  # PEFT's get_delta_weight (fan_in_fan_out false)
        biggest = max(biggest, float(delta.abs().max()))
        expected[mod + ".weight"] = w + delta
    if biggest < 1e-4:
        fail(f"the adapters are (nearly) zero: largest update {biggest}")
    worst, changed = 0.0, 0
    for name, m in merged.items():
        got = torch.from_numpy(m.astype(np.float32))
        if name.rsplit(".", 1)[0] in modules:
            changed += 1
            worst = max(worst, float((got - expected[name]).abs().max()))
        elif not torch.equal(got, expected[name]):
            fail(f"{name} is not adapted but differs from the base")
    if worst > 1e-6:
        fail(f"merged weights differ from base + PEFT adapters by {worst} (> 1e-6)")
    print(f"ok: {changed} adapted weights match within {worst:.3g} (largest update {biggest:.3g}), "
          f"{len(merged) - changed} others unchanged")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__)
        sys.exit(2)
    main(*sys.argv[1:])
