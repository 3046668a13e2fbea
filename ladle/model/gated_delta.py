"""Gated DeltaNet: the linear-attention layers of Qwen3.5 and Qwen3-Next, one sequence's state at a time.

Where an attention layer keeps every token's K/V, a linear-attention layer keeps a fixed-size state:
per value head a matrix S [dk, dv], and the last kernel - 1 inputs of its short causal convolution.
Each token decays S by exp(g), then writes the part of v that S does not already predict from k:

    S' = exp(g) S;  u = beta (v - S'^T k);  S = S' + k u^T;  o = S^T q

with q and k L2-normalised and q scaled by 1 / sqrt(dk). Prompts take the chunked form (a chunk's
tokens at once: the updates inside a chunk are a unit lower-triangular system, solved in one go);
decode steps take the recurrence itself. Both carry the state from one call to the next, so a
prompt computed in chunks of any size ends in the state computed whole, up to float rounding.
Everything runs in float32; the state is float32 too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens solved at once in the chunked form


@dataclass
class LinearAttentionState:
    """One sequence's state in one layer: conv [channels, kernel - 1] (the last inputs), ssm [Hv, dk, dv]."""

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def zeros(cls, channels: int, kernel: int, heads: int, dk: int, dv: int,
              device: torch.device | str = "cpu") -> "LinearAttentionState":
        return cls(torch.zeros(channels, kernel - 1, device=device),
                   torch.zeros(heads, dk, dv, device=device))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of x [T, C] with weight [C, K], continuing from state [C, K - 1] (the
    inputs before x), then SiLU. Returns (out [T, C], the next state)."""
    inputs = torch.cat([state.to(x.dtype), x.T], dim=1)  # [C, K - 1 + T]
    out = F.conv1d(inputs[None], weight[:, None, :].to(x.dtype), groups=x.shape[1])[0]
    return F.silu(out.T), inputs[:, x.shape[0] :].float()


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens: q, k [T, H, dk] (normalised and scaled), v [T, H, dv], g, beta [T, H], from
    state [H, dk, dv]. Returns (out [T, H, dv], the next state), float32."""
    q, k, v, g, beta = (x.float().transpose(0, 1) for x in (q, k, v, g, beta))  # heads first
    outs = []
    for start in range(0, q.shape[1], chunk):
        part = slice(start, start + chunk)
        out, state = _chunk(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state)
        outs.append(out)
    return torch.cat(outs, dim=1).transpose(0, 1), state


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C tokens of a chunk at once, per head ([H, C, ...]). With gamma the cumulative decay inside the
    chunk, token i's state is exp(gamma_i) S0 + sum_{j <= i} exp(gamma_i - gamma_j) k_j u_j^T, so the
    writes u solve (I + A) u = beta (v - exp(gamma) K S0), A_ij = beta_i exp(gamma_i - gamma_j) k_i . k_j
    below the diagonal."""
    n = g.shape[1]
    gamma = g.cumsum(1)  # [H, C]
    causal = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
    decay = torch.where(causal, gamma[:, :, None] - gamma[:, None, :], float("-inf")).exp()  # [H, C, C]
    system = torch.eye(n, device=g.device) + (beta[:, :, None] * decay * (k @ k.transpose(1, 2))).tril(-1)
    rhs = beta[:, :, None] * (v - gamma.exp()[:, :, None] * (k @ state))
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [H, C, dv]
    out = gamma.exp()[:, :, None] * (q @ state) + (decay * (q @ k.transpose(1, 2))) @ u
    last = gamma[:, -1:]  # [H, 1]
    state = last.exp()[:, :, None] * state + (k * (last - gamma).exp()[:, :, None]).transpose(1, 2) @ u
    return out, state


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences (decode): q, k [B, H, dk], v [B, H, dv], g, beta [B, H], states
    [B, H, dk, dv]. Returns (out [B, H, dv], the next states), float32."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = state * g.exp()[:, :, None, None]
    u = beta[:, :, None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))
    state = state + k[:, :, :, None] * u[:, :, None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


@dataclass
class GatedDeltaNetWeights:
    """A Gated DeltaNet layer's weights, as Qwen3.5 names them under linear_attn."""

    in_proj_qkv: torch.Tensor  # [2 * Hk * dk + Hv * dv, hidden]
    in_proj_z: torch.Tensor  # [Hv * dv, hidden]: the output gate
    in_proj_b: torch.Tensor  # [Hv, hidden]: beta = sigmoid(b)
    in_proj_a: torch.Tensor  # [Hv, hidden]: the decay's step
    conv: torch.Tensor  # [channels, kernel]
    dt_bias: torch.Tensor  # [Hv]
    A_log: torch.Tensor  # [Hv]
    norm: torch.Tensor  # [dv]
    out_proj: torch.Tensor  # [hidden, Hv * dv]
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    eps: float = 1e-6


def gated_delta_net(w: GatedDeltaNetWeights, x: torch.Tensor, state: LinearAttentionState) -> torch.Tensor:
    """The layer over one sequence's next tokens x [T, hidden] (a prompt's chunk, or one decode token),
    updating state in place. Returns [T, hidden] in x's dtype."""
    t = x.shape[0]
    hk, hv, dk, dv = w.key_heads, w.value_heads, w.key_dim, w.value_dim
    mixed, state.conv = causal_conv(x @ w.in_proj_qkv.T, w.conv, state.conv)
    q, k, v = mixed.float().split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = (l2_normalize(y.view(t, hk, dk)).repeat_interleave(hv // hk, dim=1) for y in (q, k))
    q = q * dk**-0.5
    beta = torch.sigmoid(x @ w.in_proj_b.T).float()
    g = -w.A_log.float().exp() * F.softplus((x @ w.in_proj_a.T).float() + w.dt_bias.float())
    out, state.ssm = gated_delta_rule(q, k, v.view(t, hv, dv), g, beta, state.ssm)
    z = (x @ w.in_proj_z.T).view(t, hv, dv)
    return _gated_norm(out.to(x.dtype), z, w.norm, w.eps).reshape(t, hv * dv) @ w.out_proj.T


def _gated_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output (rounded to x's dtype before the weight), gated by SiLU(z) in float32."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * normed.to(x.dtype)).float() * F.silu(z.float())).to(x.dtype)
