"""Gated DeltaNet layers inside the packed batch: each sequence's recurrent state lives in a slot of a
state pool, beside the paged K/V of the full-attention layers.

The engine gives every running sequence a slot, and keeps other slots as snapshots: the state at a
block boundary of a cached prefix, so a prefix hit resumes the recurrence where the hit ends. A
step's StateMetadata says which slot each row's sequence uses, where it starts (from zeros, from a
snapshot, or where it left off), and after which rows to copy its state into a snapshot.

A prompt is computed in pieces that end on absolute block boundaries (the chunked delta rule, one
piece at a time), so the state at each boundary exists to snapshot, and a sequence resumed from a
snapshot computes its remaining pieces exactly as it would have cold: bit for bit the same, which
canonical scoring needs. The short convolution is a sum of shifted products, each row's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ladle.model.config import HybridConfig
from ladle.model.gated_delta import CHUNK, _chunk, _gated_norm, gated_delta_step, l2_normalize
from ladle.model.layers import Linear


@dataclass
class SpanStates:
    """The state side of one prefill span (ladle.model.attention.PrefillSpan, same order)."""

    slot: int
    start: int  # the absolute position of the span's first row
    fresh: bool = False  # the span starts the sequence: its state starts from zeros
    restore: int | None = None  # copy this snapshot slot into the sequence's slot first (a prefix hit)
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (rows into the span, snapshot slot)


@dataclass
class StateMetadata:
    """Which state slot each sequence of a step reads and writes."""

    decode_slots: torch.Tensor  # int64 [num_decodes]
    spans: list[SpanStates] = field(default_factory=list)
    decode_snapshots: list[tuple[int, int]] = field(default_factory=list)  # (decode row, snapshot slot)
    decode_fresh: list[int] = field(default_factory=list)  # decode rows that start their sequence
    decode_restores: list[tuple[int, int]] = field(default_factory=list)  # (snapshot slot, decode row's slot)


class LinearStatePool:
    """Every slot's state in every linear layer, float32: conv [layers, slots, channels, kernel - 1]
    (the convolution's last inputs) and ssm [layers, slots, value heads, key dim, value dim]."""

    def __init__(self, hybrid: HybridConfig, num_slots: int, block_size: int, device: torch.device | str = "cpu"):
        """block_size: the paged cache's; prompts are computed in pieces that end on its boundaries."""
        layers, h = len(hybrid.linear_layers), hybrid
        self.num_slots, self.block_size = num_slots, block_size
        self.conv = torch.zeros(layers, num_slots, h.conv_channels, h.conv_kernel - 1, device=device)
        self.ssm = torch.zeros(layers, num_slots, h.value_heads, h.key_dim, h.value_dim, device=device)

    def begin_step(self, meta: StateMetadata) -> None:
        """Before any layer: zero the slots of sequences that start now, restore those resuming from a
        snapshot (every layer's state at once)."""
        fresh = [s.slot for s in meta.spans if s.fresh] + [int(meta.decode_slots[r]) for r in meta.decode_fresh]
        restores = [(s.restore, s.slot) for s in meta.spans if s.restore is not None] + meta.decode_restores
        if fresh:
            index = torch.tensor(fresh, device=self.conv.device)
            self.conv[:, index] = 0
            self.ssm[:, index] = 0
        for src, dst in restores:
            self.conv[:, dst] = self.conv[:, src]
            self.ssm[:, dst] = self.ssm[:, src]


@dataclass
class LinearAttentionLayer:
    """One Gated DeltaNet layer's weights and its index among the linear layers (its row of the pool)."""

    qkv: Linear  # hidden -> q, k, v (the convolution's channels)
    z: Linear  # hidden -> the output gate, per value head
    ba: Linear  # hidden -> beta's and the decay step's logits, per value head
    conv: torch.Tensor  # float32 [channels, kernel]
    dt_bias: torch.Tensor  # float32 [value heads]
    A: torch.Tensor  # float32 [value heads]: exp(A_log)
    norm: torch.Tensor  # [value dim]
    out: Linear
    index: int
    shape: HybridConfig
    eps: float

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.qkv, self.z, self.ba, self.out)

    def __call__(self, x: torch.Tensor, meta: StateMetadata, rows: list[tuple[int, int]], pool: LinearStatePool,
                 inv: bool) -> torch.Tensor:
        """The layer's output [T, hidden] for normed inputs x [T, hidden]: rows [0, len(decode_slots)) are
        decodes, rows[i] = (start, end) the rows of meta.spans[i]."""
        h = self.shape
        t, hv = x.shape[0], h.value_heads
        mixed = self.qkv(x, inv).float()
        gates = self.ba(x, inv).float()
        beta, steps = torch.sigmoid(gates[:, :hv]), gates[:, hv:] + self.dt_bias
        out = torch.empty(t, hv, h.value_dim, device=x.device)
        num_decodes = meta.decode_slots.shape[0]
        if num_decodes:
            out[:num_decodes] = self._decode(mixed[:num_decodes], self._decay(steps[:num_decodes]),
                                             beta[:num_decodes], meta, pool)
        step = math.gcd(pool.block_size, CHUNK)  # pieces end on every block boundary
        for span, (start, end) in zip(meta.spans, rows):
            out[start:end] = self._prefill(mixed[start:end], steps[start:end], beta[start:end], span, pool, step)
        z = self.z(x, inv).view(t, hv, h.value_dim)
        normed = _gated_norm(out.to(x.dtype), z, self.norm, self.eps)
        return self.out(normed.reshape(t, hv * h.value_dim), inv)

    def _decay(self, steps: torch.Tensor) -> torch.Tensor:
        """g, the log of each token's decay, from its step logits (with dt_bias added)."""
        return -self.A * F.softplus(steps)

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (normalised, scaled), k (normalised) [T, Hv, dk] and v [T, Hv, dv] out of the convolved channels."""
        h = self.shape
        t, hk, dk = mixed.shape[0], h.key_heads, h.key_dim
        q, k, v = mixed.split([hk * dk, hk * dk, h.value_heads * h.value_dim], dim=-1)
        q, k = (l2_normalize(y.reshape(t, hk, dk)).repeat_interleave(h.value_heads // hk, dim=1) for y in (q, k))
        return q * dk**-0.5, k, v.reshape(t, h.value_heads, h.value_dim)

    def _prefill(self, mixed: torch.Tensor, steps: torch.Tensor, beta: torch.Tensor, span: SpanStates,
                 pool: LinearStatePool, step: int) -> torch.Tensor:
        """One sequence's span: the convolution over it, then the delta rule piece by piece from its slot's
        state, copying the state into the snapshot slots after the rows they name. The decay is taken piece
        by piece too: torch's softplus rounds a tensor's last few elements apart from the others, so a row's
        bits would depend on where the step's tensor ends."""
        i, slot = self.index, span.slot
        inputs = torch.cat([pool.conv[i, slot], mixed.T], dim=1)  # [C, K - 1 + T]
        convolved = _shifted_conv(inputs, self.conv)
        pool.conv[i, slot] = inputs[:, mixed.shape[0] :]
        q, k, v = self._qkv(convolved)
        snapshots = dict(span.snapshots)
        state = pool.ssm[i, slot]
        outs, done = [], 0
        while done < mixed.shape[0]:
            n = min(step - (span.start + done) % step, mixed.shape[0] - done)
            part = slice(done, done + n)
            g = self._decay(steps[part])
            o, state = _chunk(*(y.transpose(0, 1) for y in (q[part], k[part], v[part], g, beta[part])), state)
            outs.append(o.transpose(0, 1))
            done += n
            if done in snapshots:
                pool.ssm[i, snapshots[done]] = state
                pool.conv[i, snapshots[done]] = inputs[:, done : done + self.conv.shape[1] - 1]
        pool.ssm[i, slot] = state
        return torch.cat(outs)

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: StateMetadata,
                pool: LinearStatePool) -> torch.Tensor:
        """One token of each decoding sequence, their states gathered from and written back to their slots."""
        i, slots = self.index, meta.decode_slots
        inputs = torch.cat([pool.conv[i, slots], mixed[:, :, None]], dim=2)  # [B, C, K]
        pool.conv[i, slots] = inputs[:, :, 1:]
        convolved = F.silu((inputs * self.conv).sum(-1))
        q, k, v = self._qkv(convolved)
        out, pool.ssm[i, slots] = gated_delta_step(q, k, v, g, beta, pool.ssm[i, slots])
        for row, snapshot in meta.decode_snapshots:
            pool.conv[i, snapshot] = pool.conv[i, slots[row]]
            pool.ssm[i, snapshot] = pool.ssm[i, slots[row]]
        return out


def _shifted_conv(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of inputs [C, K - 1 + T] (the state, then T rows) with
    weight [C, K]: [T, C], each output a sum of K products in a fixed order, whatever T is."""
    kernel, t = weight.shape[1], inputs.shape[1] - weight.shape[1] + 1
    acc = inputs[:, :t] * weight[:, :1]
    for j in range(1, kernel):
        acc = acc + inputs[:, j : j + t] * weight[:, j : j + 1]
    return F.silu(acc.T)


def load_linear_attention(w: dict[str, torch.Tensor], layer: int, index: int, h: HybridConfig, eps: float,
                          linear) -> LinearAttentionLayer:
    """Layer `layer`'s Gated DeltaNet weights, taken out of w (Qwen3.5's names, or Qwen3-Next's fused
    projections regrouped into them)."""
    p = f"model.layers.{layer}.linear_attn."
    if h.fused_projections:
        qkv, z, b, a = _ungroup(w.pop(p + "in_proj_qkvz.weight"), w.pop(p + "in_proj_ba.weight"), h)
    else:
        qkv, z = w.pop(p + "in_proj_qkv.weight"), w.pop(p + "in_proj_z.weight")
        b, a = w.pop(p + "in_proj_b.weight"), w.pop(p + "in_proj_a.weight")
    conv = w.pop(p + "conv1d.weight")
    return LinearAttentionLayer(
        qkv=linear(qkv, None), z=linear(z, None), ba=linear(torch.cat([b, a]), None),
        conv=conv.reshape(conv.shape[0], -1).float(), dt_bias=w.pop(p + "dt_bias").float(),
        A=w.pop(p + "A_log").float().exp(), norm=w.pop(p + "norm.weight"), out=linear(w.pop(p + "out_proj.weight"), None),
        index=index, shape=h, eps=eps)


def _ungroup(qkvz: torch.Tensor, ba: torch.Tensor, h: HybridConfig) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next's projections hold, per key head, its q, k, then its value heads' v and z (and b then a):
    regrouped as all q, all k, all v (the convolution's channel order), z, b and a."""
    hk, r = h.key_heads, h.value_heads // h.key_heads
    grouped = qkvz.view(hk, -1, qkvz.shape[-1])
    q, k, v, z = grouped.split([h.key_dim, h.key_dim, r * h.value_dim, r * h.value_dim], dim=1)
    b, a = ba.view(hk, 2 * r, ba.shape[-1]).split([r, r], dim=1)
    flat = [y.reshape(-1, qkvz.shape[-1]) for y in (q, k, v, z, b, a)]
    return torch.cat(flat[:3]), flat[3], flat[4], flat[5]
