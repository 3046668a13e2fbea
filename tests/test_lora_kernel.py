"""The native batched multi-LoRA kernel (lora.cpp, NativeKernels.lora_add) on every instruction set
this CPU runs: against a float64 gather reference, rows without an adapter untouched bit for bit,
a row's bits independent of its batch and of the thread count, bad operands refused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from ladle.model.kernels import loader
from ladle.model.kernels.native import NativeKernels

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again


@pytest.fixture(params=loader.supported_isas())
def lora_kernels(request, monkeypatch: pytest.MonkeyPatch) -> Iterator[NativeKernels]:
    """The kernels built for each instruction set this CPU runs (LADLE_ISA forces each). A failed build,
    a missing compiler included, is a failure, as in tests/test_kernels.py: ladle needs its kernels."""
    if not loader.enabled():
        if os.environ.get("CI"):
            pytest.fail("LADLE_NATIVE_KERNELS=0 in CI: the native kernels' tests would not run")
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    monkeypatch.setenv("LADLE_ISA", request.param)
    loader.reset()
    k = loader.native_kernels()
    assert k is not None, "the native kernels failed to build; see the warning logged above"
    assert k.isa == request.param
    yield k
    monkeypatch.undo()
    loader.reset()


@dataclass
class Batch:
    x: torch.Tensor  # [T, in], rows strided
    y: torch.Tensor  # [T, out]
    slots: torch.Tensor  # int32 [T]
    a: torch.Tensor  # [S, P*R, in]
    bt: torch.Tensor  # [S, P*R, out]
    ranks: torch.Tensor  # int32 [S, P]
    cols: torch.Tensor  # int64 [P + 1]

    def run(self, kernels: NativeKernels, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """lora_add on a copy of y (of the rows `rows` only, if given); returns the copy."""
        x, y, slots = self.x, self.y, self.slots
        if rows is not None:
            x, y, slots = x[rows], y[rows], slots[rows]
        y = y.clone()
        kernels.lora_add(x, y, slots.contiguous(), self.a, self.bt, self.ranks, self.cols)
        return y


def make_batch(rows: int, k: int, out: int, rank: int, cols: list[int], slots: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    parts = len(cols) - 1
    wide = torch.randn(rows, k + 9, generator=gen)
    x = wide[:, 4 : 4 + k]  # row stride k + 9
    assert x.stride(0) == k + 9
    slot_of_row = torch.randint(-1, slots, (rows,), generator=gen, dtype=torch.int32)
    slot_of_row[: slots + 1] = torch.arange(-1, slots, dtype=torch.int32)  # every slot and -1 appear
    slot_of_row = slot_of_row[torch.randperm(rows, generator=gen)]
    ranks = torch.randint(0, rank + 1, (slots, parts), generator=gen, dtype=torch.int32)
    ranks[0, 0], ranks[-1, -1] = 0, rank  # a skipped part and a full-rank part
    return Batch(x=x, y=torch.randn(rows, out, generator=gen), slots=slot_of_row,
                 a=torch.randn(slots, parts * rank, k, generator=gen) / k**0.5,
                 bt=torch.randn(slots, parts * rank, out, generator=gen), ranks=ranks,
                 cols=torch.tensor(cols, dtype=torch.int64))


def reference(b: Batch) -> torch.Tensor:
    """float64 y + per-row gather: u = x @ A[s]^T with rank rows past ranks[s, p] masked to zero,
    then u @ B^T into the part's columns."""
    parts = b.ranks.shape[1]
    rank = b.a.shape[1] // parts
    y = b.y.double().clone()
    keep = (torch.arange(rank).view(1, 1, rank) < b.ranks.unsqueeze(-1)).reshape(b.ranks.shape[0], parts * rank)
    for t, s in enumerate(b.slots.tolist()):
        if s < 0:
            continue
        u = (b.a[s].double() @ b.x[t].double()) * keep[s]  # [P*R]
        for p in range(parts):
            c0, c1 = b.cols[p].item(), b.cols[p + 1].item()
            y[t, c0:c1] += u[p * rank : (p + 1) * rank] @ b.bt[s, p * rank : (p + 1) * rank, c0:c1].double()
    return y


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# (T, in, out, R, cols): the brief's odd sizes (three uneven parts), two parts that leave columns
# out at both ends, inputs and columns under one 8-float stripe, and stripes with no tail.
SHAPES = [
    (37, 77, 131, 5, [0, 45, 98, 131]),
    (37, 77, 131, 5, [3, 61, 126]),
    (9, 5, 7, 3, [0, 2, 7]),
    (20, 64, 96, 8, [0, 32, 64, 96]),
    (37, 300, 517, 8, [0, 300, 411, 517]),  # enough work for the threads
    (12, 576, 960, 16, [0, 576, 768, 960]),  # SmolLM2-135M's fused qkv
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-in{s[1]}-out{s[2]}-R{s[3]}-P{len(s[4]) - 1}")
def test_lora_add_matches_float64_reference(lora_kernels: NativeKernels, shape) -> None:
    rows, k, out, rank, cols = shape
    b = make_batch(rows, k, out, rank, cols, slots=4, seed=k * out)
    y = b.run(lora_kernels)
    ref = reference(b)
    assert relative_error(y, ref) < 1e-5
    delta = y.double() - b.y.double()  # the update alone, against the reference's (y's rounding aside)
    assert ((delta - (ref - b.y.double())).abs().max() / (ref - b.y.double()).abs().max()).item() < 1e-5
    # columns outside every part and rows without an adapter: the same bits as before
    outside = torch.ones(out, dtype=torch.bool)
    outside[cols[0] : cols[-1]] = False
    assert torch.equal(y[:, outside], b.y[:, outside])
    untouched = b.slots < 0
    assert untouched.any() and torch.equal(y[untouched], b.y[untouched])


def test_rows_without_an_adapter_are_untouched_bit_for_bit(lora_kernels: NativeKernels) -> None:
    b = make_batch(37, 77, 131, 5, [0, 45, 98, 131], slots=4, seed=3)
    b.slots[::2] = -1
    b.y[::2, ::3] = float("nan")  # NaNs and -0.0 stay exactly what they were
    b.y[::2, 1::3] = -0.0
    b.x[::2] = float("inf")  # and a row's input is not even read
    y = b.run(lora_kernels)
    assert y[::2].view(torch.int32).equal(b.y[::2].view(torch.int32))
    assert torch.isfinite(y[1::2]).all()
    none = b.slots.clone().fill_(-1)  # a batch with no adapter at all
    y = b.y.clone()
    lora_kernels.lora_add(b.x, y, none, b.a, b.bt, b.ranks, b.cols)
    assert y.view(torch.int32).equal(b.y.view(torch.int32))


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[-1]], ids=["small", "threaded"])
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads(lora_kernels: NativeKernels, shape) -> None:
    rows, k, out, rank, cols = shape
    b = make_batch(rows, k, out, rank, cols, slots=4, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = b.run(lora_kernels)
        torch.set_num_threads(1)
        single_thread = b.run(lora_kernels)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batched, single_thread)
    for t in range(rows):  # alone, and as the last row of a pair of its slot, and of another
        assert torch.equal(b.run(lora_kernels, slice(t, t + 1))[0], batched[t]), t
    shuffled = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    assert torch.equal(b.run(lora_kernels, shuffled), batched[shuffled])
    head = b.run(lora_kernels, slice(0, 5))  # a prefix: rows pair up differently by slot
    assert torch.equal(head, batched[:5])


def test_bad_operands_are_refused(lora_kernels: NativeKernels) -> None:
    b = make_batch(6, 77, 131, 5, [0, 45, 98, 131], slots=4, seed=5)
    y = b.y.clone()

    def call(**changes) -> None:
        args = dict(x=b.x, y=y, slots=b.slots, a=b.a, bt=b.bt, ranks=b.ranks, cols=b.cols) | changes
        lora_kernels.lora_add(**args)

    with pytest.raises(ValueError, match="float32"):
        call(x=b.x.double())
    with pytest.raises(ValueError, match="int32"):
        call(slots=b.slots.long())
    with pytest.raises(ValueError, match="int64 cols"):
        call(cols=b.cols.int())
    with pytest.raises(ValueError, match="slots must lie in -1..3"):
        call(slots=torch.tensor([0, 1, 4, -1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="slots must lie"):
        call(slots=torch.tensor([0, 1, -2, -1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="ranks must lie in 0..5"):
        call(ranks=b.ranks.clone().fill_(6))
    with pytest.raises(ValueError, match="cols"):
        call(cols=torch.tensor([0, 98, 45, 131]))
    with pytest.raises(ValueError, match="cols"):
        call(cols=torch.tensor([0, 45, 98, 132]))
    with pytest.raises(ValueError, match="shapes"):
        call(bt=b.bt[:, :, :130].contiguous())
    with pytest.raises(ValueError, match="shapes"):
        call(cols=b.cols[:3])
    with pytest.raises(ValueError, match="contiguous"):
        call(x=b.x.t().contiguous().t())
    with pytest.raises(ValueError, match="contiguous"):
        call(a=b.a.transpose(1, 2).contiguous().transpose(1, 2))
    assert torch.equal(y, b.y)  # nothing written by a refused call


def test_the_avx512_build_gives_the_avx2_builds_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX-512 runs the same chains two to a register (lora.cpp): the same bits as AVX2."""
    if not loader.enabled() or "avx512" not in loader.supported_isas():
        pytest.skip("needs the native kernels and an AVX-512 CPU")
    results = []
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv("LADLE_ISA", isa)
        loader.reset()
        k = loader.native_kernels()
        assert k is not None and k.isa == isa
        results.append([make_batch(*shape[:4], shape[4], slots=4, seed=17).run(k) for shape in SHAPES])
    loader.reset()
    for shape, wide, narrow in zip(SHAPES, *results):
        assert torch.equal(wide, narrow), shape
