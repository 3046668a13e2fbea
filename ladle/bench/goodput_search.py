"""`ladle bench sweep --search goodput`: the highest load at which the share of requests meeting every
SLO (attainment) stays at or above a target, as GuideLLM's goodput profile searches for it.

The load (a request rate or a concurrency) doubles from --start until a run misses the target, then
the last load that met it and the first that missed are bisected until they are within 10% of each
other (for a concurrency: adjacent). The answer is the highest load measured to meet the target; every
run measured is kept, in load order.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ladle.bench.client import Target
from ladle.bench.datasets import SampleRequest
from ladle.bench.metrics import compute_metrics
from ladle.bench.runner import LoadSpec, run_load
from ladle.bench.sweep import step_load


@dataclass
class GoodputSearch:
    by: str = "concurrency"
    start: float = 1.0
    attainment: float = 0.95  # the share of requests that must meet every SLO
    tolerance: float = 0.1  # bisect until the bracket is this close (relative)
    max_load: float = 4096.0

    def validate(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError("--attainment must be in (0, 1]")
        if not self.start > 0 or not self.max_load >= self.start:
            raise ValueError("--start must be positive and at most the search's largest load")

    def next_between(self, lo: float, hi: float) -> float | None:
        """The load to try between a passing lo and a failing hi; None once they are close enough."""
        if self.by == "concurrency":
            return None if hi - lo <= 1 else float((int(lo) + int(hi)) // 2)
        return None if hi <= lo * (1 + self.tolerance) else (lo + hi) / 2


def attainment(step: dict[str, Any]) -> float:
    n = step["completed"] + step["failed"]
    return (step["good_completed"] or 0) / n if n else 0.0


async def search_goodput(target: Target, make_requests: Callable[[int], list[SampleRequest]], spec: GoodputSearch,
                         base_load: LoadSpec, percentiles: list[float], slo: dict[str, float], *,
                         progress: bool = True, log: Callable[[str], None] = print,
                         before_step: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
    """Run the search; returns the result JSON's fields (the best load passing, every step measured)."""
    if not slo:
        raise ValueError("a goodput search needs a goodput SLO (--goodput ttft:MS tpot:MS ...)")
    spec.validate()
    steps: list[dict[str, Any]] = []

    async def passes(load: float) -> bool:
        if before_step is not None:
            await before_step()
        ls = step_load(spec.by, load, base_load)
        requests = make_requests(len(steps))
        run = await run_load(target, requests, ls, progress=progress, desc=f"{spec.by} {load:g}")
        step = {"load": load, "request_rate": "inf" if math.isinf(ls.request_rate) else ls.request_rate,
                "max_concurrency": ls.max_concurrency, "num_prompts": len(requests),
                **compute_metrics(run.results, run.duration, percentiles, slo)}
        step["attainment"] = attainment(step)
        step["meets_target"] = step["attainment"] >= spec.attainment
        steps.append(step)
        log(f"{spec.by} {load:g}: attainment {step['attainment']:.1%} "
            f"({'meets' if step['meets_target'] else 'misses'} {spec.attainment:.0%}), "
            f"goodput {step['request_goodput']:.2f} req/s, {step['goodput_tok_s']:.1f} tok/s")
        return step["meets_target"]

    lo, hi, load = None, None, spec.start
    while load <= spec.max_load:
        if not await passes(load):
            hi = load
            break
        lo, load = load, load * 2
    while lo is not None and hi is not None and (mid := spec.next_between(lo, hi)) is not None:
        if await passes(mid):
            lo = mid
        else:
            hi = mid
    steps.sort(key=lambda s: s["load"])
    best = next((s for s in reversed(steps) if s["meets_target"] and s["load"] == lo), None)
    return {"search": "goodput", "by": spec.by, "goodput_slo_ms": slo, "attainment_target": spec.attainment,
            "best": None if best is None else _best_fields(best), "first_miss": hi, "steps": steps}


def _best_fields(step: dict[str, Any]) -> dict[str, Any]:
    keys = ("load", "attainment", "request_goodput", "goodput_tok_s", "request_throughput", "p99_ttft_ms",
            "p99_tpot_ms", "p99_itl_ms")
    return {k: step[k] for k in keys}
