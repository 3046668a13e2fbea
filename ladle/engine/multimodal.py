"""A prompt's images as the engine sees them: token ids plus placeholder spans, each span the run of
placeholder tokens one image tile stands in for, with the embeddings that replace theirs.

The placeholder ids are the same for every image, so the prefix cache keys a block by `cache_tokens`:
the token ids with each placeholder replaced by its span's key, a negative number (no token id is)
drawn from the image's content hash and the tile, so one image's blocks never serve another's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass(frozen=True, eq=False)
class ImagePrompt:
    """A text prompt and the images it marks, one marker each where the chat template puts one (vLLM's
    {"prompt": ..., "multi_modal_data": {"image": ...}}): what goes to add_request in place of text."""

    text: str
    images: tuple["Image", ...]


@dataclass(frozen=True, eq=False)
class ImageTokens:
    """A prompt with images already expanded and encoded (ImagePrompts.prompt on the engine thread):
    its token ids and placeholder spans, for callers that read the ids before submitting (decisions)."""

    ids: list[int]
    spans: tuple["ImageSpan", ...]


@dataclass(frozen=True, eq=False)
class ImageSpan:
    offset: int  # prompt position of its first placeholder token
    embeds: torch.Tensor  # [length, hidden]: the input embeddings of its placeholders, in order
    key: int  # < 0: stands for each of its placeholders in prefix-cache keys
    grid: tuple[int, int] | None = None  # M-RoPE: its tokens' rows and columns (row by row); None: plain positions

    @property
    def length(self) -> int:
        return self.embeds.shape[0]

    @property
    def end(self) -> int:
        return self.offset + self.length


def span_key(image_hash: bytes, tile: int) -> int:
    """A negative int64 naming one tile of one image (its content hash and index)."""
    return -1 - (int.from_bytes(image_hash[:7], "little") * 64 + tile % 64)


def cache_tokens(token_ids: list[int], spans: tuple[ImageSpan, ...]) -> list[int]:
    """token_ids with each placeholder replaced by its span's key: what the prefix cache keys blocks by."""
    if not spans:
        return token_ids
    tokens = list(token_ids)
    for span in spans:
        tokens[span.offset : span.end] = [span.key] * span.length
    return tokens


def embedding_rows(spans: tuple[ImageSpan, ...], start: int, end: int, row: int) -> list[tuple[int, torch.Tensor]]:
    """The spans' embeddings a forward of positions [start, end) needs, at batch row `row` for position
    `start`: (first row, rows of embeddings) for each span the positions cut into, however they cut it."""
    out = []
    for span in spans:
        lo, hi = max(span.offset, start), min(span.end, end)
        if lo < hi:
            out.append((row + lo - start, span.embeds[lo - span.offset : hi - span.offset]))
    return out


def mrope_positions(spans: tuple[ImageSpan, ...], start: int, end: int) -> list[list[int]]:
    """Qwen2.5-VL's M-RoPE positions [3][end - start] (time, row, column) of positions [start, end): a text
    token's three are one number, its index less what the images before it saved; an image's tokens start
    where a text token there would, at one time, their rows and columns counted from it; the text after
    an image goes on from its largest row or column, plus one."""
    rows: list[list[int]] = [[], [], []]
    shift, spans = 0, [span for span in spans if span.grid is not None]
    for k in range(start, end):
        while spans and spans[0].end <= k:
            shift += spans[0].length - max(spans[0].grid)
            spans.pop(0)
        span = spans[0] if spans and spans[0].offset <= k else None
        p = k - shift
        if span is None:
            t = h = w = p
        else:
            j, first = k - span.offset, span.offset - shift
            t, h, w = first, first + j // span.grid[1], first + j % span.grid[1]
        for row, value in zip(rows, (t, h, w)):
            row.append(value)
    return rows
