"""Moving a prompt's K/V between processes over TCP (disaggregated prefill/decode).

The prefill worker listens on --kv-transfer-config's kv_ip:kv_port; a decode worker connects,
names a transfer, and reads it back. Every frame is checksummed, so a damaged transfer is
detected and the decode worker computes the prompt itself instead of decoding from bad K/V.

    request   "LKVT" u16 version, u16 id length, the transfer id (UTF-8)
    reply     "LKVT" u16 version, u8 status (0: here, 1: unknown id), u32 header length,
              the header (JSON), u32 crc32 of the header; then, when found, per block:
              u32 index, u32 payload length, u32 crc32 of the payload, the payload (each of
              the block's tensors' raw bytes in order); then u32 0xFFFFFFFF, u32 0, u32 0.

The header carries the prompt's token ids, the first token (and its logprobs), the block size
and each block tensor's dtype and shape; the payload lengths follow from those.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field

import torch

from ladle.engine.handoff import KVExports, KVHandoff
from ladle.engine.request import TokenLogprob

log = logging.getLogger("ladle")

MAGIC = b"LKVT"
VERSION = 1
REQUEST = struct.Struct("<4sHH")
REPLY = struct.Struct("<4sHBI")
CRC = struct.Struct("<I")
BLOCK = struct.Struct("<III")
END = 0xFFFFFFFF
FOUND, UNKNOWN = 0, 1
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                                        torch.float8_e4m3fn)}


class KVTransferError(Exception):
    """A transfer that could not be made or did not check out (the decode worker recomputes)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # a short label for metrics: unreachable, not_found, corrupt, protocol


@dataclass
class TransferStats:
    """Totals a worker's /metrics reports; updated from transfer threads, so under a lock."""

    sent_bytes: int = 0
    sent: int = 0
    received_bytes: int = 0
    received: int = 0
    receive_seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_sent(self, nbytes: int) -> None:
        with self._lock:
            self.sent += 1
            self.sent_bytes += nbytes

    def record_received(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.received += 1
            self.received_bytes += nbytes
            self.receive_seconds += seconds

    def record_failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] = self.failures.get(reason, 0) + 1


# -- encoding -------------------------------------------------------------------


def _header(h: KVHandoff) -> bytes:
    lp = h.first_logprob
    return json.dumps({
        "token_ids": h.token_ids, "first_token": h.first_token, "block_size": h.block_size,
        "first_logprob": None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]],
        "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in h.blocks[0]] if h.blocks else [],
        "num_blocks": len(h.blocks),
    }).encode()


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # via uint8: bf16 has no numpy dtype


def encode_reply(h: KVHandoff | None) -> list[bytes]:
    """The reply's frames for handoff h (None: the id is unknown)."""
    if h is None:
        return [REPLY.pack(MAGIC, VERSION, UNKNOWN, 0) + CRC.pack(zlib.crc32(b""))]
    header = _header(h)
    frames = [REPLY.pack(MAGIC, VERSION, FOUND, len(header)) + header + CRC.pack(zlib.crc32(header))]
    for i, block in enumerate(h.blocks):
        payload = b"".join(_raw(t) for t in block)
        frames.append(BLOCK.pack(i, len(payload), zlib.crc32(payload)) + payload)
    frames.append(BLOCK.pack(END, 0, 0))
    return frames


# -- the producer's server --------------------------------------------------------


class KVTransferServer:
    """Serves a producer's handed-over K/V (KVExports) to decode workers, one thread per connection."""

    def __init__(self, exports: KVExports, host: str, port: int, stats: TransferStats):
        self.exports, self.stats = exports, stats
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="ladle-kv-transfer", daemon=True)

    def start(self) -> "KVTransferServer":
        self._thread.start()
        log.info("KV transfer: serving handed-over K/V on %s:%d", self.host, self.port)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        try:
            magic, version, id_len = REQUEST.unpack(_recv_exact(conn, REQUEST.size))
            if magic != MAGIC or version != VERSION:
                return
            transfer_id = bytes(_recv_exact(conn, id_len)).decode()
            handoff = self.exports.take(transfer_id)
            sent = 0
            for frame in encode_reply(handoff):
                conn.sendall(frame)
                sent += len(frame)
            if handoff is not None:
                self.stats.record_sent(sent)
        except (OSError, ValueError, KVTransferError) as e:
            log.warning("KV transfer: a fetch failed on the producer side: %s", e)


# -- the consumer's fetch ------------------------------------------------------------


def fetch(host: str, port: int, transfer_id: str, timeout: float = 30.0) -> tuple[KVHandoff, int]:
    """The handoff named transfer_id from a producer, and the bytes read. Raises KVTransferError."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            tid = transfer_id.encode()
            conn.sendall(REQUEST.pack(MAGIC, VERSION, len(tid)) + tid)
            return _read_reply(conn)
    except OSError as e:
        raise KVTransferError("unreachable", f"{host}:{port}: {e}") from None


def _read_reply(conn: socket.socket) -> tuple[KVHandoff, int]:
    magic, version, status, header_len = REPLY.unpack(_recv_exact(conn, REPLY.size))
    if magic != MAGIC or version != VERSION:
        raise KVTransferError("protocol", "not a ladle KV transfer reply")
    raw_header = _recv_exact(conn, header_len)
    if CRC.unpack(_recv_exact(conn, CRC.size))[0] != zlib.crc32(raw_header):
        raise KVTransferError("corrupt", "the header's checksum does not match")
    if status != FOUND:
        raise KVTransferError("not_found", "the producer holds no such transfer (fetched already, or expired)")
    header = json.loads(raw_header)
    specs = [(DTYPES[dtype], shape) for dtype, shape in header["tensors"]]
    sizes = [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in specs]
    blocks, nbytes = [], REPLY.size + header_len + CRC.size
    while True:
        index, length, crc = BLOCK.unpack(_recv_exact(conn, BLOCK.size))
        nbytes += BLOCK.size + length
        if index == END:
            break
        if index != len(blocks) or length != sum(sizes):
            raise KVTransferError("protocol", f"block {index} arrived out of order or with {length} bytes")
        payload = _recv_exact(conn, length)
        if zlib.crc32(payload) != crc:
            raise KVTransferError("corrupt", f"block {index}'s checksum does not match")
        blocks.append(_tensors(payload, specs, sizes))
    if len(blocks) != header["num_blocks"]:
        raise KVTransferError("protocol", f"{len(blocks)} blocks arrived, {header['num_blocks']} announced")
    lp = header["first_logprob"]
    first_logprob = None if lp is None else TokenLogprob(lp[0], lp[1], [tuple(t) for t in lp[2]])
    return KVHandoff(header["token_ids"], header["first_token"], first_logprob, header["block_size"], blocks), nbytes


def _tensors(payload: bytearray, specs: list, sizes: list[int]) -> list[torch.Tensor]:
    out, offset = [], 0
    for (dtype, shape), size in zip(specs, sizes):
        raw = torch.frombuffer(payload, dtype=torch.uint8, count=size, offset=offset)
        out.append(raw.view(dtype).view(shape))
        offset += size
    return out


def _recv_exact(conn: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)  # writable: torch.frombuffer takes it without a copy
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            raise KVTransferError("protocol", "the connection closed mid-transfer")
        got += k
    return buf


def timed_fetch(host: str, port: int, transfer_id: str, stats: TransferStats,
                timeout: float = 30.0) -> KVHandoff | None:
    """fetch, recorded in stats; None (and a warning) when it failed."""
    started = time.perf_counter()
    try:
        handoff, nbytes = fetch(host, port, transfer_id, timeout)
    except KVTransferError as e:
        stats.record_failure(e.reason)
        log.warning("KV transfer %s from %s:%d failed (%s); computing the prompt instead", transfer_id, host, port, e)
        return None
    stats.record_received(nbytes, time.perf_counter() - started)
    return handoff
