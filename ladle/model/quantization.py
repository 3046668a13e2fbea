"""Weight-only int8: linear weights as int8 with float32 scales, computed on by native kernels.

Two forms. Per output row (`--quantization int8` on a float model): quantised at load,
symmetric, s = max|W_row| / 127, Q = round(W / s), and y = (x Q^T) * s + b. Grouped (a GGUF's
Q8_0 / Q4_x / Q5_x / Q4_K / Q6_K blocks, repacked exactly by ladle.model.gguf_blocks; GPTQ and
AWQ layers, ladle.model.int4_checkpoints): a scale, and maybe a minimum, per output row and
group of inputs, each group's sum folded in by its scale. A decode step reads one byte per
weight instead of four, which is what bounds it, and half a byte where the values fit 4 bits
(0..15: the 4-bit formats, their offsets kept in the minimums), held two to a byte; group
scales and minimums are held as fp16 where every one is exactly an fp16 (the GGUF types with
one fp16 factor per block), else float32.

Per-row weights run on integer dot products (kernels/int8_dot.cpp): each row of x is quantised
to 8 bits per block of 32 inputs on the fly and multiplied with the int8 weights exactly in
int32 (VNNI, AVX2 or scalar: the same sums), as llama.cpp does for Q8_0, so a decode step costs
one instruction per 64 weights and runs at memory speed; the 8-bit activations cost a little
accuracy (the README has the figures). Grouped weights, and per-row ones whose inputs are no
multiple of 32, run on the canonical kernel: float activations, an exact FMA chain per output
over weights widened on the fly. Both kernels give a row the same bits whatever else is in the
call, so canonical (scoring) rows take them too and scoring keeps its bit-identical replay.
LADLE_INT8_DOT=0 keeps per-row weights on the canonical kernel. On AMX CPUs, decode-sized calls of
AMX_INT8_ROWS rows take the same integer sums from AMX tiles (int8_dot.cpp): the same bits.

A prompt's many rows reuse each weight often enough that converting it again in every row tile
costs more than the bytes save: calls of more than WIDEN_ROWS rows (when the model's routing
sends prefills to torch) widen W back to float a slice at a time, each weight exactly as
dequantising the checkpoint gives it, and multiply on torch's GEMM (MKL), float activations
and all. Without native kernels the layer keeps the dequantised float weight and runs as a
float Linear (same numbers as the widened path, no saving).

`quantization` (the engine's flag): `auto` serves weights as the checkpoint holds them (GGUF
blocks grouped int8, float tensors float), `none` dequantises everything to float, `int8`
also quantises float tensors per row, `fp8` holds them as e4m3 (ladle.model.fp8). An FP8
checkpoint's layers (Fp8Weights) stay FP8 under `fp8` (the engine resolves `auto` to it where
the platform has FP8 matmuls) and are dequantised under the others.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch

from ladle.model import kernels
from ladle.model.kernels.native import DOT_BLOCK, exactly_fp16
from ladle.model.kernels.routing import ROUNDS, MatmulRouting, interleaved_seconds
from ladle.model.fp8 import Fp8Linear, Fp8Weight, cat_fp8
from ladle.model.layers import Linear

log = logging.getLogger(__name__)

WIDEN_ROWS = 128  # calls of more rows than this take widened slices on torch (see the module docstring)
# per-row int8 calls that go to the AMX tiles where the CPU has them: where the tiles' per-block cost
# (a store of the sums and their float fold) is shared by enough rows (a guess until timed on AMX)
AMX_INT8_ROWS = range(4, 33)
WIDEN_SLICE_BYTES = 8 << 20  # float weights widened at a time: they stay in cache for the GEMM
_workspace = threading.local()  # each thread's slice buffer, reused from call to call


def dot_enabled() -> bool:
    """LADLE_INT8_DOT=0 keeps per-row int8 weights on the exact FMA-chain kernel (float activations)."""
    return os.environ.get("LADLE_INT8_DOT", "1").strip().lower() not in ("0", "false", "no", "off")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q int8 [out, in], scales float32 [out]) with weight ~= Q * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row stays zero
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales[:, None]


@dataclass
class GroupedWeight:
    """An int8 weight with a scale (and maybe a minimum) per output row and group of inputs:
    weight[n, k] = q[n, k] * scales[n, k // size] (+ mins[n, k // size])."""

    q: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out, in / size]
    mins: torch.Tensor | None = None
    source: str = "GGUF blocks"  # what the checkpoint held, for the start log

    @property
    def four_bit(self) -> bool:
        """Whether the values fit 4 bits (0..15) over an even number of inputs per group: the kernel
        then holds them two to a byte."""
        return self.size % 2 == 0 and bool(self.q.min() >= 0) and bool(self.q.max() <= 15)

    @property
    def size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        groups = self.scales.shape[1]
        w = self.q.float().view(self.q.shape[0], groups, -1) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.view(self.q.shape).to(dtype)

    def regrouped(self, size: int) -> GroupedWeight:
        """The same weights with each group's scale (and minimum) repeated over groups of `size`,
        which divides this one's."""
        if self.size % size:
            raise ValueError(f"groups of {self.size} do not split into groups of {size}")
        repeat = self.size // size
        mins = None if self.mins is None else self.mins.repeat_interleave(repeat, dim=1)
        return GroupedWeight(self.q, self.scales.repeat_interleave(repeat, dim=1), mins, self.source)


def dense(weight: torch.Tensor | GroupedWeight | Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a float tensor of `dtype` (quantised checkpoints' layers dequantised)."""
    return weight.to(dtype) if isinstance(weight, torch.Tensor) else weight.dequantize(dtype)


def cat_weights(parts: list[torch.Tensor | GroupedWeight | Fp8Weight],
                dtype: torch.dtype) -> torch.Tensor | GroupedWeight | Fp8Weight:
    """Fused projections (q/k/v, gate/up) stacked by output row: grouped if every part is grouped
    (in groups of the smallest part's size where sizes differ, as in a Q4_K_M file's Q4_K and Q6_K
    layers; a missing minimum is a zero one), fp8 if every part is fp8 with scales that stack,
    else float."""
    if all(isinstance(p, Fp8Weight) for p in parts):
        fused = cat_fp8(parts)
        if fused is not None:
            return fused
    grouped = [p for p in parts if isinstance(p, GroupedWeight)]
    size = min((p.size for p in grouped), default=0)
    if len(grouped) == len(parts) and all(p.size % size == 0 for p in grouped):
        grouped = [p if p.size == size else p.regrouped(size) for p in grouped]
        mins = None
        if any(p.mins is not None for p in grouped):
            mins = torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in grouped])
        return GroupedWeight(torch.cat([p.q for p in grouped]), torch.cat([p.scales for p in grouped]), mins,
                             " + ".join(sorted({p.source for p in grouped})))
    return torch.cat([dense(p, dtype) for p in parts])


def describe(linears: list[Linear]) -> str:
    """How a model's linear weights are held, for the start log and /version."""
    grouped = {(lin.bits, lin.group_size, lin.source) for lin in linears if lin.quantized and lin.group_size}
    fp8 = sorted({lin.source for lin in linears if isinstance(lin, Fp8Linear)})
    per_row = sum(lin.quantized and not lin.group_size and not isinstance(lin, Fp8Linear) for lin in linears)
    floats = sum(not lin.quantized for lin in linears)
    parts = [f"{'4-bit' if bits == 4 else 'int8'} in groups of {size} ({source})"
             for bits, size, source in sorted(grouped)]
    parts += ["int8 per row"] * bool(per_row) + [f"fp8 e4m3 per row ({source})" for source in fp8]
    parts += ["float"] * bool(floats)
    return " + ".join(parts)


def make_linear(weight: torch.Tensor | GroupedWeight | Fp8Weight, bias: torch.Tensor | None, quantization: str,
                dtype: torch.dtype) -> Linear:
    """The layer `quantization` asks for (see the module docstring; fp8: ladle.model.fp8)."""
    if quantization == "fp8":
        if isinstance(weight, Fp8Weight):
            return Fp8Linear.from_checkpoint(weight, bias, dtype)
        return Fp8Linear.quantized_at_load(dense(weight, dtype), bias)
    if isinstance(weight, Fp8Weight):
        weight = weight.dequantize(dtype)
    if isinstance(weight, GroupedWeight):
        return Linear(weight.dequantize(dtype), bias) if quantization == "none" else Int8Linear(weight, bias, dtype)
    return Int8Linear(weight, bias, dtype) if quantization == "int8" else Linear(weight, bias)


class Int8Linear(Linear):
    """A Linear on int8 weights: a float weight quantised per output row at construction, or a
    grouped one as it is (see the module docstring)."""

    def __init__(self, weight: torch.Tensor | GroupedWeight, bias: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None):
        grouped = isinstance(weight, GroupedWeight)
        dtype = dtype or (torch.float32 if grouped else weight.dtype)
        q, self.scales = (weight.q, None) if grouped else quantize_int8(weight)
        self.group_size = weight.size if grouped else None  # None: a scale per output row
        self.source = weight.source if grouped else "quantised at load"
        native = kernels.native_kernels()
        self._dot = False
        if native is None:
            float_weight = weight.dequantize(dtype) if grouped else dequantize_int8(q, self.scales).to(dtype)
            super().__init__(float_weight, bias)
            self._int8_panels = None
            return
        super().__init__(torch.empty(0, q.shape[1], dtype=dtype), bias)  # no float copy of W
        self.out_features = q.shape[0]
        self.bits = 4 if grouped and weight.four_bit else 8
        self._dot = not grouped and q.shape[1] % DOT_BLOCK == 0 and dot_enabled()  # per row: integer dot products
        if self._dot:
            self._int8_panels, self.scales = native.pack_dot(q, self.scales)
        else:
            self._int8_panels = native.pack_panels(q, four_bit=self.bits == 4)
        self._groups = None
        if grouped:  # fp16 scales and minimums where they all are fp16 values (a GGUF's): half the bytes
            params = [t for t in (weight.scales, weight.mins) if t is not None]
            params_dtype = torch.float16 if all(exactly_fp16(t) for t in params) else torch.float32
            mins = None if weight.mins is None else native.pack_groups(weight.mins, params_dtype)
            self._groups = (weight.size, native.pack_groups(weight.scales, params_dtype), mins)
        self._kernels = native  # the library that packed the panels computes with them

    def __call__(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        if self._int8_panels is None:
            return super().__call__(x, batch_invariant)
        if x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:  # the model's rows: as they are
            return self._matmul(x, batch_invariant)
        rows = x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, self.in_features).contiguous()
        y = self._matmul(rows.float(), batch_invariant).reshape(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _matmul(self, rows: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        """float32 rows [M, in] (rows may be strided) through the kernel this call's size takes."""
        if not batch_invariant and rows.shape[0] > WIDEN_ROWS and self.routing.prefill == "torch":
            return self._widened_matmul(rows)
        return self._kernel_matmul(rows)

    def _kernel_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self._dot and self._kernels.amx_int8 and rows.shape[0] in AMX_INT8_ROWS:
            return self._kernels.int8_amx_linear(rows, self._int8_panels, self.scales, self.out_features, self._bias32)
        if self._dot:
            return self._kernels.int8_dot_linear(rows, self._int8_panels, self.scales, self.out_features, self._bias32)
        return self._kernels.canonical_linear(rows, self._int8_panels, self.out_features, self._bias32, self.scales,
                                              self._groups)

    def _widened_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T (+ bias) on torch's GEMM, W widened to float one slice of panels at a time."""
        k, n, all_panels = self.in_features, self.out_features, self._int8_panels.shape[0]
        per_slice = max(1, WIDEN_SLICE_BYTES // (k * 16 * 4))  # panels
        buffer = getattr(_workspace, "buffer", None)
        if buffer is None or buffer.numel() < k * per_slice * 16:
            buffer = _workspace.buffer = torch.empty(k * per_slice * 16)
        y = torch.empty(x.shape[0], n)
        for first in range(0, all_panels, per_slice):
            panels = min(per_slice, all_panels - first)
            out = buffer[:k * panels * 16].view(k, panels * 16)
            if self._dot:
                w = self._kernels.widen_dot_panels(self._int8_panels, self.scales, out, first)
            else:
                w = self._kernels.widen_panels(self._int8_panels, k, out, first, self.scales, self._groups)
            begin, end = first * 16, min(n, (first + panels) * 16)
            torch.mm(x, w[:, :end - begin], out=y[:, begin:end])
        return y if self._bias32 is None else y.add_(self._bias32)

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
        if self._groups is None:
            return self._int8_panels.numel() + self.scales.numel() * 4
        _, scales, mins = self._groups
        params = scales.numel() + (0 if mins is None else mins.numel())
        return self._int8_panels.numel() + params * scales.element_size()


PREFILL_TIMING_ROWS = 2 * WIDEN_ROWS  # a prompt chunk, for choose_prefill_route


def choose_prefill_route(linears: list[Int8Linear]) -> MatmulRouting:
    """Where calls of more than WIDEN_ROWS rows go, timed on these layers (one decoder layer's):
    `canonical`, the layers' own kernel, or `torch`, widened slices on torch's GEMM. Which wins
    depends on the CPU: MKL's float GEMM on an AVX-512 Xeon; the int8 dot kernel on a Zen 5 EPYC,
    where MKL's float32 GEMM reaches about 170 GFLOP/s. Decode-sized calls always take the kernel."""
    linears = [lin for lin in linears if isinstance(lin, Int8Linear)]  # fp8 layers take their one op at any size
    if not linears:
        return MatmulRouting("canonical", "canonical", "no int8 layers to time")
    x = torch.randn(PREFILL_TIMING_ROWS, max(lin.in_features for lin in linears), generator=torch.Generator().manual_seed(0))
    rows = {lin.in_features: x[:, : lin.in_features] for lin in linears}
    samples = interleaved_seconds({"kernel": lambda: [lin._kernel_matmul(rows[lin.in_features]) for lin in linears],
                                   "widened": lambda: [lin._widened_matmul(rows[lin.in_features]) for lin in linears]},
                                  ROUNDS)  # in rounds, so that a burst of another process's work slows both
    kernel, widened = min(samples["kernel"]), min(samples["widened"])
    measured = (f"{PREFILL_TIMING_ROWS} rows through a layer's quantised weights: their kernel {kernel * 1e3:.1f} ms, "
                f"widened slices on torch {widened * 1e3:.1f} ms")
    return MatmulRouting("canonical", "canonical" if kernel < widened else "torch", measured)

