"""Sliding windows and attention sinks in ladle.model.triton's prefill and decode kernels, against
float64 attention: each row over its last `window` positions, gpt-oss's sink logit per head in the
softmax's denominator. The blocks wholly below a sequence's first window point at the pool's NaN
block (as the engine hands its released blocks over), so a kernel that reads one fails. Runs under
Triton's interpreter without a GPU (fp16/fp32 operands; bf16 on the device)."""

from __future__ import annotations

import math

import pytest
import torch
from test_triton_attention import (
    DEVICE, LEAD_ROWS, SMALL_TILES, SPANS, Pool, assert_close, fused_qkv, int32, make_pool, nan_like,
    poisoned_scratch,
)

from ladle.model.triton.decode_attention import decode_attention
from ladle.model.triton.prefill_attention import plan_query_blocks, prefill_attention

BLOCK = 8
FLOATS = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float16, id="f16"),
          pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.cuda)]
WINDOWS = [5, 40]  # inside one 16-key tile, several tiles


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int], scale: float,
              window: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """float64: row r attends to keys (positions[r] - window, positions[r]], sinks [H] join the denominator."""
    q = q.cpu().double()
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("rhd,khd->hrk", q, k) * scale
    key_pos, pos = torch.arange(k.shape[0])[None, :], torch.tensor(positions)[:, None]
    scores = scores.masked_fill(~((key_pos <= pos) & (key_pos > pos - window)), -math.inf)
    if sinks is not None:
        sink = sinks.cpu().double()[:, None, None].expand(-1, len(positions), 1)
        return torch.einsum("hrk,khd->rhd", torch.cat([scores, sink], -1).softmax(-1)[..., :-1], v)
    return torch.einsum("hrk,khd->rhd", scores.softmax(-1), v)


def references(pool: Pool, q: torch.Tensor, rows: dict[int, tuple[int, list[int]]], scale: float, window: int,
               sinks: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """rows: sequence -> (first row in q, positions). Reads each sequence's keys before they are poisoned."""
    out = {}
    for s, (first, positions) in rows.items():
        keys, values = pool.keys(s)
        out[s] = reference(q[first : first + len(positions)], keys, values, positions, scale, window, sinks)
    return out


def poison_below_windows(pool: Pool, first_positions: dict[int, int], window: int) -> int:
    """Point each sequence's blocks wholly below its first row's window at the NaN block; returns how many."""
    poison, count = pool.k.shape[0] - 1, 0
    for s, pos in first_positions.items():
        below = max(0, pos - window + 1) // BLOCK
        pool.tables[s, :below] = poison
        count += below
    return count


def sink_logits(heads: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(heads, generator=gen) * 2).float().to(DEVICE)


def run_prefill(pool: Pool, q: torch.Tensor, spans: list[tuple[int, int, int]], scale: float, window: int,
                sinks: torch.Tensor | None, tiles: dict[str, int] = SMALL_TILES) -> torch.Tensor:
    config = dict(tiles)
    out = nan_like(q)
    q_lens = [n for _, _, n in spans]
    prefill_attention(q, pool.k, pool.v, out, pool.tables[[s for s, _, _ in spans]], int32([r for _, r, _ in spans]),
                      int32(q_lens), int32([pool.lens[s] for s, _, _ in spans]),
                      plan_query_blocks(q_lens, config.pop("block_m")), scale, window=window, sinks=sinks, **config)
    return out


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_prefill_with_a_window_and_sinks_matches_float64(dtype: torch.dtype, window: int, with_sinks: bool) -> None:
    gen = torch.Generator().manual_seed(window)
    heads, kv_heads, head_dim = 4, 2, 32
    pool = make_pool([p + n for p, n in SPANS], BLOCK, kv_heads, head_dim, dtype, gen)
    q, _, _ = fused_qkv(LEAD_ROWS + sum(n for _, n in SPANS), heads, kv_heads, head_dim, dtype, gen)
    sinks = sink_logits(heads, gen) if with_sinks else None
    starts = [LEAD_ROWS + sum(n for _, n in SPANS[:s]) for s in range(len(SPANS))]
    rows = {s: (starts[s], list(range(p, p + n))) for s, (p, n) in enumerate(SPANS)}
    want = references(pool, q, rows, head_dim**-0.5, window, sinks)
    assert poison_below_windows(pool, {s: p for s, (p, _) in enumerate(SPANS)}, window) > 0 or window == 40
    out = run_prefill(pool, q, [(s, starts[s], n) for s, (_, n) in enumerate(SPANS)], head_dim**-0.5, window, sinks)
    assert out[:LEAD_ROWS].isnan().all()
    for s, (first, positions) in rows.items():
        assert_close(out[first : first + len(positions)], want[s], dtype)


@pytest.mark.parametrize("dtype", FLOATS[:2])
def test_a_windowed_row_is_bitwise_the_same_alone_batched_or_chunked(dtype: torch.dtype) -> None:
    """As without a window: a row's tiles start at key 0 and skipping the tiles below a block's first
    window, or masking them, changes no bit; with sinks too."""
    gen = torch.Generator().manual_seed(12)
    heads, kv_heads, head_dim, n, window = 4, 2, 32, 45, 12
    pool = make_pool([n, 29, 40], BLOCK, kv_heads, head_dim, dtype, gen)
    q, _, _ = fused_qkv(n + 70, heads, kv_heads, head_dim, dtype, gen)
    sinks, scale = sink_logits(heads, gen), head_dim**-0.5
    whole = run_prefill(pool, q, [(0, 0, n)], scale, window, sinks)[:n]
    chunked = nan_like(whole)
    for start, end in zip((0, 13, 33), (13, 33, n)):
        partial = Pool(pool.k, pool.v, None, None, pool.tables, [end, 29, 40])
        chunked[start:end] = run_prefill(partial, q, [(0, start, end - start)], scale, window, sinks)[start:end]
    assert torch.equal(chunked, whole)
    batched = run_prefill(pool, q, [(1, n, 11), (2, n + 11, 27), (0, 5, n - 5)], scale, window, sinks)
    assert torch.equal(batched[5:n], whole[5:])
    singles_pool = Pool(pool.k, pool.v, None, None, pool.tables[:1].expand(n, -1), list(range(1, n + 1)))
    assert torch.equal(run_prefill(singles_pool, q[:n], [(r, r, 1) for r in range(n)], scale, window, sinks), whole)


@pytest.mark.parametrize("num_splits", [3])  # splits of a window: the merge and the sink's term
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_decode_with_a_window_and_sinks_matches_float64(dtype: torch.dtype, window: int, with_sinks: bool,
                                                        num_splits: int) -> None:
    gen = torch.Generator().manual_seed(window + num_splits)
    heads, kv_heads, head_dim = 8, 2, 32
    lens = [37, 0, 1, 5, 16, 61]
    pool = make_pool(lens, BLOCK, kv_heads, head_dim, dtype, gen)
    q, _, _ = fused_qkv(len(lens), heads, kv_heads, head_dim, dtype, gen)
    sinks = sink_logits(heads, gen) if with_sinks else None
    live = {b: (b, [n - 1]) for b, n in enumerate(lens) if n}
    want = references(pool, q, live, head_dim**-0.5, window, sinks)
    poison_below_windows(pool, {b: n - 1 for b, n in enumerate(lens) if n}, window)
    out = nan_like(q)
    decode_attention(q, pool.k, pool.v, out, pool.tables, int32(lens), head_dim**-0.5, num_splits,
                     poisoned_scratch(len(lens), heads, head_dim, num_splits), window=window, sinks=sinks,
                     block_n=SMALL_TILES["block_n"])
    for b in live:
        assert_close(out[b : b + 1], want[b], dtype)
    assert torch.equal(out[1], torch.zeros_like(out[1])), "a seq_len 0 row must give exactly 0"


@pytest.fixture(scope="module", params=["mistral", "gpt_oss"])
def windowed_model(request, tmp_path_factory: pytest.TempPathFactory, smollm2_dir):
    """Mistral windowing every layer (its released blocks read as block 0), and gpt-oss: windowed and
    global layers alternating, with sinks."""
    from tiny_models import build_tiny_model
    from transformers import AutoModelForCausalLM

    overrides = {"sliding_window": BLOCK} if request.param == "mistral" else {}
    folder = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), smollm2_dir, **overrides)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_the_triton_backend_runs_windowed_models_as_transformers_does(windowed_model) -> None:
    """Prompts chunked 16 tokens at a time, each chunk crossing the window's edge."""
    from test_triton_engine import GREEDY, PROMPTS, TRITON, assert_matches_transformers

    from ladle import LLM

    folder, hf_model = windowed_model
    llm = LLM(str(folder), **TRITON, max_num_batched_tokens=16, long_prefill_token_threshold=16)
    assert llm.engine.isa.startswith("triton") and llm.engine.model_config.layer_windows
    results = llm.generate(PROMPTS, GREEDY)
    assert max(len(r.prompt_token_ids) for r in results) > 3 * BLOCK
    assert_matches_transformers(results, hf_model)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
