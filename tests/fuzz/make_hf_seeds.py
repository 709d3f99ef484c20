#!/usr/bin/env python3
"""Regenerates the seed corpus of fuzz_hf_config under tests/fuzz/seeds/fuzz_hf_config/ (committed; run
this only to change it). Input layout (see fuzz_hf_config.cpp): byte 0 mode (0 config.json, 1
model.safetensors, 2 index + two shards), byte 1 shard-size knob, then the file bytes. Safetensors files are
built here byte by byte from the format description, independently of Loom's writer."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "seeds", "fuzz_hf_config")

SIZES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "F8_E4M3": 1}


def safetensors(tensors, pad=True, metadata=None):
    """tensors: list of (name, dtype, shape); data bytes are a simple pattern."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = SIZES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        blobs.append(bytes((off + i * 13) % 251 for i in range(n)))
        off += n
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def seed(name, mode, knob, body):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(bytes([mode, knob]) + body)


GPT2 = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
        "n_head": 12, "n_inner": None, "layer_norm_epsilon": 1e-05, "activation_function": "gelu_new",
        "bos_token_id": 50256, "eos_token_id": 50256, "tie_word_embeddings": True}
LLAMA31 = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
           "eos_token_id": [128001, 128008, 128009]}
LLAMA2 = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
          "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-05, "rope_scaling": None, "torch_dtype": "float16", "bos_token_id": 1,
          "eos_token_id": 2}
MISTRAL = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
           "sliding_window": 4096}


def main():
    os.makedirs(OUT, exist_ok=True)
    seed("cfg_gpt2", 0, 3, json.dumps(GPT2, indent=2).encode())
    seed("cfg_llama31", 0, 3, json.dumps(LLAMA31, indent=2).encode())
    seed("cfg_llama2", 0, 3, json.dumps(LLAMA2).encode())
    seed("cfg_mistral", 0, 3, json.dumps(dict(MISTRAL, sliding_window=None)).encode())
    seed("st_single", 1, 2, safetensors([("wte", "F32", [4, 3]), ("ln.bias", "BF16", [3]),
                                         ("ids", "I64", [2]), ("scale", "F32", [])],
                                        metadata={"format": "pt"}))
    seed("st_unpadded_f64", 1, 0, safetensors([("d", "F64", [2]), ("u", "U8", [3])], pad=False))
    seed("st_empty_tensor", 1, 9, safetensors([("z", "F16", [0, 4]), ("q", "F8_E4M3", [5])]))
    shard1 = safetensors([("a", "F32", [3]), ("b", "BF16", [2, 2])], metadata={"format": "pt"})
    shard2 = safetensors([("c", "I32", [4])], metadata={"format": "pt"})
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    index = json.dumps({"metadata": {"total_size": 36}, "weight_map": {"a": s1, "b": s1, "c": s2}},
                       indent=2, sort_keys=True).encode()
    seed("idx_two_shards", 2, 1, struct.pack("<H", len(index)) + index + struct.pack("<H", len(shard1)) + shard1 +
         shard2)
    wrong = json.dumps({"weight_map": {"a": s2, "b": s1, "c": s2}}).encode()
    seed("idx_wrong_shard", 2, 1, struct.pack("<H", len(wrong)) + wrong + struct.pack("<H", len(shard1)) + shard1 +
         shard2)


if __name__ == "__main__":
    main()
