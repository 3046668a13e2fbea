"""Request fields that constrain the output, resolved to one grammar and a tool-call plan.

Structured outputs come as OpenAI's `response_format`, vLLM's `structured_outputs` object or
vLLM's older `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar`; at most one of them
per request. Tools come as `tools` + `tool_choice` (+ `parallel_tool_calls`): "required" and a
named function become a grammar (so the arguments always parse); "auto" parses what the model
writes with the server's --tool-call-parser; "none" only shows the tools to the model. A tool's
`strict: false` makes its grammar read the parameters schema as JSON Schema does (properties it
does not name are allowed); strict true or unset forbids them, as OpenAI's strict mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ladle.errors import InvalidRequestError
from ladle.structured.spec import StructuredOutputsParams
from ladle.tools.choice import function_of, named_schema, required_schema
from ladle.tools.parsers import NamedParser, RequiredParser, ToolParser, make_parser


class _Strict(BaseModel):
    """Sub-objects whose unknown keys are errors (a misspelt constraint must not be ignored)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_outputs_of(req: Any) -> StructuredOutputsParams | None:
    """The one output constraint a request sets (None for none); 400 naming the field when it
    sets several or one is malformed."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True, field="response_format")))
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format of type json_schema needs json_schema.schema",
                                          param="response_format.json_schema")
            found.append(("response_format", StructuredOutputsParams(
                json=rf.json_schema.schema_, strict=bool(rf.json_schema.strict), field="response_format.json_schema")))
    so = req.structured_outputs
    if so is not None:
        found.append(("structured_outputs", StructuredOutputsParams(
            json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object),
            disable_any_whitespace=so.disable_any_whitespace, strict=False)))
    for name in GUIDED_FIELDS:
        value = getattr(req, name)
        if value is not None:
            kind = name.removeprefix("guided_")
            found.append((name, StructuredOutputsParams(**{kind: value}, strict=False, field=name)))
    if len(found) > 1:
        raise InvalidRequestError(f"{found[1][0]} cannot be combined with {found[0][0]}: set one output constraint",
                                  param=found[1][0])
    return found[0][1] if found else None


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]]
    parser_name: str | None = None  # auto: the server's --tool-call-parser
    function: str | None = None  # named: the function
    parallel: bool = True
    strict: bool = True  # the grammar's strictness (named, required): no tool it covers says strict false

    @property
    def grammar(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            tool = next(t for t in self.tools if function_of(t)["name"] == self.function)
            return StructuredOutputsParams(json=named_schema(tool), strict=self.strict, field="tool_choice")
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel), strict=self.strict,
                                           field="tools")
        return None

    def new_parser(self) -> ToolParser | None:
        """A parser for one choice's text (None: the text is plain content)."""
        if self.mode == "named":
            return NamedParser(self.function)
        if self.mode == "required":
            return RequiredParser()
        if self.mode == "auto":
            return make_parser(self.parser_name)
        return None


def tool_plan_of(req: Any, auto_parser: str | None) -> ToolPlan | None:
    """How the request's tools are used (None without tools). auto_parser: the server's
    --tool-call-parser when --enable-auto-tool-choice is on, else None (as in vLLM, "auto" is then
    refused, and a request that names no tool_choice gets "none")."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto" if auto_parser else "none"
    if isinstance(choice, NamedToolChoice):
        names = [function_of(t)["name"] for t in tools]
        if choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                      f"({', '.join(names)})", param="tool_choice")
        strict = req.tools[names.index(choice.function.name)].function.strict is not False
        return ToolPlan("named", tools, function=choice.function.name, parallel=parallel, strict=strict)
    if choice == "auto" and auto_parser is None:
        raise InvalidRequestError('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                                  "and --tool-call-parser", param="tool_choice")
    if choice not in ("none", "auto", "required"):
        raise InvalidRequestError("tool_choice must be none, auto, required or {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}", param="tool_choice")
    return ToolPlan(choice, tools, parser_name=auto_parser if choice == "auto" else None, parallel=parallel,
                    strict=_strictness(req.tools) if choice == "required" else True)


def _strictness(tools: list[ToolDefinition]) -> bool:
    """One grammar covers every tool under "required": strict unless a tool says strict false, and
    refused when others say strict true."""
    said = [t.function.strict for t in tools]
    if True in said and False in said:
        raise InvalidRequestError('tool_choice "required" takes tools that are all strict or all not',
                                  param=f"tools[{said.index(False)}].function.strict")
    return False not in said
