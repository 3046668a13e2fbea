"""`ladle bench sweep`: step the load up until goodput collapses, and find the knee.

A load is a request rate (req/s, arrivals as in `bench serve`) or a concurrency
cap (every request queued at once, at most that many in flight). The sweep runs
the loads in increasing order and stops once goodput falls below `stop_fraction`
(half) of its peak so far.

The knee is the highest load whose goodput still tracks the offered load,
scanning up from the lowest load to the first that does not:
- by rate: goodput >= fraction * n / (n/rate + e2el0). That is the rate at which
  a server that keeps up completes a run of n requests: the last one arrives at
  n/rate and takes e2el0, the median E2EL at the lowest load, to finish. (The
  plain rate would flag short runs at high rates for their drain time.)
- by concurrency: at least `fraction` of the requests are good, and goodput per
  slot stays within `fraction` of the lowest load's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from collections.abc import Awaitable, Callable
from typing import Any

from ladle.bench.client import Target
from ladle.bench.datasets import SampleRequest
from ladle.bench.metrics import compute_metrics
from ladle.bench.runner import LoadSpec, run_load

BY = ("rate", "concurrency")


@dataclass
class SweepSpec:
    by: str = "rate"
    loads: list[float] | None = None  # explicit loads; else start * factor**i for max_steps steps
    start: float = 1.0
    factor: float = 2.0
    max_steps: int = 10
    knee_fraction: float = 0.9
    stop_fraction: float = 0.5

    def schedule(self) -> list[float]:
        if self.by not in BY:
            raise ValueError(f"--by must be one of {', '.join(BY)}")
        loads = list(self.loads) if self.loads else [self.start * self.factor**i for i in range(self.max_steps)]
        if self.by == "concurrency":
            loads = [float(max(1, round(x))) for x in loads]
        if any(not x > 0 for x in loads):
            raise ValueError("loads must be positive")
        return sorted(set(loads))


def step_load(by: str, load: float, base: LoadSpec) -> LoadSpec:
    if by == "rate":
        return replace(base, request_rate=load)
    return replace(base, max_concurrency=int(load))


def keep_up_rate(n: int, rate: float, e2el0_s: float) -> float:
    """Requests/s an unsaturated server completes n requests offered at `rate` in (see the module doc)."""
    return n / (n / rate + e2el0_s)


def tracks(step: dict[str, Any], base: dict[str, Any], by: str, fraction: float) -> bool:
    goodput = step["request_goodput"] or 0.0
    n = step["completed"] + step["failed"]
    if n == 0:
        return False
    if by == "rate":
        e2el0 = base["median_e2el_ms"] / 1000.0
        return goodput >= fraction * keep_up_rate(n, step["load"], e2el0)
    good_share = (step["good_completed"] or 0) / n
    base_per_slot = (base["request_goodput"] or 0.0) / base["load"]
    return good_share >= fraction and goodput / step["load"] >= fraction * base_per_slot


def find_knee(steps: list[dict[str, Any]], by: str, fraction: float = 0.9) -> int | None:
    """Index of the knee in `steps` (sorted by load), or None when even the lowest load falls short."""
    knee = None
    for i, step in enumerate(steps):
        if not tracks(step, steps[0], by, fraction):
            break
        knee = i
    return knee


def _summary(step: dict[str, Any], by: str) -> str:
    return (f"{by} {step['load']:g}: throughput {step['request_throughput']:.2f} req/s, "
            f"goodput {step['request_goodput']:.2f} req/s, p99 TTFT {step['p99_ttft_ms']:.1f} ms, "
            f"p99 TPOT {step['p99_tpot_ms']:.1f} ms, failed {step['failed']}")


async def run_sweep(target: Target, make_requests: Callable[[int], list[SampleRequest]], spec: SweepSpec,
                    base_load: LoadSpec, percentiles: list[float], slo: dict[str, float], *,
                    progress: bool = True, log: Callable[[str], None] = print,
                    before_step: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
    """Run the sweep. `make_requests(step)` gives each step its own requests (fresh prompts, so a
    prefix cache does not serve one step from another's); `before_step` runs before each (a cache reset)."""
    if not slo:
        raise ValueError("a sweep needs a goodput SLO (--goodput ttft:MS tpot:MS ...)")
    percentiles = sorted(set(percentiles) | {99.0})
    steps: list[dict[str, Any]] = []
    stop_reason = "reached the last load"
    for i, load in enumerate(spec.schedule()):
        requests = make_requests(i)
        ls = step_load(spec.by, load, base_load)
        if before_step is not None:
            await before_step()
        run = await run_load(target, requests, ls, progress=progress, desc=f"{spec.by} {load:g}")
        step = {
            "load": load,
            "request_rate": "inf" if math.isinf(ls.request_rate) else ls.request_rate,
            "burstiness": ls.burstiness,
            "max_concurrency": ls.max_concurrency,
            "num_prompts": len(requests),
            "arrival_span": run.arrival_span,
            **compute_metrics(run.results, run.duration, percentiles, slo),
        }
        steps.append(step)
        log(_summary(step, spec.by))
        peak = max(s["request_goodput"] for s in steps)
        if peak == 0:
            stop_reason = "no request met the SLO at the lowest load"
            break
        if step["request_goodput"] < spec.stop_fraction * peak:
            stop_reason = f"goodput fell below {spec.stop_fraction:g} of its peak"
            break
    base = steps[0]
    for step in steps:
        step["tracks_offered_load"] = tracks(step, base, spec.by, spec.knee_fraction)
        if spec.by == "rate":
            step["keep_up_rate"] = keep_up_rate(step["num_prompts"], step["load"], base["median_e2el_ms"] / 1000.0)
    knee = find_knee(steps, spec.by, spec.knee_fraction)
    peak_step = max(steps, key=lambda s: s["request_goodput"])
    return {
        "by": spec.by,
        "goodput_slo_ms": slo,
        "knee_fraction": spec.knee_fraction,
        "stop_fraction": spec.stop_fraction,
        "stop_reason": stop_reason,
        "unloaded_median_e2el_ms": base["median_e2el_ms"],
        "peak": {"load": peak_step["load"], "request_goodput": peak_step["request_goodput"]},
        "knee": None if knee is None else _knee_fields(steps[knee]),
        "steps": steps,
    }


def _knee_fields(step: dict[str, Any]) -> dict[str, Any]:
    keys = ("load", "request_throughput", "request_goodput", "output_throughput", "p99_ttft_ms", "p99_tpot_ms",
            "p99_e2el_ms")
    return {k: step[k] for k in keys}
