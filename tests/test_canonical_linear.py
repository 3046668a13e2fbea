"""The canonical matmul: one fixed FMA chain per output element, so a row's bits never depend
on the rows beside it, the call's size or the instruction set. Checked against float64 and
against the scalar definition, on every instruction set this CPU runs (LADLE_ISA forces each)."""

from __future__ import annotations

import json

from fractions import Fraction

import numpy as np

import pytest
import torch

from ladle.model import kernels
from ladle.model.kernels import loader
from ladle.model.layers import Linear

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

SHAPES = [(37, 5), (64, 40), (576, 960), (1536, 576), (300, 1001)]  # (in, out): panel tails, odd k


def operands(k: int, n: int, dtype: torch.dtype, rows: int = 40):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=gen).to(dtype)
    return torch.randn(rows, k, generator=gen), w, torch.randn(n, generator=gen)


def to_float32(exact: Fraction) -> float:
    """`exact` rounded to the nearest float32 (ties to even), without double rounding."""
    d = float(exact)  # correctly rounded to float64
    f = np.float32(d)
    other = np.nextafter(f, np.float32(np.inf if d > f else -np.inf), dtype=np.float32)
    if (float(f) + float(other)) / 2 == d and Fraction(d) != exact:  # a float64 tie that exact is not
        f = max(f, other) if exact > d else min(f, other)
    return float(f)


def fma_chain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, row: int, col: int) -> float:
    """The definition, one element: acc = fma(x, w, acc) in input order, each step rounded once
    to float32 from the exact value; then + bias."""
    acc = 0.0
    for xi, wi in zip(x[row].tolist(), w[col].float().tolist()):
        acc = to_float32(Fraction(xi) * Fraction(wi) + Fraction(acc))
    return to_float32(Fraction(acc) + Fraction(b[col].item()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_and_is_row_invariant(isa_kernels, shape, dtype) -> None:
    k, n = shape
    x, w, b = operands(k, n, dtype)
    packed = isa_kernels.pack_panels(w)
    y = isa_kernels.canonical_linear(x, packed, n, b)
    ref = x.double() @ w.double().T + b.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    for rows in (1, 2, 3, 5, 12, 13, 25, 40):  # every tile shape and tail, more than one row block
        assert torch.equal(isa_kernels.canonical_linear(x[:rows], packed, n, b), y[:rows]), rows
    for row in (0, 17):  # a row alone, out of place
        assert torch.equal(isa_kernels.canonical_linear(x[row : row + 1], packed, n, b), y[row : row + 1])


def test_bf16_rows_in_and_out_are_the_float_kernel_rounded_once(isa_kernels) -> None:
    """bf16 x (rows strided, as a fused projection's slice) to a bf16 y: exactly the float32 kernel on
    the widened rows, rounded to bf16 once, and still the same bits for a row alone."""
    x, w, b = operands(200, 37, torch.bfloat16, rows=13)
    xb = torch.cat([x, x], dim=1).bfloat16()[:, :200]  # row stride 400
    packed = isa_kernels.pack_panels(w)
    y = isa_kernels.canonical_linear(xb, packed, 37, b)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, isa_kernels.canonical_linear(xb.float(), packed, 37, b).to(torch.bfloat16))
    assert torch.equal(isa_kernels.canonical_linear(xb[5:6], packed, 37, b), y[5:6])


def test_is_the_fma_chain_itself(isa_kernels) -> None:
    x, w, b = operands(61, 19, torch.float32, rows=3)
    y = isa_kernels.canonical_linear(x, isa_kernels.pack_panels(w), 19, b)
    for row, col in ((0, 0), (1, 16), (2, 18)):
        assert y[row, col].item() == fma_chain(x, w, b, row, col)


def test_same_bits_on_every_instruction_set(monkeypatch: pytest.MonkeyPatch) -> None:
    if not loader.enabled():
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    x, w, b = operands(576, 960, torch.float32, rows=20)
    results = {}
    for isa in loader.supported_isas():
        monkeypatch.setenv("LADLE_ISA", isa)
        loader.reset()
        native = kernels.native_kernels()
        results[isa] = native.canonical_linear(x, native.pack_panels(w), 960, b)
    loader.reset()
    first = next(iter(results.values()))
    assert all(torch.equal(y, first) for y in results.values()), list(results)


def test_strided_rows_and_bf16_activations(isa_kernels) -> None:
    x, w, b = operands(64, 40, torch.bfloat16)
    wide = torch.randn(40, 100)
    wide[:, 10:74] = x
    lin = Linear(w, b.to(torch.bfloat16))
    strided = lin(wide[:, 10:74], batch_invariant=True)
    assert strided.dtype == torch.float32 and torch.equal(strided, lin(x.contiguous(), batch_invariant=True))
    y16 = lin(x.to(torch.bfloat16), batch_invariant=True)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16[3:4], lin(x[3:4].to(torch.bfloat16), batch_invariant=True))


def test_requested_isa_the_cpu_lacks_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "supported_isas", lambda flags=None: ["avx2", "scalar"])
    monkeypatch.setenv("LADLE_ISA", "avx512")
    assert loader.chosen_isa() == "avx2"
    monkeypatch.setenv("LADLE_ISA", "scalar")
    assert loader.chosen_isa() == "scalar"
    monkeypatch.setenv("LADLE_ISA", "sse9")
    with pytest.raises(ValueError, match="LADLE_ISA"):
        loader.chosen_isa()


def test_supported_isas_follow_the_cpu_flags() -> None:
    if loader.platform.machine() != "x86_64":
        pytest.skip("x86 flags")
    assert loader.supported_isas({"avx", "avx2", "fma"}) == ["avx2", "scalar"]
    assert loader.supported_isas({"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl"}) == [
        "avx512", "avx2", "scalar"]
    assert loader.supported_isas({"sse4_2"}) == ["scalar"]


def test_routing_is_measured_and_can_be_forced(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from ladle.model.kernels import routing

    if not loader.enabled():
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    monkeypatch.delenv("LADLE_MATMUL", raising=False)
    native = kernels.native_kernels()
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path))  # measured here, not read from an earlier run
    monkeypatch.setattr(routing, "_chosen", {})
    weights = [torch.randn(96, 64), torch.randn(64, 96)]
    measured = routing.choose_routing(native, weights)
    assert measured.prefill in ("canonical", "torch") and len(measured.by_rows) == len(routing.ROW_BUCKETS)
    assert all(kernel in routing.KERNELS for kernel in measured.by_rows)
    parts = measured.measured.split("; ")  # every candidate timed at every bucket's size, and prompt-sized
    assert [p.split(" rows:")[0] for p in parts] == [str(r) for r in routing.ROW_BUCKETS + (routing.PREFILL_ROWS,)]
    assert all("small" in p and "canonical" in p and "torch" in p for p in parts[:-1])
    assert "small" not in parts[-1] and "torch" in parts[-1]
    assert measured.decode == measured.by_rows[-1]
    bf16 = routing.choose_routing(native, [w.bfloat16() for w in weights])
    assert "small" not in bf16.measured  # the small-row kernel takes float32 weights only
    assert routing.choose_routing(None, weights) == routing.MatmulRouting("torch", "torch", "no native kernels")
    monkeypatch.setenv("LADLE_MATMUL", "small:canonical")
    assert (routing.choose_routing(native, weights).decode, routing.choose_routing(native, weights).prefill) == (
        "small", "canonical")
    monkeypatch.setenv("LADLE_MATMUL", "fast:torch")
    with pytest.raises(ValueError, match="LADLE_MATMUL"):
        routing.choose_routing(native, weights)


def test_kept_measurements_follow_the_kernels_sources(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The routes and the auto dtype are kept per version of the kernels' sources: an edited kernel
    (an upgrade) is measured again, not served by the last version's timings."""
    import shutil

    from ladle.model import dtype
    from ladle.model.kernels import routing

    if not loader.enabled():
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    sources = tmp_path / "kernels"
    shutil.copytree(loader.KERNELS_DIR, sources, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(loader, "KERNELS_DIR", sources)
    key = ("avx2", torch.float32, ((80, 48), (48, 80)))

    def kept_files() -> tuple:
        loader.sources_digest.cache_clear()
        return routing.routes_file("avx2", key), dtype.auto_choice_file()

    try:
        before = kept_files()
        assert kept_files() == before  # the same sources, the same files
        header = sources / "canonical_linear.h"
        header.write_text(header.read_text() + "\n// edited\n")
        after = kept_files()
        assert all(a != b and a.parent == b.parent for a, b in zip(after, before))
    finally:
        loader.sources_digest.cache_clear()  # the real sources' digest again


def test_routes_are_measured_once_per_machine(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A second process (here: the in-process choice forgotten) reads the routes the first measured,
    and measures again once their file is deleted or unreadable."""
    from ladle.model.kernels import routing

    if not loader.enabled():
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    monkeypatch.delenv("LADLE_MATMUL", raising=False)
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(routing, "_chosen", {})
    monkeypatch.setattr(routing, "NOISY", float("inf"))  # these microsecond calls spread on a loaded machine
    native = kernels.native_kernels()
    weights = [torch.randn(80, 48), torch.randn(48, 80)]
    first = routing.choose_routing(native, weights)
    path = routing.routes_file(native.isa, (native.isa, torch.float32, ((80, 48), (48, 80))))
    assert path.is_file() and path.is_relative_to(tmp_path)
    measured = []
    real = routing._measure
    monkeypatch.setattr(routing, "_measure", lambda *a: measured.append(1) or real(*a))
    routing._chosen.clear()
    again = routing.choose_routing(native, weights)
    assert measured == [] and (again.by_rows, again.prefill) == (first.by_rows, first.prefill)
    assert again.measured == f"{first.measured} (measured once: {path})"
    path.write_text("{not json")
    routing._chosen.clear()
    routing.choose_routing(native, weights)
    assert measured == [1]
    kept = json.loads(path.read_text())  # routes kept by an earlier version (timed one candidate after another)
    path.write_text(json.dumps({k: v for k, v in kept.items() if k != "version"}))
    routing._chosen.clear()
    routing.choose_routing(native, weights)
    assert measured == [1, 1] and json.loads(path.read_text())["version"] == routing.ROUTES_VERSION


def test_routes_timed_on_a_busy_machine_are_used_and_not_kept(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Timings whose rounds spread beyond NOISY (here any spread at all) serve the process, are not
    written, and the next start measures again."""
    from ladle.model.kernels import routing

    if not loader.enabled():
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    monkeypatch.delenv("LADLE_MATMUL", raising=False)
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(routing, "_chosen", {})
    monkeypatch.setattr(routing, "NOISY", 0.5)  # a slowest round is never under half the fastest: always busy
    native = kernels.native_kernels()
    weights = [torch.randn(80, 48), torch.randn(48, 80)]
    chosen = routing.choose_routing(native, weights)
    assert len(chosen.by_rows) == len(routing.ROW_BUCKETS) and "measured once" not in chosen.measured
    assert not routing.routes_file(native.isa, (native.isa, torch.float32, ((80, 48), (48, 80)))).exists()
    assert "busy machine" in caplog.text


def test_interleaved_rounds_and_what_counts_as_steady() -> None:
    from ladle.model.kernels import routing

    order = []
    samples = routing.interleaved_seconds({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3)
    assert order == ["a", "b"] + ["a", "b"] * 3 and [len(t) for t in samples.values()] == [3, 3]  # warm-up, rounds
    assert routing.is_steady({"a": [1.0, 1.2, 1.5], "b": [2.0, 2.0, 2.9]})
    assert not routing.is_steady({"a": [1.0, 1.2, 1.5], "b": [2.0, 3.1, 2.2]})
