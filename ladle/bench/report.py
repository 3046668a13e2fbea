"""What a benchmark leaves behind: vLLM's result table, provenance, and result files."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from ladle.bench.metrics import LATENCY_METRICS, percentile_key

HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
SECRET_FLAGS = ("api_key", "header")


def format_table(result: dict[str, Any], percentiles: list[float],
                 metrics: tuple[str, ...] = LATENCY_METRICS) -> str:
    """The "Serving Benchmark Result" table of `vllm bench serve`."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append("{:<40} {:<10}".format(label, format(value, fmt)))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    rate = result.get("request_rate")
    if rate not in (None, "inf") and not math.isinf(float(rate)):
        row("Request rate configured (RPS):", float(rate), ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
        row("Token goodput (tok/s):", result["goodput_tok_s"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"], ".2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for metric in metrics:
        short, header = HEADERS[metric]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{metric}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{metric}_ms"], ".2f")
        for p in percentiles:
            key = percentile_key(p, metric)
            row(f"P{key[1:].split('_')[0]} {short} (ms):", result[key], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def redact(flags: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in flags.items():
        if key in SECRET_FLAGS and value:
            value = "<redacted>"
        elif isinstance(value, float) and math.isinf(value):
            value = "inf"
        elif not isinstance(value, (str, int, float, bool, list, dict, type(None))):
            value = str(value)
        out[key] = value
    return out


def provenance(flags: dict[str, Any], model: str, target_version: Any, **extra: Any) -> dict[str, Any]:
    """Who measured what, where: tool version, the target's /version, model, machine, every flag."""
    from ladle import __version__

    return {
        "tool": "ladle bench",
        "tool_version": __version__,
        "target_version": target_version,
        "model": model,
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
        "command": " ".join(["ladle", *sys.argv[1:]]) if sys.argv and "ladle" in sys.argv[0] else None,
        "flags": redact(flags),
        **extra,
    }


def timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def result_path(result_dir: str | None, filename: str | None, default_name: str) -> Path:
    path = Path(result_dir or ".") / (filename or default_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(_finite(data), indent=2, default=_json_default) + "\n", encoding="utf-8")


def _finite(value: Any) -> Any:
    """inf and nan as strings ("inf", as vLLM writes an infinite rate): strict JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


def format_turn_table(per_turn: list[dict[str, Any]], agent: dict[str, Any] | None = None) -> str:
    """Agent sessions turn by turn (metrics.agent_turn_metrics): TTFT, and the prompt tokens the server
    had cached or prefilled again; "-" where the server reported no cached tokens."""
    columns = "{:>4} {:>5} {:>11} {:>11} {:>9} {:>9} {:>9} {:>12}"
    lines = ["{s:{c}^{n}}".format(s=" Agent Turns ", n=76, c="="),
             columns.format("turn", "reqs", "TTFT p50ms", "TTFT p99ms", "prompt", "cached", "hit rate",
                            "re-prefilled")]
    for t in per_turn:
        lines.append(columns.format(
            t["turn"], t["requests"], _num(t["ttft_p50_ms"], ".1f"), _num(t["ttft_p99_ms"], ".1f"),
            _num(t["prompt_tokens_mean"], ".0f"), _num(t["cached_tokens_mean"], ".0f"),
            _num(t["prefix_hit_rate"], ".1%"), _num(t["reprefilled_tokens_mean"], ".0f")))
    if agent is not None:
        lines.append("-" * 76)
        lines.append(f"all turns: hit rate {_num(agent['prefix_hit_rate'], '.1%')}, re-prefilled "
                     f"{_num(agent['reprefilled_tokens_total'], '.0f')} tokens, "
                     f"{_num(agent['reprefilled_tokens_per_turn_mean'], '.0f')} a turn after the first")
    lines.append("=" * 76)
    return "\n".join(lines)


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)
