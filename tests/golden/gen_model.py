"""Whole-model PyTorch reference for Loom's GPT-2 (Megatron naming and layout), computed in float64.

Run:  /usr/bin/python3 tests/golden/gen_model.py      (torch 1.13; a few seconds)
Writes tests/golden/fixtures/gpt_tiny.safetensors (~0.4 MB, float32 storage, float64 math), read by
tests/golden/test_golden_model.cpp.

Config (also in the file's __metadata__):
  num_layers L=2, hidden C=32, heads NH=4 (HS=8), seq T=16, micro-batch B=3 (= global batch, 1 rank),
  vocab_size V=97 padded to Vp=128 (make-vocab-size-divisible-by 128), max_position_embeddings 16,
  layernorm eps 1e-5, GeLU tanh approximation, no dropout, output layer tied to the word embeddings.

Model:
  x = wte[tokens] + wpe[0..T-1]
  per layer: x = x + proj(attn(ln1(x)));  x = x + fc2(gelu_tanh(fc1(ln2(x))))
  logits = ln_f(x) @ wte^T, all Vp columns;  loss = mean over the B*T tokens of the cross-entropy over
  the first V columns only (padded columns excluded). attn: causal softmax(q k^T / sqrt(HS)) v.
  linear_qkv's 3C output columns are in Megatron's grouped layout: for each head h, [q_h, k_h, v_h]
  (HS each), i.e. qkv.view(B, T, NH, 3, HS). Linear weights are (out, in): y = x W^T + b.

Parameters (names exactly as stored; i in {0, 1}):
  embedding.word_embeddings.weight (Vp, C)      embedding.position_embeddings.weight (T, C)
  decoder.layers.{i}.input_layernorm.weight, .bias (C)
  decoder.layers.{i}.self_attention.linear_qkv.weight (3C, C), .bias (3C)
  decoder.layers.{i}.self_attention.linear_proj.weight (C, C), .bias (C)
  decoder.layers.{i}.pre_mlp_layernorm.weight, .bias (C)
  decoder.layers.{i}.mlp.linear_fc1.weight (4C, C), .bias (4C)
  decoder.layers.{i}.mlp.linear_fc2.weight (C, 4C), .bias (C)
  decoder.final_layernorm.weight, .bias (C)
Init (Megatron-like, so values are realistic): weights N(0, 0.02); linear_proj and linear_fc2 weights
N(0, 0.02/sqrt(2L)); biases N(0, 0.02) (not zero, so bias gradients are exercised); LayerNorm weights
1 + N(0, 0.1), LayerNorm biases N(0, 0.02); the padded rows V..Vp-1 of the word embeddings are random
too. The initial values are rounded to float32 first and the float64 math starts from exactly those.

Tensors in the file (all F32 unless noted):
  <name>                 every initial parameter
  tokens, targets        I32 (B, T), values in [0, V)
  ref.logits             (B, T, Vp) at the initial parameters
  ref.loss               (1,) mean loss at the initial parameters
  ref.grad.<name>        gradient of the mean loss for every parameter (padded wte rows get exactly 0)
  ref.losses             (10,) loss at the start of each of 10 training iterations (before its update)
  ref.lrs                (10,) learning rate used by each iteration
  ref.grad_norms         (10,) global gradient L2 norm of each iteration, before clipping
  ref.final.<name>       every parameter after the 10 iterations

Training (10 iterations, the same batch each time), Megatron semantics:
  - AdamW as torch.optim.AdamW (= apex FusedAdam adam_w_mode): betas (0.9, 0.95), eps 1e-8, weight decay
    0.1 on every parameter except biases and LayerNorm weights/biases (embeddings ARE decayed);
  - gradient clipping by the global norm over all grads, max_norm 1.0: clip_coeff = 1.0 / (norm + 1e-6),
    applied only if < 1;
  - LR: Megatron OptimizerParamScheduler, lr 1e-2, min_lr 1e-3, warmup 3 iterations, decay 10
    iterations, cosine, counted in samples: s = (iter - 1) * 3, warmup_steps 9, decay_steps 30;
    lr(s) = lr * s / 9 if s <= 9 (iteration 1 uses lr 0 but still advances Adam's state and step),
    min_lr if s > 30, else min_lr + 0.5 * (cos(pi * (s - 9) / 21) + 1) * (lr - min_lr).
Deterministic: fixed seed, single thread, so regenerating gives identical bytes.
"""
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_py as st  # noqa: E402

f64 = torch.float64
SEED = 1234
CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=3,
           global_batch_size=3, vocab_size=97, padded_vocab_size=128, max_position_embeddings=16)
L, C, NH, T, B = (CFG[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                   "micro_batch_size"))
V, Vp, HS = CFG["vocab_size"], CFG["padded_vocab_size"], C // NH
EPS = 1e-5
TRAIN_ITERS, LR, MIN_LR, WARMUP_ITERS, DECAY_ITERS = 10, 1e-2, 1e-3, 3, 10
BETAS, ADAM_EPS, WEIGHT_DECAY, CLIP_GRAD, INIT_STD = (0.9, 0.95), 1e-8, 0.1, 1.0, 0.02


def param_shapes():
    shapes = {"embedding.word_embeddings.weight": (Vp, C), "embedding.position_embeddings.weight": (T, C)}
    for i in range(L):
        p = f"decoder.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (C,), p + "input_layernorm.bias": (C,),
            p + "self_attention.linear_qkv.weight": (3 * C, C), p + "self_attention.linear_qkv.bias": (3 * C,),
            p + "self_attention.linear_proj.weight": (C, C), p + "self_attention.linear_proj.bias": (C,),
            p + "pre_mlp_layernorm.weight": (C,), p + "pre_mlp_layernorm.bias": (C,),
            p + "mlp.linear_fc1.weight": (4 * C, C), p + "mlp.linear_fc1.bias": (4 * C,),
            p + "mlp.linear_fc2.weight": (C, 4 * C), p + "mlp.linear_fc2.bias": (C,),
        })
    shapes.update({"decoder.final_layernorm.weight": (C,), "decoder.final_layernorm.bias": (C,)})
    return shapes


def is_norm(name):
    return "layernorm" in name


def no_weight_decay(name):
    return name.endswith(".bias") or is_norm(name)


def init_params(g):
    params = {}
    for name, shape in param_shapes().items():
        if is_norm(name) and name.endswith(".weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=f64)
        elif name.endswith(".bias"):
            t = INIT_STD * torch.randn(shape, generator=g, dtype=f64)
        elif "linear_proj" in name or "linear_fc2" in name:
            t = INIT_STD / math.sqrt(2 * L) * torch.randn(shape, generator=g, dtype=f64)
        else:
            t = INIT_STD * torch.randn(shape, generator=g, dtype=f64)
        params[name] = t.to(torch.float32).to(f64)  # stored as f32: start the f64 math from those values
    return params


def forward(P, tokens, targets):
    x = P["embedding.word_embeddings.weight"][tokens] + P["embedding.position_embeddings.weight"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(L):
        p = f"decoder.layers.{i}."
        h = F.layer_norm(x, (C,), P[p + "input_layernorm.weight"], P[p + "input_layernorm.bias"], EPS)
        qkv = F.linear(h, P[p + "self_attention.linear_qkv.weight"], P[p + "self_attention.linear_qkv.bias"])
        qkv = qkv.view(B, T, NH, 3, HS)  # grouped layout: per head [q_h, k_h, v_h]
        q, k, v = (qkv[:, :, :, j].permute(0, 2, 1, 3) for j in range(3))  # (B, NH, T, HS)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(HS)
        s = s.masked_fill(~causal, float("-inf"))
        y = (torch.softmax(s, dim=-1) @ v).permute(0, 2, 1, 3).reshape(B, T, C)
        x = x + F.linear(y, P[p + "self_attention.linear_proj.weight"], P[p + "self_attention.linear_proj.bias"])
        h = F.layer_norm(x, (C,), P[p + "pre_mlp_layernorm.weight"], P[p + "pre_mlp_layernorm.bias"], EPS)
        h = F.gelu(F.linear(h, P[p + "mlp.linear_fc1.weight"], P[p + "mlp.linear_fc1.bias"]), approximate="tanh")
        x = x + F.linear(h, P[p + "mlp.linear_fc2.weight"], P[p + "mlp.linear_fc2.bias"])
    x = F.layer_norm(x, (C,), P["decoder.final_layernorm.weight"], P["decoder.final_layernorm.bias"], EPS)
    logits = x @ P["embedding.word_embeddings.weight"].t()  # (B, T, Vp)
    loss = F.cross_entropy(logits[..., :V].reshape(B * T, V), targets.reshape(B * T))
    return logits, loss


def megatron_lr(iteration):
    """OptimizerParamScheduler.get_lr() for the iteration (1-based), steps counted in samples."""
    gbs = CFG["global_batch_size"]
    s, warmup, decay = (iteration - 1) * gbs, WARMUP_ITERS * gbs, DECAY_ITERS * gbs
    if warmup > 0 and s <= warmup:
        return LR * s / warmup
    if s > decay:
        return MIN_LR
    ratio = (s - warmup) / (decay - warmup)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (LR - MIN_LR)


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(SEED)
    P0 = init_params(g)
    tokens = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
    targets = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)

    P = {n: t.clone().requires_grad_(True) for n, t in P0.items()}
    names = list(P)
    logits0, loss0 = forward(P, tokens, targets)
    loss0.backward()
    out = {n: P0[n] for n in names}
    out.update({"tokens": tokens, "targets": targets, "ref.logits": logits0, "ref.loss": loss0.reshape(1)})
    out.update({f"ref.grad.{n}": P[n].grad.clone() for n in names})

    decay = [P[n] for n in names if not no_weight_decay(n)]
    nodecay = [P[n] for n in names if no_weight_decay(n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": nodecay, "weight_decay": 0.0}], lr=0.0, betas=BETAS, eps=ADAM_EPS)
    losses, lrs, norms = [], [], []
    for it in range(1, TRAIN_ITERS + 1):
        opt.zero_grad(set_to_none=True)
        _, loss = forward(P, tokens, targets)
        loss.backward()
        total = math.sqrt(sum(float((P[n].grad ** 2).sum()) for n in names))
        coeff = CLIP_GRAD / (total + 1e-6)
        if coeff < 1.0:
            for n in names:
                P[n].grad.mul_(coeff)
        lr = megatron_lr(it)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        losses.append(float(loss))
        lrs.append(lr)
        norms.append(total)
        print(f"  iter {it:2d}  lr {lr:.6f}  loss {float(loss):.6f}  grad norm {total:.6f}")
    out["ref.losses"] = torch.tensor(losses, dtype=f64)
    out["ref.lrs"] = torch.tensor(lrs, dtype=f64)
    out["ref.grad_norms"] = torch.tensor(norms, dtype=f64)
    out.update({f"ref.final.{n}": P[n].detach() for n in names})

    tensors = {}
    for k, t in out.items():
        t = t.detach()
        tensors[k] = (t.to(torch.int32) if k in ("tokens", "targets") else t.to(torch.float32)).contiguous().numpy()
    meta = {k: str(v) for k, v in CFG.items()}
    meta.update({
        "generator": "tests/golden/gen_model.py", "seed": str(SEED), "model": "gpt2 (Megatron naming)",
        "layernorm_epsilon": str(EPS), "activation": "gelu_tanh", "tied_output": "true",
        "qkv_layout": "grouped per head: [q_h, k_h, v_h]", "train_iters": str(TRAIN_ITERS), "lr": str(LR),
        "min_lr": str(MIN_LR), "lr_warmup_iters": str(WARMUP_ITERS), "lr_decay_iters": str(DECAY_ITERS),
        "lr_decay_style": "cosine", "adam_beta1": str(BETAS[0]), "adam_beta2": str(BETAS[1]),
        "adam_eps": str(ADAM_EPS), "weight_decay": str(WEIGHT_DECAY), "clip_grad": str(CLIP_GRAD),
        "init_method_std": str(INIT_STD), "no_weight_decay": "biases and layernorm weights/biases",
        "reference": "float64 math, stored as float32",
    })
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "gpt_tiny.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    n = st.save(path, tensors, meta)
    print(f"wrote {os.path.relpath(path)} ({n / 1024:.1f} KiB, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
