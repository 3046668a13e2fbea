"""The per-token layer ops a forward calls between its matmuls, as one table chosen at start-up.

The CPU's are ladle.model.layers' functions (native kernels where they apply, else torch). On
CUDA each of them is one fused Triton kernel (ladle.model.triton.ops): torch's versions cost
several launches apiece, which a batch-1 decode step, bound by reading the weights once, cannot
afford. Both round as transformers does in reduced precision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladle.model import layers


@dataclass(frozen=True)
class LayerOps:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]  # h += a; norm(h)
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # x [T, heads, D], cos, sin
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    name: str = "torch"
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor] = layers.gelu_tanh_and_mul  # torch's on every device


TORCH_OPS = LayerOps(layers.rms_norm, layers.add_rms_norm, layers.apply_rotary, layers.silu_and_mul)


def triton_ops() -> LayerOps:
    from ladle.model.triton import ops

    return LayerOps(ops.rms_norm, ops.add_rms_norm, ops.rotary, ops.silu_and_mul, name="triton")
