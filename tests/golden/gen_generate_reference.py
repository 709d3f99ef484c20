"""Greedy-decoding reference for `loom generate` / InferenceSession: tiny Llama-style and GPT-2-style
models in PyTorch (float64 math), decoded greedily by re-running the full forward over the whole prefix
each step (no cache), so the C++ KV-cached decoder must reproduce the same tokens.

Run:  /usr/bin/python3 tests/golden/gen_generate_reference.py      (torch 1.13, no transformers; ~1 s)
Writes tests/golden/fixtures/generate_tiny.safetensors (~60 KB), read by tests/unit/model/test_inference.cpp.
The model (parameter names and shapes, init, forward) is gen_llama_model.py's, whose optional config keys
(learned positions, ungated GeLU MLP, emb_std/w_std) exist for these cases; see that file's docstring.

Common shapes: L=2 layers, C=16, NH=4 query heads (HS=4), vocab V=53 padded to Vp=64,
max_position_embeddings P=32, norm eps 1e-5, 12 new tokens per case.
Cases (metadata "<case>.<key>" holds each config):
  llama   RMSNorm, SwiGLU (F=24), RoPE base 1e4, GQA with NKV=2 key/value heads, no biases, untied output,
          sliding window [--window-size 5,0] (6 keys), prompt of 7 tokens: the 19-token sequence is longer
          than the window, so decoding must drop the oldest keys
  gpt2    LayerNorm, GeLU (tanh, F=4C=64), learned absolute positions, all biases, output tied to the word
          embedding, prompt of 5 tokens
Init: word embeddings N(0, emb_std), learned positions N(0, 0.5), qkv weights N(0, 0.3), other weights
N(0, w_std), biases N(0, 0.05), norm weights 1 + N(0, 0.1) (emb_std, w_std: 1, 0.2 for llama; 0.5, 0.4 for
gpt2, whose tied output layer otherwise settles on repeating one token).
Tensors per case <c> (F32 unless noted):
  <c>.param.<name>    every parameter
  <c>.prompt          I32 (Tp,) prompt token ids in [0, V)
  <c>.ref.tokens      I32 (12,) the greedy continuation: argmax over the first V logits, one per step
  <c>.ref.logits      (12, Vp) the logits each of those tokens was chosen from (last position of the prefix)
The script checks that every step's best logit beats the runner-up by more than 1e-3, so float32 rounding
in the C++ model cannot flip a choice, and that the continuation holds at least 6 distinct tokens (a model
stuck repeating one token would test little); otherwise it tries the next seed. Deterministic: fixed seeds, single thread.
"""
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_llama_model as lm  # noqa: E402
import safetensors_py as st  # noqa: E402

L, C, NH, V, Vp = lm.L, lm.C, lm.NH, lm.V, lm.Vp  # the shapes are gen_llama_model.py's
P, STEPS = 32, 12
MARGIN = 1e-3

CASES = {
    "llama": dict(normalization="RMSNorm", activation="swiglu", ffn_hidden_size=24, kv_channels=4,
                  num_query_groups=2, add_bias_linear=0, untie=1, position_embedding_type="rope",
                  rotary_base=10000.0, rotary_percent=1.0, rotary_interleaved=0, use_rope_scaling=0,
                  window_left=5, prompt_len=7, emb_std=1.0, w_std=0.2),
    "gpt2": dict(normalization="LayerNorm", activation="gelu", ffn_hidden_size=64, kv_channels=4,
                 num_query_groups=4, add_bias_linear=1, untie=0, position_embedding_type="learned_absolute",
                 rotary_base=10000.0, rotary_percent=1.0, rotary_interleaved=0, use_rope_scaling=0,
                 window_left=-1, prompt_len=5, emb_std=0.5, w_std=0.4),
}


def forward(cfg, Pm, tokens):
    """Logits (T, Vp) of one sequence, the full causal forward (gen_llama_model.py's, batch of one)."""
    return lm.logits_of(cfg, Pm, torch.tensor([tokens], dtype=torch.int64))[0]


def greedy(cfg, Pm, prompt):
    seq, toks, logits = list(prompt), [], []
    for _ in range(STEPS):
        last = forward(cfg, Pm, seq)[-1]
        top2 = torch.topk(last[:V], 2).values
        if float(top2[0] - top2[1]) <= MARGIN:
            return None  # a near tie: pick another seed
        t = int(torch.argmax(last[:V]))
        toks.append(t)
        logits.append(last)
        seq.append(t)
    return toks, torch.stack(logits)


def main():
    torch.set_num_threads(1)
    tensors, meta = {}, {}
    for name, cfg in CASES.items():
        for attempt in range(100):
            g = torch.Generator().manual_seed(zlib.crc32(f"generate/{name}/{attempt}".encode()))
            Pm = lm.init_params(dict(cfg, max_positions=P), g)
            prompt = torch.randint(0, V, (cfg["prompt_len"],), generator=g, dtype=torch.int64).tolist()
            out = greedy(cfg, Pm, prompt)
            if out is not None and len(set(out[0])) >= 6:  # no near ties, and not stuck repeating a token
                break
        else:
            raise SystemExit(f"{name}: no seed without near ties")
        toks, logits = out
        for n, t in Pm.items():
            tensors[f"{name}.param.{n}"] = t.to(torch.float32).numpy()
        tensors[f"{name}.prompt"] = torch.tensor(prompt, dtype=torch.int32).numpy()
        tensors[f"{name}.ref.tokens"] = torch.tensor(toks, dtype=torch.int32).numpy()
        tensors[f"{name}.ref.logits"] = logits.to(torch.float32).numpy()
        for k, v in cfg.items():
            meta[f"{name}.{k}"] = str(v)
        print(f"  {name:6s} prompt {prompt} -> {toks} (seed attempt {attempt})")
    meta.update({"cases": ",".join(CASES), "generator": "tests/golden/gen_generate_reference.py",
                 "num_layers": str(L), "hidden_size": str(C), "num_attention_heads": str(NH),
                 "vocab_size": str(V), "padded_vocab_size": str(Vp), "max_position_embeddings": str(P),
                 "norm_epsilon": str(lm.EPS), "steps": str(STEPS),
                 "reference": "float64 math, stored as float32"})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "generate_tiny.safetensors")
    n = st.save(path, tensors, meta)
    print(f"wrote {os.path.relpath(path)} ({n / 1024:.1f} KiB, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
