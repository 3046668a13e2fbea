"""The second KV tier: evicted prefix-cache blocks kept in files on local disk, bounded, LRU.

One file per block, named by the block's key: magic "LKV1", version u16, header length u32, crc32
u32 of the payload, the header (JSON: [dtype, shape] per tensor), then the tensors' raw bytes in
order. A load checks all of it against the tensors it fills before writing any of them, so a
damaged or foreign file means "recompute the block", never wrong K/V. Capacity counts payload bytes
only (`block_bytes`, the KV pool's own arithmetic); each file's header adds about a hundred more.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import struct
import tempfile
import weakref
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger("ladle")

MAGIC = b"LKV1"
VERSION = 1
PREFIX = struct.Struct("<4sHII")  # magic, version, header length, crc32 of the payload


@dataclass
class OffloadStats:
    stored: int = 0  # blocks written to the tier
    restored: int = 0  # blocks read back (successful loads)
    dropped: int = 0  # blocks that left the tier unread: evicted for room, damaged, or never written


@dataclass
class _Entry:
    nbytes: int
    canonical: bool


def block_bytes(tensors: list[torch.Tensor]) -> int:
    """The payload bytes one block's tensors take in the tier (its capacity unit)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _header(tensors: list[torch.Tensor]) -> bytes:
    return json.dumps([[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]).encode()


def _raw(t: torch.Tensor) -> memoryview:
    # through uint8: bfloat16 and float8 have no numpy dtype
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


class OffloadTier:
    """A bounded, file-backed host tier for evicted KV blocks: one file per block in a private directory."""

    def __init__(self, directory: str | None, capacity_bytes: int) -> None:
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        # a fresh private folder: no two servers share files, and no earlier run's are ever read
        self.directory = tempfile.mkdtemp(prefix="ladle-kv-", dir=directory)
        self.capacity_bytes = capacity_bytes
        self.stats = OffloadStats()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._used = 0
        self._warned_write = False
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._used

    def contains(self, key: bytes, canonical_only: bool = False) -> bool:
        entry = self._entries.get(key)
        return entry is not None and (entry.canonical or not canonical_only)

    def store(self, key: bytes, tensors: list[torch.Tensor], canonical: bool) -> None:
        """Save one block's tensors under key, evicting the least recently used blocks for room."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            if entry.canonical or not canonical:
                return
            self.discard(key)  # a canonical copy replaces a batched one: it is good for everyone
        nbytes = block_bytes(tensors)
        if nbytes > self.capacity_bytes:
            self.stats.dropped += 1
            return
        while self._used + nbytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        try:
            _write(self._path(key), tensors)
        except OSError as e:
            _unlink(self._path(key))
            self.stats.dropped += 1
            if not self._warned_write:  # a full disk would fail every store: say it once
                log.warning("KV offload tier: cannot write to %s (%s); blocks are dropped", self.directory, e)
                self._warned_write = True
            return
        self._entries[key] = _Entry(nbytes, canonical)
        self._used += nbytes
        self.stats.stored += 1

    def load(self, key: bytes, out: list[torch.Tensor]) -> bool:
        """Copy key's block into out (same shapes and dtypes as stored); False if absent or damaged,
        with out untouched and a damaged entry dropped."""
        if key not in self._entries:
            return False
        try:
            payload = _read(self._path(key), out)
        except (OSError, ValueError) as e:
            self._drop(key)
            log.warning("KV offload tier: block %s unreadable (%s); recomputing it", key.hex(), e)
            return False
        offset = 0
        for t in out:
            n = t.numel() * t.element_size()
            src = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=offset)
            t.copy_(src.view(t.dtype).view(t.shape))
            offset += n
        self._entries.move_to_end(key)
        self.stats.restored += 1
        return True

    def discard(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._used -= entry.nbytes
            _unlink(self._path(key))

    def clear(self) -> None:
        """Drop every block (the prefix cache was reset)."""
        for key in list(self._entries):
            self.discard(key)

    def close(self) -> None:
        """Delete every file and the directory; safe to call twice, and run at interpreter exit."""
        self._cleanup()
        self._entries.clear()
        self._used = 0

    def _path(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex() + ".kv")

    def _drop(self, key: bytes) -> None:
        self.discard(key)
        self.stats.dropped += 1


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _write(path: str, tensors: list[torch.Tensor]) -> None:
    header, raws = _header(tensors), [_raw(t) for t in tensors]
    crc = 0
    for raw in raws:
        crc = zlib.crc32(raw, crc)
    with open(path, "wb") as f:
        f.write(PREFIX.pack(MAGIC, VERSION, len(header), crc) + header)
        for raw in raws:
            f.write(raw)


def _read(path: str, out: list[torch.Tensor]) -> memoryview:
    """The file's payload once every check against out has passed; ValueError names the first that failed."""
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)  # writable, so torch.frombuffer takes it as is
        if f.readinto(data) != len(data) or len(data) < PREFIX.size:
            raise ValueError("truncated")
    magic, version, header_len, crc = PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not a version {VERSION} block file")
    start = PREFIX.size + header_len
    if data[PREFIX.size:start] != _header(out):
        raise ValueError("dtypes or shapes differ")
    payload = memoryview(data)[start:]
    if payload.nbytes != block_bytes(out):
        raise ValueError("truncated or too long")
    if zlib.crc32(payload) != crc:
        raise ValueError("checksum mismatch")
    return payload
