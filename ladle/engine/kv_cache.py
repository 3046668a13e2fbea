"""Block pool and per-sequence block tables. The scheduler decides; this keeps count.

The runner owns the tensors; this module only hands out block ids.
"""

from __future__ import annotations

from collections import deque

from ladle.engine.request import Sequence


class BlockPool:
    """Fixed set of block ids with reference counts (shared prefix blocks count > 1)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def release(self, block_id: int) -> bool:
        """Drop one reference; True when the block became unreferenced."""
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} released twice"
        if self.ref_counts[block_id] == 0:
            self.free_ids.append(block_id)
            return True
        return False


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (vLLM's kv_cache_usage_perc, as a fraction)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold its computed tokens plus num_new_tokens."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(needed))
        return True

    def free(self, seq: Sequence) -> None:
        # Release tail first so the free list hands out a sequence's blocks in order again.
        for b in reversed(seq.block_table):
            self.pool.release(b)
        seq.block_table = []
