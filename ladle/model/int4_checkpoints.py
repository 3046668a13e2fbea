"""4-bit checkpoints as people download them (GPTQ and AWQ safetensors), read into grouped int8.

Both store, per linear layer NAME, 4-bit integers packed eight to an int32, a float16 scale and a
4-bit zero point per output column and group of inputs, and dequantise as

    weight[n, k] = scale[g, n] * (q[k, n] - zero[g, n]),     g = k // group_size

which is a GroupedWeight (ladle.model.quantization) with q as it is (0..15, so the kernel holds it
two to a byte), the scales, and minimums -zero * scale (exact in float32: an fp16 scale times an
integer below 32).

    GPTQ  NAME.qweight int32 [in / 8, out]   input 8i + j in bits 4j..4j+3 of row i
          NAME.qzeros  int32 [groups, out / 8], column 8c + j in bits 4j of column c; the classic
                       format (checkpoint_format "gptq") stores zero - 1, "gptq_v2" the zero
          NAME.scales  fp16  [groups, out];  NAME.g_idx int32 [in]: each input's group
    AWQ   NAME.qweight int32 [in, out / 8]   column 8c + ORDER[j] in bits 4j of column c
          NAME.qzeros  int32 [groups, out / 8], the same packing; NAME.scales fp16 [groups, out]

A GPTQ checkpoint quantised with act-order (`desc_act`: g_idx not in input order) puts inputs of
one group anywhere in the row, which the grouped kernel's contiguous groups cannot express; its
layers are dequantised to float (logged) and served as float, or as int8 per row with
--quantization int8.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ladle.model.quantization import GroupedWeight

log = logging.getLogger(__name__)

METHODS = ("gptq", "awq")
PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble j holds column ORDER[j] of its 8


def check_config(qc: dict[str, Any]) -> str:
    """The checkpoint's quant_method, after refusing what ladle cannot read."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (ladle reads {METHODS})")
    if qc.get("bits", 4) != 4:
        raise ValueError(f"quantization_config.bits {qc['bits']!r}: ladle reads 4-bit {method.upper()} checkpoints")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"quantization_config.version {qc['version']!r}: ladle reads AWQ's 'gemm' packing")
    if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {qc['checkpoint_format']!r} is not a GPTQ packing")
    return method


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (0..15, nibble j from bits 4j), along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    words = packed.to(torch.int32)
    if dim == 0:
        values = (words[:, None, :] >> shifts[None, :, None]) & 0xF
        return values.reshape(-1, packed.shape[1])
    return ((words[:, :, None] >> shifts) & 0xF).reshape(packed.shape[0], -1)


def read_layer(method: str, tensors: dict[str, torch.Tensor], qc: dict[str, Any],
               name: str) -> GroupedWeight | torch.Tensor:
    """NAME's packed tensors (suffixes PACKED_SUFFIXES, keys without NAME) -> its weight [out, in]."""
    if method == "awq":
        q = _awq_columns(unpack_nibbles(tensors[".qweight"], dim=1))
        zeros = _awq_columns(unpack_nibbles(tensors[".qzeros"], dim=1))
    else:
        q = unpack_nibbles(tensors[".qweight"], dim=0)
        zeros = unpack_nibbles(tensors[".qzeros"], dim=1)
        if qc.get("checkpoint_format", "gptq") == "gptq":
            zeros = zeros + 1
    scales = tensors[".scales"].float()
    in_features, out_features = q.shape
    groups = scales.shape[0]
    if zeros.shape != scales.shape or scales.shape[1] != out_features or in_features % groups:
        raise ValueError(f"{name}: qweight {tuple(q.shape)}, qzeros and scales {tuple(scales.shape)} do not agree")
    size = in_features // groups
    g_idx = tensors.get(".g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_features) // size):
        log.info("%s: act-order groups (desc_act), dequantised to float", name)
        rows = g_idx.long()
        return (scales[rows] * (q - zeros[rows])).T.contiguous()
    q, scales, zeros = q.T, scales.T.contiguous(), zeros.T
    return GroupedWeight(q.to(torch.int8).contiguous(), scales, (-zeros * scales).contiguous(), method.upper())


def _awq_columns(values: torch.Tensor) -> torch.Tensor:
    """AWQ's interleaved columns [rows, out] back in order."""
    order = torch.tensor(AWQ_ORDER)
    index = torch.empty(8, dtype=torch.long)
    index[order] = torch.arange(8)  # column c is nibble index[c]
    cols = values.shape[1]
    return values[:, (torch.arange(0, cols, 8)[:, None] + index).flatten()]


def read_checkpoint(weights: dict[str, torch.Tensor], qc: dict[str, Any]) -> dict[str, Any]:
    """`weights` with every packed layer's tensors replaced by its NAME.weight."""
    method = check_config(qc)
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".qweight")]:
        name = key.removesuffix(".qweight")
        parts = {s: out.pop(name + s) for s in PACKED_SUFFIXES if name + s in out}
        missing = [s for s in PACKED_SUFFIXES[:3] if s not in parts]
        if missing:
            raise ValueError(f"{method.upper()} layer {name} has no {', '.join(name + s for s in missing)}")
        out[name + ".weight"] = read_layer(method, parts, qc, name)
    return out
