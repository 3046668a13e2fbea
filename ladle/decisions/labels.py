"""Answer labels and the one-distinct-token check at the answer position.

A label works only if appending it to the rendered prompt text adds exactly one token,
different from every other label's token: then that token's probability at the position
after the prompt is the probability of the label.

Encoding the whole prompt once per label is slow (26 labels x 500 tokens, per question), so
labels are checked against the prompt's tail after its last added token (the tokenizer
splits text at added tokens, so text past the last one is encoded on its own). The tail is
used only when it encodes to exactly the prompt's last ids; otherwise the whole prompt is.
"""

from __future__ import annotations

import itertools
import string

from ladle.decisions.question import MAX_LETTER_OPTIONS, Question
from ladle.model.tokenizer import Tokenizer

LETTERS = list(string.ascii_uppercase)
DIGITS = list(string.digits)
YES_NO = ["yes", "no"]
TWO_LETTERS = ["".join(p) for p in itertools.product(string.ascii_uppercase, repeat=2)]  # AA, AB, ..., ZZ


def base_labels(q: Question) -> list[str] | None:
    """The labels of q, or None when it needs two-letter labels (more than 26 options)."""
    n = len(q.options)
    if q.kind == "yes_no":
        return list(YES_NO)
    if q.kind == "score":
        return DIGITS[:n]
    return LETTERS[:n] if n <= MAX_LETTER_OPTIONS else None


class LabelChecker:
    """Checks labels for one request's prompts; prompts sharing a tail share the work."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.added = [t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.content]
        self._single: dict[tuple[str, str], int | None] = {}  # (tail, label) -> its one token, or None

    def label_ids(self, prompt: str, prompt_ids: list[int], labels: list[str]) -> list[int | None]:
        """Each label's one token at the answer position, or None where it is not one token."""
        tail, tail_ids = self._tail(prompt, prompt_ids)
        missing = [label for label in labels if (tail, label) not in self._single]
        if missing:
            encoded = self.tokenizer.backend.encode_batch([tail + label for label in missing],
                                                          add_special_tokens=False)
            n = len(tail_ids)
            for label, enc in zip(missing, encoded):
                ok = len(enc.ids) == n + 1 and enc.ids[:n] == tail_ids
                self._single[(tail, label)] = enc.ids[n] if ok else None
        return [self._single[(tail, label)] for label in labels]

    def check(self, q: Question, prompt: str, prompt_ids: list[int], labels: list[str]) -> list[int]:
        """The labels' token ids; refuses (400 naming the question and label) any that is not one distinct token."""
        ids = self.label_ids(prompt, prompt_ids, labels)
        first: dict[int, str] = {}
        for label, token in zip(labels, ids):
            if token is None:
                raise q.refuse(f"label {label!r} does not encode as exactly one token at the answer position "
                               "with this model's tokenizer; this model is not supported for this question",
                               code="unsupported_label")
            if token in first:
                raise q.refuse(f"labels {first[token]!r} and {label!r} encode as the same token at the answer "
                               "position; this model is not supported for this question", code="unsupported_label")
            first[token] = label
        return [t for t in ids if t is not None]

    def two_letter_labels(self, q: Question, prompt: str, prompt_ids: list[int]) -> list[str]:
        """The first n two-letter labels (AA, AB, ...) that are each one distinct token at this answer position."""
        n = len(q.options)
        picked, seen = [], set()
        for label, token in zip(TWO_LETTERS, self.label_ids(prompt, prompt_ids, TWO_LETTERS)):
            if token is not None and token not in seen:
                picked.append(label)
                seen.add(token)
                if len(picked) == n:
                    return picked
        raise q.refuse(f"{n} options need {n} two-letter labels that are each one distinct token at the answer "
                       f"position, and this model's tokenizer has only {len(picked)}", code="unsupported_label")

    def _tail(self, prompt: str, prompt_ids: list[int]) -> tuple[str, list[int]]:
        cut = max((prompt.rfind(t) + len(t) for t in self.added if t in prompt), default=-1)
        if 0 < cut < len(prompt):
            tail = prompt[cut:]
            tail_ids = self.tokenizer.encode(tail)
            if tail_ids and prompt_ids[-len(tail_ids):] == tail_ids:
                return tail, tail_ids
        return prompt, prompt_ids
