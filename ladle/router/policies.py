"""Routing policies: each picks a worker for a request among the available candidates.

A policy's `choose(info, candidates)` returns (worker, reason); the reason labels
ladle_router_routing_decisions_total. `on_routed(info, worker)` tells it where the request
went (after a retry, that is not the first choice). `prepare` may fetch what `choose` needs
(kv_events: the prompt's token ids) before the choice, asynchronously.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ladle.router.kv_view import KVView
from ladle.router.prefix_tree import PrefixTree
from ladle.router.workers import Worker

if TYPE_CHECKING:
    import httpx

    from ladle.router.config import RouterConfig

TOKENIZED_ROUTES = ("/v1/chat/completions", "/v1/completions")


@dataclass
class RequestInfo:
    path: str
    body: Any = None  # the parsed JSON body, or None
    text: str = ""  # the routing key (ladle.router.text)
    token_ids: list[int] | None = None  # kv_events: the prompt's tokens, from a worker's /tokenize
    match_ratio: float | None = None  # set by cache-aware policies: the matched fraction on the chosen worker


@dataclass
class _Rotation:
    """Round robin's counter, also the tie-breaker of the other policies."""
    counter: itertools.count = field(default_factory=itertools.count)

    def pick(self, candidates: list[Worker]) -> Worker:
        return candidates[next(self.counter) % len(candidates)]

    def least_loaded(self, candidates: list[Worker]) -> Worker:
        fewest = min(w.in_flight for w in candidates)
        return self.pick([w for w in candidates if w.in_flight == fewest])


class Policy:
    name = ""

    async def prepare(self, info: RequestInfo, candidates: list[Worker], client: httpx.AsyncClient) -> None:
        return None

    def choose(self, info: RequestInfo, candidates: list[Worker]) -> tuple[Worker, str]:
        raise NotImplementedError

    def on_routed(self, info: RequestInfo, worker: Worker) -> None:
        return None


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.rotation = _Rotation()

    def choose(self, info: RequestInfo, candidates: list[Worker]) -> tuple[Worker, str]:
        return self.rotation.pick(candidates), "round_robin"


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self) -> None:
        self.rotation = _Rotation()

    def choose(self, info: RequestInfo, candidates: list[Worker]) -> tuple[Worker, str]:
        return self.rotation.least_loaded(candidates), "least_load"


@dataclass
class Balance:
    """SGLang's guard: loads this uneven send a request to the least loaded worker, cache or not."""
    abs_threshold: int
    rel_threshold: float

    def imbalanced(self, candidates: list[Worker]) -> bool:
        loads = [w.in_flight for w in candidates]
        most, fewest = max(loads), min(loads)
        return most - fewest > self.abs_threshold and most > fewest * self.rel_threshold


class CacheAware(Policy):
    """Per worker, an approximate tree of the text sent there: a request goes where the longest
    prefix of its text went before, when that covers more than cache_threshold of it; otherwise
    to the worker holding the least text (the emptiest cache)."""
    name = "cache_aware"

    def __init__(self, cache_threshold: float, balance: Balance, max_tree_size: int) -> None:
        self.cache_threshold, self.balance, self.max_tree_size = cache_threshold, balance, max_tree_size
        self.trees: dict[str, PrefixTree] = {}
        self.rotation = _Rotation()

    def tree(self, worker: Worker) -> PrefixTree:
        return self.trees.setdefault(worker.url, PrefixTree(self.max_tree_size))

    def choose(self, info: RequestInfo, candidates: list[Worker]) -> tuple[Worker, str]:
        if not info.text:
            return self.rotation.least_loaded(candidates), "no_text_lowest_load"
        if self.balance.imbalanced(candidates):
            return self.rotation.least_loaded(candidates), "load_imbalance"
        matched = {w.url: self.tree(w).match(info.text) for w in candidates}
        best = max(matched.values())
        leaders = [w for w in candidates if matched[w.url] == best]
        if best / len(info.text) > self.cache_threshold:
            chosen, reason = self.rotation.least_loaded(leaders), "cache_hit"
        else:
            smallest = min(self.tree(w).size for w in candidates)
            emptiest = [w for w in candidates if self.tree(w).size == smallest]
            chosen, reason = self.rotation.least_loaded(emptiest), "cache_miss_smallest_tree"
        info.match_ratio = matched[chosen.url] / len(info.text)
        return chosen, reason

    def on_routed(self, info: RequestInfo, worker: Worker) -> None:
        if info.text:
            self.tree(worker).insert(info.text)


class KVEvents(Policy):
    """Exact: each worker's KV events give the blocks it holds; a request goes to the worker
    holding the most leading blocks of its prompt (ties: the least loaded), under the same load
    guard as cache_aware. Where no worker holds any yet (a prefix still being computed where an
    earlier request went), without token ids (no /tokenize answer, a route other than chat or
    completions) or with a candidate whose event stream is down, cache_aware decides."""
    name = "kv_events"

    def __init__(self, views: dict[str, KVView], fallback: CacheAware) -> None:
        self.views, self.fallback = views, fallback
        self.rotation = _Rotation()

    async def prepare(self, info: RequestInfo, candidates: list[Worker], client: httpx.AsyncClient) -> None:
        info.token_ids = await prompt_token_ids(info, self.rotation.least_loaded(candidates), client)

    def choose(self, info: RequestInfo, candidates: list[Worker]) -> tuple[Worker, str]:
        ids = info.token_ids
        views = [self.views.get(w.url) for w in candidates]
        if not ids or not all(v is not None and v.live for v in views):
            worker, _ = self.fallback.choose(info, candidates)
            return worker, "kv_events_unavailable"
        if self.fallback.balance.imbalanced(candidates):
            return self.rotation.least_loaded(candidates), "load_imbalance"
        matched = {w.url: v.matched_blocks(ids) * v.block_size for w, v in zip(candidates, views)}
        best = max(matched.values())
        info.match_ratio = best / len(ids)
        if best == 0:  # nothing stored yet: the prefix may still be computing where the router sent it
            worker, reason = self.fallback.choose(info, candidates)
            return worker, f"kv_miss_{reason}"
        return self.rotation.least_loaded([w for w in candidates if matched[w.url] == best]), "kv_hit"

    def on_routed(self, info: RequestInfo, worker: Worker) -> None:
        self.fallback.on_routed(info, worker)


async def prompt_token_ids(info: RequestInfo, worker: Worker, client: httpx.AsyncClient) -> list[int] | None:
    """The prompt's token ids as the worker renders them; None when it cannot say."""
    body = info.body
    if info.path not in TOKENIZED_ROUTES or not isinstance(body, dict):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (int, list)):
        first = prompt if isinstance(prompt[0], int) else prompt[0]
        return first if all(isinstance(t, int) for t in first) else None
    request = _tokenize_request(body)
    if request is None:
        return None
    try:
        reply = await client.post(f"{worker.url}/tokenize", json=request, timeout=10.0)
        return reply.json()["tokens"] if reply.status_code == 200 else None
    except Exception:  # transport errors and odd replies alike: route without token ids
        return None


def _tokenize_request(body: dict) -> dict | None:
    request = {"model": body["model"]} if "model" in body else {}
    if isinstance(body.get("messages"), list):
        request |= {"messages": body["messages"], "add_generation_prompt": True}
        request |= {k: body[k] for k in ("chat_template_kwargs", "tools") if body.get(k) is not None}
        return request
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return request | {"prompt": prompt} if isinstance(prompt, str) else None


def make_policy(config: RouterConfig, views: dict[str, KVView]) -> Policy:
    """A fresh policy of config.policy (views: the KV event views kv_events reads, filled elsewhere)."""
    if config.policy == "round_robin":
        return RoundRobin()
    if config.policy == "least_load":
        return LeastLoad()
    cache_aware = CacheAware(config.cache_threshold, Balance(config.balance_abs_threshold,
                                                             config.balance_rel_threshold), config.max_tree_size)
    return cache_aware if config.policy == "cache_aware" else KVEvents(views, cache_aware)
