"""Writes tests/golden/fixtures/ckpt_python_writer.safetensors: a tiny file from an independent
(Python) safetensors writer that tests/unit/ckpt/test_safetensors.cpp reads back and re-creates
byte for byte with Loom's writer. Every value comes from a formula the C++ test repeats, so the
fixture only changes if this script does. Run: /usr/bin/python3 tests/golden/gen_safetensors_fixture.py

Contents (name: dtype shape = values):
  a.f32:    F32 (2, 3)  = (i - 2.5) * 0.37, i = 0..5
  b.bf16:   BF16 (5,)   = bf16(round-to-nearest-even) of [1/3, pi, -2.75, 1e-3, 65504.5]
  c.f16:    F16 (2, 2)  = f16 (via f32) of [0.1, -1.5, 6.1e-5, 1000.25]
  d.i32:    I32 (4,)    = [-2, 0, 7, 2147483647]
  e.i64:    I64 (3,)    = [-1, 2^40, 5]
  f.u16:    U16 (3,)    = [0, 1, 65535]
  g.f8e4m3: F8_E4M3 (4,) bytes [0x38, 0xB8, 0x7E, 0x01] = [1, -1, 448, 2^-9]
  h.f8e5m2: F8_E5M2 (3,) bytes [0x3C, 0x7B, 0x80]       = [1, 57344, -0]
  scalar:   F32 ()      = 42.0
  empty:    F32 (0, 3)
  wärme:    F32 (1,)    = -7.25   (non-ASCII name: stored as UTF-8)
  __metadata__: {"format": "pt", "note": "π ≈ 3.14159", "writer": "gen_safetensors_fixture.py"}
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_py as st  # noqa: E402


def main():
    tensors = {
        "a.f32": ((np.arange(6, dtype=np.float64) - 2.5) * 0.37).astype(np.float32).reshape(2, 3),
        "b.bf16": st.Raw("BF16", [5], st.bf16_bits(np.array([1 / 3, math.pi, -2.75, 1e-3, 65504.5],
                                                             dtype=np.float32)).astype("<u2").tobytes()),
        "c.f16": np.array([[0.1, -1.5], [6.1e-5, 1000.25]], dtype=np.float32).astype(np.float16),
        "d.i32": np.array([-2, 0, 7, 2147483647], dtype=np.int32),
        "e.i64": np.array([-1, 1 << 40, 5], dtype=np.int64),
        "f.u16": np.array([0, 1, 65535], dtype=np.uint16),
        "g.f8e4m3": st.Raw("F8_E4M3", [4], bytes([0x38, 0xB8, 0x7E, 0x01])),
        "h.f8e5m2": st.Raw("F8_E5M2", [3], bytes([0x3C, 0x7B, 0x80])),
        "scalar": np.array(42.0, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "wärme": np.array([-7.25], dtype=np.float32),
    }
    metadata = {"format": "pt", "note": "π ≈ 3.14159", "writer": "gen_safetensors_fixture.py"}
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "ckpt_python_writer.safetensors")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    n = st.save(out, tensors, metadata)
    print(f"wrote {out} ({n} bytes)")


if __name__ == "__main__":
    main()
