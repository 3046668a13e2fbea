"""An approximate radix tree over the request text the router sent to one worker.

SGLang's cache-aware router keeps one per worker: the longest prefix a request shares with the
tree estimates how much of its prompt that worker still has cached. The tree holds at most
`max_chars` characters; beyond that the least recently used leaves go first, as the worker's
own cache would evict them.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

_clock = itertools.count()  # a logical clock: monotonic and without ties


@dataclass(eq=False)
class _Node:
    edge: str  # the characters between the parent and this node
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)  # first character of the child's edge -> child
    last_used: int = 0


@dataclass
class PrefixTree:
    max_chars: int = 2**22
    root: _Node = field(default_factory=lambda: _Node("", None))
    size: int = 0  # characters held, over all edges

    def match(self, text: str) -> int:
        """How many leading characters of text the tree holds (touching what matched)."""
        node, pos, now = self.root, 0, next(_clock)
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            common = _common_length(child.edge, text, pos)
            child.last_used = now
            pos += common
            if common < len(child.edge):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        node, pos, now = self.root, 0, next(_clock)
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                node.children[text[pos]] = _Node(text[pos:], node, last_used=now)
                self.size += len(text) - pos
                break
            common = _common_length(child.edge, text, pos)
            if common < len(child.edge):
                child = self._split(child, common)
            child.last_used = now
            pos += common
            node = child
        if self.size > self.max_chars:
            self._evict(self.size - self.max_chars)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut child's edge at `at`: a new middle node takes the head, child keeps the tail."""
        middle = _Node(child.edge[:at], child.parent, last_used=child.last_used)
        middle.parent.children[middle.edge[0]] = middle
        child.edge, child.parent = child.edge[at:], middle
        middle.children[child.edge[0]] = child
        return middle

    def _evict(self, chars: int) -> None:
        """Drop least recently used leaves (and parents left childless) until chars are freed."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < chars:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.edge[0]]
            freed += len(leaf.edge)
            if not parent.children and parent is not self.root:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        self.size -= freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_length(edge: str, text: str, pos: int) -> int:
    n = min(len(edge), len(text) - pos)
    i = 0
    while i < n and edge[i] == text[pos + i]:
        i += 1
    return i
