"""Tiny Hugging Face mixture-of-experts directories (Mixtral, Qwen2-MoE, Qwen3-MoE) plus reference logits and
greedy continuations, for the converter and for `loom generate` on MoE models.

Run:  /usr/bin/python3 tests/golden/gen_hf_moe_models.py      (torch 1.13, no transformers; a few seconds)
Writes (read by tests/unit/train/test_model_io_moe.cpp and tests/e2e/test_convert_cli.cpp):
  fixtures/hf_mixtral/{config.json, model.safetensors}      ~200 KB
  fixtures/hf_qwen2_moe/{config.json, model.safetensors}    ~240 KB
  fixtures/hf_qwen3_moe/{config.json, model.safetensors}    ~150 KB
  fixtures/hf_moe_reference.safetensors                      tokens, logits and greedy decodes of all three

The directories are what transformers' save_pretrained writes for MixtralForCausalLM, Qwen2MoeForCausalLM and
Qwen3MoeForCausalLM in the Hub's per-expert layout (float32, HF names, config.json with HF's keys). The
forward below is written from transformers' modeling code (not installed), in HF's names and layouts, so
nothing is shared with Loom's mapping:
  attention  as Llama (gen_hf_models.py): q/k/v/o_proj (Qwen2-MoE: q/k/v biases), RoPE by rotate_half with
             float32 cos/sin, repeat_kv for grouped heads; Qwen3-MoE: q_norm / k_norm, an RMSNorm over each
             head's head_dim channels, on q and k before RoPE; head_dim may differ from hidden / heads.
  MoE block  logits = x @ gate.weight^T; p = softmax(logits) over all experts (float); the top-k of p
             (values, experts); renormalised to sum 1 when norm_topk_prob (Mixtral: always);
             out = sum_k p_k * down(silu(gate_proj(x)) * up_proj(x)) of expert k (Mixtral: w2(silu(w1 x) * w3 x)).
             Qwen2-MoE adds sigmoid(x @ shared_expert_gate.weight^T) * shared_expert(x).
  layers     Mixtral: every layer sparse. Qwen: layer i sparse unless in mlp_only_layers, when
             (i + 1) % decoder_sparse_step == 0; dense layers are Llama's MLP of intermediate_size.
Cases:
  mixtral    2 layers, hidden 32, 4 heads, 2 KV heads, 4 experts top-2 of width 48, untied, rope_theta 1e6
  qwen2_moe  3 layers (layer 1 dense via mlp_only_layers [1], intermediate 64), hidden 32, 4 heads (MHA),
             6 experts top-3 of width 24, shared expert 40 with its gate, q/k/v biases, norm_topk_prob false
             (Loom: --moe-router-pre-softmax), tied embeddings
  qwen3_moe  2 layers (decoder_sparse_step 2: layer 0 dense of 48, layer 1 sparse), hidden 32, 4 heads of
             head_dim 16, 2 KV heads, q/k norms, 8 experts top-2 of width 16, norm_topk_prob true, untied
Vocabulary 101 (Loom pads to 128), 32 positions, rms_norm_eps 1e-6 (qwen) / 1e-5 (mixtral).
Tensors in hf_moe_reference.safetensors, per case <c>:
  <c>.tokens (2, 8) I32 and <c>.logits (2, 8, 101): the full forward of a batch
  <c>.prompt (6,) I32, <c>.gen.tokens (10,) I32: greedy continuation by re-running the full forward over the
  whole prefix every step (no cache); <c>.gen.logits (10, 101): the logits each token was chosen from
Checks (else the next seed is tried): every greedy step's best logit beats the runner-up by > 1e-3, and at
every sparse layer every token's k-th largest router logit beats the (k+1)-th by > 1e-3 (float32 rounding
in Loom must not pick other experts); the continuation holds at least 4 distinct tokens.
Weights: N(0, 1) embeddings, N(0, 0.2) matrices, N(0, 0.6) router gates, N(0, 0.05) biases, norm weights
1 + N(0, 0.1). Math in float64 from the float32 weights. Fixed seeds: regenerating gives identical bytes.
"""
import json
import math
import os
import sys
import zlib

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_py as st  # noqa: E402

f64 = torch.float64
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
V, B, T, P = 101, 2, 8, 32
PROMPT, STEPS, MARGIN = 6, 10, 1e-3

CASES = {
    "mixtral": dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, inter=48, experts=4, topk=2,
                    moe_inter=48, shared=0, norm_topk=True, sparse=[1, 1], qkv_bias=False, qk_norm=False,
                    tied=False, theta=1e6, eps=1e-5),
    "qwen2_moe": dict(layers=3, hidden=32, heads=4, kv_heads=4, head_dim=8, inter=64, experts=6, topk=3,
                      moe_inter=24, shared=40, norm_topk=False, sparse=[1, 0, 1], qkv_bias=True, qk_norm=False,
                      tied=True, theta=1e6, eps=1e-6),
    "qwen3_moe": dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=16, inter=48, experts=8, topk=2,
                      moe_inter=16, shared=0, norm_topk=True, sparse=[0, 1], qkv_bias=False, qk_norm=True,
                      tied=False, theta=1e6, eps=1e-6),
}


def rand(g, shape, std, mean=0.0):
    t = mean + std * torch.randn(shape, generator=g, dtype=f64)
    return t.to(torch.float32)  # what the file stores; the math starts from exactly these values


def params(name, c, g):
    C, NH, NKV, HS = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"]
    p = {"model.embed_tokens.weight": rand(g, (V, C), 1.0)}
    for i in range(c["layers"]):
        h = f"model.layers.{i}."
        p[h + "input_layernorm.weight"] = rand(g, (C,), 0.1, 1.0)
        p[h + "post_attention_layernorm.weight"] = rand(g, (C,), 0.1, 1.0)
        for proj, rows in (("q_proj", NH * HS), ("k_proj", NKV * HS), ("v_proj", NKV * HS)):
            p[h + f"self_attn.{proj}.weight"] = rand(g, (rows, C), 0.2)
            if c["qkv_bias"]:
                p[h + f"self_attn.{proj}.bias"] = rand(g, (rows,), 0.05)
        p[h + "self_attn.o_proj.weight"] = rand(g, (C, NH * HS), 0.2)
        if c["qk_norm"]:
            p[h + "self_attn.q_norm.weight"] = rand(g, (HS,), 0.1, 1.0)
            p[h + "self_attn.k_norm.weight"] = rand(g, (HS,), 0.1, 1.0)
        if not c["sparse"][i]:
            FF = c["inter"]
            for proj, shape in (("gate_proj", (FF, C)), ("up_proj", (FF, C)), ("down_proj", (C, FF))):
                p[h + f"mlp.{proj}.weight"] = rand(g, shape, 0.2)
            continue
        FF = c["moe_inter"]
        m = h + ("block_sparse_moe." if name == "mixtral" else "mlp.")
        p[m + "gate.weight"] = rand(g, (c["experts"], C), 0.6)
        names = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(c["experts"]):
            for proj, shape in zip(names, ((FF, C), (FF, C), (C, FF))):
                p[m + f"experts.{e}.{proj}.weight"] = rand(g, shape, 0.2)
        if c["shared"]:
            S = c["shared"]
            for proj, shape in (("gate_proj", (S, C)), ("up_proj", (S, C)), ("down_proj", (C, S))):
                p[m + f"shared_expert.{proj}.weight"] = rand(g, shape, 0.2)
            p[m + "shared_expert_gate.weight"] = rand(g, (1, C), 0.2)
    p["model.norm.weight"] = rand(g, (C,), 0.1, 1.0)
    if not c["tied"]:
        p["lm_head.weight"] = rand(g, (V, C), 0.2)
    return p


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def forward(name, c, p, tokens, gaps):
    """Logits (B, T, V) of tokens (B, T); appends every sparse layer's router margins to `gaps`."""
    Pm = {k: v.to(f64) for k, v in p.items()}
    C, NH, NKV, HS, eps = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], c["eps"]
    Bn, Tn = tokens.shape
    G = NH // NKV

    def lin(n, x):
        return F.linear(x, Pm[n + ".weight"], Pm.get(n + ".bias"))

    def rms(w, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def mlp(pre, x):
        return lin(pre + "down_proj", F.silu(lin(pre + "gate_proj", x)) * lin(pre + "up_proj", x))

    inv_freq = 1.0 / (c["theta"] ** (torch.arange(0, HS, 2, dtype=f64) / HS))
    angles = torch.arange(Tn, dtype=f64)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(torch.float32).to(f64), emb.sin().to(torch.float32).to(f64)
    causal = torch.tril(torch.ones(Tn, Tn, dtype=torch.bool))
    x = Pm["model.embed_tokens.weight"][tokens]
    for i in range(c["layers"]):
        h = f"model.layers.{i}."
        a = rms(Pm[h + "input_layernorm.weight"], x)
        q = lin(h + "self_attn.q_proj", a).view(Bn, Tn, NH, HS)
        k = lin(h + "self_attn.k_proj", a).view(Bn, Tn, NKV, HS)
        v = lin(h + "self_attn.v_proj", a).view(Bn, Tn, NKV, HS).transpose(1, 2)
        if c["qk_norm"]:
            q = rms(Pm[h + "self_attn.q_norm.weight"], q)
            k = rms(Pm[h + "self_attn.k_norm.weight"], k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(G, dim=1)  # repeat_kv
        v = v.repeat_interleave(G, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(HS)
        s = s.masked_fill(~causal, float("-inf"))
        y = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(Bn, Tn, NH * HS)
        x = x + lin(h + "self_attn.o_proj", y)
        m = rms(Pm[h + "post_attention_layernorm.weight"], x)
        if not c["sparse"][i]:
            x = x + mlp(h + "mlp.", m)
            continue
        pre = h + ("block_sparse_moe." if name == "mixtral" else "mlp.")
        flat = m.reshape(-1, C)
        logits = lin(pre + "gate", flat)
        srt = torch.sort(logits, dim=-1, descending=True).values
        gaps.append(float((srt[:, c["topk"] - 1] - srt[:, c["topk"]]).min()))
        probs = torch.softmax(logits, dim=-1)
        top, idx = torch.topk(probs, c["topk"], dim=-1)
        if c["norm_topk"]:
            top = top / top.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(c["experts"]):
            ex = pre + f"experts.{e}."
            if name == "mixtral":
                ye = lin(ex + "w2", F.silu(lin(ex + "w1", flat)) * lin(ex + "w3", flat))
            else:
                ye = mlp(ex, flat)
            weight = (top * (idx == e)).sum(dim=-1, keepdim=True)  # p_k of the tokens that chose e, else 0
            out = out + weight * ye
        if c["shared"]:
            gate = torch.sigmoid(lin(pre + "shared_expert_gate", flat))
            out = out + gate * mlp(pre + "shared_expert.", flat)
        x = x + out.view(Bn, Tn, C)
    x = rms(Pm["model.norm.weight"], x)
    head = Pm["model.embed_tokens.weight"] if c["tied"] else Pm["lm_head.weight"]
    return x @ head.t()


def greedy(name, c, p, prompt, gaps):
    seq, toks, logits = list(prompt), [], []
    for _ in range(STEPS):
        last = forward(name, c, p, torch.tensor([seq]), gaps)[0, -1]
        top2 = torch.topk(last, 2).values
        if float(top2[0] - top2[1]) <= MARGIN:
            return None
        t = int(torch.argmax(last))
        toks.append(t)
        logits.append(last)
        seq.append(t)
    return toks, torch.stack(logits)


def config(name, c):
    common = {"attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": c["hidden"], "initializer_range": 0.02, "max_position_embeddings": P,
              "num_attention_heads": c["heads"], "num_hidden_layers": c["layers"],
              "num_key_value_heads": c["kv_heads"], "num_experts_per_tok": c["topk"], "output_router_logits": False,
              "rms_norm_eps": c["eps"], "rope_scaling": None, "rope_theta": c["theta"],
              "tie_word_embeddings": c["tied"], "torch_dtype": "float32", "transformers_version": "4.51.0",
              "use_cache": True, "vocab_size": V}
    if name == "mixtral":
        return dict(common, architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=c["inter"],
                    num_local_experts=c["experts"], router_aux_loss_coef=0.02, router_jitter_noise=0.0,
                    sliding_window=None)
    dense = [i for i in range(c["layers"]) if not c["sparse"][i]]
    qwen = dict(common, intermediate_size=c["inter"], moe_intermediate_size=c["moe_inter"], num_experts=c["experts"],
                norm_topk_prob=c["norm_topk"], router_aux_loss_coef=0.001, use_sliding_window=False,
                sliding_window=None, max_window_layers=c["layers"])
    if name == "qwen2_moe":
        return dict(qwen, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", decoder_sparse_step=1,
                    mlp_only_layers=dense, shared_expert_intermediate_size=c["shared"], qkv_bias=True)
    return dict(qwen, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=2,
                mlp_only_layers=[], head_dim=c["head_dim"], attention_bias=False)


def write_dir(name, cfg, tensors):
    d = os.path.join(FIXTURES, "hf_" + name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    st.save(os.path.join(d, "model.safetensors"), {k: v.numpy() for k, v in tensors.items()}, {"format": "pt"})


def main():
    torch.set_num_threads(1)
    ref = {}
    for name, c in CASES.items():
        for attempt in range(200):
            g = torch.Generator().manual_seed(zlib.crc32(f"hf_moe/{name}/{attempt}".encode()))
            p = params(name, c, g)
            tokens = torch.randint(0, V, (B, T), generator=g)
            prompt = torch.randint(0, V, (PROMPT,), generator=g).tolist()
            gaps = []
            logits = forward(name, c, p, tokens, gaps)
            out = greedy(name, c, p, prompt, gaps)
            if out is not None and min(gaps) > MARGIN and len(set(out[0])) >= 4:
                break
        else:
            raise SystemExit(f"{name}: no seed without near ties")
        write_dir(name, config(name, c), p)
        ref[f"{name}.tokens"] = tokens.to(torch.int32).numpy()
        ref[f"{name}.logits"] = logits.to(torch.float32).numpy()
        ref[f"{name}.prompt"] = torch.tensor(prompt, dtype=torch.int32).numpy()
        ref[f"{name}.gen.tokens"] = torch.tensor(out[0], dtype=torch.int32).numpy()
        ref[f"{name}.gen.logits"] = out[1].to(torch.float32).numpy()
        assert np.isfinite(ref[f"{name}.logits"]).all()
        size = os.path.getsize(os.path.join(FIXTURES, "hf_" + name, "model.safetensors"))
        print(f"  {name:9s} seed attempt {attempt}, router margin {min(gaps):.4f}, prompt {prompt} -> {out[0]}; "
              f"model.safetensors {size} bytes")
    n = st.save(os.path.join(FIXTURES, "hf_moe_reference.safetensors"), ref,
                {"vocab_size": str(V), "generator": "tests/golden/gen_hf_moe_models.py"})
    print(f"fixtures/hf_moe_reference.safetensors: {n} bytes")


if __name__ == "__main__":
    main()
