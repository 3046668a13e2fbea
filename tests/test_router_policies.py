"""The router's pure parts: the approximate prefix tree, the KV event view, routing text, policies."""

from __future__ import annotations

import pytest

from ladle.router.config import RouterConfig
from ladle.router.disagg import needs_prefill_hop, prefill_body
from ladle.router.kv_view import KVView
from ladle.router.policies import Balance, CacheAware, KVEvents, LeastLoad, RequestInfo, RoundRobin
from ladle.router.prefix_tree import PrefixTree
from ladle.router.text import routing_text
from ladle.router.workers import Worker


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", healthy=True, in_flight=n) for i, n in enumerate(loads)]


# -- prefix tree ------------------------------------------------------------------------


def test_tree_matches_longest_prefix_across_splits() -> None:
    tree = PrefixTree()
    tree.insert("hello world")
    tree.insert("hello there")
    assert tree.match("hello world!") == 11
    assert tree.match("hello thx") == 8
    assert tree.match("help") == 3
    assert tree.match("xyz") == 0
    assert tree.size == len("hello ") + len("world") + len("there")


def test_tree_evicts_least_recently_used_leaves() -> None:
    tree = PrefixTree(max_chars=20)
    tree.insert("aaaaaaaaaa")
    tree.insert("bbbbbbbbbb")
    tree.match("aaaaaaaaaa")  # a is now the more recent
    tree.insert("cccccccccc")
    assert tree.size <= 20
    assert tree.match("aaaaaaaaaa") == 10 and tree.match("cccccccccc") == 10
    assert tree.match("bbbbbbbbbb") == 0


def test_tree_eviction_removes_emptied_parents() -> None:
    tree = PrefixTree(max_chars=12)
    tree.insert("abcdef1")
    tree.insert("abcdef2")  # "abcdef" + "1" + "2": 8
    tree.insert("zzzzzzz")  # 15 > 12: the old branch goes, leaves first, then its parent
    assert tree.size <= 12 and tree.match("zzzzzzz") == 7 and tree.match("abcdef1") == 0


# -- KV view ---------------------------------------------------------------------------


def snapshot(*blocks: tuple[str, str, list[int]]) -> dict:
    return {"type": "snapshot", "block_size": 2, "root": "r",
            "blocks": [{"hash": h, "parent": p, "tokens": t} for h, p, t in blocks]}


def test_kv_view_matches_leading_full_blocks() -> None:
    view = KVView()
    view.apply(snapshot(("a", "r", [1, 2]), ("b", "a", [3, 4])))
    assert view.live and view.matched_blocks([1, 2, 3, 4, 5]) == 2
    assert view.matched_blocks([1, 2, 9, 9]) == 1
    assert view.matched_blocks([3, 4]) == 0  # the same tokens under another parent are another block
    assert view.matched_blocks([1]) == 0


def test_kv_view_applies_stored_and_removed_events() -> None:
    view = KVView()
    view.apply(snapshot(("a", "r", [1, 2])))
    view.apply({"type": "events", "events": [{"type": "stored", "hash": "b", "parent": "a", "tokens": [3, 4]},
                                             {"type": "removed", "hash": "a"}]})
    assert view.matched_blocks([1, 2, 3, 4]) == 0 and len(view.blocks) == 1
    view.apply({"type": "events", "events": [{"type": "stored", "hash": "a", "parent": "r", "tokens": [1, 2]}]})
    assert view.matched_blocks([1, 2, 3, 4]) == 2


def test_kv_view_snapshot_replaces_everything() -> None:
    view = KVView()
    view.apply(snapshot(("a", "r", [1, 2])))
    view.mark_stale()
    assert not view.live
    view.apply(snapshot(("c", "r", [5, 6])))
    assert view.live and view.matched_blocks([1, 2]) == 0 and view.matched_blocks([5, 6]) == 1


# -- routing text ------------------------------------------------------------------------


def test_routing_text_of_each_body_shape() -> None:
    chat = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": [{"type": "text", "text": "T"}, {"type": "image_url"}]}]}
    assert routing_text(chat) == "system:S\nuser:T\n"
    assert routing_text({"prompt": ["first", "second"]}) == "first"
    assert routing_text({"prompt": [1, 2, 3]}) == ""
    assert routing_text({"input": "hi", "instructions": "be brief"}) == "be briefhi"
    assert routing_text({"input": "ticket", "questions": [{"question": "which team?"}]}) == "ticketwhich team?"
    assert routing_text({"model": "m"}) == "" and routing_text(None) == ""


# -- policies ----------------------------------------------------------------------------


def test_round_robin_cycles_and_least_load_prefers_idle() -> None:
    ws = workers(0, 0, 0)
    rr = RoundRobin()
    assert [rr.choose(RequestInfo(""), ws)[0].url for _ in range(4)] == ["http://w0", "http://w1", "http://w2",
                                                                        "http://w0"]
    busy = workers(3, 0, 1)
    assert LeastLoad().choose(RequestInfo(""), busy)[0].url == "http://w1"


def cache_aware(**kw) -> CacheAware:
    return CacheAware(kw.get("threshold", 0.5), Balance(kw.get("abs", 32), kw.get("rel", 1.5)), 2**20)


def route(policy, text: str, ws: list[Worker]) -> tuple[str, str]:
    info = RequestInfo("/v1/completions", {"prompt": text}, text)
    worker, reason = policy.choose(info, ws)
    policy.on_routed(info, worker)
    return worker.url, reason


def test_cache_aware_follows_prefix_and_spreads_new_ones() -> None:
    policy, ws = cache_aware(), workers(0, 0)
    prefix = "A long shared system prompt. " * 10
    first, reason = route(policy, prefix + "question one", ws)
    assert reason == "cache_miss_smallest_tree"
    other, _ = route(policy, "Something else entirely " * 5, ws)
    assert other != first  # the emptier tree gets the new prefix
    assert route(policy, prefix + "question two", ws) == (first, "cache_hit")


def test_cache_aware_load_imbalance_overrides_the_cache() -> None:
    policy, ws = cache_aware(abs=2, rel=1.5), workers(0, 0)
    text = "shared prefix " * 20
    url, _ = route(policy, text, ws)
    hot = next(w for w in ws if w.url == url)
    hot.in_flight = 10
    assert route(policy, text, ws) == (next(w.url for w in ws if w is not hot), "load_imbalance")


def test_kv_events_routes_to_the_worker_holding_the_blocks() -> None:
    ws = workers(0, 0)
    views = {w.url: KVView() for w in ws}
    views["http://w0"].apply(snapshot())
    views["http://w1"].apply(snapshot(("a", "r", [1, 2]), ("b", "a", [3, 4])))
    policy = KVEvents(views, cache_aware())
    info = RequestInfo("/v1/completions", {"prompt": [1, 2, 3, 4, 5]}, "", token_ids=[1, 2, 3, 4, 5])
    worker, reason = policy.choose(info, ws)
    assert (worker.url, reason, info.match_ratio) == ("http://w1", "kv_hit", 0.8)
    views["http://w0"].mark_stale()
    assert policy.choose(info, ws)[1] == "kv_events_unavailable"


def test_kv_events_follows_the_router_while_a_prefix_is_still_computing() -> None:
    ws = workers(0, 0)
    views = {w.url: KVView() for w in ws}
    for view in views.values():
        view.apply(snapshot())  # live, and empty: nothing is stored anywhere yet
    policy = KVEvents(views, cache_aware())
    text = "a long shared document " * 20

    def send(question: str) -> tuple[str, str]:
        info = RequestInfo("/v1/completions", {"prompt": text + question}, text + question, token_ids=[7, 8, 9])
        worker, reason = policy.choose(info, ws)
        policy.on_routed(info, worker)
        return worker.url, reason

    first, reason = send("one?")
    assert reason == "kv_miss_cache_miss_smallest_tree"
    assert send("two?") == (first, "kv_miss_cache_hit")  # where the first went, not merely the least loaded


def test_disagg_prefill_body_and_skips() -> None:
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}, "n": 1,
            "max_tokens": 50}
    hop = prefill_body(body, "/v1/chat/completions")
    assert hop == {"model": "m", "messages": [], "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": True}}
    assert "max_completion_tokens" not in prefill_body({"prompt": "x"}, "/v1/completions")
    assert needs_prefill_hop(body) and not needs_prefill_hop(body | {"n": 2})
    assert not needs_prefill_hop(body | {"kv_transfer_params": {"do_remote_prefill": True}})


def test_config_rejects_bad_setups() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        RouterConfig(workers=["http://a"], policy="random")
    with pytest.raises(ValueError, match="both"):
        RouterConfig(prefill=["http://a"])
    assert RouterConfig(workers=["127.0.0.1:9/v1/"]).workers == ["http://127.0.0.1:9"]
