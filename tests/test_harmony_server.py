"""gpt-oss end to end: a tiny random gpt-oss (harmony's special tokens and a harmony chat template,
tests/tiny_models.py) served with --reasoning-parser gpt_oss and --tool-call-parser openai, through
the openai SDK. A random model writes no harmony by itself, so a regex (structured_outputs) makes it
write the messages; the server reads them as it reads a real gpt-oss's."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import MODEL, own_server
from tiny_models import build_tiny_model

from ladle import LLM
from ladle.config import EngineConfig
from ladle.engine.sampling_params import SamplingParams
from ladle.errors import InvalidRequestError
from ladle.reasoning.harmony import MARKERS
from ladle.reasoning.parser import HARMONY_TAGS
from ladle.server.app import create_app
from ladle.server.openai_routes import prepare_chat
from ladle.server.protocol import ChatCompletionRequest
from ladle.tools.harmony import HarmonyParser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK = r"<\|channel\|>analysis<\|message\|>[a-z]{2,8}( [a-z]{2,8}){1,3}<\|end\|>"
CALL = THINK + (r"<\|start\|>assistant<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json"
                r'<\|message\|>\{"city": "(Paris|Rome)"\}')
ANSWER = THINK + r"<\|start\|>assistant<\|channel\|>final<\|message\|>[A-Z][a-z]{2,8}( [a-z]{2,8}){1,3}\."


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), smollm2_dir)


@pytest.fixture(scope="module")
def server(gpt_oss: Path):
    config = EngineConfig(model=str(gpt_oss), reasoning_parser="gpt_oss", num_kv_blocks=64)
    with own_server(config, tool_call_parser="openai") as s:
        yield s


@pytest.fixture(scope="module")
def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def create(sdk: openai.OpenAI, regex: str | None = None, **kw):
    extra = {"structured_outputs": {"regex": regex}} if regex else {}
    return sdk.chat.completions.create(model=MODEL, messages=ASK, **{"temperature": 0, "max_tokens": 160,
                                                                     "extra_body": extra, **kw})


def collect_stream(chunks) -> tuple[str, str, dict[int, dict], str | None]:
    """The reasoning, content and calls (by index) the deltas add up to, and the finish reason."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta: its id and name, before any arguments
                    assert d.index not in calls and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    calls[d.index]["arguments"] += d.function.arguments
    return reasoning, content, calls, finish


def no_markers(*texts: str | None) -> bool:
    return not any(m in (t or "") for m in MARKERS for t in texts)


def test_a_tool_call_whole_and_streamed(sdk: openai.OpenAI) -> None:
    whole = create(sdk, CALL, tools=[WEATHER]).choices[0]
    assert whole.finish_reason == "tool_calls"
    message = whole.message
    assert message.content is None and message.reasoning_content and no_markers(message.reasoning_content)
    [call] = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    reasoning, content, calls, finish = collect_stream(create(sdk, CALL, tools=[WEATHER], stream=True))
    assert (reasoning, content, finish) == (message.reasoning_content, "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_a_final_answer_whole_and_streamed(sdk: openai.OpenAI) -> None:
    whole = create(sdk, ANSWER)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "stop" and not message.tool_calls
    assert message.reasoning_content and message.content.endswith(".")
    assert no_markers(message.reasoning_content, message.content)
    assert 0 < whole.usage.completion_tokens_details.reasoning_tokens < whole.usage.completion_tokens
    reasoning, content, calls, finish = collect_stream(create(sdk, ANSWER, stream=True))
    assert (reasoning, content, calls, finish) == (message.reasoning_content, message.content, {}, "stop")


def test_what_a_random_model_writes_never_shows_a_marker(sdk: openai.OpenAI) -> None:
    for seed in range(3):
        kw = dict(tools=[WEATHER], temperature=1.0, seed=seed, max_tokens=40)
        message = create(sdk, **kw).choices[0].message
        reasoning = getattr(message, "reasoning_content", None)  # left out when the reply did not think
        assert no_markers(message.content, reasoning)
        assert collect_stream(create(sdk, stream=True, **kw))[:2] == (reasoning or "", message.content or "")


def test_the_responses_api_reads_harmony_too(server) -> None:
    body = {"model": MODEL, "input": "What is the weather in Paris?", "max_output_tokens": 24, "temperature": 1.0,
            "reasoning": {"effort": "high"}}
    r = httpx.post(f"{server.base_url}/responses", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete") and no_markers(r.text), r.text
    r = httpx.post(f"{server.base_url}/responses", json={**body, "reasoning": {"effort": "minimal"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text


def test_required_and_named_tool_choices_are_a_grammars_json(sdk: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = create(sdk, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.tool_calls[0].function.name == "get_weather"
        assert "city" in json.loads(out.message.tool_calls[0].function.arguments)


def test_reasoning_effort_is_the_system_messages_reasoning_line(server, sdk: openai.OpenAI) -> None:
    ctx = create_app(server.engine, MODEL, tool_call_parser="openai").state.ctx
    tok = server.engine.tokenizer

    def prompt(**kw) -> str:
        inputs = prepare_chat(ctx, ChatCompletionRequest(messages=ASK, **kw))
        assert inputs.params.thinking_token_budget is None and not inputs.params.skip_special_tokens
        return tok.decode(inputs.prompt_ids, skip_special_tokens=False)

    assert "Reasoning: high\n" in prompt(reasoning_effort="high")
    assert "Reasoning: low\n" in prompt(reasoning_effort="low")
    assert "Reasoning: medium\n" in prompt()  # the template's default
    assert prompt().endswith("<|start|>assistant")
    effort = create(sdk, ANSWER, reasoning_effort="high")  # a level, not a budget: the reply thinks on
    assert effort.usage.prompt_tokens == create(sdk, ANSWER, reasoning_effort="low").usage.prompt_tokens
    assert effort.choices[0].message.reasoning_content and effort.choices[0].message.content


def test_a_calls_result_continues_the_conversation_with_its_thinking(server) -> None:
    ctx = create_app(server.engine, MODEL, tool_call_parser="openai").state.ctx
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*ASK, {"role": "assistant", "tool_calls": [call], "reasoning_content": "Need the weather."},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    inputs = prepare_chat(ctx, ChatCompletionRequest(messages=messages, tools=[WEATHER]))
    text = server.engine.tokenizer.decode(inputs.prompt_ids, skip_special_tokens=False)
    assert ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|><|start|>functions.get_weather '
            "to=assistant<|channel|>commentary<|message|>18 degrees<|end|><|start|>assistant") in text
    assert "namespace functions {" in text and "type get_weather = (_: {\ncity: string,\n}) => any;" in text


def test_bad_harmony_requests_are_400s_naming_the_field(sdk: openai.OpenAI) -> None:
    for kw, param in ((dict(reasoning_effort="minimal"), "reasoning_effort"),
                      (dict(reasoning_effort="low", extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}),
                       "reasoning_effort"),
                      (dict(extra_body={"skip_special_tokens": False}), "skip_special_tokens")):
        with pytest.raises(openai.BadRequestError) as err:
            create(sdk, **kw)
        assert err.value.body["param"] == param, (kw, err.value.body)


def test_a_template_that_does_not_read_the_effort_is_a_400(server) -> None:
    app = create_app(server.engine, MODEL, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(InvalidRequestError) as err:
        prepare_chat(app.state.ctx, ChatCompletionRequest(messages=ASK, reasoning_effort="high"))
    assert err.value.param == "reasoning_effort"


def test_the_openai_tool_parser_needs_the_gpt_oss_reasoning_parser(async_engine) -> None:
    with pytest.raises(ValueError, match="--reasoning-parser gpt_oss"):
        create_app(async_engine, MODEL, tool_call_parser="openai")  # the session's SmolLM2, no reasoning parser


def test_a_spent_budget_opens_the_final_answer(gpt_oss: Path) -> None:
    """The prompt opened the analysis message: after 3 tokens of it the engine writes its end and the
    final message's header, and the model answers there."""
    llm = LLM(str(gpt_oss), reasoning_parser="gpt_oss", num_kv_blocks=16)
    tok = llm.engine.tokenizer
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant" + HARMONY_TAGS.start
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, skip_special_tokens=False,
                            thinking_token_budget=3)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    close = tok.encode(HARMONY_TAGS.close, add_special_tokens=False)
    assert out.num_reasoning_tokens == 3 and out.token_ids[3:3 + len(close)] == close
    parser = HarmonyParser(in_analysis=True)
    parser.feed(out.text)
    parser.finish()
    assert parser.reasoning == tok.decode(out.token_ids[:3], skip_special_tokens=False)
    assert parser.content == tok.decode(out.token_ids[3 + len(close):], skip_special_tokens=False)
