"""GGUF's quantised blocks, repacked exactly into grouped int8: per row, int8 values with a float32
scale (and for some types a minimum) per group of G inputs, so that

    weight[n, k] = q[n, k] * scale[n, k // G] (+ min[n, k // G])

is the very number llama.cpp's (and gguf-py's) dequantisation gives: the fp16 scales widen
exactly, and scale * q needs at most 24 of float32's significant bits.

    Q8_0  34 bytes: fp16 d, 32 x int8 q                 w = d * q
    Q4_0  18 bytes: fp16 d, 16 bytes of 4-bit q         w = d * (q - 8) = d * q + (-8 d)
    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of 4-bit q w = d * q + m
    Q5_0  22 bytes: fp16 d, 32 high bits, 16 bytes of low 4 bits    w = d * (q - 16)
    Q5_1  24 bytes: fp16 d, fp16 m, 32 high bits, 16 bytes of low 4 bits    w = d * q + m

(4-bit q: element j < 16 in the low nibble of byte j, element 16 + j in its high nibble; a 5-bit
q's fifth bit is bit j of the little-endian 32-bit word. 5-bit values are held as int8.) The
4-bit types keep q as it is (0..15), Q4_0's offset going into its minimums, so the kernel can
hold them two to a byte: it reads half a byte per weight where the float path reads four.

The k-quants (llama.cpp's Q4_K_M files mix Q4_K and Q6_K) hold super-blocks of 256 inputs
whose sub-blocks carry small integer scales under one fp16 factor; each sub-block becomes a
group, its scale (and minimum) the product, exact in float32:

    Q4_K  144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit (sc, m) for 8 sub-blocks of 32,
          128 bytes of 4-bit q                          w = (d sc) q - (dmin m)         G = 32
    Q6_K  210 bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 x int8 sc,
          fp16 d                                        w = (d sc) (q - 32)             G = 16
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
# bytes per block, inputs per block, inputs per group
_LAYOUT = {Q.Q8_0: (34, 32, 32), Q.Q4_0: (18, 32, 32), Q.Q4_1: (20, 32, 32), Q.Q5_0: (22, 32, 32),
           Q.Q5_1: (24, 32, 32), Q.Q4_K: (144, 256, 32), Q.Q6_K: (210, 256, 16)}
GROUPED_TYPES = frozenset(_LAYOUT)


def unpack(data: np.ndarray, qtype: GGMLQuantizationType, rows: int,
           cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A [rows, cols] tensor's raw blocks -> (q int8 [rows, cols], scales float32 [rows, cols / G],
    mins float32 [rows, cols / G] or None), G the type's group size."""
    block_bytes, block_size, _ = _LAYOUT[qtype]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    if cols % block_size or blocks.shape[0] != rows * cols // block_size:
        raise ValueError(f"{qtype.name} data does not hold a [{rows}, {cols}] tensor")
    q, scales, mins = _UNPACK[qtype](blocks)
    return q.reshape(rows, cols), scales.reshape(rows, -1), None if mins is None else mins.reshape(rows, -1)


def _half(b: np.ndarray) -> np.ndarray:
    """fp16 values from their byte pairs (the last axis), as float32 [..., 1]."""
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> their low nibbles then their high nibbles, [..., 2n], as int8."""
    return np.concatenate([b & 0x0F, b >> 4], axis=-1).astype(np.int8)


def _q8_0(blocks: np.ndarray):
    return blocks[:, 2:].copy().view(np.int8), _half(blocks[:, :2]), None


def _q4_0(blocks: np.ndarray):
    scales = _half(blocks[:, :2])
    return _nibbles(blocks[:, 2:]), scales, -8 * scales  # exact: a power of two times an fp16


def _q4_1(blocks: np.ndarray):
    return _nibbles(blocks[:, 4:]), _half(blocks[:, :2]), _half(blocks[:, 2:4])


def _five_bits(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """5-bit values from 16 bytes of nibbles and 4 bytes holding each element's fifth bit."""
    bits = np.unpackbits(high, axis=1, bitorder="little")  # bit e of the word: element e
    return _nibbles(low) | (bits.astype(np.int8) << 4)


def _q5_0(blocks: np.ndarray):
    return _five_bits(blocks[:, 6:], blocks[:, 2:6]) - 16, _half(blocks[:, :2]), None


def _q5_1(blocks: np.ndarray):
    return _five_bits(blocks[:, 8:], blocks[:, 4:8]), _half(blocks[:, :2]), _half(blocks[:, 2:4])


def _q4_k(blocks: np.ndarray):
    d, dmin = _half(blocks[:, :2]), _half(blocks[:, 2:4])
    packed = blocks[:, 4:16]
    low, high = packed[:, :4], packed[:, 4:8]  # sub-blocks 0-3: 6 bits each of sc (low) and m (high)
    top = packed[:, 8:12]  # sub-blocks 4-7: 4 low bits of sc and of m, their top 2 bits in low's and high's
    sc = np.concatenate([low & 63, (top & 0x0F) | ((low >> 6) << 4)], axis=1)
    m = np.concatenate([high & 63, (top >> 4) | ((high >> 6) << 4)], axis=1)
    # 32 bytes per pair of sub-blocks: the first sub-block's values in the low nibbles
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 256)
    return q, d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q6_k(blocks: np.ndarray):
    low = blocks[:, :128].reshape(-1, 2, 64)  # per half of 128 inputs
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    # a half's input 32j + l (j = 0..3, l = 0..31): the low nibble of byte l (j = 0) or l + 32
    # (j = 1), the high nibble of the same for j = 2, 3; its top two bits are bits 2j, 2j + 1 of
    # high byte l
    low4 = np.concatenate([low & 0x0F, low >> 4], axis=2)  # [blocks, 2, 128]: j = 0, 1 then 2, 3
    top2 = (high >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3  # [blocks, 2, 4, 32]
    q = (low4 | (top2.reshape(-1, 2, 128) << 4)).astype(np.int8) - 32
    return q.reshape(-1, 256), _half(blocks[:, 208:210]) * sc, None


_UNPACK = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q4_K: _q4_k,
           Q.Q6_K: _q6_k}
