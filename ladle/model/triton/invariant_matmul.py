"""A batch-invariant matmul for canonical rows on CUDA: y = x @ W^T (+ bias), one fixed tile.

cuBLAS picks its kernel, its tiles and often a split over K from the call's shape, so a row's
bits move with the number of rows beside it. Here every call uses the same tile (BLOCK_M x
BLOCK_N, stepping BLOCK_K through K in order, no split-K), whatever M: an output's sum is the
same tl.dot steps over the same K tiles for a row alone or in a batch of 64. Rows past M are
masked loads of zero, never mixed into another row's sum. Canonical requests (decisions,
/v1/score, --deterministic) take it; other traffic keeps cuBLAS (ladle.model.layers.Linear).

The accumulator is float32; float32 operands multiply in IEEE float32 (no TF32), bf16 and fp16
ones on the tensor cores. The result is rounded once to x's dtype, after the bias.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 128, 64  # fixed: the tile is what keeps a row's bits


@triton.jit
def _invariant_matmul(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K),
                    other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows may be strided) @ weight [N, K]^T (+ bias [N]) in x's dtype, each row's bits
    independent of M."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("invariant_linear: x and weight need contiguous rows")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _invariant_matmul[grid](x, weight, bias if bias is not None else x, y, m, n, k, x.stride(0), weight.stride(0),
                            y.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y
