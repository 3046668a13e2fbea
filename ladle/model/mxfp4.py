"""MXFP4 expert weights (gpt-oss's checkpoints), dequantised once at load.

A weight W [rows, cols] is stored as NAME_blocks uint8 [rows, cols / 32, 16] and NAME_scales uint8
[rows, cols / 32]: each group of 32 values along a row is 32 four-bit E2M1 codes, two to a byte (the
low nibble first), sharing one E8M0 scale 2^(scale - 127). gpt-oss keeps its experts' gate_up_proj
and down_proj this way, each [experts, out, in] here, and transformers' parameters are the
transpose, [experts, in, out]. Every MXFP4 value is exact in bfloat16, so dequantising loses
nothing; it costs memory, 16 bits a weight where the checkpoint holds 4.25.
"""

from __future__ import annotations

import torch

# E2M1: sign, two exponent bits, one mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., rows, groups, 16] codes and [..., rows, groups] scales -> [..., rows, groups * 32] in dtype."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not go with scales {tuple(scales.shape)}")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # low nibble first
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None]).flatten(-2).to(dtype)


def read_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each NAME_blocks / NAME_scales pair replaced by float32 NAME in
    transformers' layout ([experts, in, out]), as an unquantised gpt-oss checkpoint holds it."""
    out = dict(weights)
    for name in [n for n in weights if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        scales = out.pop(base + "_scales", None)
        if scales is None:
            raise ValueError(f"{name} has no {base}_scales beside it")
        out[base] = dequantize(out.pop(name), scales).transpose(-1, -2).contiguous()
    return out
