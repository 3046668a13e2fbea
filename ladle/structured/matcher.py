"""One sequence's place in its grammar, and the batch's token masks applied in one call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar


class GrammarState:
    """Advances with each accepted token; `rollback` undoes the last tokens (speculative
    decoding rejects drafted tokens after they were accepted here)."""

    def __init__(self, compiled: "xgrammar.CompiledGrammar"):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        ok = self._matcher.accept_token(token_id)
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set to -inf, in place, every logit a row's grammar forbids next ([B, V] float32 logits, any device).

    xgrammar fills one bit per token (bit j of word w: token 32w + j) in a CPU bitmask; it goes to the
    logits' device in one copy that does not wait for the device (pinned), and is unpacked there with
    torch rather than by xgrammar's CPU kernel: 1.3 ms against 4.5 ms for 16 rows of a 49k vocabulary
    where the grammar allows few tokens (the common case inside JSON)."""
    vocab, device = logits.shape[-1], logits.device
    pinned = device.type == "cuda"
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32, pin_memory=pinned)
    for i, state in enumerate(states):
        state.fill_mask(bitmask, i)
    words = bitmask.to(device, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, :vocab].bool()
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows, pin_memory=pinned).to(device, non_blocking=True)
        logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
