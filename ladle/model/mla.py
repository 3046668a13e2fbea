"""Multi-head latent attention (MLA), DeepSeek V2/V3's: every head's keys and values come from one
compressed vector per token, so the cache holds that latent (kv_lora_rank numbers, normed) and one
shared rotary key (qk_rope_head_dim numbers) per token instead of 2 x heads x head_dim.

A head's key is [W_UK_h c ; k_pe] and its value W_UV_h c (kv_b_proj holds W_UK and W_UV). Attention
never expands them: q_nope . W_UK_h c = (W_UK_h^T q_nope) . c, so each query is absorbed into the
latent space once, scores are taken against the cached latents directly, and the weighted sum of
latents is mapped through W_UV_h after the softmax (DeepSeek's "weight absorption").

DeepSeek lays its rotary dimensions out in interleaved pairs (rope_interleave): they are rotated pair
by pair and written out as halves, the same permutation for queries and keys, so dot products are
those of the interleaved layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class MLAWeights:
    """One layer's MLA weights, as DeepSeek V3 names them under self_attn."""

    q_a: torch.Tensor | None  # q_a_proj [q_lora_rank, hidden]; None where q_proj maps the hidden state directly
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: torch.Tensor  # q_b_proj (or q_proj) [heads * (nope + rope), q_lora_rank or hidden]
    kv_a: torch.Tensor  # kv_a_proj_with_mqa [kv_lora_rank + rope, hidden]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [heads * (nope + v), kv_lora_rank]
    o_proj: torch.Tensor  # [hidden, heads * v]
    heads: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    eps: float = 1e-6
    interleaved: bool = True

    @property
    def rank(self) -> int:
        return self.kv_a_norm.shape[0]

    def absorb(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, rank], W_UV [heads, v, rank]) out of kv_b."""
        per_head = self.kv_b.view(self.heads, self.nope_dim + self.v_dim, self.rank)
        return per_head[:, : self.nope_dim], per_head[:, self.nope_dim :]


def softmax_scale(head_dim: int, rope_scaling: dict | None) -> float:
    """1 / sqrt(nope + rope), times YaRN's mscale squared where the config asks (mscale_all_dim)."""
    scale = head_dim**-0.5
    scaling = rope_scaling or {}
    factor, mscale_all_dim = scaling.get("factor", 1.0), scaling.get("mscale_all_dim", 0)
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE on x [T, ..., rope] with cos/sin [T, rope] (each frequency's angle twice, halves layout)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    half = x.shape[-1] // 2
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., :half], sin[..., :half]
        return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def latent_kv(w: MLAWeights, x: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a token leaves in the cache: its normed latent [T, rank] and its rotated shared key [T, rope]."""
    latent, k_pe = (x @ w.kv_a.T).split([w.rank, w.rope_dim], dim=-1)
    return _rms_norm(latent, w.kv_a_norm, w.eps), rotate(k_pe, cos, sin, w.interleaved)


def queries(w: MLAWeights, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_nope [T, heads, nope], rotated q_pe [T, heads, rope])."""
    if w.q_a is not None:
        x = _rms_norm(x @ w.q_a.T, w.q_a_norm, w.eps)
    q = (x @ w.q_b.T).view(x.shape[0], w.heads, w.nope_dim + w.rope_dim)
    q_nope, q_pe = q.split([w.nope_dim, w.rope_dim], dim=-1)
    return q_nope, rotate(q_pe, cos, sin, w.interleaved)


def latent_attention(w: MLAWeights, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                     k_pe: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries [T, heads, ...] over cached latents [L, rank] and shared keys [L, rope]; visible [T, L]:
    which keys each query sees. Returns the output projection's input [T, heads * v]."""
    w_uk, w_uv = w.absorb()
    out_latent = latent_softmax(absorb_queries(q_nope, w_uk), q_pe, latent[None], k_pe[None], visible[:, None], scale)
    return values_of(out_latent, w_uv)


def absorb_queries(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, heads, nope] into the latent space: W_UK_h^T q_nope per head, [T, heads, rank]."""
    return torch.einsum("thn,hnr->thr", q_nope, w_uk)


def values_of(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The heads' weighted sums of latents [T, heads, rank] through W_UV: [T, heads * v]."""
    return torch.einsum("thr,hvr->thv", out_latent, w_uv).flatten(1)


def latent_softmax(q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                   visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed queries [G, M, rank] and rotated ones [G, M, rope] over latents [G, L, rank] and shared keys
    [G, L, rope] (G broadcast: a decode's own cache, or one sequence's for its M = rows x heads); visible
    [G, M, L] (broadcast) where a query sees a key. The softmax-weighted sum of the latents, [G, M, rank]:
    scores in the latent space, the softmax in float32, as transformers takes it."""
    scores = (q_latent @ latent.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)) * scale
    probs = scores.float().masked_fill(~visible, float("-inf")).softmax(-1).to(latent.dtype)
    return probs @ latent


LatentCache = tuple[torch.Tensor, torch.Tensor]  # (latents [L, rank], shared rotary keys [L, rope])


def mla(w: MLAWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float,
        cache: LatentCache | None = None) -> tuple[torch.Tensor, LatentCache]:
    """A sequence's next tokens x [T, hidden] (cos/sin at their positions) after the cached (latents,
    shared keys) of the tokens before them. Returns (the layer's output [T, hidden], the grown cache)."""
    latent, k_pe = latent_kv(w, x, cos, sin)
    if cache is not None:
        latent, k_pe = torch.cat([cache[0], latent]), torch.cat([cache[1], k_pe])
    t, past = x.shape[0], latent.shape[0] - x.shape[0]
    visible = torch.arange(latent.shape[0])[None, :] <= torch.arange(past, past + t)[:, None]
    out = latent_attention(w, *queries(w, x, cos, sin), latent, k_pe, visible, scale)
    return out @ w.o_proj.T, (latent, k_pe)
