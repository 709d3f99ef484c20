#!/usr/bin/env python3
"""Regenerates fuzz_sft_jsonl's tokenizer fixture (tests/fuzz/fixtures/sft_chat.model: a tiny BPE
SentencePiece model with byte fallback and the chat templates' special tokens, trained by spm_train) and
its seed corpus under tests/fuzz/seeds/fuzz_sft_jsonl/ (committed; run this only to change them).
Seed layout: byte 0 holds the options (see fuzz_sft_jsonl.cpp), the rest is the JSONL file."""
import json
import os
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA2, LLAMA3, CHATML = 1, 2, 3
EOD, ALL_LOSS, WORKERS3, SKIP_BAD, NO_PACKING, OVERLONG_SKIP = 4, 8, 16, 32, 64, 128


def model():
    text = ("the quick brown fox jumps over the lazy dog\nhello world how are you\nI am fine thank you and you\n"
            "what is the answer to the question\nsystem user assistant\n")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "text.txt"), "w") as f:
            f.write(text)
        subprocess.run(["spm_train", "--input=text.txt", "--model_prefix=sft_chat", "--vocab_size=300",
                        "--model_type=bpe", "--byte_fallback=true", "--normalization_rule_name=identity",
                        "--minloglevel=2",
                        "--control_symbols=<|im_start|>,<|im_end|>,<|begin_of_text|>,<|start_header_id|>,"
                        "<|end_header_id|>,<|eot_id|>"], cwd=tmp, check=True, capture_output=True)
        os.makedirs(os.path.join(HERE, "fixtures"), exist_ok=True)
        with open(os.path.join(tmp, "sft_chat.model"), "rb") as src:
            data = src.read()
        with open(os.path.join(HERE, "fixtures", "sft_chat.model"), "wb") as dst:
            dst.write(data)


def seed(name, options, lines):
    out = os.path.join(HERE, "seeds", "fuzz_sft_jsonl", name)
    body = "".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines)
    with open(out, "wb") as f:
        f.write(bytes([options]) + body.encode("utf-8"))


def conv(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def main():
    model()
    os.makedirs(os.path.join(HERE, "seeds", "fuzz_sft_jsonl"), exist_ok=True)
    seed("pairs", EOD, [{"input": "hello", "output": "world"}, {"input": "", "output": "how are you"},
                        {"input": "caf\u00e9 \u65e5\u672c", "output": "fine \U0001F600"}])
    long_answer = {"input": "what is the answer to the question", "output": " ".join(["the lazy dog"] * 12)}
    seed("overlong_truncate", WORKERS3, [long_answer, {"input": "a", "output": "b"}])
    seed("overlong_skip", OVERLONG_SKIP | NO_PACKING, [long_answer, {"input": "a", "output": "b c"}])
    seed("llama2", LLAMA2 | EOD, [conv(("system", "be brief"), ("user", "hello"), ("assistant", "world")),
                                  conv(("user", "hi"), ("assistant", "yo"), ("user", "and"), ("assistant", "you"))])
    seed("llama3", LLAMA3 | WORKERS3, [conv(("user", "the quick"), ("assistant", "brown fox")),
                                       conv(("system", "s"), ("user", "u"), ("assistant", "a"))])
    seed("chatml", CHATML | ALL_LOSS | NO_PACKING, [conv(("user", "how are you"), ("assistant", "I am fine"))])
    seed("bad_lines", CHATML | SKIP_BAD, [
        conv(("user", "x"), ("assistant", "y")),
        conv(("assistant", "first")),
        conv(("user", "no answer")),
        {"messages": "text"},
        {"messages": [{"role": "user", "content": 5}]},
        "{not json",
        "",
        conv(("user", "x"), ("system", "late"), ("assistant", "y")),
        conv(("user", "ok"), ("assistant", "fine")),
    ])
    seed("pairs_bad", SKIP_BAD, [{"input": "q"}, {"input": "q", "output": ""}, {"input": 1, "output": "a"},
                                 {"input": "q", "output": "a"}])


if __name__ == "__main__":
    main()
