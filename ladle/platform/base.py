"""What a platform decides for the engine (ladle.platform)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from ladle.model.ops import TORCH_OPS, LayerOps, triton_ops

if TYPE_CHECKING:
    from collections.abc import Callable

    from ladle.config import EngineConfig
    from ladle.model.attention import AttentionBackend, KVCache
    from ladle.model.dtype import DtypeChoice


class Platform(ABC):
    name: str
    device: torch.device
    attention: str  # the attention backend's name: torch or triton
    default_kv_cache_gib: float | None = None  # the pool without --kv-cache-memory-gib; None: measured
    top_p_head: int | None = None  # top_p's first look at each row's likeliest tokens (sampler.outside_nucleus)

    @abstractmethod
    def check(self, config: EngineConfig) -> None:
        """Refuse, naming the flag, what this device cannot run (ValueError)."""

    @abstractmethod
    def choose_dtype(self, requested: str, quantized: bool) -> DtypeChoice:
        """What `--dtype` (auto included) computes in here, and why."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the start log: the device and its memory."""

    @property
    def kernels(self) -> str:
        """The kernels behind the model's ops, for the start log and /version."""
        return self.attention

    @property
    def nucleus_kernel(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """A kernel that finds top_p's nucleus without sorting each row (sampler.distribution); None:
        the sampler sorts."""
        return None

    @property
    def argmax_kernel(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A kernel for the greedy rows' argmax over float32 logits (sampler); None: torch's."""
        return None

    @property
    def graphs(self) -> bool:
        """Whether decode steps can replay captured graphs here."""
        return False

    @property
    def keeps_quantized_weights(self) -> bool:
        """Whether quantised checkpoints (GGUF blocks, GPTQ, AWQ) are served as they are, on their own
        kernels; else place_weights dequantises them."""
        return True

    @property
    def fp8_matmuls(self) -> bool:
        """Whether FP8 matmuls run on fp8 hardware here (an FP8 checkpoint then stays FP8 under auto)."""
        return False

    def place_weights(self, weights: dict, dtype: torch.dtype) -> dict:
        """The checkpoint's tensors where this platform computes with them."""
        return weights

    def kv_cache_blocks(self, profile: Callable[[], None], config: EngineConfig, vocab_size: int,
                        bytes_per_block: int) -> int:
        """The KV pool's size when no flag fixes it, with the model built and no pool yet; profile()
        runs a forward at the largest step the scheduler can make."""
        raise NotImplementedError(f"{self.name} sizes its KV pool from --kv-cache-memory-gib")

    def attention_backend(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int,
                          windows: tuple[int | None, ...] = (), scale: float | None = None) -> AttentionBackend:
        """windows: each layer's sliding window (ModelConfig.layer_windows); scale: q . k's factor
        (ModelConfig.attention_scale)."""
        if self.attention == "triton":
            from ladle.model.triton.backend import TritonPagedAttention

            return TritonPagedAttention(cache, num_heads, num_kv_heads, head_dim, windows, scale)
        from ladle.model.attention import TorchPagedAttention

        return TorchPagedAttention(cache, num_heads, num_kv_heads, head_dim, windows, scale)

    def layer_ops(self) -> LayerOps:
        return triton_ops() if self.attention == "triton" else TORCH_OPS

    def generator(self, seed: int) -> torch.Generator:
        """A seeded generator for a request's own draws, on this device."""
        return torch.Generator(device=self.device).manual_seed(seed)
