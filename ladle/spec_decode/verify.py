"""Which drafted tokens the target keeps.

Drafts are proposed deterministically (a lookup, or a drafter's argmax), so the draft
distribution q is a point mass on each drafted token d. Leviathan et al.'s rule, accept d
with probability min(1, p(d)/q(d)) = p(d) and on rejection draw from max(p - q, 0)
normalised (p without d), is then exactly: draw the token from the target's p and keep the
draft while it equals that draw. That is what this does, position by position, with the
request's own sampler (temperature, top-k/p, penalties seeing the tokens kept so far) and
generator: every emitted token costs one draw, as without speculation, so a seeded request
emits the same tokens with or without it. A grammar advances over the drafts kept so far, so
each row is masked as it would be, and is rolled back at the end (the engine then advances it
over the emitted tokens as over any sampled one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ladle.engine.request import Sequence, TokenLogprob

Sample = Callable[[torch.Tensor, Sequence], tuple[int, "TokenLogprob | None"]]


def verify(rows: torch.Tensor, seq: Sequence, drafts: list[int], sample: Sample) -> list[tuple[int, TokenLogprob | None]]:
    """rows[i]: the target's logits after the sequence's last token and drafts[:i]. Returns the
    tokens emitted this step: the drafts kept, then one drawn token (the correction at the first
    mismatch, or a bonus token after the last draft)."""
    emitted: list[tuple[int, TokenLogprob | None]] = []
    kept = 0
    try:
        for i, row in enumerate(rows[: len(drafts) + 1]):
            token, logprob = sample(row, seq)
            emitted.append((token, logprob))
            if i == len(drafts) or token != drafts[i]:
                break
            if seq.grammar is not None and not seq.grammar.accept(token):
                break  # (only where the mask let everything through) it ends this step as the drawn token
            seq.token_ids.append(token)  # for now: the next position's penalties and mask count it
            kept += 1
    finally:
        del seq.token_ids[len(seq.token_ids) - kept :]
        if seq.grammar is not None and kept:
            seq.grammar.rollback(kept)
    return emitted
