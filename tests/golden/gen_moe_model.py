"""Whole-model PyTorch reference for Loom's mixture-of-experts GPTModel (a tiny Llama-style MoE), computed
in float64.

Run:  /usr/bin/python3 tests/golden/gen_moe_model.py      (torch 1.13, no transformers; a few seconds)
Writes tests/golden/fixtures/moe_tiny.safetensors (float32 storage, float64 math), read by
tests/golden/test_golden_moe_model.cpp.

The decoder is gen_llama_model.py's Llama (RMSNorm, RoPE with rotate_half, grouped-query attention via
repeat_kv, SwiGLU, untied lm_head; its helpers are reused) with the MLP of the layers that
--moe-layer-freq marks replaced by a sparse MoE block written out from Hugging Face's
MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock (transformers is not installed): router logits, per-token
routing weights over the chosen experts, a loop over experts that runs each one on the tokens routed to
it (index_add of weight · expert(x)), plus shared experts on every token, scaled by sigmoid(x · gate) with
the shared-expert gate. The routing and the losses follow Megatron-Core's documented semantics
(moe_utils.topk_softmax_with_capacity, router.TopKRouter, MoEAuxLossAutoScaler; Loom's
include/loom/nn/moe.h), written here from the formulas, no code copied:
  - softmax (Mixtral): softmax over all experts, top-k, the k probs divided by their sum; the script
    asserts this equals Megatron's softmax over the k largest logits;
  - pre-softmax (Qwen-MoE, norm_topk_prob False): the top-k of the full softmax, not renormalised;
  - sigmoid: top-k of sigmoid(logits) + expert bias (bias for selection only), probs = s / (sum + 1e-20);
  - --moe-router-topk-scaling-factor multiplies the probs;
  - capacity = ceil(N k / E * factor) over the micro-batch's N = B*T tokens; drop policy probs keeps each
    expert's `capacity` largest probs (ties to the lower token, never hit here);
  - aux_loss (Switch, Megatron's normalisation, which divides Hugging Face's by k):
    coeff * E / (k N^2) * sum_e (sum_n scores[n, e]) * count[e], scores = softmax(logits) (sigmoid:
    sigmoid / (sum + 1e-20)), count[e] = tokens whose top-k of those scores holds e, before any drop;
    seq_aux_loss: the same per sequence of T tokens (coeff * sum_e (E count_b[e] / (T k)) * mean_t
    scores), averaged over the B sequences;
  - z-loss: coeff * mean_n logsumexp(logits[n])^2;
  - MoEAuxLossAutoScaler: the losses' gradients enter with the main loss's backward scale. For one
    micro-batch in FP32 (loss scale 1, one micro-batch) that scale is 1, so the gradients stored are
    those of   objective = mean cross-entropy over the B*T tokens + sum over MoE layers (aux + z),
while the loss stored (and what GPTModel::forward returns) is the mean cross-entropy alone.

Common shapes (small, to keep the fixture small): L=3 layers, hidden C=32, NH=4 query heads, NKV=2
key/value groups, head size 4 [--kv-channels 4], seq T=8, micro-batch B=2 (N=16 tokens), vocab V=29
padded to Vp=32, dense FFN width 16, E=4 experts of width 8 [--moe-ffn-hidden-size 8], top-k 2, RMSNorm
eps 1e-5, RoPE base 1e4, untied output layer, no biases, no dropout.

Weight sets (metadata "weight_sets"; a case names its set in "<case>.weights"): "a" with
--moe-layer-freq [1,0,1], "b" with [0,1,1] and shared experts of width 8 with a gate, "c" with [1,1,0].
Cases (metadata "cases"; each case's config is in "<case>.<key>" metadata, flags in brackets):
  mixtral          set a; softmax routing, aux_loss coeff 0.25 [--moe-aux-loss-coeff], z-loss 0.0625
                   [--moe-z-loss-coeff]
  mixtral_seqaux   set a; the same with [--moe-router-load-balancing-type seq_aux_loss], no z-loss
  qwen             set b; [--moe-router-pre-softmax], [--moe-router-topk-scaling-factor 1.5], shared
                   experts with [--moe-shared-expert-gate], aux_loss 0.125
  capacity         set c; softmax, [--moe-expert-capacity-factor 1.0 --moe-token-drop-policy probs]
                   (capacity 8 per expert; the script asserts every MoE layer drops tokens), aux 0.125
  sigmoid_bias     set b (shared experts with the gate); [--moe-router-score-function sigmoid
                   --moe-router-enable-expert-bias] with the expert bias given (the script asserts it
                   changes some token's experts), scaling factor 2.5, aux_loss 0.125, z-loss 0.03125
Every case's routing decisions are away from ties: the generator redraws a set's weights (attempt
counter in "<set>.attempt") until, in every case using it, each token's k-th and (k+1)-th selection
scores differ by at least 0.02 (logits; 0.005 for sigmoid + bias) and each over-full expert's
capacity-th and next prob by at least 0.005, so Loom's float32 forward routes exactly like this float64
one.

Layout: Loom's (Megatron-core's) names, gen_llama_model.py's for the dense parts, and
  decoder.layers.{i}.mlp.router.weight (E, C)
  decoder.layers.{i}.mlp.experts.linear_fc1.weight{e} (2F, C) = [gate; up], linear_fc2.weight{e} (C, F)
  decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight (2S, C), linear_fc2.weight (C, S),
  decoder.layers.{i}.mlp.shared_experts.gate_weight (1, C)
Init: embeddings N(0, 1); qkv N(0, 0.3); router N(0, 0.35); other weights N(0, 0.15); norms 1 + N(0, 0.1);
rounded to float32 first and the float64 math starts from exactly those values.

Tensors (F32 unless noted):
  <set>.param.<name>   every parameter of the set        <set>.tokens, <set>.targets  I32 (B, T)
  <case>.expert_bias.<layer>   (E) the router's expert bias (sigmoid_bias only)
  <case>.ref.logits (B, T, Vp)   <case>.ref.loss (1,) mean cross-entropy   <case>.ref.objective (1,)
  <case>.ref.grad.<name>         gradient of the objective for every parameter
  <case>.ref.aux.<layer>, <case>.ref.z.<layer>   (1,) a MoE layer's losses WITHOUT their coefficients
                                                 (Loom's MoeLayerStats; 0 when the loss is off)
  <case>.ref.tokens_per_expert.<layer>  (E) rows per expert after capacity (the routing map's column sums)
Deterministic: fixed seeds, single thread, so regenerating gives identical bytes.
"""
import math
import os
import sys
import zlib

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_llama_model as llama  # noqa: E402
import safetensors_py as st  # noqa: E402

f64 = torch.float64
L, C, NH, NKV, HS, T, B, V, Vp, FFN = 3, 32, 4, 2, 4, 8, 2, 29, 32, 16
E, K, FMOE, SHARED = 4, 2, 8, 8
N = B * T
ARCH = dict(normalization="RMSNorm", rotary_base=10000.0, use_rope_scaling=0)

WEIGHT_SETS = {
    "a": dict(layer_freq=[1, 0, 1], shared=0),
    "b": dict(layer_freq=[0, 1, 1], shared=SHARED),
    "c": dict(layer_freq=[1, 1, 0], shared=0),
}

# Router settings; defaults below. Coefficients and factors are exact in float32.
ROUTER = dict(score="softmax", pre_softmax=0, topk_scaling=0.0, lb="aux_loss", aux=0.0, z=0.0, capacity=0.0,
              drop="probs", expert_bias=0)
CASES = {
    "mixtral": dict(ROUTER, weights="a", mixtral=1, aux=0.25, z=0.0625),
    "mixtral_seqaux": dict(ROUTER, weights="a", mixtral=1, lb="seq_aux_loss", aux=0.25),
    "qwen": dict(ROUTER, weights="b", pre_softmax=1, topk_scaling=1.5, aux=0.125, shared_gate=1),
    "capacity": dict(ROUTER, weights="c", aux=0.125, capacity=1.0),
    "sigmoid_bias": dict(ROUTER, weights="b", score="sigmoid", expert_bias=1, topk_scaling=2.5, aux=0.125,
                         z=0.03125, shared_gate=1),
}
MARGIN_LOGIT, MARGIN_SIGMOID, MARGIN_CAPACITY = 0.02, 0.005, 0.005


def param_shapes(ws):
    shapes = {"embedding.word_embeddings.weight": (Vp, C)}
    for i in range(L):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (C,)
        shapes[p + "self_attention.linear_qkv.weight"] = ((NH + 2 * NKV) * HS, C)
        shapes[p + "self_attention.linear_proj.weight"] = (C, NH * HS)
        shapes[p + "pre_mlp_layernorm.weight"] = (C,)
        if ws["layer_freq"][i]:
            shapes[p + "mlp.router.weight"] = (E, C)
            for e in range(E):
                shapes[p + f"mlp.experts.linear_fc1.weight{e}"] = (2 * FMOE, C)
                shapes[p + f"mlp.experts.linear_fc2.weight{e}"] = (C, FMOE)
            if ws["shared"]:
                shapes[p + "mlp.shared_experts.linear_fc1.weight"] = (2 * ws["shared"], C)
                shapes[p + "mlp.shared_experts.linear_fc2.weight"] = (C, ws["shared"])
                shapes[p + "mlp.shared_experts.gate_weight"] = (1, C)
        else:
            shapes[p + "mlp.linear_fc1.weight"] = (2 * FFN, C)
            shapes[p + "mlp.linear_fc2.weight"] = (C, FFN)
    shapes["decoder.final_layernorm.weight"] = (C,)
    shapes["output_layer.weight"] = (Vp, C)
    return shapes


def init_params(ws, g):
    params = {}
    for name, shape in param_shapes(ws).items():
        if "layernorm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=f64)
        elif "word_embeddings" in name:
            t = torch.randn(shape, generator=g, dtype=f64)
        elif "linear_qkv" in name:
            t = 0.3 * torch.randn(shape, generator=g, dtype=f64)
        elif "router" in name:
            t = 0.35 * torch.randn(shape, generator=g, dtype=f64)
        else:
            t = 0.15 * torch.randn(shape, generator=g, dtype=f64)
        params[name] = t.to(torch.float32).to(f64)
    return params


def stable_topk(v, k, dim):
    """Indices of the k largest along dim, best first, ties to the lower index (Loom's rule)."""
    return torch.sort(v, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)


class Margins:
    """The smallest distance of any routing decision from a tie, over a forward."""

    def __init__(self):
        self.ok = True
        self.worst = {}

    def check(self, what, sorted_vals, k, need):
        """sorted_vals (rows, n) descending; the gap between positions k-1 and k of every row."""
        if sorted_vals.shape[1] <= k:
            return
        gap = float((sorted_vals[:, k - 1] - sorted_vals[:, k]).min())
        self.worst[what] = min(self.worst.get(what, math.inf), gap)
        if gap < need:
            self.ok = False


def route(cfg, logits, bias, margins):
    """Megatron-Core's routing of logits (N, E): (probs (N, E) with 0 off the final routing map, the
    map)."""
    lg = logits.detach()
    if cfg["score"] == "softmax":
        margins.check("topk logits", torch.sort(lg, dim=1, descending=True).values, K, MARGIN_LOGIT)
        if cfg.get("mixtral"):
            # Hugging Face Mixtral: softmax over all experts, top-k, renormalise.
            w = torch.softmax(logits, dim=1)
            idx = stable_topk(w.detach(), K, 1)
            p = w.gather(1, idx)
            p = p / p.sum(dim=-1, keepdim=True)
            # Megatron's softmax after top-k picks and weighs the same.
            idx2 = stable_topk(lg, K, 1)
            assert torch.equal(idx, idx2)
            assert torch.allclose(p, torch.softmax(logits.gather(1, idx2), dim=-1), rtol=1e-12, atol=0)
        elif cfg["pre_softmax"]:
            s = torch.softmax(logits, dim=1)
            idx = stable_topk(s.detach(), K, 1)
            p = s.gather(1, idx)
        else:
            idx = stable_topk(lg, K, 1)
            p = torch.softmax(logits.gather(1, idx), dim=-1)
    else:
        s = torch.sigmoid(logits)
        sel = s.detach() + (bias if bias is not None else 0.0)
        margins.check("topk sigmoid+bias", torch.sort(sel, dim=1, descending=True).values, K, MARGIN_SIGMOID)
        idx = stable_topk(sel, K, 1)
        p = s.gather(1, idx)
        p = p / (p.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg["topk_scaling"]:
        p = p * cfg["topk_scaling"]
    gates = torch.zeros(N, E, dtype=f64).scatter(1, idx, p)
    topk_map = torch.zeros(N, E, dtype=torch.bool).scatter(1, idx, True)
    final_map = topk_map
    if cfg["capacity"]:
        cap = math.ceil(N * K / E * cfg["capacity"])
        assert cap <= N
        assert cfg["drop"] == "probs"
        gd = gates.detach()
        for e in range(E):  # decisions of the over-full experts must be away from ties
            if int(topk_map[:, e].sum()) > cap:
                margins.check("capacity probs", torch.sort(gd[:, e], descending=True).values[None, :], cap,
                              MARGIN_CAPACITY)
        keep = torch.zeros(N, E, dtype=torch.bool).scatter(0, stable_topk(gd, cap, 0), True)
        final_map = topk_map & keep
    return gates * final_map, final_map, topk_map, idx


def router_losses(cfg, logits, margins):
    """(aux, z) without their coefficients."""
    aux = torch.zeros((), dtype=f64)
    if cfg["aux"] and cfg["lb"] != "none":
        if cfg["score"] == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            sg = torch.sigmoid(logits)
            scores = sg / (sg.sum(dim=-1, keepdim=True) + 1e-20)
        margins.check("aux topk logits", torch.sort(logits.detach(), dim=1, descending=True).values, K,
                      MARGIN_LOGIT)
        lmap = torch.zeros(N, E, dtype=f64).scatter(1, stable_topk(scores.detach(), K, 1), 1.0)
        if cfg["lb"] == "aux_loss":
            aux = (scores.sum(dim=0) * lmap.sum(dim=0)).sum() * (E / (K * N * N))
        else:  # per sequence b: tokens b*T .. b*T + T - 1 (Megatron's (S, B) view, the same sequences)
            per_seq = []
            for b in range(B):
                cnt = lmap[b * T:(b + 1) * T].sum(dim=0) / (T * K / E)
                per_seq.append((cnt * scores[b * T:(b + 1) * T].mean(dim=0)).sum())
            aux = torch.stack(per_seq).mean()
    z = torch.zeros((), dtype=f64)
    if cfg["z"]:
        z = torch.logsumexp(logits, dim=-1).square().mean()
    return aux, z


def swiglu_mlp(x, w1, w2):
    gate, up = (x @ w1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def moe_block(cfg, P, p, h, bias, margins, record):
    """Sparse MoE block over h (N, C) (Mixtral's loop over experts), plus shared experts."""
    logits = h @ P[p + "mlp.router.weight"].t()
    probs, final_map, topk_map, idx = route(cfg, logits, bias, margins)
    y = torch.zeros_like(h)
    for e in range(E):
        top_x = torch.nonzero(final_map[:, e]).flatten()  # tokens routed to expert e, in token order
        out = swiglu_mlp(h[top_x], P[p + f"mlp.experts.linear_fc1.weight{e}"],
                         P[p + f"mlp.experts.linear_fc2.weight{e}"])
        y = y.index_add(0, top_x, out * probs[top_x, e, None])
    if p + "mlp.shared_experts.linear_fc1.weight" in P:
        s = swiglu_mlp(h, P[p + "mlp.shared_experts.linear_fc1.weight"], P[p + "mlp.shared_experts.linear_fc2.weight"])
        if cfg.get("shared_gate"):
            s = s * torch.sigmoid(h @ P[p + "mlp.shared_experts.gate_weight"].t())
        y = y + s
    aux, z = router_losses(cfg, logits, margins)
    record.append(dict(aux=aux, z=z, tokens_per_expert=final_map.sum(dim=0), dropped=int(topk_map.sum() - final_map.sum()),
                       idx=idx))
    return y, cfg["aux"] * aux + cfg["z"] * z


def forward(cfg, ws, P, tokens, targets, biases, margins):
    """(logits (B, T, Vp), mean cross-entropy, objective, per-MoE-layer records)."""
    x = P["embedding.word_embeddings.weight"][tokens]
    cos, sin = llama.rope_tables(ARCH, HS, T)
    i = torch.arange(T)[:, None]
    visible = torch.arange(T)[None, :] <= i
    G = NH // NKV
    extra = torch.zeros((), dtype=f64)
    records = []
    for layer in range(L):
        p = f"decoder.layers.{layer}."
        h = llama.norm(ARCH, P, p + "input_layernorm", x)
        qkv = (h @ P[p + "self_attention.linear_qkv.weight"].t()).view(B, T, NKV, G + 2, HS)
        q = qkv[:, :, :, :G].reshape(B, T, NH, HS).transpose(1, 2)
        k = qkv[:, :, :, G].transpose(1, 2)
        v = qkv[:, :, :, G + 1].transpose(1, 2)
        q = llama.apply_rope(q, cos, sin, HS, 0)
        k = llama.apply_rope(k, cos, sin, HS, 0)
        k = k.repeat_interleave(G, dim=1)
        v = v.repeat_interleave(G, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(HS)
        s = s.masked_fill(~visible, float("-inf"))
        att = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, T, NH * HS)
        x = x + att @ P[p + "self_attention.linear_proj.weight"].t()
        h = llama.norm(ARCH, P, p + "pre_mlp_layernorm", x)
        if ws["layer_freq"][layer]:
            y, losses = moe_block(cfg, P, p, h.reshape(N, C), biases.get(layer), margins, records)
            x = x + y.view(B, T, C)
            extra = extra + losses
        else:
            x = x + swiglu_mlp(h, P[p + "mlp.linear_fc1.weight"], P[p + "mlp.linear_fc2.weight"])
    x = llama.norm(ARCH, P, "decoder.final_layernorm", x)
    logits = x @ P["output_layer.weight"].t()
    loss = F.cross_entropy(logits[..., :V].reshape(N, V), targets.reshape(N))
    return logits, loss, loss + extra, records


def case_biases(name, cfg, ws):
    if not cfg["expert_bias"]:
        return {}
    g = torch.Generator().manual_seed(zlib.crc32(("moe_model_bias/" + name).encode()))
    return {i: (0.1 * torch.randn(E, generator=g, dtype=f64)).to(torch.float32).to(f64)
            for i in range(L) if ws["layer_freq"][i]}


def draw_set(set_name, ws):
    """The first attempt whose weights keep every case of the set away from routing ties."""
    users = {n: c for n, c in CASES.items() if c["weights"] == set_name}
    for attempt in range(200):
        g = torch.Generator().manual_seed(zlib.crc32(f"moe_model/{set_name}/{attempt}".encode()))
        P0 = init_params(ws, g)
        tokens = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
        targets = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
        ok = True
        for name, cfg in users.items():
            m = Margins()
            with torch.no_grad():
                _, _, _, rec = forward(cfg, ws, P0, tokens, targets, case_biases(name, cfg, ws), m)
            ok = ok and m.ok
            if cfg["capacity"]:  # the case must really drop tokens, in every MoE layer
                ok = ok and all(r["dropped"] > 0 for r in rec)
            if cfg["expert_bias"]:  # and the bias must really move some choice
                with torch.no_grad():
                    _, _, _, rec0 = forward(dict(cfg, expert_bias=0), ws, P0, tokens, targets, {}, Margins())
                ok = ok and any(not torch.equal(r["idx"], r0["idx"]) for r, r0 in zip(rec, rec0))
        if ok:
            return attempt, P0, tokens, targets
    raise RuntimeError(f"no tie-free weights for set {set_name}")


def main():
    torch.set_num_threads(1)
    tensors, meta = {}, {}
    sets = {}
    for set_name, ws in WEIGHT_SETS.items():
        attempt, P0, tokens, targets = draw_set(set_name, ws)
        sets[set_name] = (P0, tokens, targets)
        tensors[f"{set_name}.tokens"] = tokens.to(torch.int32).numpy()
        tensors[f"{set_name}.targets"] = targets.to(torch.int32).numpy()
        for n, t in P0.items():
            tensors[f"{set_name}.param.{n}"] = t.to(torch.float32).numpy()
        meta[f"{set_name}.attempt"] = str(attempt)
        meta[f"{set_name}.layer_freq"] = ",".join(str(v) for v in ws["layer_freq"])
        meta[f"{set_name}.shared"] = str(ws["shared"])
    for name, cfg in CASES.items():
        ws = WEIGHT_SETS[cfg["weights"]]
        P0, tokens, targets = sets[cfg["weights"]]
        biases = case_biases(name, cfg, ws)
        P = {n: t.clone().requires_grad_(True) for n, t in P0.items()}
        m = Margins()
        logits, loss, objective, records = forward(cfg, ws, P, tokens, targets, biases, m)
        assert m.ok
        objective.backward()
        tensors[f"{name}.ref.logits"] = logits.detach().to(torch.float32).numpy()
        tensors[f"{name}.ref.loss"] = loss.detach().reshape(1).to(torch.float32).numpy()
        tensors[f"{name}.ref.objective"] = objective.detach().reshape(1).to(torch.float32).numpy()
        for n in P:
            tensors[f"{name}.ref.grad.{n}"] = P[n].grad.to(torch.float32).numpy()
        moe_layers = [i for i in range(L) if ws["layer_freq"][i]]
        for layer, r in zip(moe_layers, records):
            tensors[f"{name}.ref.aux.{layer}"] = r["aux"].detach().reshape(1).to(torch.float32).numpy()
            tensors[f"{name}.ref.z.{layer}"] = r["z"].detach().reshape(1).to(torch.float32).numpy()
            tensors[f"{name}.ref.tokens_per_expert.{layer}"] = r["tokens_per_expert"].to(torch.float32).numpy()
        for layer, b in biases.items():
            tensors[f"{name}.expert_bias.{layer}"] = b.to(torch.float32).numpy()
        for k, v in cfg.items():
            meta[f"{name}.{k}"] = str(v)
        dropped = sum(r["dropped"] for r in records)
        margins = ", ".join(f"{k} {v:.3g}" for k, v in m.worst.items())
        print(f"  {name:15s} loss {float(loss):.6f} objective {float(objective):.6f} dropped {dropped} "
              f"(closest ties: {margins})")
    meta.update({"cases": ",".join(CASES), "weight_sets": ",".join(WEIGHT_SETS),
                 "generator": "tests/golden/gen_moe_model.py", "num_layers": str(L), "hidden_size": str(C),
                 "num_attention_heads": str(NH), "num_query_groups": str(NKV), "kv_channels": str(HS),
                 "seq_length": str(T), "micro_batch_size": str(B), "vocab_size": str(V),
                 "padded_vocab_size": str(Vp), "ffn_hidden_size": str(FFN), "num_experts": str(E),
                 "moe_router_topk": str(K), "moe_ffn_hidden_size": str(FMOE), "norm_epsilon": str(llama.EPS),
                 "rotary_base": str(ARCH["rotary_base"]), "reference": "float64 math, stored as float32"})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "moe_tiny.safetensors")
    n = st.save(path, tensors, meta)
    print(f"wrote {os.path.relpath(path)} ({n / 1024:.1f} KiB, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
