"""Writing a step's new K/V rows into the paged cache: one program per token, all its KV heads.

A token's slot is block * block_size + offset; the kernel splits it back into the two and
addresses the pool through its strides, so a per-layer view of ladle's [L, N, B, H, D] cache
works as is, and k/v may be strided views of the fused qkv projection. A negative slot marks a
padded row (a captured graph's spare rows) and writes nothing.

An 8-bit cache gets each (token, head) row quantised exactly as ladle.model.kv_quant.quantize
does it, so the kernel and the torch path store the same bytes: inv = qmax / absmax as an
IEEE-rounded division, then x * inv, then int8 rounds half to even (spelled out, Triton has no
such round) or fp8 clamps to +-448 and casts, which rounds to nearest even. Launches disable
FMA contraction so no product is fused into a neighbouring add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle.model import kv_quant

_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@triton.jit
def _round_half_even(y):
    # floor(y + 0.5) would be off for the float just below 0.5 (y + 0.5 rounds up to 1.0);
    # y - floor(y) is exact for |y| < 2^23, so compare the fraction instead
    lo = tl.floor(y)
    frac = y - lo
    lo_is_odd = (lo - 2.0 * tl.floor(lo * 0.5)) == 1.0
    round_up = (frac > 0.5) | ((frac == 0.5) & lo_is_odd)
    return tl.where(round_up, lo + 1.0, lo)


@triton.jit
def _store_row(src_ptr, dst_ptr, scale_ptr, mask, head_mask, QUANTIZED: tl.constexpr, QMAX: tl.constexpr,
               IS_INT8: tl.constexpr):
    x = tl.load(src_ptr, mask=mask, other=0.0)
    if QUANTIZED:
        x = x.to(tl.float32)
        absmax = tl.max(tl.abs(x), 1)
        has_values = absmax > 0
        qmax = tl.full(absmax.shape, QMAX, tl.float32)
        inv = tl.where(has_values, tl.div_rn(qmax, tl.where(has_values, absmax, 1.0)), 0.0)
        y = x * inv[:, None]
        if IS_INT8:
            y = tl.minimum(tl.maximum(_round_half_even(y), -QMAX), QMAX)
        else:
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        tl.store(dst_ptr, y.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr, tl.div_rn(absmax, qmax), mask=head_mask)
    else:
        tl.store(dst_ptr, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_cb, stride_ct, stride_ch, stride_cd, stride_sb, stride_st, stride_sh,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr,
                     QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        head = tl.arange(0, BLOCK_H)
        head_mask = head < NUM_KV_HEADS
        heads = head[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = head_mask[:, None] & (dims < HEAD_DIM)
        dst = block * stride_cb + offset * stride_ct + heads * stride_ch + dims * stride_cd
        scale_dst = block * stride_sb + offset * stride_st + head * stride_sh
        _store_row(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, k_cache_ptr + dst,
                   k_scale_ptr + scale_dst, mask, head_mask, QUANTIZED, QMAX, IS_INT8)
        _store_row(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, v_cache_ptr + dst,
                   v_scale_ptr + scale_dst, mask, head_mask, QUANTIZED, QMAX, IS_INT8)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v [T, KVH, D] (any strides) into the caches [N, block_size, KVH, D] at slot_mapping [T]
    (negative: skip the row). With k_scale/v_scale [N, block_size, KVH] (an 8-bit cache) the rows
    are quantised per token and head, as kv_quant.quantize does it."""
    t, kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (t,)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (kv_heads, head_dim)
    quantized = k_scale is not None
    assert quantized == kv_quant.is_8bit(k_cache.dtype) and (v_scale is not None) == quantized
    if quantized:
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
    else:
        k_scale = v_scale = k_cache  # never read
    if t == 0:
        return
    block_h, block_d = triton.next_power_of_2(kv_heads), triton.next_power_of_2(head_dim)
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *k_scale.stride()[:3],
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1], QUANTIZED=quantized, QMAX=_QMAX.get(k_cache.dtype, 0.0),
        IS_INT8=k_cache.dtype == torch.int8,
        num_warps=min(max(block_h * block_d // 256, 1), 8), enable_fp_fusion=False)
