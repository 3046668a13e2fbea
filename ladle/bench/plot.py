"""The sweep's picture: throughput and goodput, p99 TTFT, TPOT and E2EL against load.

Drawn on matplotlib's Agg canvas directly (no pyplot), so it needs no display
and leaves the process's matplotlib backend alone; imported only when a sweep
writes its PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_sweep(sweep: dict[str, Any], path: str | Path, marked: str = "knee") -> None:
    """marked: the step the sweep singles out, "knee" (a sweep's) or "best" (a goodput search's)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = sweep["steps"]
    by = sweep["by"]
    loads = [s["load"] for s in steps]
    slo = sweep.get("goodput_slo_ms") or {}
    knee = sweep.get(marked)
    xlabel = "request rate (req/s)" if by == "rate" else "max concurrency"

    fig = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    ax = axes[0][0]
    ax.plot(loads, [s["request_throughput"] for s in steps], "o-", label="throughput")
    ax.plot(loads, [s["request_goodput"] for s in steps], "s-", label="goodput")
    if by == "rate":
        ax.plot(loads, loads, ":", color="gray", label="offered")
    if knee is not None:
        ax.plot([knee["load"]], [knee["request_goodput"]], "*", color="black", markersize=14, zorder=5)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("requests/s")
    ax.set_title("Throughput and goodput")
    panels = [(axes[0][1], "ttft", "p99 TTFT"), (axes[1][0], "tpot", "p99 TPOT"), (axes[1][1], "e2el", "p99 E2EL")]
    for ax_, metric, title in panels:
        ax_.plot(loads, [s[f"p99_{metric}_ms"] for s in steps], "o-", color="C3", label=title)
        if metric in slo:
            ax_.axhline(slo[metric], color="C2", linestyle="--", label=f"SLO {slo[metric]:g} ms")
        ax_.set_ylim(bottom=0)
        ax_.set_ylabel("ms")
        ax_.set_title(title)
    for ax_ in (ax, *(p[0] for p in panels)):
        if knee is not None:
            ax_.axvline(knee["load"], color="black", linestyle="-.", alpha=0.6, label=f"{marked} {knee['load']:g}")
        if len(loads) > 1 and max(loads) / min(loads) >= 8:
            ax_.set_xscale("log", base=2)
        ax_.set_xlabel(xlabel)
        ax_.grid(True, alpha=0.3)
        ax_.legend(fontsize=8)
    slo_text = ", ".join(f"{k} <= {v:g} ms" for k, v in slo.items())
    fig.suptitle(f"{sweep.get('model', '')}  goodput SLO: {slo_text}".strip())
    fig.savefig(str(path), dpi=100)
