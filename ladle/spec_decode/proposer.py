"""The configured drafter behind one call: drafts for the sequences that may speculate this step."""

from __future__ import annotations

import torch

from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.request import Sequence
from ladle.spec_decode import early_exit, ngram
from ladle.spec_decode.config import SpeculativeConfig
from ladle.spec_decode.draft_model import DraftModel
from ladle.spec_decode.mtp import MTPDrafter


class Proposer:
    def __init__(self, spec: SpeculativeConfig, runner: early_exit.DraftRunner, kv: KVCacheManager,
                 num_layers: int, vocab_size: int, dtype: torch.dtype, num_blocks: int, block_size: int):
        self.spec = spec
        self.runner, self.kv = runner, kv
        self.draft_layers = min(spec.draft_layers or max(1, num_layers // 4), num_layers)
        self.draft_model = DraftModel(spec.model, vocab_size, dtype, num_blocks, block_size) \
            if spec.method == "draft_model" else None
        self.mtp = MTPDrafter(runner.model, num_blocks, block_size, dtype) if spec.method == "mtp" else None

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Up to rooms[i] tokens to follow each sequence (fewer, or none, where the drafter has none)."""
        spec = self.spec
        if spec.method == "ngram":
            return [ngram.propose(seq.token_ids, room, spec.prompt_lookup_min, spec.prompt_lookup_max)
                    for seq, room in zip(seqs, rooms)]
        if self.draft_model is not None:
            return self.draft_model.propose(seqs, rooms)
        # early exit: the drafting layers write K/V at the drafted positions, so those need blocks (MTP: its
        # own cache's, laid out as the target's)
        placed = [i for i, (seq, room) in enumerate(zip(seqs, rooms)) if self.kv.allocate_slots(seq, room + 1)]
        if self.mtp is not None:
            drafts = self.mtp.propose([seqs[i] for i in placed], [rooms[i] for i in placed])
        else:
            drafts = early_exit.propose(self.runner, [seqs[i] for i in placed], [rooms[i] for i in placed],
                                        self.draft_layers)
        out: list[list[int]] = [[] for _ in seqs]
        for i, draft in zip(placed, drafts):
            out[i] = draft
        return out

    def keep_only(self, running: list[Sequence]) -> None:
        """Drop what the drafter holds for sequences no longer running (finished, aborted, preempted)."""
        if self.draft_model is not None:
            self.draft_model.forget_all_but({seq.seq_id for seq in running})
        if self.mtp is not None:
            self.mtp.forget_all_but({seq.seq_id for seq in running})
