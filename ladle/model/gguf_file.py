"""A GGUF file's header read straight into Python values, and its tensors as views of one memmap.

gguf-py's GGUFReader keeps a numpy view of every part of every value, each element of an array
included: for a 49k-token vocabulary and its merges, some 200k views built one by one, which the
conversion never reads (transformers reads the tokenizer on its own). This reads each array whole:
numbers in one np.frombuffer, strings one after another. The values are what GGUFReader's
`field.contents()` gives, and the tensors' data the same views (tests/test_loader.py compares them).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
NUMBERS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
           12: "<f8"}  # GGUF's value types, STRING and ARRAY aside
PLAIN_TENSORS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}  # other types are blocks: their bytes, row by row


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF's dims, innermost first (numpy's in reverse)
    n_elements: int
    data: np.ndarray  # numpy's dims; for block types uint8, a row's blocks as bytes


@dataclass
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buffer: np.ndarray):
        self.buffer, self.at = buffer, 0

    def unpack(self, fmt: str) -> Any:
        [value] = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        self.at += size
        return bytes(self.buffer[self.at - size:self.at]).decode("utf-8")

    def numbers(self, kind: int, count: int) -> np.ndarray:
        dtype = np.dtype(NUMBERS[kind])
        values = np.frombuffer(self.buffer, dtype, count, self.at)
        self.at += count * dtype.itemsize
        return values

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            if item_kind == STRING:
                return [self.string() for _ in range(count)]
            if item_kind == ARRAY:
                return [self.value(self.unpack("<I")) for _ in range(count)]
            return self.numbers(item_kind, count).tolist()
        if kind not in NUMBERS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.numbers(kind, 1).tolist()[0]


def read_gguf(path: Path | str) -> GGUFFile:
    """The metadata (key -> str, int, float, bool or list) and the tensors of a little-endian GGUF (v2, v3)."""
    buffer = np.memmap(path, mode="r")
    cursor = _Cursor(buffer)
    if bytes(buffer[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cursor.at = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (big-endian or unknown) is not read here")
    tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = cursor.numbers(10, cursor.unpack("<I")).copy()
        infos.append((name, dims, GGMLQuantizationType(cursor.unpack("<I")), cursor.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: alignment {alignment} is not a power of two")
    start = -(-cursor.at // alignment) * alignment
    return GGUFFile(metadata, [_tensor(buffer, start, *info) for info in infos])


def _tensor(buffer: np.ndarray, start: int, name: str, dims: np.ndarray, kind: GGMLQuantizationType,
            offset: int) -> GGUFTensor:
    n_elements = int(np.prod(dims))
    shape = tuple(reversed(dims.tolist()))
    if kind in PLAIN_TENSORS:
        dtype, count = np.dtype(PLAIN_TENSORS[kind]), n_elements
    else:
        block_size, type_size = GGML_QUANT_SIZES[kind]
        dtype, count, shape = np.dtype(np.uint8), n_elements * type_size // block_size, \
            quant_shape_to_byte_shape(shape, kind)
    data = np.frombuffer(buffer, dtype, count, start + offset).reshape(shape)
    return GGUFTensor(name, kind, dims, n_elements, data)
