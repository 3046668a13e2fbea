"""Drafting with a smaller model that shares the target's tokenizer (vLLM's `draft_model`).

The drafter keeps its own paged KV cache and, per target sequence, a shadow sequence: before each
proposal the shadow takes the target's tokens, keeps the K/V of the prefix they still share (the
drafts the target rejected are dropped), computes what it has not seen, then drafts greedily one
token per forward."""

from __future__ import annotations

import torch

from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.request import Sequence, SeqStatus
from ladle.engine.runner import ModelRunner
from ladle.engine.sampling_params import SamplingParams
from ladle.engine.scheduler import ScheduledSeq, common_prefix_len
from ladle.model.config import ModelConfig
from ladle.model.loader import load_weights, resolve_model_path


class DraftModel:
    def __init__(self, model: str, vocab_size: int, dtype: torch.dtype, num_blocks: int, block_size: int):
        folder = resolve_model_path(model)
        config = ModelConfig.from_folder(folder)
        if config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary ({config.vocab_size}) is not the target's ({vocab_size}):"
                             " it must share the tokenizer")
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(config, load_weights(folder, dtype), num_blocks, block_size, dtype, "auto")
        self._shadows: dict[int, Sequence] = {}  # target seq_id -> the drafter's copy

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Up to rooms[i] greedy tokens of the draft model after each sequence."""
        room_of, drafts = {}, {}
        batch = []
        for seq, room in zip(seqs, rooms):
            shadow = self._synced(seq)
            if self.kv.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens + room - 1):
                room_of[seq.seq_id], drafts[seq.seq_id] = room, []
                batch.append(ScheduledSeq(shadow, shadow.num_tokens - shadow.num_computed_tokens))
        while batch:  # the first pass computes what each shadow had not seen; then one draft each
            out = self.runner.execute(batch)
            for item in batch:
                item.seq.num_computed_tokens += item.num_new_tokens
            batch = []
            for shadow, row in zip(out.sample_seqs, out.sample_logits):
                draft = drafts[shadow.seq_id]
                draft.append(int(row.argmax()))
                if len(draft) < room_of[shadow.seq_id]:
                    shadow.token_ids.append(draft[-1])
                    batch.append(ScheduledSeq(shadow, 1))
        return [drafts.get(seq.seq_id, []) for seq in seqs]

    def forget_all_but(self, seq_ids: set[int]) -> None:
        """Free the shadows of sequences no longer running (finished, aborted or preempted)."""
        for seq_id in [s for s in self._shadows if s not in seq_ids]:
            self.kv.free(self._shadows.pop(seq_id))

    def _synced(self, seq: Sequence) -> Sequence:
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self._shadows[seq.seq_id] = Sequence(
                seq_id=seq.seq_id, request_id=seq.request_id, index=seq.index, token_ids=[],
                num_prompt_tokens=seq.num_prompt_tokens, params=SamplingParams(max_tokens=1),
                arrival_time=seq.arrival_time, status=SeqStatus.RUNNING)
        shared = common_prefix_len(shadow.token_ids, seq.token_ids, shadow.num_computed_tokens)
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = min(shared, seq.num_tokens - 1)  # the last token is always computed here
        self.kv.trim(shadow)
        return shadow
