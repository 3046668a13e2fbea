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

A checkpoint already in FP8 (ladle.model.fp8_checkpoints) arrives as an Fp8Weight: its e4m3 values
and its scales, one per block of rows and inputs. Where each row has one scale (per-channel and
per-tensor checkpoints) the layer takes them as they are; block-scaled ones (128 x 128: DeepSeek's,
Qwen3's FP8 releases) are dequantised and quantised again per row, since a rowwise scaled matmul
takes one scale per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.model.layers import Linear, in_fixed_chunks

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] as e4m3 with one float32 scale per row [R, 1]: x ~ q * scale."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@dataclass
class Fp8Weight:
    """A checkpoint's FP8 weight: weight[n, k] = q[n, k] * scales[n // rows, k // inputs], one float32
    scale per block of `block` = (rows, inputs); a per-row weight's block is (1, in), a per-tensor
    one's the whole matrix."""

    q: torch.Tensor  # float8_e4m3fn [out, in]
    scales: torch.Tensor  # float32 [ceil(out / rows), ceil(in / inputs)]
    block: tuple[int, int]
    source: str = "checkpoint"

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def per_row(self) -> bool:
        """Whether each output row has one scale over all its inputs."""
        return self.block[1] >= self.q.shape[1]

    def row_scales(self) -> torch.Tensor:
        """[out, 1]: each row's scale (per_row weights only)."""
        if not self.per_row:
            raise ValueError(f"a weight scaled in blocks of {self.block} has no single scale per row")
        return self.scales[:, :1].repeat_interleave(self.block[0], dim=0)[: self.q.shape[0]].float()

    def as_per_row(self) -> Fp8Weight:
        """The same weight with its scales spelled out one per row (block (1, in))."""
        return Fp8Weight(self.q, self.row_scales(), (1, self.q.shape[1]), self.source)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.q.shape
        scales = self.scales.float().repeat_interleave(self.block[0], dim=0)[:rows]
        scales = scales.repeat_interleave(self.block[1], dim=1)[:, :cols]
        return (self.q.float() * scales).to(dtype)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Fp8Weight:
        return Fp8Weight(self.q.to(device, non_blocking=non_blocking),
                         self.scales.to(device, non_blocking=non_blocking), self.block, self.source)

    def rows(self, span: slice) -> Fp8Weight:
        """Output rows `span` (a tensor-parallel rank's share), cut on the scales' block boundaries."""
        w = self.as_per_row() if self.per_row else self
        values, scales = _cut(span, w.q.shape[0], w.block[0], "rows")
        return Fp8Weight(w.q[values].clone(), w.scales[scales].clone(), w.block, w.source)

    def columns(self, span: slice) -> Fp8Weight:
        """Input columns `span`; a per-row weight keeps its scales, a block-scaled one its blocks' columns."""
        if self.per_row:
            values, _ = _cut(span, self.q.shape[1], 1, "inputs")
            w = self.as_per_row()
            q = w.q[:, values].clone()
            return Fp8Weight(q, w.scales.clone(), (1, q.shape[1]), w.source)
        values, scales = _cut(span, self.q.shape[1], self.block[1], "inputs")
        return Fp8Weight(self.q[:, values].clone(), self.scales[:, scales].clone(), self.block, self.source)


def _cut(span: slice, length: int, block: int, what: str) -> tuple[slice, slice]:
    """`span` of `length` values and the span of their blocks' scales; it must start and end on a block."""
    start, stop = span.start or 0, length if span.stop is None else span.stop
    if start % block or (stop % block and stop != length):
        raise ValueError(f"an fp8 weight's blocks of {block} {what} do not split at {start}:{stop}")
    return slice(start, stop), slice(start // block, -(-stop // block))


def cat_fp8(parts: list[Fp8Weight]) -> Fp8Weight | None:
    """Fused projections stacked by output row as one Fp8Weight, or None where their scales cannot
    stack (blocks of different shapes, or a part whose rows end inside a block)."""
    if all(p.per_row for p in parts):
        parts = [p.as_per_row() for p in parts]
    block = parts[0].block
    if any(p.block != block or p.per_row != parts[0].per_row for p in parts):
        return None
    if not parts[0].per_row and any(p.q.shape[0] % block[0] for p in parts[:-1]):
        return None
    return Fp8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), block,
                     " + ".join(sorted({p.source for p in parts})))


class Fp8Linear(Linear):
    """y = x W^T + b over e4m3 weights with per-row scales (see the module docstring)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 source: str):
        """q: e4m3 [N, K]; scales: float32 [N, 1]; dtype: the activations' (and outputs') dtype."""
        super().__init__(torch.empty(0, q.shape[1], dtype=dtype, device=q.device), bias)
        self.out_features = q.shape[0]
        self.qweight_t = q.t()  # [K, N] column-major: the layout _scaled_mm takes for its second operand
        self.scales_t = scales.float().t().contiguous()  # [1, N]
        self.bias32 = None if bias is None else bias.float()
        self.source = source

    @classmethod
    def quantized_at_load(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
        """A float weight quantised per row now."""
        q, scales = quantize_rows(weight)
        return cls(q, scales, bias, weight.dtype, "quantised at load")

    @classmethod
    def from_checkpoint(cls, weight: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> Fp8Linear:
        """A checkpoint's FP8 weight: its values and scales as they are where it has one scale per row,
        else (block scales) dequantised and quantised again per row."""
        if weight.per_row:
            return cls(weight.q, weight.row_scales(), bias, dtype, weight.source)
        q, scales = quantize_rows(weight.dequantize(torch.float32))
        return cls(q, scales, bias, dtype, f"{weight.source}, blocks re-quantised per row")

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
