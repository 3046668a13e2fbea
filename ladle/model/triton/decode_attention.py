"""Split-KV (flash-decoding) attention for decode steps: one query token per sequence.

A decode step has too few rows to fill the GPU with one program per (sequence, KV head), so
stage 1 also splits each sequence's keys into num_splits contiguous pieces, grid (B, KVH,
num_splits). A program takes every query head of its KV head at once (the GQA group, padded to
BLOCK_H >= 16 rows so tl.dot has M >= 16): K/V are read once per group, not once per head. It
writes its piece's normalised float32 output and log-sum-exp to scratch; stage 2, grid (B, H),
merges a row's pieces in split order.

A row attends to its keys [first, seq_len): first is 0, or under a sliding window the row's last
`window` keys; keys below first are never read. Splits divide that range. The split length is
cdiv(cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N, a function of the row's own keys and
the launch's split count alone: another row's length never moves a row's split
or tile boundaries, so its result does not depend on its batch-mates (only on num_splits, which
choose_num_splits takes from the batch shape, never from lengths). Splits past a row's end are
empty: stage 1 returns at once and stage 2 reads only the splits holding keys, which it counts
the same way, so stale scratch is never read and a padded row (seq_len 0) comes out exactly 0.
Everything is read on the device (seq_lens, block tables): no host sync, no allocation given a
DecodeScratch, so a step can be captured in a CUDA graph. Attention sinks (gpt-oss: a logit per
head that joins the softmax's denominator and weighs no value) enter in stage 2, as one more term
of the merged sum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ladle.model.triton.prefill_attention import LOG2E, attend_tile, load_kv_tile, scale_operands


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """Pinned: a decode reads K/V once and is bound by memory, so the tile is sized for loads in
    flight (64 keys of a 128-wide head = 16 KiB of K per stage) rather than for the products."""
    d = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:  # exact float32 products on CUDA cores (tests): tiles that do not spill
        return DecodeConfig(32, 4 if d <= 64 else 8, 2)
    return DecodeConfig(64 if d <= 128 else 32, 4, 2)


def choose_num_splits(batch: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Splits per sequence so that batch * num_kv_heads * splits programs about fill the SMs; 1
    once the batch fills them alone. A function of the batch's shape only, never of its lengths."""
    programs = batch * num_kv_heads
    if programs >= num_sms:
        return 1
    return max(1, min(max_splits, triton.cdiv(num_sms, programs)))


@dataclass
class DecodeScratch:
    """Stage 1's partial results, preallocated so that a captured graph never allocates."""

    out: torch.Tensor  # [max_batch, num_heads, max_splits, head_dim] float32, each split normalised
    lse: torch.Tensor  # [max_batch, num_heads, max_splits] float32, log2-sum-exp2 of the split's scores

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, head_dim: int, max_splits: int,
                 device: torch.device | str) -> "DecodeScratch":
        return cls(torch.empty(max_batch, num_heads, max_splits, head_dim, dtype=torch.float32, device=device),
                   torch.empty(max_batch, num_heads, max_splits, dtype=torch.float32, device=device))

    @property
    def max_batch(self) -> int:
        return self.out.shape[0]

    @property
    def max_splits(self) -> int:
        return self.out.shape[2]


@triton.jit
def _split_len(num_keys, num_splits, BLOCK_N: tl.constexpr):
    return tl.cdiv(tl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _first_key(seq_len, window):
    """The first key a row of seq_len keys attends to: its last `window` under a sliding window (> 0)."""
    first = seq_len * 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)
    return first


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, seq_lens_ptr,
                         part_out_ptr, part_lse_ptr, qk_scale, num_splits, window,
                         stride_qb, stride_qh, stride_qd,
                         stride_cb, stride_ct, stride_ch, stride_cd, stride_sb, stride_st, stride_sh, stride_table,
                         stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         QUANTIZED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    first = _first_key(seq_len, window)
    split_len = _split_len(seq_len - first, num_splits, BLOCK_N)
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        table_ptr = tables_ptr + row * stride_table
        group_head = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + group_head
        dims = tl.arange(0, BLOCK_D)
        q_mask = (group_head < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                    mask=q_mask, other=0.0)

        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_H], dtype=tl.float32)
        for tile_start in range(start, end, BLOCK_N):
            keys = tile_start + tl.arange(0, BLOCK_N)
            key_mask = keys < end
            k_t, v, k_scale, v_scale = load_kv_tile(
                k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, keys, key_mask, kv_head, dims,
                stride_cb, stride_ct, stride_ch, stride_cd, stride_sb, stride_st, stride_sh,
                q.dtype, HEAD_DIM, BLOCK_SIZE, QUANTIZED)
            acc, m, l = attend_tile(q, k_t, v, k_scale, v_scale, acc, m, l, qk_scale, key_mask[None, :], QUANTIZED)

        # a non-empty split has a key for every row: l > 0
        part = row * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + dims[None, :], acc / l[:, None], mask=q_mask)
        tl.store(part_lse_ptr + row * stride_lb + heads * stride_lh + split, m + tl.log2(l),
                 mask=group_head < GROUP)


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, seq_lens_ptr, sinks_ptr, out_ptr, num_splits, window,
                         stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         stride_ob, stride_oh, stride_od,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_SINKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    num_keys = seq_len - _first_key(seq_len, window)
    used = tl.cdiv(num_keys, tl.maximum(_split_len(num_keys, num_splits, BLOCK_N), 1))  # the splits with keys
    lse_ptr = part_lse_ptr + row * stride_lb + head * stride_lh
    part_ptr = part_out_ptr + row * stride_pb + head * stride_ph
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    top = tl.full([], float("-inf"), dtype=tl.float32)
    for split in range(0, used):
        top = tl.maximum(top, tl.load(lse_ptr + split))
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    if HAS_SINKS and used > 0:  # base 2, as the scores are
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
        total += tl.exp2(sink - top)
    for split in range(0, used):
        weight = tl.exp2(tl.load(lse_ptr + split) - top)
        acc += weight * tl.load(part_ptr + split * stride_ps + dims, mask=dim_mask, other=0.0)
        total += weight
    o = acc / tl.where(total > 0, total, 1.0)  # a padded row (seq_len 0): exactly 0
    tl.store(out_ptr + row * stride_ob + head * stride_oh + dims * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int,
                     scratch: DecodeScratch | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, window: int | None = None,
                     sinks: torch.Tensor | None = None, **config: int) -> torch.Tensor:
    """Attention of one query per row, q [B, H, D] (any strides), over the paged caches
    [N, block_size, KVH, D] into out [B, H, D]: row b attends to its first seq_lens[b] keys
    (int32 [B]; 0 gives 0), the last `window` of them under a sliding window, through block_tables
    [B, W] (int32). An 8-bit cache passes its scales [N, block_size, KVH]; sinks [H] (float32) are
    gpt-oss's logits per head in each softmax's denominator. Keywords (block_n, num_warps,
    num_stages) override decode_config's."""
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    assert num_heads % kv_heads == 0 and out.shape == q.shape and k_cache.shape[3] == head_dim
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    cfg = dataclasses.replace(decode_config(head_dim, k_cache.dtype), **config)
    quantized, k_scale, v_scale = scale_operands(k_cache, k_scale, v_scale)
    if scratch is None:
        scratch = DecodeScratch.allocate(batch, num_heads, head_dim, num_splits, q.device)
    assert batch <= scratch.max_batch and num_splits <= scratch.max_splits
    assert scratch.out.shape[1:] == (num_heads, scratch.max_splits, head_dim)
    assert scratch.out.stride(3) == 1 and scratch.lse.stride(2) == 1
    if batch == 0:
        return out
    block_d = max(triton.next_power_of_2(head_dim), 16)
    part, lse = scratch.out, scratch.lse
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, part, lse, scale * LOG2E, num_splits,
        window or 0, *q.stride(), *k_cache.stride(), *k_scale.stride()[:3], block_tables.stride(0),
        *part.stride()[:3], *lse.stride()[:2],
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg.block_n, BLOCK_SIZE=k_cache.shape[1], QUANTIZED=quantized,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    assert sinks is None or sinks.shape == (num_heads,)
    _decode_merge_kernel[(batch, num_heads)](
        part, lse, seq_lens, part if sinks is None else sinks, out, num_splits, window or 0,
        *part.stride()[:3], *lse.stride()[:2], *out.stride(),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=cfg.block_n, HAS_SINKS=sinks is not None, num_warps=1,
        enable_fp_fusion=False)
    return out
