"""KV events: the prefix cache's stored and evicted blocks, for a router that routes on them.

A router that knows which blocks each replica holds can send a prompt where its prefix is
already computed (vLLM publishes such events for Dynamo's router). The radix tree reports
every full base-model block it gains or drops; this log keeps those events numbered, plus a
mirror of what the tree holds so a new subscriber starts from a snapshot. The engine thread
writes; any thread reads (a lock guards both).

A block is named by its chained digest (`Node.digest`: the namespace and every token up to
and including the block), so a subscriber can rebuild the tree from (hash, parent, tokens).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from ladle.engine.prefix_cache import Node

MAX_EVENTS = 65536  # a subscriber further behind than this starts again from a snapshot


@dataclass(frozen=True)
class BlockStored:
    hash: str
    parent: str
    tokens: tuple[int, ...]

    def to_json(self) -> dict:
        return {"type": "stored", "hash": self.hash, "parent": self.parent, "tokens": list(self.tokens)}


@dataclass(frozen=True)
class BlockRemoved:
    hash: str

    def to_json(self) -> dict:
        return {"type": "removed", "hash": self.hash}


KVEvent = BlockStored | BlockRemoved


@dataclass(frozen=True)
class KVSnapshot:
    seq: int  # the number of the last event it includes
    block_size: int
    root: str  # the parent hash of a prompt's first block
    blocks: list[BlockStored]  # parents before children

    def to_json(self) -> dict:
        return {"type": "snapshot", "block_size": self.block_size, "root": self.root,
                "blocks": [{"hash": b.hash, "parent": b.parent, "tokens": list(b.tokens)} for b in self.blocks]}


@dataclass
class KVEventLog:
    block_size: int
    root: str  # hex digest of the base model's root (namespace 0)
    max_events: int = MAX_EVENTS
    _seq: int = 0
    _blocks: dict[str, BlockStored] = field(default_factory=dict)  # insertion order: parents first
    _events: deque = field(default_factory=deque)  # (seq, event), oldest first
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- the prefix cache's side (engine thread) ---------------------------------

    def on_stored(self, node: Node) -> None:
        if node.namespace != 0 or len(node.key) != self.block_size:
            return  # adapters' trees and partial leaves are not routable by token blocks
        event = BlockStored(node.digest.hex(), node.parent.digest.hex(), node.key)
        with self._lock:
            self._blocks[event.hash] = event
            self._append(event)

    def on_removed(self, node: Node) -> None:
        digest = node.digest.hex()
        with self._lock:
            if self._blocks.pop(digest, None) is not None:
                self._append(BlockRemoved(digest))

    def _append(self, event: KVEvent) -> None:
        self._seq += 1
        self._events.append((self._seq, event))
        if len(self._events) > self.max_events:
            self._events.popleft()

    # -- subscribers' side (any thread) ------------------------------------------

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self._seq, self.block_size, self.root, list(self._blocks.values()))

    def since(self, seq: int) -> tuple[int, list[KVEvent]] | None:
        """The events after number seq and the number of the last; None when some of them were
        dropped already (the subscriber must start again from a snapshot)."""
        with self._lock:
            if seq == self._seq:
                return seq, []
            oldest = self._events[0][0] if self._events else self._seq + 1
            if seq + 1 < oldest:
                return None
            return self._seq, [e for n, e in self._events if n > seq]
