"""Reasoning models end to end: think blocks split into reasoning_content (whole and streamed),
thinking budgets forced closed by the engine, usage and metrics that agree, and the effort-aware
admission policy. The embedded SmolLM2 is made a reasoning model by a chat template that opens a
think block (as DeepSeek-R1's and Qwen3's do), or by a grammar that makes it write one."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from server_utils import MODEL, own_server

from ladle import LLM
from ladle.config import EngineConfig
from ladle.engine.engine import LLMEngine
from ladle.engine.sampling_params import SamplingParams
from ladle.errors import InvalidRequestError
from ladle.reasoning.parser import split_reasoning
from ladle.structured.spec import StructuredOutputsParams

# Qwen3's convention: the generation prompt opens a think block, or with enable_thinking=False
# writes an empty, closed one.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
THINK_PROMPT = "<|im_start|>user\nWhat is 7 times 8?<|im_end|>\n<|im_start|>assistant\n<think>\n"
QUESTION = [{"role": "user", "content": "What is 7 times 8?"}]
CLOSE = "</think>\n\n"


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), reasoning_parser="deepseek_r1", num_kv_blocks=128)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def generate(llm: LLM, prompt: str, params: SamplingParams):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("budget", [0, 1, 10])
def test_a_budget_of_n_emits_n_reasoning_tokens_then_the_close_then_the_answer(llm: LLM, budget: int) -> None:
    tok = llm.engine.tokenizer
    close = tok.encode(CLOSE, add_special_tokens=False)
    free = generate(llm, THINK_PROMPT, greedy(40))
    assert CLOSE.strip() not in free.text  # unbudgeted, this model never closes the block by itself
    assert free.num_reasoning_tokens == 40
    out = generate(llm, THINK_PROMPT, greedy(40, thinking_token_budget=budget))
    assert out.token_ids[:budget] == free.token_ids[:budget]  # the model's own thinking, up to the budget
    assert out.token_ids[budget : budget + len(close)] == close  # then the engine closes the block
    assert out.num_reasoning_tokens == budget
    assert len(out.token_ids) == 40  # and the model answers after it
    reasoning, content = split_reasoning(out.text, in_reasoning=True)
    assert reasoning == tok.decode(free.token_ids[:budget])
    assert content and content == tok.decode(out.token_ids[budget + len(close) :]).lstrip()


def test_a_block_the_model_writes_is_counted_between_its_tags(llm: LLM) -> None:
    """No block in the prompt: the grammar makes the model open and close one itself."""
    tok = llm.engine.tokenizer
    regex = StructuredOutputsParams(regex=r"<think>[a-z]{1,8}( [a-z]{1,8}){2,5}</think>\n\n[A-Z][a-z]{1,8}( [a-z]{1,8}){1,4}\.")
    prompt = "<|im_start|>user\nWhat is 7 times 8?<|im_end|>\n<|im_start|>assistant\n"
    out = generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=regex))
    reasoning, content = split_reasoning(out.text, in_reasoning=False)
    assert reasoning and content
    # independently: the tokens whose text begins after "<think>" and before "</think>"
    starts = [len(tok.decode(out.token_ids[:i])) for i in range(len(out.token_ids))]
    opened, closed = out.text.index("<think>") + len("<think>"), out.text.index("</think>")
    inside = [s for s in starts if opened <= s < closed]
    assert out.num_reasoning_tokens == len(inside) > 0


def test_budgets_are_refused_without_a_reasoning_parser_or_with_a_grammar(smollm2_dir: Path) -> None:
    plain = LLM(str(smollm2_dir), num_kv_blocks=32)
    with pytest.raises(InvalidRequestError) as e:
        plain.generate([THINK_PROMPT], greedy(4, thinking_token_budget=2), use_tqdm=False)
    assert e.value.param == "thinking_token_budget"
    with pytest.raises(InvalidRequestError) as e:
        greedy(4, thinking_token_budget=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    assert e.value.param == "thinking_token_budget"
    with pytest.raises(InvalidRequestError):
        greedy(4, thinking_token_budget=-1)


def test_a_server_default_budget_applies_to_requests_without_one(smollm2_dir: Path) -> None:
    llm = LLM(str(smollm2_dir), reasoning_parser="qwen3", thinking_token_budget=5, num_kv_blocks=64)
    assert generate(llm, THINK_PROMPT, greedy(20)).num_reasoning_tokens == 5
    assert generate(llm, THINK_PROMPT, greedy(20, thinking_token_budget=7)).num_reasoning_tokens == 7


# -- effort-aware admission ---------------------------------------------------------


def admitted(smollm2_dir: Path, cap: int, max_num_seqs: int = 3) -> list[str]:
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), num_kv_blocks=64, max_num_seqs=max_num_seqs,
                                    max_high_effort_seqs=cap, high_effort_tokens=64))
    for i in range(3):
        engine.add_request(f"long-{i}", "Think hard about", greedy(200))
    engine.add_request("short", "Say hi", greedy(8))
    engine.step()
    return sorted(s.request_id for s in engine.scheduler.running)


def test_high_effort_sequences_are_capped_and_short_ones_go_first(smollm2_dir: Path) -> None:
    assert admitted(smollm2_dir, cap=0) == ["long-0", "long-1", "long-2"]  # off: first come, first served
    assert admitted(smollm2_dir, cap=1) == ["long-0", "short"]  # a slot stays free rather than a second long
    assert admitted(smollm2_dir, cap=2, max_num_seqs=2) == ["long-0", "short"]  # the short one goes first


# -- the server, through the openai SDK ---------------------------------------------


@pytest.fixture(scope="module")
def thinking_server(smollm2_dir: Path):
    config = EngineConfig(model=str(smollm2_dir), reasoning_parser="qwen3", num_kv_blocks=256)
    with own_server(config, chat_template=THINK_TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(thinking_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=thinking_server.base_url, api_key="none", max_retries=0)


def ask(sdk: openai.OpenAI, **kw):
    return sdk.chat.completions.create(model=MODEL, messages=QUESTION, **{"temperature": 0, "max_tokens": 30, **kw})


def test_reasoning_content_and_usage_through_the_sdk(sdk: openai.OpenAI, thinking_server) -> None:
    before = thinking_server.scrape().get("ladle:reasoning_tokens_total", 0.0)
    r = ask(sdk, extra_body={"thinking_token_budget": 8})
    message = r.choices[0].message
    assert message.reasoning_content and message.content
    assert "<think>" not in message.content and "</think>" not in message.reasoning_content
    assert r.usage.completion_tokens_details.reasoning_tokens == 8
    close = len(thinking_server.engine.tokenizer.encode(CLOSE, add_special_tokens=False))
    assert r.usage.completion_tokens > 8 + close  # the thinking, the forced close, then an answer
    assert thinking_server.scrape()["ladle:reasoning_tokens_total"] == before + 8


def test_streamed_reasoning_equals_the_whole_reply(sdk: openai.OpenAI) -> None:
    whole = ask(sdk, extra_body={"thinking_token_budget": 8})
    reasoning, content, usage = "", "", None
    for chunk in ask(sdk, extra_body={"thinking_token_budget": 8}, stream=True,
                     stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert reasoning == whole.choices[0].message.reasoning_content
    assert content == whole.choices[0].message.content
    assert usage.completion_tokens_details.reasoning_tokens == 8


def test_reasoning_effort_maps_to_a_budget(sdk: openai.OpenAI) -> None:
    r = ask(sdk, reasoning_effort="none")
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert r.choices[0].message.content
    low = ask(sdk, reasoning_effort="low", max_tokens=12, extra_body={"ignore_eos": True})  # 256 tokens of budget: never reached here
    assert low.usage.completion_tokens_details.reasoning_tokens == 12
    assert low.choices[0].message.content is None  # still thinking when max_tokens ran out


def test_enable_thinking_false_leaves_the_reply_all_content(sdk: openai.OpenAI) -> None:
    r = ask(sdk, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_budget_fields_are_checked(thinking_server, server) -> None:
    def post(url: str, **body) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4, **body})

    for url, body, param in (
        (server.url, {"thinking_token_budget": 4}, "thinking_token_budget"),  # no --reasoning-parser
        (server.url, {"reasoning_effort": "low"}, "reasoning_effort"),
        (thinking_server.url, {"thinking_token_budget": -1}, "thinking_token_budget"),
        (thinking_server.url, {"reasoning_effort": "low", "thinking_token_budget": 3}, "thinking_token_budget"),
        (thinking_server.url, {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ):
        r = post(url, **body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)


def test_the_responses_api_leaves_the_think_block_out_and_counts_it(thinking_server) -> None:
    def respond(**kw) -> dict:
        body = {"model": MODEL, "input": "What is 7 times 8?", "max_output_tokens": 16, "temperature": 0, **kw}
        return httpx.post(f"{thinking_server.base_url}/responses", json=body, timeout=60).json()

    def text(r: dict) -> str:
        return "".join(p["text"] for item in r["output"] if item["type"] == "message" for p in item["content"])

    thinking = respond()  # the whole reply stays in its think block: no answer text, all reasoning
    usage = thinking["usage"]
    assert text(thinking) == "" and usage["output_tokens_details"]["reasoning_tokens"] >= usage["output_tokens"] - 1
    quick = respond(reasoning={"effort": "none"})  # closed at once: the answer, without the tags
    assert text(quick) and "think>" not in text(quick)
    assert quick["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    assert quick["reasoning"] == {"effort": "none", "summary": None}
