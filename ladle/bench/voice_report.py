"""What `ladle bench voice` prints and draws: the wait-vs-eager table and the latency distributions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

WIDTH = 78
COLORS = {"wait": "C0", "eager": "C1"}


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_voice_table(result: dict[str, Any]) -> str:
    """Modes side by side (p50/p95 latencies from the end of speech, drafts, tokens), with eager/wait ratios."""
    summary: dict[str, dict[str, Any]] = result["summary"]
    modes = list(summary)
    ratios = result.get("ratios")
    both = ratios is not None
    lines = ["{s:{c}^{n}}".format(s=" Voice Turn Benchmark ", n=WIDTH, c="=")]
    lines.append(f"Model: {result.get('model_id', '')}")
    lines.append(f"Order: {result['order']} passes: {', '.join(result['passes'])} (a pass replays every "
                 f"conversation once)")
    lines.append(f"Conversations: {result['conversations']} ({result['turns_per_pass']} turns a pass); max "
                 f"concurrency {result['max_concurrency']}; cancel by {result['cancel']}")
    head = "{:<42}" + "{:>12}" * (len(modes) + both)
    lines.append(head.format("", *modes, *(["eager/wait"] if both else [])))
    lines.append("-" * WIDTH)

    def row(label: str, values: list[str], ratio: float | None | str = "") -> None:
        extra = [ratio if isinstance(ratio, str) else _fmt(ratio, ".2f")] if both else []
        lines.append(head.format(label, *values, *extra))

    def each(fn: Any) -> list[str]:
        return [fn(summary[m]) for m in modes]

    row("Turns (failed)", each(lambda s: f"{s['completed_turns']} ({s['failed_turns']})"))
    for metric, label in (("first_token", "first token"), ("first_sentence", "first sentence")):
        for p in ("p50", "p95"):
            row(f"End of speech -> {label} {p} (ms)", each(lambda s: _fmt(s[f"{p}_{metric}_ms"], ".1f")),
                ratios[f"{p}_{metric}"] if both else "")
    row("Reply TTFT p50 (ms)", each(lambda s: _fmt(s["p50_reply_ttft_ms"], ".1f")))
    row("Drafts started", each(lambda s: str(s["drafts_started"])))
    row("Drafts used (of started)", each(lambda s: _share(s["drafts_used"], s["draft_use_rate"])))
    row("Drafts cancelled (of started)", each(lambda s: _share(s["drafts_cancelled"], s["draft_cancel_rate"])))
    row("Turns answered by a draft", each(lambda s: _fmt(s["turns_answered_by_draft"], ".0%")))
    row("Wasted tokens (per turn)",
        each(lambda s: f"{s['wasted_tokens']} ({_fmt(s['wasted_tokens_per_turn'], '.1f')})"))
    row("Cached prompt tokens, mean", each(lambda s: _fmt(s["cached_tokens_mean"], ".0f")))
    row("Prefix hit rate", each(lambda s: _fmt(s["prefix_hit_rate"], ".1%")))
    row("Barge-ins", each(lambda s: str(s["barge_ins"])))
    if any("server_p50_first_token_ms" in summary[m] for m in modes):
        for key, label in (("queued_ms", "queued"), ("prefill_ms", "prefill"), ("first_token_ms", "first token")):
            row(f"Server {label} p50 (ms)", each(lambda s: _fmt(s.get(f"server_p50_{key}"), ".1f")))
    lines.append("=" * WIDTH)
    if both:
        lines.append(f"Median eager/wait, end of speech -> first token: {_fmt(ratios['p50_first_token'], '.2f')} "
                     f"(ratio of medians), {_fmt(ratios['paired_median_first_token'], '.2f')} (median of "
                     f"per-turn ratios)")
        lines.append(f"Median eager/wait, end of speech -> first sentence: "
                     f"{_fmt(ratios['p50_first_sentence'], '.2f')} (ratio of medians), "
                     f"{_fmt(ratios['paired_median_first_sentence'], '.2f')} (median of per-turn ratios)")
    return "\n".join(lines)


def _share(count: int, rate: float | None) -> str:
    return f"{count} ({_fmt(rate, '.0%')})" if rate is not None else "-"


def plot_voice(result: dict[str, Any], path: str | Path, where: str | None = None) -> None:
    """Per-turn end of speech -> first token and -> first sentence, each mode's distribution (ECDF) with
    its p50 (dashed) and p95 (dotted); `where` (e.g. the CPU) joins the title. Matplotlib's Agg canvas, no
    pyplot."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, metric, title in ((axes[0], "first_token", "end of speech -> first token"),
                              (axes[1], "first_sentence", "end of speech -> first sentence")):
        for mode, s in result["summary"].items():
            values = np.sort([r[f"{metric}_ms"] for r in result["turns"]
                              if r["mode"] == mode and r[f"{metric}_ms"] is not None])
            if not len(values):
                continue
            color = COLORS.get(mode)
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", color=color,
                    label=f"{mode} (n={len(values)})")
            for p, style in (("p50", "--"), ("p95", ":")):
                x = s[f"{p}_{metric}_ms"]
                ax.axvline(x, color=color, linestyle=style, alpha=0.8, label=f"{mode} {p} {x:.0f} ms")
        ax.set_xlim(left=0)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("ms from the end of speech")
        ax.set_ylabel("share of turns")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    ratio = (result.get("ratios") or {}).get("p50_first_token")
    note = f"; median eager/wait {ratio:.2f}" if ratio is not None else ""
    fig.suptitle(f"ladle bench voice: {result.get('model_id', '')}, cancel by {result['cancel']}, "
                 f"{result['order']} passes{note}" + (f"\n{where}" if where else ""), fontsize=10)
    fig.savefig(str(path), dpi=100)
