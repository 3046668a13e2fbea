"""Block pool, per-sequence block tables and the prefix cache. The scheduler decides;
this keeps count. The runner owns the tensors; this module only hands out block ids.

Block states: free (on the free list), held (referenced by running sequences), or
cached (in the radix tree with no reference: reusable by a later prompt, and evicted
least recently used first when the pool needs room).

Invariant: a sequence holds a path from the tree's root, so every ancestor of a held
block is held too, and every cached block can eventually be evicted.

Sliding windows (`window`: a model whose every layer has one, the largest of them) break that
on purpose: a sequence lets go of the blocks wholly behind its window (their table entries turn
HOLLOW), so a long sequence holds about window / block_size + 1 blocks, not its whole length.
The tree's inner unreferenced blocks are then evictable too (they go hollow), and a prefix hit
needs only the blocks its window reaches back to (ladle.engine.prefix_cache).

With a second tier (--kv-offload-gib) an evicted block's K/V goes to local disk under its
prefix digest, and a later prompt that runs past the tree's match continues matching there:
those blocks are read back into fresh blocks and join the tree, as if they had never left.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ladle.engine.prefix_cache import HOLLOW, Node, RadixCache, chain_digest
from ladle.engine.request import Sequence
from ladle.engine.state_cache import StateCache

if TYPE_CHECKING:
    import torch

    from ladle.engine.kv_offload import OffloadTier


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found cached
    evictions: int = 0  # blocks evicted


@dataclass
class OffloadLink:
    """The second tier as the block manager uses it, and the measured break-even: a run of blocks is
    read back only while a block reads back faster than its tokens prefill on this machine."""

    tier: "OffloadTier"
    block_views: Callable[[int], list["torch.Tensor"]]  # block id -> its slices of the live KV tensors
    block_size: int
    load_s_per_block: float | None = None  # running means, measured while serving
    prefill_s_per_token: float | None = None  # the engine's figure

    def worth_restoring(self) -> bool:
        if self.load_s_per_block is None or self.prefill_s_per_token is None:
            return True  # restore until measured otherwise: it is far cheaper for any real model
        return self.load_s_per_block < self.prefill_s_per_token * self.block_size

    def record_load(self, seconds: float) -> None:
        self.load_s_per_block = _running_mean(self.load_s_per_block, seconds)

    def record_prefill(self, seconds: float, tokens: int) -> None:
        self.prefill_s_per_token = _running_mean(self.prefill_s_per_token, seconds / tokens)


def _running_mean(mean: float | None, value: float, weight: float = 0.1) -> float:
    return value if mean is None else mean + weight * (value - mean)


class BlockPool:
    """Fixed set of block ids with reference counts (shared prefix blocks count > 1)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # a stack: the block freed last is handed out first, so the pages in use stay few and
        # warm (caches, TLB) and a fresh block's first-touch page faults are paid only while
        # the pool grows, not on every pass through it
        self.free_ids: deque[int] = deque(range(num_blocks - 1, -1, -1))
        self.ref_counts = [0] * num_blocks

    def take_free(self) -> int:
        block_id = self.free_ids.pop()
        self.ref_counts[block_id] = 1
        return block_id

    def ref(self, block_id: int) -> bool:
        """Add a reference; True when the block was unreferenced before."""
        self.ref_counts[block_id] += 1
        return self.ref_counts[block_id] == 1

    def unref(self, block_id: int) -> bool:
        """Drop a reference; True when the block is now unreferenced."""
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} released twice"
        return self.ref_counts[block_id] == 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_outputs: bool = True, window: int | None = None, states: StateCache | None = None):
        """states: a hybrid model's linear-attention state slots (a prefix hit ends only where a
        snapshot of the state is kept)."""
        self.block_size = block_size
        self.states = states
        self.window = window
        # False in deterministic mode: generated tokens' K/V came from single-token steps,
        # which match a later prompt's prefill bit for bit only with the native kernels.
        self.cache_outputs = cache_outputs
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(block_size, hollow=window is not None) if enable_prefix_caching else None
        self.num_cached_unreferenced = 0
        self.stats = PrefixCacheStats()
        self.offload: OffloadLink | None = None

    def enable_offload(self, tier: "OffloadTier", block_views: Callable[[int], list["torch.Tensor"]]) -> None:
        """Keep evicted prefix blocks in `tier` and read them back on later hits."""
        assert self.cache is not None, "the second tier holds prefix-cache blocks: it needs prefix caching"
        self.offload = OffloadLink(tier, block_views, self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now: free ones plus cached ones that may be evicted."""
        return len(self.pool.free_ids) + self.num_cached_unreferenced

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cache) if self.cache else 0

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (vLLM's kv_cache_usage_perc, as a fraction)."""
        return 1.0 - self.num_free_blocks / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------

    def cached_prefix_len(self, seq: Sequence) -> int:
        """Tokens of seq a lookup would find now (read-only; for longest-prefix-match)."""
        if self.cache is None:
            return 0
        return len(self._match(seq)) * self.block_size

    def _match(self, seq: Sequence) -> list[Node]:
        """seq's longest cached path whose blocks hold all the K/V a prompt continuing it needs."""
        path = self.cache.match(seq.cache_token_ids, self._max_match_blocks(seq), canonical_only=seq.canonical,
                                namespace=seq.adapter_id)
        if self.states is not None:  # the state must be restorable where the hit ends
            while path and path[-1].snapshot is None:
                path.pop()
        if self.window is None:
            return path
        for k in range(len(path), 0, -1):
            if not any(node.hollow for node in path[self.first_needed_block(k * self.block_size) : k]):
                return path[:k]
        return []

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` (or any later one) reads."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // self.block_size

    def release_out_of_window(self, seq: Sequence) -> None:
        """Let go of seq's blocks that no query from its next token on reads (sliding windows)."""
        table = seq.block_table
        end = self.first_needed_block(seq.num_computed_tokens)
        start = end
        while start > 0 and table[start - 1] != HOLLOW:
            start -= 1
        for k in range(start, end):  # oldest first, so the prefix cache evicts them in that order
            self._unref(table[k])
            table[k] = HOLLOW

    def _max_match_blocks(self, seq: Sequence) -> int:
        return self.reusable_tokens(seq) // self.block_size

    def reusable_tokens(self, seq: Sequence) -> int:
        """How far seq may start on K/V other sequences computed. At least the last token is
        always computed, so the step has logits to sample from."""
        limit = seq.params.max_reused_prompt_tokens
        return seq.num_tokens - 1 if limit is None else min(seq.num_tokens - 1, limit)

    def reuses_prefix(self, seq: Sequence) -> bool:
        """Whether seq may start on K/V other sequences computed (cached or in flight)."""
        return self.cache is not None and seq.params.max_reused_prompt_tokens != 0

    def match_prefix(self, seq: Sequence) -> int:
        """Start a fresh sequence on its longest cached prefix; returns the tokens skipped."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if self.states is not None and seq.state_slot is None:
            seq.state_slot = self.states.take_running()
        if not self.reuses_prefix(seq):
            return 0
        path = self._match(seq)
        needed = self.first_needed_block(len(path) * self.block_size)
        for node in path[needed:]:
            self._ref(node.block_id)
        seq.block_table = [HOLLOW] * needed + [node.block_id for node in path[needed:]]
        seq.num_cached_blocks = len(path)
        seq.num_computed_tokens = len(path) * self.block_size
        if self.states is not None:  # the state exists at block ends only: no second tier, no partial blocks
            seq.cached_tail = path[-1] if path else None
            if path:  # restored from the snapshot at the path's end
                seq.state_restore = path[-1].snapshot
                self.states.touch(path[-1])
        else:
            last = seq.cached_tail = self._restore(seq, path[-1] if path else self.cache.root(seq.adapter_id))
            self._reuse_partial_block(seq, None if last.parent is None else last)
        self.release_pins(seq)
        return seq.num_computed_tokens

    def plan_snapshots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Hybrid models: a snapshot slot for each block boundary of seq's prompt that its next
        num_new_tokens tokens reach, which the step writes and cache_full_blocks hands to the block's node."""
        if self.states is None or self.cache is None:
            return
        bs, start = self.block_size, seq.num_computed_tokens
        end = min(start + num_new_tokens, seq.num_prompt_tokens)
        for boundary in reversed(range((start // bs + 1) * bs, end + 1, bs)):  # the deepest first, where slots are few
            if boundary not in seq.pending_snapshots and (slot := self.states.take_snapshot()) is not None:
                seq.pending_snapshots[boundary] = slot

    def import_prefix(self, tokens: list[int], blocks: list, write: Callable[[int, list], None]) -> list[int]:
        """Enter K/V computed elsewhere for the leading blocks of tokens (the last may be partly
        filled) into the base model's tree, writing each block not cached yet with write(block_id,
        tensors). Returns the blocks of the path, each with a reference held for the caller (a
        sequence's pins, released once it is matched or freed), so none is evicted meanwhile."""
        if self.cache is None:
            return []
        bs, parent, pinned = self.block_size, self.cache.root(0), []
        for k, tensors in enumerate(blocks):
            key = tuple(tokens[k * bs : (k + 1) * bs])
            node = parent.children.get(key)
            if node is not None and not node.hollow:
                self._ref(node.block_id)
            elif self.num_free_blocks > 0:
                block = self._take_block()
                write(block, tensors)
                node = self.cache.insert(parent, key, block)
            else:
                break
            pinned.append(node.block_id)
            if len(key) < bs:
                break
            parent = node
        return pinned

    def release_pins(self, seq: Sequence) -> None:
        for b in seq.pinned_blocks:
            self._unref(b)
        seq.pinned_blocks = []

    def _restore(self, seq: Sequence, parent: Node) -> Node:
        """Continue seq's match in the second tier: read its next blocks back while the tier has
        them (and the tree does not); returns the last node of seq's cached path."""
        link = self.offload
        if link is None or not link.worth_restoring():
            return parent
        bs, tier = self.block_size, link.tier
        tokens = seq.cache_token_ids
        for k in range(len(seq.block_table), self._max_match_blocks(seq)):
            key = tuple(tokens[k * bs : (k + 1) * bs])
            digest = chain_digest(parent.digest, key)
            if key in parent.children or not tier.contains(digest, canonical_only=seq.canonical):
                break
            if self.num_free_blocks == 0:
                break
            block = self._take_block()
            started = time.perf_counter()
            if not tier.load(digest, link.block_views(block)):  # missing or corrupt: recompute from here
                self._unref(block)
                break
            link.record_load(time.perf_counter() - started)
            parent = self.cache.insert(parent, key, block, tier.contains(digest, canonical_only=True),
                                       seq.adapter_id)
            seq.block_table.append(block)
            seq.num_cached_blocks += 1
            seq.num_computed_tokens += bs
        return parent

    def _reuse_partial_block(self, seq: Sequence, parent) -> None:
        """Where the prompt shares only the start of a cached block, copy those tokens'
        K/V into a fresh block (the runner does the copy) instead of recomputing them."""
        start = seq.num_computed_tokens
        limit = min(start + self.block_size, self.reusable_tokens(seq))
        source, shared = self.cache.partial_match(parent, seq.cache_token_ids[start:limit], canonical_only=seq.canonical,
                                                  namespace=seq.adapter_id)
        if source is None or self.num_free_blocks <= 1:  # keep the source from being evicted for it
            return
        self._ref(source.block_id)  # pin the source while a block is taken for the copy
        block = self._take_block()
        self._unref(source.block_id)
        seq.block_table.append(block)
        seq.pending_copy = (source.block_id, block, shared)
        seq.num_computed_tokens += shared

    def share_in_flight(self, seq: Sequence, source: Sequence, num_tokens: int) -> int:
        """Restart seq (just matched, not yet run) on the first num_tokens tokens of source,
        a sequence this step computes at least that far: its full blocks are shared as they
        are, and the tokens of the last, partial one are copied during the step (the runner
        copies each layer once the step has written it). Returns the tokens seq now skips."""
        full, rest = divmod(num_tokens, self.block_size)
        blocks = source.block_table[:full]
        for b in blocks:  # before seq lets go of its own, so none of them can be evicted meanwhile
            if b != HOLLOW:
                self._ref(b)
        self.free(seq)
        if rest and self.num_free_blocks == 0:  # no block to copy into: share the full blocks only
            rest = 0
        seq.block_table = list(blocks)
        seq.num_cached_blocks = 0
        if self.cache is not None:
            while seq.num_cached_blocks < full and self.cache.contains_block(blocks[seq.num_cached_blocks]):
                seq.num_cached_blocks += 1
            seq.cached_tail = self.cache.by_block[blocks[seq.num_cached_blocks - 1]] if seq.num_cached_blocks else None
        if rest:
            block = self._take_block()
            seq.block_table.append(block)
            seq.in_step_copy = (source.block_table[full], block, rest)
        seq.num_computed_tokens = full * self.block_size + rest
        return seq.num_computed_tokens

    def record_lookup(self, seq: Sequence, hit_tokens: int) -> None:
        self.stats.queries += seq.num_tokens
        self.stats.hits += hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter seq's newly completed blocks into the tree (after a step computed them)."""
        if self.cache is None:
            return
        computed = seq.num_computed_tokens if self.cache_outputs else min(seq.num_computed_tokens, seq.num_prompt_tokens)
        full = computed // self.block_size
        bs = self.block_size
        tokens = seq.cache_token_ids
        for k in range(seq.num_cached_blocks, full):
            parent = self._cached_parent(seq, k)
            if (k and parent is None) or seq.block_table[k] == HOLLOW:
                break
            key = tuple(tokens[k * bs : (k + 1) * bs])
            node = seq.cached_tail = self.cache.insert(parent, key, seq.block_table[k], seq.canonical, seq.adapter_id)
            replaced = seq.canonical and not node.canonical
            if self.states is not None:
                self._hand_snapshot(seq, node, (k + 1) * bs, replaced)
            if node.block_id != seq.block_table[k]:  # someone cached the same tokens first
                if replaced:
                    self._replace_with_canonical(node, seq.block_table[k])
                else:  # share theirs, return ours
                    self._ref(node.block_id)
                    self._unref(seq.block_table[k])
                    seq.block_table[k] = node.block_id
            seq.num_cached_blocks = k + 1
        self._release_snapshots(seq, upto=computed)

    def _hand_snapshot(self, seq: Sequence, node: Node, boundary: int, canonical_takes_over: bool) -> None:
        """Give node seq's snapshot of the state at its block's end; where a canonical block takes the node
        over, a batched sequence's snapshot goes (its bits may differ) whether or not seq has one."""
        snapshot = seq.pending_snapshots.pop(boundary, None)
        if canonical_takes_over:
            self.states.forget(node)
        if snapshot is not None:
            self.states.attach(snapshot, node)

    def _release_snapshots(self, seq: Sequence, upto: int | None = None) -> None:
        """Give back seq's pending snapshots at boundaries up to `upto` (all of them: None) that no node took."""
        for boundary in [b for b in seq.pending_snapshots if upto is None or b <= upto]:
            self.states.release(seq.pending_snapshots.pop(boundary))

    def _cached_parent(self, seq: Sequence, k: int) -> Node | None:
        """The tree node seq's block k (its next to cache: k == seq.num_cached_blocks) goes under: None for
        the first block, or where seq's path left the tree (its parent block was replaced by a canonical
        one or evicted: seq stays private)."""
        parent = seq.cached_tail if k else None
        if parent is None or parent.detached:
            return None
        if seq.block_table[k - 1] not in (HOLLOW, parent.block_id):
            return None
        return parent

    def _replace_with_canonical(self, node, block_id: int) -> None:
        old = self.cache.replace_block(node, block_id)
        if self.pool.ref_counts[old] == 0:  # it was cached and unreferenced: free it now
            self.num_cached_unreferenced -= 1
            self.pool.free_ids.append(old)

    # -- allocation -----------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold its computed tokens plus num_new_tokens."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_block())
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past seq's tokens: those only rejected drafts were written to."""
        keep = self.blocks_for(seq.num_tokens)
        while len(seq.block_table) > keep:
            self._unref(seq.block_table.pop())

    def _take_block(self) -> int:
        if not self.pool.free_ids:
            self._evict_one()
        return self.pool.take_free()

    def free(self, seq: Sequence, keep_partial: bool = False) -> None:
        """Let go of seq's blocks. With keep_partial (a finished or cancelled sequence, never a
        preempted one) its last, partly filled block stays cached too, so a prompt that extends
        seq's tokens copies them instead of computing them again."""
        self.release_pins(seq)
        if keep_partial and self.cache is not None and self.states is None:
            self._cache_partial_block(seq)
        if self.states is not None:
            self._release_states(seq)
        # Tail first: leaves become evictable before their parents, and the free list
        # hands a sequence's blocks out in order again.
        for b in reversed(seq.block_table):
            if b != HOLLOW:
                self._unref(b)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.cached_tail = None
        seq.pending_copy = seq.in_step_copy = None

    def _release_states(self, seq: Sequence) -> None:
        self._release_snapshots(seq)
        if seq.state_slot is not None:
            self.states.give_back_running(seq.state_slot)
        seq.state_slot = seq.state_restore = None

    def _cache_partial_block(self, seq: Sequence) -> None:
        """Enter seq's partly filled last block as a leaf keyed by the tokens it holds. Only where
        that is safe: its K/V were written (no copy into it still pending), its full blocks are all
        in the tree (else it has no parent there), and no other sequence writes to it."""
        computed = seq.num_computed_tokens if self.cache_outputs else min(seq.num_computed_tokens,
                                                                          seq.num_prompt_tokens)
        full, rest = divmod(computed, self.block_size)
        if (not rest or len(seq.block_table) <= full or seq.num_cached_blocks != full
                or seq.pending_copy is not None or seq.in_step_copy is not None):
            return
        block = seq.block_table[full]
        if self.pool.ref_counts[block] != 1:
            return
        parent = self._cached_parent(seq, full)
        if full and parent is None:
            return
        key = tuple(seq.cache_token_ids[full * self.block_size : computed])
        self.cache.insert(parent, key, block, seq.canonical, seq.adapter_id)  # the same tokens cached: a no-op

    def _ref(self, block_id: int) -> None:
        if self.pool.ref(block_id) and self.cache is not None and self.cache.contains_block(block_id):
            self.cache.mark_referenced(block_id)
            self.num_cached_unreferenced -= 1

    def _unref(self, block_id: int) -> None:
        if not self.pool.unref(block_id):
            return
        if self.cache is not None and self.cache.contains_block(block_id):
            self.cache.mark_unreferenced(block_id)
            self.num_cached_unreferenced += 1
        else:
            self.pool.free_ids.append(block_id)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block no sequence holds, and every block of the second tier: a prompt
        computed before is a miss afterwards. Blocks that running sequences hold stay (and stay
        cached). True when nothing is left cached; False when running sequences hold some."""
        if self.cache is None:
            return True
        while (evicted := self.cache.evict_lru(lambda b: self.pool.ref_counts[b] == 0)) is not None:
            self._forget_snapshot(evicted[0])
            self.num_cached_unreferenced -= 1  # dropped, not evicted for room: no eviction counted
            self.pool.free_ids.append(evicted[1])
        if self.offload is not None:
            self.offload.tier.clear()
        return len(self.cache) == 0

    def _evict_one(self) -> None:
        evicted = self.cache.evict_lru(lambda b: self.pool.ref_counts[b] == 0) if self.cache else None
        assert evicted is not None, "no block to evict although the count said there was"
        node, block = evicted
        self._forget_snapshot(node)
        if self.offload is not None and len(node.key) == self.block_size:  # before anything writes over it
            self.offload.tier.store(node.digest, self.offload.block_views(block), node.canonical)
        self.num_cached_unreferenced -= 1
        self.stats.evictions += 1
        self.pool.free_ids.append(block)

    def _forget_snapshot(self, node: Node) -> None:
        if self.states is not None:
            self.states.forget(node)
