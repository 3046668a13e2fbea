"""Paged multi-head latent attention (DeepSeek V3's MLA) over a latent KV cache.

Each cached token is one vector per layer: its normed latent (kv_lora_rank numbers) and its rotated
shared key (qk_rope_head_dim), side by side in KVCache.k (MLAConfig.cache_shape; V has width 0).

Prompt chunks decompress the latents into every head's keys and values (one matmul through kv_b_proj)
and attend with SDPA: cheaper than absorbing when many queries share the keys. Decodes stay in the
latent space (ladle.model.mla's weight absorption): they read only the cached latents, through the
block tables. Canonical spans (scoring, --deterministic) take the absorbed form too, in query tiles
aligned to absolute block boundaries, each against exactly the keys up to its end, as
TorchPagedAttention._tiles does: a row's bits do not depend on chunking, a prefix-cache hit or batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ladle.model.attention import AttentionMetadata, KVCache, PrefillSpan, sdpa, window_mask
from ladle.model.layers import Linear
from ladle.model.mla import absorb_queries, latent_softmax, values_of


@dataclass
class LatentHeads:
    """One layer's map from a token's latent to every head's key (its part without RoPE) and value:
    kv_b_proj whole, for decompressing prompt chunks, and split per head, for absorbed queries."""

    kv_b: Linear  # rank -> heads * (nope + v)
    w_uk: torch.Tensor  # [heads, nope, rank]
    w_uv: torch.Tensor  # [heads, v, rank]

    @classmethod
    def of(cls, kv_b: Linear, heads: int, nope: int, v: int) -> "LatentHeads":
        per_head = kv_b.weight.view(heads, nope + v, kv_b.in_features)
        return cls(kv_b, per_head[:, :nope].contiguous(), per_head[:, nope:].contiguous())

    @property
    def heads(self) -> int:
        return self.w_uk.shape[0]

    @property
    def nope_dim(self) -> int:
        return self.w_uk.shape[1]

    @property
    def v_dim(self) -> int:
        return self.w_uv.shape[1]


class MLAPagedAttention:
    """Attention of MLA layers over a latent KVCache (one vector of rank + rope per token and layer).

    scale: what q . k is multiplied by (ladle.model.mla.softmax_scale: 1/sqrt(nope + rope), YaRN's mscale)."""

    def __init__(self, cache: KVCache, rank: int, rope_dim: int, scale: float):
        if cache.quantized:
            raise ValueError("an 8-bit KV cache (--kv-cache-dtype) is not supported for multi-head latent "
                             "attention (DeepSeek V3) yet: serve it with the compute dtype's cache")
        if cache.layer_shape(0) != (1, rank + rope_dim):
            raise ValueError(f"MLA needs a latent cache of (1, {rank + rope_dim}) per token and layer, not "
                             f"{cache.layer_shape(0)}")
        self.cache, self.rank, self.rope_dim, self.scale = cache, rank, rope_dim, scale

    def prepare(self, meta: AttentionMetadata) -> None:
        """The decodes' key masks [B, 1, max_blocks * block_size] (True: attend)."""
        if meta.backend_data is None and meta.decode_block_tables is not None:
            keys = torch.arange(meta.decode_block_tables.shape[1] * self.cache.block_size, device=self.cache.k.device)
            meta.backend_data = (keys[None, :] < meta.decode_context_lens.to(keys.device)[:, None])[:, None]

    def static_decode(self, block_tables: torch.Tensor, context_lens: torch.Tensor) -> object:
        """What CUDA graphs' decode steps would read (ladle.engine.cuda_graphs): not offered yet, so a CUDA
        start with graphs is refused by name rather than failing inside a capture."""
        raise ValueError("decode steps of multi-head latent attention (DeepSeek V3) are not captured as CUDA "
                         "graphs yet: serve it with --enforce-eager")

    def write(self, layer: int, latent: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata) -> None:
        """This step's latents [T, rank] and rotated shared keys [T, rope] into their slots, then the step's
        in-step copies (blocks other sequences compute in this step)."""
        flat = self.cache.k[layer].view(-1, self.rank + self.rope_dim)
        flat.index_copy_(0, meta.slot_mapping, torch.cat([latent, k_pe], dim=-1).to(flat.dtype))
        for src, dst, n in meta.in_step_copies:  # in order: a source may itself be a destination
            self.cache.copy_prefix(src, dst, n, layer)

    def attend(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
               heads: LatentHeads, meta: AttentionMetadata) -> torch.Tensor:
        """q_nope [T, heads, nope], q_pe [T, heads, rope] (rotated); latent, k_pe: this step's, already written.
        Returns the output projection's input [T, heads * v]."""
        out = q_nope.new_empty(q_nope.shape[0], heads.heads * heads.v_dim)
        d = meta.num_decodes
        if d:
            out[:d] = self._decode(layer, q_nope[:d], q_pe[:d], heads, meta)
        for span in meta.prefills:
            rows = slice(span.start, span.end)
            if span.canonical:
                out[rows] = self._tiles(layer, span, q_nope[rows], q_pe[rows], heads)
            else:
                out[rows] = self._decompressed(layer, span, q_nope[rows], q_pe[rows], latent[rows], k_pe[rows], heads)
        return out

    def _gather(self, layer: int, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached (latents [..., tokens, rank], shared keys [..., tokens, rope]) of the blocks in
        block_table [..., blocks], one contiguous run per table."""
        flat = block_table.flatten().to(self.cache.k.device)
        blocks = self.cache.k[layer].index_select(0, flat).to(dtype)
        run = blocks.view(*block_table.shape[:-1], -1, self.rank + self.rope_dim)
        return run.split([self.rank, self.rope_dim], dim=-1)

    def _decode(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, heads: LatentHeads,
                meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence, absorbed: scored against its cached latents, never expanded."""
        latent, k_pe = self._gather(layer, meta.decode_block_tables, q_nope.dtype)
        out = latent_softmax(absorb_queries(q_nope, heads.w_uk), q_pe, latent, k_pe, meta.backend_data, self.scale)
        return values_of(out, heads.w_uv)

    def _decompressed(self, layer: int, span: PrefillSpan, q_nope: torch.Tensor, q_pe: torch.Tensor,
                      latent: torch.Tensor, k_pe: torch.Tensor, heads: LatentHeads) -> torch.Tensor:
        """A prompt chunk: the latents it attends to (its own, or the cache's when tokens came before it)
        expanded into every head's keys and values, then SDPA."""
        n, ctx = span.end - span.start, span.context_len
        if ctx != n:
            latent, k_pe = (t[:ctx] for t in self._gather(layer, span.block_table, q_nope.dtype))
        kv = heads.kv_b(latent).view(ctx, heads.heads, heads.nope_dim + heads.v_dim)
        k_nope, v = kv.split([heads.nope_dim, heads.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, heads.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        positions = torch.arange(ctx, device=q.device)
        mask = None if ctx == n else window_mask(positions[ctx - n :], positions, None)
        o = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                 is_causal=mask is None, scale=self.scale)
        return o[0].transpose(0, 1).reshape(n, heads.heads * heads.v_dim)

    def _tiles(self, layer: int, span: PrefillSpan, q_nope: torch.Tensor, q_pe: torch.Tensor,
               heads: LatentHeads) -> torch.Tensor:
        """A canonical span, absorbed, in query tiles aligned to absolute block boundaries: a tile that starts
        mid-block (its first tokens were cached) is padded with zero queries back to the block start, and
        attends to exactly the keys up to its end, so every call's shapes are the same however the prompt
        was chunked, cached or batched."""
        bs = self.cache.block_size
        n, ctx = span.end - span.start, span.context_len
        first = ctx - n  # absolute position of the span's first query
        latent, k_pe = self._gather(layer, span.block_table, q_nope.dtype)
        out, pos = [], first
        while pos < ctx:
            start, end = pos // bs * bs, min(pos // bs * bs + bs, ctx)
            pad = (0, 0, 0, 0, pos - start, 0)
            nope = F.pad(q_nope[pos - first : end - first], pad)
            rope = F.pad(q_pe[pos - first : end - first], pad)
            positions = torch.arange(end, device=q_nope.device)
            seen = window_mask(positions[start:], positions, None)[:, None]  # [rows, 1, keys]
            tile = latent_softmax(absorb_queries(nope, heads.w_uk), rope, latent[None, :end], k_pe[None, :end], seen,
                                  self.scale)
            out.append(values_of(tile, heads.w_uv)[pos - start :])  # the padded rows too: fixed shapes
            pos = end
        return torch.cat(out)
