"""Output text of one sequence: incremental detokenisation plus stop strings.

Text that could still turn out to be the start of a stop string is held back, so a
streamed client never sees stop text that a later token completes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ladle.engine.request import StepOutput


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str: ...


class OutputTextTracker:
    def __init__(self, detokenizer: Detokenizer, stop: list[str]):
        self.detokenizer = detokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.released = 0

    def append(self, token_id: int) -> str | None:
        """Add a token's text. Returns the stop string it completed (the text is cut
        before it) or None."""
        old_len = len(self.text)
        self.text += self.detokenizer.step(token_id)
        if not self.stop or len(self.text) == old_len:
            return None
        window_start = max(0, old_len - self.hold)
        hits = [(self.text.find(s, window_start), s) for s in self.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return None
        pos, s = min(hits)
        self.text = self.text[:pos]
        return s

    def release(self, finished: bool) -> str:
        """Text that is now safe to hand to the client."""
        end = len(self.text) if finished else max(self.released, len(self.text) - self.hold)
        out = self.text[self.released : end]
        self.released = end
        return out


def keep_stop_strings(out: StepOutput) -> StepOutput:
    """include_stop_str_in_output: the tracker cut the text right before the stop string it matched;
    vLLM cuts right after it instead, so each text that a stop string ended gets it back."""
    for delta in out.deltas:
        if delta.finish_reason == "stop" and isinstance(delta.stop_reason, str):
            delta.text += delta.stop_reason
    return out
