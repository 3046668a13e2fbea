"""`ladle serve [MODEL] [--host] [--port] [--api-key] [engine flags]`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ladle.config import EngineConfig, add_engine_arguments, engine_config_from_args
from ladle.tools.parsers import TOOL_CALL_PARSERS
from ladle.server.media import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_MAX_IMAGE_BYTES, MediaLimits

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=os.environ.get("LADLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $LADLE_API_KEY, else none)")
    g.add_argument("--max-request-body-bytes", type=int, default=None, help="larger bodies get 413 (default 16 MiB)")
    g.add_argument("--uvicorn-log-level", choices=LOG_LEVELS, default="info",
                   help="log level of uvicorn, the HTTP server; at info, debug and trace it also logs a line "
                        "per HTTP request (its access log)")
    g.add_argument("--root-path", default="", help="the path prefix a proxy serves ladle under (FastAPI root_path)")
    g.add_argument("--allowed-origins", type=json_list, default=None, metavar="JSON",
                   help='origins browsers may call from (CORS), e.g. \'["http://localhost:3000"]\' or \'["*"]\' '
                        "(default: none; vLLM's default is any)")
    g.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON",
                   help="methods cross-origin requests may use (default: any)")
    g.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON",
                   help="headers cross-origin requests may send (default: any)")
    g.add_argument("--allow-credentials", action="store_true", help="let cross-origin requests carry credentials")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per request: id, route, status, token counts, latency (never the content)")
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="do not log requests (the default; vLLM's older flag)")
    g.add_argument("--max-stored-responses", type=int, default=None,
                   help="/v1/responses kept for previous_response_id, least recently used dropped (default 1000)")
    g.add_argument("--no-webui", dest="webui", action="store_false",
                   help="do not serve the browser playground at /")
    f = parser.add_argument_group("replicas")
    f.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="run N engine processes (the cores shared out between them) behind `ladle router` on "
                        "this port (default 1: this process serves)")
    f.add_argument("--router-policy", default="cache_aware",
                   choices=("round_robin", "least_load", "cache_aware", "kv_events"),
                   help="how the router picks a replica for each request (with --data-parallel-size > 1)")
    c = parser.add_argument_group("chat and logprobs")
    c.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) replacing the model's")
    c.add_argument("--max-logprobs", type=int, default=None,
                   help="the most top logprobs a request may ask for (default and most: 20)")
    m = parser.add_argument_group("images")
    m.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let requests name images as file: URLs under DIR (vLLM's flag; default: no local files)")
    m.add_argument("--media-fetch-timeout", type=float, default=DEFAULT_FETCH_TIMEOUT_S, metavar="SECONDS",
                   help="how long fetching an image's http(s) URL may take before the request is a 400")
    m.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES, metavar="N",
                   help="the largest image file a request may send or name")
    t = parser.add_argument_group("tool calling")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default when a request has tools): parse calls out of replies')
    t.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="hermes: <tool_call>{...}</tool_call> blocks (Hermes, Qwen2.5/3, and ladle's prompt for "
                        "templates without tools); llama3_json: a reply of JSON calls (Llama 3.1+); openai (or "
                        "gpt_oss, harmony): gpt-oss's harmony messages to functions.NAME (with --reasoning-parser "
                        "gpt_oss)")
    d = parser.add_argument_group("decisions")
    d.add_argument("--decision-calibration", action="append", default=[], metavar="NAME=PATH",
                   help="a calibration from `ladle calibrate fit`, for questions naming it (repeatable)")
    d.add_argument("--decision-head", action="append", default=[], metavar="NAME=PATH",
                   help="a head from `ladle heads fit` (HEAD.safetensors beside HEAD.json), for questions "
                        "naming it (repeatable)")


def json_list(value: str) -> list[str]:
    """A flag holding a JSON list of strings, as vLLM's --allowed-origins takes it."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not (isinstance(parsed, list) and all(isinstance(x, str) for x in parsed)):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', not {value!r}")
    return parsed


def app_options(args: argparse.Namespace) -> dict:
    """create_app's keyword arguments for the server flags (reads --chat-template's file)."""
    from ladle.model.tokenizer import compile_chat_template
    from ladle.server.app import DEFAULT_MAX_BODY_BYTES
    from ladle.server.chat_prompt import load_chat_template
    from ladle.server.protocol import MAX_LOGPROBS
    from ladle.server.response_store import DEFAULT_MAX_STORED_RESPONSES

    template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    if template is not None:
        try:
            compile_chat_template(template)
        except Exception as e:  # jinja2's syntax errors: say so at start, not on the first request
            raise ValueError(f"--chat-template does not compile: {e}") from None
    max_logprobs = MAX_LOGPROBS if args.max_logprobs is None else args.max_logprobs
    if not 0 <= max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the engine returns at most {MAX_LOGPROBS})")
    return dict(api_key=args.api_key, max_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES,
                tool_call_parser=auto_tool_call_parser(args), chat_template=template, max_logprobs=max_logprobs,
                allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                root_path=args.root_path, log_requests=args.enable_log_requests, webui=args.webui,
                max_stored_responses=DEFAULT_MAX_STORED_RESPONSES if args.max_stored_responses is None
                else args.max_stored_responses,
                media=MediaLimits(max_bytes=args.max_image_bytes, fetch_timeout_s=args.media_fetch_timeout,
                                  allowed_local_media_path=args.allowed_local_media_path))


def serving_config(args: argparse.Namespace) -> tuple[EngineConfig, str, dict]:
    """The engine's config, the served model name and create_app's keyword arguments (the decision
    calibrations and heads included) for these flags."""
    from ladle.decisions.extensions import Extensions
    from ladle.server.context import served_model_name

    options = app_options(args)
    config = engine_config_from_args(args)
    name = served_model_name(config)
    options["decision_extensions"] = Extensions.load(name, args.decision_calibration, args.decision_head)
    return config, name, options


def auto_tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser for tool_choice "auto", or None when the server does not serve "auto"."""
    from ladle.server.harmony import check_parsers

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    check_parsers(args.reasoning_parser, args.tool_call_parser)
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def run(args: argparse.Namespace) -> int:
    if args.data_parallel_size != 1:
        from ladle.platform import cuda_probe
        from ladle.server.data_parallel import run_fleet

        if args.device != "cpu" and cuda_probe()[0]:
            print("ladle serve: --data-parallel-size above 1 shares out the CPU's cores between replicas; it does "
                  "not run on CUDA yet (pass --device cpu for replicas on the CPU)", file=sys.stderr)
            return 2

        return run_fleet(args, getattr(args, "argv", None) or sys.argv[2:])
    import uvicorn

    from ladle.engine.async_engine import AsyncEngine
    from ladle.engine.engine import LLMEngine
    from ladle.server.app import create_app

    try:
        config, name, options = serving_config(args)
        engine = AsyncEngine(LLMEngine(config))
    except (FileNotFoundError, KeyError, ValueError) as e:  # a bad model path, flag or file: say so, no traceback
        print(f"ladle serve: {e}", file=sys.stderr)
        return 2
    app = create_app(engine, name, **options)
    if args.enable_log_requests:
        _log_requests_to_stderr()
    host = f"[{args.host}]" if ":" in args.host else args.host
    info, cache = engine.runtime_info, engine.cache_config_info
    print(f"ladle: serving {name} (max_model_len {engine.max_model_len}) at http://{host}:{args.port}/v1\n"
          f"ladle: device {info['device']}; dtype {info['dtype']} ({info['dtype_reason']}); weights {info['weights']}; "
          f"KV cache {info['kv_cache_dtype']} ({cache['num_gpu_blocks']} blocks of {cache['block_size']} tokens); "
          f"kernels {info['kernels']}; matmuls: {info['matmul']}",
          file=sys.stderr, flush=True)
    if args.webui:
        print(f"ladle: playground at http://{host}:{args.port}{args.root_path.rstrip('/')}/", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_keep_alive=30)
    finally:
        engine.shutdown()
    return 0


def _log_requests_to_stderr() -> None:
    log = logging.getLogger("ladle.requests")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s ladle: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
