"""Slots of a hybrid model's linear-attention state pool (ladle.model.linear_attention), as the engine
hands them out.

Each running sequence holds one slot: its recurrent state, which grows with nothing. The other slots
hold snapshots: the state at a block boundary of a cached prefix, each attached to the radix node
whose block ends there, so a prefix hit restores the state where the hit ends as well as the K/V.
Snapshots are bounded (num_snapshots slots, --max-state-snapshots): when none is free, the least
recently used attached one is dropped from its node, whose blocks stay cached but no hit ends there
any more. A snapshot a step is about to write (pending) is never dropped.
"""

from __future__ import annotations

from collections import OrderedDict

from ladle.engine.prefix_cache import Node


class StateCache:
    def __init__(self, num_running: int, num_snapshots: int):
        self.num_running, self.num_snapshots = num_running, num_snapshots
        self.free_running = list(range(num_running))
        self.free_snapshots = list(range(num_running, num_running + num_snapshots))
        self.attached: OrderedDict[int, Node] = OrderedDict()  # snapshot slot -> its node, least recent first

    @property
    def num_slots(self) -> int:
        return self.num_running + self.num_snapshots

    def take_running(self) -> int:
        return self.free_running.pop()

    def give_back_running(self, slot: int) -> None:
        self.free_running.append(slot)

    def take_snapshot(self) -> int | None:
        """A slot to write a snapshot into: a free one, or the least recently used attached one's."""
        if self.free_snapshots:
            return self.free_snapshots.pop()
        if not self.attached:
            return None
        slot, node = self.attached.popitem(last=False)
        node.snapshot = None
        return slot

    def release(self, slot: int) -> None:
        """A pending snapshot that no node took."""
        self.free_snapshots.append(slot)

    def attach(self, slot: int, node: Node) -> None:
        """Give node the snapshot in slot (the state once its block is computed); a node that has one keeps it."""
        if node.snapshot is not None:
            self.release(slot)
            return
        node.snapshot = slot
        self.attached[slot] = node

    def touch(self, node: Node) -> None:
        """A hit restored node's snapshot: it is the most recently used."""
        self.attached.move_to_end(node.snapshot)

    def forget(self, node: Node) -> None:
        """node leaves the tree (or its block does): its snapshot slot is free again."""
        if node.snapshot is not None:
            del self.attached[node.snapshot]
            self.free_snapshots.append(node.snapshot)
            node.snapshot = None

    @property
    def idle(self) -> bool:
        """Every running slot is free and every snapshot slot is free or attached (none pending)."""
        return (len(self.free_running) == self.num_running
                and len(self.free_snapshots) + len(self.attached) == self.num_snapshots)
