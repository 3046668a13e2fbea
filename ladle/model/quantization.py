"""Weight-only int8: each linear layer's weight as int8 with one float32 scale per output row.

Quantised at load (symmetric, per output channel): s = max|W_row| / 127, Q = round(W / s).
Activations, sums and outputs stay in float32: y = (x Q^T) * s + b. A decode step reads one
byte per weight instead of four, which is what bounds it.

The int8 weights live only as the native canonical kernel's panels (16 output columns per
panel, widened to float on the fly). That kernel fixes each output's FMA chain whatever the
rows of the call, so every call takes it, decode steps, prompts and canonical (scoring)
rows alike, and scoring keeps its bit-identical replay. Without native kernels the layer
keeps the dequantised float weight and runs as a float Linear (same numbers, no saving).
"""

from __future__ import annotations

import logging

import torch

from ladle.model import kernels
from ladle.model.layers import Linear

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q int8 [out, in], scales float32 [out]) with weight ~= Q * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row stays zero
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales[:, None]


class Int8Linear(Linear):
    """A Linear whose weight is quantised to int8 at construction (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        q, self.scales = quantize_int8(weight)
        native = kernels.native_kernels()
        if native is None:
            super().__init__(dequantize_int8(q, self.scales).to(weight.dtype), bias)
            self._int8_panels = None
            return
        super().__init__(weight[:0], bias)  # no float copy of W
        self.out_features = weight.shape[0]
        self._int8_panels = native.pack_panels(q)
        self._kernels = native  # the library that packed the panels computes with them

    def __call__(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        if self._int8_panels is None:
            return super().__call__(x, batch_invariant)
        rows = x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, self.in_features).contiguous()
        y = self._kernels.canonical_linear(rows.float(), self._int8_panels, self.out_features, self._bias32,
                                           self.scales)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def pack(self) -> None:
        if self._int8_panels is None:
            super().pack()

    @property
    def quantized(self) -> bool:
        return self._int8_panels is not None

    @property
    def nbytes(self) -> int:
        if self._int8_panels is None:
            return super().nbytes
        return self._int8_panels.numel() + self.scales.numel() * 4
