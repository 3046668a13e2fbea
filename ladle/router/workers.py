"""The workers the router sends to: their health, drain state and router-counted load.

A worker gets traffic only when healthy (its last GET /health answered 200) and not draining.
A failed request marks it unhealthy at once; the health loop brings it back at its next good
check.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

    from ladle.router.metrics import RouterMetrics

ROLES = ("worker", "prefill", "decode")


@dataclass(eq=False)
class Worker:
    url: str
    role: str = "worker"
    healthy: bool = False
    draining: bool = False
    in_flight: int = 0
    requests_total: int = 0
    failures_total: int = 0

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining


@dataclass
class WorkerPool:
    workers: list[Worker]
    metrics: RouterMetrics
    became_healthy: asyncio.Event = field(default_factory=asyncio.Event)

    def available(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.available]

    def healthy(self, role: str | None = None) -> list[Worker]:
        return [w for w in self.workers if w.healthy and (role is None or w.role == role)]

    def by_url(self, url: str) -> list[Worker]:
        return [w for w in self.workers if w.url == url]

    def set_healthy(self, worker: Worker, healthy: bool) -> None:
        worker.healthy = healthy
        self.metrics.worker_healthy.labels(worker.url).set(1 if healthy else 0)
        if healthy:
            self.became_healthy.set()

    def mark_failed(self, worker: Worker) -> None:
        """A request to it could not connect or got a 5xx: no traffic until a good health check."""
        worker.failures_total += 1
        self.metrics.worker_failures.labels(worker.url).inc()
        self.set_healthy(worker, False)

    def started(self, worker: Worker, route: str) -> None:
        worker.in_flight += 1
        worker.requests_total += 1
        self.metrics.requests.labels(worker.url, route).inc()
        self.metrics.in_flight.labels(worker.url).set(worker.in_flight)

    def finished(self, worker: Worker) -> None:
        worker.in_flight -= 1
        self.metrics.in_flight.labels(worker.url).set(worker.in_flight)

    async def check_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        await asyncio.gather(*(self._check(client, w, timeout) for w in self.workers))

    async def _check(self, client: httpx.AsyncClient, worker: Worker, timeout: float) -> None:
        try:
            ok = (await client.get(f"{worker.url}/health", timeout=timeout)).status_code == 200
        except Exception:  # any transport failure is "not healthy", never a crash of the loop
            ok = False
        self.set_healthy(worker, ok)

    async def health_loop(self, client: httpx.AsyncClient, interval: float) -> None:
        """Checks every worker every interval seconds, until cancelled."""
        while True:
            await self.check_all(client, timeout=max(interval, 1.0))
            await asyncio.sleep(interval)

    async def wait_until_healthy(self, timeout: float) -> bool:
        """True once any worker is healthy; False if none is within timeout seconds."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            self.became_healthy.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.became_healthy.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    def to_json(self, views: dict | None = None) -> list[dict]:
        return [{"url": w.url, "role": w.role, "healthy": w.healthy, "draining": w.draining,
                 "in_flight": w.in_flight, "requests_total": w.requests_total, "failures_total": w.failures_total,
                 "kv_blocks": _view_size(views, w.url)} for w in self.workers]


def _view_size(views: dict | None, url: str) -> int | None:
    view = (views or {}).get(url)
    return len(view.blocks) if view is not None and view.live else None
