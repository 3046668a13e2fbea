"""The adapters a server serves, by name, and which of them stay loaded in memory.

Names are registered at start (`--lora-modules`) or at run time (load/unload routes). At
most `max_cpu_loras` adapters keep their weights in memory; the least recently used beyond
that are paged out and read from their folder again when a request needs them; adapters of
requests in flight are pinned (kept, even beyond max_cpu_loras). Thread-safe:
the server registers and lists, the engine thread reads weights.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from ladle.lora.adapter import AdapterError, AdapterNameError, AdapterRef, AdapterWeights, load_adapter
from ladle.model.config import ModelConfig


class LoRARegistry:
    def __init__(self, cfg: ModelConfig, max_rank: int, max_cpu_loras: int):
        self.cfg = cfg
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._lock = threading.Lock()
        self._by_name: dict[str, AdapterRef] = {}
        self._loaded: OrderedDict[int, AdapterWeights] = OrderedDict()  # ref id -> weights, least recent first
        self._pins: dict[int, int] = {}  # ref id -> requests in flight on it
        self.num_loads = 0  # reads from disk, paging in included

    def add(self, name: str, path: str | Path) -> AdapterRef:
        """Read, check and register an adapter; raises AdapterError (a bad folder, a name in use)."""
        if not name or not name.strip():
            raise AdapterNameError("an adapter needs a name")
        with self._lock:
            if name in self._by_name:
                raise AdapterNameError(f"an adapter named {name!r} is already loaded")
        ref, weights = load_adapter(name, path, self.cfg, self.max_rank)
        with self._lock:
            if name in self._by_name:  # registered meanwhile
                raise AdapterNameError(f"an adapter named {name!r} is already loaded")
            self._by_name[name] = ref
            self._keep(ref, weights)
            self.num_loads += 1
        return ref

    def remove(self, name: str) -> AdapterRef | None:
        """Unregister; requests already accepted on it still finish with it."""
        with self._lock:
            return self._by_name.pop(name, None)

    def get(self, name: str) -> AdapterRef | None:
        with self._lock:
            return self._by_name.get(name)

    def refs(self) -> list[AdapterRef]:
        with self._lock:
            return list(self._by_name.values())

    def weights(self, ref: AdapterRef) -> AdapterWeights:
        """ref's weights, read again from its folder if they were paged out."""
        with self._lock:
            weights = self._loaded.get(ref.id)
            if weights is not None:
                self._loaded.move_to_end(ref.id)
                return weights
        try:
            _, weights = load_adapter(ref.name, ref.path, self.cfg, self.max_rank)
        except AdapterError as e:
            raise AdapterError(f"adapter {ref.name!r} could not be paged in again: {e}") from None
        with self._lock:
            self._keep(ref, weights)
            self.num_loads += 1
        return weights

    def pin(self, ref: AdapterRef) -> None:
        """Keep ref's weights in memory until as many `unpin`s; reads them again if they were paged out.
        Raises AdapterError (pinning nothing) when they cannot be read."""
        with self._lock:
            self._pins[ref.id] = self._pins.get(ref.id, 0) + 1
        try:
            self.weights(ref)
        except AdapterError:
            self.unpin(ref)
            raise

    def unpin(self, ref: AdapterRef) -> None:
        with self._lock:
            left = self._pins.get(ref.id, 0) - 1
            if left > 0:
                self._pins[ref.id] = left
            else:
                self._pins.pop(ref.id, None)
                self._page_out()

    def num_in_memory(self) -> int:
        with self._lock:
            return len(self._loaded)

    def _keep(self, ref: AdapterRef, weights: AdapterWeights) -> None:  # under _lock
        self._loaded[ref.id] = weights
        self._loaded.move_to_end(ref.id)
        self._page_out()

    def _page_out(self) -> None:  # under _lock
        """Drop the least recently used unpinned adapters beyond max_cpu_loras."""
        unpinned = [i for i in self._loaded if i not in self._pins]
        for ref_id in unpinned[: max(0, len(self._loaded) - self.max_cpu_loras)]:
            del self._loaded[ref_id]
