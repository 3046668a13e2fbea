"""`--speculative-config` (JSON, vLLM's keys) and how many tokens to draft at a given load."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model", "early_exit", "mtp")  # mtp: the checkpoint's MTP layer (DeepSeek V3)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1  # ngram: the shortest suffix looked up in the context
    prompt_lookup_max: int = 4  # ngram: the longest (tried first)
    model: str | None = None  # draft_model: a smaller model sharing the tokenizer (folder, GGUF or hub id)
    draft_layers: int | None = None  # early_exit: the first layers that draft (None: a quarter of them)
    # Speculation pays only while the machine has compute to spare: it shrinks as the running batch
    # grows and stops at this many sequences (vLLM's key of the same name). 4: on 2 CPU cores a
    # verification step of 4 sequences already costs more than its kept drafts save
    # (benchmarks/speculative.py).
    disable_by_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not served; one of {METHODS}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('"model" names the draft model, and only for method "draft_model"')
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError("draft_layers must be at least 1")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")

    @classmethod
    def parse(cls, value: str | dict) -> "SpeculativeConfig":
        """From the flag's JSON (or a dict); an unknown key is an error, not ignored."""
        data = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def verify_rows(self, max_num_seqs: int) -> int:
        """The most rows a verification step computes (each sequence's last token and its drafts), over
        every batch size up to max_num_seqs."""
        return max(b * (1 + self.tokens_at(b)) for b in range(1, max_num_seqs + 1))

    def tokens_at(self, batch_size: int) -> int:
        """Draft length when `batch_size` sequences decode together: all of num_speculative_tokens up
        to a quarter of disable_by_batch_size, half of them up to a half, one token below it, none
        from it on (each drafted token adds a row to every verification step)."""
        limit = self.disable_by_batch_size
        if batch_size >= limit:
            return 0
        if batch_size * 4 <= limit:
            return self.num_speculative_tokens
        if batch_size * 2 <= limit:
            return max(1, self.num_speculative_tokens // 2)
        return 1
