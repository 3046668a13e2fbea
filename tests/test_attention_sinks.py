"""Attention sinks (gpt-oss): a learned logit per head that joins each softmax's denominator and
weighs no value, in every CPU attention path (the native prompt and decode kernels, torch's masked
SDPA for prompts and decodes, and its block-aligned tiles), with and without a sliding window,
against float64."""

from __future__ import annotations

import pytest
import torch

from ladle.model.attention import AttentionMetadata, CanonicalRows, KVCache, PrefillSpan, TorchPagedAttention

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

HEADS, KV_HEADS, D, BLOCK = 4, 2, 16, 8
TABLE = torch.tensor([3, 7, 1, 12, 5])  # 40 positions
LENGTH = 40
SCALE = 0.3


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], sinks: torch.Tensor,
              window: int | None) -> torch.Tensor:
    """float64: each query row (at its position) over keys [first, position], with its head's sink."""
    group = HEADS // KV_HEADS
    out = []
    for row, pos in zip(q.double(), positions, strict=True):
        first = 0 if window is None else max(0, pos - window + 1)
        keys = k[first : pos + 1].double().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v[first : pos + 1].double().repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", row, keys) * SCALE
        weights = torch.softmax(torch.cat((logits, sinks.double()[:, None]), dim=1), dim=1)[:, :-1]
        out.append(torch.einsum("hn,nhd->hd", weights, values).reshape(-1))
    return torch.stack(out)


@pytest.fixture
def filled(kernels: str):
    """A one-layer cache holding a 40-token sequence's K/V, the queries, and sinks on both sides of
    the scores (one far above them, where the sink takes nearly all the weight)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(LENGTH, h, D, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    sinks = torch.tensor([-1.5, 0.0, 2.0, 9.0])
    cache = KVCache(1, 16, BLOCK, KV_HEADS, D)
    slots = TABLE[torch.arange(LENGTH) // BLOCK] * BLOCK + torch.arange(LENGTH) % BLOCK
    TorchPagedAttention(cache, HEADS, KV_HEADS, D).write_kv(0, k, v, AttentionMetadata(slot_mapping=slots))
    return cache, q, k, v, sinks


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("canonical", [False, True], ids=["sdpa", "row-invariant"])
@pytest.mark.parametrize("start", [0, 27], ids=["whole", "after-a-cached-prefix"])
def test_prompt_rows_with_sinks(filled, window: int | None, canonical: bool, start: int) -> None:
    """Prompt rows [start, 40): torch's masked SDPA, or (canonical) the native prompt kernel or
    torch's tiles without it."""
    cache, q, k, v, sinks = filled
    backend = TorchPagedAttention(cache, HEADS, KV_HEADS, D, windows=(window,), scale=SCALE)
    span = PrefillSpan(0, LENGTH - start, LENGTH, TABLE, canonical=canonical)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), prefills=[span],
                             canonical=CanonicalRows.of([span]) if canonical else None)
    backend.prepare(meta)
    out = backend.attend(0, q[start:], k[start:], v[start:], meta, sinks)
    expected = reference(q[start:], k, v, list(range(start, LENGTH)), sinks, window)
    assert (out.double() - expected).abs().max() < 1e-5
    without = backend.attend(0, q[start:], k[start:], v[start:], meta)
    assert (without.double() - expected).abs().max() > 0.1  # the sinks change the result


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("rows", [False, True], ids=["decode-kernel", "prompt-kernel"])
def test_decode_rows_with_sinks(filled, window: int | None, rows: bool) -> None:
    """Two decodes (positions 39 and 20 of the same sequence's blocks): the native decode kernel, or
    each as a one-row span of the prompt kernel; torch's masked SDPA without the native kernels."""
    cache, q, k, v, sinks = filled
    backend = TorchPagedAttention(cache, HEADS, KV_HEADS, D, windows=(window,), scale=SCALE)
    tables, lens = TABLE.repeat(2, 1), torch.tensor([LENGTH, 21])
    meta = AttentionMetadata(slot_mapping=torch.zeros(2, dtype=torch.int64), num_decodes=2,
                             decode_block_tables=tables, decode_context_lens=lens)
    if rows:
        meta.decode_rows = CanonicalRows(tables, torch.arange(2), torch.ones(2, dtype=torch.int64), lens - 1)
    backend.prepare(meta)
    queries = torch.stack((q[LENGTH - 1], q[20]))
    out = backend.attend(0, queries, k[:2], v[:2], meta, sinks)
    assert (out.double() - reference(queries, k, v, [LENGTH - 1, 20], sinks, window)).abs().max() < 1e-5
