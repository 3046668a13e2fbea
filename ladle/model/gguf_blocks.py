"""GGUF's quantised blocks, repacked exactly into grouped int8: per row, int8 values with a float32
scale (and for the `_1` types a minimum) per group of 32 inputs, so that

    weight[n, k] = q[n, k] * scale[n, k // 32] (+ min[n, k // 32])

is the very number llama.cpp's (and gguf-py's) dequantisation gives: the fp16 scales widen
exactly, and scale * q needs at most 19 of float32's 24 significant bits.

    Q8_0  34 bytes: fp16 d, 32 x int8 q                 w = d * q
    Q4_0  18 bytes: fp16 d, 16 bytes of 4-bit q         w = d * (q - 8) = d * q + (-8 d)
    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of 4-bit q w = d * q + m

(4-bit q: element j < 16 in the low nibble of byte j, element 16 + j in its high nibble.) The
4-bit types keep q as it is (0..15), Q4_0's offset going into its minimums, so the kernel can
hold them two to a byte: it reads half a byte per weight where the float path reads four.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

GROUP_SIZE = 32
_BLOCK_BYTES = {GGMLQuantizationType.Q8_0: 34, GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
GROUPED_TYPES = frozenset(_BLOCK_BYTES)


def unpack(data: np.ndarray, qtype: GGMLQuantizationType, rows: int,
           cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A [rows, cols] tensor's raw blocks -> (q int8 [rows, cols], scales float32 [rows, cols / 32],
    mins float32 [rows, cols / 32] or None)."""
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, _BLOCK_BYTES[qtype])
    if blocks.shape[0] != rows * cols // GROUP_SIZE or cols % GROUP_SIZE:
        raise ValueError(f"{qtype.name} data does not hold a [{rows}, {cols}] tensor")
    scales = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    mins = None
    if qtype == GGMLQuantizationType.Q8_0:
        q = blocks[:, 2:].copy().view(np.int8)
    else:
        nibbles = blocks[:, 2:] if qtype == GGMLQuantizationType.Q4_0 else blocks[:, 4:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int8)
        if qtype == GGMLQuantizationType.Q4_0:
            mins = -8 * scales  # exact: a power of two times an fp16
        else:
            mins = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    return q.reshape(rows, cols), scales, mins
