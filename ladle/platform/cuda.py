"""An NVIDIA GPU: bf16, Triton paged attention and layer ops, a profiled KV pool, decode graphs."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ladle.platform.base import Platform
from ladle.platform.memory import KVBudget, graph_reserve, sampler_reserve

if TYPE_CHECKING:
    from collections.abc import Callable

    from ladle.config import EngineConfig
    from ladle.model.dtype import DtypeChoice

log = logging.getLogger("ladle")


def unsupported_on_cuda(config: EngineConfig) -> list[str]:
    """The flags of `config` the CUDA path refuses, each with why."""
    spec = config.speculative_config
    refused = {
        "--tensor-parallel-size above 1 (its ranks are gloo processes on the CPU)": config.tensor_parallel_size > 1,
        "--quantization int8 (its kernels are the CPU's integer dot products; serve the float weights)":
            config.quantization == "int8",
        "--kv-transfer-config (the K/V handoff between engines is built for CPU pools)":
            config.kv_transfer_config is not None,
        '--speculative-config with "method": "draft_model" (its second KV pool is not sized on the GPU yet; '
        "ngram and early_exit run)": spec is not None and spec.method == "draft_model",
    }
    return [what for what, on in refused.items() if on]


FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89), Hopper and later


def fp8_refusal(config: EngineConfig, gpu: str, capability: tuple[int, int]) -> list[str]:
    """--quantization fp8 where the GPU has no FP8 tensor cores (before sm_89: Ada, Hopper)."""
    if config.quantization != "fp8" or capability >= FP8_CAPABILITY:
        return []
    return [f"--quantization fp8 on {gpu} (sm_{capability[0]}{capability[1]}: FP8 matmuls need sm_89 or later)"]


class CudaPlatform(Platform):
    name = "cuda"

    def __init__(self, attention_backend: str = "auto"):
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.attention = "triton" if attention_backend == "auto" else attention_backend
        props = torch.cuda.get_device_properties(self.device)
        self.gpu_name, self.total_memory = props.name, props.total_memory
        self.capability, self.num_sms = (props.major, props.minor), props.multi_processor_count

    def check(self, config: EngineConfig) -> None:
        refused = unsupported_on_cuda(config) + fp8_refusal(config, self.gpu_name, self.capability)
        if refused:
            raise ValueError(f"--device cuda does not run {'; '.join(refused)}")

    def choose_dtype(self, requested: str, quantized: bool) -> DtypeChoice:
        from ladle.model.dtype import DtypeChoice, canonical_name

        name = canonical_name(requested)
        if name != "auto":
            return DtypeChoice(name, "requested")
        if self.capability >= (8, 0):
            return DtypeChoice("bfloat16", f"auto: sm_{self.capability[0]}{self.capability[1]} computes bf16")
        return DtypeChoice("float16", f"auto: sm_{self.capability[0]}{self.capability[1]} has no bf16")

    @property
    def kernels(self) -> str:
        return f"{self.attention} attention on {self.gpu_name}"

    @property
    def graphs(self) -> bool:
        return self.attention == "triton"  # the torch backend builds per-step masks on the host

    @property
    def keeps_quantized_weights(self) -> bool:
        return False

    @property
    def fp8_matmuls(self) -> bool:
        return self.capability >= FP8_CAPABILITY

    def describe(self) -> str:
        return (f"cuda:{self.device.index} ({self.gpu_name}, {self.total_memory / 2**30:.0f} GiB, "
                f"sm_{self.capability[0]}{self.capability[1]}, {self.num_sms} SMs)")

    def place_weights(self, weights: dict, dtype: torch.dtype) -> dict:
        """Every tensor on the GPU; quantised layers (GGUF blocks, GPTQ, AWQ) dequantised to dtype, an FP8
        checkpoint's kept (Fp8Weights)."""
        from ladle.model.quantization import GroupedWeight

        placed = {}
        for name in list(weights):
            w = weights.pop(name)  # one host copy at a time
            if isinstance(w, GroupedWeight):
                w = w.dequantize(dtype)
            placed[name] = w.to(self.device, non_blocking=True)
        torch.cuda.synchronize(self.device)
        return placed

    def kv_cache_blocks(self, profile: Callable[[], None], config: EngineConfig, vocab_size: int,
                        bytes_per_block: int) -> int:
        budget = self.measure(profile, config, vocab_size)
        blocks = budget.num_blocks(bytes_per_block)
        log.info("KV pool from --gpu-memory-utilization: %s", budget.describe())
        return blocks

    def measure(self, profile: Callable[[], None], config: EngineConfig, vocab_size: int) -> KVBudget:
        """The activations' peak over one profiled forward, then what is in use: the pool's budget."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        profile()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        graphs = 0 if config.enforce_eager else graph_reserve(config.max_num_seqs, config.decode_graph_rows, vocab_size)
        reserve = sampler_reserve(config.max_num_seqs, vocab_size) + graphs
        return KVBudget(total, config.gpu_memory_utilization, total - free, peak, reserve)
