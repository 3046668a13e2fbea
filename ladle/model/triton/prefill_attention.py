"""Varlen "extend" attention over the paged KV cache: prefill chunks, or any span of query rows.

Span s owns query rows [q_starts[s], q_starts[s] + q_lens[s]) of the flat batch; its chunk's K/V
are already in the cache, which holds ctx_lens[s] of the sequence's tokens, so its row i sits at
absolute position ctx_lens[s] - q_lens[s] + i and attends causally to keys [0, that position].
Every key, cached prefix and fresh chunk alike, is read from the pool through the block table,
looked up per key (tiles do not follow cache blocks). A host-built plan (`plan_query_blocks`)
gives each program one span's BLOCK_M rows; the grid is (query blocks, query heads).

Key tiles start at absolute position 0 and step by a fixed BLOCK_N, whatever the chunking: where
a cached prefix ends or a chunk begins never moves a tile boundary, so a row sees the same tiles,
reduced in the same order, alone, batched with other sequences, or in any chunking of its
prompt. The tiles a row does not need (its block's later rows need them) are exact no-ops: their
scores are -inf, so p = 0 and the running max is unchanged (a rescale by exp(0) = 1). Tiles
wholly at or below the block's first row's position skip the causal mask; a masked tile whose
mask is all true does the same arithmetic (a `where` that keeps every score), and launches
disable FMA contraction, so the compiler cannot fuse the unmasked loop's products differently
from the masked one's. The softmax runs in base 2, log2(e) folded into the scale, all in
float32; P is rounded to the compute dtype for the P @ V product, as in FlashAttention.

Under a sliding window a row attends to its last `window` positions only: the tiles below the
block's first row's window are skipped (for every row of the block they would be exact no-ops) and
no key below it is read; the rows' lower bounds join the mask. Attention sinks (gpt-oss: a logit
per head) join each row's denominator at the end, weighing no value.

An 8-bit cache is dequantised by its per-key scales outside the products: K's scale multiplies
the scores and V's is folded into P, and int8/fp8 values convert exactly to the query's dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """The pinned launch config for a head size and cache dtype (no autotuning: numerics must not
    depend on timing). 16-bit and 8-bit caches compute in the query's 16-bit dtype on tensor cores:
    head_dim 128 takes Hopper's usual 128 x 64 flash-attention tile (8 warps, K/V triple-buffered:
    ~97 KiB of shared memory, 196 registers, no spills on sm_90), smaller heads a 64 x 64 one."""
    d = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:  # exact float32 products on CUDA cores (tests): tiles that do not spill
        return PrefillConfig(64, 32, 8, 2) if d <= 64 else PrefillConfig(16, 16, 4, 2)
    if d <= 64:
        return PrefillConfig(64, 64, 4, 3)
    if d <= 128:
        return PrefillConfig(128, 64, 8, 3)
    return PrefillConfig(64, 32, 8, 2)


@dataclass
class QueryBlocks:
    """The launch plan: program g handles rows [first_row[g], first_row[g] + block_m) of span
    span[g] (int32 tensors, one entry per program), masked at the span's end."""

    span: torch.Tensor
    first_row: torch.Tensor
    block_m: int

    def __len__(self) -> int:
        return self.span.shape[0]

    def to(self, device: torch.device | str) -> "QueryBlocks":
        return QueryBlocks(self.span.to(device, non_blocking=True), self.first_row.to(device, non_blocking=True),
                           self.block_m)


def plan_query_blocks(q_lens: list[int], block_m: int) -> QueryBlocks:
    """One program per block_m rows of each span. A span's last blocks see the most keys, so they
    are listed first: the longest programs start earliest and the grid's tail is short ones."""
    spans, rows = [], []
    for s, n in enumerate(q_lens):
        for first in reversed(range(0, n, block_m)):
            spans.append(s)
            rows.append(first)
    return QueryBlocks(torch.tensor(spans, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32), block_m)


# -- shared with the decode kernel --------------------------------------------------------------


def scale_operands(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(quantized, k_scale, v_scale) as the kernels take them: an 8-bit cache's scales
    [N, block_size, KVH], or for a float cache the cache itself as a pointer never read."""
    quantized = k_scale is not None
    assert quantized == (k_cache.element_size() == 1), "an 8-bit cache comes with its scales, a float one without"
    if not quantized:
        return False, k_cache, k_cache
    assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
    return True, k_scale, v_scale


@triton.jit
def _load(ptr, mask):
    # an unmasked load where nothing is masked: a mask, even all true, can cost vectorised loads
    if mask is None:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0.0)
    return x


@triton.jit
def load_kv_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, keys, key_mask, kv_head, dims,
                 stride_cb, stride_ct, stride_ch, stride_cd, stride_sb, stride_st, stride_sh,
                 dtype: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 QUANTIZED: tl.constexpr):
    """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] of the keys at absolute positions `keys`, in
    dtype, and (an 8-bit cache) their scales [BLOCK_N]. Keys outside key_mask (None: every key is
    valid) and padded dims load as 0."""
    block = _load(table_ptr + keys // BLOCK_SIZE, key_mask).to(tl.int64)
    # int64 before the multiply: block * stride overflows int32 in a large pool
    row = block * stride_cb + (keys % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
    k_mask = None
    v_mask = None
    if key_mask is not None:
        k_mask = key_mask[None, :]
        v_mask = key_mask[:, None]
    if HEAD_DIM != dims.shape[0]:  # a head size padded to a power of two
        k_mask = (dims < HEAD_DIM)[:, None] if k_mask is None else k_mask & (dims < HEAD_DIM)[:, None]
        v_mask = (dims < HEAD_DIM)[None, :] if v_mask is None else v_mask & (dims < HEAD_DIM)[None, :]
    k_t = _load(k_ptr + row[None, :] + dims[:, None] * stride_cd, k_mask).to(dtype)
    v = _load(v_ptr + row[:, None] + dims[None, :] * stride_cd, v_mask).to(dtype)
    k_scale = 1.0
    v_scale = 1.0
    if QUANTIZED:
        scale_row = block * stride_sb + (keys % BLOCK_SIZE) * stride_st + kv_head * stride_sh
        k_scale = _load(k_scale_ptr + scale_row, key_mask)
        v_scale = _load(v_scale_ptr + scale_row, key_mask)
    return k_t, v, k_scale, v_scale


@triton.jit
def attend_tile(q, k_t, v, k_scale, v_scale, acc, m, l, qk_scale, mask, QUANTIZED: tl.constexpr):
    """One online-softmax step over a key tile: returns the updated (acc, m, l), with m, like the
    scores, in base 2 (qk_scale includes log2(e)). mask [rows or 1, BLOCK_N]: True where a row attends
    to a key; None: every row attends to every key."""
    s = tl.dot(q, k_t, input_precision="ieee")  # ieee: float32 operands must not drop to tf32
    if QUANTIZED:
        s = s * k_scale[None, :]
    s = s * qk_scale
    if mask is not None:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # a row with no key yet keeps m = -inf: subtract 0 instead, so that -inf - -inf never makes NaN
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    if QUANTIZED:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return acc, m_new, l


# -- the extend kernel --------------------------------------------------------------------------

@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, sinks_ptr,
                    q_starts_ptr, q_lens_ptr, ctx_lens_ptr, plan_span_ptr, plan_row_ptr, qk_scale, window,
                    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
                    stride_cb, stride_ct, stride_ch, stride_cd, stride_sb, stride_st, stride_sh, stride_table,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    QUANTIZED: tl.constexpr, HAS_SINKS: tl.constexpr):
    program = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    span = tl.load(plan_span_ptr + program)
    first_row = tl.load(plan_row_ptr + program)
    q_start = tl.load(q_starts_ptr + span)
    q_len = tl.load(q_lens_ptr + span)
    ctx_len = tl.load(ctx_lens_ptr + span)
    table_ptr = tables_ptr + span.to(tl.int64) * stride_table

    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    positions = ctx_len - q_len + rows
    dims = tl.arange(0, BLOCK_D)
    q_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :] * stride_qd,
                mask=q_mask, other=0.0)

    first_pos = ctx_len - q_len + first_row
    num_keys = tl.maximum(ctx_len - q_len + tl.minimum(first_row + BLOCK_M, q_len), 0)  # the last row's keys
    tiles = tl.cdiv(num_keys, BLOCK_N)
    # the keys each row attends to are (lows, positions]; tiles [0, first_tile) are below every row's
    lows = positions - window if window > 0 else positions * 0 - 1
    first_key = tl.maximum(first_pos - window + 1, 0) if window > 0 else first_pos * 0
    first_tile = first_key // BLOCK_N
    # tiles [low_tiles, unmasked_tiles) hold keys within every row's window and at or below its position
    low_tiles = tl.cdiv(tl.maximum(num_keys - window, 0), BLOCK_N) if window > 0 else first_tile
    low_tiles = tl.minimum(tl.maximum(low_tiles, first_tile), tiles)
    unmasked_tiles = tl.maximum(tl.minimum(tl.maximum(first_pos + 1, 0) // BLOCK_N, tiles), low_tiles)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    for tile in range(first_tile, low_tiles):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_t, v, k_scale, v_scale = load_kv_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, keys, (keys >= first_key) & (keys < num_keys), kv_head,
            dims, stride_cb, stride_ct, stride_ch, stride_cd, stride_sb, stride_st, stride_sh,
            q.dtype, HEAD_DIM, BLOCK_SIZE, QUANTIZED)
        seen = (keys[None, :] <= positions[:, None]) & (keys[None, :] > lows[:, None])
        acc, m, l = attend_tile(q, k_t, v, k_scale, v_scale, acc, m, l, qk_scale, seen, QUANTIZED)
    for tile in range(low_tiles, unmasked_tiles):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_t, v, k_scale, v_scale = load_kv_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, keys, None, kv_head, dims,
            stride_cb, stride_ct, stride_ch, stride_cd, stride_sb, stride_st, stride_sh,
            q.dtype, HEAD_DIM, BLOCK_SIZE, QUANTIZED)
        acc, m, l = attend_tile(q, k_t, v, k_scale, v_scale, acc, m, l, qk_scale, None, QUANTIZED)
    for tile in range(unmasked_tiles, tiles):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_t, v, k_scale, v_scale = load_kv_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, keys, (keys >= first_key) & (keys < num_keys), kv_head,
            dims, stride_cb, stride_ct, stride_ch, stride_cd, stride_sb, stride_st, stride_sh,
            q.dtype, HEAD_DIM, BLOCK_SIZE, QUANTIZED)
        seen = (keys[None, :] <= positions[:, None]) & (keys[None, :] > lows[:, None])
        acc, m, l = attend_tile(q, k_t, v, k_scale, v_scale, acc, m, l, qk_scale, seen, QUANTIZED)

    if HAS_SINKS:  # one more term of the denominator, in base 2 against the row's running max
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l = tl.where(l > 0, l + tl.exp2(sink - m), l)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]  # a fully masked row: 0, not 0/0
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      block_tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                      ctx_lens: torch.Tensor, plan: QueryBlocks, scale: float,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      window: int | None = None, sinks: torch.Tensor | None = None,
                      **config: int) -> torch.Tensor:
    """Causal attention of the spans' query rows q [T, H, D] (any strides) over the paged caches
    [N, block_size, KVH, D], into out [T, H, D] (rows outside every span untouched), each row over
    its last `window` positions under a sliding window. block_tables [S, W], q_starts, q_lens,
    ctx_lens [S] are int32 on q's device; plan comes from plan_query_blocks(q_lens, block_m). An
    8-bit cache passes its scales [N, block_size, KVH]; sinks [H] (float32) are gpt-oss's logits per
    head in each softmax's denominator. Keywords (block_n, num_warps, num_stages) override
    prefill_config's; block_m is the plan's."""
    _, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    assert num_heads % kv_heads == 0 and out.shape == q.shape and k_cache.shape[3] == head_dim
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert config.pop("block_m", plan.block_m) == plan.block_m, "block_m is the plan's"
    cfg = dataclasses.replace(prefill_config(head_dim, k_cache.dtype), block_m=plan.block_m, **config)
    quantized, k_scale, v_scale = scale_operands(k_cache, k_scale, v_scale)
    if len(plan) == 0:
        return out
    plan = plan.to(q.device)
    assert sinks is None or sinks.shape == (num_heads,)
    _prefill_kernel[(len(plan), num_heads)](
        q, k_cache, v_cache, out, k_scale, v_scale, block_tables, q if sinks is None else sinks,
        q_starts, q_lens, ctx_lens, plan.span, plan.first_row, scale * LOG2E, window or 0,
        *q.stride(), *out.stride(), *k_cache.stride(), *k_scale.stride()[:3], block_tables.stride(0),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, QUANTIZED=quantized,
        HAS_SINKS=sinks is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    return out
