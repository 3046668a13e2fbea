"""gpt-oss's harmony replies, read by the harmony parser: the analysis channel as reasoning, messages to
functions.NAME as calls, the rest as content without a marker; whole replies, and the same replies
streamed one character at a time and cut at random (no model)."""

from __future__ import annotations

import random

import pytest
from test_reasoning_parser import random_splits

from ladle.reasoning.budget import ReasoningSpec
from ladle.reasoning.harmony import MARKERS, Header
from ladle.reasoning.parser import HARMONY_PARSERS, HARMONY_TAGS, THINK_PARSERS, is_harmony, tags_for
from ladle.server.harmony import check_parsers
from ladle.tools.harmony import HarmonyParser
from ladle.tools.parsers import HARMONY_TOOL_PARSERS, make_parser

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
WEATHER = '{"city":"Paris"}'
CASES = [  # (reply, (reasoning_content, content, [(name, arguments)]))
    # the analysis channel, then the final answer (<|return|> ends it when the stop token is shown)
    (f"{ANALYSIS}User asks 2+2. Simple.<|end|>{FINAL}2 + 2 = 4.", ("User asks 2+2. Simple.", "2 + 2 = 4.", [])),
    (f"{ANALYSIS}a<|end|>{FINAL}b<|return|>", ("a", "b", [])),
    (f"{ANALYSIS}still thinking", ("still thinking", "", [])),  # cut by max_tokens: all reasoning
    (f"{ANALYSIS}<|end|>{FINAL}", ("", "", [])),
    # a call: the recipient after the channel, or in the role part of the header
    (f"{ANALYSIS}Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
     f"<|constrain|>json<|message|>{WEATHER}<|call|>", ("Need the weather.", "", [("get_weather", WEATHER)])),
    (f" to=functions.get_weather<|channel|>commentary json<|message|>{WEATHER}",
     (None, "", [("get_weather", WEATHER)])),
    # a preamble (commentary without a recipient) is content; two calls
    ("<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to=functions.get_weather"
     f"<|channel|>commentary json<|message|>{WEATHER}<|call|><|start|>assistant<|channel|>commentary "
     'to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>',
     (None, "Checking both.", [("get_weather", WEATHER), ("add", '{"a": 2, "b": 3}')])),
    ('<|channel|>commentary to=functions.add<|message|>{"a": ', (None, "", [("add", '{"a": ')])),  # as written
    # a built-in tool's call on the analysis channel is reasoning; a recipient outside functions is no call
    ("<|channel|>analysis to=python code<|message|>print(1)<|call|>", ("print(1)", "", [])),
    ("<|channel|>commentary to=browser.search<|message|>q<|call|>", (None, "q", [])),
    # markers: never content, whatever the place
    ("<|channel|>final<|message|>Hello <b>there</b> <| not one |>", (None, "Hello <b>there</b> <| not one |>", [])),
    ("<|channel|>final<|message|>a<|constrain|>b<|message|>c<|end|>\n\n<|end|><|return|>", (None, "abc", [])),
    (f"{ANALYSIS}x<|end|>\n{FINAL}y<|end|> and more", ("x", "y and more", [])),
    (f"{ANALYSIS}think{FINAL}answer", ("think", "answer", [])),  # a new message ends the open one
    (f"{ANALYSIS}think<|channel|>final<|message|>answer", ("think", "answer", [])),
    ("<|channel|>analysis<|mess", (None, "", [])),  # a header cut short
    # a reply that is not harmony (a grammar's JSON, plain text): content as written
    ('{"city": "Paris"}', (None, '{"city": "Paris"}', [])),
    (" to be or not", (None, " to be or not", [])),
    ("<|", (None, "<|", [])),
    ("  \n", (None, "", [])),  # whitespace alone outside messages
    ("", (None, "", [])),
]
PIECES = [*MARKERS, "analysis", "final", "commentary", " to=functions.f", " to=", "json", "x", " ", "\n", "<", "<|",
          "|>", "{}"]


def whole(text: str, calls: bool = True) -> tuple[str | None, str, list[tuple[str, str]]]:
    parser = HarmonyParser(calls)
    parser.feed(text)
    parser.finish()
    reasoning = parser.reasoning if parser.reasoning_started else None
    return reasoning, parser.content, [(c.name, c.arguments) for c in parser.tool_calls()]


def streamed(parts: list[str], calls: bool = True) -> tuple[str, str, list[tuple[str, str]]]:
    """From the events alone: reasoning, content and calls, each call's name before its arguments."""
    parser = HarmonyParser(calls)
    reasoning, content, names, args = "", "", {}, {}
    for events in [parser.feed(part) for part in parts] + [parser.finish()]:
        reasoning, content = reasoning + events.reasoning, content + events.content
        for i, call_id, name in events.started:
            assert i == len(names) and call_id.startswith("call_")
            names[i] = name
        for i, part in events.arguments:
            assert i in names, "arguments came before their call's name"
            args[i] = args.get(i, "") + part
    return reasoning, content, [(names[i], args.get(i, "")) for i in sorted(names)]


@pytest.mark.parametrize("text,want", CASES)
def test_whole_replies(text: str, want: tuple) -> None:
    assert whole(text) == want


@pytest.mark.parametrize("text,want", CASES)
def test_a_stream_one_character_at_a_time_gives_the_whole_replys_parts(text: str, want: tuple) -> None:
    assert streamed(list(text)) == (want[0] or "", want[1], want[2])


@pytest.mark.parametrize("seed", range(4))
def test_streams_cut_at_random_agree_with_the_whole_reply(seed: int) -> None:
    rng = random.Random(seed)
    texts = [text for text, _ in CASES]
    texts += ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 16))) for _ in range(40)]
    for text in texts:
        for calls in (True, False):
            reasoning, content, calls_made = whole(text, calls)
            assert not any(m in content or m in (reasoning or "") for m in MARKERS if m in text), text
            for parts in random_splits(text, rng, n=50):
                assert streamed(parts, calls) == (reasoning or "", content, calls_made), parts


def test_a_stream_holds_back_only_what_may_become_a_marker() -> None:
    parser = HarmonyParser()
    assert parser.feed("<|chan").reasoning == ""
    assert parser.feed("nel|>analysis<|message|>abc<|e").reasoning == "abc"
    events = parser.feed("nd|><|start|>assistant<|channel|>final<|message|>1 < 2 and <")
    assert (events.reasoning, events.content) == ("", "1 < 2 and ")
    assert parser.feed("b>").content == "<b>"
    assert parser.finish().content == ""


def test_a_calls_id_and_name_come_with_its_header_before_any_argument() -> None:
    parser = HarmonyParser()
    events = parser.feed("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>")
    assert [(i, name) for i, _, name in events.started] == [(0, "get_weather")] and not events.arguments
    assert parser.feed('{"city"').arguments == [(0, '{"city"')]
    parser.finish()
    assert parser.tool_calls()[0].id == events.started[0][1]


def test_without_calls_their_text_is_content() -> None:
    text = f"{ANALYSIS}r<|end|><|start|>assistant<|channel|>commentary to=functions.add<|message|>{{}}<|call|>"
    assert whole(text, calls=False) == ("r", "{}", [])


def test_a_reply_continuing_the_prompts_analysis_message() -> None:
    parser = HarmonyParser(in_analysis=True)
    parser.feed(f"more thought<|end|>{FINAL}done")
    parser.finish()
    assert (parser.reasoning, parser.content, parser.reasoning_started) == ("more thought", "done", True)


def test_headers() -> None:
    assert Header.parse("assistant<|channel|>final") == Header("final")
    assert Header.parse("<|channel|>commentary to=functions.get_weather <|constrain|>json").function == "get_weather"
    assert Header.parse(" to=functions.a.b<|channel|>commentary json") == Header("commentary", "functions.a.b")
    assert Header.parse("<|channel|>analysis to=python").function is None
    assert Header.parse("<|channel|>commentary to=functions.").function is None


def test_parser_names() -> None:
    assert {tags_for(name) for name in HARMONY_PARSERS} == {HARMONY_TAGS}
    assert all(is_harmony(name) for name in HARMONY_PARSERS) and not any(map(is_harmony, THINK_PARSERS))
    assert all(isinstance(make_parser(name), HarmonyParser) for name in HARMONY_TOOL_PARSERS)
    accepted = (("gpt_oss", "openai"), ("openai_gptoss", "harmony"), ("gpt_oss", None), ("qwen3", "hermes"))
    for reasoning, tools in accepted:
        check_parsers(reasoning, tools)
    with pytest.raises(ValueError, match="--reasoning-parser gpt_oss"):
        check_parsers(None, "openai")
    with pytest.raises(ValueError, match="--tool-call-parser openai"):
        check_parsers("gpt_oss", "hermes")


def test_the_serve_flags() -> None:
    from test_server_paths import parse

    from ladle.server import cli as serve_cli

    harmony = parse("--reasoning-parser", "gpt_oss", "--enable-auto-tool-choice", "--tool-call-parser", "openai")
    assert serve_cli.auto_tool_call_parser(harmony) == "openai"
    assert serve_cli.run(parse("--enable-auto-tool-choice", "--tool-call-parser", "openai")) == 2  # before loading


def test_a_spent_budget_closes_the_analysis_message_and_opens_the_final_one() -> None:
    class Spelling:  # a tokenizer that spells each character as a token
        @staticmethod
        def encode(text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

    close = "".join(map(chr, ReasoningSpec.of(Spelling(), HARMONY_TAGS).close_token_ids))
    assert close == "<|end|>" + FINAL
    assert whole(ANALYSIS + "thinking" + close + "answer") == ("thinking", "answer", [])
