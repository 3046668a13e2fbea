"""POST /v1/chat/completions and POST /v1/completions, streamed (SSE) or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from ladle.engine.async_engine import RequestStream
from ladle.engine.request import RequestTimings, TokenLogprob
from ladle.engine.sampling_params import SamplingParams
from ladle.errors import InvalidRequestError
from ladle.server import harmony
from ladle.server.chat_prompt import chat_prompt
from ladle.reasoning.parser import prompt_opens_reasoning
from ladle.server.chat_tools import ChoiceDeltas, Thinking, assistant_message
from ladle.server.constraints import ToolPlan, tool_plan_of
from ladle.server.context import ServerContext, get_context
from ladle.server.errors import validation_error
from ladle.server.kv_handover import reply_params, with_kv_transfer
from ladle.server.live import Tracked
from ladle.server.logprobs import CompletionLogprobsBuilder, chat_logprobs, prompt_logprobs_of
from ladle.server.middleware import RequestRecord, request_record
from ladle.server.openapi import schemas
from ladle.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, CompletionChoice, CompletionRequest, CompletionResponse, DeltaMessage, Timings, Usage,
    random_id, unrecognized,
)
from ladle.server.streaming import (
    DONE, ClientDisconnected, abort_all, collect, merge, sse_error, sse_event, sse_response, unless_disconnected,
)

router = APIRouter()
M = TypeVar("M", bound=BaseModel)
CHAT_EXAMPLES = {
    "chat": {"messages": [{"role": "user", "content": "Say hello in one short sentence."}], "max_tokens": 16},
    "streamed": {"messages": [{"role": "system", "content": "You are terse."},
                              {"role": "user", "content": "Name a colour."}],
                 "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
}
COMPLETION_EXAMPLES = {
    "completion": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    "streamed": {"prompt": ["Once upon a time", "1, 2, 3,"], "max_tokens": 8, "stream": True, "seed": 7},
    "echoed logprobs": {"prompt": "Hello world", "max_tokens": 2, "echo": True, "logprobs": 2},
}


async def parse_body(request: Request, model: type[M]) -> M:
    """Validate the JSON body ourselves, so every problem is a 400 naming the field (never a 422);
    a field the model does not declare gets OpenAI's answer."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        error = validation_error(e.errors())
        if e.errors()[0]["type"] == "extra_forbidden" and error.param:
            raise unrecognized(error.param) from None
        raise error from None


def json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def _response_id(prefix: str, req: ChatCompletionRequest | CompletionRequest) -> str:
    """The client's request_id under the route's prefix (as vLLM names it), else a fresh one."""
    return f"{prefix}-{req.request_id}" if req.request_id else random_id(prefix)


def _renames(req: ChatCompletionRequest | CompletionRequest) -> dict[str, str]:
    """Engine parameter names -> the request fields the client actually sent."""
    if isinstance(req, CompletionRequest):
        return {}
    return {"prompt": "messages", "max_tokens": req.max_tokens_field, "thinking_token_budget": req.budget_field}


def _renamed(e: InvalidRequestError, renames: dict[str, str]) -> InvalidRequestError:
    new = renames.get(e.param or "")
    if new is None or new == e.param:
        return e
    message = e.message.replace("max_tokens", new) if e.param == "max_tokens" else e.message
    return InvalidRequestError(message, new, e.code)


def _sampling_params(ctx: ServerContext, req: ChatCompletionRequest | CompletionRequest,
                     tools: ToolPlan | None = None) -> SamplingParams:
    try:
        params = req.to_sampling_params()
    except InvalidRequestError as e:
        raise _renamed(e, _renames(req)) from None
    grammar = tools.grammar if tools is not None else None
    if grammar is not None:
        if params.structured_outputs is not None:
            field = params.structured_outputs.field.split(".")[0]
            raise InvalidRequestError(f'{field} cannot be combined with tool_choice "{tools.mode}": the tool call '
                                      "is the output", param=field)
        params.structured_outputs = grammar
    vocab = ctx.engine.vocab_size
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
    params.update_from_tokenizer(ctx.engine.tokenizer, vocab)
    return params


async def _submit(ctx: ServerContext, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
                  renames: dict[str, str], lora: str | None) -> RequestStream:
    try:
        return await ctx.engine.add_request(request_id, prompt, params, priority, lora)
    except InvalidRequestError as e:
        raise _renamed(e, renames) from None


# -- chat ------------------------------------------------------------------------


@dataclass
class ChatInputs:
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None
    lora: str | None  # the adapter `model` names
    thinking: Thinking | None  # --reasoning-parser: how its replies split into reasoning and content
    # a prompt with images: its text and each image's (part name, URL), fetched when it is submitted
    text: str = ""
    images: list[tuple[str, str]] = field(default_factory=list)


def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest) -> ChatInputs:
    """A chat request checked and rendered (with the server's chat template); 400s name its fields.
    /v1/chat/completions and /v1/responses both come through here."""
    model = ctx.check_model(req.model)
    req.check_supported()
    ctx.check_logprobs(req.top_logprobs, "top_logprobs")
    ctx.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    tools = tool_plan_of(req, ctx.tool_call_parser)
    params = _chat_params(ctx, req, tools)
    template_kwargs = harmony.template_kwargs(req) if ctx.harmony else req.chat_template_kwargs
    images = [url for i, m in enumerate(req.messages) for url in m.image_urls(f"messages[{i}]")]
    ctx.check_images(images)
    prompt = chat_prompt(ctx.chat_tokenizer, req.messages, req.add_generation_prompt,
                         req.continue_final_message, template_kwargs, tools.tools if tools else None,
                         as_parts=ctx.engine.engine.images is not None)
    tags = ctx.reasoning_tags
    thinking = None if tags is None else Thinking(tags, prompt_opens_reasoning(prompt, tags), ctx.harmony)
    if images:  # the engine expands and tokenizes it (no truncation: it would cut into an image)
        return ChatInputs([], params, tools, model.lora, thinking, prompt, images)
    ids = ctx.engine.tokenizer.encode(prompt, keep_last=req.prompt_room(ctx.engine.max_model_len))
    return ChatInputs(ids, params, tools, model.lora, thinking)


def _chat_params(ctx: ServerContext, req: ChatCompletionRequest, tools: ToolPlan | None) -> SamplingParams:
    """A chat request's sampling parameters. A harmony model's effort is in its prompt, not a budget, and
    its replies are decoded with their special tokens for the harmony parser, which keeps them from the client."""
    if not ctx.harmony:
        return _sampling_params(ctx, req, tools)
    harmony.check_request(req, ctx.chat_tokenizer.chat_template)
    params = _sampling_params(ctx, harmony.without_effort(req), tools)
    params.skip_special_tokens = False
    return params


async def submit_chat(ctx: ServerContext, request: Request, request_id: str, req: ChatCompletionRequest,
                      inputs: ChatInputs) -> RequestStream:
    prompt = await ctx.image_prompt(inputs.text, inputs.images) if inputs.images else inputs.prompt_ids
    stream = await _submit(ctx, request_id, prompt, inputs.params, req.priority, _renames(req), inputs.lora)
    inputs.prompt_ids = stream.prompt_token_ids
    record = request_record(request)
    record.request_id, record.prompt_tokens = request_id, len(inputs.prompt_ids)
    return stream


@router.post("/v1/chat/completions", openapi_extra=schemas(
    ChatCompletionRequest, ChatCompletionResponse, stream_event=ChatCompletionChunk, examples=CHAT_EXAMPLES))
async def chat_completions(request: Request) -> Response:
    ctx = get_context(request)
    req = await parse_body(request, ChatCompletionRequest)
    inputs = prepare_chat(ctx, req)
    inputs.params = await with_kv_transfer(ctx, req.kv_transfer_params, inputs.params, req.stream)
    tools = inputs.tools
    request_id = _response_id("chatcmpl", req)
    stream = await submit_chat(ctx, request, request_id, req, inputs)
    ids = inputs.prompt_ids
    tracked = ctx.live.add([request_id, req.request_id], [stream.request_id])
    if req.stream:
        return sse_response(_chat_events(ctx, req, stream, inputs, request_record(request), tracked))
    try:
        result, cached = await unless_disconnected(request, collect(stream, req.n))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        ctx.live.remove(tracked)
    request_record(request).output_tokens = sum(len(c.token_ids) for c in result.outputs)
    choices = []
    for c in result.outputs:
        message, finish_reason = assistant_message(tools, c.text, c.finish_reason, inputs.thinking)
        choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason, stop_reason=c.stop_reason,
                                  logprobs=chat_logprobs(ctx.names, c.logprobs) if req.logprobs else None))
    reasoning = sum(c.num_reasoning_tokens or 0 for c in result.outputs) if inputs.thinking else None
    completion_tokens = sum(len(c.token_ids) for c in result.outputs)
    usage = Usage.of(len(ids), completion_tokens, cached, reasoning)
    timings = Timings.of([result.timings], len(ids), cached, completion_tokens) \
        if req.include_timings and result.timings else None
    prompt_lps = None if req.prompt_logprobs is None else \
        prompt_logprobs_of(ctx.names, _prompt_logprobs(result.prompt_logprobs, len(ids), req.prompt_logprobs))
    body = ChatCompletionResponse(id=request_id, model=req.model or ctx.model_name, choices=choices, usage=usage,
                                  prompt_logprobs=prompt_lps, timings=timings,
                                  kv_transfer_params=reply_params(ctx, req.kv_transfer_params, stream.request_id))
    return json_response(body)


async def _chat_events(ctx: ServerContext, req: ChatCompletionRequest, stream: RequestStream,
                       inputs: ChatInputs, record: RequestRecord, tracked: Tracked) -> AsyncIterator[str]:
    created = int(time.time())
    exclude = None if req.include_usage else {"usage"}
    num_prompt_tokens = len(stream.prompt_token_ids)
    generated: dict[int, int] = {}  # completion tokens so far, per choice
    reasoning: dict[int, int] = {}  # reasoning tokens so far, per choice
    choice_deltas: dict[int, ChoiceDeltas] = {}

    def event(choices: list[ChatChunkChoice], usage: Usage | None = None, timings: Timings | None = None) -> str:
        if usage is None and req.continuous_usage and choices:  # vLLM: the usage of the chunk's choice so far
            usage = _running_usage(num_prompt_tokens, generated.get(choices[0].index, 0))
        chunk = ChatCompletionChunk(id=stream.request_id, created=created, model=req.model or ctx.model_name,
                                    choices=choices, usage=usage, timings=timings)
        return sse_event(chunk, exclude)

    cached, stages = 0, None
    try:
        async for out in stream:
            cached, stages = out.num_cached_tokens, out.timings or stages
            for d in out.deltas:
                if d.index not in generated:  # the first chunk of each choice carries the role
                    generated[d.index] = 0
                    choice_deltas[d.index] = ChoiceDeltas(inputs.tools, inputs.thinking)
                    yield event([ChatChunkChoice(index=d.index, delta=DeltaMessage(role="assistant", content=""))])
                generated[d.index] += len(d.token_ids)
                if d.num_reasoning_tokens is not None:
                    reasoning[d.index] = d.num_reasoning_tokens
                logprobs = chat_logprobs(ctx.names, d.logprobs) if req.logprobs and d.logprobs else None
                deltas = choice_deltas[d.index]
                delta = deltas.delta(d.text, last=d.finish_reason is not None)
                if not (delta or d.finish_reason or logprobs):
                    continue  # text held back (stop strings, split characters, tags): nothing to say yet
                if delta is None:
                    delta = DeltaMessage(content="") if logprobs else DeltaMessage()
                yield event([ChatChunkChoice(index=d.index, delta=delta, logprobs=logprobs,
                                             finish_reason=deltas.finish_reason(d.finish_reason),
                                             stop_reason=d.stop_reason)])
        timings = Timings.of([stages], num_prompt_tokens, cached, sum(generated.values())) \
            if req.include_timings and stages else None
        if req.include_usage:
            yield event([], Usage.of(num_prompt_tokens, sum(generated.values()), cached,
                                     sum(reasoning.values()) if inputs.thinking else None), timings)
        elif timings is not None:
            yield event([], timings=timings)
    except Exception as e:  # the reply broke off: an error event ends it, never [DONE] (that says it finished)
        yield sse_error(e)
        return
    finally:
        stream.abort()  # a client that left (cancellation lands here) frees its blocks at once
        ctx.live.remove(tracked)
        record.output_tokens = sum(generated.values())
    yield DONE


# -- completions -----------------------------------------------------------------


@router.post("/v1/completions", openapi_extra=schemas(
    CompletionRequest, CompletionResponse, stream_event=CompletionResponse, examples=COMPLETION_EXAMPLES))
async def completions(request: Request) -> Response:
    ctx = get_context(request)
    req = await parse_body(request, CompletionRequest)
    model = ctx.check_model(req.model)
    req.check_supported()
    ctx.check_logprobs(req.logprobs, "logprobs")
    ctx.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    prompts = req.prompts()
    params = await with_kv_transfer(ctx, req.kv_transfer_params, _sampling_params(ctx, req), req.stream, len(prompts))
    tok = ctx.engine.tokenizer
    keep = req.prompt_room(ctx.engine.max_model_len)
    prompt_ids = [tok.encode(p, add_special_tokens=req.add_special_tokens, keep_last=keep) if isinstance(p, str)
                  else list(p) if keep is None else list(p[-keep:]) for p in prompts]
    request_id = _response_id("cmpl", req)
    streams: list[RequestStream] = []
    try:
        for i, ids in enumerate(prompt_ids):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await _submit(ctx, rid, ids, params, req.priority,
                                         {"prompt": f"prompt[{i}]"} if len(prompts) > 1 else {}, model.lora))
    except BaseException:
        abort_all(streams)
        raise
    record = request_record(request)
    record.request_id, record.prompt_tokens = request_id, sum(len(ids) for ids in prompt_ids)
    # only now are token id prompts known to be valid; a truncated prompt is echoed as the model saw it
    prompt_texts = [p if isinstance(p, str) and keep is None else tok.decode(ids, skip_special_tokens=False)
                    if req.echo else "" for p, ids in zip(prompts, prompt_ids)]
    tracked = ctx.live.add([request_id, req.request_id], [s.request_id for s in streams])
    if req.stream:
        return sse_response(_completion_events(ctx, req, request_id, streams, prompt_texts, record, tracked))
    try:
        results = await unless_disconnected(request, _collect_all(streams, req.n))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        ctx.live.remove(tracked)
    choices, completion_tokens, cached = [], 0, 0
    for i, (result, n_cached) in enumerate(results):
        cached += n_cached
        for c in result.outputs:
            completion_tokens += len(c.token_ids)
            text, logprobs = c.text, None
            token_ids, lps = c.token_ids, c.logprobs
            if req.echo:
                text = prompt_texts[i] + text
                token_ids = result.prompt_token_ids + token_ids
                lps = _prompt_logprobs(result.prompt_logprobs, len(result.prompt_token_ids), req.logprobs) + lps
            if req.logprobs is not None:
                logprobs = CompletionLogprobsBuilder(ctx.names).build(token_ids, lps)
            prompt_lps = None if req.prompt_logprobs is None else prompt_logprobs_of(ctx.names, _prompt_logprobs(
                result.prompt_logprobs, len(result.prompt_token_ids), req.prompt_logprobs))
            choices.append(CompletionChoice(index=i * req.n + c.index, text=text, logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_logprobs=prompt_lps))
    record.output_tokens = completion_tokens
    usage = Usage.of(sum(len(ids) for ids in prompt_ids), completion_tokens, cached)
    timings = Timings.of([r.timings for r, _ in results if r.timings], usage.prompt_tokens, cached,
                         completion_tokens) if req.include_timings else None
    body = CompletionResponse(id=request_id, model=req.model or ctx.model_name, choices=choices, usage=usage,
                              timings=timings, kv_transfer_params=reply_params(ctx, req.kv_transfer_params,
                                                                               streams[0].request_id))
    return json_response(body)


async def _collect_all(streams: list[RequestStream], n: int) -> list:
    try:
        return list(await asyncio.gather(*(collect(s, n) for s in streams)))
    finally:
        abort_all(streams)


def _running_usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    """The usage a chunk carries under stream_options.continuous_usage_stats (as vLLM: no details)."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _prompt_logprobs(lps: list[TokenLogprob | None] | None, num_prompt_tokens: int,
                     k: int | None) -> list[TokenLogprob | None]:
    """One entry per prompt token (None where nothing was computed), each with its k most likely tokens
    (the engine computed as many as the larger of logprobs and prompt_logprobs asked)."""
    lps = [lp if lp is None else replace(lp, top=lp.top[: k or 0]) for lp in lps or []]
    return lps + [None] * (num_prompt_tokens - len(lps))


async def _completion_events(ctx: ServerContext, req: CompletionRequest, request_id: str,
                             streams: list[RequestStream], prompt_texts: list[str],
                             record: RequestRecord, tracked: Tracked) -> AsyncIterator[str]:
    created = int(time.time())
    exclude = None if req.include_usage else {"usage"}
    builders: dict[int, CompletionLogprobsBuilder] = {}
    prompt_lps: dict[int, list] = {}
    generated: dict[int, int] = {}  # completion tokens so far, per choice
    cached: dict[int, int] = {}
    stages: dict[int, RequestTimings] = {}
    try:
        async for i, out in merge(streams):
            cached[i] = out.num_cached_tokens
            if out.timings is not None:
                stages[i] = out.timings
            if out.prompt_logprobs is not None:
                prompt_lps.setdefault(i, out.prompt_logprobs)
            for d in out.deltas:
                index = i * req.n + d.index
                generated[index] = generated.get(index, 0) + len(d.token_ids)
                text, token_ids, lps = d.text, d.token_ids, d.logprobs
                if index not in builders:  # this choice's first chunk: echo the prompt before it
                    builders[index] = CompletionLogprobsBuilder(ctx.names)
                    if req.echo:
                        prompt = streams[i].prompt_token_ids
                        text = prompt_texts[i] + text
                        token_ids = prompt + token_ids
                        lps = _prompt_logprobs(prompt_lps.get(i), len(prompt), req.logprobs) + lps
                if not (text or d.finish_reason or (req.logprobs is not None and token_ids)):
                    continue
                logprobs = builders[index].build(token_ids, lps) if req.logprobs is not None else None
                choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                          finish_reason=d.finish_reason, stop_reason=d.stop_reason)
                # vLLM: the usage of this choice's prompt and of its completion so far
                usage = (_running_usage(len(streams[i].prompt_token_ids), generated[index])
                         if req.continuous_usage else None)
                yield sse_event(CompletionResponse(id=request_id, created=created, model=req.model or ctx.model_name,
                                                   choices=[choice], usage=usage), exclude)
        prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)
        usage = Usage.of(prompt_tokens, sum(generated.values()), sum(cached.values())) if req.include_usage else None
        timings = Timings.of(list(stages.values()), prompt_tokens, sum(cached.values()),
                             sum(generated.values())) if req.include_timings and stages else None
        if usage is not None or timings is not None:
            yield sse_event(CompletionResponse(id=request_id, created=created, model=req.model or ctx.model_name,
                                               choices=[], usage=usage, timings=timings), exclude)
    except Exception as e:  # the reply broke off: an error event ends it, never [DONE] (that says it finished)
        yield sse_error(e)
        return
    finally:
        abort_all(streams)
        ctx.live.remove(tracked)
        record.output_tokens = sum(generated.values())
    yield DONE
