"""Iteration-level scheduling: every step picks which tokens of which sequences run.

Decodes go first, then unfinished prefills, then newly admitted requests, all under
one token budget. When the block pool runs dry the scheduler preempts (the most
recently admitted, or under the priority policy the least urgent) and recomputes
the victim later.
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
        if self.config.scheduling_policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        planned: dict[int, ScheduledSeq] = {}
        # Decodes first, then chunks of prompts already under way.
        for seq in sorted(self.running, key=lambda s: self._remaining(s) != 1):
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue
            n = self._chunk(seq, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = self._pick_victim()
                budget += self._preempt(victim, planned, out)
                if victim is seq:
                    break
            else:
                planned[seq.seq_id] = ScheduledSeq(seq, n)
                budget -= n
        if not out.preempted:
            self._admit(budget, planned)
        out.scheduled = list(planned.values())
        return out

    def _admit(self, budget: int, planned: dict[int, ScheduledSeq]) -> None:
        self.waiting.sort(key=self._urgency)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk(seq, budget)
            if not self.kv.allocate_slots(seq, n):
                break
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            planned[seq.seq_id] = ScheduledSeq(seq, n)
            budget -= n

    def _remaining(self, seq: Sequence) -> int:
        return seq.num_tokens - seq.num_computed_tokens

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = self._remaining(seq)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    def _pick_victim(self) -> Sequence:
        return max(self.running, key=self._urgency)

    def _preempt(self, victim: Sequence, planned: dict[int, ScheduledSeq], out: SchedulerOutput) -> int:
        """Free the victim's blocks and queue it for recompute; returns budget handed back."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = SeqStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(victim)
        out.preempted.append(victim)
        unplanned = planned.pop(victim.seq_id, None)
        return unplanned.num_new_tokens if unplanned else 0

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
