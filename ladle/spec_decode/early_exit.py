"""Self-speculative drafting: the target's own first layers and LM head guess the next tokens (an
early exit, as in LayerSkip); the full model then verifies them. No second model, no second KV
cache: the drafting layers write their K/V into the sequence's own blocks, and the verifying
step writes all layers there again."""

from __future__ import annotations

from typing import Protocol

import torch

from ladle.engine.request import Sequence


class DraftRunner(Protocol):
    def draft_logits(self, seqs: list[Sequence], tokens: list[int], positions: list[int],
                     num_layers: int) -> torch.Tensor: ...


def propose(runner: DraftRunner, seqs: list[Sequence], rooms: list[int], num_layers: int) -> list[list[int]]:
    """Up to rooms[i] greedy tokens of the early-exit model after each sequence (its last token not
    yet computed), drafted for all sequences together, one position per forward."""
    drafts: list[list[int]] = [[] for _ in seqs]
    tokens = [seq.token_ids[-1] for seq in seqs]
    for step in range(max(rooms, default=0)):
        active = [i for i, room in enumerate(rooms) if step < room]
        logits = runner.draft_logits([seqs[i] for i in active], [tokens[i] for i in active],
                                     [seqs[i].num_tokens - 1 + step for i in active], num_layers)
        for row, i in enumerate(active):
            tokens[i] = int(logits[row].argmax())
            drafts[i].append(tokens[i])
    return drafts
