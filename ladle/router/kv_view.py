"""The exact view of one worker's prefix cache, rebuilt from its KV events (GET /v1/kv_events).

A block is named by a chained hash; it is found from its parent's hash and its own tokens, so a
prompt's token ids are matched by walking from the root, one full block at a time, as the
worker's own cache would. A "snapshot" event replaces the view; "events" add and drop blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVView:
    block_size: int = 0
    root: str = ""
    blocks: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # hash -> (parent, tokens)
    children: dict[tuple[str, tuple[int, ...]], str] = field(default_factory=dict)  # (parent, tokens) -> hash
    live: bool = False  # a snapshot arrived and its stream is still open

    def apply(self, event: dict[str, Any]) -> None:
        """Fold one event (one `data:` payload of the stream) into the view."""
        kind = event.get("type")
        if kind == "snapshot":
            self._reset(int(event["block_size"]), str(event["root"]))
            for block in event.get("blocks", []):
                self._store(block)
            self.live = True
        elif kind == "events":
            for e in event.get("events", []):
                if e.get("type") == "stored":
                    self._store(e)
                elif e.get("type") == "removed":
                    self._remove(str(e["hash"]))

    def mark_stale(self) -> None:
        self.live = False

    def matched_blocks(self, token_ids: list[int]) -> int:
        """How many leading full blocks of token_ids the worker holds."""
        if not self.block_size:
            return 0
        parent, count = self.root, 0
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = self.children.get((parent, tuple(token_ids[start:start + self.block_size])))
            if parent is None:
                break
            count += 1
        return count

    def _reset(self, block_size: int, root: str) -> None:
        self.block_size, self.root = block_size, root
        self.blocks.clear()
        self.children.clear()

    def _store(self, block: dict[str, Any]) -> None:
        digest, parent, tokens = str(block["hash"]), str(block["parent"]), tuple(block["tokens"])
        self.blocks[digest] = (parent, tokens)
        self.children[(parent, tokens)] = digest

    def _remove(self, digest: str) -> None:
        entry = self.blocks.pop(digest, None)
        if entry is not None and self.children.get(entry) == digest:
            del self.children[entry]
