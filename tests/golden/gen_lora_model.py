"""PyTorch LoRA reference for Loom's adapters on a Llama model (GPTModel with ModelOptions::lora), float64.

Run:  /usr/bin/python3 tests/golden/gen_lora_model.py      (torch 1.13; a second)
Writes tests/golden/fixtures/lora_tiny.safetensors, read by tests/golden/test_golden_lora.cpp.

Written independently of Loom's fused layout: the reference model is Hugging Face's LlamaModel with separate
q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj modules, and LoRA as PEFT's LoraLayer adds it
to a module: y = base(x) + (alpha / r) * lora_B(lora_A(x)) (dropout 0). The shared pieces (RMSNorm, RoPE with
rotate_half, the SwiGLU MLP) come from gen_llama_model.py. Shapes: gen_llama_model.py's (L=2, C=16, NH=4,
NKV=2, HS=4, T=12, B=2, V=53 -> Vp=64, F=24), rank 2, alpha 8.

Cases (metadata "cases"; "<case>.targets" is the --lora-target-modules list):
  peft   adapters on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (PEFT's modules: on
         Loom's fused layers they adapt the matching output slices)
  fused  adapters on Loom's whole linear_qkv (one A, B over the fused grouped-layout output, which the
         reference splits into the q/k/v heads the way Megatron's layout defines), linear_proj,
         linear_fc1 (B over [gate; up]) and linear_fc2

Tensors (F32 unless noted), per case <c>:
  <c>.param.<loom name>      the frozen base in Loom's names (fused qkv in the grouped layout, fc1 = [gate; up])
  <c>.lora.<loom name>       the adapters (A, and a non-zero B so the test sees them)
  <c>.tokens, <c>.targets    I32 (B, T)
  <c>.ref.logits (B, T, Vp), <c>.ref.loss (1,), <c>.ref.grad.<adapter name>: gradients of the mean loss
"""
import os
import sys
import zlib

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_llama_model as ref  # noqa: E402
import safetensors_py as st  # noqa: E402

f64 = torch.float64
L, C, NH, NKV, T, B, V, Vp, FF = ref.L, ref.C, ref.NH, 2, ref.T, ref.B, ref.V, ref.Vp, ref.FFN
HS, G, R, ALPHA = C // NH, NH // 2, 2, 8.0
CFG = dict(ref.LLAMA, num_query_groups=NKV)
HF_SHAPES = {"q_proj": (NH * HS, C), "k_proj": (NKV * HS, C), "v_proj": (NKV * HS, C), "o_proj": (C, NH * HS),
             "gate_proj": (FF, C), "up_proj": (FF, C), "down_proj": (C, FF)}
TARGETS = {"peft": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "fused": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}
LOOM_MODULE = {"q_proj": "self_attention.q_proj", "k_proj": "self_attention.k_proj",
               "v_proj": "self_attention.v_proj", "o_proj": "self_attention.linear_proj",
               "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.linear_fc2",
               "linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
               "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
FUSED_SHAPES = {"linear_qkv": ((NH + 2 * NKV) * HS, C), "linear_proj": (C, NH * HS), "linear_fc1": (2 * FF, C),
                "linear_fc2": (C, FF)}


def randn(g, shape, std):
    return (std * torch.randn(shape, generator=g, dtype=f64)).to(torch.float32).to(f64)


def hf_base(g):
    """The base model in Hugging Face's modules."""
    P = {"embed": randn(g, (Vp, C), 1.0), "lm_head": randn(g, (Vp, C), 0.15),
         "norm": (1.0 + randn(g, (C,), 0.1))}
    for i in range(L):
        P[f"{i}.input_layernorm"] = 1.0 + randn(g, (C,), 0.1)
        P[f"{i}.post_attention_layernorm"] = 1.0 + randn(g, (C,), 0.1)
        for m, shape in HF_SHAPES.items():
            P[f"{i}.{m}"] = randn(g, shape, 0.3 if m[0] in "qkv" else 0.15)
    return P


def loom_base(P):
    """Loom's names and fused layouts: qkv per query group [its G query heads, key head, value head]."""
    out = {"embedding.word_embeddings.weight": P["embed"], "output_layer.weight": P["lm_head"],
           "decoder.final_layernorm.weight": P["norm"]}
    for i in range(L):
        p = f"decoder.layers.{i}."
        q = P[f"{i}.q_proj"].view(NKV, G * HS, C)
        k = P[f"{i}.k_proj"].view(NKV, HS, C)
        v = P[f"{i}.v_proj"].view(NKV, HS, C)
        out[p + "input_layernorm.weight"] = P[f"{i}.input_layernorm"]
        out[p + "pre_mlp_layernorm.weight"] = P[f"{i}.post_attention_layernorm"]
        out[p + "self_attention.linear_qkv.weight"] = torch.cat((q, k, v), dim=1).reshape(-1, C)
        out[p + "self_attention.linear_proj.weight"] = P[f"{i}.o_proj"]
        out[p + "mlp.linear_fc1.weight"] = torch.cat((P[f"{i}.gate_proj"], P[f"{i}.up_proj"]))
        out[p + "mlp.linear_fc2.weight"] = P[f"{i}.down_proj"]
    return out


def adapters(case, g):
    """Loom-named adapter tensors: A ~ U(-1/sqrt(in), 1/sqrt(in)) as PEFT, B non-zero (PEFT starts at 0)."""
    A = {}
    for i in range(L):
        for m in TARGETS[case]:
            out_f, in_f = HF_SHAPES[m] if m in HF_SHAPES else FUSED_SHAPES[m]
            name = f"decoder.layers.{i}.{LOOM_MODULE[m]}"
            bound = 1.0 / in_f ** 0.5
            A[name + ".lora_A.weight"] = ((torch.rand((R, in_f), generator=g, dtype=f64) * 2 - 1) * bound).to(
                torch.float32).to(f64)
            A[name + ".lora_B.weight"] = randn(g, (out_f, R), 0.5)
    return A


def lora(A, name, x):
    """PEFT: (alpha / r) * lora_B(lora_A(x)); zero when the module has no adapter."""
    a = A.get(name + ".lora_A.weight")
    if a is None:
        return 0.0
    return (ALPHA / R) * F.linear(F.linear(x, a), A[name + ".lora_B.weight"])


def logits_of(case, P, A, tokens):
    cos, sin = ref.rope_tables(CFG, HS, T)
    x = P["embed"][tokens]
    i_ = torch.arange(T)[:, None]
    visible = torch.arange(T)[None, :] <= i_
    for i in range(L):
        p = f"decoder.layers.{i}."
        h = ref.norm(CFG, {"w.weight": P[f"{i}.input_layernorm"]}, "w", x)
        q = F.linear(h, P[f"{i}.q_proj"]) + lora(A, p + "self_attention.q_proj", h)
        k = F.linear(h, P[f"{i}.k_proj"]) + lora(A, p + "self_attention.k_proj", h)
        v = F.linear(h, P[f"{i}.v_proj"]) + lora(A, p + "self_attention.v_proj", h)
        if case == "fused":  # the fused adapter's rows: per group [G query heads, key head, value head]
            d = lora(A, p + "self_attention.linear_qkv", h).view(B, T, NKV, G + 2, HS)
            q = q + d[:, :, :, :G].reshape(B, T, NH * HS)
            k = k + d[:, :, :, G].reshape(B, T, NKV * HS)
            v = v + d[:, :, :, G + 1].reshape(B, T, NKV * HS)
        q = ref.apply_rope(q.view(B, T, NH, HS).transpose(1, 2), cos, sin, HS, 0)
        k = ref.apply_rope(k.view(B, T, NKV, HS).transpose(1, 2), cos, sin, HS, 0).repeat_interleave(G, dim=1)
        v = v.view(B, T, NKV, HS).transpose(1, 2).repeat_interleave(G, dim=1)
        s = (q @ k.transpose(-1, -2)) / HS ** 0.5
        y = (torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v).transpose(1, 2).reshape(B, T, -1)
        x = x + F.linear(y, P[f"{i}.o_proj"]) + lora(A, p + "self_attention.linear_proj", y)
        h = ref.norm(CFG, {"w.weight": P[f"{i}.post_attention_layernorm"]}, "w", x)
        gate = F.linear(h, P[f"{i}.gate_proj"]) + lora(A, p + "mlp.gate_proj", h)
        up = F.linear(h, P[f"{i}.up_proj"]) + lora(A, p + "mlp.up_proj", h)
        if case == "fused":
            d = lora(A, p + "mlp.linear_fc1", h)
            gate, up = gate + d[..., :FF], up + d[..., FF:]
        m = F.silu(gate) * up
        x = x + F.linear(m, P[f"{i}.down_proj"]) + lora(A, p + "mlp.linear_fc2", m)
    x = ref.norm(CFG, {"w.weight": P["norm"]}, "w", x)
    return x @ P["lm_head"].t()


def main():
    torch.set_num_threads(1)
    tensors, meta = {}, {}
    for case in TARGETS:
        g = torch.Generator().manual_seed(zlib.crc32(("lora_model/" + case).encode()))
        P = hf_base(g)
        A0 = adapters(case, g)
        tokens = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
        targets = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
        A = {n: t.clone().requires_grad_(True) for n, t in A0.items()}
        logits = logits_of(case, P, A, tokens)
        loss = F.cross_entropy(logits[..., :V].reshape(B * T, V), targets.reshape(B * T))
        loss.backward()
        for n, t in loom_base(P).items():
            tensors[f"{case}.param.{n}"] = t.to(torch.float32).numpy()
        for n in A:
            tensors[f"{case}.lora.{n}"] = A0[n].to(torch.float32).numpy()
            tensors[f"{case}.ref.grad.{n}"] = A[n].grad.to(torch.float32).numpy()
        tensors[f"{case}.tokens"] = tokens.to(torch.int32).numpy()
        tensors[f"{case}.targets"] = targets.to(torch.int32).numpy()
        tensors[f"{case}.ref.logits"] = logits.detach().to(torch.float32).numpy()
        tensors[f"{case}.ref.loss"] = loss.detach().reshape(1).to(torch.float32).numpy()
        meta[f"{case}.targets"] = ",".join(TARGETS[case])
        print(f"  {case:6s} loss {float(loss):.6f}  ({len(A)} adapter tensors)")
    meta.update({"cases": ",".join(TARGETS), "generator": "tests/golden/gen_lora_model.py", "lora_rank": str(R),
                 "lora_alpha": str(ALPHA), "num_query_groups": str(NKV)})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "lora_tiny.safetensors")
    n = st.save(path, tensors, meta)
    print(f"wrote {os.path.relpath(path)} ({n / 1024:.1f} KiB, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
