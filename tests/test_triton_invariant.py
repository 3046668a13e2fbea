"""The batch-invariant Triton matmul (ladle.model.triton.invariant_matmul) that canonical rows take on
CUDA: a row's bits alone and in batches of 2, 7 and 64, against float64. Without a GPU it runs under
Triton's interpreter on the CPU (float32 and float16: the interpreter's tl.dot on bf16 is wrong), bf16
on the device (marked cuda)."""

from __future__ import annotations

import pytest
import torch

from ladle.model.triton.invariant_matmul import BLOCK_M, invariant_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)]
# relative to sum |x w|: float32 sums in float32; fp16/bf16 round the result once to their own ulp
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def operands(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k, generator=g)[:, :k]  # rows strided, as a fused projection's slice
    w, b = torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
    return (t.to(dtype).to(DEVICE) for t in (x, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    k, n = 80, 72  # a K tail past the 64-deep tiles, an N tail inside the 128-wide one
    x, w, b = operands(64, k, n, dtype)
    y = invariant_linear(x, w, b)
    exact = x.double() @ w.double().T + b.double()
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()
    assert y.dtype == dtype and ((y.double() - exact).abs() <= TOLERANCE[dtype] * scale).all()
    row = 5  # alone, then at every place of a batch: first, middle, in the second M tile
    alone = invariant_linear(x[row : row + 1], w, b)
    assert torch.equal(alone, y[row : row + 1])
    for batch, at in ((2, 1), (7, 3), (64, BLOCK_M + 2)):
        others = operands(batch, k, n, dtype, seed=batch)
        xs = next(others).clone()
        xs[at] = x[row]
        assert torch.equal(invariant_linear(xs, w, b)[at], alone[0]), (batch, at)


def test_without_bias_and_with_one_row_tile() -> None:
    x, w, _ = operands(3, 64, 16, torch.float32, seed=4)
    y = invariant_linear(x, w)
    assert torch.allclose(y.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        invariant_linear(x.t(), w)
