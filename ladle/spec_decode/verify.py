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

import copy
from collections.abc import Callable

import torch

from ladle.engine.request import Sequence, TokenLogprob

Drawn = tuple[int, "TokenLogprob | None"]
Sample = Callable[[torch.Tensor, Sequence], Drawn]
SampleBatch = Callable[[torch.Tensor, list[Sequence]], list[Drawn]]


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


def verify_all(jobs: list[tuple[torch.Tensor, Sequence, list[int]]], sample: SampleBatch) -> list[list[Drawn]]:
    """verify() for each (rows, seq, drafts) job. The rows of every sequence drawn_at_once go through the
    sampler together, each row seeing the sequence as it stands there (its drafts before it), in one
    call: one device-to-host copy for them all, where row by row costs one per row. The others are
    verified row by row."""
    at_once = [j for j, (_, seq, _) in enumerate(jobs) if drawn_at_once(seq)]
    results: list[list[Drawn] | None] = [None] * len(jobs)
    if at_once:
        rows = torch.cat([jobs[j][0][: len(jobs[j][2]) + 1] for j in at_once])
        drawn = iter(sample(rows, [view for j in at_once for view in position_views(jobs[j][1], jobs[j][2])]))
        for j in at_once:
            drafts = jobs[j][2]
            results[j] = up_to_first_miss([next(drawn) for _ in range(len(drafts) + 1)], drafts)
    return [result if result is not None else verify(rows, seq, drafts, lambda row, s: sample(row[None], [s])[0])
            for result, (rows, seq, drafts) in zip(results, jobs)]


def drawn_at_once(seq: Sequence) -> bool:
    """Whether each row's draw depends only on the tokens before it: no grammar to advance over the
    drafts, no forced token, and no seeded generator (drawing for rows past a rejection would spend
    draws a run without speculation does not make)."""
    return seq.grammar is None and seq.forced_token is None and (seq.params.greedy or seq.generator is None)


def position_views(seq: Sequence, drafts: list[int]) -> list[Sequence]:
    """The sequence as the sampler sees it at each row: after its last token and drafts[:i] (penalties,
    min_tokens and bad words read its tokens)."""
    views = []
    for i in range(len(drafts) + 1):
        view = copy.copy(seq)
        view.token_ids = seq.token_ids + drafts[:i]
        views.append(view)
    return views


def up_to_first_miss(drawn: list[Drawn], drafts: list[int]) -> list[Drawn]:
    """The draws emitted: each that equals its draft, then the first that does not (or the bonus)."""
    for i, (token, _) in enumerate(drawn[: len(drafts)]):
        if token != drafts[i]:
            return drawn[: i + 1]
    return drawn[: len(drafts) + 1]
