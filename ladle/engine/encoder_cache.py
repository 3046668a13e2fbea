"""The vision encoder's outputs by image content hash, least recently used out first once over a size
bound: several questions about one image (decisions, turns of a chat) encode it once."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class EncodedImage:
    """One image as the prompt takes it: the text standing in for it (its placeholders, with whatever
    marks its tiles) and each tile's embeddings, in the order of their placeholder runs."""

    placeholders: str
    tiles: list[torch.Tensor]
    grids: list[tuple[int, int] | None] | None = None  # M-RoPE: each tile's rows and columns of tokens

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tiles) + len(self.placeholders)


@dataclass
class EncoderStats:
    """Running totals, read by the metrics."""

    images: int = 0  # images received
    runs: int = 0  # images the encoder ran on
    seconds: float = 0.0  # spent encoding
    hits: int = 0  # images found in the cache


class EncoderCache:
    def __init__(self, max_bytes: int):
        """max_bytes 0: nothing is kept (every image is encoded)."""
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: OrderedDict[bytes, EncodedImage] = OrderedDict()

    def get(self, key: bytes) -> EncodedImage | None:
        image = self.entries.get(key)
        if image is not None:
            self.entries.move_to_end(key)
        return image

    def put(self, key: bytes, image: EncodedImage) -> None:
        if image.nbytes > self.max_bytes or key in self.entries:
            return
        self.entries[key] = image
        self.bytes += image.nbytes
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
