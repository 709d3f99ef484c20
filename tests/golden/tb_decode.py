#!/usr/bin/env python3
"""Independent decoder for TensorBoard event files, written from the format descriptions alone (plain
Python 3: no tensorboard, protobuf or crc packages, and a bitwise CRC-32C rather than a table), so the
C++ writer's tests do not check it against itself.

TFRecord framing, every record:
  uint64 LE length | uint32 LE masked_crc32c(the 8 length bytes) | data | uint32 LE masked_crc32c(data)
  masked_crc32c(x) = ((c >> 15) | (c << 17)) + 0xa282ead8 (mod 2^32), c = CRC-32C (Castagnoli)
Each data block is a tensorflow.Event protobuf:
  Event: wall_time=1 double, step=2 int64, file_version=3 string, summary=5 Summary
  Summary: value=1 repeated Value
  Value: tag=1 string, simple_value=2 float, tensor=8 TensorProto, metadata=9 SummaryMetadata
  SummaryMetadata: plugin_data=1 {plugin_name=1 string}
  TensorProto: dtype=1 enum (DT_STRING = 7), tensor_shape=2, string_val=8 repeated bytes

Usage: tb_decode.py EVENTFILE
Prints one JSON line per event: {"wall_time": w, "step": s, "file_version": v} or
{"wall_time": w, "step": s, "scalars": {tag: value}, "texts": {tag: text}}. Non-finite scalars are
printed as the strings "nan", "inf", "-inf" so every line stays valid JSON. Exits 1 with a message on
stderr at the first CRC, framing or protobuf error.
"""
import json
import math
import struct
import sys


class DecodeError(Exception):
    pass


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(crc):
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_varint(buf, pos):
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise DecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


def fields(buf):
    """Yields (field_number, wire_type, value) for each field of one message; value is an int for
    varints, bytes for fixed64/fixed32/length-delimited."""
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise DecodeError("field number 0")
        if wire == 0:
            value, pos = read_varint(buf, pos)
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            if pos + n > len(buf):
                raise DecodeError("truncated fixed%d field %d" % (n * 8, field))
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 2:
            n, pos = read_varint(buf, pos)
            if pos + n > len(buf):
                raise DecodeError("length-delimited field %d runs past its message" % field)
            value, pos = buf[pos:pos + n], pos + n
        else:
            raise DecodeError("unsupported wire type %d (field %d)" % (wire, field))
        yield field, wire, value


def expect(wire, want, what):
    if wire != want:
        raise DecodeError("%s has wire type %d, expected %d" % (what, wire, want))


def to_int64(u):
    return u - (1 << 64) if u >= 1 << 63 else u


def json_float(x):
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def decode_value(buf):
    tag, simple, plugin, dtype, strings = None, None, None, None, []
    for field, wire, v in fields(buf):
        if field == 1:
            expect(wire, 2, "Value.tag")
            tag = v.decode("utf-8")
        elif field == 2:
            expect(wire, 5, "Value.simple_value")
            simple = struct.unpack("<f", v)[0]
        elif field == 8:
            expect(wire, 2, "Value.tensor")
            for tf, tw, tv in fields(v):
                if tf == 1:
                    expect(tw, 0, "TensorProto.dtype")
                    dtype = tv
                elif tf == 8:
                    expect(tw, 2, "TensorProto.string_val")
                    strings.append(tv.decode("utf-8"))
        elif field == 9:
            expect(wire, 2, "Value.metadata")
            for mf, mw, mv in fields(v):
                if mf == 1:
                    expect(mw, 2, "SummaryMetadata.plugin_data")
                    for pf, pw, pv in fields(mv):
                        if pf == 1:
                            expect(pw, 2, "PluginData.plugin_name")
                            plugin = pv.decode("utf-8")
    if tag is None:
        raise DecodeError("Summary.Value without a tag")
    return tag, simple, plugin, dtype, strings


def decode_event(buf):
    out = {"wall_time": 0.0, "step": 0}
    scalars, texts = {}, {}
    has_summary = False
    for field, wire, v in fields(buf):
        if field == 1:
            expect(wire, 1, "Event.wall_time")
            out["wall_time"] = struct.unpack("<d", v)[0]
        elif field == 2:
            expect(wire, 0, "Event.step")
            out["step"] = to_int64(v)
        elif field == 3:
            expect(wire, 2, "Event.file_version")
            out["file_version"] = v.decode("utf-8")
        elif field == 5:
            expect(wire, 2, "Event.summary")
            has_summary = True
            for sf, sw, sv in fields(v):
                if sf != 1:
                    continue
                expect(sw, 2, "Summary.value")
                tag, simple, plugin, dtype, strings = decode_value(sv)
                if simple is not None:
                    scalars[tag] = json_float(simple)
                elif plugin == "text" or dtype == 7:
                    if dtype != 7 or len(strings) != 1:
                        raise DecodeError("text summary '%s' is not one DT_STRING value" % tag)
                    texts[tag] = strings[0]
    if has_summary:
        out["scalars"] = scalars
        out["texts"] = texts
    return out


def decode_file(data):
    pos = 0
    events = []
    while pos < len(data):
        if pos + 12 > len(data):
            raise DecodeError("truncated record header at byte %d" % pos)
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if masked(crc32c(header)) != length_crc:
            raise DecodeError("length CRC mismatch in record at byte %d" % pos)
        start = pos + 12
        if start + length + 4 > len(data):
            raise DecodeError("truncated record data at byte %d" % pos)
        body = data[start:start + length]
        (data_crc,) = struct.unpack("<I", data[start + length:start + length + 4])
        if masked(crc32c(body)) != data_crc:
            raise DecodeError("data CRC mismatch in record at byte %d" % pos)
        events.append(decode_event(body))
        pos = start + length + 4
    return events


def main():
    if len(sys.argv) != 2:
        sys.stderr.write("usage: tb_decode.py EVENTFILE\n")
        return 2
    with open(sys.argv[1], "rb") as f:
        data = f.read()
    try:
        events = decode_file(data)
    except (DecodeError, UnicodeDecodeError, struct.error) as e:
        sys.stderr.write("tb_decode.py: %s: %s\n" % (sys.argv[1], e))
        return 1
    for ev in events:
        print(json.dumps(ev, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
