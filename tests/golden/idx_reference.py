#!/usr/bin/env python3
"""Reference writer/reader for Megatron's mmap indexed dataset (.bin/.idx), written from the format
description alone (numpy + struct), independent of Loom's C++ code. The C++ tests run it to produce
files that Loom must write byte-for-byte and read back token-for-token.

Format (all little-endian):
  .idx: b"MMIDIDX\\x00\\x00", u64 version 1, u8 dtype code, u64 sequence count S, u64 document count D+1,
        int32 lengths[S], int64 pointers[S] (byte offset of each sequence in .bin), int64 doc_idx[D+1]
  .bin: the tokens of every sequence, back to back, in the dtype

Usage:
  idx_reference.py write SPEC.json   SPEC: {"prefix": P, "dtype": "uint16"|... or "vocab_size": V,
                                            "documents": [[[tok, ...], ...sequences], ...documents]}
  idx_reference.py dump PREFIX OUT.json   writes {"dtype": code, "documents": [...]} read from PREFIX
"""
import json
import struct
import sys

import numpy as np

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
NP = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def choose_dtype(vocab_size):
    # Megatron's DType.optimal_dtype: 16-bit unsigned below 65500 ids, else 32-bit signed.
    return "uint16" if vocab_size < 65500 else "int32"


def write(spec):
    name = spec["dtype"] if "dtype" in spec else choose_dtype(spec["vocab_size"])
    code = CODES[name]
    dt = np.dtype(NP[code]).newbyteorder("<")
    lengths, doc_idx = [], [0]
    with open(spec["prefix"] + ".bin", "wb") as fbin:
        for doc in spec["documents"]:
            for seq in doc:
                arr = np.asarray(seq, dtype=np.int64)
                assert np.all(arr.astype(dt).astype(np.int64) == arr), "token does not fit the dtype"
                fbin.write(arr.astype(dt).tobytes())
                lengths.append(len(seq))
            doc_idx.append(len(lengths))
    itemsize = dt.itemsize
    pointers = np.zeros(len(lengths), dtype="<i8")
    if lengths:
        pointers[1:] = np.cumsum(np.asarray(lengths[:-1], dtype=np.int64) * itemsize)
    with open(spec["prefix"] + ".idx", "wb") as fidx:
        fidx.write(b"MMIDIDX\x00\x00")
        fidx.write(struct.pack("<Q", 1))
        fidx.write(struct.pack("<B", code))
        fidx.write(struct.pack("<Q", len(lengths)))
        fidx.write(struct.pack("<Q", len(doc_idx)))
        fidx.write(np.asarray(lengths, dtype="<i4").tobytes())
        fidx.write(pointers.tobytes())
        fidx.write(np.asarray(doc_idx, dtype="<i8").tobytes())


def dump(prefix, out):
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00", "bad magic"
    version, code, S, D1 = struct.unpack_from("<QBQQ", raw, 9)
    assert version == 1
    off = 34
    lengths = np.frombuffer(raw, dtype="<i4", count=S, offset=off)
    pointers = np.frombuffer(raw, dtype="<i8", count=S, offset=off + 4 * S)
    doc_idx = np.frombuffer(raw, dtype="<i8", count=D1, offset=off + 12 * S)
    assert off + 12 * S + 8 * D1 == len(raw), "trailing or missing bytes"
    data = np.fromfile(prefix + ".bin", dtype=np.dtype(NP[code]).newbyteorder("<"))
    itemsize = data.dtype.itemsize
    seqs = [data[p // itemsize: p // itemsize + n].astype(np.int64).tolist() for p, n in zip(pointers, lengths)]
    docs = [seqs[doc_idx[k]:doc_idx[k + 1]] for k in range(D1 - 1)]
    json.dump({"dtype": int(code), "documents": docs}, open(out, "w"))


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(json.load(open(sys.argv[2])))
    elif sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
