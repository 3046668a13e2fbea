"""Iteration-level scheduling: every step picks which tokens of which sequences run.

Decodes go first, then unfinished prefills, then newly admitted requests, all under
one token budget. When the block pool runs dry the scheduler preempts (the most
recently admitted, or under the priority policy the least urgent) and recomputes
the victim later. A new sequence starts from its longest cached prefix.

Effort-aware admission (--max-high-effort-seqs N): a high-effort sequence (a thinking budget,
else a max_tokens, above --high-effort-tokens) waits while N of them run, and low-effort
sequences are admitted first; so the slots and step budget left over stay free for short
requests however many long thinkers queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ladle.config import EngineConfig
from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.request import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class _StepPlan:
    budget: int
    planned: dict[int, ScheduledSeq] = field(default_factory=dict)
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    sources: set[int] = field(default_factory=set)  # sequences others share in-flight blocks of: never preempted

    def add(self, seq: Sequence, n: int) -> None:
        self.planned[seq.seq_id] = ScheduledSeq(seq, n)
        self.budget -= n


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _urgency(self, seq: Sequence) -> tuple:
        """Smaller runs sooner."""
        if self.config.scheduling_policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        # Decodes first, then chunks of prompts already under way.
        for seq in sorted(self.running, key=lambda s: self._remaining(s) - len(s.draft_token_ids) != 1):
            if seq.status is not SeqStatus.RUNNING or plan.budget == 0:
                continue
            n = self._chunk(seq, plan.budget)
            del seq.draft_token_ids[max(0, n - 1) :]  # the drafts that fit this step's budget
            if n == 0:
                continue
            self.kv.release_out_of_window(seq)
            while not self.kv.allocate_slots(seq, n):
                victim = max(self.running, key=self._urgency)
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                plan.add(seq, n)
                self.kv.plan_snapshots(seq, n)
        if not plan.out.preempted:
            self._admit(plan)
        plan.out.scheduled = list(plan.planned.values())
        return plan.out

    def _admit(self, plan: _StepPlan) -> None:
        self._order_waiting()
        no_slot: list[Sequence] = []  # one adapter or high-effort sequence too many: they wait, the rest go on
        while self.waiting and plan.budget > 0:
            seq = self.waiting[0]
            if not self._adapter_fits(seq) or not self._effort_fits(seq):
                no_slot.append(self.waiting.pop(0))
                continue
            if len(self.running) >= self.config.max_num_seqs:
                if self._preempt_for(seq, plan):
                    continue
                break
            hit = self.kv.match_prefix(seq)
            if self._waits_for_state(seq, plan, hit):
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                break
            hit = self._share_in_flight(seq, plan, hit)
            n = self._chunk(seq, plan.budget)
            if n == 0 or not self.kv.allocate_slots(seq, n):
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                if n > 0 and self._preempt_for(seq, plan):
                    continue
                break
            if seq.num_preemptions == 0:
                self.kv.record_lookup(seq, hit)
                seq.num_cached_tokens = hit
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.add(seq, n)
            self.kv.plan_snapshots(seq, n)
        self.waiting[:0] = no_slot

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether running seq keeps the running sequences within --max-loras distinct adapters
        (so no step holds more)."""
        if seq.lora is None:
            return True
        running = {s.lora.id for s in self.running if s.lora is not None}
        return seq.lora.id in running or len(running) < self.config.max_loras

    def is_high_effort(self, seq: Sequence) -> bool:
        r = seq.reasoning
        effort = r.budget if r is not None and r.budget is not None else seq.params.max_tokens
        return effort > self.config.high_effort_tokens

    def _effort_fits(self, seq: Sequence) -> bool:
        cap = self.config.max_high_effort_seqs
        if cap == 0 or not self.is_high_effort(seq):
            return True
        return sum(1 for s in self.running if self.is_high_effort(s)) < cap

    def _share_in_flight(self, seq: Sequence, plan: _StepPlan, hit: int) -> int:
        """Start seq further on when a sequence this step computes shares more of its prompt
        than the prefix cache holds (requests sharing a prefix that arrive together: the
        first computes it, the others join in the same step). Returns the tokens skipped."""
        if not self.kv.reuses_prefix(seq) or self.kv.states is not None:
            return hit
        best, best_len = self._in_flight_source(seq, plan, hit)
        if best is None:
            return hit
        plan.sources.add(best.seq_id)
        return self.kv.share_in_flight(seq, best, best_len)

    def _waits_for_state(self, seq: Sequence, plan: _StepPlan, hit: int) -> bool:
        """Hybrid models: a sequence this step computes covers a whole block more of seq's prompt than
        its hit. seq cannot join it mid-step (its state exists only once the step has run), so it waits
        for the next step, when that block is cached with a snapshot of the state."""
        if self.kv.states is None or not self.kv.reuses_prefix(seq):
            return False
        _, shared = self._in_flight_source(seq, plan, hit)
        return shared // self.config.block_size > hit // self.config.block_size

    def _in_flight_source(self, seq: Sequence, plan: _StepPlan, hit: int) -> tuple[Sequence | None, int]:
        """The planned sequence that computes the most of seq's prompt beyond hit, and how far they agree."""
        best, best_len = None, hit
        for item in plan.planned.values():
            src = item.seq
            if (seq.canonical and not src.canonical) or src.adapter_id != seq.adapter_id:
                continue
            end = min(src.num_computed_tokens + item.num_new_tokens, self.kv.reusable_tokens(seq))
            if not self.kv.cache_outputs:  # generated tokens' K/V may not match a prompt's
                end = min(end, src.num_prompt_tokens)
            if end > best_len and (n := common_prefix_len(seq.cache_token_ids, src.cache_token_ids, end)) > best_len:
                best, best_len = src, n
        return best, best_len

    def _order_waiting(self) -> None:
        if self.config.scheduling_policy == "lpm":
            # Longest cached prefix first; ties in arrival order.
            lengths = {s.seq_id: self.kv.cached_prefix_len(s) for s in self.waiting}
            self.waiting.sort(key=lambda s: (-lengths[s.seq_id], s.arrival_time, s.seq_id))
        else:
            self.waiting.sort(key=self._urgency)
        if self.config.max_high_effort_seqs:
            self.waiting.sort(key=self.is_high_effort)  # stable: low-effort first, each lane in order

    def _preempt_for(self, seq: Sequence, plan: _StepPlan) -> bool:
        """Priority policy: make room for seq by preempting a less urgent running sequence."""
        candidates = [s for s in self.running if s.seq_id not in plan.sources]
        if self.config.scheduling_policy != "priority" or not candidates:
            return False
        victim = max(candidates, key=self._urgency)
        if self._urgency(victim) <= self._urgency(seq):
            return False
        self._preempt(victim, plan)
        return True

    def _remaining(self, seq: Sequence) -> int:
        return seq.num_tokens + len(seq.draft_token_ids) - seq.num_computed_tokens

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = self._remaining(seq)
        n = remaining
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        n = min(n, budget)
        if seq.canonical and n < remaining:
            # Chunks end on block boundaries, so no attention tile of the torch fallback is split.
            bs = self.config.block_size
            # A sequence that starts mid-block (a partial prefix hit) may not reach the next
            # boundary within what is left of this step's budget: it waits for the next step.
            n = max(0, (seq.num_computed_tokens + n) // bs * bs - seq.num_computed_tokens)
        return n

    def _preempt(self, victim: Sequence, plan: _StepPlan) -> None:
        """Free the victim's blocks and queue it for recompute."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.draft_token_ids = []
        victim.status = SeqStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(victim)
        plan.out.preempted.append(victim)
        unplanned = plan.planned.pop(victim.seq_id, None)
        if unplanned:
            plan.budget += unplanned.num_new_tokens

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Account for the tokens the runner computed and cache the blocks they filled."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.cache_full_blocks(item.seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq, keep_partial=True)
        seq.status = SeqStatus.FINISHED


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most limit."""
    n = min(limit, len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: halve, comparing slices at C speed
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
