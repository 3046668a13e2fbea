"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat path.

A request becomes a chat request (instructions, the previous response's conversation, this input),
is checked, rendered and run exactly as /v1/chat/completions runs one (function tools included), and
its reply becomes output items: a message, and a function_call item per call. Responses made with
`store` (the default) are kept in a bounded LRU so a later request can continue them with
`previous_response_id`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from ladle.engine.async_engine import RequestStream
from ladle.errors import InvalidRequestError
from ladle.server.chat_tools import ChoiceDeltas, Thinking, assistant_message
from ladle.server.constraints import ToolPlan
from ladle.server.context import ServerContext, get_context
from ladle.server.errors import APIError, api_error_of, validation_error
from ladle.server.middleware import RequestRecord, request_record
from ladle.server.openai_routes import json_response, prepare_chat, submit_chat
from ladle.server.openapi import schemas
from ladle.server.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCallMessage
from ladle.server.response_output import Status, StreamedOutput, assistant_turn, openai_id, output_items
from ladle.server.responses_protocol import (
    FunctionCallInput, FunctionCallOutput, IncompleteDetails, InputMessage, OutputItem, ResponseDeleted,
    ResponseError, ResponseObject, ResponsesRequest, ResponseStreamEvent, ResponseUsage,
)
from ladle.server.response_store import StoredResponse
from ladle.server.streaming import ClientDisconnected, collect, sse_event, sse_response, unless_disconnected

router = APIRouter()

# a chat request's field -> the /v1/responses field the client sent
_RENAMES = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input",
            "response_format": "text.format", "response_format.json_schema": "text.format",
            "reasoning_effort": "reasoning.effort"}


# -- the request ----------------------------------------------------------------


async def parse_request(request: Request) -> ResponsesRequest:
    try:
        return ResponsesRequest.model_validate_json(await request.body())
    except ValidationError as e:
        error = validation_error(e.errors())
        if e.errors()[0]["type"] in ("extra_forbidden", "none_required"):  # a field ladle does not serve
            raise APIError(400, f"{error.param} is not supported by /v1/responses", param=error.param) from None
        raise error from None


INPUT_ITEMS = {"message": InputMessage, "function_call": FunctionCallInput, "function_call_output": FunctionCallOutput}


def input_messages(value: str | list[dict[str, Any]], origins: list[int] | None = None) -> list[ChatMessage]:
    """The request's `input` as chat messages (function calls join the assistant message before them,
    their outputs become tool messages); 400 naming the item at fault. origins: filled with each
    message's item index."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    if not value:
        raise InvalidRequestError("input must be a string or a non-empty list of items", param="input")
    messages: list[ChatMessage] = []
    for i, raw in enumerate(value):
        item = _input_item(i, raw)
        if isinstance(item, FunctionCallInput):
            call = ToolCallMessage(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = (last.tool_calls or []) + [call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutput):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
        else:
            messages.append(ChatMessage(role=item.role, content=item.chat_content(f"input[{i}]")))
        if origins is not None:
            origins += [i] * (len(messages) - len(origins))
    return messages


def _input_item(i: int, item: Any) -> InputMessage | FunctionCallInput | FunctionCallOutput:
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind not in INPUT_ITEMS:
        raise InvalidRequestError(f"input items of type {kind!r} are not supported (only "
                                  f"{', '.join(INPUT_ITEMS)})", param=f"input[{i}].type")
    try:
        return INPUT_ITEMS[kind].model_validate(item)
    except ValidationError as e:
        raise validation_error([{**err, "loc": ("input", i, *err["loc"])} for err in e.errors()]) from None


def _previous_conversation(ctx: ServerContext, response_id: str | None) -> list[ChatMessage]:
    if response_id is None:
        return []
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"Previous response with id '{response_id}' not found: it was made with store=false, "
                       f"is unknown, or is older than the {ctx.responses.capacity} responses this server keeps",
                       param="previous_response_id", code="previous_response_not_found")
    return list(stored.conversation)


def _chat_request(req: ResponsesRequest, conversation: list[ChatMessage]) -> ChatCompletionRequest:
    # instructions lead this turn only: they are not part of the conversation a next turn continues
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    tools = [t.chat_tool() for t in req.tools] if req.tools else None
    return ChatCompletionRequest(model=req.model, messages=system + conversation, max_tokens=req.max_output_tokens,
                                 temperature=req.temperature, top_p=req.top_p, user=req.user,
                                 response_format=req.text_format.response_format(), tools=tools,
                                 tool_choice=req.chat_tool_choice(), parallel_tool_calls=req.parallel_tool_calls,
                                 reasoning_effort=req.reasoning.effort if req.reasoning is not None else None)


@contextmanager
def _named_as_sent(first: int = 0, origins: list[int] | None = None) -> Iterator[None]:
    """Errors of the chat path name the chat request's fields: rename them to this request's. A content
    part (an image) of chat message first + k is named in input item origins[k]."""
    try:
        yield
    except InvalidRequestError as e:
        param = e.param or ""
        new = _RENAMES.get(param) or ("input" if param.startswith("messages[") else None)
        index, _, rest = param.removeprefix("messages[").partition("]")
        if new == "input" and rest.startswith(".content[") and index.isdigit() and origins is not None \
                and 0 <= int(index) - first < len(origins):
            new = f"input[{origins[int(index) - first]}]{rest}"
        if new is None:
            raise
        raise InvalidRequestError(e.message.replace(param, new), new, e.code) from None


# -- the response ---------------------------------------------------------------


@dataclass
class Turn:
    """One /v1/responses request on its way through the engine."""

    req: ResponsesRequest
    model: str
    tools: ToolPlan | None  # how the reply's text becomes function calls
    conversation: list[ChatMessage]  # the previous turns' and this turn's input (no instructions)
    temperature: float
    top_p: float
    id: str
    message_id: str
    created_at: int
    thinking: Thinking | None = None  # --reasoning-parser: the think block is left out of the output, counted

    def body(self, status: str, output: list[OutputItem] | None = None, usage: ResponseUsage | None = None,
             error: ResponseError | None = None) -> ResponseObject:
        req = self.req
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, error=error, model=self.model,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, output=output or [],
            parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
            store=req.store, reasoning=req.reasoning, temperature=self.temperature, top_p=self.top_p, text=req.text_echo(),
            tool_choice=req.tool_choice or "auto", tools=req.tools or [], usage=usage, user=req.user,
            metadata=req.metadata or {})

    def finished(self, text: str, finish_reason: str | None, usage: ResponseUsage) -> ResponseObject:
        reply, _ = assistant_message(self.tools, text, finish_reason, self.thinking)
        status = _status(finish_reason)
        return self.body(status, output_items(reply, self.message_id, status), usage)


def _status(finish_reason: str | None) -> Status:
    # cut by max_output_tokens (or the context's end): incomplete, as OpenAI says it
    return "incomplete" if finish_reason == "length" else "completed"


def _keep(ctx: ServerContext, turn: Turn, body: ResponseObject) -> None:
    if turn.req.store:
        ctx.responses.put(StoredResponse(body, turn.conversation + [assistant_turn(body.output)]))


# -- routes ---------------------------------------------------------------------

EXAMPLES = {
    "text": {"input": "Say hello in one short sentence.", "max_output_tokens": 16},
    "streamed": {"instructions": "You are terse.", "input": [{"role": "user", "content": "Name a colour."}],
                 "max_output_tokens": 8, "temperature": 0, "stream": True, "store": False},
}


@router.post("/v1/responses", openapi_extra=schemas(ResponsesRequest, ResponseObject, stream_event=ResponseStreamEvent,
                                                    examples=EXAMPLES))
async def create_response(request: Request) -> Response:
    ctx = get_context(request)
    req = await parse_request(request)
    req.check_supported()
    previous, origins = _previous_conversation(ctx, req.previous_response_id), []
    conversation = previous + input_messages(req.input, origins)
    chat_req = _chat_request(req, conversation)
    turn_id = openai_id("resp")
    with _named_as_sent(len(chat_req.messages) - len(conversation) + len(previous), origins):
        inputs = prepare_chat(ctx, chat_req)
        stream = await submit_chat(ctx, request, turn_id, chat_req, inputs)
    turn = Turn(req, req.model or ctx.model_name, inputs.tools, conversation, inputs.params.temperature, inputs.params.top_p,
                turn_id, openai_id("msg"), int(time.time()), inputs.thinking)
    if req.stream:
        return sse_response(_events(ctx, turn, stream, request_record(request)))
    try:
        result, cached = await unless_disconnected(request, collect(stream, 1))
    except ClientDisconnected:
        return Response(status_code=499)
    reply = result.outputs[0]
    request_record(request).output_tokens = len(reply.token_ids)
    usage = ResponseUsage.of(len(inputs.prompt_ids), len(reply.token_ids), cached, reply.num_reasoning_tokens or 0)
    body = turn.finished(reply.text, reply.finish_reason, usage)
    _keep(ctx, turn, body)
    return json_response(body)


@router.get("/v1/responses/{response_id}", openapi_extra=schemas(response=ResponseObject))
async def retrieve_response(response_id: str, request: Request) -> Response:
    _refuse_query_params(request)
    return json_response(_stored(get_context(request), response_id).body)


@router.delete("/v1/responses/{response_id}", openapi_extra=schemas(response=ResponseDeleted))
async def delete_response(response_id: str, request: Request) -> Response:
    ctx = get_context(request)
    _stored(ctx, response_id)
    ctx.responses.delete(response_id)
    return json_response(ResponseDeleted(id=response_id))


def _stored(ctx: ServerContext, response_id: str) -> StoredResponse:
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found (responses made with store=false are "
                       "not kept)", param="response_id", code="response_not_found")
    return stored


def _refuse_query_params(request: Request) -> None:
    # streaming a stored response again (stream, starting_after) needs background mode, which ladle lacks
    if request.query_params:
        name = next(iter(request.query_params))
        raise APIError(400, f"{name} is not supported when retrieving a response", param=name)


# -- streaming ------------------------------------------------------------------


async def _events(ctx: ServerContext, turn: Turn, stream: RequestStream, record: RequestRecord) -> AsyncIterator[str]:
    """The typed events OpenAI sends, in its order: created, in_progress, each output item opened
    (a message and its text part, or a function call) and grown by deltas, every item done, then
    completed (or incomplete)."""
    sequence = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        return sse_event({"type": kind, "sequence_number": next(sequence), **fields}, event=kind)

    started = turn.body("in_progress").model_dump(mode="json")
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    output, deltas = StreamedOutput(event, turn.message_id), ChoiceDeltas(turn.tools, turn.thinking)
    output_tokens, cached, finish_reason, reasoning_tokens = 0, 0, None, 0
    try:
        async for out in stream:
            cached = out.num_cached_tokens
            for d in out.deltas:
                output_tokens += len(d.token_ids)
                finish_reason = d.finish_reason or finish_reason
                reasoning_tokens = d.num_reasoning_tokens or reasoning_tokens
                delta = deltas.delta(d.text, last=d.finish_reason is not None)
                for e in output.feed(delta) if delta is not None else []:
                    yield e
    except Exception as exc:
        e = api_error_of(exc)
        yield event("error", code=e.code, message=e.message, param=e.param)
        failed = turn.body("failed", error=ResponseError(code=e.code or "server_error", message=e.message))
        yield event("response.failed", response=failed.model_dump(mode="json"))
        return
    finally:
        stream.abort()  # a client that left (cancellation lands here) frees its blocks at once
        record.output_tokens = output_tokens
    for e in output.finish(_status(finish_reason)):
        yield e
    usage = ResponseUsage.of(len(stream.prompt_token_ids), output_tokens, cached, reasoning_tokens)
    body = turn.body(_status(finish_reason), output.items, usage)
    _keep(ctx, turn, body)  # before the last event: a client may continue the moment it reads it
    yield event(f"response.{body.status}", response=body.model_dump(mode="json"))
