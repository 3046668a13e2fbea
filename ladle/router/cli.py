"""`ladle router --worker URL ... [--policy P] [--host] [--port]`: one OpenAI-compatible front over
several workers (or, with --prefill and --decode, over disaggregated prefill and decode workers)."""

from __future__ import annotations

import argparse
import sys

from ladle.router.config import POLICIES, RouterConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workers")
    w.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="an OpenAI-compatible server to route to, e.g. http://127.0.0.1:8001 (repeatable)")
    w.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="disaggregated mode: a prefill worker (repeatable; needs --decode)")
    w.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="disaggregated mode: a decode worker (repeatable; needs --prefill)")
    w.add_argument("--health-check-interval", type=float, default=2.0, metavar="SECONDS",
                   help="GET /health on every worker this often (default 2.0)")
    w.add_argument("--max-retries", type=int, default=2,
                   help="send a request that failed before its first byte to this many other workers (default 2)")
    p = parser.add_argument_group("routing")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware",
                   help="round_robin; least_load (fewest requests in flight); cache_aware (where the longest "
                        "prefix of the text went, SGLang's design; the default); kv_events (where the workers' "
                        "KV events say the prompt's blocks are cached)")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="cache_aware: the matched fraction above which a request follows its prefix (default 0.5)")
    p.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="load imbalance: most - fewest in flight above this ... (default 32)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and most above fewest times this: route by load alone (default 1.5)")
    p.add_argument("--max-tree-size", type=int, default=2**22,
                   help="cache_aware: characters of text remembered per worker (default 2**22)")
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--uvicorn-log-level", choices=LOG_LEVELS, default="warning",
                   help="log level of uvicorn, the HTTP server (default warning); info, debug and trace also "
                        "log a line per HTTP request (its access log)")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(workers=args.worker, policy=args.policy, prefill=args.prefill, decode=args.decode,
                        health_check_interval=args.health_check_interval, max_retries=args.max_retries,
                        cache_threshold=args.cache_threshold, balance_abs_threshold=args.balance_abs_threshold,
                        balance_rel_threshold=args.balance_rel_threshold, max_tree_size=args.max_tree_size)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"ladle router: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from ladle.router.app import build_app

    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"ladle router: {config.policy} over {_describe(config)} at http://{host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    uvicorn.run(build_app(config), host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_keep_alive=30)
    return 0


def _describe(config: RouterConfig) -> str:
    if config.disaggregated:
        return f"prefill {', '.join(config.prefill)}; decode {', '.join(config.decode)}"
    return ", ".join(config.workers)
