"""The request and response models of /v1/responses (OpenAI's Responses API, as vLLM serves it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ladle.errors import InvalidRequestError
from ladle.server.constraints import (
    FunctionDefinition, JsonSchemaFormat, NamedFunction, NamedToolChoice, ResponseFormat, ToolDefinition,
)
from ladle.server.protocol import TextPart, _Request, _Response


# -- /v1/responses ---------------------------------------------------------------
# OpenAI's Responses API over the chat path: a request becomes chat messages (see
# ladle.server.responses); the reply is one assistant message item.


class _Closed(BaseModel):
    """/v1/responses refuses what it does not implement: an unknown field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class InputPart(_Request):
    """A content part: only text ones are served, the others are refused by their type."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    type: str
    text: str | None = None
    # an earlier reply's output_text passed back as input carries them: they describe that reply, no effect
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Closed):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    id: str | None = None  # set on an earlier reply's message passed back as input
    status: str | None = None

    def chat_content(self, where: str) -> str | list[TextPart]:
        """The content as a chat message's: its text, or with input_image parts, chat's text and image_url parts."""
        if isinstance(self.content, str) or all(part.type != "input_image" for part in self.content):
            return self.text(where)
        return [self._image_part(part, f"{where}.content[{j}]") if part.type == "input_image"
                else TextPart(type="text", text=InputMessage(role=self.role, content=[part]).text(f"{where}.content[{j}]"))
                for j, part in enumerate(self.content)]

    @staticmethod
    def _image_part(part: InputPart, where: str) -> TextPart:
        """An input_image part ({"image_url": URL, "detail": "auto"}) as chat's image_url part."""
        extra = dict(part.model_extra or {})
        url, detail = extra.pop("image_url", None), extra.pop("detail", "auto")
        if extra or part.text is not None:
            param = f"{where}.{next(iter(extra)) if extra else 'text'}"
            raise InvalidRequestError(f"{param} is not supported by /v1/responses (an image by image_url only)",
                                      param=param)
        if detail != "auto":
            raise InvalidRequestError(f"{where}.detail {detail!r} is not supported (only 'auto')",
                                      param=f"{where}.detail")
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{where}.image_url needs a URL", param=f"{where}.image_url")
        return TextPart(type="image_url", image_url={"url": url})

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type not in ("input_text", "output_text") or part.text is None:
                raise InvalidRequestError(f"content parts of type {part.type!r} are not supported "
                                          "(only input_text, output_text and input_image)",
                                          param=f"{where}.content[{j}].type")
            if part.model_extra:
                param = f"{where}.content[{j}].{next(iter(part.model_extra))}"
                raise InvalidRequestError(f"{param} is not supported by /v1/responses", param=param)
            texts.append(part.text)
        return "\n".join(texts)


class _CallItem(_Closed):
    """An input item about one function call (`call_id`); `id` and `status` as a reply carried them."""

    call_id: str
    id: str | None = None
    status: str | None = None


class FunctionCallInput(_CallItem):
    """An earlier reply's function call, passed back as input."""

    type: Literal["function_call"]
    name: str
    arguments: str


class FunctionCallOutput(_CallItem):
    """The result of a call, for the model's next turn."""

    type: Literal["function_call_output"]
    output: str


class FunctionTool(_Closed):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> ToolDefinition:
        return ToolDefinition(function=FunctionDefinition(name=self.name, description=self.description,
                                                          parameters=self.parameters, strict=self.strict))


class FunctionToolChoice(_Closed):
    type: Literal["function"]
    name: str


class TextFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> ResponseFormat | None:
        """The chat request's response_format for this text.format."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        if self.schema_ is None:
            raise InvalidRequestError("text.format of type json_schema needs a schema", param="text.format.schema")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=self.name or "response", description=self.description, schema=self.schema_, strict=self.strict))


class ReasoningConfig(_Closed):
    """A reasoning model's effort (served with --reasoning-parser): a thinking budget, as chat's
    reasoning_effort maps it. The reasoning text itself is left out of the output; its tokens are
    counted in usage.output_tokens_details.reasoning_tokens."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: None = None  # summaries are not produced


class TextConfig(_Closed):
    format: TextFormat | None = None


MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits


class ResponsesRequest(_Closed):
    model: str | None = None
    input: str | list[dict[str, Any]]  # items are checked one by one (ladle.server.responses)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None  # function tools; OpenAI's hosted tools are not served
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # accepted only where they change nothing: no extra output, no background runs
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    reasoning: ReasoningConfig | None = None

    def check_supported(self) -> None:
        if self.include:
            raise InvalidRequestError(f"include {self.include} is not supported", param="include")
        if self.background:
            raise InvalidRequestError("background responses are not supported", param="background")
        if self.metadata is not None:
            _check_metadata(self.metadata)

    @property
    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")

    def chat_tool_choice(self) -> str | NamedToolChoice | None:
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            return NamedToolChoice(function=NamedFunction(name=choice.name))
        return choice

    def text_echo(self) -> dict[str, Any]:
        """The response's `text`: the format as asked for."""
        return {"format": self.text_format.model_dump(by_alias=True, exclude_none=True)}


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_KEYS:
        raise InvalidRequestError(f"metadata may hold at most {MAX_METADATA_KEYS} keys", param="metadata")
    for k, v in metadata.items():
        if len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            raise InvalidRequestError(f"metadata keys may be at most {MAX_METADATA_KEY} characters and values "
                                      f"{MAX_METADATA_VALUE}", param=f"metadata.{k[:MAX_METADATA_KEY]}")


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(_Response):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(_Response):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # OpenAI's billed cache writes: ladle has none


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> "ResponseUsage":
        return cls(input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


class ResponseError(_Response):
    code: str
    message: str


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False


class ResponseDeleted(_Response):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class ResponseStreamEvent(BaseModel):
    """A streamed event: `type` says which (response.created, response.output_text.delta, ...,
    response.completed) and the rest of its fields follow OpenAI's event of that type."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
