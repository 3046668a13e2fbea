"""The CPU: native kernels chosen by instruction set, torch's paged attention, a pool of fixed size."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from ladle.config import CPU_KV_CACHE_GIB
from ladle.platform.base import Platform

if TYPE_CHECKING:
    from collections.abc import Callable

    from ladle.config import EngineConfig
    from ladle.model.dtype import DtypeChoice

log = logging.getLogger("ladle")


class CpuPlatform(Platform):
    name = "cpu"
    device = torch.device("cpu")
    default_kv_cache_gib = CPU_KV_CACHE_GIB
    top_p_head = 1024  # without the native kernels: sorting a whole vocabulary row takes the CPU ms

    def __init__(self, attention_backend: str = "auto"):
        self.attention = "torch" if attention_backend == "auto" else attention_backend
        if self.attention == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--attention-backend triton needs a CUDA GPU (on the CPU its kernels run only under "
                             "Triton's interpreter, TRITON_INTERPRET=1: for tests)")

    def check(self, config: EngineConfig) -> None:
        if config.quantization == "fp8":
            log.warning("--quantization fp8 on the CPU: torch multiplies e4m3 without fp8 hardware, tens of times "
                        "slower than float32 (a correctness path); --quantization int8 is the CPU's fast one")

    def choose_dtype(self, requested: str, quantized: bool) -> DtypeChoice:
        from ladle.model.dtype import choose_dtype

        return choose_dtype(requested, quantized=quantized)

    @property
    def kernels(self) -> str:
        if self.attention == "triton":
            return "triton (interpreted on the CPU)"
        native = self._native()
        return native.isa if native is not None else "torch"

    @property
    def nucleus_kernel(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        native = self._native()
        return native.keep_nucleus if native is not None else None

    @property
    def argmax_kernel(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        native = self._native()
        return native.argmax if native is not None else None  # torch's argmax: a scalar loop, 8x slower

    @staticmethod
    def _native():
        from ladle.model import kernels

        return kernels.native_kernels()

    def describe(self) -> str:
        return f"cpu ({os.cpu_count()} cores)"
