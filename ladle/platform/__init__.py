"""Where the engine computes: a platform, chosen once at start-up (`--device auto|cpu|cuda`).

A platform says where tensors live, what `--dtype auto` means there, which attention backend
and layer ops the model gets, how the KV pool is sized, and whether decode steps replay CUDA
graphs. The engine asks it; nothing else in the engine branches on the device.
"""

from __future__ import annotations

import logging

from ladle.platform.base import Platform
from ladle.platform.cpu import CpuPlatform

log = logging.getLogger("ladle")

__all__ = ["CpuPlatform", "Platform", "cuda_probe", "resolve_platform"]


def cuda_probe() -> tuple[bool, str]:
    """(usable, why): whether this process can compute on an NVIDIA GPU, and the reason either way."""
    import torch

    if torch.version.cuda is None:
        return False, f"this torch build has no CUDA (torch {torch.__version__})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA GPU"
    return True, f"torch {torch.__version__} sees {torch.cuda.device_count()} CUDA GPU(s)"


def resolve_platform(device: str = "auto", attention_backend: str = "auto") -> Platform:
    """The platform for `--device` (auto: CUDA when torch sees a GPU) and `--attention-backend`."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, not {device!r}")
    if device == "cpu":
        return CpuPlatform(attention_backend)
    usable, why = cuda_probe()
    if device == "cuda" and not usable:
        raise ValueError(f"--device cuda: {why}")
    if not usable:
        log.info("device auto: cpu (%s)", why)
        return CpuPlatform(attention_backend)
    from ladle.platform.cuda import CudaPlatform

    log.info("device %s: cuda (%s)", device, why)
    return CudaPlatform(attention_backend)
