"""How much of a GPU the KV pool gets (`--gpu-memory-utilization`, with vLLM's meaning).

The engine may use `utilization` of the GPU's whole memory. What is in use once the weights are
loaded (by this process or any other: weights, the CUDA context, library workspaces), the peak
a profiled forward at the largest step adds on top, and a reserve for what comes after the
profile (the sampler's [max_num_seqs, vocab] float32 temporaries, the captured graphs' buffers)
are taken off; the KV pool gets the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
GRAPH_RESERVE = 256 * 2**20  # the decode graphs' static buffers and their shared pool's activations
SAMPLER_COPIES = 4  # [rows, vocab] float32 tensors the sampler holds at once (logits, probs, noise, a sort)


@dataclass(frozen=True)
class KVBudget:
    total: int  # the GPU's memory
    utilization: float
    in_use: int  # everything allocated on the GPU after loading the weights (by anyone)
    activation_peak: int  # what the profiled forward added at its peak
    reserve: int

    @property
    def kv_bytes(self) -> int:
        return int(self.total * self.utilization) - self.in_use - self.activation_peak - self.reserve

    def num_blocks(self, bytes_per_block: int) -> int:
        """Blocks of the pool; ValueError, with the figures, when nothing is left for one."""
        blocks = self.kv_bytes // bytes_per_block
        if blocks < 1:
            raise ValueError(f"--gpu-memory-utilization {self.utilization} leaves no room for the KV cache: "
                             f"{self.describe()}; raise it, or set --kv-cache-memory-gib")
        return blocks

    def describe(self) -> str:
        return (f"{self.utilization:.2f} of {self.total / GIB:.1f} GiB, less {self.in_use / GIB:.2f} GiB in use, "
                f"{self.activation_peak / GIB:.2f} GiB of activations at the profiled peak and "
                f"{self.reserve / GIB:.2f} GiB reserved: {max(0, self.kv_bytes) / GIB:.2f} GiB for KV")


def sampler_reserve(max_num_seqs: int, vocab_size: int) -> int:
    return SAMPLER_COPIES * max_num_seqs * vocab_size * 4


def graph_reserve(max_num_seqs: int, graph_rows: int, vocab_size: int) -> int:
    """GRAPH_RESERVE, and the float32 logits of the verification graphs' rows beyond max_num_seqs."""
    return GRAPH_RESERVE + 4 * (graph_rows - max_num_seqs) * vocab_size
