"""RouterState: everything one router app holds (workers, policies, views, sticky ids, metrics),
and how it picks a worker for a request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ladle.router.config import RouterConfig
from ladle.router.kv_view import KVView
from ladle.router.metrics import RouterMetrics
from ladle.router.policies import LeastLoad, Policy, RequestInfo, make_policy
from ladle.router.sticky import StickyTable
from ladle.router.workers import Worker, WorkerPool

if TYPE_CHECKING:
    import httpx

    from ladle.router.proxy import Forwarder, Picker


@dataclass
class RouterState:
    config: RouterConfig
    metrics: RouterMetrics
    pool: WorkerPool
    policies: dict[str, Policy]  # role -> its policy (its trees cover that role's workers)
    views: dict[str, KVView]  # url -> KV event view (kv_events only)
    sticky: StickyTable = field(default_factory=StickyTable)
    plain: LeastLoad = field(default_factory=LeastLoad)  # routes with no prompt to match
    client: httpx.AsyncClient | None = None
    forwarder: Forwarder | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: RouterConfig) -> RouterState:
        metrics = RouterMetrics()
        if config.disaggregated:
            workers = [Worker(u, "prefill") for u in config.prefill] + [Worker(u, "decode") for u in config.decode]
        else:
            workers = [Worker(u) for u in config.workers]
        views = {w.url: KVView() for w in workers} if config.policy == "kv_events" else {}
        roles = {w.role for w in workers}
        state = cls(config, metrics, WorkerPool(workers, metrics), {r: make_policy(config, views) for r in roles},
                    views)
        for w in workers:
            metrics.worker_healthy.labels(w.url).set(0)
            metrics.in_flight.labels(w.url).set(0)
        return state

    @property
    def serving_role(self) -> str:
        """The role that answers clients: decode workers in disaggregated mode."""
        return "decode" if self.config.disaggregated else "worker"

    async def prepare(self, role: str, info: RequestInfo) -> None:
        candidates = self.pool.available(role)
        if candidates and self.client is not None:
            await self.policies[role].prepare(info, candidates, self.client)

    def policy_picker(self, role: str, info: RequestInfo) -> Picker:
        policy = self.policies[role]

        def pick(candidates: list[Worker], retry: bool) -> Worker:
            worker, reason = policy.choose(info, candidates)
            self._decided(policy.name, "retry" if retry else reason, info)
            policy.on_routed(info, worker)
            self._remember_request_id(info.body, worker)
            return worker
        return pick

    def plain_picker(self, info: RequestInfo | None = None, reason: str = "least_load") -> Picker:
        """Least load, for routes without a prompt; sticky routes label their one choice `sticky`."""
        def pick(candidates: list[Worker], retry: bool) -> Worker:
            worker, _ = self.plain.choose(RequestInfo(""), candidates)
            self.metrics.decisions.labels(self.config.policy, "retry" if retry else reason).inc()
            self._remember_request_id(info.body if info else None, worker)
            return worker
        return pick

    def _decided(self, policy: str, reason: str, info: RequestInfo) -> None:
        self.metrics.decisions.labels(policy, reason).inc()
        if info.match_ratio is not None:
            self.metrics.prefix_match_ratio.observe(info.match_ratio)
            info.match_ratio = None

    def _remember_request_id(self, body: Any, worker: Worker) -> None:
        if isinstance(body, dict) and isinstance(body.get("request_id"), str):
            self.sticky.record_request_id(body["request_id"], worker.url)

    def record_response_id(self, worker: Worker, reply: Any) -> None:
        """/v1/responses: a reply's id (or a stream's response.created event) -> its worker."""
        if isinstance(reply, dict):
            inner = reply.get("response")
            ident = inner.get("id") if isinstance(inner, dict) else reply.get("id")
            if isinstance(ident, str):
                self.sticky.record(ident, worker.url)
