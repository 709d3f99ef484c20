#!/usr/bin/env python3
"""Regenerates the seed corpus of fuzz_ckpt_metadata under tests/fuzz/seeds/fuzz_ckpt_metadata/ (committed;
run this only to change it). Input layout (see fuzz_ckpt_metadata.cpp): byte 0 mode (0 tracker, 1
metadata.json next to a valid shard, 2 u16 LE length + metadata.json + shard_00000.safetensors, 3 one
safetensors file). Files are built here byte by byte from the format descriptions (docs/training.md,
include/loom/ckpt/sharded.h and safetensors.h), independently of Loom's writers, CRC-32C included."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "seeds", "fuzz_ckpt_metadata")


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283

SIZES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "U8": 1}


def safetensors(tensors, metadata=None, checksums=True, bad_crc=None):
    """tensors: list of (name, dtype, shape), stored in this order; data bytes are a simple pattern."""
    header, blobs, off, crcs = {}, [], 0, {}
    for name, dtype, shape in tensors:
        n = SIZES[dtype]
        for d in shape:
            n *= d
        blob = bytes((off + i * 13) % 251 for i in range(n))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        crcs[name] = "%08x" % (crc32c(blob) ^ (1 if name == bad_crc else 0))
        blobs.append(blob)
        off += n
    meta = dict(metadata or {})
    if checksums:
        meta["loom.crc32c"] = json.dumps(crcs, separators=(",", ":"))
    if meta:
        header = {"__metadata__": dict(sorted(meta.items())), **header}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def shard(pieces, metadata_text=None, rank=0):
    """pieces: list of (name, dtype, global_shape, partition_dim, ranges, flat_begin, flat_end)."""
    index, tensors = [], []
    for name, dtype, gshape, pd, ranges, fb, fe in pieces:
        index.append({"name": name, "dtype": dtype, "global_shape": gshape, "partition_dim": pd, "ranges": ranges,
                      "flat_begin": fb, "flat_end": fe, "key": name})
        tensors.append((name, dtype, [fe - fb]))
    idx = {"format": "loom-sharded", "version": 1, "rank": rank, "pieces": index}
    if metadata_text is not None:
        idx["metadata_crc32c"] = "%08x" % crc32c(metadata_text)
    return safetensors(tensors, {"loom_sharded_index": json.dumps(idx, separators=(",", ":"))})


def metadata(world_size=1, extra=None):
    j = {"format": "loom-checkpoint", "format_version": 1, "iteration": 10}
    j.update(extra or {})
    j["sharded_checkpoint"] = {"format": "loom-sharded", "version": 1, "world_size": world_size,
                               "layout": {"tp": 1, "pp": 1, "dp": 1, "sharding": "no_shard"}}
    return (json.dumps(j, indent=2) + "\n").encode()


def seed(name, mode, body):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(bytes([mode]) + body)


PIECES = [("w", "F32", [4, 3], 0, [[0, 2], [2, 2]], 0, 12), ("b", "BF16", [6], -1, [], 2, 5),
          ("optimizer.exp_avg.w", "F32", [4, 3], 1, [[1, 2]], 0, 8)]


def main():
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        os.remove(os.path.join(OUT, f))
    for name, text in [("tracker_5", b"5"), ("tracker_old", b"10"), ("tracker_release", b"release"),
                       ("tracker_space", b" 0000005\n"), ("tracker_bad", b"5x")]:
        seed(name, 0, text)
    seed("meta_sharded", 1, metadata())
    seed("meta_two_ranks", 1, metadata(world_size=2))
    seed("meta_legacy", 1, json.dumps({"format": "loom-checkpoint", "iteration": 4,
                                       "files": {"model": "shard_00000.safetensors"}}).encode())
    for name, meta, pieces, with_crc in [("both_ok", metadata(), PIECES, True),
                                         ("both_no_meta_crc", metadata(), PIECES, False),
                                         ("both_one_piece", metadata(extra={"step": 3}), PIECES[:1], True)]:
        body = shard(pieces, meta if with_crc else None)
        seed(name, 2, struct.pack("<H", len(meta)) + meta + body)
    meta = metadata()
    old = safetensors([("w", "F32", [12])], {"loom_sharded_index": json.dumps(
        {"format": "loom-sharded", "version": 1, "rank": 0, "pieces": [
            {"name": "w", "dtype": "F32", "global_shape": [4, 3], "partition_dim": -1, "ranges": [],
             "flat_begin": 0, "flat_end": 12, "key": "w"}]})}, checksums=False)
    seed("both_before_checksums", 2, struct.pack("<H", len(meta)) + meta + old)
    seed("st_checksums", 3, safetensors([("a", "F32", [2, 3]), ("b", "BF16", [5]), ("e", "F32", [0])]))
    seed("st_bad_crc", 3, safetensors([("a", "F32", [2, 3]), ("b", "U8", [3])], bad_crc="a"))
    seed("st_plain", 3, safetensors([("a", "I64", [2]), ("b", "F16", [3])], {"format": "pt"}, checksums=False))


if __name__ == "__main__":
    main()
