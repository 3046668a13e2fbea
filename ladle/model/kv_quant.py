"""8-bit KV caches (`--kv-cache-dtype int8|fp8`): each token's K and V, per KV head, stored as
int8 or fp8 e4m3 with one float32 scale (max |x| over the head's values, over the format's
largest value).

A scale per token and head rather than per block or per tensor: a block fills a token at a
time, so a block-wide scale would have to be fixed before its tokens are seen, and a
tensor-wide one (vLLM's fp8 default of 1.0) loses small heads to rounding. At head size 64
the scale adds 4 bytes to 64, so a token takes 68 bytes per head and layer against float32's
256: 3.8x the tokens in the same memory (1.9x bfloat16's).

Quantising is deterministic (the same row always gives the same bytes), and every attention
path reads the cache, fresh tokens included, so an 8-bit cache keeps ladle's bit-identical
scoring cold, cached and batched. The native kernels and these torch functions write the
same bytes.
"""

from __future__ import annotations

import torch

# format name -> storage dtype; `fp8` is vLLM's name for e4m3
KV_8BIT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_8bit(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in dtype, float32 scales [...]), x ~ values * scales."""
    x = x.float()
    qmax = _QMAX[dtype]
    absmax = x.abs().amax(-1)
    inv = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
    y = x * inv[..., None]
    if dtype == torch.int8:
        values = y.round().clamp_(-qmax, qmax).to(torch.int8)
    else:
        values = y.clamp_(-qmax, qmax).to(dtype)
    return values, absmax / qmax


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (values.float() * scales[..., None]).to(dtype)
