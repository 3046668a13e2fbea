"""Think blocks out of a reasoning model's reply: reasoning_content apart from content.

One parser serves the `<think>...</think>` family (DeepSeek-R1, Qwen3); vLLM's names for it
(--reasoning-parser) are all accepted. gpt-oss's harmony replies (`gpt_oss`, or vLLM's
`openai_gptoss`) are read by ladle.tools.harmony instead; their tags here serve the engine's
thinking budget (ladle.reasoning.budget). The rules, the same for a whole reply and for a stream of
text deltas cut anywhere:
- the block is open from the start when the prompt left it open (the chat template wrote the
  start tag); else it opens only if the reply begins, after whitespace, with the start tag;
- a start tag at the top of an already open block is dropped (models sometimes repeat it);
- the block ends at its first end tag; everything after it is content, leading whitespace dropped;
- a block never closed is all reasoning; a reply that opens none is all content, as written.

A stream holds back only what could still turn into a tag and releases everything else at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ladle.reasoning import harmony

THINK_PARSERS = ("deepseek_r1", "qwen3", "think")
HARMONY_PARSERS = ("gpt_oss", "openai_gptoss")
REASONING_PARSERS = THINK_PARSERS + HARMONY_PARSERS


@dataclass(frozen=True)
class ThinkTags:
    start: str = "<think>"
    end: str = "</think>"
    close: str | None = None  # what budget forcing writes to end the block; None: the end tag and a blank line


DEFAULT_TAGS = ThinkTags()
# an analysis message that opens the reply; forced closed, it gives way to the final answer
HARMONY_TAGS = ThinkTags(harmony.ANALYSIS_HEADER, harmony.END, close=harmony.END + harmony.FINAL_HEADER)


def tags_for(parser_name: str) -> ThinkTags:
    """The tags of a --reasoning-parser name."""
    if parser_name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser_name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return HARMONY_TAGS if is_harmony(parser_name) else DEFAULT_TAGS


def is_harmony(parser_name: str | None) -> bool:
    """Whether a --reasoning-parser name reads gpt-oss's harmony format."""
    return parser_name in HARMONY_PARSERS


def prompt_opens_reasoning(prompt_text: str, tags: ThinkTags = DEFAULT_TAGS) -> bool:
    """Whether the prompt ends inside an open think block: its last start tag is after its last end tag."""
    return prompt_text.rfind(tags.start) > prompt_text.rfind(tags.end)


def split_reasoning(text: str, in_reasoning: bool, tags: ThinkTags = DEFAULT_TAGS) -> tuple[str | None, str | None]:
    """A whole reply -> (reasoning_content, content); reasoning is None when no block opened, content when empty."""
    body = text.lstrip()
    if body.startswith(tags.start):  # the reply opens the block, or repeats the prompt's start tag
        text = body[len(tags.start) :]
    elif not in_reasoning:
        return None, text or None
    reasoning, closed, content = text.partition(tags.end)
    return reasoning, (content.lstrip() if closed else "") or None


def _partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper prefix of tag (what may still become it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _Phase(enum.Enum):
    OPENING = "opening"  # only whitespace and maybe part of a start tag seen: not yet known if one comes
    THINKING = "thinking"
    ANSWER = "answer"


class ReasoningStream:
    """One reply's text deltas in, (reasoning delta, content delta) out; "" where nothing is released yet."""

    def __init__(self, in_reasoning: bool, tags: ThinkTags = DEFAULT_TAGS) -> None:
        self.tags = tags
        self.reasoning_started = in_reasoning  # a block was opened, by the prompt or by the reply
        self._phase = _Phase.OPENING
        self._held = ""  # text received but not yet released
        self._answer_began = False  # until it does, whitespace after the end tag is dropped

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        return self._release(final=False)

    def finish(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the reply."""
        return self._release(final=True)

    def _release(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._phase is _Phase.OPENING:
            self._decide_opening(final)
        if self._phase is _Phase.THINKING:
            reasoning = self._release_thinking(final)
        if self._phase is _Phase.ANSWER:
            content = self._release_answer()
        return reasoning, content

    def _decide_opening(self, final: bool) -> None:
        body = self._held.lstrip()
        if body.startswith(self.tags.start):  # the tag and the whitespace before it are dropped
            self._held = body[len(self.tags.start) :]
            self.reasoning_started = True
            self._phase = _Phase.THINKING
        elif final or not self.tags.start.startswith(body):
            # no start tag: the prompt's open block goes on, or the reply is plain content as written
            self._phase = _Phase.THINKING if self.reasoning_started else _Phase.ANSWER
            self._answer_began = not self.reasoning_started

    def _release_thinking(self, final: bool) -> str:
        at = self._held.find(self.tags.end)
        if at >= 0:
            reasoning, self._held = self._held[:at], self._held[at + len(self.tags.end) :]
            self._phase = _Phase.ANSWER
            return reasoning
        keep = 0 if final else _partial_tag_len(self._held, self.tags.end)
        cut = len(self._held) - keep
        reasoning, self._held = self._held[:cut], self._held[cut:]
        return reasoning

    def _release_answer(self) -> str:
        content, self._held = self._held, ""
        if not self._answer_began:
            content = content.lstrip()
            self._answer_began = bool(content)
        return content
