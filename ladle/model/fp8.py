"""FP8 weights (`--quantization fp8`, vLLM's name): W as float8 e4m3 with one float32 scale per output
row, quantised at load (s = max|W_row| / 448, Q = W / s rounded to e4m3); each call quantises its
activations the same way per token (row), and one scaled matmul multiplies the two in fp8 and
applies both scales and the bias in float32:

    y[m, n] = sx[m] * sw[n] * sum_k Qx[m, k] Qw[n, k] + b[n]     (torch._scaled_mm, rowwise scales)

A decode step reads one byte per weight instead of bf16's two. On CUDA the product runs on FP8
tensor cores (sm_89 and later; older GPUs are refused at start); on the CPU torch runs the same
op without fp8 hardware, a correctness path (int8 is the CPU's fast one).

Canonical rows (decisions, scoring, --deterministic) are multiplied in chunks of a fixed number
of rows, zero-padded: one call shape whatever the batch, and each row's activation scale is its
own, so a row's bits do not depend on what else is in the step.
"""

from __future__ import annotations

import torch

from ladle.model.layers import Linear, in_fixed_chunks

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] as e4m3 with one float32 scale per row [R, 1]: x ~ q * scale."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(Linear):
    """y = x W^T + b over e4m3 weights with per-row scales (see the module docstring)."""

    source = "quantised at load"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        q, scales = quantize_rows(weight)
        super().__init__(torch.empty(0, weight.shape[1], dtype=weight.dtype, device=weight.device), bias)
        self.out_features = q.shape[0]
        self.qweight_t = q.t()  # [K, N] column-major: the layout _scaled_mm takes for its second operand
        self.scales_t = scales.t().contiguous()  # [1, N]
        self.bias32 = None if bias is None else bias.float()

    @property
    def quantized(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return self.qweight_t.numel() + self.scales_t.numel() * 4

    def pack(self) -> None:  # nothing for the canonical kernel: fp8 rows have their own fixed path
        pass

    def __call__(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        return in_fixed_chunks(x, self._scaled) if batch_invariant else self._scaled(x)

    def dequantized(self) -> torch.Tensor:
        """The weights these e4m3 values and scales stand for, float32 [N, K] (tests, references)."""
        return (self.qweight_t.float() * self.scales_t).t()

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        qx, sx = quantize_rows(x)
        bias = None if self.bias32 is None else self.bias32.to(x.dtype)
        return torch._scaled_mm(qx, self.qweight_t, scale_a=sx, scale_b=self.scales_t, bias=bias, out_dtype=x.dtype)
