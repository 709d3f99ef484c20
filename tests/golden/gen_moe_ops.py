"""PyTorch golden references for the mixture-of-experts building blocks (include/loom/nn/moe.h): the router
(gate GEMM, score function, top-k, scaling, expert bias, capacity with both drop policies and padding,
aux_loss / seq_aux_loss / z-loss), the token permutation, the grouped expert MLP and the weighted
unpermutation, checked end to end by tests/golden/test_golden_moe.cpp.

Run:  /usr/bin/python3 tests/golden/gen_moe_ops.py      (torch 1.13 + numpy; about a second)
Writes tests/golden/fixtures/ops_moe.safetensors.

Written from the papers' and Megatron-Core's documented formulas (no code copied), in float64 with torch
autograd for every gradient:
  - HF Mixtral (MixtralSparseMoeBlock): softmax over all experts, top-k, divide the k probs by their sum;
    the "mixtral" case is routed this way, and the script asserts it equals Megatron's softmax-after-top-k;
  - Megatron-Core topk_softmax_with_capacity: pre-softmax (top-k of the full softmax, no renormalisation),
    sigmoid (top-k of sigmoid + expert bias for selection, probs = s / (sum + 1e-20) when k > 1), the top-k
    scaling factor, capacity = ceil(N k / E * factor) with drop policy probs (each expert keeps its
    `capacity` largest probs) or position (its first `capacity` tokens) and pad-to-capacity (the capacity
    mask is the routing map); capacity > N drops nothing;
  - aux_loss (switch_load_balancing_loss_func): sum_e (sum_n scores) * count_e * E * coeff / (k N^2) with
    scores = softmax (sigmoid: sigmoid / sum) and count from the top-k of those scores;
  - seq_aux_loss (sequence_load_balancing_loss_func) over Megatron's (S, B, E) view: Loom's tokens are
    (B, T) row-major, transposed to (T, B) here before the formula;
  - z-loss (z_loss_func): coeff * mean(logsumexp(logits)^2);
  - both losses enter the objective multiplied by grad_scale (MoEAuxLossAutoScaler's backward scale):
    objective = sum(y * dy) + grad_scale * (aux + z).
Every top-k breaks ties towards the lower index (stable descending sort), Loom's documented rule.
Rows are permuted expert-major, token order within an expert (Megatron's permute).
"""
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_ops  # noqa: E402
import safetensors_py as st  # noqa: E402
from gen_ops import f64, leaf, randn  # noqa: E402


class Writer(gen_ops.Writer):
    def save(self):
        self.meta["cases"] = ",".join(self.cases)
        self.meta["generator"] = "tests/golden/gen_moe_ops.py"
        self.meta["reference"] = "float64 math on the float32 inputs, stored as float32"
        path = os.path.join(gen_ops.FIXTURES, f"ops_{self.family}.safetensors")
        n = st.save(path, self.tensors, self.meta)
        print(f"  {os.path.relpath(path)}: {len(self.cases)} cases, {n / 1024:.1f} KiB")
        return n


def topk_low_index(v, k):
    """Indices of the k largest entries of each row, best first, ties to the lower index."""
    return torch.sort(v, dim=1, descending=True, stable=True).indices[:, :k]


def mixtral_routing(logits, k):
    """Hugging Face Mixtral: softmax over all experts, top-k, renormalise the k probs."""
    w = torch.softmax(logits, dim=1)
    idx = topk_low_index(w, k)
    p = w.gather(1, idx)
    return idx, p / p.sum(dim=-1, keepdim=True)


def megatron_routing(logits, c, bias):
    k = c["topk"]
    if c["score"] == "softmax" and not c["pre_softmax"]:
        idx = topk_low_index(logits, k)
        p = torch.softmax(logits.gather(1, idx), dim=-1)
    elif c["score"] == "softmax":
        s = torch.softmax(logits, dim=-1)
        idx = topk_low_index(s, k)
        p = s.gather(1, idx)
    else:
        s = torch.sigmoid(logits)
        idx = topk_low_index(s.detach() + (bias if bias is not None else 0), k)
        p = s.gather(1, idx)
        if k > 1:
            p = p / (p.sum(dim=-1, keepdim=True) + 1e-20)
    if c.get("scale"):
        p = p * c["scale"]
    return idx, p


def route(logits, c, bias):
    N, E = logits.shape
    k = c["topk"]
    if c.get("mixtral"):
        idx, p = mixtral_routing(logits, k)
        idx2, p2 = megatron_routing(logits, dict(c, score="softmax", pre_softmax=False), None)
        assert torch.equal(idx, idx2) and torch.allclose(p, p2, rtol=1e-12, atol=1e-15)
    else:
        idx, p = megatron_routing(logits, c, bias)
    gates = torch.zeros(N, E, dtype=f64).scatter(1, idx, p)
    tmap = torch.zeros(N, E, dtype=torch.bool).scatter(1, idx, True)
    fmap = tmap
    if c.get("capacity") is not None:
        cap = math.ceil((N * k / E) * c["capacity"])
        if cap > N:
            capmask = torch.ones(N, E, dtype=torch.bool)
        else:
            v = gates.detach() if c["drop"] == "probs" else tmap.to(f64)
            order = torch.sort(v, dim=0, descending=True, stable=True).indices[:cap]
            capmask = torch.zeros(N, E, dtype=torch.bool).scatter(0, order, True)
        fmap = capmask if c["pad"] else (tmap & capmask)
    return idx, gates * fmap, fmap


def aux_losses(logits, c, T):
    N, E = logits.shape
    k = c["topk"]
    aux = torch.zeros((), dtype=f64)
    if c["lb"] != "none" and c["aux"] != 0:
        if c["score"] == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            sg = torch.sigmoid(logits)
            scores = sg / (sg.sum(dim=-1, keepdim=True) + 1e-20)
        lmap = torch.zeros(N, E, dtype=f64).scatter(1, topk_low_index(scores.detach(), k), 1.0)
        if c["lb"] == "aux_loss":
            aux = (scores.sum(dim=0) * lmap.sum(dim=0)).sum() * (E * c["aux"] / (k * N * N))
        else:  # seq_aux_loss on Megatron's (S, B, E) view
            B = N // T
            probs_sbe = scores.view(B, T, E).transpose(0, 1)
            map_sbe = lmap.view(B, T, E).transpose(0, 1)
            cost = map_sbe.sum(dim=0) / (T * k / E)
            aux = (cost * probs_sbe.mean(dim=0)).sum(dim=1).mean() * c["aux"]
    z = torch.zeros((), dtype=f64)
    if c["z"] != 0:
        z = torch.logsumexp(logits, dim=-1).square().mean() * c["z"]
    return aux, z


def experts(xp, sizes, w1, w2, gated):
    outs, o = [], 0
    for e, m in enumerate(sizes):
        h = xp[o:o + m] @ w1[e].T
        if gated:
            Fh = h.shape[1] // 2
            a = F.silu(h[:, :Fh]) * h[:, Fh:]
        else:
            a = F.gelu(h, approximate="tanh")
        outs.append(a @ w2[e].T)
        o += m
    return torch.cat(outs, dim=0)


SCORES = {"softmax": 0, "sigmoid": 1}
LBS = {"aux_loss": 0, "seq_aux_loss": 1, "none": 2}
DROPS = {"probs": 0, "position": 1}

# name, N, T (sequence length), C, F, E, config
CASES = [
    ("mixtral_k2_e8", 10, 5, 16, 12, 8,
     dict(topk=2, score="softmax", pre_softmax=False, mixtral=True, lb="aux_loss", aux=0.125, z=0.0625,
          gated=True)),
    ("presoftmax_k2_e3_gelu", 5, 5, 8, 6, 3,
     dict(topk=2, score="softmax", pre_softmax=True, lb="aux_loss", aux=0.25, z=0.0, gated=False)),
    ("sigmoid_scaled_seqaux_n217", 217, 31, 8, 4, 8,
     dict(topk=2, score="sigmoid", pre_softmax=False, scale=2.5, lb="seq_aux_loss", aux=0.125, z=0.0625,
          gated=True)),
    ("capacity_probs_n37", 37, 37, 8, 6, 8,
     dict(topk=2, score="softmax", pre_softmax=False, lb="aux_loss", aux=0.125, z=0.0, capacity=1.0,
          drop="probs", pad=False, gated=True)),
    ("capacity_position_pad_n217_k1", 217, 7, 8, 4, 3,
     dict(topk=1, score="softmax", pre_softmax=True, lb="aux_loss", aux=0.0625, z=0.0625, capacity=0.5,
          drop="position", pad=True, gated=True)),
    ("capacity_probs_pad_n5", 5, 5, 8, 6, 8,
     dict(topk=2, score="softmax", pre_softmax=True, lb="none", aux=0.0, z=0.0, capacity=1.25, drop="probs",
          pad=True, gated=False)),
    ("capacity_above_n_pad", 5, 5, 8, 6, 3,
     dict(topk=2, score="softmax", pre_softmax=False, lb="aux_loss", aux=0.125, z=0.0, capacity=4.0,
          drop="probs", pad=True, gated=True)),
    ("sigmoid_k1_n1", 1, 1, 8, 6, 3,
     dict(topk=1, score="sigmoid", pre_softmax=False, lb="aux_loss", aux=0.125, z=0.0625, gated=True)),
    ("sigmoid_expert_bias_n37", 37, 37, 8, 6, 8,
     dict(topk=2, score="sigmoid", pre_softmax=False, bias=True, lb="none", aux=0.0, z=0.0, gated=True)),
]


def gen_moe():
    w = Writer("moe")
    for name, N, T, C, Fh, E, c in CASES:
        k = c["topk"]
        cap = c.get("capacity")
        g = w.case(name, N=N, T=T, C=C, F=Fh, E=E, topk=k, score=SCORES[c["score"]], pre_softmax=c["pre_softmax"],
                   lb=LBS[c["lb"]], has_capacity=cap is not None, drop=DROPS[c.get("drop", "probs")],
                   pad=c.get("pad", False), gated=c["gated"], expert_bias=c.get("bias", False))
        F1 = 2 * Fh if c["gated"] else Fh
        x = leaf(randn(g, N, C))
        wr = leaf(randn(g, E, C, scale=0.5))
        w1 = leaf(randn(g, E, F1, C, scale=0.3))
        w2 = leaf(randn(g, E, C, Fh, scale=0.3))
        dy = randn(g, N, C)
        bias = randn(g, E, scale=0.3) if c.get("bias") else None
        grad_scale = 0.5
        floats = dict(aux_coeff=c["aux"], z_coeff=c["z"], capacity=cap or 0.0, scale=c.get("scale", 0.0),
                      grad_scale=grad_scale)
        for key, v in floats.items():
            assert float(torch.tensor(v, dtype=torch.float32)) == v, key  # exact in f32
            w.put(name, key, torch.tensor([v], dtype=f64))
        if bias is not None:
            w.put(name, "expert_bias", bias)

        logits = x @ wr.T
        idx, probs, fmap = route(logits, c, bias)
        aux, z = aux_losses(logits, c, T)
        sizes = [int(s) for s in fmap.sum(dim=0)]
        tokens = torch.cat([torch.nonzero(fmap[:, e]).flatten() for e in range(E)])
        row_probs = torch.cat([probs[fmap[:, e], e] for e in range(E)])
        yp = experts(x[tokens], sizes, w1, w2, c["gated"])
        y = torch.zeros(N, C, dtype=f64).index_add(0, tokens, yp * row_probs[:, None])
        objective = (y * dy).sum() + grad_scale * (aux + z)
        objective.backward()

        for key, t in dict(x=x, router_weight=wr, fc1=w1, fc2=w2, dy=dy, y=y, probs=probs, aux_loss=aux.reshape(1),
                           z_loss=z.reshape(1), dx=x.grad, drouter_weight=wr.grad, dfc1=w1.grad,
                           dfc2=w2.grad).items():
            w.put(name, key, t)
        w.put(name, "topk_idx", idx)
        w.put(name, "group_sizes", torch.tensor(sizes, dtype=torch.int32))
    return w.save()


if __name__ == "__main__":
    torch.set_num_threads(1)
    gen_moe()
