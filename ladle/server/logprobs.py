"""Engine logprobs in OpenAI's two shapes, chat (`content` list) and legacy completions, and prompt
logprobs in vLLM's."""

from __future__ import annotations

import re
from functools import lru_cache

from ladle.engine.request import TokenLogprob
from ladle.model.tokenizer import Tokenizer
from ladle.server.protocol import (
    ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob,
)

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the printable stand-in of each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenNames:
    """How a token id reads in a logprobs entry: its text and its exact bytes (cached)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        # A token holding part of a UTF-8 character decodes to U+FFFD; its bytes are still exact.
        piece = self.tokenizer.id_to_token(token_id) or ""
        if m := _SP_BYTE.match(piece):
            return [int(m.group(1), 16)]
        table = _byte_level_decoder()
        if piece and all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
        return list(self._text(token_id).encode("utf-8"))


def chat_logprobs(names: TokenNames, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    def entry(token_id: int, lp: float) -> TopLogprob:
        return TopLogprob(token=names.text(token_id), logprob=_finite(lp), bytes=names.bytes(token_id))

    content = [
        ChatTokenLogprob(**entry(lp.token_id, lp.logprob).model_dump(),
                         top_logprobs=[entry(t, v) for t, v in lp.top])
        for lp in logprobs
    ]
    return ChatLogprobs(content=content)


class CompletionLogprobsBuilder:
    """Accumulates legacy-completions logprobs for one choice; text offsets run across calls."""

    def __init__(self, names: TokenNames, text_offset: int = 0):
        self.names = names
        self.offset = text_offset

    def build(self, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, lp in zip(token_ids, logprobs):
            text = self.names.text(token_id)
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if lp is None:  # the first prompt token: nothing predicts it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(lp.logprob))
            top = {self.names.text(t): _finite(v) for t, v in lp.top}
            top.setdefault(text, _finite(lp.logprob))  # vLLM includes the chosen token
            out.top_logprobs.append(top)
        return out


def prompt_logprobs_of(names: TokenNames, logprobs: list[TokenLogprob | None]) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, its own entry first (with its rank), then the most
    likely tokens ranked 1, 2, ...; an entry met twice keeps its place and takes the later rank, as
    vLLM's dict does."""
    def entry(token_id: int, lp: float, rank: int | None) -> PromptLogprob:
        return PromptLogprob(logprob=_finite(lp), rank=rank, decoded_token=names.text(token_id))

    out: PromptLogprobs = []
    for lp in logprobs:
        if lp is None:
            out.append(None)
            continue
        entries = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
        for rank, (token_id, value) in enumerate(lp.top, 1):
            entries[str(token_id)] = entry(token_id, value, rank)
        out.append(entries)
    return out


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number (vLLM uses the same floor)
    return max(x, -9999.0)
