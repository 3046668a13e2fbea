"""Aggregate request results into vLLM's `bench serve` metrics, goodput included.

A request is good when it succeeded and meets every SLO given (DistServe's
goodput, as vLLM computes it): TTFT <= ttft, TPOT <= tpot, E2EL <= e2el, in ms.
TPOT = (E2EL - TTFT) / (output tokens - 1); a request of at most one output
token has no TPOT sample, and counts as TPOT 0 against the SLO. ITL <= itl holds
when the 99th percentile of the request's own inter-token gaps is within it (the
SLO serving playbooks state on ITL p99: a stall mid-stream fails it, where the
mean a TPOT takes would hide it); a request with no gaps meets it.

Goodput is given in requests (`request_goodput`) and in tokens (`goodput_tok_s`:
the output tokens of the good requests), each per second of the run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ladle.bench.client import RequestResult

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
ITL_SLO_PERCENTILE = 99.0
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` (or one comma-separated item) -> {"ttft": 500.0, "tpot": 50.0}, in ms."""
    slo: dict[str, float] = {}
    for item in items or []:
        for pair in filter(None, item.split(",")):
            name, sep, value = pair.partition(":")
            name = name.strip().lower()
            if not sep or name not in SLO_METRICS:
                raise ValueError(f"bad goodput SLO {pair!r}: use KEY:MS with KEY one of {', '.join(SLO_METRICS)}")
            ms = float(value)
            if not ms >= 0:
                raise ValueError(f"goodput SLO {pair!r} must be a non-negative number of ms")
            slo[name] = ms
    return slo


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in str(text).split(",") if p.strip()]
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"bad percentiles {text!r}: use comma-separated numbers in (0, 100]")
    return values


def percentile_key(p: float, metric: str) -> str:
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def tpot(r: RequestResult) -> float:
    """Seconds per output token after the first; 0 for a single-token (or empty) answer."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def request_itl(r: RequestResult) -> float:
    """Seconds: the 99th percentile of the request's inter-token gaps (0 without any)."""
    return float(np.percentile(r.itl, ITL_SLO_PERCENTILE)) if r.itl else 0.0


def is_good(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.success:
        return False
    measured = {"ttft": r.ttft, "tpot": tpot(r), "e2el": r.latency}
    if "itl" in slo:
        measured["itl"] = request_itl(r)
    return all(measured[name] * 1000.0 <= limit for name, limit in slo.items())


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """(max output tokens in any one-second bucket, max requests in flight at once), as vLLM reports."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    buckets: dict[int, int] = {}
    events = []
    for r in ok:
        for stamp in np.cumsum([r.start_time + r.ttft, *r.itl]):
            second = int(stamp - t0)
            buckets[second] = buckets.get(second, 0) + 1
        events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    in_flight = peak = 0
    for _, delta in sorted(events):  # ends (-1) sort before starts at the same instant
        in_flight += delta
        peak = max(peak, in_flight)
    return float(max(buckets.values())), peak


def compute_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                    slo: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM's result fields: throughputs per second of `duration`, latencies in ms.

    `request_goodput` is None when no SLO is given (as in vLLM).
    """
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [tpot(r) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    good_requests = [r for r in ok if is_good(r, slo)] if slo else None
    peak_tokens, peak_requests = _peaks(ok)
    dur = max(duration, 1e-9)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / dur,
        "request_goodput": None if good_requests is None else len(good_requests) / dur,
        "goodput_tok_s": None if good_requests is None else sum(r.output_tokens for r in good_requests) / dur,
        "good_completed": None if good_requests is None else len(good_requests),
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    for metric in LATENCY_METRICS:
        ms = np.asarray(samples[metric] or [0.0]) * 1000.0
        out[f"mean_{metric}_ms"] = float(np.mean(ms))
        out[f"median_{metric}_ms"] = float(np.median(ms))
        out[f"std_{metric}_ms"] = float(np.std(ms))
        for p in percentiles:
            out[percentile_key(p, metric)] = float(np.percentile(ms, p))
    return out


def agent_turn_metrics(results: list[RequestResult]) -> dict[str, Any] | None:
    """Agent sessions turn by turn: TTFT, and how much of each turn's prompt the server had cached
    (usage.prompt_tokens_details.cached_tokens) or had to prefill again. None for runs without turns.

    Cache figures count the successful requests whose server reported cached tokens, None where none did.
    """
    turns = sorted({r.turn for r in results if r.turn is not None})
    if not turns:
        return None
    ok = [r for r in results if r.success and r.turn is not None]
    reported = [r for r in ok if r.cached_tokens is not None]
    later = [r for r in reported if r.turn >= 1]
    totals = {
        "prefix_hit_rate": _hit_rate(reported),
        "reprefilled_tokens_total": sum(_reprefilled(r) for r in reported) if reported else None,
        # turns with a previous context: what a prefix cache (and a second KV tier) should spare
        "reprefilled_tokens_per_turn_mean": _mean([_reprefilled(r) for r in later]),
    }
    return {"per_turn": [_turn_row(t, [r for r in ok if r.turn == t]) for t in turns], "agent": totals}


def _turn_row(turn: int, ok: list[RequestResult]) -> dict[str, Any]:
    ttft_ms = [r.ttft * 1000.0 for r in ok]
    reported = [r for r in ok if r.cached_tokens is not None]
    return {
        "turn": turn,
        "requests": len(ok),
        "ttft_p50_ms": _percentile(ttft_ms, 50),
        "ttft_p99_ms": _percentile(ttft_ms, 99),
        "prompt_tokens_mean": _mean([r.prompt_len for r in ok]),
        "cached_tokens_mean": _mean([r.cached_tokens for r in reported]),
        "prefix_hit_rate": _hit_rate(reported),
        "reprefilled_tokens_mean": _mean([_reprefilled(r) for r in reported]),
    }


def _reprefilled(r: RequestResult) -> int:
    """Prompt tokens the server had to prefill: all but those its prefix cache held."""
    return r.prompt_len - (r.cached_tokens or 0)


def _hit_rate(reported: list[RequestResult]) -> float | None:
    prompt = sum(r.prompt_len for r in reported)
    return sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _percentile(values: list[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if values else None


def per_request_fields(results: list[RequestResult]) -> dict[str, list[Any]]:
    """The per-request arrays `vllm bench serve --save-detailed` writes, and ladle's own when present."""
    fields: dict[str, list[Any]] = {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "queue_times": [r.queue_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }
    # figures only some servers and datasets have
    if any(r.cached_tokens is not None for r in results):
        fields["cached_tokens"] = [r.cached_tokens for r in results]
    if any(r.turn is not None for r in results):
        fields["turns"] = [r.turn for r in results]
    return fields
