"""Whole-model PyTorch reference for Loom's Llama-family options (GPTModel with Megatron's Llama flags),
computed in float64.

Run:  /usr/bin/python3 tests/golden/gen_llama_model.py      (torch 1.13, no transformers; a few seconds)
Writes tests/golden/fixtures/llama_tiny.safetensors (~0.5 MB, float32 storage, float64 math), read by
tests/golden/test_golden_llama_model.cpp.

The reference is written out from Hugging Face's LlamaModel (transformers is not installed): LlamaRMSNorm
x * rsqrt(mean(x^2) + eps) * w, apply_rotary_pos_emb with rotate_half, repeat_kv for grouped-query
attention, LlamaMLP down(act(gate(x)) * up(x)), an untied lm_head; plus the options Megatron adds on top
(Qwen-style q/k norms and qkv bias, --kv-channels, partial and interleaved RoPE, Llama 3.1 frequency
scaling, sliding-window attention, LayerNorm, tied output layer, GeGLU).

Common shapes: L=2 layers, hidden C=16, NH=4 query heads, seq T=12, micro-batch B=2, vocab V=53 padded to
Vp=64, FFN width F=24, norm eps 1e-5, no dropout.

Cases (metadata "cases"; each case's config is in "<case>.<key>" metadata entries, flag names in brackets):
  mha, gqa, mqa          Llama: RMSNorm, SwiGLU, RoPE base 1e4, untied output, no biases; NKV = 4, 2, 1
                         key/value heads [--group-query-attention --num-query-groups NKV]
  mha_window, ...        the same weights with a sliding window [--window-size 3,0]: query i sees keys
                         j with i - 3 <= j <= i, i.e. j > i - window for window = 4 keys
  qwen                   RMSNorm, SwiGLU, NKV = 2, head size 6 (NH*HS = 24 != C) [--kv-channels 6], q/k
                         RMSNorm per head before RoPE [--qk-layernorm], qkv bias only [--disable-bias-linear
                         --add-qkv-bias], untied, RoPE base 1e6 with Llama 3.1 scaling (factor 8, low/high
                         frequency factors 1/4, original context 8192) [--use-rope-scaling]
  mixed                  LayerNorm, GeGLU (config only: Megatron has no flag), MQA, head size 8, q/k
                         LayerNorm, all linear biases, tied output layer, RoPE on half of each head
                         [--rotary-percent 0.5] with interleaved pairs [--rotary-interleaved], base 5e5,
                         Llama 3.1 scaling, window [--window-size 5,0]

Layout (Loom's = Megatron-core's names):
  embedding.word_embeddings.weight (Vp, C); output_layer.weight (Vp, C) when untied
  decoder.layers.{i}.input_layernorm.weight (+ .bias for LayerNorm)
  decoder.layers.{i}.self_attention.linear_qkv.weight ((NH + 2 NKV) HS, C) (+ .bias): grouped order, for
      each key/value group g: its G = NH/NKV query heads, its key head, its value head (HS rows each);
      query head h = g*G + j uses key/value head g (what repeat_kv does)
  decoder.layers.{i}.self_attention.q_layernorm.weight, k_layernorm.weight (HS) (+ .bias)  [qk-layernorm]
  decoder.layers.{i}.self_attention.linear_proj.weight (C, NH HS) (+ .bias)
  decoder.layers.{i}.pre_mlp_layernorm.weight (+ .bias)
  decoder.layers.{i}.mlp.linear_fc1.weight (2F, C) (+ .bias) = [gate_proj; up_proj]
  decoder.layers.{i}.mlp.linear_fc2.weight (C, F) (+ .bias) = down_proj
  decoder.final_layernorm.weight (+ .bias)
RoPE: inv_freq[i] = 1 / base^(2i / rd), rd = int(HS * rotary_percent) channels of each q and k head rotate
(position t = the token's index), the rest pass through; rotate_half pairs (c, c + rd/2), interleaved
pairs (2c, 2c + 1). cos/sin tables are computed in float64 and rounded to float32 (what Loom's tables
hold); the reference uses exactly those values.

Init (so that every path carries signal): embeddings N(0, 1); qkv weights N(0, 0.3), other weights
N(0, 0.15); biases N(0, 0.05); norm weights 1 + N(0, 0.1), norm biases N(0, 0.05); padded vocabulary rows
random too. Values are rounded to float32 first and the float64 math starts from exactly those.

Tensors (all F32 unless noted), per case <c>:
  <c>.param.<name>       every parameter            <c>.tokens, <c>.targets   I32 (B, T) in [0, V)
  <c>.ref.logits         (B, T, Vp)                 <c>.ref.loss              (1,) mean over the B*T tokens
  <c>.ref.grad.<name>    gradient of the mean loss for every parameter
Deterministic: fixed seeds, single thread, so regenerating gives identical bytes.
"""
import math
import os
import sys
import zlib

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_py as st  # noqa: E402

f64 = torch.float64
L, C, NH, T, B, V, Vp, FFN, EPS = 2, 16, 4, 12, 2, 53, 64, 24, 1e-5

LLAMA = dict(normalization="RMSNorm", activation="swiglu", kv_channels=C // NH, num_query_groups=NH,
             add_bias_linear=0, add_qkv_bias=0, untie=1, qk_layernorm=0, rotary_base=10000.0,
             rotary_percent=1.0, rotary_interleaved=0, use_rope_scaling=0, window_left=-1)


def case_configs():
    cases = {}
    for name, nkv in (("mha", 4), ("gqa", 2), ("mqa", 1)):
        cases[name] = dict(LLAMA, num_query_groups=nkv)
        cases[name + "_window"] = dict(LLAMA, num_query_groups=nkv, window_left=3, weights=name)
    cases["qwen"] = dict(LLAMA, num_query_groups=2, kv_channels=6, qk_layernorm=1, add_qkv_bias=1,
                         rotary_base=1e6, use_rope_scaling=1)
    cases["mixed"] = dict(normalization="LayerNorm", activation="geglu", kv_channels=8, num_query_groups=1,
                          add_bias_linear=1, add_qkv_bias=0, untie=0, qk_layernorm=1, rotary_base=5e5,
                          rotary_percent=0.5, rotary_interleaved=1, use_rope_scaling=1, window_left=5)
    return cases


def layernorm_kind(cfg):
    return cfg["normalization"] == "LayerNorm"


def param_shapes(cfg):
    """Loom's parameter names and shapes, in the order init_params draws them. Keys a config may leave
    out (gen_generate_reference.py's): ffn_hidden_size (FFN), add_qkv_bias, qk_layernorm (0),
    position_embedding_type ("rope"; "learned_absolute" adds position_embeddings of max_positions rows),
    activation "gelu" (an ungated MLP, fc1 F rows)."""
    HS, NKV, FF = cfg["kv_channels"], cfg["num_query_groups"], cfg.get("ffn_hidden_size", FFN)
    ln = layernorm_kind(cfg)
    qkv_bias = cfg["add_bias_linear"] or cfg.get("add_qkv_bias", 0)
    bias = cfg["add_bias_linear"]
    fc1_rows = FF if cfg["activation"] == "gelu" else 2 * FF
    shapes = {"embedding.word_embeddings.weight": (Vp, C)}
    if cfg.get("position_embedding_type", "rope") == "learned_absolute":
        shapes["embedding.position_embeddings.weight"] = (cfg["max_positions"], C)

    def norm(prefix, n):
        shapes[prefix + ".weight"] = (n,)
        if ln:
            shapes[prefix + ".bias"] = (n,)

    for i in range(L):
        p = f"decoder.layers.{i}."
        norm(p + "input_layernorm", C)
        norm(p + "pre_mlp_layernorm", C)
        shapes[p + "self_attention.linear_qkv.weight"] = ((NH + 2 * NKV) * HS, C)
        if qkv_bias:
            shapes[p + "self_attention.linear_qkv.bias"] = ((NH + 2 * NKV) * HS,)
        shapes[p + "self_attention.linear_proj.weight"] = (C, NH * HS)
        if bias:
            shapes[p + "self_attention.linear_proj.bias"] = (C,)
        if cfg.get("qk_layernorm", 0):
            norm(p + "self_attention.q_layernorm", HS)
            norm(p + "self_attention.k_layernorm", HS)
        shapes[p + "mlp.linear_fc1.weight"] = (fc1_rows, C)
        shapes[p + "mlp.linear_fc2.weight"] = (C, FF)
        if bias:
            shapes[p + "mlp.linear_fc1.bias"] = (fc1_rows,)
            shapes[p + "mlp.linear_fc2.bias"] = (C,)
    norm("decoder.final_layernorm", C)
    if cfg["untie"]:
        shapes["output_layer.weight"] = (Vp, C)
    return shapes


def init_params(cfg, g):
    """The init of the docstring; a config may override the word-embedding and other-weight stds with
    emb_std (1) and w_std (0.15). Learned positions are N(0, 0.5)."""
    params = {}
    for name, shape in param_shapes(cfg).items():
        if "layernorm" in name and name.endswith(".weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=f64)
        elif name.endswith(".bias"):
            t = 0.05 * torch.randn(shape, generator=g, dtype=f64)
        elif "word_embeddings" in name:
            t = cfg.get("emb_std", 1.0) * torch.randn(shape, generator=g, dtype=f64)
        elif "position_embeddings" in name:
            t = 0.5 * torch.randn(shape, generator=g, dtype=f64)
        elif "linear_qkv" in name:
            t = 0.3 * torch.randn(shape, generator=g, dtype=f64)
        else:
            t = cfg.get("w_std", 0.15) * torch.randn(shape, generator=g, dtype=f64)
        params[name] = t.to(torch.float32).to(f64)
    return params


def inv_freq(cfg, rd):
    """Megatron RotaryEmbedding / HF LlamaRotaryEmbedding frequencies, with _compute_llama3_parameters."""
    base = cfg["rotary_base"]
    inv = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=f64) / rd))
    if cfg["use_rope_scaling"]:
        factor, low, high, old_ctx = 8.0, 1.0, 4.0, 8192.0
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_tables(cfg, rd, n_pos=T):
    angles = torch.arange(n_pos, dtype=f64)[:, None] * inv_freq(cfg, rd)[None, :]  # (n_pos, rd/2)
    # Loom's tables are float32: the reference rotates with exactly those values.
    return angles.cos().to(torch.float32).to(f64), angles.sin().to(torch.float32).to(f64)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(x, cos, sin, rd, interleaved):
    """x (..., HS); cos/sin (..., rd/2) broadcastable. HF apply_rotary_pos_emb on the first rd channels
    (the rest pass through); interleaved: GPT-J / Megatron --rotary-interleaved pairs. gen_llama_ops.py
    uses it too."""
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    if interleaved:
        c, s = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        y = x_rot * c + rotate_every_two(x_rot) * s
    else:
        c, s = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        y = x_rot * c + rotate_half(x_rot) * s
    return torch.cat((y, x_pass), dim=-1)


def norm(cfg, P, prefix, x):
    if layernorm_kind(cfg):
        return F.layer_norm(x, (x.shape[-1],), P[prefix + ".weight"], P[prefix + ".bias"], EPS)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * P[prefix + ".weight"]


def linear(P, prefix, x):
    return F.linear(x, P[prefix + ".weight"], P.get(prefix + ".bias"))


def act(cfg, gate):
    if cfg["activation"] == "swiglu":
        return F.silu(gate)
    return F.gelu(gate, approximate="tanh")


def mlp(cfg, fc1_out):
    """fc1 output -> fc2 input: act(gate) * up for the gated kinds, GeLU (tanh) for "gelu"."""
    if cfg["activation"] == "gelu":
        return F.gelu(fc1_out, approximate="tanh")
    gate, up = fc1_out.chunk(2, dim=-1)
    return act(cfg, gate) * up


def logits_of(cfg, P, tokens):
    """Logits (B, T, Vp) of the full causal forward over tokens (B, T); T may differ from the global T."""
    B, T = tokens.shape
    HS, NKV = cfg["kv_channels"], cfg["num_query_groups"]
    G = NH // NKV
    rope = cfg.get("position_embedding_type", "rope") == "rope"
    x = P["embedding.word_embeddings.weight"][tokens]
    if rope:
        rd = int(HS * cfg["rotary_percent"])
        cos, sin = rope_tables(cfg, rd, T)
    else:
        x = x + P["embedding.position_embeddings.weight"][:T]
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    visible = j <= i
    if cfg["window_left"] >= 0:
        visible = visible & (j > i - (cfg["window_left"] + 1))
    for layer in range(L):
        p = f"decoder.layers.{layer}."
        h = norm(cfg, P, p + "input_layernorm", x)
        qkv = linear(P, p + "self_attention.linear_qkv", h).view(B, T, NKV, G + 2, HS)
        q = qkv[:, :, :, :G].reshape(B, T, NH, HS).transpose(1, 2)  # head g*G + j
        k = qkv[:, :, :, G].transpose(1, 2)  # (B, NKV, T, HS)
        v = qkv[:, :, :, G + 1].transpose(1, 2)
        if cfg.get("qk_layernorm", 0):
            q = norm(cfg, P, p + "self_attention.q_layernorm", q)
            k = norm(cfg, P, p + "self_attention.k_layernorm", k)
        if rope:
            q = apply_rope(q, cos, sin, rd, cfg["rotary_interleaved"])
            k = apply_rope(k, cos, sin, rd, cfg["rotary_interleaved"])
        k = k.repeat_interleave(G, dim=1)  # repeat_kv: head h reads key/value head h // G
        v = v.repeat_interleave(G, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(HS)
        s = s.masked_fill(~visible, float("-inf"))
        y = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, T, NH * HS)
        x = x + linear(P, p + "self_attention.linear_proj", y)
        h = norm(cfg, P, p + "pre_mlp_layernorm", x)
        x = x + linear(P, p + "mlp.linear_fc2", mlp(cfg, linear(P, p + "mlp.linear_fc1", h)))
    x = norm(cfg, P, "decoder.final_layernorm", x)
    head = P["output_layer.weight"] if cfg["untie"] else P["embedding.word_embeddings.weight"]
    return x @ head.t()


def forward(cfg, P, tokens, targets):
    logits = logits_of(cfg, P, tokens)
    loss = F.cross_entropy(logits[..., :V].reshape(B * T, V), targets.reshape(B * T))
    return logits, loss


def main():
    torch.set_num_threads(1)
    tensors, meta = {}, {}
    cases = case_configs()
    weights = {}
    for name, cfg in cases.items():
        base = cfg.get("weights", name)
        g = torch.Generator().manual_seed(zlib.crc32(("llama_model/" + base).encode()))
        if base not in weights:
            P0 = init_params(cfg, g)
            tokens = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
            targets = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
            weights[base] = (P0, tokens, targets)
        P0, tokens, targets = weights[base]
        P = {n: t.clone().requires_grad_(True) for n, t in P0.items()}
        logits, loss = forward(cfg, P, tokens, targets)
        loss.backward()
        tensors[f"{name}.tokens"] = tokens.to(torch.int32).numpy()
        tensors[f"{name}.targets"] = targets.to(torch.int32).numpy()
        tensors[f"{name}.ref.logits"] = logits.detach().to(torch.float32).numpy()
        tensors[f"{name}.ref.loss"] = loss.detach().reshape(1).to(torch.float32).numpy()
        for n in P:
            tensors[f"{name}.param.{n}"] = P0[n].to(torch.float32).numpy()
            tensors[f"{name}.ref.grad.{n}"] = P[n].grad.to(torch.float32).numpy()
        for k, v in cfg.items():
            if k != "weights":
                meta[f"{name}.{k}"] = str(v)
        print(f"  {name:12s} loss {float(loss):.6f}  ({len(P)} parameters)")
    meta.update({"cases": ",".join(cases), "generator": "tests/golden/gen_llama_model.py",
                 "num_layers": str(L), "hidden_size": str(C), "num_attention_heads": str(NH),
                 "seq_length": str(T), "micro_batch_size": str(B), "vocab_size": str(V),
                 "padded_vocab_size": str(Vp), "ffn_hidden_size": str(FFN), "norm_epsilon": str(EPS),
                 "reference": "float64 math, stored as float32"})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "llama_tiny.safetensors")
    n = st.save(path, tensors, meta)
    print(f"wrote {os.path.relpath(path)} ({n / 1024:.1f} KiB, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
