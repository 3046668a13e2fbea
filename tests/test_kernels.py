"""The native kernels (small-row linear, RMSNorm and its fused residual add, rotary embedding, SwiGLU's
activation, decode and prompt attention) against torch or float64, and the torch fallback without them."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ladle.model import kernels, kv_quant
from ladle.model.kernels import loader
from ladle.model.kernels.routing import MatmulRouting
from ladle.model.layers import BATCH_INVARIANT_ROWS, Linear, rms_norm

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again


@pytest.fixture(scope="module")
def native() -> kernels.NativeKernels:
    if not loader.enabled():
        if os.environ.get("CI"):
            pytest.fail("LADLE_NATIVE_KERNELS=0 in CI: the native kernels' tests would not run")
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    k = kernels.native_kernels()
    assert k is not None, "the native kernels failed to build; see the warning logged above"
    return k


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    """Nothing loaded before and after the test, so LADLE_NATIVE_KERNELS is read afresh."""
    loader.reset()
    yield
    loader.reset()


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return w.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("in_features", [576, 1536, 64, 37])
@pytest.mark.parametrize("out_features", [1, 7, 960, 1001])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(native, in_features: int, out_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(in_features * out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    for rows in range(1, 33):
        x = torch.randn(rows, in_features, generator=gen)
        y = native.linear(x, w, b)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        assert relative_error(y, reference(x, w, b)) < 1e-4, rows


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_covers_every_row(native, threads: int) -> None:
    gen = torch.Generator().manual_seed(threads)
    w = torch.randn(3 * 8 * 5 + 3, 512, generator=gen)  # more weight than the single-thread cutoff
    x = torch.randn(5, 512, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = native.linear(x, w)
        norm = torch.randn(512, generator=gen)
        many = torch.randn(200, 512, generator=gen)  # enough rows for rms_norm to use the threads
        normed = native.rms_norm(many, norm, 1e-6)
    finally:
        torch.set_num_threads(before)
    assert relative_error(y, reference(x, w, None)) < 1e-4
    assert relative_error(normed, rms_reference(many, norm, 1e-6)) < 1e-6


@pytest.mark.parametrize("features", [576, 1536, 64, 37])
def test_rms_norm_matches_torch(native, features: int) -> None:
    gen = torch.Generator().manual_seed(features)
    w = torch.randn(features, generator=gen)
    for rows in (1, 3, 32, 100):
        x = torch.randn(rows, features, generator=gen) * 5
        assert relative_error(native.rms_norm(x, w, 1e-5), rms_reference(x, w, 1e-5)) < 1e-6, rows
        assert relative_error(rms_norm(x, w, 1e-5), rms_reference(x, w, 1e-5)) < 1e-6, rows


def test_rms_norm_rows_do_not_depend_on_the_batch(native) -> None:
    # Batch-invariant mode relies on it: prefill chunks of any size take the native path.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 576, generator=gen)
    norm = torch.randn(576, generator=gen)
    batched = native.rms_norm(x, norm, 1e-5)
    for i in (0, 1, 150, 299):
        assert torch.equal(native.rms_norm(x[i : i + 1], norm, 1e-5)[0], batched[i])


def paged_cache(gen: torch.Generator, blocks: int = 40, block_size: int = 16, kv_heads: int = 3,
                d: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(blocks, block_size, kv_heads, d, generator=gen),
            torch.randn(blocks, block_size, kv_heads, d, generator=gen))


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                        lens: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """In float64: query b against the first lens[b] keys of its table (their last `window`, if given)."""
    _, block_size, kv_heads, d = k_cache.shape
    heads = q.shape[1]
    out = []
    for b, n in enumerate(lens.tolist()):
        first = 0 if window is None else max(0, n - window)
        slots = [tables[b, t // block_size].item() * block_size + t % block_size for t in range(first, n)]
        k = k_cache.reshape(-1, kv_heads, d)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache.reshape(-1, kv_heads, d)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), k) / d**0.5, dim=-1)
        out.append(torch.einsum("ht,thd->hd", p, v).reshape(-1))
    return torch.stack(out)


def poison_below(cache: torch.Tensor, table: torch.Tensor, keys: int) -> torch.Tensor:
    """The cache with NaN in the blocks of `table` that hold only keys below `keys`: a result that depends
    on one of them (below a sliding window, where the pool may hand blocks on) is NaN."""
    cache = cache.clone()
    cache[table[: max(keys, 0) // cache.shape[1]]] = float("nan")
    return cache


@pytest.mark.parametrize("window", [None, 1, 20], ids=["whole", "window1", "window20"])
@pytest.mark.parametrize("lens", [[1], [37], [16, 5, 160], [300], [1000, 900]])  # the last uses both threads
def test_decode_attention_matches_torch(native, lens: list[int], window: int | None) -> None:
    gen = torch.Generator().manual_seed(sum(lens))
    k_cache, v_cache = paged_cache(gen, blocks=80)
    width = max(-(-n // 16) for n in lens)
    tables = torch.stack([torch.randperm(80, generator=gen)[:width] for _ in lens])
    qkv = torch.randn(len(lens), (9 + 3) * 64, generator=gen)
    q = qkv[:, : 9 * 64].view(len(lens), 9, 64)  # strided rows, as the model passes them
    expected = attention_reference(q, k_cache, v_cache, tables, torch.tensor(lens), window)
    if window is not None and len(lens) == 1:
        k_cache, v_cache = (poison_below(c, tables[0], lens[0] - window) for c in (k_cache, v_cache))
    out = native.decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), 64**-0.5, window)
    assert out.shape == (len(lens), 9 * 64)
    assert relative_error(out, expected) < 1e-5


def prompt_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     first: int, window: int | None = None) -> torch.Tensor:
    """Causal attention for rows at positions first.. in float64."""
    rows = q.shape[0]
    lens = torch.arange(first + 1, first + rows + 1)
    return attention_reference(q, k_cache, v_cache, table.expand(rows, -1), lens, window)


def prompt_attention(native, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     spans: list[tuple[torch.Tensor, int, int, int]], window: int | None = None) -> torch.Tensor:
    """spans: (block table, first row, rows, first position). Rows no span covers stay NaN."""
    width = max(len(t) for t, *_ in spans)
    tables = torch.zeros(len(spans), width, dtype=torch.int64)
    for i, (t, *_) in enumerate(spans):
        tables[i, : len(t)] = t
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"))
    native.prompt_attention(q, k_cache, v_cache, tables, torch.tensor([s[1] for s in spans]),
                            torch.tensor([s[2] for s in spans]), torch.tensor([s[3] for s in spans]),
                            q.shape[2] ** -0.5, out, window=window)
    return out


@pytest.mark.parametrize(("rows", "first", "d"), [(1, 0, 64), (37, 0, 64), (300, 0, 64), (33, 526, 64),
                                                  (5, 90, 128), (20, 3, 8)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_prompt_attention_matches_torch(native, rows: int, first: int, d: int, kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows + first + d)
    k_cache, v_cache = (c.to(kv_dtype) for c in paged_cache(gen, blocks=80, d=d))  # the reference reads the same bf16
    table = torch.randperm(80, generator=gen)[: -(-(first + rows) // 16)]
    qkv = torch.randn(rows, (9 + 6) * d, generator=gen)
    q = qkv[:, : 9 * d].view(rows, 9, d)  # strided rows, as the model passes them
    out = prompt_attention(native, q, k_cache, v_cache, [(table, 0, rows, first)])
    assert relative_error(out, prompt_reference(q, k_cache, v_cache, table, first)) < 1e-5


@pytest.mark.parametrize(("rows", "first", "window"), [(37, 0, 5), (300, 0, 64), (33, 526, 100), (5, 90, 1),
                                                       (40, 200, 13)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_prompt_attention_with_a_sliding_window(native, rows: int, first: int, window: int,
                                                kv_dtype: torch.dtype) -> None:
    """Each row against its last `window` keys, in float64. The blocks below the first row's window
    hold NaN (an 8-bit cache's scales too): nothing may depend on them, as the pool may hand them on."""
    gen = torch.Generator().manual_seed(rows + first + window)
    k_cache, v_cache = paged_cache(gen, blocks=80)
    scales = {}
    if kv_dtype == torch.int8:  # the reference reads what the kernel dequantises
        (k_cache, ks), (v_cache, vs) = (kv_quant.quantize(c, torch.int8) for c in (k_cache, v_cache))
        scales = {"k_scales": ks, "v_scales": vs}
    table = torch.randperm(80, generator=gen)[: -(-(first + rows) // 16)]
    q = torch.randn(rows, 9, 64, generator=gen)
    if scales:
        expected = prompt_reference(q, kv_quant.dequantize(k_cache, ks), kv_quant.dequantize(v_cache, vs), table,
                                    first, window)
        scales = {name: poison_below(s, table, first + 1 - window) for name, s in scales.items()}
    else:
        expected = prompt_reference(q, k_cache, v_cache, table, first, window)
        k_cache, v_cache = (poison_below(c, table, first + 1 - window) for c in (k_cache, v_cache))
    out = torch.full((rows, 9 * 64), float("nan"))
    native.prompt_attention(q, k_cache, v_cache, table[None], torch.tensor([0]), torch.tensor([rows]),
                            torch.tensor([first]), 64**-0.5, out, **scales, window=window)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("window", [None, 50], ids=["whole", "window50"])
def test_prompt_attention_rows_do_not_depend_on_their_neighbours(native, window: int | None) -> None:
    """A row's bits are the same computed in one 600-row chunk, in a later chunk next to
    another sequence, or alone: what scoring and --deterministic rely on."""
    gen = torch.Generator().manual_seed(8)
    k_cache, v_cache = paged_cache(gen, blocks=80)
    table, other = torch.randperm(80, generator=gen)[:38], torch.randperm(80, generator=gen)[:3]
    q = torch.randn(600, 9, 64, generator=gen)
    whole = prompt_attention(native, q, k_cache, v_cache, [(table, 0, 600, 0)], window)
    neighbour = torch.randn(40, 9, 64, generator=gen)
    for first in (1, 13, 16, 523, 599):
        batch = torch.cat([neighbour, q[first:]])
        chunk = prompt_attention(native, batch, k_cache, v_cache, [(other, 0, 40, 5), (table, 40, 600 - first, first)],
                                 window)
        assert torch.equal(chunk[40:], whole[first:]), first
        alone = prompt_attention(native, q[first : first + 1], k_cache, v_cache, [(table, 0, 1, first)], window)
        assert torch.equal(alone, whole[first : first + 1]), first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(native, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = (c.to(dtype) for c in paged_cache(gen))
    qkv = torch.randn(4, (9 + 3 + 3) * 64, generator=gen).to(dtype)
    k = qkv[:, 9 * 64 : 12 * 64].view(4, 3, 64)
    v = qkv[:, 12 * 64 :].view(4, 3, 64)
    slots = torch.tensor([5, 17, 639, 300])
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    expect_k.view(-1, 3, 64).index_copy_(0, slots, k)
    expect_v.view(-1, 3, 64).index_copy_(0, slots, v)
    native.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def test_attention_kernels_refuse_indices_outside_the_cache(native) -> None:
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache = paged_cache(gen)
    before = k_cache.clone()
    k = torch.randn(1, 3, 64, generator=gen)
    with pytest.raises(IndexError):
        native.write_kv(k, k, k_cache, v_cache, torch.tensor([40 * 16]))
    assert torch.equal(k_cache, before)
    q = torch.randn(1, 9, 64, generator=gen)
    with pytest.raises(IndexError):
        native.decode_attention(q, k_cache, v_cache, torch.tensor([[3, 40]]), torch.tensor([20]), 0.125)
    with pytest.raises(IndexError):
        native.decode_attention(q, k_cache, v_cache, torch.tensor([[3, 4]]), torch.tensor([33]), 0.125)
    q = torch.randn(4, 9, 64, generator=gen)
    with pytest.raises(IndexError):  # a block id past the cache
        prompt_attention(native, q, k_cache, v_cache, [(torch.tensor([3, 40]), 0, 4, 14)])
    with pytest.raises(IndexError):  # positions past the table
        prompt_attention(native, q, k_cache, v_cache, [(torch.tensor([3]), 0, 4, 14)])


def test_linear_routes_each_row_bucket_to_its_kernel(native, monkeypatch: pytest.MonkeyPatch) -> None:
    native = kernels.native_kernels()  # the instance Linear will use
    calls: dict[str, list[int]] = {"small": [], "canonical": []}
    real, real_canonical = native.linear, native.canonical_linear

    def spy(x, w, b=None):
        calls["small"].append(x.shape[0])
        return real(x, w, b)

    def canonical_spy(x, packed, n, b=None):
        calls["canonical"].append(x.shape[0])
        return real_canonical(x, packed, n, b)

    monkeypatch.setattr(native, "linear", spy)
    monkeypatch.setattr(native, "canonical_linear", canonical_spy)
    gen = torch.Generator().manual_seed(2)
    lin = Linear(torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen))
    # buckets 1, 2-4, 5-16, 17-64 and prompt-sized, each its own kernel
    lin.routing = MatmulRouting("small", "torch", by_rows=("small", "canonical", "torch", "small"))
    assert lin.routing.table() == "1 small, 2-4 canonical, 5-16 torch, 17-64 small, 65+ torch"
    for rows in (1, 2, 4, 5, 16, 17, 64, 65):
        x = torch.randn(rows, 64, generator=gen)
        assert relative_error(lin(x), reference(x, lin.weight, lin.bias)) < 1e-4
    assert calls == {"small": [1, 17, 64], "canonical": [2, 4]}
    calls["canonical"].clear()
    for rows in (1, 65, 3 * BATCH_INVARIANT_ROWS):  # canonical rows keep the canonical kernel whatever the bucket
        x = torch.randn(rows, 64, generator=gen)
        assert relative_error(lin(x, batch_invariant=True), reference(x, lin.weight, lin.bias)) < 1e-4
    assert calls["canonical"] == [1, 65, 3 * BATCH_INVARIANT_ROWS]
    assert lin.nbytes == 96 * 64 * 4


def test_disabled_by_environment(fresh_loader, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LADLE_NATIVE_KERNELS", "0")
    monkeypatch.setattr(loader, "_build", lambda isa: pytest.fail("disabled kernels must not be built"))
    assert kernels.native_kernels() is None
    gen = torch.Generator().manual_seed(3)
    lin = Linear(torch.randn(33, 576, generator=gen))
    x = torch.randn(2, 576, generator=gen)
    assert relative_error(lin(x), reference(x, lin.weight, None)) < 1e-4
    assert relative_error(lin(x, batch_invariant=True), reference(x, lin.weight, None)) < 1e-4
    norm = torch.randn(576, generator=gen)
    assert torch.equal(rms_norm(x, norm, 1e-6), F.rms_norm(x, (576,), norm, 1e-6))


def test_failed_build_warns_once_and_falls_back(fresh_loader, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    def no_compiler(isa: str) -> str:
        raise RuntimeError("Error building extension 'ladle_kernels'\nc++: not found")

    monkeypatch.setenv("LADLE_NATIVE_KERNELS", "1")
    monkeypatch.setattr(loader, "_build", no_compiler)
    gen = torch.Generator().manual_seed(4)
    lin = Linear(torch.randn(16, 64, generator=gen))
    x = torch.randn(1, 64, generator=gen)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        for _ in range(3):
            assert relative_error(lin(x), reference(x, lin.weight, None)) < 1e-4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Error building extension" in warnings[0].getMessage()


def test_build_goes_to_the_ladle_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path))
    assert loader.build_dir().parent == tmp_path / "kernels"
    monkeypatch.delenv("LADLE_CACHE_DIR")
    assert loader.build_dir().parent == Path.home() / ".cache" / "ladle" / "kernels"


def test_rms_norm_bf16_rounds_as_transformers_does(native) -> None:
    """bf16 RMSNorm: normalise in float32, round to bf16, scale by the bf16 weight, round again."""
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(37, 576, generator=gen) * 3).to(torch.bfloat16)
    w = torch.randn(576, generator=gen).to(torch.bfloat16)
    xf = x.double()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).float().to(torch.bfloat16)
    ref = (w.float() * normed.float()).to(torch.bfloat16)
    y = native.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    # the only freedom is the float32 rounding of the sum of squares and the root: at most one bf16 step
    assert torch.allclose(y.float(), ref.float(), rtol=2**-7, atol=0)
    assert (y == ref).float().mean() > 0.99
    assert torch.equal(native.rms_norm(x[5:6], w, 1e-5), y[5:6])  # a row alone: the same bits


def test_rotary_in_place_is_the_torch_arithmetic_bit_for_bit(isa_kernels) -> None:
    """The native rotation of float32 heads (rows strided inside a fused qkv row, as the model hands
    them over) against x * cos + rotate_half(x) * sin in torch ops, on every instruction set."""
    from ladle.model.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(37, (6 + 2 + 2) * 64, generator=gen) * 4
    positions = torch.randint(0, 4000, (37,), generator=gen)
    cos, sin = RotaryEmbedding(64, 4096, 10000.0, None).tables(positions)
    x = qkv[:, : 8 * 64].view(37, 8, 64)
    x1, x2 = x.chunk(2, dim=-1)
    expect = x * cos + torch.cat((x2, x1), dim=-1) * sin
    v_before = qkv[:, 8 * 64 :].clone()
    assert isa_kernels.rotary(x, cos, sin) is x
    assert torch.equal(x, expect) and torch.equal(qkv[:, 8 * 64 :], v_before)  # v untouched
    with pytest.raises(ValueError, match="even"):
        isa_kernels.rotary(torch.randn(2, 1, 7), torch.randn(2, 1, 7), torch.randn(2, 1, 7))


def _ulps(y: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |y - ref| in float32 steps at ref (ref in float64)."""
    r = ref.float().abs()
    step = (torch.nextafter(r, torch.tensor(float("inf"))) - r).double()
    return ((y.double() - ref).abs() / step).max().item()


@pytest.mark.parametrize("n", [576, 37])  # the default model's width; a width off every vector length
def test_add_rms_norm_is_torchs_add_then_its_norm_within_float32_rounding(isa_kernels, n: int) -> None:
    """The residual add is torch's `h + a` bit for bit; the norm is not torch's RMSNorm bit for bit (its
    sum of squares runs in another order) but as close to float64 as torch's own float32 arithmetic is
    (transformers' LlamaRMSNorm in torch ops: pow, mean, rsqrt, two products): measured 3.3 float32 steps
    at most on the AVX2 and AVX-512 builds against torch's 3.2, and 9.6 on the scalar build, whose sum
    of squares is one chain of n adds (bounds 4 and 16: the next step up)."""
    gen = torch.Generator().manual_seed(12)
    h, a, w = torch.randn(16, n, generator=gen) * 3, torch.randn(16, n, generator=gen), torch.randn(n, generator=gen)
    expect_h = h + a
    torch_norm = w * (expect_h * torch.rsqrt(expect_h.pow(2).mean(-1, keepdim=True) + 1e-6))
    hd = expect_h.double()
    exact = w.double() * (hd / torch.sqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6))
    y = isa_kernels.add_rms_norm(h, a, w, 1e-6)
    assert torch.equal(h, expect_h)  # in place, one rounded add per element
    assert _ulps(torch_norm, exact) <= 4  # the yardstick: torch's own float32 RMSNorm
    assert _ulps(y, exact) <= (16 if isa_kernels.isa == "scalar" else 4)
    assert torch.allclose(y, torch_norm, rtol=4e-6 if isa_kernels.isa == "scalar" else 1e-6, atol=0)


def test_silu_and_mul_is_within_float_rounding_and_row_invariant(isa_kernels) -> None:
    """The native SwiGLU activation against float64 (its exp is within 2 ulp), in place into the
    gate half; an element's bits do not depend on its row count or its place in a row (the vector
    body and the scalar tail agree)."""
    gen = torch.Generator().manual_seed(13)
    gate_up = torch.randn(21, 2 * 203, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 88.0, -90.0])
    gate, up = gate_up.double().chunk(2, dim=-1)
    expect = gate * torch.sigmoid(gate) * up
    original = gate_up.clone()
    y = isa_kernels.silu_and_mul(gate_up)
    assert y.data_ptr() == gate_up.data_ptr() and y.shape == (21, 203)
    assert torch.equal(gate_up[:, 203:], original[:, 203:])  # up untouched
    assert ((y.double() - expect).abs() <= 1e-6 * expect.abs() + 1e-30).all()  # e^-|x| floors at e^-87.3
    one_row = isa_kernels.silu_and_mul(original[7:8].clone())
    assert torch.equal(one_row, y[7:8])
    shifted = torch.cat([original[7, :203].roll(5), original[7, 203:].roll(5)]).unsqueeze(0)
    assert torch.equal(isa_kernels.silu_and_mul(shifted).roll(-5, dims=1), y[7:8])


def test_bf16_rotary_rounds_each_op_as_torchs_bf16_ops(isa_kernels) -> None:
    """bf16 heads rotated in place by bf16 tables: each product and their sum rounded to bf16, as the
    three torch ops round them in bf16 (the products of two bf16 numbers are exact in float32, so the
    same bits)."""
    from ladle.model.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(14)
    qkv = (torch.randn(23, (4 + 2 + 2) * 64, generator=gen) * 4).bfloat16()
    cos, sin = (t.bfloat16() for t in RotaryEmbedding(64, 4096, 10000.0, None).tables(
        torch.randint(0, 4000, (23,), generator=gen)))
    x = qkv[:, : 6 * 64].view(23, 6, 64)
    x1, x2 = x.chunk(2, dim=-1)
    expect = x * cos + torch.cat((x2, x1), dim=-1) * sin
    v_before = qkv[:, 6 * 64 :].clone()
    assert isa_kernels.rotary(x, cos, sin) is x
    assert torch.equal(x, expect) and torch.equal(qkv[:, 6 * 64 :], v_before)


def test_bf16_add_rms_norm_is_torchs_bf16_add_then_the_bf16_norm(isa_kernels) -> None:
    gen = torch.Generator().manual_seed(15)
    h = (torch.randn(9, 576, generator=gen) * 3).bfloat16()
    a, w = torch.randn(9, 576, generator=gen).bfloat16(), torch.randn(576, generator=gen).bfloat16()
    expect_h = h + a
    expect_y = isa_kernels.rms_norm(expect_h, w, 1e-6)  # the bf16 norm, checked against transformers above
    y = isa_kernels.add_rms_norm(h, a, w, 1e-6)
    assert torch.equal(h, expect_h) and torch.equal(y, expect_y) and y.dtype == torch.bfloat16


def test_bf16_silu_and_mul_rounds_where_torch_does(isa_kernels) -> None:
    """silu(gate) rounded to bf16, then times up rounded to bf16, as `F.silu(gate).mul_(up)` in bf16:
    against that computed from a float64 silu, every element within one bf16 step (the float32 exp
    may round a silu across a bf16 tie) and nearly all exactly; rows alone give the same bits."""
    gen = torch.Generator().manual_seed(16)
    gate_up = (torch.randn(13, 2 * 333, generator=gen) * 6).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.double()
    expect = (g * torch.sigmoid(g)).bfloat16().float().mul(up.float()).bfloat16()
    original = gate_up.clone()
    y = isa_kernels.silu_and_mul(gate_up)
    assert y.dtype == torch.bfloat16 and y.data_ptr() == gate_up.data_ptr()
    assert torch.equal(gate_up[:, 333:], original[:, 333:])
    assert torch.allclose(y.float(), expect.float(), rtol=2**-7, atol=0)
    assert (y == expect).float().mean() > 0.99
    assert torch.equal(isa_kernels.silu_and_mul(original[4:5].clone()), y[4:5])
