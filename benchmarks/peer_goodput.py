"""serve_vs_peers.py's goodput view: for each server, the highest concurrency and the highest request
rate at which the SLO holds for --attainment of the requests (`ladle bench sweep --search goodput`, an
HTTP tool, so any server), with warm-ups discarded, servers in turn within each round; the table holds
the median over rounds, and a PNG one attainment curve per server and axis.

The SLO is stated with the figures: by default TTFT <= 2 s and TPOT <= 100 ms for 99% of the requests,
for the 0.4B-shaped model on 2 cores.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

AXES = ("concurrency", "rate")
SEARCH_SEED = 100  # the first search's; later ones start 1000 further on


@dataclass(frozen=True)
class SearchSpec:
    slo: str = "ttft:2000,tpot:100"
    attainment: float = 0.99
    num_prompts: int = 24
    prompt_len: int = 256
    output_len: int = 32
    warmups: int = 2
    max_steps: int = 10  # doublings from the first load the search may take
    rate_start: float = 0.25  # req/s: on 2 cores a 256-token request takes seconds, so 1 req/s is past the knee


def search(base: str, label: str, rnd: int, spec: SearchSpec, logs: Path, timeout_s: float) -> dict[str, dict]:
    """Both searches against the server at `base`; returns each axis's result JSON."""
    out = {}
    for i, axis in enumerate(AXES):
        name = f"goodput-{label.replace(':', '-')}-{axis}-r{rnd + 1}.json"
        cmd = [sys.executable, "-m", "ladle.cli", "bench", "sweep", "--search", "goodput", "--by", axis,
               "--base-url", base, "--goodput", spec.slo, "--attainment", str(spec.attainment),
               "--num-prompts", str(spec.num_prompts), "--random-input-len", str(spec.prompt_len),
               "--random-output-len", str(spec.output_len), "--num-warmups", str(spec.warmups),
               "--max-steps", str(spec.max_steps), "--start", str(spec.rate_start if axis == "rate" else 1),
               "--temperature", "0", "--no-plot", "--disable-tqdm",
               "--result-dir", str(logs),
               # a search's steps draw prompts from seed + step: each axis (and round) from its own seeds, or
               # the second axis's first steps would repeat the first's prompts and hit the prefix cache
               "--seed", str(SEARCH_SEED + 1000 * (len(AXES) * rnd + i)),
               "--result-filename", name]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode not in (0, 1) or not (logs / name).is_file():  # 1: even the lowest load missed
            raise RuntimeError(f"goodput search by {axis} failed: {done.stderr[-1000:]}")
        out[axis] = json.loads((logs / name).read_text())
        best = out[axis]["best"]
        print(f"  [{label} round {rnd + 1}] goodput search by {axis}: "
              f"{'none' if best is None else format(best['load'], 'g')}", flush=True)
    return out


def table(found: dict[str, list[dict[str, dict]]]) -> dict[str, dict[str, float | None]]:
    """server -> the median over rounds of each axis's best load and its goodput in tok/s."""
    rows = {}
    for label, rounds in found.items():
        row: dict[str, float | None] = {}
        for axis in AXES:
            bests = [r[axis]["best"] for r in rounds if axis in r]
            loads = [b["load"] if b else 0.0 for b in bests]
            row[axis] = statistics.median(loads) if loads else None
            row[f"{axis}_tok_s"] = statistics.median(b["goodput_tok_s"] if b else 0.0 for b in bests) if bests \
                else None
            row[f"{axis}_first"] = min((r[axis]["steps"][0]["load"] for r in rounds if r.get(axis, {}).get("steps")),
                                       default=None)
        rows[label] = row
    return rows


def print_table(rows: dict[str, dict[str, float | None]], spec: SearchSpec) -> None:
    print(f"\ngoodput: the highest load at which {spec.attainment:.0%} of requests meet {spec.slo} "
          f"(ms; {spec.prompt_len}-token prompts, {spec.output_len} output tokens, {spec.warmups} warm-ups "
          f"discarded)\n")
    print("| server | max concurrency | goodput there (tok/s) | max request rate (req/s) | goodput there (tok/s) |")
    print("| --- | --- | --- | --- | --- |")
    for label, row in rows.items():
        cells = [_load_cell(row, "concurrency"), _cell(row.get("concurrency_tok_s"), ".1f"), _load_cell(row, "rate"),
                 _cell(row.get("rate_tok_s"), ".1f")]
        print(f"| {label} | " + " | ".join(cells) + " |")


def _cell(value: float | None, spec: str) -> str:
    return "failed" if value is None else format(value, spec)


def _load_cell(row: dict[str, float | None], axis: str) -> str:
    """The best load; a search whose first load already missed says it was below that."""
    value, first = row.get(axis), row.get(f"{axis}_first")
    if value == 0 and first is not None:
        return f"below {first:g}"
    return _cell(value, "g")


def plot(found: dict[str, list[dict[str, dict]]], spec: SearchSpec, path: Path) -> None:
    """Attainment against load, one curve per server (its first round), a panel per axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, axis in zip(fig.subplots(1, 2), AXES):
        for label, rounds in found.items():
            if rounds and axis in rounds[0]:
                steps = rounds[0][axis]["steps"]
                ax.plot([s["load"] for s in steps], [100 * s["attainment"] for s in steps], "o-", label=label)
        ax.axhline(100 * spec.attainment, color="gray", linestyle="--", label=f"target {spec.attainment:.0%}")
        ax.set_xlabel("max concurrency" if axis == "concurrency" else "request rate (req/s)")
        ax.set_ylabel(f"% of requests meeting {spec.slo}")
        ax.set_ylim(0, 105)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Goodput knee per server")
    fig.savefig(str(path), dpi=100)
