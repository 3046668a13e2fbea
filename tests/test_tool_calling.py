"""Tool calling with the openai SDK: required and named choices under a grammar, auto through a parser."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_utils import MODEL, Server, app_server

from ladle.model.tokenizer import Tokenizer
from ladle.server.chat_prompt import chat_prompt
from ladle.server.protocol import ChatMessage

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(message, allowed: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_choices_always_parse(client: openai.OpenAI) -> None:
    for seed in range(6):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=120)
        # one call: at temperature 1 the 135M model may repeat parallel calls past any max_tokens
        required = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw).choices[0]
        assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
        _check_calls(required.message, {"get_weather", "add"})
        named = client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": "add"}}, **kw).choices[0]
        assert named.finish_reason == "tool_calls" and len(named.message.tool_calls) == 1
        _check_calls(named.message, {"add"})
    parallel = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=200).choices[0]
    assert parallel.finish_reason == "tool_calls" and len(parallel.message.tool_calls) >= 1
    _check_calls(parallel.message, {"get_weather", "add"})


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(client: openai.OpenAI, tool_choice) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=200)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta: id, type and name, before any arguments
                    assert d.index not in calls and d.function.name and d.type == "function"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    calls[d.index]["arguments"] += d.function.arguments
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_result_continues_the_conversation(server: Server, client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=30)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens + 10  # the call and its result are in the prompt
    server.wait_idle()


def test_auto_tool_choice_parses_what_the_model_writes(async_engine) -> None:
    """With --tool-call-parser hermes, a reply holding a <tool_call> block comes back as a call. An
    earlier call in the history (rendered by the fallback prompt) makes the 135M model copy the
    convention at temperature 0."""
    rome = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}
    messages = [{"role": "user", "content": "weather in Rome?"}, {"role": "assistant", "tool_calls": [rome]},
                {"role": "user", "content": "weather in Paris?"}]
    with app_server(async_engine, cold=True, tool_call_parser="hermes") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                             max_tokens=60).choices[0]
        assert out.finish_reason == "tool_calls", out
        assert out.message.tool_calls[0].function.name == "get_weather"
        assert json.loads(out.message.tool_calls[0].function.arguments)["city"] == "Paris"
        plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                               tools=[WEATHER], temperature=0, max_tokens=12).choices[0]
        assert plain.message.content and not plain.message.tool_calls


def test_bad_tool_requests_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="auto"), "tool_choice"),  # this server has no --tool-call-parser
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (dict(tools=[{"type": "function", "function": {"name": "x", "parameters": {"type": "wat"}}}],
              tool_choice="required"), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "x"}, "extra": 1}]), "tools[0].extra"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **kw)
        assert err.value.body["param"] == param, (kw, err.value.body)
    # tools with no tool_choice on a server without auto tool choice: "none", the model answers in text
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=5, temperature=0)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


def test_a_tool_aware_template_renders_tools_and_calls_itself(smollm2_dir) -> None:
    template = ("{% for t in tools or [] %}T:{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.role }}:"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
                "{{ m.content }}|{% endfor %}")
    tokenizer = Tokenizer(Tokenizer.from_folder(smollm2_dir).backend, {}, template)
    call = {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", tool_calls=[call]),
                ChatMessage(role="tool", tool_call_id="call_1", content="18 C")]
    assert chat_prompt(tokenizer, messages, tools=[WEATHER]) == \
        "T:get_weather;user:hi|assistant:get_weather(Paris)|tool:18 C|"
