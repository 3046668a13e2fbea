"""The adapters resident for compute (`--max-loras` slots), and one step's batch over them.

Every decoder layer keeps, per fused projection (qkv, o_proj, gate_up, down), the A and B^T of
all slots stacked: A [slots, parts * max_rank, in] and B^T [slots, parts * max_rank, out], each
part (q, k, v of qkv; gate, up of gate_up) in its own max_rank rows and writing only its own
output columns. A step's rows name their slot (-1: the base model), and one call per projection
adds every row's low-rank term after the base matmul ran once for all rows: the native gather
kernel (rows in any order, a row's bits independent of its batch), or in torch a loop over the
step's adapters (the baseline, and the path for other dtypes or without native kernels;
LADLE_LORA_KERNEL=loop forces it).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladle.lora.adapter import AdapterRef, AdapterWeights, projection_shapes
from ladle.model import kernels
from ladle.model.config import ModelConfig

# fused projection (as ladle.model.llama names its Linears) -> the adapter projections it holds, in column order
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
LORA_KERNELS = ("auto", "native", "loop")


def lora_kernel() -> str:
    """LADLE_LORA_KERNEL: auto (native where it runs), native, or loop (torch, one matmul pair per adapter)."""
    name = os.environ.get("LADLE_LORA_KERNEL", "auto").strip().lower() or "auto"
    if name not in LORA_KERNELS:
        raise ValueError(f"LADLE_LORA_KERNEL must be one of {LORA_KERNELS}, not {name!r}")
    return name


@dataclass
class Stack:
    a: torch.Tensor  # [slots, parts * R, in]
    bt: torch.Tensor  # [slots, parts * R, out]
    ranks: torch.Tensor  # [slots, parts] int32: rank rows in use (0: the part is not adapted)
    cols: torch.Tensor  # [parts + 1] int64: part p writes columns cols[p] .. cols[p + 1] - 1


@dataclass
class LoRABatch:
    """One step's rows over the resident adapters; `add` is what the model calls after each projection."""

    slots: torch.Tensor  # [T] int32, -1 for base-model rows
    stacks: list[dict[str, Stack]]
    rows_by_slot: dict[int, torch.Tensor]  # the loop path's row indices per slot in this step
    native: bool

    def add(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[t] += (x[t] A^T) B^T with row t's adapter, in place."""
        s = self.stacks[layer][projection]
        if self.native:
            kernels.native_kernels().lora_add(x, y, self.slots, s.a, s.bt, s.ranks, s.cols)
            return
        for slot, rows in self.rows_by_slot.items():
            y.index_add_(0, rows, (x.index_select(0, rows) @ s.a[slot].T) @ s.bt[slot])


class LoRASlots:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.num_slots, self.max_rank, self.dtype = num_slots, max_rank, dtype
        self.device = torch.device(device)
        shapes = projection_shapes(cfg)
        self.stacks = [{group: self._empty(parts, shapes) for group, parts in GROUPS.items()}
                       for _ in range(cfg.num_hidden_layers)]
        self.resident: list[AdapterRef | None] = [None] * num_slots
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self.num_writes = 0  # adapters copied into a slot

    def _empty(self, parts: tuple[str, ...], shapes: dict[str, tuple[int, int]]) -> Stack:
        d_in = shapes[parts[0]][0]
        cols = [0, *itertools.accumulate(shapes[p][1] for p in parts)]
        rows = len(parts) * self.max_rank
        return Stack(torch.zeros(self.num_slots, rows, d_in, dtype=self.dtype, device=self.device),
                     torch.zeros(self.num_slots, rows, cols[-1], dtype=self.dtype, device=self.device),
                     torch.zeros(self.num_slots, len(parts), dtype=torch.int32), torch.tensor(cols, dtype=torch.int64))

    def assign(self, refs: list[AdapterRef], weights_of: Callable[[AdapterRef], AdapterWeights]) -> dict[int, int]:
        """Slots for one step's adapters (at most num_slots distinct ones), by ref id: resident ones keep
        theirs; the others are copied into the least recently used slots this step does not need."""
        wanted = {ref.id: ref for ref in refs}
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} adapters in one step, over the {self.num_slots} slots")
        slot_of = {ref.id: i for i, ref in enumerate(self.resident) if ref is not None and ref.id in wanted}
        free = sorted((i for i in range(self.num_slots) if i not in slot_of.values()), key=self._last_used.__getitem__)
        for ref in wanted.values():
            if ref.id not in slot_of:
                slot = free.pop(0)
                self._write(slot, weights_of(ref))
                self.resident[slot] = ref
                slot_of[ref.id] = slot
        tick = next(self._clock)
        for slot in slot_of.values():
            self._last_used[slot] = tick
        return slot_of

    def _write(self, slot: int, weights: AdapterWeights) -> None:
        r = self.max_rank
        for layer, stacks in enumerate(self.stacks):
            for group, parts in GROUPS.items():
                s = stacks[group]
                s.a[slot].zero_()
                s.bt[slot].zero_()
                s.ranks[slot].zero_()
                for p, proj in enumerate(parts):
                    module = weights.modules.get((layer, proj))
                    if module is None:
                        continue
                    a, b = module
                    rank = a.shape[0]
                    s.a[slot, p * r : p * r + rank] = a
                    s.bt[slot, p * r : p * r + rank, int(s.cols[p]) : int(s.cols[p + 1])] = b.T
                    s.ranks[slot, p] = rank
        self.num_writes += 1

    def batch(self, row_slots: list[int]) -> LoRABatch | None:
        """The step's LoRABatch for these per-row slots (-1: base); None when no row has an adapter."""
        slots = torch.tensor(row_slots, dtype=torch.int32)
        active = sorted(set(row_slots) - {-1})
        if not active:
            return None
        choice = lora_kernel()
        native = (choice != "loop" and self.dtype == torch.float32 and self.device.type == "cpu"
                  and kernels.native_kernels() is not None)
        if choice == "native" and not native:
            raise RuntimeError("LADLE_LORA_KERNEL=native, but the native kernels cannot run this model's LoRA "
                               f"(dtype {self.dtype}, kernels {'on' if kernels.native_kernels() else 'off'})")
        rows = {} if native else {s: torch.nonzero(slots == s).flatten().to(self.device) for s in active}
        return LoRABatch(slots, self.stacks, rows, native)
