"""Decode steps replayed as CUDA graphs.

A decode step of a small batch launches a few hundred small kernels; from Python, launching
them costs more than running them. So at start-up each batch size of a ladder is run once and
captured (largest first, all into one memory pool); a step of B sequences then replays the
graph of the smallest captured size >= B, its padded rows neutralised (slot -1: no K/V written;
context 0: nothing attended, an output of 0). A graph reads its inputs from static buffers,
refilled before each replay by two host-to-device copies (the per-row scalars, then the block
tables' first rows), and writes its logits into a static buffer.

Only steps over generated tokens are replayed (the runner decides): decodes, and speculative
verification, whose every drafted token is a decode row of its own (its sequence's block table, a
context ending at its position), so one graph of that many rows computes it. Prefill chunks,
adapters and prompt logprobs run eagerly. The attention backend supplies the step's static
metadata (`static_decode`: its kernels' scratch preallocated, the split count fixed per size),
so numerics never depend on host values baked in at capture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladle.model.attention import AttentionMetadata

MAX_CAPTURED = 512
Replay = Callable[[], None]
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]


def capture_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, then steps of 8 to 256 and of 16 beyond (as vLLM), up to max_rows (capped at 512),
    which is always included."""
    top = min(max_rows, MAX_CAPTURED)
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, MAX_CAPTURED + 1, 16)]
    return sorted({s for s in ladder if s < top} | {top})


def padded_size(sizes: list[int], batch: int) -> int | None:
    """The smallest captured size that holds `batch` rows; None when none does."""
    return next((s for s in sizes if s >= batch), None)


@dataclass
class StaticInputs:
    """A graph's inputs: per-row scalars [4, rows] (token, position, slot, context length) and block
    tables [rows, width], int32, pinned on the host and mirrored on the device."""

    scalars: torch.Tensor  # host, pinned
    tables: torch.Tensor  # host, pinned
    scalars_dev: torch.Tensor
    tables_dev: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, width: int, device: torch.device) -> StaticInputs:
        pin = device.type == "cuda"
        scalars = torch.zeros(4, rows, dtype=torch.int32, pin_memory=pin)
        tables = torch.zeros(rows, width, dtype=torch.int32, pin_memory=pin)
        scalars[2] = -1
        return cls(scalars, tables, scalars.to(device), tables.to(device))

    @property
    def width(self) -> int:
        return self.tables.shape[1]

    def device_views(self, size: int) -> tuple[torch.Tensor, ...]:
        """tokens, positions, slots, context lengths [size] and block tables [size, width] on the device."""
        tokens, positions, slots, lens = self.scalars_dev[:, :size]
        return tokens, positions, slots, lens, self.tables_dev[:size]

    def fill(self, size: int, tokens: list[int], positions: list[int], slots: list[int],
             block_tables: list[list[int]], context_lens: list[int]) -> None:
        """Rows [0, len(tokens)) from the step, rows up to `size` padding; then copied to the device."""
        n = len(tokens)
        s = self.scalars.numpy()
        s[:, :n] = (tokens, positions, slots, context_lens)
        s[:, n:size] = ((0,), (0,), (-1,), (0,))
        t = self.tables.numpy()
        for i, table in enumerate(block_tables):  # columns past a row's length are never read
            t[i, : len(table)] = table
        self.scalars_dev.copy_(self.scalars, non_blocking=True)
        self.tables_dev[:n].copy_(self.tables[:n], non_blocking=True)


class DecodeGraphs:
    def __init__(self, model, max_rows: int, max_blocks_per_seq: int, device: torch.device,
                 capture: Capture | None = None):
        """model: a LlamaForCausalLM whose attention backend offers `static_decode`; capture: how a step
        is recorded (default: CUDA graphs; tests on the CPU pass an eager stand-in)."""
        self.model = model
        self.sizes = capture_sizes(max_rows)
        self.inputs = StaticInputs.allocate(self.sizes[-1], max_blocks_per_seq, device)
        self._capture = capture or CudaGraphCapture(device)
        self.steps: dict[int, tuple[Replay, torch.Tensor]] = {}
        self.replays = 0

    def fits(self, batch: int, blocks_per_seq: int) -> bool:
        return batch <= self.sizes[-1] and blocks_per_seq <= self.inputs.width

    def capture(self) -> None:
        """Record every size, largest first (smaller ones then reuse the pool's memory)."""
        for size in reversed(self.sizes):
            self.steps[size] = self._capture(lambda size=size: self._step(size))

    def _step(self, size: int) -> torch.Tensor:
        tokens, positions, slots, lens, tables = self.inputs.device_views(size)
        meta = AttentionMetadata(slot_mapping=slots, num_decodes=size)
        meta.backend_data = self.model.attention.static_decode(tables, lens)
        return self.model.compute_logits(self.model.forward(tokens, positions, meta))

    def replay(self, tokens: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
               context_lens: list[int]) -> torch.Tensor:
        """float32 logits [len(tokens), vocab] of one decode step (a view of the graph's output buffer,
        valid until the next replay)."""
        size = padded_size(self.sizes, len(tokens))
        self.inputs.fill(size, tokens, positions, slots, block_tables, context_lens)
        run, logits = self.steps[size]
        run()
        self.replays += 1
        return logits[: len(tokens)]


class CudaGraphCapture:
    """Records a step as a CUDA graph after one eager warm-up run (which compiles its kernels)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def __call__(self, step: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        step()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = self.pool or graph.pool()
        return graph.replay, out


def eager_capture(step: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
    """A stand-in for CUDA graphs where there are none (tests on the CPU): the same static buffers, the
    step run again on each replay into the same output tensor."""
    with torch.inference_mode():
        out = step()

    def replay() -> None:
        with torch.inference_mode():
            out.copy_(step())

    return replay, out
