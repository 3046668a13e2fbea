"""Building blocks of the Llama family: RMSNorm, rotary embedding, SwiGLU."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ladle.model import kernels
from ladle.model.config import rope_type
from ladle.model.kernels.routing import MatmulRouting


# Without the native kernels, batch-invariant matmuls run through torch in calls of exactly
# this many rows (padded): one call shape, so the library picks one kernel. Weaker than
# the native canonical kernel, which fixes each output's reduction order by construction.
BATCH_INVARIANT_ROWS = 16


class Linear:
    """y = x W^T + b, with W kept as it comes, [out, in] and contiguous, in the model's dtype.

    Batch-invariant calls (canonical sequences) always go to the native canonical kernel:
    one fixed FMA chain per output, so a row's bits never depend on what shares the call
    (W packed into its panel layout on first use); on CUDA, to the fixed-tile Triton matmul.
    Other calls go where `routing` says, by their row count: the native small-row kernel
    (float32 decode steps), the canonical kernel, the AMX kernel (bf16 decode steps on CPUs
    with AMX), or torch (MKL, oneDNN for bf16).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.out_features, self.in_features = weight.shape
        fp32_cpu = [t.dtype == torch.float32 and t.device.type == "cpu" for t in (weight, bias) if t is not None]
        self._native_ok = all(fp32_cpu)
        self._panels: torch.Tensor | None = None  # the canonical kernel's copy of W
        self._bias32 = None if bias is None else self.bias.float()
        self.routing = MatmulRouting()

    def __call__(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        kernel = self.routing.invariant if batch_invariant else self.routing.kernel_for(x.shape[0])
        if kernel == "canonical":
            return self._canonical(x)
        if kernel == "triton":
            from ladle.model.triton.invariant_matmul import invariant_linear

            return invariant_linear(x, self.weight, self.bias)
        if kernel == "small" and self._native_ok and self._native_input(x):
            native = kernels.native_kernels()
            if native is not None:
                return native.linear(x, self.weight, self.bias)
        if kernel == "amx" and self._amx_input(x):
            return kernels.native_kernels().amx_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> None:
        """Pack W for the canonical kernel now rather than on the first call that needs it (a CPU's
        weights only: the native kernels are the CPU's)."""
        if not self.weight.is_cpu:
            return
        native = kernels.native_kernels()
        if native is not None and self._panels is None:
            self._panels = native.pack_panels(self.weight)

    @property
    def packed(self) -> torch.Tensor | None:
        """W in the canonical kernel's panel layout (None until packed or without native kernels)."""
        return self._panels

    group_size: int | None = None  # int8 weights' inputs per scale (ladle.model.quantization)

    @property
    def quantized(self) -> bool:
        """Whether W is held as int8 panels (ladle.model.quantization)."""
        return False

    def _canonical(self, x: torch.Tensor) -> torch.Tensor:
        native = kernels.native_kernels() if x.is_cpu and x.dim() == 2 and x.stride(1) == 1 else None
        if native is None:
            return self._fixed_shape(x)
        if self._panels is None:
            self.pack()
        if x.dtype == torch.bfloat16:  # widened and rounded back in the kernel: the same bits, no conversions
            return native.canonical_linear(x, self._panels, self.out_features, self._bias32)
        y = native.canonical_linear(x.float(), self._panels, self.out_features, self._bias32)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _fixed_shape(self, x: torch.Tensor) -> torch.Tensor:
        return in_fixed_chunks(x, lambda chunk: F.linear(chunk, self.weight, self.bias))

    def _amx_input(self, x: torch.Tensor) -> bool:
        # routed to `amx` only where the kernels are the AMX build (routing.py), so no second check of that
        return (x.dtype == self.weight.dtype == torch.bfloat16 and _native_operand(x) and self.weight.is_cpu
                and x.shape[1] == self.in_features and (self.bias is None or self.bias.dtype == torch.bfloat16))

    def _native_input(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and _native_operand(x) and x.shape[1] == self.in_features

    @property
    def nbytes(self) -> int:
        """Weight bytes one call reads."""
        return self.weight.numel() * self.weight.element_size()


def in_fixed_chunks(x: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """matmul over x's rows in zero-padded calls of exactly BATCH_INVARIANT_ROWS rows: one call shape
    whatever the batch, so a library that picks its kernel by shape picks the same one for every row."""
    rows, step = x.shape[0], BATCH_INVARIANT_ROWS
    padded = F.pad(x, (0, 0, 0, -rows % step))
    return torch.cat([matmul(chunk) for chunk in padded.split(step)])[:rows]


def _native_operand(x: torch.Tensor, dim: int = 2) -> bool:
    # The kernels trust their operands (raw pointers), so anything unusual goes to torch.
    return (x.dtype in (torch.float32, torch.bfloat16) and x.is_cpu and x.dim() == dim and x.is_contiguous()
            and not x.requires_grad)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Native for any number of rows, not just decode steps: a row then gets the same bits
    # whatever its batch, as batch-invariant mode needs.
    matches = weight.dtype == x.dtype and weight.shape[0] == x.shape[-1]
    if matches and _native_operand(x) and _native_operand(weight, dim=1):
        native = kernels.native_kernels()
        if native is not None:  # 2 us against F.rms_norm's 7 on a decode step's row
            return native.rms_norm(x, weight, eps)
    if x.dtype != torch.float32:
        # as transformers computes it in reduced precision: normalise in fp32, then round and scale
        # (Llama), or scale by a float32 weight and round once (Gemma, whose norms ladle keeps in fp32)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if weight.dtype == torch.float32:
            return (normed * weight).to(x.dtype)
        return weight * normed.to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual step and the next norm: h += a in place, then RMSNorm(h); the same bits as
    `h = h + a` and `rms_norm(h, ...)`, in one native pass for float32 and bfloat16."""
    if (h.dtype == a.dtype == weight.dtype and _native_operand(h) and _native_operand(a)
            and _native_operand(weight, dim=1) and h.shape == a.shape and weight.shape[0] == h.shape[1]):
        native = kernels.native_kernels()
        if native is not None:
            return native.add_rms_norm(h, a, weight, eps)
    h.add_(a)
    return rms_norm(h, weight, eps)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) (tanh approximation, transformers' gelu_pytorch_tanh) * up: Gemma's gating."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in place in gate_up's first half (rows stay gate_up's stride):
    no new [T, intermediate] tensors. float32 and bfloat16 take the native kernel (its own exp, the
    same bits for an element whatever its row count), other dtypes torch's ops."""
    if (gate_up.dtype in (torch.float32, torch.bfloat16) and gate_up.is_cpu and gate_up.dim() == 2
            and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0 and not gate_up.requires_grad):
        native = kernels.native_kernels()
        if native is not None:
            return native.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


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


def _yarn_inv_freq(head_dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: each frequency interpolated (divided by the factor) where its wavelength is long against the
    original context, kept where it is short, and blended along a linear ramp of dimensions in between."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the old context
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    span = high - low if high != low else 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    kept = 1 - ramp
    wavelengths = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # as transformers rounds each step
    return 1.0 / (factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


def _proportional_inv_freq(inv_freq: torch.Tensor, head_dim: int, s: dict[str, Any]) -> torch.Tensor:
    """Gemma 4's global layers: only the first partial_rotary_factor of each head's frequency pairs turn
    (at their usual frequencies over the whole head_dim), the rest have frequency 0 (cos 1, sin 0: left as
    they are); all divided by the factor."""
    turning = int(s.get("partial_rotary_factor", 1.0) * head_dim // 2)
    inv_freq = torch.cat((inv_freq[:turning], torch.zeros(head_dim // 2 - turning)))
    return inv_freq / s.get("factor", 1.0)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (its mscale), 1 for other RoPEs."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # float32 throughout, as transformers computes it, so positions rotate bit-for-bit alike
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(head_dim, theta, scaling)
    elif kind == "proportional":
        inv_freq = _proportional_inv_freq(inv_freq, head_dim, scaling)
    else:
        raise ValueError(f"rope_scaling type {kind!r} is not supported yet")
    return inv_freq


class RotaryEmbedding:
    """Neox-style rotary embedding (rotate-half), as Hugging Face's Llama and Qwen2 apply it."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device | str = "cpu"):
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # on the CPU, as transformers computes it, then moved
        factor = rope_attention_factor(scaling)
        self.cos = (freqs.cos() * factor).to(device)
        self.sin = (freqs.sin() * factor).to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `positions`, [T, 1, D] each: looked up once per step for all layers."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def mrope_tables(self, positions: torch.Tensor, section: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE's (Qwen2.5-VL): positions [3, T], each token's time, row and column; the first section[0]
        frequencies turn with the time, the next section[1] with the row, the rest with the column."""
        rows = torch.arange(self.cos.shape[1], device=positions.device)
        which = torch.bucketize(rows, torch.tensor(section, device=positions.device).cumsum(0), right=True)
        pick = positions[which]  # [half dims, T]: the position each frequency turns with
        cos = self.cos[pick.T, rows].unsqueeze(1)
        sin = self.sin[pick.T, rows].unsqueeze(1)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [T, heads, D] and `tables`' cos, sin.

    The sign of rotate_half lives in the table, so this is transformers' arithmetic bit
    for bit in three elementwise ops; float32 or bfloat16 heads laid out contiguously are rotated
    in place by the native kernel (the same three roundings) and x returned.
    """
    if (x.dtype == cos.dtype == sin.dtype and x.dtype in (torch.float32, torch.bfloat16) and x.is_cpu
            and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.is_contiguous()
            and sin.is_contiguous()
            and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2]) and not x.requires_grad):
        native = kernels.native_kernels()
        if native is not None:
            return native.rotary(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
