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

Under sliding windows (`hollow=True`: a model whose every layer has one) a sequence lets go of the
blocks behind its window, so an unreferenced block may sit below referenced ones. Such an inner
node is evicted by going hollow: its block goes back to the pool and the node stays as a step of
the path (its tokens and digest), holding no K/V. A prompt may then match through hollow nodes
as long as the blocks its window needs hold theirs (KVCacheManager decides how far); a sequence
that computes a hollow node's tokens again fills it. A hollow node with no children left goes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

Key = tuple[int, ...]
HOLLOW = -1  # the block id of a node (or a block-table entry) whose K/V were let go


@dataclass(eq=False)
class Node:
    key: Key
    block_id: int  # HOLLOW: its K/V were let go (sliding windows), the node only keeps the path
    parent: "Node | None"
    canonical: bool = False
    children: dict[Key, "Node"] = field(default_factory=dict)
    digest: bytes = b""  # of the namespace and every token from the root through this block
    namespace: int = 0  # the tree it is in: 0 for the base model, else a LoRA adapter's id
    detached: bool = False  # removed from the tree
    snapshot: int | None = None  # hybrid models: the state slot holding the state once this block is computed

    @property
    def hollow(self) -> bool:
        return self.block_id == HOLLOW


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
    def __init__(self, block_size: int, hollow: bool = False):
        self.block_size = block_size
        self.hollow = hollow  # inner nodes may be evicted by going hollow (sliding windows)
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
        """Longest cached path for tokens, at most max_blocks deep (read-only). Hollow nodes are
        steps of it too: the caller decides which K/V it needs."""
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
            if (canonical_only and not child.canonical) or child.hollow:
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
        cached, the existing node is returned and block_id stays private; a hollow one is filled."""
        parent = parent or self.root(namespace)
        existing = parent.children.get(key)
        if existing is not None and existing.hollow:
            existing.block_id, existing.canonical = block_id, canonical
            self.by_block[block_id] = existing
            if self.listener is not None:
                self.listener.on_stored(existing)
        if existing is not None:
            return existing
        node = Node(key=key, block_id=block_id, parent=parent, canonical=canonical,
                    digest=chain_digest(parent.digest, key), namespace=parent.namespace)
        parent.children[key] = node
        self.by_block[block_id] = node
        if not self.hollow:
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
        if self.hollow or not node.children:
            self.evictable[block_id] = node
            self.evictable.move_to_end(block_id)

    def evict_lru(self, is_unreferenced) -> tuple[Node, int] | None:
        """Evict the least recently used unreferenced block: remove its node, a leaf, or leave an
        inner one hollow. Returns the node and the block it let go."""
        if not self.evictable:
            return None
        block_id, node = self.evictable.popitem(last=False)
        del self.by_block[block_id]
        if node.children:
            node.block_id = HOLLOW
        else:
            self._remove(node, is_unreferenced)
        if self.listener is not None:
            self.listener.on_removed(node)
        return node, block_id

    def _remove(self, node: Node, is_unreferenced) -> None:
        """Take a childless node out of the tree, and its parent too if that leaves it a hollow leaf."""
        parent = node.parent
        del parent.children[node.key]
        node.detached = True
        if parent.parent is None or parent.children:
            return
        if parent.hollow:
            self._remove(parent, is_unreferenced)
        elif is_unreferenced(parent.block_id):
            self.evictable[parent.block_id] = parent
