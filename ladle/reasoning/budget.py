"""Thinking budgets: each sequence's reasoning tokens counted as they are generated, and the think
block closed by the engine itself once the budget is spent (budget forcing).

Reasoning tokens are the output tokens inside the think block, between its tags: neither the
start tag the model may write nor the end tag count. Detection reads the output text, so it
holds whatever tokens the model used to spell a tag. When the budget runs out the engine emits
the end tag and a blank line (the tokenizer's spelling of them) in place of what the model
would have sampled, then lets the model answer: the answer always comes. gpt-oss's tags
(--reasoning-parser gpt_oss) are those of an analysis message, and its close is the end of that
message and the header of the final one; they are special tokens, seen only in output decoded
with them (skip_special_tokens false, as the server decodes harmony chat replies).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ladle.reasoning.parser import ThinkTags, prompt_opens_reasoning

# reasoning_effort -> thinking budget in tokens (OpenAI's levels; "none" and "minimal" skip thinking)
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 256, "medium": 1024, "high": 4096}
CLOSING_TEXT = "\n\n"  # forced after the end tag, so the answer starts on a line of its own
PROMPT_TAIL_TOKENS = 32  # a template opens the block at the very end of the prompt


class Phase(enum.Enum):
    UNDECIDED = "undecided"  # the prompt left no block open; the output may open one with its first text
    THINKING = "thinking"
    CLOSING = "closing"  # the engine is emitting the end tag
    ANSWER = "answer"


@dataclass(frozen=True)
class ReasoningSpec:
    """What the engine knows about a reasoning model's think blocks."""

    tags: ThinkTags
    close_token_ids: tuple[int, ...]  # what budget forcing emits

    @classmethod
    def of(cls, tokenizer, tags: ThinkTags) -> "ReasoningSpec":
        close = tags.end + CLOSING_TEXT if tags.close is None else tags.close
        return cls(tags, tuple(tokenizer.encode(close, add_special_tokens=False)))

    def tracker(self, prompt_tail_text: str, budget: int | None) -> "ReasoningTracker":
        opened = prompt_opens_reasoning(prompt_tail_text, self.tags)
        tracker = ReasoningTracker(self, Phase.THINKING if opened else Phase.UNDECIDED, budget)
        tracker.check_budget()
        return tracker


@dataclass
class ReasoningTracker:
    """One sequence's think block, fed the output text after every token."""

    spec: ReasoningSpec
    phase: Phase
    budget: int | None  # None: unlimited
    num_reasoning_tokens: int = 0
    forced: list[int] = field(default_factory=list)  # tokens the engine must emit next, in order
    _block_start: int = 0  # where the block's text begins in the output text
    _starts: list[int] = field(default_factory=list)  # text offset at which each reasoning token began

    @property
    def may_force(self) -> bool:
        """Whether budget forcing may still take over this sequence's next tokens."""
        return self.budget is not None and self.phase is not Phase.ANSWER

    def observe(self, text: str, text_before: int) -> None:
        """The output text after a token whose own text began at offset text_before."""
        if self.phase is Phase.CLOSING:
            if not self.forced:
                self.phase = Phase.ANSWER
        elif self.phase is Phase.UNDECIDED:
            self._decide(text)
        elif self.phase is Phase.THINKING:
            self._think(text, text_before)

    def check_budget(self) -> None:
        if self.phase is Phase.THINKING and self.budget is not None and self.num_reasoning_tokens >= self.budget:
            self.phase = Phase.CLOSING
            self.forced = list(self.spec.close_token_ids)

    def _decide(self, text: str) -> None:
        start = self.spec.tags.start
        body = text.lstrip()
        if body.startswith(start):
            self.phase = Phase.THINKING
            self._block_start = len(text) - len(body) + len(start)
            self.check_budget()
        elif not start.startswith(body):
            self.phase = Phase.ANSWER

    def _think(self, text: str, text_before: int) -> None:
        end = self.spec.tags.end
        at = text.find(end, max(self._block_start, text_before - len(end) + 1))
        if at < 0:
            self._starts.append(text_before)
            self.num_reasoning_tokens += 1
            self.check_budget()
            return
        # the tag ended the block: the tokens that began before it were reasoning
        self.num_reasoning_tokens = sum(1 for s in self._starts if s < at) + (text_before < at)
        self.phase = Phase.ANSWER
        self._starts = []
