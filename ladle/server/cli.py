"""`ladle serve [MODEL] [--host] [--port] [--api-key] [engine flags]`."""

from __future__ import annotations

import argparse
import os
import sys

from ladle.config import add_engine_arguments, engine_config_from_args

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("LADLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $LADLE_API_KEY, else none)")
    g.add_argument("--max-request-body-bytes", type=int, default=None, help="larger bodies get 413 (default 16 MiB)")
    g.add_argument("--uvicorn-log-level", choices=LOG_LEVELS, default="info")
    d = parser.add_argument_group("decisions")
    d.add_argument("--decision-calibration", action="append", default=[], metavar="NAME=PATH",
                   help="a calibration from `ladle calibrate fit`, for questions naming it (repeatable)")
    d.add_argument("--decision-head", action="append", default=[], metavar="NAME=PATH",
                   help="a head from `ladle heads fit` (HEAD.safetensors beside HEAD.json), for questions "
                        "naming it (repeatable)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ladle.decisions.extensions import Extensions
    from ladle.engine.async_engine import AsyncEngine
    from ladle.engine.engine import LLMEngine
    from ladle.server.app import DEFAULT_MAX_BODY_BYTES, create_app
    from ladle.server.context import served_model_name

    try:
        config = engine_config_from_args(args)
        name = served_model_name(config)
        extensions = Extensions.load(name, args.decision_calibration, args.decision_head)
        engine = AsyncEngine(LLMEngine(config))
    except (FileNotFoundError, KeyError, ValueError) as e:  # a bad model path, flag or file: say so, no traceback
        print(f"ladle serve: {e}", file=sys.stderr)
        return 2
    app = create_app(engine, name, api_key=args.api_key, decision_extensions=extensions,
                     max_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES)
    host = f"[{args.host}]" if ":" in args.host else args.host
    info = engine.runtime_info
    print(f"ladle: serving {name} (max_model_len {engine.max_model_len}) at http://{host}:{args.port}/v1\n"
          f"ladle: dtype {info['dtype']} ({info['dtype_reason']}); KV cache {info['kv_cache_dtype']}; "
          f"kernels {info['kernels']}; matmuls: {info['matmul']}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_keep_alive=30)
    finally:
        engine.shutdown()
    return 0
