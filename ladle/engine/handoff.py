"""A prompt's K/V handed from one engine to another (disaggregated prefill/decode).

The prefill engine runs the prompt, samples the first token, and keeps a copy of the prompt's
KV blocks (`KVExports`) until a decode engine fetches it (ladle.distributed.kv_transfer moves it
between processes). The decode engine enters those blocks into its prefix cache, appends the
first token as already generated, and goes on decoding: none of the prompt is computed again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ladle.engine.request import TokenLogprob

if TYPE_CHECKING:
    from ladle.engine.request import Sequence

EXPORT_TTL_SECONDS = 120.0  # a handoff nobody fetched by then is dropped


@dataclass
class KVHandoff:
    token_ids: list[int]  # the prompt
    first_token: int  # what the prefill engine sampled after it
    first_logprob: TokenLogprob | None  # with its logprobs, when the request asked for them
    block_size: int
    # per block (the last may be partly filled), the KV cache's tensors at that block:
    # K and V [layers, block_size, kv_heads, head_dim], and an 8-bit cache's scales
    blocks: list[list[torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for block in self.blocks for t in block)


@dataclass
class _Export:
    handoff: KVHandoff
    expires: float


class KVExports:
    """Handoffs waiting to be fetched, by request id: bounded in bytes, dropped after a TTL,
    handed out once. The engine thread puts, the transfer server's threads take."""

    def __init__(self, capacity_bytes: int, ttl: float = EXPORT_TTL_SECONDS):
        self.capacity_bytes = capacity_bytes
        self.ttl = ttl
        self._entries: OrderedDict[str, _Export] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.dropped = 0  # handoffs dropped unfetched (expired, or evicted for room)

    def put(self, transfer_id: str, handoff: KVHandoff) -> bool:
        """Keep handoff for one fetch; False when it is larger than the whole buffer."""
        size = handoff.num_bytes
        if size > self.capacity_bytes:
            return False
        with self._lock:
            self._expire(time.monotonic())
            while self._bytes + size > self.capacity_bytes:
                self._pop_oldest()
            self._entries[transfer_id] = _Export(handoff, time.monotonic() + self.ttl)
            self._bytes += size
        return True

    def take(self, transfer_id: str) -> KVHandoff | None:
        with self._lock:
            self._expire(time.monotonic())
            entry = self._entries.pop(transfer_id, None)
            if entry is None:
                return None
            self._bytes -= entry.handoff.num_bytes
            return entry.handoff

    def __contains__(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._entries

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def _expire(self, now: float) -> None:
        while self._entries and next(iter(self._entries.values())).expires < now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= entry.handoff.num_bytes
        self.dropped += 1


@dataclass
class HandoffStats:
    exported: int = 0  # prompts whose K/V a prefill engine kept for a fetch
    imported: int = 0  # requests a decode engine started on handed-over K/V
    imported_tokens: int = 0  # prompt tokens those requests did not compute
    rejected: int = 0  # handoffs that did not fit the request or this engine: the prompt was computed


def export_handoff(seq: "Sequence", kv_tensors: list[torch.Tensor], block_size: int) -> KVHandoff:
    """A copy of a finished one-token request's prompt K/V and its first token."""
    num_blocks = -(-seq.num_prompt_tokens // block_size)
    blocks = [[t[:, b].clone() for t in kv_tensors] for b in seq.block_table[:num_blocks]]
    return KVHandoff(token_ids=seq.prompt_token_ids, first_token=seq.token_ids[seq.num_prompt_tokens],
                     first_logprob=seq.logprobs[0] if seq.logprobs else None, block_size=block_size, blocks=blocks)


def handoff_mismatch(handoff: KVHandoff, ids: list[int], seq: "Sequence", kv_tensors: list[torch.Tensor],
                     block_size: int) -> str | None:
    """Why this engine cannot continue seq from handoff (it computes the prompt instead); None if it can."""
    if handoff.token_ids != ids:
        return "its prompt tokens differ from this request's"
    if handoff.block_size != block_size or len(handoff.blocks) != -(-len(ids) // block_size):
        return "its blocks do not match this engine's block size"
    want = [(t.dtype, t[:, 0].shape) for t in kv_tensors]
    if any([(t.dtype, t.shape) for t in block] != want for block in handoff.blocks):
        return "its K/V tensors differ in dtype or shape from this engine's cache (another model or --kv-cache-dtype)"
    if seq.canonical or seq.lora is not None:
        return "canonical and LoRA sequences compute their own K/V"
    if seq.params.prompt_logprobs is not None:
        return "prompt logprobs need the prompt computed"
    if (seq.params.logprobs is None) != (handoff.first_logprob is None):
        return "logprobs of the first token were asked of one side only"
    return None


def block_writer(kv_tensors: list[torch.Tensor]):
    """write(block_id, tensors): one handed-over block into the KV cache."""
    def write(block_id: int, tensors: list[torch.Tensor]) -> None:
        for dst, src in zip(kv_tensors, tensors):
            dst[:, block_id].copy_(src)
    return write
