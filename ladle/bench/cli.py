"""`ladle bench serve | sweep | voice`: load-test any OpenAI-compatible server (ladle, vLLM, SGLang, llama.cpp).

Flags follow `vllm bench serve` where it has them, so the numbers compare. `voice` replays voice-agent
turn scripts in real time, answering at the end of turn or drafting eagerly (ladle.bench.voice).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ladle.bench.client import Target, is_chat
from ladle.bench.datasets import DATASETS, DatasetSpec, SampleRequest, sample_requests
from ladle.bench.discover import TargetInfo, check_request, discover, reset_prefix_cache
from ladle.bench.metrics import (
    LATENCY_METRICS, agent_turn_metrics, compute_metrics, parse_goodput, parse_percentiles, per_request_fields,
)
from ladle.bench.report import format_table, format_turn_table, provenance, result_path, timestamp, write_json
from ladle.bench.runner import LoadSpec, run_load
from ladle.bench.sweep import BY, SweepSpec, run_sweep
from ladle.bench.voice import CANCEL_MODES, CHAT, MODES, VoiceSpec, run_voice, summarize
from ladle.bench.voice_report import format_voice_table
from ladle.bench.voice_script import load_scripts, replicate

PROBE_SEED_OFFSET = 999_983  # the initial test request comes from its own draw, not the benchmark's prompts
WARMUP_SEED_OFFSET = 499_979  # so do the warm-up requests


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="{serve,sweep,voice}")
    serve = sub.add_parser("serve", help="one benchmark run: throughput, goodput and latency percentiles")
    _add_common(serve, num_prompts=1000)
    serve.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second (default inf: all at once)")
    serve.add_argument("--save-result", action="store_true", help="write the result JSON")
    serve.add_argument("--save-detailed", action="store_true", help="also write per-request arrays")
    serve.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="extra fields for the result JSON")

    sweep = sub.add_parser("sweep", help="step the load up until goodput falls below half its peak; find the knee")
    _add_common(sweep, num_prompts=200)
    sweep.add_argument("--by", choices=BY, default="rate", help="load axis: request rate or max concurrency")
    sweep.add_argument("--loads", type=str, default=None, help="explicit loads, e.g. 1,2,4,8")
    sweep.add_argument("--start", type=float, default=1.0, help="first load (without --loads)")
    sweep.add_argument("--factor", type=float, default=2.0, help="load multiplier per step (without --loads)")
    sweep.add_argument("--max-steps", type=int, default=10,
                       help="loads to step through without --loads: --start times --factor to the power 0, 1, "
                            "... (the sweep may stop sooner)")
    sweep.add_argument("--knee-fraction", type=float, default=0.9,
                       help="goodput must stay within this fraction of the offered load for the knee")
    sweep.add_argument("--stop-fraction", type=float, default=0.5, help="stop once goodput < this x its peak")
    sweep.add_argument("--no-plot", action="store_true", help="skip the PNG")
    sweep.add_argument("--search", choices=("knee", "goodput"), default="knee",
                       help="knee: step the loads up and mark the knee; goodput: double the load from --start "
                            "until SLO attainment misses --attainment, then bisect to within 10%% (a concurrency: "
                            "to adjacent ones) and report the highest load that meets it (GuideLLM's profile)")
    sweep.add_argument("--attainment", type=float, default=0.95,
                       help="--search goodput: the share of requests that must meet every SLO (its doublings "
                            "stop at --start x 2^(--max-steps - 1))")

    voice = sub.add_parser("voice", help="replay voice-agent turn scripts in real time: wait for the end of "
                                         "turn vs eager drafts")
    _add_voice(voice)


def _add_common(p: argparse.ArgumentParser, num_prompts: int) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    t.add_argument("--host", default="127.0.0.1", help="server host, used without --base-url")
    t.add_argument("--port", type=int, default=8000, help="server port, used without --base-url")
    t.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    t.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    t.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    t.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra HTTP headers")
    t.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random",
                   help="the workload: random (random-word prompts of set lengths), sharegpt (the conversations "
                        "of --dataset-path), prefix (a few shared system prompts, each request with its own "
                        "tail), agent (multi-turn tool-calling sessions), decisions (POST /v1/decisions requests), "
                        "trace (a recorded trace replayed on its own clock, --dataset-path)")
    d.add_argument("--dataset-path", default=None,
                   help="ShareGPT JSON file (--dataset sharegpt), or a JSONL trace (--dataset trace)")
    d.add_argument("--trace-speedup", type=float, default=1.0,
                   help="trace: replay this many times faster than recorded (the arrival gaps divided by it)")
    d.add_argument("--trace-block-len", type=int, default=512,
                   help="trace: tokens each of a line's hash_ids stands for (Mooncake's blocks are 512)")
    d.add_argument("--num-prompts", type=int, default=num_prompts, help="requests per run (per step in a sweep)")
    d.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    d.add_argument("--output-len", type=int, default=None, help="sets every dataset's output length")
    d.add_argument("--random-input-len", type=int, default=1024,
                   help="random: prompt tokens per request after the shared prefix (the mean, with "
                        "--random-range-ratio)")
    d.add_argument("--random-output-len", type=int, default=128,
                   help="random: output tokens per request, sent as max_tokens with ignore_eos (the mean, with "
                        "--random-range-ratio)")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: input and output lengths drawn uniformly from [len x (1 - r), len x (1 + r)], "
                        "r in [0, 1)")
    d.add_argument("--random-prefix-len", type=int, default=0,
                   help="random: tokens of one random prefix shared by every prompt")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: output tokens (max_tokens) of every request (default: the length of the "
                        "conversation's reply)")
    d.add_argument("--prefix-len", "--prefix-repetition-prefix-len", dest="prefix_len", type=int, default=512,
                   help="prefix: tokens of each shared system prompt")
    d.add_argument("--prefix-suffix-len", "--prefix-repetition-suffix-len", dest="prefix_suffix_len", type=int,
                   default=128, help="prefix: tokens of each request's own tail after its shared prompt")
    d.add_argument("--prefix-num-prefixes", "--prefix-repetition-num-prefixes", dest="prefix_num_prefixes",
                   type=int, default=1, help="prefix: distinct shared prompts, the requests spread evenly over them")
    d.add_argument("--prefix-output-len", "--prefix-repetition-output-len", dest="prefix_output_len", type=int,
                   default=128, help="prefix: output tokens (max_tokens) per request")
    d.add_argument("--agent-turns", type=int, default=6,
                   help="agent: turns per session, each prompt extending the previous turn's (--num-prompts "
                        "counts turns)")
    d.add_argument("--agent-system-len", type=int, default=1024,
                   help="agent: tokens of the system prompt every session shares")
    d.add_argument("--agent-burst-len", type=int, default=256, help="typical tokens of one tool result")
    d.add_argument("--agent-output-len", type=int, default=64, help="agent: output tokens (max_tokens) per turn")
    d.add_argument("--agent-think-time", type=float, default=0.0, metavar="SECONDS",
                   help="mean time a tool call runs before the session's next turn (seeded, exponential; "
                        "not counted in TTFT or queue time)")
    d.add_argument("--decisions-input-len", type=int, default=256,
                   help="decisions: tokens of each request's input text")
    d.add_argument("--decisions-questions", type=int, default=3,
                   help="decisions: questions per request (choice, yes/no and score in turn)")
    d.add_argument("--decisions-options", type=int, default=4,
                   help="decisions: options of each choice question (held to 2..26)")
    d.add_argument("--tokens-per-word", type=float, default=None,
                   help="prompt tokens per generated word (default: measured via /tokenize, else 1.0)")
    d.add_argument("--no-tokenize", action="store_true", help="do not calibrate prompt lengths via /tokenize")

    r = p.add_argument_group("load and measurement")
    r.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1 = Poisson)")
    r.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once, the rest waiting their turn (default: no limit; "
                        "a sweep --by concurrency sets it per step)")
    r.add_argument("--seed", type=int, default=0,
                   help="seeds the sampled prompts and the arrival times, so a run repeats (a sweep's step i "
                        "samples its prompts with seed + i)")
    r.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 itl:200 e2el:10000 (itl: the p99 of each request's "
                        "inter-token gaps)")
    r.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", default="99",
                   help="comma-separated percentiles, e.g. 50,90,99,99.9")
    r.add_argument("--percentile-metrics", default=",".join(LATENCY_METRICS), help="metrics shown in the table")
    r.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (always on for --dataset random)")
    r.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature sent in every request (default: none sent, the server's own)")
    r.add_argument("--top-p", type=float, default=None,
                   help="top_p sent in every request (default: none sent, the server's own)")
    r.add_argument("--top-k", type=int, default=None,
                   help="top_k sent in every request (default: none sent, the server's own)")
    r.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    r.add_argument("--skip-initial-test", action="store_true", help="do not send one test request first")
    r.add_argument("--num-warmups", type=int, default=0, metavar="N",
                   help="requests sent first, at the run's concurrency, and left out of every figure (a sweep "
                        "sends them once, before its first step)")
    r.add_argument("--reset-cache", action="store_true",
                   help="POST /reset_prefix_cache after the warm-ups (ladle, vLLM), so the run (each step of a "
                        "sweep) starts on a cold prefix cache; the result says cold or warm")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    o = p.add_argument_group("output")
    o.add_argument("--label", default=None, help="result file prefix (default: openai or openai-chat)")
    o.add_argument("--result-dir", default=None,
                   help="folder for the result JSON, and a sweep's PNG (default: the current one)")
    o.add_argument("--result-filename", default=None,
                   help="file name of the result JSON (default: made of the label or sweep axis, the load, the "
                        "model and the date)")


def _add_voice(p: argparse.ArgumentParser) -> None:
    p.set_defaults(endpoint=CHAT)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    t.add_argument("--host", default="127.0.0.1", help="server host, used without --base-url")
    t.add_argument("--port", type=int, default=8000, help="server port, used without --base-url")
    t.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    t.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    t.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra HTTP headers")
    t.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    s = p.add_argument_group("scripts and modes")
    s.add_argument("--script", nargs="+", default=None, metavar="PATH",
                   help="turn-script JSONL files, folders of them, or shipped script names (default: all shipped)")
    s.add_argument("--modes", default=",".join(MODES), help="comma-separated, of wait and eager")
    s.add_argument("--cancel", choices=CANCEL_MODES, default="disconnect",
                   help="how drafts are cancelled: close the stream, or POST /v1/requests/{id}/cancel (ladle)")
    s.add_argument("--repeat", type=int, default=1, help="replays of the scripts per mode")
    s.add_argument("--max-concurrency", type=int, default=4, help="conversations at once")
    s.add_argument("--copies", type=int, default=1,
                   help="callers per conversation in each pass (each its own call), to load the server as more "
                        "simultaneous calls would; raise --max-concurrency with it")
    s.add_argument("--turn-gap", type=float, default=0.3, metavar="SECONDS",
                   help="from a reply's end to the caller's next turn (without a barge-in)")
    s.add_argument("--server-timings", action="store_true",
                   help='ask for the server\'s "timings" (ladle: include_timings) and record them')
    s.add_argument("--skip-warmup", action="store_true", help="do not warm the system prompts first")

    r = p.add_argument_group("requests")
    r.add_argument("--max-tokens", type=int, default=64, help="longest reply in tokens (max_tokens of each request)")
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent in every request")
    r.add_argument("--seed", type=int, default=0, help="sent as the requests' seed")
    r.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    o = p.add_argument_group("output")
    o.add_argument("--result-dir", default=None, help="folder for the result JSON (default: the current one)")
    o.add_argument("--result-filename", default=None,
                   help="file name of the result JSON (default: voice-concurrencyN-MODEL-DATE.json)")
    o.add_argument("--plot", default=None, metavar="PATH", help="write the latency distributions as a PNG")


def run(args: argparse.Namespace) -> int:
    if args.bench_command is None:
        print("usage: ladle bench {serve,sweep,voice} ... (ladle bench serve --help)", file=sys.stderr)
        return 2
    main = {"serve": _serve, "sweep": _sweep, "voice": _voice}[args.bench_command]
    try:
        return asyncio.run(main(args))
    except (RuntimeError, ValueError, OSError) as e:
        print(f"ladle bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _base_url(args: argparse.Namespace) -> str:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if base.endswith("/v1") and args.endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]  # OpenAI clients' base URLs end in /v1; our endpoints carry it
    return base


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bad {what} {item!r}: use KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    spec = DatasetSpec(**{k: getattr(args, k) for k in DatasetSpec.__dataclass_fields__ if k not in ("name", "path")},
                       name=args.dataset, path=args.dataset_path)
    if args.input_len is not None:
        spec.random_input_len = args.input_len
    if args.output_len is not None:
        for key in ("random_output_len", "sharegpt_output_len", "prefix_output_len", "agent_output_len"):
            setattr(spec, key, args.output_len)
    return spec


async def _prepare(args: argparse.Namespace) -> tuple[TargetInfo, DatasetSpec, dict[str, float], list[float]]:
    slo = parse_goodput(args.goodput)
    percentiles = parse_percentiles(args.percentiles)
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.num_warmups < 0:
        raise ValueError("--num-warmups must be 0 or more")
    if args.dataset == "trace" and not math.isinf(getattr(args, "request_rate", math.inf)):
        raise ValueError("--request-rate: a trace arrives on its own clock (scale it with --trace-speedup)")
    if args.dataset == "trace" and getattr(args, "by", None) == "rate":
        raise ValueError("--by rate: a trace arrives on its own clock; sweep it --by concurrency")
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    target = Target(
        base_url=_base_url(args), model=args.model or "", endpoint=args.endpoint, api_key=args.api_key,
        ignore_eos=args.ignore_eos or args.dataset == "random",  # as vLLM: random runs to its output length
        extra_body={**{k: v for k, v in sampling.items() if v is not None}, **(args.extra_body or {})},
        headers=_pairs(args.header, "--header"), timeout_s=args.request_timeout,
    )
    spec = _dataset_spec(args)
    calibrate = not args.no_tokenize and args.dataset != "sharegpt"
    info = await discover(target, args.tokens_per_word, calibrate=calibrate)
    if not args.skip_initial_test:
        await check_request(info.target, _requests(spec, info, 1, args.seed + PROBE_SEED_OFFSET)[0])
    if args.num_warmups:
        print(f"Warming up with {args.num_warmups} requests (not counted) ...", flush=True)
        warmups = _requests(spec, info, args.num_warmups, args.seed + WARMUP_SEED_OFFSET)
        await run_load(info.target, warmups, LoadSpec(max_concurrency=args.max_concurrency), progress=False)
    return info, spec, slo, percentiles


async def _cache_state(args: argparse.Namespace, target: Target) -> str:
    """Reset the server's prefix cache where asked: the run is then "cold", else "warm"."""
    if not args.reset_cache:
        return "warm"
    await reset_prefix_cache(target)
    return "cold"


def _requests(spec: DatasetSpec, info: TargetInfo, n: int, seed: int) -> list[SampleRequest]:
    return sample_requests(spec, n, seed, info.tokens_per_word)


def _header(args: argparse.Namespace, info: TargetInfo, extra: dict[str, Any]) -> dict[str, Any]:
    backend = "openai-chat" if is_chat(args.endpoint) else "openai"
    flags = {k: v for k, v in vars(args).items() if k != "bench_command"}
    return {
        "date": timestamp(),
        "backend": backend,
        "label": args.label or backend,
        "model_id": info.target.model,
        "base_url": info.target.base_url,
        "endpoint": args.endpoint,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "ignore_eos": info.target.ignore_eos,
        **extra,
        "tokens_per_word": info.tokens_per_word,
        "tokens_per_word_source": info.tokens_per_word_source,
        "provenance": provenance(flags, info.target.model, info.version, subcommand=args.bench_command),
    }


def _model_stem(model: str) -> str:
    return model.rstrip("/").split("/")[-1] or "model"


async def _serve(args: argparse.Namespace) -> int:
    info, spec, slo, percentiles = await _prepare(args)
    requests = _requests(spec, info, args.num_prompts, args.seed)
    load = LoadSpec(request_rate=args.request_rate, burstiness=args.burstiness,
                    max_concurrency=args.max_concurrency, seed=args.seed)
    rate_text = "inf" if math.isinf(load.request_rate) else f"{load.request_rate:g}"
    print(f"Traffic request rate: {rate_text}\nBurstiness factor: {load.burstiness:g} "
          f"({'Poisson process' if load.burstiness == 1 else 'Gamma distribution'})\n"
          f"Maximum request concurrency: {load.max_concurrency}", flush=True)
    cache = await _cache_state(args, info.target)
    run = await run_load(info.target, requests, load, progress=not args.disable_tqdm)
    metrics = compute_metrics(run.results, run.duration, percentiles, slo or None)
    metrics.update(agent_turn_metrics(run.results) or {})
    traffic = {"request_rate": "inf" if math.isinf(load.request_rate) else load.request_rate,
               "burstiness": load.burstiness, "max_concurrency": load.max_concurrency,
               "goodput_slo_ms": slo or None, "num_warmups": args.num_warmups, "cache": cache}
    result = {**_header(args, info, traffic), **_pairs(args.metadata, "--metadata"), **metrics}
    shown = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip() in LATENCY_METRICS)
    print(format_table(result, percentiles, shown))
    if "per_turn" in result:
        print(format_turn_table(result["per_turn"], result["agent"]))
    errors = [r.error for r in run.results if not r.success]
    for i, err in enumerate(errors[:5]):
        print(f"error {i}: {err}", file=sys.stderr)
    if args.save_result or args.save_detailed:
        if args.save_detailed:
            result.update(per_request_fields(run.results))
        concurrency = f"-concurrency{load.max_concurrency}" if load.max_concurrency else ""
        name = f"{result['label']}-{rate_text}qps{concurrency}-{_model_stem(info.target.model)}-{result['date']}.json"
        path = result_path(args.result_dir, args.result_filename, name)
        write_json(path, result)
        print(f"result written to {path}")
    return 0 if metrics["completed"] else 1


async def _sweep(args: argparse.Namespace) -> int:
    loads = [float(x) for x in args.loads.split(",") if x.strip()] if args.loads else None
    sweep_spec = SweepSpec(by=args.by, loads=loads, start=args.start, factor=args.factor, max_steps=args.max_steps,
                           knee_fraction=args.knee_fraction, stop_fraction=args.stop_fraction)
    sweep_spec.schedule()  # validate before touching the target
    if args.search == "goodput" and args.loads:
        raise ValueError("--loads: a goodput search chooses its loads (from --start, doubling, then bisecting)")
    if not args.goodput:
        raise ValueError("a sweep needs --goodput, e.g. --goodput ttft:500 tpot:50")
    info, spec, slo, percentiles = await _prepare(args)
    base = LoadSpec(burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed)

    def make_requests(step: int) -> list[SampleRequest]:
        return _requests(spec, info, args.num_prompts, args.seed + step)

    reset = (lambda: reset_prefix_cache(info.target)) if args.reset_cache else None
    if args.search == "goodput":
        return await _goodput_search(args, info, make_requests, base, percentiles, slo, reset)
    sweep = await run_sweep(info.target, make_requests, sweep_spec, base, percentiles, slo,
                            progress=not args.disable_tqdm, log=lambda line: print(line, flush=True),
                            before_step=reset)
    _write_sweep(args, info, sweep, "sweep", marked="knee")
    knee = sweep["knee"]
    if knee is None:
        print(f"knee: none (even the lowest load's goodput fell short); stopped: {sweep['stop_reason']}")
    else:
        print(f"knee: {args.by} {knee['load']:g} (goodput {knee['request_goodput']:.2f} req/s, "
              f"p99 TTFT {knee['p99_ttft_ms']:.1f} ms, p99 TPOT {knee['p99_tpot_ms']:.1f} ms); "
              f"stopped: {sweep['stop_reason']}")
    return 0


def _write_sweep(args: argparse.Namespace, info: TargetInfo, found: dict[str, Any], kind: str, marked: str) -> None:
    """A sweep's (or a goodput search's) result JSON, and its PNG unless --no-plot, marking its `marked` step."""
    extra = {"burstiness": args.burstiness, "num_warmups": args.num_warmups,
             "cache": "cold" if args.reset_cache else "warm"}
    result = {**_header(args, info, extra), "model": info.target.model, **found}
    name = f"{kind}-{args.by}-{_model_stem(info.target.model)}-{result['date']}.json"
    path = result_path(args.result_dir, args.result_filename, name)
    write_json(path, result)
    print(f"{'sweep' if kind == 'sweep' else 'search'} written to {path}")
    if not args.no_plot:
        from ladle.bench.plot import plot_sweep

        png = Path(path).with_suffix(".png")
        plot_sweep(result, png, marked=marked)
        print(f"plot written to {png}")


async def _goodput_search(args: argparse.Namespace, info: TargetInfo, make_requests, base: LoadSpec,
                          percentiles: list[float], slo: dict[str, float], reset) -> int:
    from ladle.bench.goodput_search import GoodputSearch, search_goodput

    spec = GoodputSearch(by=args.by, start=args.start, attainment=args.attainment,
                         max_load=args.start * 2 ** (args.max_steps - 1))
    found = await search_goodput(info.target, make_requests, spec, base, percentiles, slo,
                                 progress=not args.disable_tqdm, log=lambda line: print(line, flush=True),
                                 before_step=reset)
    _write_sweep(args, info, found, "goodput", marked="best")
    best = found["best"]
    if best is None:
        print(f"highest {args.by} meeting {args.attainment:.0%} attainment: none (even {args.start:g} misses)")
        return 1
    print(f"highest {args.by} meeting {args.attainment:.0%} attainment: {best['load']:g} "
          f"(attainment {best['attainment']:.1%}, goodput {best['request_goodput']:.2f} req/s, "
          f"{best['goodput_tok_s']:.1f} tok/s); first miss: "
          f"{'none up to the largest load' if found['first_miss'] is None else format(found['first_miss'], 'g')}")
    return 0


async def _voice(args: argparse.Namespace) -> int:
    spec = VoiceSpec(modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), cancel=args.cancel,
                     repeat=args.repeat, max_concurrency=args.max_concurrency, max_tokens=args.max_tokens,
                     temperature=args.temperature, seed=args.seed, turn_gap=args.turn_gap,
                     server_timings=args.server_timings, warmup=not args.skip_warmup)
    spec.validate()
    if args.copies < 1:
        raise ValueError("--copies must be at least 1")
    conversations = replicate(load_scripts(args.script), args.copies)
    target = Target(base_url=_base_url(args), model=args.model or "", endpoint=CHAT, api_key=args.api_key,
                    extra_body=args.extra_body or {}, headers=_pairs(args.header, "--header"),
                    timeout_s=args.request_timeout)
    info = await discover(target, calibrate=False)
    turns = sum(len(c.turns) for c in conversations)
    print(f"Voice scripts: {len(conversations)} conversations, {turns} turns; modes {', '.join(spec.modes)} "
          f"in interleaved passes, {spec.repeat} per mode", flush=True)
    run = await run_voice(info.target, conversations, spec, progress=not args.disable_tqdm)
    flags = {k: v for k, v in vars(args).items() if k != "bench_command"}
    result = {
        "date": timestamp(), "backend": "openai-chat", "label": "voice", "model_id": info.target.model,
        "base_url": info.target.base_url, "endpoint": CHAT, "conversation_names": [c.name for c in conversations],
        "conversations": len(conversations), "turns_per_pass": turns, "modes": list(spec.modes),
        "order": "interleaved", "passes": run.passes, "repeat": spec.repeat, "max_concurrency": spec.max_concurrency,
        "copies": args.copies, "cancel": spec.cancel, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
        "turn_gap": spec.turn_gap, "server_timings": spec.server_timings, "duration": run.duration,
        "failed_requests": run.failed_requests, **summarize(run, spec.modes),
        "turns": [asdict(r) for r in run.turns], "errors": run.errors,
        "provenance": provenance(flags, info.target.model, info.version, subcommand="voice"),
    }
    print(format_voice_table(result))
    for i, err in enumerate(run.errors[:5]):
        print(f"error {i}: {err}", file=sys.stderr)
    name = f"voice-concurrency{spec.max_concurrency}-{_model_stem(info.target.model)}-{result['date']}.json"
    path = result_path(args.result_dir, args.result_filename, name)
    write_json(path, result)
    print(f"result written to {path}")
    if args.plot:
        from ladle.bench.voice_report import plot_voice

        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_voice(result, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if run.failed_requests == 0 else 1
