"""Disaggregated prefill/decode on the server side: `kv_transfer_params` in and out.

A prefill worker (--kv-transfer-config kv_producer) gets a one-token request with
{"do_remote_decode": true}: the engine keeps the prompt's K/V, and the reply's
`kv_transfer_params` says where a decode worker fetches it. A decode worker (kv_consumer)
gets the original request with those params: it fetches the K/V over TCP
(ladle.distributed.kv_transfer) and the engine continues from it. A fetch that fails, or K/V
that does not fit, costs a recompute of the prompt, never the request.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from ladle.distributed.kv_transfer import timed_fetch
from ladle.engine.sampling_params import SamplingParams
from ladle.server.context import ServerContext
from ladle.server.errors import APIError
from ladle.server.protocol import KVTransferParams

FETCH_TIMEOUT_SECONDS = 30.0


async def with_kv_transfer(ctx: ServerContext, kv: KVTransferParams | None, params: SamplingParams,
                           stream: bool, num_prompts: int = 1) -> SamplingParams:
    """params for a request carrying kv_transfer_params (as is without them); 400s name the field."""
    if kv is None or not (kv.do_remote_decode or kv.do_remote_prefill):
        return params
    config = ctx.engine.engine.config.kv_transfer_config
    if kv.do_remote_decode and kv.do_remote_prefill:
        raise _refuse("do_remote_decode and do_remote_prefill cannot both be set")
    if params.n != 1 or num_prompts != 1:
        raise _refuse("hands over one sequence: it needs n = 1 and a single prompt")
    if kv.do_remote_decode:
        if config is None or not config.produces:
            raise _refuse("do_remote_decode needs a prefill worker (--kv-transfer-config with kv_role kv_producer "
                          "or kv_both)")
        if stream:
            raise _refuse("a prefill worker's request (do_remote_decode) is not streamed")
        return replace(params, export_kv=True)
    if config is None or not config.consumes:
        raise _refuse("do_remote_prefill needs a decode worker (--kv-transfer-config with kv_role kv_consumer "
                      "or kv_both)")
    if kv.remote_host is None or kv.remote_port is None or kv.transfer_id is None:
        raise _refuse("do_remote_prefill needs remote_host, remote_port and transfer_id (a prefill worker's reply)")
    handoff = await asyncio.to_thread(timed_fetch, kv.remote_host, kv.remote_port, kv.transfer_id,
                                      ctx.transfer_stats, FETCH_TIMEOUT_SECONDS)
    return params if handoff is None else replace(params, kv_handoff=handoff)


def reply_params(ctx: ServerContext, kv: KVTransferParams | None, request_id: str) -> KVTransferParams | None:
    """What a prefill worker's reply tells the decode worker (None when nothing was kept)."""
    exports = ctx.engine.engine.kv_exports
    server = ctx.kv_transfer_server
    if kv is None or not kv.do_remote_decode or exports is None or server is None or request_id not in exports:
        return None
    return KVTransferParams(do_remote_prefill=True, remote_host=server.host, remote_port=server.port,
                            transfer_id=request_id)


def _refuse(why: str) -> APIError:
    return APIError(400, f"kv_transfer_params: {why}", param="kv_transfer_params")
