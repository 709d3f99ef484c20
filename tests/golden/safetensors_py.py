"""A small, dependency-free safetensors writer for the golden-fixture generators.

The `safetensors` Python package is not installed on the build machines, so the generators use this
instead. It is written independently of Loom's C++ writer (src/ckpt/safetensors.cpp) and follows the
layout of the reference safetensors library, which the C++ writer follows too; the ckpt unit tests
check that both produce identical bytes:
  - 8-byte little-endian header length N, then N bytes of compact JSON, then the tensor data;
  - "__metadata__" first (keys sorted), then tensors ordered by dtype (widest first, the reference
    library's dtype order) and then by name; each entry's fields in the order dtype, shape, data_offsets;
  - non-ASCII characters written as UTF-8 (not \\u escapes); header padded with spaces so that
    8 + N is a multiple of 8.
"""
import json
import os
import struct

import numpy as np

# The reference library's dtype order (higher first in the file).
DTYPE_RANK = {
    "BOOL": 0, "U8": 4, "I8": 5, "F8_E5M2": 6, "F8_E4M3": 7, "F8_E8M0": 8, "I16": 9, "U16": 10,
    "F16": 11, "BF16": 12, "I32": 13, "U32": 14, "F32": 15, "C64": 16, "F64": 17, "I64": 18, "U64": 19,
}
DTYPE_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
    "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "F64": 8, "I64": 8, "U64": 8,
}
_NUMPY_DTYPES = {
    np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
    np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("uint16"): "U16",
    np.dtype("int16"): "I16", np.dtype("uint8"): "U8", np.dtype("int8"): "I8",
}


class Raw:
    """A tensor given as a safetensors dtype name, a shape and its little-endian bytes (BF16, FP8)."""

    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, list(shape), bytes(data)
        n = 1
        for d in self.shape:
            n *= d
        assert n * DTYPE_SIZE[dtype] == len(self.data), (dtype, shape, len(self.data))


def bf16_bits(x):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays a quiet NaN."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, ((b >> 16) | 0x40).astype(np.uint16), rounded)


def _as_entry(value):
    if isinstance(value, Raw):
        return value.dtype, value.shape, value.data
    a = np.asarray(value)
    if a.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"unsupported numpy dtype {a.dtype}")
    le = a.dtype.newbyteorder("<")
    return _NUMPY_DTYPES[a.dtype], list(a.shape), np.ascontiguousarray(a, dtype=le).tobytes()


def serialize(tensors, metadata=None):
    """tensors: {name: numpy array | Raw}; metadata: {str: str} or None. Returns the file's bytes."""
    entries = {name: _as_entry(v) for name, v in tensors.items()}
    order = sorted(entries, key=lambda n: (-DTYPE_RANK[entries[n][0]], n))
    header = {}
    if metadata:
        header["__metadata__"] = {k: str(metadata[k]) for k in sorted(metadata)}
    offset, chunks = 0, []
    for name in order:
        dtype, shape, data = entries[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        chunks.append(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def save(path, tensors, metadata=None):
    """Writes atomically (tmp + rename) so an interrupted regeneration leaves the old fixture."""
    data = serialize(tensors, metadata)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


_NUMPY_OF = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
             "I16": np.int16, "U16": np.uint16, "I8": np.int8, "U8": np.uint8}


def load(path):
    """Reads a safetensors file: ({name: numpy array}, metadata dict). BF16 widens to float32 exactly."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        raw = data[base + b:base + end]
        if e["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(_NUMPY_OF[e["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(e["shape"]).copy()
    return out, metadata
