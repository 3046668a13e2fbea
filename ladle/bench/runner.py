"""The load generator: requests leave on an arrival schedule, under an optional concurrency cap.

Arrivals follow vLLM's `bench serve`: all at once for an infinite rate, else
gamma-distributed gaps with shape `burstiness` and mean 1/rate (burstiness 1 is
a Poisson process, below 1 burstier, above 1 more regular), rescaled so the last
arrival lands at n/rate. A trace's requests (--dataset trace) keep their own
arrival times instead. A request waits for a free slot when --max-concurrency
is reached.

Agent sessions: a session's first turn arrives on the schedule like any request;
each later turn arrives `think_time` seconds (its tool call's run) after the
previous turn's answer ended, whatever its own slot in the schedule. Neither the
wait for the previous answer nor the think time counts as queue time or TTFT.
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
    arrival_span: float  # the last scheduled arrival (later agent turns have none), seconds after the start


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
    """Send `requests` on `load`'s schedule (a trace's requests on their own) and wait for every answer."""
    if requests and all(r.arrival is not None for r in requests):
        arrivals = np.array([r.arrival for r in requests])
    else:
        arrivals = arrival_times(len(requests), load.request_rate, load.burstiness, np.random.default_rng(load.seed))
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, unit="req", dynamic_ncols=True)

    async with make_http_client(target, load.max_concurrency) as http:

        async def one(req: SampleRequest, at: float, before: asyncio.Task | None) -> RequestResult:
            if before is None:  # a lone request or a session's first turn: on the schedule
                arrival = start + at
                await asyncio.sleep(max(arrival - time.perf_counter(), 0.0))
            else:
                await asyncio.wait([before])  # the session's previous turn, whatever its outcome
                arrival = time.perf_counter() + req.think_time  # the turn exists once the tool has run
                await asyncio.sleep(req.think_time)
            if slots is None:
                result = await send(http, target, req)
            else:
                async with slots:
                    result = await send(http, target, req)
            result.queue_time = max(result.start_time - arrival, 0.0)
            bar.update(1)
            return result

        tasks: list[asyncio.Task] = []
        last_turn: dict[int, asyncio.Task] = {}
        arrival_span = 0.0
        start = time.perf_counter()
        try:
            # every request waits in its own task, so a session's next turn is never held up
            # behind a later request's slot
            for req, at in zip(requests, arrivals):
                before = last_turn.get(req.session_id) if req.session_id is not None else None
                if before is None:
                    arrival_span = float(at)
                task = asyncio.create_task(one(req, float(at), before))
                if req.session_id is not None:
                    last_turn[req.session_id] = task
                tasks.append(task)
            results = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            bar.close()
        duration = time.perf_counter() - start
    return LoadRun(results=results, duration=duration, arrival_span=arrival_span)
