"""A typed question in one shape, whichever dialect asked it, and the checks every dialect shares."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Literal

from ladle.errors import InvalidRequestError

Kind = Literal["choice", "score", "yes_no"]

MAX_QUESTIONS = 400
MAX_OPTIONS = 255  # two-letter labels past 26
MAX_LETTER_OPTIONS = 26
MAX_LEVELS = 10


@dataclass
class Option:
    """One answer the prompt lists: an option's name, a level's text, or (yes/no) "yes" or "no"."""

    name: str
    description: str | None = None


@dataclass
class Question:
    key: str  # the caller's name for it: the reference id, the System One key, the OpenAI name
    where: str  # the request field errors name, e.g. "questions[2]"
    kind: Kind
    text: str
    options: list[Option]
    calibration: str | None = None  # ladle's extensions: a loaded calibration or head, by name
    head: str | None = None
    extension_prefix: str = ""  # "x_" in the dialects where ladle's fields carry that prefix

    def field_name(self, extension: str) -> str:
        """The request field of an extension ("calibration" or "head") in this question's dialect."""
        return self.extension_prefix + extension

    def refuse(self, message: str, field: str | None = None, code: str | None = None) -> InvalidRequestError:
        """An error naming this question (by id) and the field at fault."""
        param = f"{self.where}.{field}" if field else self.where
        return InvalidRequestError(f"question {self.key!r} ({param}): {message}", param=param, code=code)


def is_blank(text: str | None) -> bool:
    return text is None or not text.strip()


def has_control_chars(text: str) -> bool:
    """Line breaks and other control characters (Unicode category C*, tabs included)."""
    return any(unicodedata.category(c).startswith("C") for c in text)


def check_count(q: Question, what: str, count: int, lo: int, hi: int) -> None:
    if not lo <= count <= hi:
        raise q.refuse(f"must have {lo} to {hi} items (got {count})", what)


def check_option_names(q: Question, field: str) -> None:
    """Names are non-empty, on one line, and distinct after trimming and case folding."""
    seen: dict[str, int] = {}
    for i, opt in enumerate(q.options):
        where = f"{field}[{i}]"
        if is_blank(opt.name):
            raise q.refuse("option names must not be blank", where)
        if has_control_chars(opt.name):
            raise q.refuse("option names must not hold line breaks or control characters", where)
        folded = opt.name.strip().casefold()
        if folded in seen:
            raise q.refuse(f"option {opt.name!r} repeats option {seen[folded]} "
                           "(names must differ after trimming and case folding)", where)
        seen[folded] = i
