"""The load generator: requests leave on an arrival schedule, under an optional concurrency cap.

Arrivals follow vLLM's `bench serve`: all at once for an infinite rate, else
gamma-distributed gaps with shape `burstiness` and mean 1/rate (burstiness 1 is
a Poisson process, below 1 burstier, above 1 more regular), rescaled so the last
arrival lands at n/rate. A request waits for a free slot when --max-concurrency
is reached, and an agent turn also waits for its session's previous turn and then its
think time (the tool call's run): it counts as arriving once that has passed.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from ladle.bench.client import RequestResult, Target, make_http_client, send
from ladle.bench.datasets import SampleRequest


@dataclass
class LoadSpec:
    request_rate: float = math.inf  # requests per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0


@dataclass
class LoadRun:
    results: list[RequestResult]  # in the order of the requests given
    duration: float  # from the start of the schedule to the last answer, seconds
    arrival_span: float  # the last scheduled arrival, seconds after the start


def arrival_times(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds after the start at which each of `n` requests arrives."""
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if request_rate <= 0:
        raise ValueError("request rate must be positive (or inf)")
    if n == 0 or math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    # As vLLM: pin the total to n / rate, so seeds differ in pattern but offer the same load.
    return times * ((n / request_rate) / times[-1])


async def run_load(target: Target, requests: list[SampleRequest], load: LoadSpec, *,
                   progress: bool = True, desc: str | None = None) -> LoadRun:
    """Send `requests` on `load`'s schedule and wait for every answer."""
    arrivals = arrival_times(len(requests), load.request_rate, load.burstiness, np.random.default_rng(load.seed))
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, unit="req", dynamic_ncols=True)

    async with make_http_client(target, load.max_concurrency) as http:

        async def one(req: SampleRequest, arrived: float, before: asyncio.Task | None) -> RequestResult:
            if before is not None:
                await asyncio.wait([before])  # the session's previous turn, whatever its outcome
                if req.think_time > 0:  # the tool runs; the turn exists once it is done
                    await asyncio.sleep(req.think_time)
                    arrived = max(arrived, time.perf_counter())
            if slots is None:
                result = await send(http, target, req)
            else:
                async with slots:
                    result = await send(http, target, req)
            result.queue_time = max(result.start_time - arrived, 0.0)
            bar.update(1)
            return result

        tasks: list[asyncio.Task] = []
        last_turn: dict[int, asyncio.Task] = {}
        start = time.perf_counter()
        try:
            for req, at in zip(requests, arrivals):
                delay = start + float(at) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                before = last_turn.get(req.session_id) if req.session_id is not None else None
                task = asyncio.create_task(one(req, start + float(at), before))
                if req.session_id is not None:
                    last_turn[req.session_id] = task
                tasks.append(task)
            results = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            bar.close()
        duration = time.perf_counter() - start
    return LoadRun(results=results, duration=duration, arrival_span=float(arrivals[-1]) if len(arrivals) else 0.0)
