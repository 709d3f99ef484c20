"""Tiny Hugging Face model directories (GPT-2 and Llama layouts) plus reference logits, for the converter.

Run:  /usr/bin/python3 tests/golden/gen_hf_models.py      (torch 1.13, no transformers; a second)
Writes (read by tests/unit/train/test_model_io.cpp and tests/e2e/test_convert_cli.cpp):
  fixtures/hf_gpt2/{config.json, model.safetensors}    ~120 KB
  fixtures/hf_llama/{config.json, model.safetensors}   ~100 KB
  fixtures/hf_reference.safetensors                    tokens and logits of both

The directories are what transformers' save_pretrained writes for GPT2LMHeadModel / LlamaForCausalLM
(float32): HF's tensor names and layouts, config.json with HF's keys, safetensors metadata {"format": "pt"},
the tied GPT-2 lm_head left out. The logits come from the models' forward written out here from the
modeling code of transformers (it is not installed), in HF's own names and layouts, so nothing is shared
with Loom's mapping:
  GPT-2  wte + wpe; per block x += c_proj(attn(ln_1(x))), x += mlp.c_proj(gelu_new(c_fc(ln_2(x)))); ln_f;
         logits = x @ wte^T. Conv1D: y = x @ W + b with W stored (in, out); c_attn's output splits into
         [q | k | v], each C wide, heads HS-wide slices of those; softmax(q k^T / sqrt(HS)) causal.
  Llama  embed_tokens; per layer x += o_proj(attn(input_layernorm(x))), x += down_proj(silu(gate_proj(h)) *
         up_proj(h)) with h = post_attention_layernorm(x); norm; logits = lm_head(x) (untied). RMSNorm
         x * rsqrt(mean(x^2) + eps) * w. RoPE by rotate_half on q and k with inv_freq = 1/theta^(2i/HS), cos
         and sin in float32 (as HF and Loom hold them); grouped-query attention by repeat_kv (query head h
         reads key/value head h // (NH/NKV)).
Shapes: GPT-2 2 layers, n_embd 32, 4 heads, vocab 101, n_positions 16; Llama 2 layers, hidden 32, 4 heads,
2 key/value heads, intermediate 64, vocab 101, max positions 16, rope_theta 10000, rms_norm_eps 1e-6. Tokens:
(2, 8) in [0, 101). Math in float64 from the float32 weights; logits stored as float32 (B, T, V).

Weights: N(0, 1) embeddings (so tied logits carry signal), N(0, 0.2) matrices, N(0, 0.05) biases, norm
weights 1 + N(0, 0.1), norm biases N(0, 0.05). Fixed seeds: regenerating gives identical bytes.
"""
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_py as st  # noqa: E402

f64 = torch.float64
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
V, B, T = 101, 2, 8


def rand(g, shape, std, mean=0.0):
    t = mean + std * torch.randn(shape, generator=g, dtype=f64)
    return t.to(torch.float32)  # what the file stores; the math starts from exactly these values


def write_dir(name, config, tensors):
    d = os.path.join(FIXTURES, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    st.save(os.path.join(d, "model.safetensors"), {k: v.numpy() for k, v in tensors.items()}, {"format": "pt"})


# ---- GPT-2 ------------------------------------------------------------------------------------------

G2 = dict(n_layer=2, n_embd=32, n_head=4, n_positions=16, eps=1e-5)


def gpt2_params(g):
    C, L, P = G2["n_embd"], G2["n_layer"], G2["n_positions"]
    p = {"transformer.wte.weight": rand(g, (V, C), 1.0), "transformer.wpe.weight": rand(g, (P, C), 0.5)}
    for i in range(L):
        h = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            p[h + ln + ".weight"] = rand(g, (C,), 0.1, 1.0)
            p[h + ln + ".bias"] = rand(g, (C,), 0.05)
        for name, (fin, fout) in (("attn.c_attn", (C, 3 * C)), ("attn.c_proj", (C, C)), ("mlp.c_fc", (C, 4 * C)),
                                  ("mlp.c_proj", (4 * C, C))):
            p[h + name + ".weight"] = rand(g, (fin, fout), 0.2)  # Conv1D: (in, out)
            p[h + name + ".bias"] = rand(g, (fout,), 0.05)
    p["transformer.ln_f.weight"] = rand(g, (C,), 0.1, 1.0)
    p["transformer.ln_f.bias"] = rand(g, (C,), 0.05)
    return p


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gpt2_forward(p, tokens):
    P = {k: v.to(f64) for k, v in p.items()}
    C, NH = G2["n_embd"], G2["n_head"]
    HS = C // NH
    conv1d = lambda name, x: x @ P[name + ".weight"] + P[name + ".bias"]  # noqa: E731
    ln = lambda name, x: F.layer_norm(x, (C,), P[name + ".weight"], P[name + ".bias"], G2["eps"])  # noqa: E731
    x = P["transformer.wte.weight"][tokens] + P["transformer.wpe.weight"][torch.arange(T)]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(G2["n_layer"]):
        h = f"transformer.h.{i}."
        q, k, v = conv1d(h + "attn.c_attn", ln(h + "ln_1", x)).split(C, dim=-1)
        heads = lambda t: t.view(B, T, NH, HS).transpose(1, 2)  # noqa: E731
        q, k, v = heads(q), heads(k), heads(v)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(HS)
        s = s.masked_fill(~causal, float("-inf"))
        y = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + conv1d(h + "attn.c_proj", y)
        x = x + conv1d(h + "mlp.c_proj", gelu_new(conv1d(h + "mlp.c_fc", ln(h + "ln_2", x))))
    x = ln("transformer.ln_f", x)
    return x @ P["transformer.wte.weight"].t()


def gpt2_config():
    return {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
            "bos_token_id": 100, "embd_pdrop": 0.1, "eos_token_id": 100, "initializer_range": 0.02,
            "layer_norm_epsilon": G2["eps"], "model_type": "gpt2", "n_ctx": G2["n_positions"],
            "n_embd": G2["n_embd"], "n_head": G2["n_head"], "n_inner": None, "n_layer": G2["n_layer"],
            "n_positions": G2["n_positions"], "resid_pdrop": 0.1, "scale_attn_weights": True,
            "torch_dtype": "float32", "transformers_version": "4.44.0", "use_cache": True, "vocab_size": V}


# ---- Llama ------------------------------------------------------------------------------------------

LL = dict(layers=2, hidden=32, heads=4, kv_heads=2, inter=64, positions=16, theta=10000.0, eps=1e-6)


def llama_params(g):
    C, NH, NKV, FF = LL["hidden"], LL["heads"], LL["kv_heads"], LL["inter"]
    HS = C // NH
    p = {"model.embed_tokens.weight": rand(g, (V, C), 1.0)}
    for i in range(LL["layers"]):
        h = f"model.layers.{i}."
        p[h + "input_layernorm.weight"] = rand(g, (C,), 0.1, 1.0)
        p[h + "post_attention_layernorm.weight"] = rand(g, (C,), 0.1, 1.0)
        for name, shape in (("self_attn.q_proj", (NH * HS, C)), ("self_attn.k_proj", (NKV * HS, C)),
                            ("self_attn.v_proj", (NKV * HS, C)), ("self_attn.o_proj", (C, NH * HS)),
                            ("mlp.gate_proj", (FF, C)), ("mlp.up_proj", (FF, C)), ("mlp.down_proj", (C, FF))):
            p[h + name + ".weight"] = rand(g, shape, 0.2)  # nn.Linear: (out, in)
    p["model.norm.weight"] = rand(g, (C,), 0.1, 1.0)
    p["lm_head.weight"] = rand(g, (V, C), 0.2)
    return p


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def llama_forward(p, tokens):
    P = {k: v.to(f64) for k, v in p.items()}
    C, NH, NKV = LL["hidden"], LL["heads"], LL["kv_heads"]
    HS, G = C // NH, NH // NKV
    lin = lambda name, x: F.linear(x, P[name + ".weight"])  # noqa: E731
    rms = lambda name, x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + LL["eps"]) * P[name + ".weight"]  # noqa: E731
    inv_freq = 1.0 / (LL["theta"] ** (torch.arange(0, HS, 2, dtype=f64) / HS))
    angles = torch.arange(T, dtype=f64)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(torch.float32).to(f64), emb.sin().to(torch.float32).to(f64)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    x = P["model.embed_tokens.weight"][tokens]
    for i in range(LL["layers"]):
        h = f"model.layers.{i}."
        a = rms(h + "input_layernorm", x)
        q = lin(h + "self_attn.q_proj", a).view(B, T, NH, HS).transpose(1, 2)
        k = lin(h + "self_attn.k_proj", a).view(B, T, NKV, HS).transpose(1, 2)
        v = lin(h + "self_attn.v_proj", a).view(B, T, NKV, HS).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(G, dim=1)  # repeat_kv
        v = v.repeat_interleave(G, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(HS)
        s = s.masked_fill(~causal, float("-inf"))
        y = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, T, NH * HS)
        x = x + lin(h + "self_attn.o_proj", y)
        m = rms(h + "post_attention_layernorm", x)
        x = x + lin(h + "mlp.down_proj", F.silu(lin(h + "mlp.gate_proj", m)) * lin(h + "mlp.up_proj", m))
    return lin("lm_head", rms("model.norm", x))


def llama_config():
    return {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": LL["hidden"],
            "initializer_range": 0.02, "intermediate_size": LL["inter"], "max_position_embeddings": LL["positions"],
            "mlp_bias": False, "model_type": "llama", "num_attention_heads": LL["heads"],
            "num_hidden_layers": LL["layers"], "num_key_value_heads": LL["kv_heads"], "rms_norm_eps": LL["eps"],
            "rope_scaling": None, "rope_theta": LL["theta"], "tie_word_embeddings": False,
            "torch_dtype": "float32", "transformers_version": "4.44.0", "use_cache": True, "vocab_size": V}


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(20261122)
    ref = {}
    p = gpt2_params(g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    write_dir("hf_gpt2", gpt2_config(), p)
    ref["gpt2.tokens"] = tokens.to(torch.int32).numpy()
    ref["gpt2.logits"] = gpt2_forward(p, tokens).to(torch.float32).numpy()
    p = llama_params(g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    write_dir("hf_llama", llama_config(), p)
    ref["llama.tokens"] = tokens.to(torch.int32).numpy()
    ref["llama.logits"] = llama_forward(p, tokens).to(torch.float32).numpy()
    n = st.save(os.path.join(FIXTURES, "hf_reference.safetensors"), ref, {"vocab_size": str(V)})
    for d in ("hf_gpt2", "hf_llama"):
        size = os.path.getsize(os.path.join(FIXTURES, d, "model.safetensors"))
        print(f"fixtures/{d}/model.safetensors: {size} bytes")
    print(f"fixtures/hf_reference.safetensors: {n} bytes")
    assert np.isfinite(ref["gpt2.logits"]).all() and np.isfinite(ref["llama.logits"]).all()


if __name__ == "__main__":
    main()
