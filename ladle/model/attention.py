"""Paged attention: K/V live in fixed-size blocks, read through each sequence's block table.

The model calls an `AttentionBackend`; this file holds the portable torch one (the CPU's,
with its native kernels). The CUDA path's Triton kernels implement the same three methods
(ladle.model.triton.backend); the platform picks one at start-up.
"""

from __future__ import annotations

import functools
import math
import mmap
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ladle.model import kernels, kv_quant
from ladle.model.kernels.loader import cpu_flags


@functools.cache
def _torch_packs_without_its_kernel() -> bool:
    """True where torch's CPU flash attention would call its VNNI packing from a build below
    AVX-512: torch decides to pack from the CPU (AMX present) but runs the kernels of
    ATEN_CPU_CAPABILITY, and the AVX2 build of the packing raises. Only a capability forced
    below the CPU's (CI's AVX2 pass on an AMX Xeon) meets this; a real AVX2 CPU has no AMX."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return not capability.startswith("AVX512") and "amx_tile" in cpu_flags()


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """torch's scaled_dot_product_attention, on its math backend where its 16-bit flash
    kernel would fail (above)."""
    if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu" and _torch_packs_without_its_kernel():
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


@dataclass
class PrefillSpan:
    """One sequence's chunk of prompt tokens inside the flat token batch."""

    start: int  # first row in the flat batch
    end: int  # one past the last row
    context_len: int  # tokens cached for the sequence once this chunk is written
    block_table: torch.Tensor  # int64 block ids covering context_len
    # Each token's result depends only on its sequence's tokens, never on chunking or batch
    # (Sequence.canonical): the native prompt kernel, or block-aligned tiles without it.
    canonical: bool = False


def padded_block_tables(tables: list[list[int]] | list[torch.Tensor]) -> torch.Tensor:
    """int64 [len(tables), longest]: each table, zero-padded (padding is never read). Filled in numpy: a
    torch slice assignment a row took 4.8 ms for a decode step's 256 tables of 70 blocks, numpy 0.5."""
    out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table.numpy() if isinstance(table, torch.Tensor) else table
    return torch.from_numpy(out)


@dataclass
class CanonicalRows:
    """The canonical spans of a step, packed for the native row-invariant prompt kernel."""

    block_tables: torch.Tensor  # int64 [S, max_blocks]
    row_starts: torch.Tensor  # int64 [S]: first row of each span in the flat batch
    row_counts: torch.Tensor  # int64 [S]
    first_positions: torch.Tensor  # int64 [S]: absolute position of each span's first row

    @classmethod
    def of(cls, spans: list[PrefillSpan]) -> "CanonicalRows":
        tables = padded_block_tables([s.block_table for s in spans])
        return cls(tables, torch.tensor([s.start for s in spans]), torch.tensor([s.end - s.start for s in spans]),
                   torch.tensor([s.context_len - (s.end - s.start) for s in spans]))


@dataclass
class AttentionMetadata:
    """What every layer needs to attend for one step; built once by the runner.

    Rows [0, num_decodes) of the flat batch are single-token decodes, the rest are
    prefill chunks described by `prefills`.
    """

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [B] int64: tokens each decode attends to
    decode_rows: CanonicalRows | None = None  # the decodes as one-row spans, for the native prompt kernel
    prefills: list[PrefillSpan] = field(default_factory=list)
    canonical: CanonicalRows | None = None  # the canonical spans of `prefills`, if any
    # (source block, destination block, tokens) to copy in each layer once this step's K/V
    # are written: sequences starting on blocks that other sequences compute in this step
    in_step_copies: list[tuple[int, int, int]] = field(default_factory=list)
    batch_invariant: bool = False  # linear layers must give each row the same bits whatever the batch
    backend_data: object = None  # what the backend's prepare() derived from the above, for its kernels
    states: object = None  # hybrid models: each sequence's linear-attention state slot (ladle.model.linear_attention)


class AttentionBackend(Protocol):
    # Once per forward, before any layer: derive what the kernels read (on the device) from the
    # metadata, into meta.backend_data; nothing to do where it is already set (a captured graph's).
    def prepare(self, meta: AttentionMetadata) -> None: ...

    # Writes this step's K/V, then performs meta.in_step_copies, before any attend().
    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None: ...

    # sinks: float32 [num_heads], a learned logit per head in its softmax's denominator (gpt-oss), or None
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               sinks: torch.Tensor | None = None) -> torch.Tensor: ...


class LayerViews:
    """Layers held in several stacked tensors, one per attention shape, read by layer as one stacked
    tensor is: views[layer] is that layer's [blocks, block_size, kv_heads, head_dim] (contiguous)."""

    def __init__(self, stacks: list[torch.Tensor], places: list[tuple[int, int]]):
        self.stacks = stacks
        self._views = [stacks[group][index] for group, index in places]

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self._views[layer]

    def __len__(self) -> int:
        return len(self._views)

    @property
    def dtype(self) -> torch.dtype:
        return self.stacks[0].dtype

    @property
    def device(self) -> torch.device:
        return self.stacks[0].device

    @property
    def is_cpu(self) -> bool:
        return self.stacks[0].is_cpu


class KVCache:
    """Preallocated K and V storage: [layers, blocks, block_size, kv_heads, head_dim] each.

    An 8-bit cache (int8 or fp8 e4m3, ladle.model.kv_quant) also holds a float32 scale per
    slot and KV head: k_scale, v_scale [layers, blocks, block_size, kv_heads].

    Layers of different shapes (layer_shapes: each layer's (kv_heads, head_dim), Gemma 4's) are
    stacked by shape: k, v and the scales are then LayerViews, still indexed by layer. A layer shape
    (kv_heads, k_dim, v_dim) gives K and V widths of their own: MLA's latent cache (ladle.model.mla)
    is (1, kv_lora_rank + rope, 0), one vector per token in K and a V of width 0 that holds nothing.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 layer_shapes: tuple[tuple[int, ...], ...] = ()):
        self.block_size = block_size
        shapes = list(layer_shapes) or [(num_kv_heads, head_dim)] * num_layers
        groups = list(dict.fromkeys(shapes))  # the distinct shapes, in order of first use
        quantized = kv_quant.is_8bit(dtype)
        self.k_scale = self.v_scale = None
        places = [(groups.index(shape), shapes[:layer].count(shape)) for layer, shape in enumerate(shapes)]

        def stacked(which: str, of: torch.dtype) -> torch.Tensor | LayerViews:
            parts = [_zeros((shapes.count(g), num_blocks, block_size, *_part_shape(g, which)), of, device)
                     for g in groups]
            return parts[0] if len(groups) == 1 else LayerViews(parts, places)

        self.k, self.v = stacked("k", dtype), stacked("v", dtype)
        if quantized:
            self.k_scale, self.v_scale = stacked("k_scale", torch.float32), stacked("v_scale", torch.float32)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> list[torch.Tensor]:
        """Everything held per slot, layer first: K, V and an 8-bit cache's scales (each stack of a cache
        whose layers differ in shape); not a V of width 0 (MLA's), which holds nothing to copy or offload."""
        held = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else [])
        stacks = [s for t in held for s in (t.stacks if isinstance(t, LayerViews) else [t])]
        return [s for s in stacks if math.prod(s.shape[3:])]

    def copy_prefix(self, src: int, dst: int, num_tokens: int, layer: int | None = None) -> None:
        """The first num_tokens slots of block src into block dst, in one layer or every layer."""
        if layer is None:
            for t in self.tensors():
                t[:, dst, :num_tokens] = t[:, src, :num_tokens]
            return
        for t in [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else []):
            t[layer][dst, :num_tokens] = t[layer][src, :num_tokens]

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """Layer's (kv_heads, head_dim)."""
        return tuple(self.k[layer].shape[-2:])

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype = torch.float32, layer_shapes: tuple[tuple[int, ...], ...] = ()) -> int:
        """What one block holds over every layer: only what is stored (MLA's latent, no V)."""
        shapes = layer_shapes or [(num_kv_heads, head_dim)] * num_layers
        scale = torch.float32 if kv_quant.is_8bit(dtype) else None
        return sum(block_size * math.prod(_part_shape(shape, which)) * of.itemsize for shape in shapes
                   for which, of in (("k", dtype), ("v", dtype), ("k_scale", scale), ("v_scale", scale)) if of)


def _part_shape(shape: tuple[int, ...], which: str) -> tuple[int, ...]:
    """The per-slot shape of K, V or their scales for a layer shape (kv_heads, head_dim) or (kv_heads, k_dim,
    v_dim): a V of width 0 has no scales either."""
    heads, k_dim, v_dim = shape if len(shape) == 3 else (shape[0], shape[1], shape[1])
    dim = k_dim if which.startswith("k") else v_dim
    if which.endswith("scale"):
        return (heads if dim else 0,)
    return (heads, dim)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Zeroed storage that costs memory only as blocks are first written.

    Masked attention weighs unused slots by exactly 0, which is only harmless if they hold
    finite numbers, so they must start zeroed. An anonymous mapping is zeroed lazily, page by
    page, where torch.zeros would touch every byte up front; asking for transparent huge pages
    makes a block's first write fault in 2 MiB at a time instead of 4 KiB (the first 16 x 256
    prompt tokens wrote their K/V in 0.6 s with small pages, 0.1 s with huge ones).
    """
    if torch.device(device).type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


def window_mask(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(queries), len(keys)] True where a query at that position attends to a key at that position:
    causal, and within the last `window` positions under a sliding window (as transformers masks it)."""
    seen = keys[None, :] <= queries[:, None]
    if window is not None:
        seen &= keys[None, :] > queries[:, None] - window
    return seen


def sdpa_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None,
                    sinks: torch.Tensor | None, **kwargs) -> torch.Tensor:
    """SDPA of q [..., H, n, D] over k, v [..., KVH, K, D] where `seen` (bool, broadcast to [..., H, n, K])
    is True; sinks (shaped to broadcast to [..., H, n, 1]) add a logit per head to each softmax's
    denominator: a zero key scored by its float mask, whose zero value weighs nothing."""
    if sinks is None:
        return sdpa(q, k, v, attn_mask=seen, **kwargs)
    zero = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    k, v = torch.cat((k, zero), dim=-2), torch.cat((v, zero), dim=-2)
    rows = (*q.shape[:-1], k.shape[-2] - 1)
    bias = torch.zeros(rows, dtype=q.dtype, device=q.device)
    if seen is not None:
        bias = bias.masked_fill(~seen.expand(rows), -math.inf)
    bias = torch.cat((bias, sinks.to(q.dtype).expand(*rows[:-1], 1)), dim=-1)
    return sdpa(q, k, v, attn_mask=bias, **kwargs)


class TorchPagedAttention:
    """Attention over the paged cache with plain torch ops (scaled_dot_product_attention).

    windows[layer]: that layer's sliding window (each query attends to its last `window` positions),
    None where it attends to the whole context. scale: what q . k is multiplied by (head_dim^-0.5
    unless the model says otherwise). Each layer's KV heads and head dim are its cache's
    (KVCache.layer_shape): Gemma 4's global layers differ from its sliding ones."""

    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int,
                 windows: tuple[int | None, ...] = (), scale: float | None = None):
        self.cache = cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.windows = windows
        self.scale = head_dim**-0.5 if scale is None else scale
        # float32 caches take every native kernel; bfloat16 and 8-bit ones the prompt kernel
        # (decodes included) and the K/V writes; anything else stays on torch
        self._native_ok = cache.k.dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn) \
            and cache.k.is_cpu
        self._decode_kernel_ok = self._native_ok and cache.k.dtype == torch.float32
        head_dims = {cache.layer_shape(layer)[1] for layer in range(len(cache.k))}
        self._prompt_kernel_ok = self._native_ok and all(d % 8 == 0 for d in head_dims) and cache.block_size % 8 == 0

    def _native(self, *rows: torch.Tensor) -> kernels.NativeKernels | None:
        """The native kernels, if these [T, heads, D] operands suit them (inner dims contiguous)."""
        if self._native_ok and all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in rows):
            return kernels.native_kernels()
        return None

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if layer < len(self.windows) else None

    def prepare(self, meta: AttentionMetadata) -> None:
        """The decodes' key masks [B, 1, 1, max_blocks * block_size] (True: attend) for the torch path,
        by window (None: the whole context)."""
        if meta.backend_data is None and meta.decode_block_tables is not None:
            device = self.cache.k.device
            keys = torch.arange(meta.decode_block_tables.shape[1] * self.cache.block_size, device=device)
            last = meta.decode_context_lens.to(device) - 1
            meta.backend_data = {w: window_mask(last, keys, w)[:, None, None, :] for w in {None, *self.windows}}

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        if self.cache.quantized:
            self._write_quantized(layer, k, v, meta.slot_mapping)
        else:
            self._write(layer, k, v, meta.slot_mapping)
        for src, dst, n in meta.in_step_copies:  # in order: a source may itself be a destination
            self.cache.copy_prefix(src, dst, n, layer)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        same_dtype = k.dtype == v.dtype == self.cache.k.dtype
        native = self._native(k, v) if same_dtype else None
        if native is not None:  # a copy per token, where index_copy_ costs several microseconds
            native.write_kv(k, v, self.cache.k[layer], self.cache.v[layer], slots)
            return
        flat = (-1, *k.shape[1:])
        self.cache.k[layer].view(flat).index_copy_(0, slots, k.to(self.cache.k.dtype))
        self.cache.v[layer].view(flat).index_copy_(0, slots, v.to(self.cache.v.dtype))

    def _write_quantized(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        c = self.cache
        k, v = k.float(), v.float()
        native = self._native(k, v)
        if native is not None:
            native.write_kv_quantized(k, v, c.k[layer], c.v[layer], c.k_scale[layer], c.v_scale[layer], slots)
            return
        flat = (-1, *k.shape[1:])
        for x, values, scales in ((k, c.k[layer], c.k_scale[layer]), (v, c.v[layer], c.v_scale[layer])):
            q, s = kv_quant.quantize(x, values.dtype)
            values.view(torch.uint8).view(flat).index_copy_(0, slots, q.view(torch.uint8))  # no fp8 index_copy_
            scales.view(flat[:-1]).index_copy_(0, slots, s)

    def _scales(self, layer: int) -> dict[str, torch.Tensor]:
        """The prompt kernel's scale arguments for this layer (none for a float cache)."""
        if not self.cache.quantized:
            return {}
        return {"k_scales": self.cache.k_scale[layer], "v_scales": self.cache.v_scale[layer]}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (this step's tokens, already in the cache). Returns [T, H*D]."""
        if not meta.prefills:  # decodes only: nothing to assemble
            return self._decode(layer, q, meta, sinks)
        out = torch.empty(q.shape[0], self.num_heads * q.shape[2], dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(layer, q[: meta.num_decodes], meta, sinks)
        native = self._native(q) if meta.canonical is not None and self._prompt_kernel_ok else None
        for span in meta.prefills:
            if span.canonical and native is None:
                out[span.start : span.end] = self._tiles(layer, span, q, k, v, sinks)
            elif not span.canonical:
                out[span.start : span.end] = self._prefill(layer, span, q, k, v, sinks)
        if native is not None:  # every canonical span in one call, each row computed on its own
            rows = meta.canonical
            o32 = out if out.dtype == torch.float32 else torch.empty_like(out, dtype=torch.float32)
            native.prompt_attention(q.float(), self.cache.k[layer], self.cache.v[layer], rows.block_tables,
                                    rows.row_starts, rows.row_counts, rows.first_positions, self.scale, o32,
                                    **self._scales(layer), window=self.window(layer), sinks=sinks)
            if o32 is not out:
                for span in meta.prefills:
                    if span.canonical:
                        out[span.start : span.end] = o32[span.start : span.end]
        return out

    def _gather(self, layer: int, which: str, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One layer's K or V (`which`), blocks -> one contiguous run per sequence:
        [..., tokens, KVH, D] in dtype (an 8-bit cache dequantised)."""
        # index_select copies whole blocks; several times faster than advanced indexing.
        flat = block_table.flatten().to(self.cache.k.device)
        blocks = getattr(self.cache, which)[layer].index_select(0, flat)
        if self.cache.quantized:
            blocks = kv_quant.dequantize(blocks, getattr(self.cache, f"{which}_scale")[layer].index_select(0, flat))
        return blocks.to(dtype).view(*block_table.shape[:-1], -1, *self.cache.layer_shape(layer))

    def _decode(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        native = self._native(q) if meta.decode_context_lens is not None else None
        if native is not None and self._prompt_kernel_ok and meta.decode_rows is not None:
            # a decode is a one-row prompt span: the prompt kernel scores 8 keys per pass and
            # runs decode steps about 1.6x faster than the decode kernel (and row-invariant)
            rows = meta.decode_rows
            out = torch.empty(q.shape[0], self.num_heads * q.shape[2], dtype=torch.float32)
            native.prompt_attention(q.float(), self.cache.k[layer], self.cache.v[layer], rows.block_tables,
                                    rows.row_starts, rows.row_counts, rows.first_positions, self.scale, out,
                                    **self._scales(layer), window=self.window(layer), sinks=sinks)
            return out.to(q.dtype)
        if native is not None and self._decode_kernel_ok and q.dtype == torch.float32:  # K/V read in place
            return native.decode_attention(q, self.cache.k[layer], self.cache.v[layer], meta.decode_block_tables,
                                           meta.decode_context_lens, self.scale, self.window(layer), sinks)
        b = q.shape[0]
        kv_heads, head_dim = self.cache.layer_shape(layer)
        group = self.num_heads // kv_heads
        # Grouped-query trick: the heads sharing one KV head attend as a group, so K/V
        # are never repeated.
        qg = q.view(b, kv_heads, group, head_dim)
        k = self._gather(layer, "k", meta.decode_block_tables, q.dtype).transpose(1, 2)
        v = self._gather(layer, "v", meta.decode_block_tables, q.dtype).transpose(1, 2)
        group_sinks = None if sinks is None else sinks.view(1, kv_heads, group, 1)
        o = sdpa_with_sinks(qg, k, v, meta.backend_data[self.window(layer)], group_sinks, scale=self.scale)
        return o.reshape(b, self.num_heads * head_dim)

    def _prefill(self, layer: int, span: PrefillSpan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        n = span.end - span.start
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        window = self.window(layer)
        fresh = span.context_len == n and not self.cache.quantized
        if fresh:  # nothing cached before: the fresh K/V
            ks = k[span.start : span.end]
            vs = v[span.start : span.end]
        else:  # an 8-bit cache is read even for fresh tokens, so every path sees the same K/V
            ks = self._gather(layer, "k", span.block_table, q.dtype)[: span.context_len]
            vs = self._gather(layer, "v", span.block_table, q.dtype)[: span.context_len]
        if fresh and window is None and sinks is None:
            mask, causal = None, True
        else:
            positions = torch.arange(span.context_len, device=q.device)
            mask, causal = window_mask(positions[span.context_len - n :], positions, window), False
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        head_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)
        o = sdpa_with_sinks(qs, ks, vs, mask, head_sinks, is_causal=causal, enable_gqa=True, scale=self.scale)
        return o[0].transpose(0, 1).reshape(n, self.num_heads * q.shape[2])

    def _tiles(self, layer: int, span: PrefillSpan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Without the native kernels: queries in tiles aligned to absolute block boundaries,
        each against exactly the keys up to its end: the same call shapes whether a prefix
        was cached or not."""
        bs = self.cache.block_size
        n = span.end - span.start
        first = span.context_len - n  # absolute position of the span's first query
        keys = self._gather(layer, "k", span.block_table, q.dtype)[: span.context_len].transpose(0, 1)
        values = self._gather(layer, "v", span.block_table, q.dtype)[: span.context_len].transpose(0, 1)
        out = []
        pos = first
        while pos < span.context_len:
            tile_start = pos // bs * bs
            tile_end = min(tile_start + bs, span.context_len)
            rows = q[span.start + pos - first : span.start + tile_end - first]
            # A tile that starts mid-block (its first tokens' K/V were copied from the
            # cache) is padded with zero queries back to the block start: SDPA's rows
            # depend on the tile's row count, not on the other rows' values.
            rows = F.pad(rows, (0, 0, 0, 0, pos - tile_start, 0)).transpose(0, 1)
            positions = torch.arange(tile_end, device=q.device)
            seen = window_mask(positions[tile_start:], positions, self.window(layer))
            o = sdpa_with_sinks(rows.unsqueeze(0), keys[:, :tile_end].unsqueeze(0), values[:, :tile_end].unsqueeze(0),
                                seen, None if sinks is None else sinks.view(1, -1, 1, 1), enable_gqa=True,
                                scale=self.scale)
            o = o[0, :, pos - tile_start :].transpose(0, 1)
            out.append(o.reshape(tile_end - pos, self.num_heads * q.shape[2]))
            pos = tile_end
        return torch.cat(out)
