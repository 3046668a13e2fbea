"""The per-token layer ops of a Llama forward on CUDA, each one fused Triton kernel.

A batch-1 decode step is bound by reading the weights once, inside a CUDA graph; torch's
versions of these ops cost several launches apiece per layer, these one each. They keep
ladle's torch arithmetic (ladle.model.layers, which rounds as transformers' Llama code does):
everything is computed in float32 and rounded to the tensor's dtype exactly where torch's
reduced-precision ops round, i.e. after every elementwise op (a bf16 `a * b` is the float32
product rounded once), and the norm is rounded before the weight multiply. Division and square
root use the IEEE-rounded forms and launches disable FMA contraction, since the GPU's defaults
(approximate `/`, fused multiply-add) would round differently from torch. What still differs:
a norm sums its squares in another order (the output may move by an ulp or two, rarely in bf16),
and silu's exp is the GPU's approximate exp2, corrected (in bf16 exact on every gate value).

All functions are graph-capturable: no host syncs, outputs allocated with torch.empty.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _block(n: int, cap: int | None = None) -> tuple[int, int]:
    """BLOCK (n's next power of two, at most cap) and num_warps (about 8 elements a thread)."""
    block = triton.next_power_of_2(n)
    if cap is not None:
        block = min(block, cap)
    return block, min(max(block // 256, 1), 16)


@triton.jit
def _round(x, dtype: tl.constexpr):
    # float32 -> dtype -> float32: where torch rounds a reduced-precision op's result
    return x.to(dtype).to(tl.float32)


@triton.jit
def _exp(x):
    # tl.exp is 2^(x * log2e) with the product rounded, off by up to |x| ulps on the GPU; carrying
    # that rounding error (and log2e's own) keeps it within ~2 ulps of the CPU's exp, as torch has it
    t = x * 1.4426950216293335  # log2e rounded to float32
    err = tl.fma(x, 1.4426950216293335, -t) + x * 1.925963033500e-08  # t + err = x * log2e, nearly exactly
    e = tl.exp2(t)
    fixed = tl.fma(e, err * 0.6931471805599453, e)  # 2^(t + err) = 2^t (1 + err ln2)
    return tl.where(fixed == fixed, fixed, e)  # NaN where e or x is infinite: then e is exact


@triton.jit
def _normalize(x, w_ptr, cols, mask, N: tl.constexpr, eps, dtype: tl.constexpr):
    # torch: xf * rsqrt(mean(xf^2) + eps), mean = sum / N and rsqrt = 1 / sqrt, each IEEE-rounded
    var = tl.div_rn(tl.sum(x * x, axis=0), N * 1.0)
    normed = _round(x * tl.div_rn(1.0, tl.sqrt_rn(var + eps)), dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (w * normed).to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_t, stride_h, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * stride_t + h * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    out = _normalize(x, w_ptr, cols, mask, N, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + (t * heads + h) * N + cols, out, mask=mask)


@triton.jit
def _add_rms_norm_kernel(h_ptr, a_ptr, w_ptr, out_ptr, stride_h, stride_a, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = h_ptr.dtype.element_ty
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    h = _round(h + a, dtype)  # h.add_(a)
    tl.store(h_ptr + row * stride_h + cols, h.to(dtype), mask=mask)
    out = _normalize(h, w_ptr, cols, mask, N, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, out, mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, heads, stride_xt, stride_xh, stride_ct, stride_st,
                   HALF: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr):
    # one token's cos and sin rows, loaded once for its HEADS heads [HEADS, BLOCK]
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (h < heads) & (cols < HALF)
    dtype = x_ptr.dtype.element_ty
    x_ptr += t * stride_xt + h * stride_xh
    cos_ptr += t * stride_ct
    sin_ptr += t * stride_st
    # in place: both halves are read before either is written
    x1 = tl.load(x_ptr + cols, mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + cols, mask=mask).to(tl.float32)
    c1 = tl.load(cos_ptr + cols, mask=cols < HALF).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + cols, mask=cols < HALF).to(tl.float32)
    s1 = tl.load(sin_ptr + cols, mask=cols < HALF).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + cols, mask=cols < HALF).to(tl.float32)
    # x * cos + cat(x2, x1) * sin, the sign of rotate_half being in sin; three roundings
    out1 = _round(x1 * c1, dtype) + _round(x2 * s1, dtype)
    out2 = _round(x2 * c2, dtype) + _round(x1 * s2, dtype)
    tl.store(x_ptr + cols, out1.to(dtype), mask=mask)
    tl.store(x_ptr + HALF + cols, out2.to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_row, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(tl.div_rn(gate, 1.0 + _exp(-gate)), dtype)  # F.silu: x / (1 + exp(-x)), rounded
    tl.store(out_ptr + row * I + cols, (act * up).to(dtype), mask=mask)


def _empty(shape: torch.Size | tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [T, heads, N] with its last dim contiguous: 2-D and 3-D views keep their strides,
    other ranks are flattened (a copy only where a view cannot be made)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x if x.dim() == 3 else x.reshape(-1, 1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dim, into a new contiguous tensor of x's shape and dtype. x may be a
    strided view, e.g. [T, heads, D] columns of a fused qkv output; weight is [N] in x's dtype."""
    assert weight.dtype == x.dtype and weight.shape == (x.shape[-1],) and weight.is_contiguous()
    rows = _rows(x)
    t, heads, n = rows.shape
    out = _empty(x.shape, x)
    block, warps = _block(n)
    _rms_norm_kernel[(t, heads)](rows, weight, out, rows.stride(0), rows.stride(1), eps, N=n, BLOCK=block,
                                 num_warps=warps, enable_fp_fusion=False)
    return out


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += a in place (rounded to h's dtype), then RMSNorm(h) into a new tensor: one pass.
    h and a are [T, N] (or views to that) with rows of any stride and a contiguous last dim."""
    n = h.shape[-1]
    assert a.shape == h.shape and weight.dtype == h.dtype and weight.shape == (n,) and weight.is_contiguous()
    assert h.stride(-1) == 1, "h is updated in place: its last dim must be contiguous"
    h2, a2 = h.view(-1, n), a.reshape(-1, n)
    if a2.stride(1) != 1:
        a2 = a2.contiguous()
    out = _empty(h.shape, h)
    block, warps = _block(n)
    _add_rms_norm_kernel[(h2.shape[0],)](h2, a2, weight, out, h2.stride(0), a2.stride(0), eps, N=n, BLOCK=block,
                                         num_warps=warps, enable_fp_fusion=False)
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox (rotate-half) rotary embedding of x [T, heads, D] in place; x may be a strided view (last
    dim contiguous). cos, sin: RotaryEmbedding.tables' [T, 1, D] in x's dtype, sin signed. Returns x."""
    t, heads, d = x.shape
    assert x.stride(2) == 1 and d % 2 == 0
    assert cos.dtype == sin.dtype == x.dtype and cos.shape == sin.shape == (t, 1, d)
    assert cos.stride(2) == sin.stride(2) == 1
    block = triton.next_power_of_2(d // 2)
    # a program per token and up to 4096 elements of its heads (of 128-wide heads, 64 at once)
    per_program = min(triton.next_power_of_2(heads), max(1, 4096 // block))
    _, warps = _block(per_program * block)
    _rotary_kernel[(t, triton.cdiv(heads, per_program))](
        x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), HALF=d // 2, BLOCK=block,
        HEADS=per_program, num_warps=warps, enable_fp_fusion=False)
    return x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (rows of any stride, last dim contiguous), into a new [T, I]."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = _empty((t, i), gate_up)
    # elementwise: a row is split over several programs, so that a decode step's one row fills the GPU
    block, warps = _block(i, cap=1024)
    _silu_and_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, gate_up.stride(0), I=i, BLOCK=block,
                                                    num_warps=warps, enable_fp_fusion=False)
    return out
