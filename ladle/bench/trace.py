"""Replay a recorded trace on its own clock (`--dataset trace`): one JSON object a line, each a request
with its arrival `timestamp` in milliseconds (Mooncake's trace format), and either

- token lengths, `input_length` and `output_length`: a prompt of random words that long. Lines with
  `hash_ids` (Mooncake's) share prompt blocks where they share ids: block i of a prompt is the
  `--trace-block-len`-token text seeded by its id, so the trace's prefix sharing reaches the server's
  prefix cache; or
- ShareGPT-style turns, `conversations` (or `messages`): the first turn is the prompt, the second's
  length (or `output_length`) the reply's max_tokens.

Arrivals keep the trace's gaps, divided by `--trace-speedup`, from the first line's timestamp.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ladle.bench.datasets import SampleRequest
from ladle.bench.words import estimate_tokens, random_text

TRACE_KEYS = {"timestamp", "input_length", "output_length", "hash_ids", "conversations", "messages"}


def trace_dataset(rng: np.random.Generator, path: str | Path, n: int, speedup: float, block_len: int,
                  tokens_per_word: float) -> list[SampleRequest]:
    """The trace's first n requests, each with its arrival in seconds after the first."""
    if speedup <= 0:
        raise ValueError("--trace-speedup must be positive")
    lines = _read(path)[:n]
    start = lines[0][1]["timestamp"]
    out = []
    for number, entry in lines:
        request = _request(rng, entry, block_len, tokens_per_word, where=f"{path}:{number}")
        request.arrival = (entry["timestamp"] - start) / 1000.0 / speedup
        out.append(request)
    return out


def _read(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    lines = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        entry = json.loads(line)
        unknown = set(entry) - TRACE_KEYS if isinstance(entry, dict) else None
        if unknown is None or "timestamp" not in entry:
            raise ValueError(f"{path}:{number}: a trace line is a JSON object with a timestamp (ms)")
        if unknown:
            raise ValueError(f"{path}:{number}: unknown trace fields {sorted(unknown)}; a line has "
                             f"{', '.join(sorted(TRACE_KEYS))}")
        lines.append((number, entry))
    if not lines:
        raise ValueError(f"{path}: the trace is empty")
    if any(b[1]["timestamp"] < a[1]["timestamp"] for a, b in zip(lines, lines[1:])):
        raise ValueError(f"{path}: timestamps must not go back")
    return lines


def _request(rng: np.random.Generator, entry: dict[str, Any], block_len: int, tokens_per_word: float,
             where: str) -> SampleRequest:
    turns = entry.get("conversations") or entry.get("messages")
    if turns is not None:
        texts = [t.get("value", t.get("content")) for t in turns if isinstance(t, dict)]
        if not texts or not isinstance(texts[0], str):
            raise ValueError(f"{where}: conversations need a first turn with text")
        output_len = entry.get("output_length")
        if output_len is None:
            output_len = estimate_tokens(texts[1]) if len(texts) > 1 and isinstance(texts[1], str) else None
        if output_len is None:
            raise ValueError(f"{where}: give output_length, or a second turn to take the reply's length from")
        return SampleRequest(prompt=texts[0], prompt_len=estimate_tokens(texts[0]), output_len=int(output_len))
    if "input_length" not in entry or "output_length" not in entry:
        raise ValueError(f"{where}: a line has input_length and output_length, or conversations")
    length = int(entry["input_length"])
    prompt = _prompt(rng, length, entry.get("hash_ids"), block_len, tokens_per_word)
    return SampleRequest(prompt=prompt, prompt_len=length, output_len=int(entry["output_length"]))


def _prompt(rng: np.random.Generator, length: int, hash_ids: list[int] | None, block_len: int,
            tokens_per_word: float) -> str:
    """`length` tokens of words: block by block from their hash ids where the line has them (a shorter
    last block is the start of the full one: the same draws, fewer of them)."""
    if not hash_ids:
        return random_text(rng, length, tokens_per_word)
    blocks, left = [], length
    for block_id in hash_ids:
        if left <= 0:
            break
        size = min(block_len, left)
        blocks.append(random_text(np.random.default_rng(int(block_id)), size, tokens_per_word))
        left -= size
    if left > 0:  # a last stretch no block names: this request's own
        blocks.append(random_text(rng, left, tokens_per_word))
    return " ".join(blocks)
