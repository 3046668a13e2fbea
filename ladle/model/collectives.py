"""The collectives a sharded forward calls, over torch.distributed (gloo on CPU, NCCL on CUDA).

One process computes the whole model with `Single`, whose collectives do nothing. Partial
sums are reduced in float32 whatever the compute dtype, and, for batch-invariant steps on
more than two ranks, in rank order: two ranks' a + b is the same either way round, but a
ring's summation order over three or more depends on the tensor's size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class CommStats:
    calls: int = 0
    seconds: float = 0.0  # time inside collectives (waiting for the slowest rank included)
    bytes: int = 0  # payload this rank contributed


class Single:
    """One process: the whole model, nothing to exchange."""

    rank, world = 0, 1
    stats = CommStats()

    def all_reduce(self, x: torch.Tensor, ordered: bool = False) -> torch.Tensor:
        return x

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return x

    def all_to_all_rows(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return x


class ProcessGroupComm:
    """A torch.distributed process group's collectives (ProcessGroupGloo, say); every rank calls
    them in the same order."""

    def __init__(self, group: object) -> None:
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        self.stats = CommStats()

    def _timed(self, started: float, nbytes: int) -> None:
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - started
        self.stats.bytes += nbytes

    def all_reduce(self, x: torch.Tensor, ordered: bool = False) -> torch.Tensor:
        """The sum of every rank's x (same shape on all), in x's dtype."""
        started = time.perf_counter()
        y = x.float().contiguous()
        if ordered and self.world > 2:
            parts = [torch.empty_like(y) for _ in range(self.world)]
            self.group.allgather([parts], [y]).wait()
            y = parts[0]
            for p in parts[1:]:
                y = y + p
        else:
            self.group.allreduce([y]).wait()
        self._timed(started, y.numel() * 4)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's x stacked by rank, rank r's having counts[r] rows (padded to the most for the exchange)."""
        started = time.perf_counter()
        padded = x.new_zeros(max(counts), *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        self.group.allgather([parts], [padded]).wait()
        self._timed(started, padded.numel() * padded.element_size())
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    def all_to_all_rows(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of x sent in runs: send[r] rows (in order) to rank r; returns the recv[r] rows from each r."""
        started = time.perf_counter()
        out = x.new_empty(sum(recv), *x.shape[1:])
        self.group.alltoall_base(out, x.contiguous(), recv, send).wait()
        self._timed(started, x.numel() * x.element_size())
        return out
