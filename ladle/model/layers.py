"""Building blocks of the Llama family: RMSNorm, rotary embedding, SwiGLU."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


# fp32 matmuls on CPU (MKL) give a row the same bits whatever else shares the call
# once a call has at least this many rows; smaller calls take other kernels.
BATCH_INVARIANT_MIN_ROWS = 16


class Linear:
    """y = x W^T + b, with W kept as `parts` column slices laid out [parts, in, out/parts].

    A batched matmul over the slices runs one slice per core. For the few rows of a
    decode step, where MKL's matrix-vector path streams weights on one core only, this
    reads them about twice as fast on two cores; for long prefills it costs nothing.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: int | None = None):
        out_features, in_features = weight.shape
        parts = parts or torch.get_num_threads()
        if parts < 1 or out_features % parts:
            parts = 1
        self.parts = parts
        self.out_features = out_features
        self.weight = weight.reshape(parts, out_features // parts, in_features).transpose(1, 2).contiguous()
        self.bias = bias

    def __call__(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        rows = x.shape[0]
        if batch_invariant and rows < BATCH_INVARIANT_MIN_ROWS:
            padded = x.new_zeros(BATCH_INVARIANT_MIN_ROWS, x.shape[1])
            padded[:rows] = x
            return self(padded)[:rows]
        if self.parts == 1:
            y = x @ self.weight[0]
        else:
            y = torch.matmul(x.unsqueeze(0), self.weight).transpose(0, 1).reshape(rows, self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(medium, blended, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # float32 throughout, as transformers computes it, so positions rotate bit-for-bit alike
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    else:
        raise ValueError(f"rope_scaling type {kind!r} is not supported yet")
    return inv_freq


class RotaryEmbedding:
    """Neox-style rotary embedding (rotate-half), as Hugging Face's Llama and Qwen2 apply it."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
