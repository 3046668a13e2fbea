"""The CUDA attention backend: ladle's Triton kernels over the paged KV pool.

Once per forward, `prepare` turns the step's metadata into the kernels' device tensors: the
decodes' block tables and lengths, and for the prefill spans their rows, context lengths, block
tables and the launch plan of query blocks. Each layer then writes its new K/V into the pool
(`write_kv`) and attends: decode rows through the split-KV decode kernel, prefill rows (every
other row, chunks of any length, canonical ones included) through the extend kernel, which
reads every key from the pool in tiles anchored at key 0, so a row's result never depends on
the batch or the chunking. A sliding-window layer passes its window (the kernels read no block
below it) and gpt-oss's layers their sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.model.attention import AttentionMetadata, KVCache, LayerViews, padded_block_tables
from ladle.model.triton.decode_attention import DecodeScratch, choose_num_splits, decode_attention
from ladle.model.triton.kv_write import write_kv
from ladle.model.triton.prefill_attention import QueryBlocks, plan_query_blocks, prefill_attention, prefill_config

MAX_SPLITS = 16


@dataclass
class PrefillRows:
    """The step's prefill spans as the extend kernel reads them (int32, on the device)."""

    block_tables: torch.Tensor  # [S, W]
    q_starts: torch.Tensor  # [S] first row in the flat batch
    q_lens: torch.Tensor  # [S]
    ctx_lens: torch.Tensor  # [S] the sequence's tokens once this chunk is written
    plan: QueryBlocks


@dataclass
class TritonStepData:
    num_decodes: int
    decode_tables: torch.Tensor | None  # [B, W] int32
    decode_lens: torch.Tensor | None  # [B] int32: keys each decode attends to, its own included
    num_splits: int
    scratch: DecodeScratch | None
    prefill: PrefillRows | None


class TritonPagedAttention:
    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int,
                 windows: tuple[int | None, ...] = (), scale: float | None = None):
        if isinstance(cache.k, LayerViews):
            raise ValueError("the Triton attention kernels take one K/V shape for every layer, and this model's "
                             "layers differ (Gemma 4's global_head_dim or num_global_key_value_heads): serve it "
                             "with --attention-backend torch")
        self.cache = cache
        self.windows = windows
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.device = cache.k.device
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 4
        self.block_m = prefill_config(head_dim, cache.k.dtype).block_m
        self._graph_scratch: DecodeScratch | None = None

    # -- per step ---------------------------------------------------------------

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.backend_data is not None:
            return
        b = meta.num_decodes
        tables = lens = scratch = None
        splits = 1
        if b:
            tables = self._int32(meta.decode_block_tables)
            lens = self._int32(meta.decode_context_lens)
            splits = choose_num_splits(b, self.num_kv_heads, self.num_sms, MAX_SPLITS)
            scratch = DecodeScratch.allocate(b, self.num_heads, self.head_dim, splits, self.device)
        meta.backend_data = TritonStepData(b, tables, lens, splits, scratch, self._prefill_rows(meta))

    def _prefill_rows(self, meta: AttentionMetadata) -> PrefillRows | None:
        spans = meta.prefills
        if not spans:
            return None
        q_lens = [s.end - s.start for s in spans]
        return PrefillRows(self._int32(padded_block_tables([s.block_table for s in spans])),
                           self._int32([s.start for s in spans]), self._int32(q_lens),
                           self._int32([s.context_len for s in spans]),
                           plan_query_blocks(q_lens, self.block_m).to(self.device))

    def _int32(self, values: torch.Tensor | list[int]) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int32).to(self.device, non_blocking=True)

    def static_decode(self, block_tables: torch.Tensor, context_lens: torch.Tensor) -> TritonStepData:
        """The metadata of a captured decode step over static buffers (ladle.engine.cuda_graphs): one
        scratch shared by every captured size, the split count fixed by the size."""
        b = block_tables.shape[0]
        if self._graph_scratch is None or self._graph_scratch.max_batch < b:
            self._graph_scratch = DecodeScratch.allocate(b, self.num_heads, self.head_dim, MAX_SPLITS, self.device)
        splits = choose_num_splits(b, self.num_kv_heads, self.num_sms, MAX_SPLITS)
        return TritonStepData(b, block_tables, context_lens, splits, self._graph_scratch, None)

    # -- per layer --------------------------------------------------------------

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        c = self.cache
        scales = (c.k_scale[layer], c.v_scale[layer]) if c.quantized else (None, None)
        write_kv(k, v, c.k[layer], c.v[layer], meta.slot_mapping, *scales)
        for src, dst, n in meta.in_step_copies:  # in order: a source may itself be a destination
            c.copy_prefix(src, dst, n, layer)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]. Returns [T, H * D]."""
        d: TritonStepData = meta.backend_data
        c = self.cache
        scales = {"k_scale": c.k_scale[layer], "v_scale": c.v_scale[layer]} if c.quantized else {}
        window = self.windows[layer] if layer < len(self.windows) else None
        if sinks is not None:
            sinks = sinks.float()
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if d.num_decodes:
            b = d.num_decodes
            decode_attention(q[:b], c.k[layer], c.v[layer], out[:b], d.decode_tables, d.decode_lens, self.scale,
                             d.num_splits, d.scratch, **scales, window=window, sinks=sinks)
        if d.prefill is not None:
            p = d.prefill
            prefill_attention(q, c.k[layer], c.v[layer], out, p.block_tables, p.q_starts, p.q_lens, p.ctx_lens,
                              p.plan, self.scale, **scales, window=window, sinks=sinks)
        return out.view(q.shape[0], self.num_heads * self.head_dim)
