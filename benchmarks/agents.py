"""Agent sessions and reasoning budgets against `ladle serve` on the embedded model.

Part 1, the second KV tier: multi-turn agent sessions (`ladle bench serve --dataset agent`, each
turn appends tool results to the last and arrives after a seeded think time) whose contexts add up
to several times the KV pool, so other sessions' turns evict a session's prefix while its tool
runs. Per-turn TTFT p50/p99 and re-prefilled tokens per turn, with the tier off and on, and the
tier's restore cost per block against prefill's cost per block, as the server measured them.

Part 2, effort-aware scheduling: long thinkers (a large thinking budget) all at once, and short
chats arriving at a steady rate; p99 TTFT of the short ones alone, beside the long ones without
the policy, and with --max-high-effort-seqs.

Usage: python benchmarks/agents.py [--sessions 8] [--turns 6] [--png docs/agents.png] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port, machine, running_server  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from ladle.bench.client import Target  # noqa: E402
from ladle.bench.datasets import SampleRequest  # noqa: E402
from ladle.bench.discover import reset_prefix_cache  # noqa: E402
from ladle.bench.runner import LoadSpec, run_load  # noqa: E402

THINK_TEMPLATE = (  # the generation prompt opens a think block, as Qwen3's and DeepSeek-R1's do
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
CHAT = "/v1/chat/completions"


LADLE = str(Path(sys.executable).with_name("ladle"))  # the venv's console script


def serve_cmd(*flags: str) -> list[str]:
    return [LADLE, "serve", "--uvicorn-log-level", "warning", *flags]


def scrape(base: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- part 1: agent sessions, the offload tier off and on --------------------------------


def agent_run(args, offload: bool, work: Path) -> dict:
    port = free_port()
    flags = ["--port", str(port), "--num-kv-blocks", str(args.pool_blocks), "--max-num-seqs", "8"]
    if offload:
        flags += ["--kv-offload-gib", str(args.offload_gib), "--kv-offload-dir", str(work)]
    label = "offload" if offload else "recompute"
    with running_server(serve_cmd(*flags), dict(os.environ), port, work / f"{label}.log", 300) as base:
        bench = [LADLE, "bench", "serve", "--base-url", base, "--dataset", "agent",
                 "--num-prompts", str(args.sessions * args.turns), "--agent-turns", str(args.turns),
                 "--agent-system-len", str(args.system_len), "--agent-burst-len", str(args.burst_len),
                 "--agent-output-len", str(args.output_len), "--agent-think-time", str(args.think_time), "--ignore-eos",
                 "--temperature", "0", "--percentiles", "50,99", "--save-result", "--result-dir", str(work),
                 "--result-filename", f"{label}.json", "--seed", "1"]
        print(f"\n== agent sessions, {label} ==", flush=True)
        subprocess.run(bench, check=True)
        result = json.loads((work / f"{label}.json").read_text())
        for kind in ("stored", "restored", "dropped"):
            result[f"offload_{kind}"] = scrape(base, f"ladle:kv_offload_{kind}_blocks_total")
        # the break-even as the server measured it while serving
        result["restore_ms_per_block"] = 1000 * scrape(base, "ladle:kv_offload_restore_seconds_per_block")
        result["prefill_ms_per_block"] = 1000 * scrape(base, "ladle:kv_offload_prefill_seconds_per_block")
    return result


def turn_rows(result: dict) -> list[dict]:
    return result["per_turn"]


# -- part 2: short requests beside long thinkers ------------------------------------------


def short_requests(n: int, tokens: int) -> list[SampleRequest]:
    return [SampleRequest(prompt=f"Question {i}: name a colour.", prompt_len=24, output_len=tokens, endpoint=CHAT)
            for i in range(n)]


async def mixed_load(base: str, model: str, args, with_long: bool) -> list[float]:
    """TTFTs (ms) of the short requests, alone or beside the long thinkers, from a cold prefix cache."""
    short = Target(base_url=base, model=model, endpoint=CHAT, ignore_eos=True,
                   extra_body={"temperature": 0, "thinking_token_budget": 8})
    await reset_prefix_cache(short)
    long = Target(base_url=base, model=model, endpoint=CHAT, ignore_eos=True,
                  extra_body={"temperature": 0, "thinking_token_budget": args.long_budget})
    longs = [SampleRequest(prompt=f"Task {i}: plan a week of meals, thinking it through.", prompt_len=24,
                           output_len=args.long_budget + 32, endpoint=CHAT) for i in range(args.long_requests)]
    tasks = []
    if with_long:
        tasks.append(asyncio.ensure_future(run_load(long, longs, LoadSpec(), progress=False)))
        await asyncio.sleep(args.long_head_start)  # the thinkers are running when the short requests start
    spec = LoadSpec(request_rate=args.short_rate, burstiness=float("inf"))
    shorts = asyncio.ensure_future(run_load(short, short_requests(args.short_requests, args.short_tokens), spec, desc="short"))
    short_run = await shorts
    for t in tasks:
        long_run = await t
        assert all(r.success for r in long_run.results), [r.error for r in long_run.results][:3]
    bad = [r.error for r in short_run.results if not r.success]
    assert not bad, bad[:3]
    return [r.ttft * 1000 for r in short_run.results]


def effort_runs(args, work: Path) -> dict:
    """The short requests alone, then beside the long thinkers, on one server without the policy (each
    run from a cold prefix cache), and beside them again on one with it."""
    template = work / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    out = {}
    for policy, labels in ((False, ("alone", "no_policy")), (True, ("policy",))):
        port = free_port()
        flags = ["--port", str(port), "--reasoning-parser", "qwen3", "--chat-template", str(template),
                 "--max-num-seqs", str(args.max_num_seqs)]
        if policy:
            flags += ["--max-high-effort-seqs", str(args.max_high_effort_seqs), "--high-effort-tokens", "256"]
        with running_server(serve_cmd(*flags), dict(os.environ), port, work / f"effort-{labels[-1]}.log", 300) as base:
            for label in labels:
                print(f"\n== short requests, {label} ==", flush=True)
                ttfts = asyncio.run(mixed_load(base, "SmolLM2-135M-Instruct", args, with_long=label != "alone"))
                out[label] = {"ttft_p50_ms": float(np.percentile(ttfts, 50)),
                              "ttft_p99_ms": float(np.percentile(ttfts, 99))}
                print(f"  short TTFT p50 {out[label]['ttft_p50_ms']:.0f} ms, p99 {out[label]['ttft_p99_ms']:.0f} ms")
    return out


# -- report --------------------------------------------------------------------------------


def report(agent: dict[str, dict], effort: dict, args) -> dict:
    off, on = agent["recompute"], agent["offload"]
    print(f"\n{machine()}")
    print(f"agent sessions: {args.sessions} x {args.turns} turns, think time {args.think_time} s, pool "
          f"{args.pool_blocks} blocks ({args.pool_blocks * 16} tokens)")
    print(f"{'turn':>4} {'reprefill off':>14} {'reprefill on':>13} {'TTFT p50 off':>13} {'TTFT p50 on':>12} "
          f"{'TTFT p99 off':>13} {'TTFT p99 on':>12}")
    for a, b in zip(turn_rows(off), turn_rows(on)):
        print(f"{a['turn']:>4} {a['reprefilled_tokens_mean']:>14.0f} {b['reprefilled_tokens_mean']:>13.0f} "
              f"{a['ttft_p50_ms']:>13.0f} {b['ttft_p50_ms']:>12.0f} {a['ttft_p99_ms']:>13.0f} {b['ttft_p99_ms']:>12.0f}")
    later = lambda r: [t for t in turn_rows(r) if t["turn"] >= 1]  # noqa: E731 - turns with a context to reuse
    reprefill = {k: sum(t["reprefilled_tokens_mean"] * t["requests"] for t in later(r)) for k, r in agent.items()}
    ttft = {k: float(np.median([t["ttft_p50_ms"] for t in later(r)])) for k, r in agent.items()}
    summary = {
        "max_prompt_tokens": max(t["prompt_tokens_mean"] for t in turn_rows(off)),
        "reprefill_ratio": reprefill["recompute"] / max(reprefill["offload"], 1.0),
        "ttft_ratio": ttft["recompute"] / ttft["offload"],
        "restored_blocks": on["offload_restored"], "stored_blocks": on["offload_stored"],
        "dropped_blocks": on["offload_dropped"],
        "restore_ms_per_block": on["restore_ms_per_block"], "prefill_ms_per_block": on["prefill_ms_per_block"],
    }
    print(f"re-prefilled tokens, turns 1+: recompute {reprefill['recompute']:.0f}, offload {reprefill['offload']:.0f}"
          f" ({summary['reprefill_ratio']:.1f}x fewer; target >= 3x)")
    print(f"median per-turn TTFT p50: recompute {ttft['recompute']:.0f} ms, offload {ttft['offload']:.0f} ms "
          f"({summary['ttft_ratio']:.1f}x; target >= 2x)")
    print(f"tier: {on['offload_stored']:.0f} stored, {on['offload_restored']:.0f} restored, "
          f"{on['offload_dropped']:.0f} dropped; a block reads back in {on['restore_ms_per_block']:.2f} ms, "
          f"its tokens prefill in {on['prefill_ms_per_block']:.2f} ms (restore while faster)")
    alone = effort["alone"]["ttft_p99_ms"]
    for label in ("alone", "no_policy", "policy"):
        e = effort[label]
        print(f"short TTFT {label:>9}: p50 {e['ttft_p50_ms']:6.0f} ms  p99 {e['ttft_p99_ms']:6.0f} ms  "
              f"({e['ttft_p99_ms'] / alone:.2f}x alone's p99)")
    summary["policy_p99_vs_alone"] = effort["policy"]["ttft_p99_ms"] / alone
    summary["no_policy_p99_vs_alone"] = effort["no_policy"]["ttft_p99_ms"] / alone
    print(f"effort-aware policy: short p99 {summary['policy_p99_vs_alone']:.2f}x unloaded (target <= 2x); "
          f"without it {summary['no_policy_p99_vs_alone']:.2f}x")
    return summary


def plot(agent: dict, effort: dict, path: str, where: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, r in agent.items():
        turns = [t["turn"] for t in turn_rows(r)]
        a.plot(turns, [t["ttft_p50_ms"] for t in turn_rows(r)], marker="o", label=f"{label} p50")
        a.plot(turns, [t["ttft_p99_ms"] for t in turn_rows(r)], marker="x", linestyle="--", label=f"{label} p99")
        b.plot(turns, [t["reprefilled_tokens_mean"] for t in turn_rows(r)], marker="o", label=label)
    a.set(title="TTFT per turn", xlabel="turn", ylabel="ms")
    b.set(title="re-prefilled tokens per turn (mean)", xlabel="turn", ylabel="tokens")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    labels = list(effort)
    c.bar(labels, [effort[k]["ttft_p99_ms"] for k in labels], color=["grey", "tab:red", "tab:green"])
    c.set(title="short requests' p99 TTFT beside long thinkers", ylabel="ms (log scale)", yscale="log")
    fig.suptitle(f"ladle agents and reasoning budgets: {where or machine()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--burst-len", type=int, default=128)
    p.add_argument("--think-time", type=float, default=2.0)
    p.add_argument("--pool-blocks", type=int, default=192)
    p.add_argument("--offload-gib", type=float, default=2.0)
    p.add_argument("--long-requests", type=int, default=8)
    p.add_argument("--long-budget", type=int, default=512)
    p.add_argument("--short-requests", type=int, default=30)
    p.add_argument("--short-rate", type=float, default=1.0)
    p.add_argument("--short-tokens", type=int, default=24)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-high-effort-seqs", type=int, default=4)
    p.add_argument("--output-len", type=int, default=32, help="tokens each agent turn generates")
    p.add_argument("--long-head-start", type=float, default=2.0, help="seconds the thinkers run before the chats")
    p.add_argument("--png", default=None, help="default: docs/agents.png (--quick: a temporary folder)")
    p.add_argument("--json", default=None)
    p.add_argument("--replot", default=None, metavar="JSON", help="only redraw the PNG from a --json result")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 sessions of 2 short turns, 1 thinker and 3 chats of a few tokens")
    args = p.parse_args()
    if args.quick:
        for name, value in dict(sessions=2, turns=2, system_len=32, burst_len=16, think_time=0.05, pool_blocks=64,
                                offload_gib=0.25, long_requests=1, long_budget=16, short_requests=3,
                                short_rate=10.0, short_tokens=4, output_len=4, long_head_start=0.2).items():
            setattr(args, name, value)
        args.png = args.png or str(Path(tempfile.mkdtemp(prefix="ladle-agents-quick-")) / "agents.png")
    args.png = args.png or "docs/agents.png"
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        plot(saved["agent"], saved["effort"], args.png, saved["machine"])
        return
    with tempfile.TemporaryDirectory(prefix="ladle-agents-") as tmp:
        work = Path(tmp)
        agent = {label: agent_run(args, label == "offload", work) for label in ("recompute", "offload")}
        effort = effort_runs(args, work)
    summary = report(agent, effort, args)
    plot(agent, effort, args.png)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "summary": summary, "agent": agent,
                                               "effort": effort}, indent=1))


if __name__ == "__main__":
    main()
