#!/usr/bin/env python3
"""Regenerates the seed corpora of fuzz_idx_reader and fuzz_jsonl under tests/fuzz/seeds/ (committed;
run this only to change them). Uses the independent reference writer tests/golden/idx_reference.py.
fuzz_idx_reader input: u16 LE length n, n bytes of .bin, then the .idx."""
import os
import struct
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "golden"))
import idx_reference  # noqa: E402


def idx_seed(name, dtype, docs):
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "s")
        idx_reference.write({"prefix": prefix, "dtype": dtype, "documents": docs})
        binb = open(prefix + ".bin", "rb").read()
        idxb = open(prefix + ".idx", "rb").read()
    assert len(binb) < 65536
    out = os.path.join(HERE, "seeds", "fuzz_idx_reader", name)
    with open(out, "wb") as f:
        f.write(struct.pack("<H", len(binb)) + binb + idxb)


def jsonl_seed(name, options, text):
    out = os.path.join(HERE, "seeds", "fuzz_jsonl", name)
    with open(out, "wb") as f:
        f.write(bytes([options]) + text.encode("utf-8"))


def main():
    os.makedirs(os.path.join(HERE, "seeds", "fuzz_idx_reader"), exist_ok=True)
    os.makedirs(os.path.join(HERE, "seeds", "fuzz_jsonl"), exist_ok=True)
    idx_seed("u16_small", "uint16", [[[10, 11, 12], [13, 14]], [], [[15], [16, 17, 18]]])
    idx_seed("i32_docs", "int32", [[[70000, 1, 2]], [[3]], [[4, 5, 6, 7]]])
    idx_seed("u8_one", "uint8", [[[1, 2, 255]]])
    idx_seed("i64_neg", "int64", [[[-1, 5]], [[], [7]]])
    idx_seed("i16_i8", "int16", [[[-300, 300]]])
    idx_seed("empty", "uint16", [])
    idx_seed("only_empty_docs", "uint16", [[], [], []])
    jsonl_seed("plain", 0, '{"text": "1 2 3"}\n{"text": "4 5"}\n')
    jsonl_seed("eod_lists", 2 | 32, '{"text": ["1 2", "", "3"]}\n{"text": ""}\n{"text": " 7\\n8 "}')
    jsonl_seed("two_keys", 8 | 4 | 32, '{"text": "1", "title": "2 3"}\n{"title": "", "text": ["9"]}\n')
    jsonl_seed("skip_bad", 1 | 2, '{"text": "1"}\n{"txt": 1}\n{bad\n\n[1]\n{"text": 5}\n{"text": "x"}\n{"text": "2"}\n')
    jsonl_seed("int32_vocab", 16 | 2, '{"text": "69999 0 12345"}\n')
    jsonl_seed("unicode", 1, '{"text": "1 \\u00e9 2", "x": [null, true, {"a": [1.5e3]}]}\n{"text": "\u00e9"}\n')


if __name__ == "__main__":
    main()
