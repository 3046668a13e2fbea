"""The offload tier on its own: bit-exact round trips, the byte bound with LRU order, damaged files
that fail safe, the canonical flag, and a private directory that close() removes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ladle.engine.kv_offload import OffloadTier, block_bytes

LAYERS, NUM_BLOCKS, BLOCK, HEADS, DIM = 2, 3, 4, 2, 8
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]


def cache(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    """K, V and, for 8-bit dtypes, their float32 scales, laid out as the runner holds them."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, NUM_BLOCKS, BLOCK, HEADS, DIM)
    if dtype == torch.int8:
        kv = [torch.randint(-128, 128, shape, dtype=torch.int8, generator=g) for _ in range(2)]
    else:
        kv = [(torch.randn(shape, generator=g) * 4).to(dtype) for _ in range(2)]
    if dtype.itemsize == 1:
        kv += [torch.rand(shape[:-1], generator=g) for _ in range(2)]
    return kv


def views(tensors: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[:, block] for t in tensors]


def raw(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous().view(torch.uint8).clone() for t in tensors]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)) for x, y in zip(a, b))


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


ONE = block_bytes(views(cache(), 0))


@pytest.fixture
def tier(tmp_path: Path):
    t = OffloadTier(str(tmp_path), capacity_bytes=4 * ONE)
    yield t
    t.close()


def file_of(tier: OffloadTier, k: bytes) -> Path:
    return Path(tier.directory) / (k.hex() + ".kv")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    src, dst = cache(dtype, seed=1), cache(dtype, seed=2)
    tier = OffloadTier(str(tmp_path), capacity_bytes=10 * block_bytes(views(src, 0)))
    tier.store(key(1), views(src, 1), canonical=False)
    before = raw(views(dst, 0) + views(dst, 2))
    assert tier.load(key(1), views(dst, 1))
    assert same_bits(views(dst, 1), views(src, 1))
    assert same_bits(views(dst, 0) + views(dst, 2), before)  # the other blocks are untouched
    assert tier.stats.stored == tier.stats.restored == 1 and tier.stats.dropped == 0
    tier.close()


def test_block_bytes_is_the_payload() -> None:
    assert ONE == 2 * LAYERS * BLOCK * HEADS * DIM * 4
    assert block_bytes(views(cache(torch.int8), 0)) == 2 * LAYERS * BLOCK * HEADS * (DIM + 4)


def test_the_bound_holds_and_the_least_recently_used_goes(tier: OffloadTier) -> None:
    kv = cache()
    for i in range(4):
        tier.store(key(i), views(kv, i % NUM_BLOCKS), canonical=False)
    assert tier.num_blocks == 4 and tier.used_bytes == 4 * ONE == tier.capacity_bytes
    assert tier.load(key(0), views(cache(seed=9), 0))  # 0 is now the most recently used
    tier.store(key(1), views(kv, 1), canonical=False)  # a refresh: 1 next to last
    tier.store(key(4), views(kv, 0), canonical=False)
    assert not tier.contains(key(2)) and all(tier.contains(key(i)) for i in (0, 1, 3, 4))
    tier.store(key(5), views(kv, 0), canonical=False)
    assert not tier.contains(key(3))
    assert tier.stats.stored == 6 and tier.stats.dropped == 2
    for i in range(6, 40):
        tier.store(key(i), views(kv, i % NUM_BLOCKS), canonical=False)
        assert tier.used_bytes <= tier.capacity_bytes and tier.num_blocks <= 4
    assert tier.stats.stored == 40 and tier.stats.dropped == 36  # the refresh of 1 stored nothing
    assert sorted(p.name for p in Path(tier.directory).iterdir()) == sorted(key(i).hex() + ".kv" for i in range(36, 40))


def test_an_oversize_block_is_not_stored(tmp_path: Path) -> None:
    tier = OffloadTier(str(tmp_path), capacity_bytes=ONE - 1)
    tier.store(key(1), views(cache(), 0), canonical=True)
    assert not tier.contains(key(1)) and tier.num_blocks == tier.used_bytes == 0
    assert tier.stats.stored == 0 and tier.stats.dropped == 1
    assert not any(Path(tier.directory).iterdir())
    tier.close()


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-7] ^= 0x5A  # in the payload
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[: len(data) - 3]))
    elif how == "header":
        path.write_bytes(b"XXXX" + bytes(data[4:]))
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["flip", "truncate", "header", "delete"])
def test_a_damaged_file_fails_safe(tier: OffloadTier, how: str, caplog: pytest.LogCaptureFixture) -> None:
    tier.store(key(1), views(cache(), 0), canonical=True)
    damage(file_of(tier, key(1)), how)
    out = views(cache(seed=5), 0)
    before = raw(out)
    with caplog.at_level(logging.WARNING, logger="ladle"):
        assert not tier.load(key(1), out)
    assert same_bits(out, before)
    assert not tier.contains(key(1)) and tier.num_blocks == tier.used_bytes == 0
    assert not file_of(tier, key(1)).exists()
    assert tier.stats.dropped == 1 and tier.stats.restored == 0
    assert "unreadable" in caplog.text


@pytest.mark.parametrize("change", ["shape", "dtype", "count"])
def test_a_layout_mismatch_fails_safe(tier: OffloadTier, change: str) -> None:
    tier.store(key(1), views(cache(), 0), canonical=False)
    if change == "shape":
        out = [torch.zeros(LAYERS, BLOCK, HEADS * DIM) for _ in range(2)]
    elif change == "dtype":
        out = views(cache(torch.float16), 0)
    else:
        out = views(cache(), 0)[:1]
    before = raw(out)
    assert not tier.load(key(1), out)
    assert same_bits(out, before) and not tier.contains(key(1)) and tier.stats.dropped == 1


def test_a_missing_key_is_not_a_drop(tier: OffloadTier) -> None:
    assert not tier.load(key(7), views(cache(), 0))
    assert tier.stats.dropped == 0


def test_canonical_flag(tier: OffloadTier) -> None:
    batched, canonical = cache(seed=1), cache(seed=2)
    tier.store(key(1), views(batched, 0), canonical=False)
    assert tier.contains(key(1)) and not tier.contains(key(1), canonical_only=True)
    tier.store(key(1), views(canonical, 0), canonical=True)  # a canonical copy takes the entry over
    assert tier.contains(key(1), canonical_only=True) and tier.num_blocks == 1 and tier.used_bytes == ONE
    tier.store(key(1), views(batched, 0), canonical=False)  # and a batched one does not undo it
    assert tier.contains(key(1), canonical_only=True)
    out = views(cache(seed=3), 0)
    assert tier.load(key(1), out) and same_bits(out, views(canonical, 0))


def test_discard(tier: OffloadTier) -> None:
    tier.store(key(1), views(cache(), 0), canonical=False)
    tier.discard(key(1))
    tier.discard(key(2))
    assert tier.num_blocks == tier.used_bytes == 0 and not file_of(tier, key(1)).exists()
    assert tier.stats.dropped == 0


def test_a_failed_write_is_dropped_and_warned_once(tier: OffloadTier, caplog: pytest.LogCaptureFixture) -> None:
    Path(tier.directory).rmdir()  # every open() now fails, like a full or vanished disk
    with caplog.at_level(logging.WARNING, logger="ladle"):
        for i in range(3):
            tier.store(key(i), views(cache(), 0), canonical=False)
    assert tier.num_blocks == tier.used_bytes == 0
    assert tier.stats.stored == 0 and tier.stats.dropped == 3
    assert caplog.text.count("cannot write") == 1


def test_tiers_on_one_directory_are_private_and_close_removes_them(tmp_path: Path) -> None:
    parent = tmp_path / "not" / "yet"
    a, b = OffloadTier(str(parent), ONE), OffloadTier(str(parent), ONE)
    assert a.directory != b.directory and Path(a.directory).parent == Path(b.directory).parent == parent
    a.store(key(1), views(cache(), 0), canonical=False)
    assert not b.contains(key(1)) and not any(Path(b.directory).iterdir())
    a.close()
    a.close()  # idempotent
    assert not Path(a.directory).exists() and Path(b.directory).is_dir()
    assert a.num_blocks == a.used_bytes == 0
    b.close()
    assert not any(parent.iterdir())


def test_a_temporary_directory_when_none_is_given() -> None:
    tier = OffloadTier(None, ONE)
    assert Path(tier.directory).is_dir() and Path(tier.directory).name.startswith("ladle-kv-")
    tier.close()
    assert not Path(tier.directory).exists()
