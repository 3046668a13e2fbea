"""Tool-call parsers and the fallback tool prompt, on texts written here (no model)."""

from __future__ import annotations

import json

import pytest

from ladle.tools import prompt
from ladle.tools.parsers import HermesParser, Llama3JsonParser, NamedParser, RequiredParser, ToolParser

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"days": [1, {"note": "a } and a \\" inside"}]}}\n</tool_call>\n'
          '<tool_call>{"arguments": "{\\"x\\": 1}", "name": "add"}</tool_call>')
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "add", "parameters": {"x": 2}}'


def _streamed(parser: ToolParser, text: str, piece: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed text in pieces of `piece` characters; (content, [(name, arguments)]) from the events alone."""
    content, names, args = "", {}, {}
    events = [parser.feed(text[i:i + piece]) for i in range(0, len(text), piece)] + [parser.finish()]
    for e in events:
        content += e.content
        for i, _, name in e.started:
            names[i] = name
        for i, part in e.arguments:
            assert i in names, "arguments came before their call's name"
            args[i] = args.get(i, "") + part
    return content, [(names[i], args.get(i, "")) for i in sorted(names)]


def _whole(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, str]] | None]:
    parser.feed(text)
    parser.finish()
    calls = parser.tool_calls()
    return parser.content, None if calls is None else [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_hermes_streamed_in_any_pieces_equals_whole(piece: int) -> None:
    content, calls = _whole(HermesParser(), HERMES)
    assert content.strip() == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris", "days": [1, {"note": "a } and a \\" inside"}]}'),
                     ("add", '{"x": 1}')]
    assert json.loads(calls[0][1])["days"][1]["note"] == 'a } and a " inside'
    streamed_content, streamed_calls = _streamed(HermesParser(), HERMES, piece)
    assert streamed_calls == calls
    assert streamed_content == content


def test_hermes_holds_back_a_partial_tag_and_releases_plain_text() -> None:
    p = HermesParser()
    assert p.feed("Hello <tool").content == "Hello "
    assert p.feed("box>").content == "<toolbox>"
    assert p.finish().content == ""
    assert p.tool_calls() == []


def test_unparseable_call_means_content() -> None:
    assert _whole(HermesParser(), '<tool_call>{"name": "f", "arguments": {"x": </tool_call>')[1] is None
    assert _whole(HermesParser(), '<tool_call>{"arguments": {}}</tool_call>')[1] is None


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_llama3_json(piece: int) -> None:
    content, calls = _whole(Llama3JsonParser(), LLAMA3)
    assert content == "" and calls == [("get_weather", '{"city": "Oslo"}'), ("add", '{"x": 2}')]
    assert _streamed(Llama3JsonParser(), LLAMA3, piece)[1] == calls
    assert _whole(Llama3JsonParser(), "  It is sunny {not a call}") == ("  It is sunny {not a call}", [])
    assert _streamed(Llama3JsonParser(), "<|python", piece)[0] == "<|python"


def test_required_and_named_parsers() -> None:
    text = '[{"name": "add", "parameters": {"x": 1, "y": [2]}}, {"name": "neg", "parameters": {}}]'
    assert _whole(RequiredParser(), text)[1] == [("add", '{"x": 1, "y": [2]}'), ("neg", "{}")]
    assert _streamed(RequiredParser(), text, 2)[1] == [("add", '{"x": 1, "y": [2]}'), ("neg", "{}")]
    assert _whole(NamedParser("add"), '{"x": 1}')[1] == [("add", '{"x": 1}')]
    assert _streamed(NamedParser("add"), '{"x": 1}', 1)[1] == [("add", '{"x": 1}')]
    assert _whole(NamedParser("add"), '{"x": ')[1] is None  # cut by max_tokens: not a call


def test_fallback_prompt_renders_tools_calls_and_results() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    out = prompt.fallback(messages, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert json.dumps(tools[0]) in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    # the assistant's call, parsed back by the hermes parser, is the call it was
    assert _whole(HermesParser(), out[2]["content"])[1] == [("get_weather", '{"city": "Paris"}')]
    templated = prompt.for_template(messages)
    assert templated[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert prompt.template_knows_tools("{% if tools %}x{% endif %}") and not prompt.template_knows_tools("{{ x }}")
