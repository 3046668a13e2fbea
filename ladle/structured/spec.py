"""What a request constrains its output to: vLLM's `StructuredOutputsParams`, engine side."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ladle.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints. `json` is a JSON schema (dict or JSON text), `regex` a
    regular expression, `choice` a list of strings, `grammar` an EBNF grammar (xgrammar's
    GBNF dialect), `json_object` any JSON object. Output matches it in full, or is cut by
    max_tokens. `disable_any_whitespace` (default true in ladle) lets JSON carry only the
    separators ", " and ": ", which keeps a small model from looping on whitespace;
    `strict` (OpenAI's json_schema.strict) forbids properties and items the schema does not name."""

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True
    strict: bool = True
    field: str = "structured_outputs"  # the request field it came from, for error messages

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError(f"{self.field} must set exactly one of {', '.join(KINDS)} "
                                      f"(got {', '.join(set_kinds) or 'none'})", param=self.field)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(f"{self.field}.choice must be a non-empty list of non-empty strings",
                                      param=f"{self.field}.choice")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (the cache key)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        return self.kind, value, self.disable_any_whitespace, self.strict
