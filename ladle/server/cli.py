"""`ladle serve [MODEL] [--host] [--port] [--api-key] [engine flags]`."""

from __future__ import annotations

import argparse
import os
import sys

from ladle.config import add_engine_arguments, engine_config_from_args
from ladle.tools.parsers import TOOL_CALL_PARSERS

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
    t = parser.add_argument_group("tool calling")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default when a request has tools): parse calls out of replies')
    t.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="hermes: <tool_call>{...}</tool_call> blocks (Hermes, Qwen2.5/3, and ladle's prompt for "
                        "templates without tools); llama3_json: a reply of JSON calls (Llama 3.1+)")
    d = parser.add_argument_group("decisions")
    d.add_argument("--decision-calibration", action="append", default=[], metavar="NAME=PATH",
                   help="a calibration from `ladle calibrate fit`, for questions naming it (repeatable)")
    d.add_argument("--decision-head", action="append", default=[], metavar="NAME=PATH",
                   help="a head from `ladle heads fit` (HEAD.safetensors beside HEAD.json), for questions "
                        "naming it (repeatable)")


def auto_tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser for tool_choice "auto", or None when the server does not serve "auto"."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ladle.decisions.extensions import Extensions
    from ladle.engine.async_engine import AsyncEngine
    from ladle.engine.engine import LLMEngine
    from ladle.server.app import DEFAULT_MAX_BODY_BYTES, create_app
    from ladle.server.context import served_model_name

    try:
        tool_call_parser = auto_tool_call_parser(args)
        config = engine_config_from_args(args)
        name = served_model_name(config)
        extensions = Extensions.load(name, args.decision_calibration, args.decision_head)
        engine = AsyncEngine(LLMEngine(config))
    except (FileNotFoundError, KeyError, ValueError) as e:  # a bad model path, flag or file: say so, no traceback
        print(f"ladle serve: {e}", file=sys.stderr)
        return 2
    app = create_app(engine, name, api_key=args.api_key, decision_extensions=extensions,
                     max_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES,
                     tool_call_parser=tool_call_parser)
    host = f"[{args.host}]" if ":" in args.host else args.host
    info, cache = engine.runtime_info, engine.cache_config_info
    print(f"ladle: serving {name} (max_model_len {engine.max_model_len}) at http://{host}:{args.port}/v1\n"
          f"ladle: dtype {info['dtype']} ({info['dtype_reason']}); weights {info['weights']}; "
          f"KV cache {info['kv_cache_dtype']} ({cache['num_gpu_blocks']} blocks of {cache['block_size']} tokens); "
          f"kernels {info['kernels']}; matmuls: {info['matmul']}",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_keep_alive=30)
    finally:
        engine.shutdown()
    return 0
