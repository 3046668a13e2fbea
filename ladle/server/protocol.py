"""Request and response bodies of the OpenAI API, with vLLM's extra fields.

Every request field either changes the result, or is metadata that changes nothing
(METADATA_FIELDS), or is accepted only at the value that changes nothing (NO_EFFECT_FIELDS:
any other value is refused with a 400 naming it). A field no model declares is refused
with a 400 naming it, as OpenAI answers ("Unrecognized request argument supplied").
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from ladle.engine.request import RequestTimings
from ladle.engine.sampling_params import SamplingParams
from ladle.errors import InvalidRequestError
from ladle.reasoning.budget import EFFORT_BUDGETS
from ladle.server.constraints import (
    NamedToolChoice, ResponseFormat, StructuredOutputsField, ToolDefinition, structured_outputs_of,
)

# Accepted and changing nothing: what clients say about a request (who sent it, how OpenAI should
# store, bill or cache it, a predicted output that only makes OpenAI faster, padding against side
# channels in OpenAI's stream events), never about its result.
METADATA_FIELDS = frozenset({"user", "store", "service_tier", "metadata", "safety_identifier", "prompt_cache_key",
                             "prompt_cache_retention", "prediction", "include_obfuscation"})
# Accepted only at their no-effect value (in brackets), refused naming them otherwise: logit_bias ({}),
# suffix (""), best_of (n), use_beam_search (false), spaces_between_special_tokens (true, or any value
# while special tokens are skipped), guided_decoding_backend (auto or xgrammar, ladle's only backend).
NO_EFFECT_FIELDS = frozenset({"logit_bias", "suffix", "best_of", "use_beam_search", "spaces_between_special_tokens",
                              "guided_decoding_backend"})
MAX_N = 128
MAX_LOGPROBS = 20  # the engine's ceiling; the server's --max-logprobs may lower it
SEED_RANGE = dict(ge=-(2**63), le=2**63 - 1)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class KVTransferParams(BaseModel):
    """Disaggregated prefill/decode. To a prefill worker: {"do_remote_decode": true} (keep the
    prompt's K/V for a decode worker). Its reply carries {"do_remote_prefill": true, remote_host,
    remote_port, transfer_id}, which the router passes to a decode worker unchanged."""

    model_config = ConfigDict(extra="forbid")
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str | None = None
    remote_port: int | None = Field(None, ge=1, le=65535)
    transfer_id: str | None = Field(None, min_length=1, max_length=512)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # metadata: ladle's events carry no obfuscation padding


class _Sampling(_Request):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, **SEED_RANGE)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # true: decoded as tokenizer.json decodes (vLLM's default)
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the prompt's last N tokens; -1: what fits
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    prompt_logprobs: int | None = Field(None, ge=0)  # at most the server's --max-logprobs
    use_beam_search: bool = False
    priority: int = 0
    # a client-chosen id: the response id becomes "<prefix>-<request_id>", and
    # POST /v1/requests/{request_id}/cancel stops the request (ladle.server.cancel)
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+$")
    include_timings: bool = False  # ladle: add the server-side stages ("timings") to the response
    # disaggregated prefill/decode (ladle.server.kv_handover), as vLLM's proxy sends it
    kv_transfer_params: KVTransferParams | None = None
    thinking_token_budget: int | None = None  # reasoning models (--reasoning-parser): tokens of thinking at most
    # output constraints (ladle.server.constraints): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries
        the usage so far (its choice's completion tokens), not only the final usage chunk."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def check_supported(self) -> None:
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.use_beam_search:
            raise InvalidRequestError("use_beam_search is not supported: ladle samples, it has no beam search",
                                      param="use_beam_search")
        if not (self.spaces_between_special_tokens or self.skip_special_tokens):
            raise InvalidRequestError("spaces_between_special_tokens false is not supported (ladle decodes as "
                                      "tokenizer.json does, as vLLM's default)", param="spaces_between_special_tokens")
        if self.truncate_prompt_tokens == 0:
            raise InvalidRequestError("truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise InvalidRequestError("ladle's only structured-output backend is xgrammar",
                                      param="guided_decoding_backend")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises InvalidRequestError naming the field at fault."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=self.allowed_token_ids, bad_words=list(self.bad_words),
            structured_outputs=structured_outputs_of(self), thinking_token_budget=self.thinking_budget,
        )

    def prompt_room(self, max_model_len: int) -> int | None:
        """How many prompt tokens to keep, the last ones (None: all), by vLLM's truncate_prompt_tokens
        rules: -1 keeps what the context leaves after max_tokens; more than that is refused."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return None
        room = max_model_len - (self.requested_max_tokens or 0)
        if room < 1:
            raise InvalidRequestError(f"{self.max_tokens_field} leaves no room for the prompt in the context "
                                      f"({max_model_len} tokens)", param=self.max_tokens_field)
        if keep > room:
            raise InvalidRequestError(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len - "
                                      f"{self.max_tokens_field} = {room}. Please request a smaller truncation size.",
                                      param="truncate_prompt_tokens")
        return room if keep == -1 else keep

    @property
    def thinking_budget(self) -> int | None:
        return self.thinking_token_budget


# -- /v1/chat/completions --------------------------------------------------------


class TextPart(_Request):
    """A content part: only text ones are served; the others are refused by their type."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallMessage(_Request):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant's earlier thinking, for templates that show it (vLLM's two names)
    reasoning_content: str | None = None
    reasoning: str | None = None
    # what OpenAI and vLLM replies carry, sent back with the message: accepted while null or empty
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def text(self, where: str) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(f"content parts of type {part.type!r} are not supported (only 'text' and "
                                          "'image_url')", param=f"{where}.content[{j}].type")
            if part.model_extra:
                raise unrecognized(f"{where}.content[{j}].{next(iter(part.model_extra))}")
            texts.append(part.text)
        return "\n".join(texts)


    def image_urls(self, where: str) -> list[tuple[str, str]]:
        """(the part's name, its URL) for each image_url content part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(f"{where}.content[{j}].image_url", _image_url(part, f"{where}.content[{j}]"))
                for j, part in enumerate(self.content) if part.type == "image_url"]

    def parts(self, where: str) -> list[dict[str, str]]:
        """The content as the parts chat templates of vision models read: {"type": "text", "text": ...} and
        {"type": "image"} where each image goes."""
        if not isinstance(self.content, list):
            return [{"type": "text", "text": self.content}] if self.content else []
        return [{"type": "image"} if part.type == "image_url" else {"type": "text", "text": ChatMessage(
            role=self.role, content=[part]).text(f"{where}.content[{j}]")} for j, part in enumerate(self.content)]


def _image_url(part: TextPart, where: str) -> str:
    """An image_url part's URL: {"image_url": {"url": ..., "detail": "auto"}} (or the URL alone)."""
    extra = dict(part.model_extra or {})
    value = extra.pop("image_url", None)
    if extra or part.text is not None:
        raise unrecognized(f"{where}.{next(iter(extra)) if extra else 'text'}")
    if isinstance(value, dict):
        value = dict(value)
        url, detail = value.pop("url", None), value.pop("detail", "auto")
        if value:
            raise unrecognized(f"{where}.image_url.{next(iter(value))}")
        if detail != "auto":
            raise InvalidRequestError(f"{where}.image_url.detail {detail!r} is not supported (only 'auto')",
                                      param=f"{where}.image_url.detail")
        value = url
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{where}.image_url needs a url", param=f"{where}.image_url")
    return value


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most the server's --max-logprobs
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # metadata (METADATA_FIELDS): accepted, no effect
    store: bool | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prediction: dict[str, Any] | None = None
    # reasoning models (--reasoning-parser): OpenAI's effort levels, mapped to thinking budgets
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                      param="continue_final_message")
        if self.reasoning_effort is not None and self.thinking_token_budget is not None:
            raise InvalidRequestError("set reasoning_effort or thinking_token_budget, not both",
                                      param="thinking_token_budget")

    def to_sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(self.requested_max_tokens, logprobs, self.prompt_logprobs)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def thinking_budget(self) -> int | None:
        if self.reasoning_effort is not None:
            return EFFORT_BUDGETS[self.reasoning_effort]
        return self.thinking_token_budget

    @property
    def budget_field(self) -> str:
        return "reasoning_effort" if self.reasoning_effort is not None else "thinking_token_budget"

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# -- /v1/completions -------------------------------------------------------------


class CompletionRequest(_Sampling):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]]: checked by prompts()
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)  # at most the server's --max-logprobs
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        # best_of == n (1 by default) returns every candidate: the same as leaving it out
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError(f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of greater than n is not supported", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if all(_is_token_id(t) for t in p):
                return [p]
            if all(isinstance(x, str) for x in p):
                return p
            if all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in p):
                return p
        raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids "
                                  "or a list of lists of token ids, and not empty", param="prompt")

    def to_sampling_params(self) -> SamplingParams:
        echoed = self.logprobs if self.echo else None  # the echoed prompt's logprobs come from the engine's
        prompt_logprobs = max((k for k in (self.prompt_logprobs, echoed) if k is not None), default=None)
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_INSTEAD = {"functions": "tools", "function_call": "tool_choice"}  # OpenAI's legacy fields -> what replaced them


def unrecognized(param: str) -> InvalidRequestError:
    """OpenAI's answer to a field it does not know."""
    instead = f" (send {_INSTEAD[param]}: ladle serves no legacy {param})" if param in _INSTEAD else ""
    return InvalidRequestError(f"Unrecognized request argument supplied: {param}{instead}", param=param)


# -- responses -------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0


class Timings(_Response):
    """include_timings: where a request's time went on the server, in ms from its arrival at the engine
    (after parsing and tokenizing): queued until first scheduled, prefill until the first token (cached
    prompt tokens were not computed), and the first and last tokens. None: the stage was never reached."""

    queued_ms: float | None = None
    prefill_ms: float | None = None
    first_token_ms: float | None = None
    last_token_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, timings: list[RequestTimings], prompt_tokens: int, cached_tokens: int,
           completion_tokens: int) -> "Timings":
        """One request's figures; a request with several prompts counts from the earliest arrival."""
        def ms(later: float | None, earlier: float | None) -> float | None:
            return None if later is None or earlier is None else round((later - earlier) * 1000, 3)

        def first(times: list[float | None]) -> float | None:
            return min((t for t in times if t is not None), default=None)

        arrival = first([t.arrival for t in timings])
        scheduled, first_token = first([t.first_scheduled for t in timings]), first([t.first_token for t in timings])
        last_token = max((t.last_token for t in timings if t.last_token is not None), default=None)
        return cls(queued_ms=ms(scheduled, arrival), prefill_ms=ms(first_token, scheduled),
                   first_token_ms=ms(first_token, arrival), last_token_ms=ms(last_token, arrival),
                   prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, completion_tokens=completion_tokens)


class _Timed(_Response):
    """A response that carries `timings` only when the request asked for them, and
    `kv_transfer_params` only from a prefill worker."""

    @model_serializer(mode="wrap")
    def _drop_unset_extras(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for name in ("timings", "kv_transfer_params", "prompt_logprobs"):
            if out.get(name, 0) is None:
                out.pop(name)
        return out


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # served with --reasoning-parser

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
           reasoning_tokens: int | None = None) -> "Usage":
        details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                   completion_tokens_details=details)

    @model_serializer(mode="wrap")
    def _drop_unset_details(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("completion_tokens_details") is None:
            out.pop("completion_tokens_details", None)
        return out


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class PromptLogprob(_Response):
    """vLLM's Logprob: a token's logprob, its rank (tokens at least as likely, itself included; 1 the
    most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# prompt_logprobs: per prompt token, None for the first (nothing predicts it), else token id -> its
# Logprob, the prompt's own token first, then the prompt_logprobs most likely (vLLM's shape)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the think block (left out when None)
    tool_calls: list[ToolCallOut] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_unset_reasoning(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("reasoning_content") is None:
            out.pop("reasoning_content", None)
        return out


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(_Response):
    """A call's first delta carries id, type and name (arguments ""); later ones only arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Timed):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # asked for with prompt_logprobs
    timings: Timings | None = None
    kv_transfer_params: KVTransferParams | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends only what a delta carries ({"content": ...}, or {} at the end)
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Timed):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # asked for with prompt_logprobs (left out otherwise)

    @model_serializer(mode="wrap")
    def _drop_unset_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("prompt_logprobs") is None:
            out.pop("prompt_logprobs", None)
        return out


class CompletionResponse(_Timed):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None
    kv_transfer_params: KVTransferParams | None = None


class CancelResponse(_Response):
    """POST /v1/requests/{request_id}/cancel: the request named was running and is cancelled."""

    id: str
    object: Literal["request.cancelled"] = "request.cancelled"
    cancelled: bool = True


# -- /tokenize, /detokenize, /v1/models ------------------------------------------


class TokenizeRequest(_Request):
    """vLLM's two shapes in one: `prompt` (completion style) or `messages` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM: True for prompts, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None  # with messages: rendered by the chat template, as a chat request's
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ladle"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionInfo(_Response):
    """GET /version: ladle's version and how this engine computes on this machine."""

    version: str
    device: str
    dtype: str
    dtype_reason: str
    quantization: str | None
    weights: str
    kv_cache_dtype: str
    kernels: str
    matmul: str
