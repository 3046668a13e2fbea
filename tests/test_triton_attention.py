"""ladle.model.triton's paged-attention kernels (KV write, prefill/extend, split-KV decode) against
plain torch: float64 attention over K/V gathered from the pool by each sequence's block table,
and kv_quant.quantize's bytes for the 8-bit write.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py): shapes are small
and tiles 16 wide (block_m/block_n overrides) so several tiles and splits are crossed; on a GPU
the `cuda` tests also run the pinned configs over longer sequences. The interpreter's tl.dot is
wrong on bfloat16 operands and its float -> fp8 cast does not round to nearest even, so bfloat16
cases and the fp8 write are marked `cuda` (fp8 *reads* are exact there, so fp8-cache attention
runs everywhere). Every output starts as NaN (decode scratch too), so an element a kernel fails
to write fails the test; pool slots that no sequence owns and the tables' padding block hold NaN,
so a key read that should not happen does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from ladle.model import kv_quant
from ladle.model.triton.decode_attention import DecodeScratch, choose_num_splits, decode_attention
from ladle.model.triton.kv_write import write_kv
from ladle.model.triton.prefill_attention import plan_query_blocks, prefill_attention, prefill_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.cuda, id="bf16")
FLOATS = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float16, id="f16"), BF16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # max abs error, values of order 1
SMALL_TILES = {"block_m": 16, "block_n": 16}  # interpreter-sized: several tiles and splits are crossed
PINNED = None  # the kernels' own configs, as the engine launches them (GPU tests)
FP8 = torch.float8_e4m3fn


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, math.nan)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def fused_qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k, v [T, KVH, D]: strided column views of one fused projection, as the model has them."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, gen=gen, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim))


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@dataclass
class Pool:
    """One layer's paged K/V with some sequences in it; tables are shuffled, padded with a NaN block."""

    k: torch.Tensor  # [N, block_size, KVH, D] in the cache dtype
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [N, block_size, KVH] for an 8-bit cache
    v_scale: torch.Tensor | None
    tables: torch.Tensor  # [S, W] int32
    lens: list[int]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def scales(self) -> dict[str, torch.Tensor]:
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def keys(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence seq's K and V [len, KVH, D] as float64 (an 8-bit cache dequantised), on the CPU."""
        blocks = self.tables[seq, : math.ceil(self.lens[seq] / self.block_size)].long().cpu()
        out = []
        for values, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = values.cpu()[blocks].double()
            if scales is not None:
                x = x * scales.cpu()[blocks].double()[..., None]
            out.append(x.flatten(0, 1)[: self.lens[seq]])
        return out[0], out[1]


def make_pool(lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              gen: torch.Generator, spare_blocks: int = 3) -> Pool:
    """Random K/V for sequences of these lengths in randomly chosen, non-contiguous blocks."""
    per_seq = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(per_seq) + spare_blocks + 1
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    poison = num_blocks - 1
    width = max(lens) + 1  # wide: even a table indexed by position instead of block stays in bounds
    tables = torch.full((len(lens), width), poison, dtype=torch.int32)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s, n in enumerate(per_seq):
        tables[s, :n] = torch.tensor(order[:n])
        order = order[n:]
        owned.view(-1)[(tables[s, :n, None].long() * block_size + torch.arange(block_size)).flatten()[: lens[s]]] = True
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if kv_quant.is_8bit(dtype):
        (k, k_scale), (v, v_scale) = kv_quant.quantize(k, dtype), kv_quant.quantize(v, dtype)
        k_scale, v_scale = k_scale.to(DEVICE), v_scale.to(DEVICE)
    else:
        k[~owned], v[~owned] = math.nan, math.nan  # slots no sequence owns, the padding block among them
        k, v = k.to(dtype), v.to(dtype)
        k_scale = v_scale = None
    return Pool(k.to(DEVICE), v.to(DEVICE), k_scale, v_scale, tables.to(DEVICE), list(lens))


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int],
              scale: float) -> torch.Tensor:
    """float64 causal attention of rows q [R, H, D] at these absolute positions over keys/values
    [L, KVH, D]; a row with no key gives 0."""
    q = q.cpu().double()
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("rhd,khd->hrk", q, k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= torch.tensor(positions)[:, None]
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hrk,khd->rhd", probs, v)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    out = out.cpu().double()
    assert not out.isnan().any(), "unwritten or NaN output"
    err = (out - ref).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err:.3g} > {TOL[dtype]:.1g}"


# -- KV write ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("src_dtype,cache_dtype", [
    pytest.param(torch.float32, torch.float32, id="f32"),
    pytest.param(torch.float16, torch.float16, id="f16"),
    pytest.param(torch.float32, torch.float16, id="f32-to-f16"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16", marks=pytest.mark.cuda),
])
@pytest.mark.parametrize("head_dim", [16, 48])
def test_write_kv_stores_rows_at_their_slots_and_skips_padding(src_dtype: torch.dtype, cache_dtype: torch.dtype,
                                                               head_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    _, k, v = fused_qkv(6, 4, 2, head_dim, src_dtype, gen)
    k_cache = randn(5, 8, 2, head_dim, gen=gen, dtype=cache_dtype)
    v_cache = randn(5, 8, 2, head_dim, gen=gen, dtype=cache_dtype)
    slots = torch.tensor([17, -1, 3, 39, -1, 8], device=DEVICE)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k.view(-1, 2, head_dim)[slot] = k[row].to(cache_dtype)
            expect_v.view(-1, 2, head_dim)[slot] = v[row].to(cache_dtype)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def quantization_rows(head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """[6, 2, head_dim] float32 rows: random ones at several magnitudes, an all-zero head, and heads
    whose absmax is 127, so that x * (127 / absmax) = x exactly and halves are ties."""
    x = torch.randn(6, 2, head_dim, generator=gen) * torch.tensor([1.0, 1e-3, 40.0, 1.0, 1.0, 3.0])[:, None, None]
    x[1, 1] = 0.0
    ties = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5, 2.5, 3.5, -126.5, 0.49999997, -0.50000006, 63.5, 64.5])
    x[3, 0, : ties.numel()] = ties[:head_dim]
    x[3, 0, ties.numel():] = 0.25
    x[4, 1] = torch.arange(head_dim) - head_dim / 2 + 0.5
    x[4, 1, 0] = -127.0
    return x


def check_quantized_write(cache_dtype: torch.dtype, src_dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = quantization_rows(head_dim, gen).to(src_dtype)
    k, v = x.to(DEVICE), (-x.flip(0)).to(DEVICE)
    shape = (4, 8, 2, head_dim)
    k_cache, v_cache = (torch.zeros(shape, device=DEVICE).to(cache_dtype) for _ in range(2))
    k_scale, v_scale = (torch.full(shape[:3], math.nan, device=DEVICE) for _ in range(2))
    slots = torch.tensor([5, 30, -1, 9, 16, 0], device=DEVICE)
    write_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    written = torch.zeros(32, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    for src, values, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        want_values, want_scales = kv_quant.quantize(src.cpu(), cache_dtype)
        for row, slot in enumerate(slots.tolist()):
            if slot >= 0:
                got = values.view(-1, 2, head_dim)[slot].cpu()
                assert torch.equal(got.view(torch.uint8), want_values[row].view(torch.uint8)), f"row {row}"
                assert torch.equal(scales.view(-1, 2)[slot].cpu(), want_scales[row]), f"row {row}"
        assert scales.view(-1, 2)[~written].isnan().all(), "a slot -1 row was written"
        assert not values.view(torch.uint8).view(-1, 2 * head_dim)[~written].any(), "a slot -1 row was written"


@pytest.mark.parametrize("src_dtype", FLOATS)
@pytest.mark.parametrize("head_dim", [32, 80])
def test_write_kv_int8_stores_kv_quant_bytes(src_dtype: torch.dtype, head_dim: int) -> None:
    check_quantized_write(torch.int8, src_dtype, head_dim)


@pytest.mark.cuda  # the interpreter's float -> fp8 cast rounds ties up and flushes subnormals
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_write_kv_fp8_stores_kv_quant_bytes(src_dtype: torch.dtype) -> None:
    check_quantized_write(FP8, src_dtype, 64)


# -- prefill / extend -------------------------------------------------------------------------------

# (cached prefix, chunk length) per sequence, block_size 8: a chunk starting mid-block, a whole
# prompt, a one-token span after a prefix of several blocks, a chunk from a block boundary into a
# last partial block
SPANS = [(13, 7), (0, 21), (30, 1), (16, 19)]
LEAD_ROWS = 2  # rows before the first span (decodes, in the engine) that the kernel must leave alone


def run_prefill(pool: Pool, q: torch.Tensor, spans: list[tuple[int, int, int]], scale: float,
                tiles: dict[str, int] | None = SMALL_TILES) -> torch.Tensor:
    """spans: (sequence, first row in q, chunk length), each chunk ending at its sequence's length."""
    config = dict(tiles or {"block_m": prefill_config(q.shape[2], pool.k.dtype).block_m})
    out = nan_like(q)
    q_lens = [n for _, _, n in spans]
    prefill_attention(q, pool.k, pool.v, out, pool.tables[[s for s, _, _ in spans]], int32([r for _, r, _ in spans]),
                      int32(q_lens), int32([pool.lens[s] for s, _, _ in spans]),
                      plan_query_blocks(q_lens, config.pop("block_m")), scale, **pool.scales(), **config)
    return out


def check_prefill(dtype: torch.dtype, cache_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                  block_size: int, spans: list[tuple[int, int]] = SPANS, tiles: dict[str, int] | None = SMALL_TILES,
                  seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool([p + n for p, n in spans], block_size, kv_heads, head_dim, cache_dtype, gen)
    rows = LEAD_ROWS + sum(n for _, n in spans)
    q, _, _ = fused_qkv(rows, heads, kv_heads, head_dim, dtype, gen)
    starts = [LEAD_ROWS + sum(n for _, n in spans[:s]) for s in range(len(spans))]
    scale = head_dim**-0.5
    out = run_prefill(pool, q, [(s, starts[s], n) for s, (_, n) in enumerate(spans)], scale, tiles)
    assert out[:LEAD_ROWS].isnan().all(), "rows outside every span were written"
    for s, (prefix, n) in enumerate(spans):
        keys, values = pool.keys(s)
        ref = reference(q[starts[s] : starts[s] + n], keys, values, list(range(prefix, prefix + n)), scale)
        assert_close(out[starts[s] : starts[s] + n], ref, dtype)


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,block_size", [
    (torch.float32, 4, 4, 32, 8),
    (torch.float32, 4, 2, 48, 8),
    (torch.float32, 8, 2, 16, 16),
    (torch.float16, 8, 2, 64, 16),
    (torch.float16, 4, 4, 80, 8),
    pytest.param(torch.bfloat16, 8, 2, 128, 16, marks=pytest.mark.cuda),
    pytest.param(torch.bfloat16, 4, 2, 80, 8, marks=pytest.mark.cuda),
], ids=["f32-mha-d32", "f32-gqa2-d48", "f32-gqa4-d16-bs16", "f16-gqa4-d64-bs16", "f16-mha-d80", "bf16-gqa4-d128",
        "bf16-gqa2-d80"])
def test_prefill_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                                   block_size: int) -> None:
    check_prefill(dtype, dtype, heads, kv_heads, head_dim, block_size)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("cache_dtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_prefill_over_8bit_cache(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    check_prefill(dtype, cache_dtype, 4, 2, 32, 8, seed=3)


@pytest.mark.cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8, FP8], ids=["bf16", "int8", "fp8"])
def test_prefill_pinned_config_over_long_spans(cache_dtype: torch.dtype) -> None:
    """The engine's launch (128 x 64 tiles at head_dim 128, bf16 queries) over spans many tiles long."""
    spans = [(1000, 300), (0, 517), (77, 1), (128, 200)]
    check_prefill(torch.bfloat16, cache_dtype, 32, 8, 128, 16, spans=spans, tiles=PINNED, seed=10)


def test_prefill_over_a_chunk_the_write_kernel_quantised() -> None:
    """The int8 path end to end: the chunk's K/V go in through write_kv, the prefix was quantised by torch."""
    gen = torch.Generator().manual_seed(4)
    prefix, n, block_size, head_dim = 13, 9, 8, 32
    pool = make_pool([prefix + n], block_size, 2, head_dim, torch.int8, gen)
    q, k, v = fused_qkv(n, 4, 2, head_dim, torch.float32, gen)
    blocks = pool.tables[0].long()
    positions = torch.arange(prefix, prefix + n, device=DEVICE)
    write_kv(k, v, pool.k, pool.v, blocks[positions // block_size] * block_size + positions % block_size,
             pool.k_scale, pool.v_scale)
    out = run_prefill(pool, q, [(0, 0, n)], head_dim**-0.5)
    keys, values = pool.keys(0)
    assert torch.allclose(keys[prefix:], kv_quant.dequantize(*kv_quant.quantize(k.cpu(), torch.int8)).double())
    assert_close(out, reference(q, keys, values, positions.tolist(), head_dim**-0.5), torch.float32)


@pytest.mark.parametrize("dtype,n,head_dim,cuts,tiles", [
    pytest.param(torch.float32, 45, 32, (13, 33), SMALL_TILES, id="f32"),
    pytest.param(torch.float16, 45, 32, (13, 33), SMALL_TILES, id="f16"),
    pytest.param(torch.bfloat16, 45, 32, (13, 33), SMALL_TILES, id="bf16", marks=pytest.mark.cuda),
    pytest.param(torch.bfloat16, 300, 128, (100, 230), PINNED, id="bf16-d128-pinned", marks=pytest.mark.cuda),
])
def test_prefill_row_is_bitwise_the_same_alone_batched_or_chunked(dtype: torch.dtype, n: int, head_dim: int,
                                                                  cuts: tuple[int, int],
                                                                  tiles: dict[str, int] | None) -> None:
    """A prompt's rows computed whole, in chunks over its cached prefix, batched with other sequences
    in other chunkings, and one row at a time: the same bits (tiles start at key 0 wherever a chunk
    begins, and tiles past a row's position change nothing). The chunks' q-blocks start at other
    rows than the whole prompt's, so a key tile unmasked for a row in one is masked in the other."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads = 4, 2
    pool = make_pool([n, 29, 40], 8, kv_heads, head_dim, dtype, gen)
    q, _, _ = fused_qkv(n + 70, heads, kv_heads, head_dim, dtype, gen)
    scale = head_dim**-0.5
    whole = run_prefill(pool, q, [(0, 0, n)], scale, tiles)[:n]

    chunked = nan_like(whole)
    for start, end in zip((0, *cuts), (*cuts, n)):  # the sequence as it would be at each chunk
        partial = Pool(pool.k, pool.v, None, None, pool.tables, [end, 29, 40])
        chunked[start:end] = run_prefill(partial, q, [(0, start, end - start)], scale, tiles)[start:end]
    assert torch.equal(chunked, whole)

    # rows 5.. after two other sequences' chunks, in a q-block grid offset from the whole prompt's
    batched = run_prefill(pool, q, [(1, n, 11), (2, n + 11, 27), (0, 5, n - 5)], scale, tiles)
    assert torch.equal(batched[5:n], whole[5:])

    # every row its own span (one row per program), in one launch
    singles_pool = Pool(pool.k, pool.v, None, None, pool.tables[:1].expand(n, -1), list(range(1, n + 1)))
    singles = run_prefill(singles_pool, q[:n], [(r, r, 1) for r in range(n)], scale, tiles)
    assert torch.equal(singles, whole)

    # other tile sizes change the bits but not the answer
    other = run_prefill(pool, q, [(0, 0, n)], scale, {"block_m": 32, "block_n": 32})[:n]
    keys, values = pool.keys(0)
    assert_close(other, reference(q[:n], keys, values, list(range(n)), scale), dtype)


def test_a_canonical_decode_row_ignores_its_batch() -> None:
    """Canonical decode rows (decisions' and --deterministic generation's) go through the extend kernel
    as one-row spans, not the split-KV decode kernel, whose split count follows the batch: such a row
    alone and in batches of 2, 7 and 64 other one-row spans (other sequences' lengths) has the same bits."""
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, head_dim = 4, 2, 32
    lens = [37] + [int(n) for n in torch.randint(1, 60, (63,), generator=gen)]
    pool = make_pool(lens, 8, kv_heads, head_dim, torch.float32, gen)
    q, _, _ = fused_qkv(64, heads, kv_heads, head_dim, torch.float32, gen)
    for batch in (2, 7, 64):
        at = batch // 2  # the row's place in the launch (its query is q[at] either way)
        alone = run_prefill(pool, q, [(0, at, 1)], 0.125)[at]
        others = list(range(1, batch))
        others.insert(at, 0)
        batched = run_prefill(pool, q, [(s, row, 1) for row, s in enumerate(others)], 0.125)
        assert not alone.isnan().any() and torch.equal(batched[at], alone), batch


def test_prefill_row_with_no_keys_gives_zero() -> None:
    """Rows whose position is below 0 (a span longer than its context) see no key: 0, not NaN."""
    gen = torch.Generator().manual_seed(6)
    pool = make_pool([2], 8, 2, 16, torch.float32, gen)
    q, _, _ = fused_qkv(4, 4, 2, 16, torch.float32, gen)
    out = run_prefill(pool, q, [(0, 0, 4)], 0.25)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    keys, values = pool.keys(0)
    assert_close(out[2:], reference(q[2:], keys, values, [0, 1], 0.25), torch.float32)


def test_plan_query_blocks_covers_every_row_once() -> None:
    plan = plan_query_blocks([21, 1, 16, 40], 16)
    assert plan.span.dtype == plan.first_row.dtype == torch.int32 and plan.block_m == 16
    covered = sorted((s, r) for s, first in zip(plan.span.tolist(), plan.first_row.tolist())
                     for r in range(first, first + 16) if r < [21, 1, 16, 40][s])
    assert covered == [(s, r) for s, n in enumerate([21, 1, 16, 40]) for r in range(n)]
    assert plan.first_row.tolist()[:2] == [16, 0]  # a span's longest block first
    assert plan.to(DEVICE).span.device.type == torch.device(DEVICE).type
    assert prefill_config(128, torch.bfloat16).block_m == 128 and prefill_config(64, torch.bfloat16).block_m == 64


# -- decode -----------------------------------------------------------------------------------------

DECODE_LENS = [37, 0, 1, 5, 16, 61]  # 0: a padded graph row; 5 and 1 leave most splits empty


def run_decode(pool: Pool, q: torch.Tensor, num_splits: int, rows: list[int] | None = None,
               scratch: DecodeScratch | None = None, tiles: dict[str, int] | None = SMALL_TILES) -> torch.Tensor:
    rows = list(range(len(pool.lens))) if rows is None else rows
    config = {"block_n": tiles["block_n"]} if tiles else {}
    out = nan_like(q)
    decode_attention(q, pool.k, pool.v, out, pool.tables[rows], int32([pool.lens[r] for r in rows]),
                     q.shape[2] ** -0.5, num_splits, scratch, **pool.scales(), **config)
    return out


def poisoned_scratch(max_batch: int, heads: int, head_dim: int, max_splits: int) -> DecodeScratch:
    scratch = DecodeScratch.allocate(max_batch, heads, head_dim, max_splits, DEVICE)
    scratch.out.fill_(math.nan)
    scratch.lse.fill_(math.nan)
    return scratch


def check_decode(dtype: torch.dtype, cache_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                 num_splits: int, lens: list[int] = DECODE_LENS, block_size: int = 8,
                 tiles: dict[str, int] | None = SMALL_TILES, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(lens, block_size, kv_heads, head_dim, cache_dtype, gen)
    q, _, _ = fused_qkv(len(lens), heads, kv_heads, head_dim, dtype, gen)
    scratch = poisoned_scratch(len(lens) + 2, heads, head_dim, num_splits + 1)  # larger than needed
    out = run_decode(pool, q, num_splits, scratch=scratch, tiles=tiles)
    for b, n in enumerate(lens):
        keys, values = pool.keys(b)
        assert_close(out[b : b + 1], reference(q[b : b + 1], keys, values, [n - 1], head_dim**-0.5), dtype)
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])), "a seq_len 0 row must give exactly 0"


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", [
    (torch.float32, 4, 4, 32),
    (torch.float32, 8, 2, 48),
    (torch.float16, 4, 2, 64),
    pytest.param(torch.bfloat16, 8, 2, 128, marks=pytest.mark.cuda),
    pytest.param(torch.bfloat16, 4, 4, 80, marks=pytest.mark.cuda),
], ids=["f32-mha-d32", "f32-gqa4-d48", "f16-gqa2-d64", "bf16-gqa4-d128", "bf16-mha-d80"])
def test_decode_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                                  num_splits: int) -> None:
    check_decode(dtype, dtype, heads, kv_heads, head_dim, num_splits)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("cache_dtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_decode_over_8bit_cache(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    check_decode(dtype, cache_dtype, 4, 2, 32, num_splits=2, seed=7)


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [1, 8])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8, FP8], ids=["bf16", "int8", "fp8"])
def test_decode_pinned_config_over_long_rows(cache_dtype: torch.dtype, num_splits: int) -> None:
    """The engine's launch (64-key tiles, bf16 queries, head_dim 128) over rows many tiles long."""
    check_decode(torch.bfloat16, cache_dtype, 32, 8, 128, num_splits, lens=[1000, 0, 333, 64, 1, 4097],
                 block_size=16, tiles=PINNED, seed=11)


def test_decode_split_counts_agree() -> None:
    """1 split, several, and more splits than key tiles: the same result within float32 rounding."""
    gen = torch.Generator().manual_seed(8)
    pool = make_pool(DECODE_LENS, 8, 2, 32, torch.float32, gen)
    q, _, _ = fused_qkv(len(DECODE_LENS), 8, 2, 32, torch.float32, gen)
    one = run_decode(pool, q, 1)
    for splits in (2, 4, 9):
        assert (run_decode(pool, q, splits) - one).abs().max().item() < 1e-6


def test_decode_row_ignores_its_batch_mates() -> None:
    """A row's splits depend on its own length only: alone or batched, the same bits."""
    gen = torch.Generator().manual_seed(9)
    pool = make_pool(DECODE_LENS, 8, 2, 32, torch.float32, gen)
    q, _, _ = fused_qkv(len(DECODE_LENS), 4, 2, 32, torch.float32, gen)
    batched = run_decode(pool, q, 3)
    for b in (0, 4, 5):
        alone = run_decode(pool, q[b : b + 1], 3, rows=[b])
        assert torch.equal(alone[0], batched[b])


def test_choose_num_splits_fills_the_sms_from_the_batch_shape() -> None:
    assert choose_num_splits(1, 8, 132) == 16  # capped at max_splits
    assert choose_num_splits(1, 8, 132, max_splits=4) == 4
    assert choose_num_splits(4, 8, 132) == 5  # 32 programs x 5 >= 132
    assert choose_num_splits(16, 8, 132) == 2
    assert choose_num_splits(17, 8, 132) == 1  # 136 programs fill 132 SMs
    assert choose_num_splits(256, 1, 132) == 1
