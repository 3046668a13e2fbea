"""The encoder cache keeps images by content hash under its byte bound, least recently used out first."""

from __future__ import annotations

import torch

from ladle.engine.encoder_cache import EncodedImage, EncoderCache


def image(rows: int) -> EncodedImage:
    return EncodedImage("", [torch.zeros(rows, 4)])  # 16 bytes a row


def test_the_least_recently_used_image_goes_first_once_over_the_bound() -> None:
    cache = EncoderCache(max_bytes=3 * 16)
    a, b, c = image(1), image(1), image(1)
    cache.put(b"a", a)
    cache.put(b"b", b)
    assert cache.get(b"a") is a  # a is now the most recent
    cache.put(b"c", c)
    cache.put(b"d", image(1))
    assert cache.get(b"b") is None and cache.get(b"a") is a and cache.get(b"c") is c
    assert cache.bytes == 3 * 16


def test_an_image_over_the_bound_is_never_kept() -> None:
    cache = EncoderCache(max_bytes=16)
    cache.put(b"big", image(2))
    cache.put(b"small", image(1))
    assert cache.get(b"big") is None and cache.get(b"small") is not None
    assert EncoderCache(0).get(b"x") is None
