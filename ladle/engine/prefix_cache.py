"""Radix tree of cached prefixes at block granularity, with LRU eviction.

Each node is one full block of tokens; the path from the root spells a token prefix
and every node names the KV block that holds that block's keys and values. Blocks
held by no sequence stay in the tree, reusable, until the pool needs room: then the
least recently used unreferenced leaves go first. "Recently used" is the moment a
block lost its last reference: `evictable` keeps that order, so eviction is O(1).

A finished or cancelled sequence also leaves its last, partly filled block behind as a
leaf whose key is shorter than a block: lookups of whole blocks never meet it, but
`partial_match` does, so a prompt that extends the sequence's tokens copies those K/V
instead of computing them again. Partial leaves are evicted like any other leaf and
never go to the second tier.

A node is canonical when a canonical sequence (scoring, --deterministic) computed its
block. Canonical sequences match canonical nodes only, so what they compute never
depends on K/V that batched generation computed; a canonical block computed later for a
non-canonical node's tokens takes the node over.

Each LoRA adapter has a tree of its own (a namespace: 0 for the base model), since the same
tokens give other K/V under another adapter.

Every node also carries a digest of its namespace and whole token prefix (chained block by
block), the name its K/V goes by once evicted to the second tier (ladle.engine.kv_offload).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

Key = tuple[int, ...]


@dataclass(eq=False)
class Node:
    key: Key
    block_id: int
    parent: "Node | None"
    canonical: bool = False
    children: dict[Key, "Node"] = field(default_factory=dict)
    digest: bytes = b""  # of the namespace and every token from the root through this block
    namespace: int = 0  # the tree it is in: 0 for the base model, else a LoRA adapter's id


class CacheListener(Protocol):
    """Told of every node the tree gains or loses (KV events)."""

    def on_stored(self, node: Node) -> None: ...

    def on_removed(self, node: Node) -> None: ...


def root_digest(namespace: int) -> bytes:
    """The digest a namespace's tree starts from (the parent of its first blocks)."""
    return chain_digest(b"ladle-kv", (namespace,))


def chain_digest(parent: bytes, key: Key) -> bytes:
    """The digest of a block's prefix: its parent's digest and its own tokens."""
    return hashlib.blake2b(parent + array("q", key).tobytes(), digest_size=16).digest()


class RadixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.roots: dict[int, Node] = {}  # namespace -> its tree's root
        self.by_block: dict[int, Node] = {}
        self.evictable: OrderedDict[int, Node] = OrderedDict()  # unreferenced leaves, oldest first
        self.listener: CacheListener | None = None

    def __len__(self) -> int:
        return len(self.by_block)

    def _keys(self, tokens: list[int], max_blocks: int) -> list[Key]:
        bs = self.block_size
        return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(max_blocks)]

    def root(self, namespace: int = 0) -> Node:
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = Node(key=(), block_id=-1, parent=None,
                                                digest=root_digest(namespace), namespace=namespace)
        return node

    def match(self, tokens: list[int], max_blocks: int, canonical_only: bool = False, namespace: int = 0) -> list[Node]:
        """Longest cached path for tokens, at most max_blocks deep (read-only)."""
        path, node = [], self.root(namespace)
        for key in self._keys(tokens, max_blocks):
            node = node.children.get(key)
            if node is None or (canonical_only and not node.canonical):
                break
            path.append(node)
        return path

    def partial_match(self, parent: Node | None, tokens: list[int] | tuple[int, ...],
                      canonical_only: bool = False, namespace: int = 0) -> tuple[Node | None, int]:
        """The child of parent (None: the namespace's root) whose block starts with the most of
        `tokens`: (node, count)."""
        best, best_len = None, 0
        for key, child in (parent or self.root(namespace)).children.items():
            if canonical_only and not child.canonical:
                continue
            n = 0
            for a, b in zip(key, tokens):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = child, n
        return best, best_len

    def insert(self, parent: Node | None, key: Key, block_id: int, canonical: bool = False,
               namespace: int = 0) -> Node:
        """Add block_id under parent (None: the namespace's root). If that block content is already
        cached, the existing node is returned and block_id stays private."""
        parent = parent or self.root(namespace)
        existing = parent.children.get(key)
        if existing is not None:
            return existing
        node = Node(key=key, block_id=block_id, parent=parent, canonical=canonical,
                    digest=chain_digest(parent.digest, key), namespace=parent.namespace)
        parent.children[key] = node
        self.by_block[block_id] = node
        self.evictable.pop(parent.block_id, None)  # a parent with children is no leaf
        if self.listener is not None:
            self.listener.on_stored(node)
        return node

    def replace_block(self, node: Node, block_id: int) -> int:
        """Make node name block_id, a canonical block for its tokens; returns the block it
        named before, which leaves the tree (its holders keep it as a private block)."""
        old = node.block_id
        del self.by_block[old]
        self.evictable.pop(old, None)
        node.block_id, node.canonical = block_id, True
        self.by_block[block_id] = node
        return old

    def contains_block(self, block_id: int) -> bool:
        return block_id in self.by_block

    def mark_referenced(self, block_id: int) -> None:
        self.evictable.pop(block_id, None)

    def mark_unreferenced(self, block_id: int) -> None:
        node = self.by_block[block_id]
        if not node.children:
            self.evictable[block_id] = node
            self.evictable.move_to_end(block_id)

    def evict_lru(self, is_unreferenced) -> Node | None:
        """Remove the least recently used unreferenced leaf and return it."""
        if not self.evictable:
            return None
        block_id, node = self.evictable.popitem(last=False)
        del self.by_block[block_id]
        parent = node.parent
        del parent.children[node.key]
        if parent.parent is not None and not parent.children and is_unreferenced(parent.block_id):
            self.evictable[parent.block_id] = parent
        if self.listener is not None:
            self.listener.on_removed(node)
        return node
