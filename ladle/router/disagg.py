"""Disaggregated prefill/decode: a chat or completion request makes two hops, as vLLM's proxy does.

1. A prefill worker computes the prompt (max_tokens 1, not streamed) with
   kv_transfer_params {"do_remote_decode": true}, and answers with the params naming its export.
2. A decode worker gets the original request plus those params, pulls the K/V instead of
   recomputing, and its reply (or stream) is the client's.
If the prefill hop fails, or the prefill worker exported nothing (params null), the decode
worker gets the request as sent and computes the prompt itself (ladle_router_pd_fallbacks_total).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import httpx
from starlette.responses import Response

from ladle.router.policies import RequestInfo
from ladle.router.proxy import Outgoing
from ladle.router.state import RouterState

PD_ROUTES = ("/v1/chat/completions", "/v1/completions")


def needs_prefill_hop(body: Any) -> bool:
    """n > 1 and requests carrying their own params go straight to a decode worker."""
    if not isinstance(body, dict) or "kv_transfer_params" in body:
        return False
    n = body.get("n")
    return n is None or n == 1


def prefill_body(body: dict, path: str) -> dict:
    out = {k: v for k, v in body.items() if k not in ("stream_options", "n")}
    out |= {"stream": False, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    if path == "/v1/chat/completions":
        out["max_completion_tokens"] = 1
    return out


async def prefill_then_decode(state: RouterState, out: Outgoing, info: RequestInfo) -> Response:
    await state.prepare("decode", info)
    if needs_prefill_hop(info.body):
        started = time.monotonic()
        params = await _prefill(state, out, info)
        state.metrics.pd_prefill_seconds.observe(time.monotonic() - started)
        if params is None:
            state.metrics.pd_fallbacks.inc()
        else:
            out = replace(out, content=json.dumps(info.body | {"kv_transfer_params": params}).encode())
    return await state.forwarder.forward(out, "decode", state.policy_picker("decode", info))


async def _prefill(state: RouterState, out: Outgoing, info: RequestInfo) -> dict | None:
    """The prefill worker's kv_transfer_params; None when there are none to pass on."""
    candidates = state.pool.available("prefill")
    if not candidates:
        return None
    prefill_info = replace(info, body=None)  # its request_id belongs to the decode hop
    worker = state.policy_picker("prefill", prefill_info)(candidates, False)
    headers = {k: v for k, v in out.headers.items() if k.lower() != "content-type"}
    state.pool.started(worker, out.route)
    try:
        reply = await state.client.post(worker.url + out.path, json=prefill_body(info.body, info.path),
                                        headers=headers, timeout=state.config.prefill_timeout)
    except httpx.HTTPError:
        state.pool.mark_failed(worker)
        return None
    finally:
        state.pool.finished(worker)
    if reply.status_code >= 500:
        state.pool.mark_failed(worker)
    if reply.status_code != 200:
        return None
    try:
        params = reply.json().get("kv_transfer_params")
    except ValueError:
        return None
    return params if isinstance(params, dict) else None
