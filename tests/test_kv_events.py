"""KV events: the prefix cache's stored and evicted blocks, as the engine logs them and as
GET /v1/kv_events streams them. The reference is the radix tree itself and an independent
digest computed here from the token ids."""

from __future__ import annotations

import hashlib
import json
from array import array

import httpx

from ladle.config import EngineConfig
from ladle.engine.kv_events import BlockRemoved, BlockStored, KVEventLog
from ladle.engine.prefix_cache import RadixCache
from tests.server_utils import own_server

BS = 16


def digest(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def tree_with_log(max_events: int = 1000) -> tuple[RadixCache, KVEventLog]:
    cache = RadixCache(BS)
    log = KVEventLog(BS, cache.root(0).digest.hex(), max_events=max_events)
    cache.listener = log
    return cache, log


def test_stored_blocks_chain_their_digests_from_the_root() -> None:
    cache, log = tree_with_log()
    a, b = tuple(range(BS)), tuple(range(BS, 2 * BS))
    na = cache.insert(None, a, block_id=0)
    cache.insert(na, b, block_id=1)
    root = digest(b"ladle-kv", (0,))
    assert log.root == root.hex()
    snap = log.snapshot()
    assert [(x.parent, x.tokens) for x in snap.blocks] == [(root.hex(), a), (digest(root, a).hex(), b)]
    assert snap.blocks[1].hash == digest(digest(root, a), b).hex()


def test_partial_leaves_and_adapter_trees_are_not_published() -> None:
    cache, log = tree_with_log()
    cache.insert(None, (1, 2, 3), block_id=0)  # a partly filled last block
    cache.insert(None, tuple(range(BS)), block_id=1, namespace=7)  # a LoRA adapter's tree
    assert log.snapshot().blocks == [] and log.since(0) == (0, [])


def test_eviction_publishes_removed_and_subscribers_follow() -> None:
    cache, log = tree_with_log()
    start = log.snapshot().seq
    node = cache.insert(None, tuple(range(BS)), block_id=0)
    cache.mark_unreferenced(0)
    evicted = cache.evict_lru(lambda b: True)
    assert evicted == (node, 0)
    seq, events = log.since(start)
    assert events == [BlockStored(node.digest.hex(), cache.root(0).digest.hex(), node.key),
                      BlockRemoved(node.digest.hex())]
    assert log.snapshot().blocks == [] and log.since(seq) == (seq, [])


def test_a_subscriber_that_fell_behind_is_told_to_resnapshot() -> None:
    cache, log = tree_with_log(max_events=4)
    parent = None
    for i in range(6):
        parent = cache.insert(parent, tuple(range(i * BS, (i + 1) * BS)), block_id=i)
    assert log.since(0) is None  # its first events are gone from the log
    snap = log.snapshot()
    assert len(snap.blocks) == 6 and log.since(snap.seq) == (snap.seq, [])


def read_events(url: str, count: int, timeout: float = 10.0) -> list[dict]:
    out = []
    with httpx.stream("GET", f"{url}/v1/kv_events", timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if len(out) == count:
                    return out
    return out


def test_the_server_streams_a_snapshot_then_the_blocks_a_request_stores() -> None:
    with own_server(EngineConfig(num_kv_blocks=64, num_threads=1)) as server:
        first = read_events(server.url, 1)[0]
        assert first["type"] == "snapshot" and first["block_size"] == BS
        prompt = "The quick brown fox jumps over the lazy dog while the cat watches from the old wooden fence. " * 3
        r = httpx.post(f"{server.base_url}/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                       timeout=60)
        ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert r.status_code == 200 and len(ids) >= 2 * BS
        snap = read_events(server.url, 1)[0]
        parent = bytes.fromhex(snap["root"])
        by_hash = {b["hash"]: b for b in snap["blocks"]}
        for k in range(len(ids) // BS):  # every full prompt block is there, chained from the root
            key = tuple(ids[k * BS:(k + 1) * BS])
            block = by_hash[digest(parent, key).hex()]
            assert block["parent"] == parent.hex() and tuple(block["tokens"]) == key
            parent = digest(parent, key)


def test_without_a_prefix_cache_there_are_no_events() -> None:
    with own_server(EngineConfig(num_kv_blocks=64, num_threads=1, enable_prefix_caching=False)) as server:
        r = httpx.get(f"{server.url}/v1/kv_events")
        assert r.status_code == 404 and r.json()["error"]["code"] == "kv_events_unavailable"
