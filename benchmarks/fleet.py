"""Replicas behind `ladle router`, and prefill/decode disaggregation, on one machine.

(1) Shared-prefix traffic: several distinct long prefixes whose total is several times one
worker's KV pool (each worker's pool holds its share of them under a routing that keeps each
prefix on one worker), every request a prefix plus a question of its own. Each routing policy
gets a fresh fleet (empty caches) and the same requests; reported: output tok/s, p50/p90 TTFT,
the workers' prefix-cache hit rate, and how the requests spread.

(2) Long prompts mixed with streaming chats under an SLO: goodput (requests per second meeting
TTFT and TPOT limits) of two colocated workers behind the router against one prefill worker
handing K/V to one decode worker, with the same cores (one thread per worker), at a few
request rates.

The cores are split between the worker processes (one thread each, oversubscribed when there
are more workers than cores): the same for every policy and layout, so the ratios compare
routing, not hardware. Writes the table as JSON and the figures as a PNG.

Usage: python benchmarks/fleet.py [--workers 4] [--prefixes 8] [--prefix-tokens 1024] [--requests 96]
                                  [--concurrency 8] [--policies ...] [--rates 0.25 0.5 0.75] [--skip-prefix]
                                  [--skip-disagg] [--png docs/fleet.png] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port, machine, running_server, running_servers  # noqa: E402

from ladle.bench.client import Target  # noqa: E402
from ladle.bench.datasets import SampleRequest  # noqa: E402
from ladle.bench.metrics import is_good, tpot  # noqa: E402
from ladle.bench.runner import LoadSpec, run_load  # noqa: E402
from ladle.bench.words import random_words  # noqa: E402

LADLE = str(Path(sys.executable).with_name("ladle"))
POLICIES = ("round_robin", "least_load", "cache_aware", "kv_events")
BLOCK = 16


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="worker processes for the shared-prefix part")
    p.add_argument("--prefixes", type=int, default=8, help="distinct shared prefixes")
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--requests", type=int, default=96, help="requests per policy")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 0.75], help="requests/s, disaggregation part")
    p.add_argument("--mix-requests", type=int, default=32, help="requests per rate, disaggregation part")
    p.add_argument("--long-tokens", type=int, default=512, help="the long prompts of the mix")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--skip-prefix", action="store_true")
    p.add_argument("--skip-warm", action="store_true", help="skip (1b), the router restarted over warm workers")
    p.add_argument("--skip-disagg", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--png", default=None, help="default: docs/fleet.png (--quick: a temporary folder)")
    p.add_argument("--json", default=None, help="default: the PNG's path with .json")
    p.add_argument("--update", action="store_true",
                   help="keep the parts of an earlier result in --json that this run skips, and redraw the PNG")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 workers, cache_aware alone over 2 short prefixes (4 requests, no warm "
                        "restart), 4 requests at one rate for the disaggregation part")
    args = p.parse_args(argv)
    if args.quick:
        for name, value in dict(workers=2, prefixes=2, prefix_tokens=48, requests=4, concurrency=2, max_tokens=4,
                                policies=["cache_aware"], skip_warm=True, rates=[2.0], mix_requests=4,
                                long_tokens=64).items():
            setattr(args, name, value)
        args.png = args.png or str(Path(tempfile.mkdtemp(prefix="ladle-fleet-quick-")) / "fleet.png")
    args.png = args.png or "docs/fleet.png"
    return args


# -- processes ---------------------------------------------------------------------------


def start_workers(stack: ExitStack, work: Path, name: str, count: int, flags: list[str]) -> list[str]:
    """`count` alike ladle serve processes, one thread each; their base URLs once all are healthy."""
    return start_serves(stack, work, [(f"{name}-{i}", flags) for i in range(count)])


def start_serves(stack: ExitStack, work: Path, named_flags: list[tuple[str, list[str]]]) -> list[str]:
    """One ladle serve process (one thread) per (log name, flags), loading side by side; their base
    URLs once all are healthy."""
    servers = []
    for name, flags in named_flags:
        port = free_port()
        cmd = [LADLE, "serve", "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1", "--no-webui",
               "--uvicorn-log-level", "warning", *flags]
        servers.append((cmd, port, work / f"{name}.log"))
    return stack.enter_context(running_servers(servers, dict(os.environ), 600.0))


def start_router(stack: ExitStack, work: Path, name: str, args: list[str]) -> str:
    port = free_port()
    cmd = [LADLE, "router", "--host", "127.0.0.1", "--port", str(port), *args]
    return stack.enter_context(running_server(cmd, dict(os.environ), port, work / f"{name}-router.log", 120.0))


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


# -- (1) shared prefixes -------------------------------------------------------------------


def prefix_requests(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[str], list[SampleRequest]]:
    prefixes = [f"Document {k}. " + random_words(rng, args.prefix_tokens) for k in range(args.prefixes)]
    order = rng.integers(0, args.prefixes, size=args.requests)
    return prefixes, [SampleRequest(prompt=f"{prefixes[k]}\nQuestion {i}: {random_words(rng, 24)}?\nAnswer:",
                                    prompt_len=args.prefix_tokens + 32, output_len=args.max_tokens)
                      for i, k in enumerate(order)]


def warm_directly(workers: list[str], prefixes: list[str]) -> None:
    """Each prefix computed on one worker without the router (another router's traffic, or this
    router's before a restart): the workers' caches are warm, the router's own estimate empty."""
    for k, prefix in enumerate(prefixes):
        body = {"model": "SmolLM2-135M-Instruct", "prompt": f"{prefix}\nQuestion: warm?\nAnswer:", "max_tokens": 1}
        httpx.post(f"{workers[k % len(workers)]}/v1/completions", json=body, timeout=600).raise_for_status()


def pool_blocks(args: argparse.Namespace) -> int:
    """Each worker's KV pool: its share of the prefixes under cache-aware routing, with room to run."""
    share = math.ceil(args.prefixes / args.workers)
    per_prefix = math.ceil((args.prefix_tokens + 48) / BLOCK)
    per_request = math.ceil((args.max_tokens + 48) / BLOCK)
    return share * per_prefix + args.concurrency * per_request + 8


def run_policy(args: argparse.Namespace, work: Path, policy: str, requests: list[SampleRequest],
               warm: list[str] | None = None) -> dict:
    print(f"\n== {policy}: {args.workers} fresh workers{', caches warmed without the router' if warm else ''} ==",
          flush=True)
    with ExitStack() as stack:
        workers = start_workers(stack, work, policy, args.workers, ["--num-kv-blocks", str(pool_blocks(args))])
        if warm:
            warm_directly(workers, warm)
            before = [scrape(w) for w in workers]
        router = start_router(stack, work, policy, ["--policy", policy, *sum((["--worker", w] for w in workers), [])])
        target = Target(base_url=router, model="SmolLM2-135M-Instruct", ignore_eos=True,
                        extra_body={"temperature": 0.0})
        run = asyncio.run(run_load(target, requests, LoadSpec(max_concurrency=args.concurrency), desc=policy))
        per_worker = [scrape(w) for w in workers]
    ok = [r for r in run.results if r.success]
    if warm:  # the routed requests' figures only
        per_worker = [{k: v - b.get(k, 0.0) for k, v in m.items()} for m, b in zip(per_worker, before)]
    hits = sum(m.get("vllm:prefix_cache_hits_total", 0) for m in per_worker)
    queries = sum(m.get("vllm:prefix_cache_queries_total", 0) for m in per_worker)
    ttfts = [r.ttft for r in ok]
    return {"policy": policy, "ok": len(ok), "failed": len(run.results) - len(ok), "duration_s": run.duration,
            "output_tok_s": sum(r.output_tokens for r in ok) / run.duration,
            "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_p90_s": float(np.percentile(ttfts, 90)) if ttfts else None,
            "hit_rate": hits / queries if queries else 0.0,
            "requests_per_worker": [int(m.get("vllm:request_success_total", 0)) for m in per_worker]}


def shared_prefix(args: argparse.Namespace, work: Path) -> list[dict]:
    _, requests = prefix_requests(args, np.random.default_rng(0))
    blocks = pool_blocks(args)
    total = args.prefixes * math.ceil(args.prefix_tokens / BLOCK)
    print(f"\n(1) shared prefixes: {args.prefixes} x ~{args.prefix_tokens} tokens = ~{total} blocks, "
          f"{blocks} blocks per worker ({total / blocks:.1f}x one pool), {args.workers} workers x 1 thread, "
          f"{args.requests} requests, {args.concurrency} at once, {args.max_tokens} output tokens", flush=True)
    return [run_policy(args, work, p, requests) for p in args.policies]


def warm_restart(args: argparse.Namespace, work: Path) -> list[dict]:
    prefixes, requests = prefix_requests(args, np.random.default_rng(0))
    print("\n(1b) the same traffic to workers whose caches are already warm (each prefix computed once on "
          "one worker without the router: a restarted router, or a fleet shared by several)", flush=True)
    return [run_policy(args, work, p, requests, warm=prefixes) for p in ("cache_aware", "kv_events")]


# -- (2) disaggregated vs colocated -------------------------------------------------------------


def mix_requests(args: argparse.Namespace, rng: np.random.Generator) -> list[SampleRequest]:
    out = []
    for i in range(args.mix_requests):
        if i % 4 == 0:  # a long document to read, a short answer
            out.append(SampleRequest(prompt=f"Report {i}. {random_words(rng, args.long_tokens)}\nSummary:",
                                     prompt_len=args.long_tokens, output_len=16))
        else:  # a chat turn streamed back
            out.append(SampleRequest(prompt=f"Chat {i}: {random_words(rng, 48)}?", prompt_len=56, output_len=64))
    return out


def run_layout(args: argparse.Namespace, work: Path, layout: str, rate: float,
               requests: list[SampleRequest]) -> dict:
    with ExitStack() as stack:
        if layout == "colocated":
            workers = start_workers(stack, work, f"colo-{rate}", 2, [])
            router = start_router(stack, work, f"colo-{rate}",
                                  ["--policy", "least_load", "--worker", workers[0], "--worker", workers[1]])
        else:
            producer, consumer = {"kv_role": "kv_producer", "kv_port": free_port()}, {"kv_role": "kv_consumer"}
            p, d = start_serves(stack, work, [(f"prefill-{rate}", ["--kv-transfer-config", json.dumps(producer)]),
                                              (f"decode-{rate}", ["--kv-transfer-config", json.dumps(consumer)])])
            router = start_router(stack, work, f"pd-{rate}", ["--prefill", p, "--decode", d])
        target = Target(base_url=router, model="SmolLM2-135M-Instruct", ignore_eos=True,
                        extra_body={"temperature": 0.0})
        run = asyncio.run(run_load(target, requests, LoadSpec(request_rate=rate, seed=1), desc=f"{layout} {rate}/s"))
        moved = scrape(d) if layout == "disaggregated" else {}
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    ok = [r for r in run.results if r.success]
    chats = [r for r in ok if r.output_tokens > 16]
    return {"layout": layout, "rate": rate, "ok": len(ok), "failed": len(run.results) - len(ok),
            "goodput_rps": sum(is_good(r, slo) for r in run.results) / run.duration,
            "good_fraction": sum(is_good(r, slo) for r in run.results) / len(run.results),
            "ttft_p90_s": float(np.percentile([r.ttft for r in ok], 90)) if ok else None,
            "chat_tpot_p90_ms": float(np.percentile([tpot(r) * 1000 for r in chats], 90)) if chats else None,
            "kv_received_mb": moved.get("ladle:kv_transfer_bytes_total", 0.0) / 1e6 if moved else None,
            "kv_receive_s": moved.get("ladle:kv_transfer_receive_seconds_total") if moved else None}


def disaggregation(args: argparse.Namespace, work: Path) -> list[dict]:
    requests = mix_requests(args, np.random.default_rng(1))
    print(f"\n(2) colocated (2 workers x 1 thread, least_load) vs disaggregated (1 prefill + 1 decode worker, "
          f"1 thread each): {args.mix_requests} requests per rate, 1 in 4 a {args.long_tokens}-token prompt, "
          f"SLO TTFT <= {args.slo_ttft_ms:.0f} ms and TPOT <= {args.slo_tpot_ms:.0f} ms", flush=True)
    return [run_layout(args, work, layout, rate, requests) for rate in args.rates
            for layout in ("colocated", "disaggregated")]


# -- report ----------------------------------------------------------------------------------


def print_prefix_table(rows: list[dict]) -> None:
    base = next((r for r in rows if r["policy"] == "round_robin"), rows[0])
    print(f"\n{'policy':<12} {'out tok/s':>9} {'vs ' + base['policy'][:2].upper():>6} {'TTFT p50':>9} {'TTFT p90':>9} {'hit rate':>8}  "
          "requests per worker")
    for r in rows:
        print(f"{r['policy']:<12} {r['output_tok_s']:>9.1f} {r['output_tok_s'] / base['output_tok_s']:>5.2f}x "
              f"{r['ttft_p50_s']:>8.2f}s {r['ttft_p90_s']:>8.2f}s {r['hit_rate']:>7.1%}  {r['requests_per_worker']}"
              + (f"  ({r['failed']} failed)" if r["failed"] else ""))


def print_disagg_table(rows: list[dict]) -> None:
    print(f"\n{'rate/s':>6} {'layout':<14} {'goodput/s':>9} {'in SLO':>7} {'TTFT p90':>9} {'chat TPOT p90':>13} "
          f"{'K/V moved':>10}")
    for r in rows:
        moved = f"{r['kv_received_mb']:.0f} MB" if r["kv_received_mb"] is not None else "-"
        tpot_p90 = f"{r['chat_tpot_p90_ms']:.0f} ms" if r["chat_tpot_p90_ms"] is not None else "-"
        print(f"{r['rate']:>6.2f} {r['layout']:<14} {r['goodput_rps']:>9.2f} {r['good_fraction']:>6.0%} "
              f"{r['ttft_p90_s']:>8.2f}s {tpot_p90:>13} {moved:>10}" + (f"  ({r['failed']} failed)" if r["failed"] else ""))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = [(r["policy"], r, "#4c72b0") for r in result.get("shared_prefix") or []]
    rows += [(f"{r['policy']}\n(warm, restarted)", r, "#55a868") for r in result.get("warm_restart") or []]
    if rows:
        ax = axes[0]
        ax.bar([label for label, _, _ in rows], [r["output_tok_s"] for _, r, _ in rows],
               color=[color for _, _, color in rows])
        for i, (_, r, _) in enumerate(rows):
            ax.text(i, r["output_tok_s"], f"p90 TTFT\n{r['ttft_p90_s']:.1f}s", ha="center", va="bottom", fontsize=7)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
        ax.set_ylabel("output tok/s")
        ax.set_title("shared prefixes, by routing policy")
    rows = result.get("disaggregation") or []
    if rows:
        ax = axes[1]
        for layout, color in (("colocated", "#4c72b0"), ("disaggregated", "#dd8452")):
            mine = [r for r in rows if r["layout"] == layout]
            ax.plot([r["rate"] for r in mine], [r["goodput_rps"] for r in mine], "o-", color=color, label=layout)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("goodput (req/s in SLO)")
        ax.set_title("long prompts + chats, same cores")
        ax.legend()
    fig.suptitle(result["machine"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    args = parse(argv)
    png = Path(args.png)
    out_json = Path(args.json) if args.json else png.with_suffix(".json")
    print(f"machine: {machine()}\nthe cores are split between worker processes, one thread each", flush=True)
    result: dict = json.loads(out_json.read_text()) if args.update and out_json.exists() else {}
    result["machine"] = machine()
    result.setdefault("runs", []).append(vars(args))  # the flags of each run that wrote into it
    with tempfile.TemporaryDirectory(prefix="ladle-fleet-") as tmp:
        if not args.skip_prefix:
            result["shared_prefix"] = shared_prefix(args, Path(tmp))
            print_prefix_table(result["shared_prefix"])
        if not args.skip_warm:
            result["warm_restart"] = warm_restart(args, Path(tmp))
            print_prefix_table(result["warm_restart"])
        if not args.skip_disagg:
            result["disaggregation"] = disaggregation(args, Path(tmp))
            print_disagg_table(result["disaggregation"])
    png.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1))
    plot(result, png)
    print(f"\nwrote {out_json} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
