"""Request fields (issue 39): each vLLM field ladle serves, against an independent reference
(transformers on the same model, its tokenizer, or vLLM's rule written out here); every other
field refused with a 400 naming it; and every field the request models accept decided: it
changes the result (a test below or elsewhere shows it), or it is metadata that changes nothing.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from conftest import VOCAB, Tiny  # the tiny 64-token model (fixture `tiny`)
from sampling_refs import chi_square_p
from server_utils import GREEDY, HELLO, MODEL, Server, ServerThread, chat, own_server

from ladle import LLM, SamplingParams
from ladle.config import EngineConfig
from ladle.errors import InvalidRequestError
from ladle.server.app import create_app
from ladle.server.chat_prompt import REPLY_ONLY
from ladle.server.constraints import tool_plan_of
from ladle.server.protocol import (
    METADATA_FIELDS, NO_EFFECT_FIELDS, ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
    StreamOptions, TokenizeRequest,
)

TESTS = Path(__file__).parent
PROMPT = [t for t in range(17, VOCAB) if t % 3]  # 31 distinct printable tokens of the tiny model
P_MIN = 1e-4  # chi-square p-value floor: a correct sampler fails it once in 10,000 seeds
TINY_CONTEXT = 64


@pytest.fixture(scope="module")
def tiny_server(tiny: Tiny) -> Iterator[Server]:
    with own_server(EngineConfig(model=str(tiny[0]), dtype="float32", max_model_len=TINY_CONTEXT,
                                 max_num_seqs=128, num_kv_blocks=600)) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_llm(tiny: Tiny) -> LLM:
    return LLM(str(tiny[0]), dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_tok(smollm2_dir: Path):
    """transformers' tokenizer of the default model (the tiny model has the same one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    """path: under /v1 (/chat/completions, /completions, /responses), else from the root (/tokenize)."""
    v1 = path.startswith(("/chat/", "/completions", "/responses"))
    return httpx.post(f"{server.base_url if v1 else server.url}{path}", json=body, timeout=120)


def ok(server: Server, path: str, **body: Any) -> dict:
    r = post(server, path, {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(server: Server, path: str, body: dict[str, Any]) -> dict:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def ref_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """float64 logits [len(ids), VOCAB]: row i predicts the token after ids[: i + 1]."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].double()


def token_ids_of(choice: dict, hf_tok) -> list[int]:
    """A tiny-model completion's tokens (logprobs' token texts; the 64 texts are distinct)."""
    names = {hf_tok.decode([i]): i for i in range(VOCAB)}
    return [names[t] for t in choice["logprobs"]["tokens"]]


# -- refused fields ----------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "Hi", "max_tokens": 2}
BOTH = ("/chat/completions", "/completions")
# vLLM's request and sampling fields that ladle does not serve, each with a value that would change
# the result. Listed from vLLM's main branch as read for issue 39: SamplingParams
# (vllm/sampling_params.py), ChatCompletionRequest (vllm/entrypoints/openai/chat_completion/protocol.py)
# and CompletionRequest (vllm/entrypoints/openai/completion/protocol.py), older names included
# (guided_whitespace_pattern, structural_tag).
VLLM_UNSERVED: list[tuple[tuple[str, ...], str, Any]] = [
    (BOTH, "use_beam_search", True),
    (BOTH, "length_penalty", 0.5),
    (BOTH, "logit_bias", {"15": 5}),
    (BOTH, "logits_processors", ["my_module.MyLogitsProcessor"]),
    (BOTH, "return_tokens_as_token_ids", True),
    (BOTH, "return_token_ids", True),
    (BOTH, "cache_salt", "a-salt"),
    (BOTH, "vllm_xargs", {"k": 1}),
    (BOTH, "max_repetition_pattern_size", 4),
    (BOTH, "min_repetition_pattern_size", 2),
    (BOTH, "repetition_min_count", 3),
    (BOTH, "mm_processor_kwargs", {"k": 1}),
    (BOTH, "guided_whitespace_pattern", " "),
    (BOTH, "structural_tag", "{}"),
    (BOTH, "best_of", 3),
    (("/chat/completions",), "echo", True),  # /v1/completions serves it
    (("/chat/completions",), "add_special_tokens", True),  # /v1/completions serves it
    (("/chat/completions",), "documents", [{"title": "t", "text": "x"}]),
    (("/chat/completions",), "chat_template", "{{ messages }}"),
    (("/chat/completions",), "include_reasoning", False),
    (("/completions",), "prompt_embeds", "AAAA"),
    (("/completions",), "suffix", " the end"),
    # SamplingParams fields the HTTP API never took
    (BOTH, "prompt_logprob_token_ids", [5]),
    (BOTH, "prompt_logprob_start", 1),
    (BOTH, "logprob_token_ids", [5]),
    (BOTH, "flat_logprobs", True),
    (BOTH, "detokenize", False),
    (BOTH, "output_kind", 1),
    (BOTH, "stream_interval", 2),
    (BOTH, "skip_clone", True),
    (BOTH, "extra_args", {"k": 1}),
    (BOTH, "skip_reading_prefix_cache", True),
    (BOTH, "repetition_detection", {"max_pattern_size": 4, "min_count": 2}),
    (BOTH, "routed_experts_prompt_start", 1),
    (BOTH, "trace_decode_token_ids", [5]),
]
# OpenAI's fields that ladle does not serve, and a typo
OPENAI_UNSERVED: list[tuple[tuple[str, ...], str, Any]] = [
    (("/chat/completions",), "functions", [{"name": "f", "parameters": {"type": "object"}}]),
    (("/chat/completions",), "function_call", "auto"),
    (("/chat/completions",), "audio", {"voice": "alloy", "format": "wav"}),
    (("/chat/completions",), "modalities", ["text", "audio"]),
    (("/chat/completions",), "verbosity", "low"),
    (("/chat/completions",), "web_search_options", {}),
    (("/chat/completions",), "moderation", {}),
    (("/chat/completions",), "prompt_cache_options", {}),
    (BOTH, "max_token", 5),
]
CASES = [(route, field, value) for routes, field, value in VLLM_UNSERVED + OPENAI_UNSERVED for route in routes]


@pytest.mark.parametrize("route,field,value", CASES, ids=[f"{'chat' if r.startswith('/chat') else 'completions'}-{f}" for r, f, _ in CASES])
def test_unserved_fields_are_refused_naming_them(server: Server, route: str, field: str, value: Any) -> None:
    body = {"model": MODEL, **(CHAT if route.startswith("/chat") else COMPLETION), field: value}
    error = refused(server, route, body)
    assert error["param"] == field and field in error["message"], error


def test_spaces_between_special_tokens_false_is_refused_where_it_would_show(server: Server) -> None:
    """vLLM's default (true) is what ladle does; false only matters while special tokens are shown."""
    body = {"model": MODEL, **CHAT, "spaces_between_special_tokens": False}
    ok(server, "/chat/completions", **body)
    error = refused(server, "/chat/completions", {**body, "skip_special_tokens": False})
    assert error["param"] == "spaces_between_special_tokens"


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "Hi", "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"messages": HELLO, "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
    ("/tokenize", {"prompt": "Hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": False}, "skip_special_tokens"),
    ("/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Hi", "cache_control": {}}]},
     "messages[0].cache_control"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "x": 1}]}]},
     "messages[0].content[0].x"),
    ("/chat/completions", {"messages": [{"role": "assistant", "content": "no", "refusal": "I can't"},
                                        {"role": "user", "content": "Hi"}]}, "messages[0].refusal"),
    ("/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
     "tools[0].function.x"),
    ("/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi", "x": 1}]}]},
     "input[0].content[0].x"),
])
def test_unknown_fields_of_other_routes_and_sub_objects_are_refused(server: Server, path: str, body: dict,
                                                                    param: str) -> None:
    error = refused(server, path, {"model": MODEL, **body})
    assert error["param"] == param and param in error["message"], error


def test_a_reply_echoed_back_is_accepted(server: Server, client: openai.OpenAI) -> None:
    """What an OpenAI or vLLM reply carries, sent back as history, null where ladle has nothing to do."""
    reply = chat(client, max_tokens=4).choices[0].message
    echoed = {**reply.model_dump(), "refusal": None, "annotations": None, "audio": None, "function_call": None}
    assert chat(client, HELLO + [echoed, {"role": "user", "content": "Again."}], max_tokens=2).choices
    answer = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4).output[0]
    again = client.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": "Hi"}, answer.model_dump(exclude_unset=True), {"role": "user", "content": "Again."}])
    assert again.output


# -- every accepted field decided -----------------------------------------------------------------------

# Each field the request models accept that changes the result -> a test that shows it does.
COVERED = {
    # sampling, shared by chat and completions
    "model": "test_server.py::test_unknown_model_and_unknown_route_are_not_found",
    "n": "test_server.py::test_n_and_seed",
    "seed": "test_server.py::test_n_and_seed",
    "stop": "test_server.py::test_stop_string_and_length",
    "stop_token_ids": "test_sampling.py::test_stop_token_ids_and_length",
    "max_tokens": "test_server.py::test_stop_string_and_length",
    "temperature": "test_sampling_semantics.py::test_temperature_samples_softmax_of_scaled_logits",
    "top_p": "test_sampling_semantics.py::test_filters_keep_exactly_the_allowed_tokens",
    "top_k": "test_sampling_semantics.py::test_filters_keep_exactly_the_allowed_tokens",
    "min_p": "test_sampling_semantics.py::test_filters_keep_exactly_the_allowed_tokens",
    "presence_penalty": "test_sampling_semantics.py::test_penalised_greedy_choices_follow_the_formula",
    "frequency_penalty": "test_sampling_semantics.py::test_penalised_greedy_choices_follow_the_formula",
    "repetition_penalty": "test_sampling_semantics.py::test_repetition_penalty_reshapes_the_distribution",
    "stream": "test_streaming.py::test_streaming_chat_equals_non_streamed",
    "stream_options": "test_streaming.py::test_stream_without_include_usage_has_no_usage_chunk",
    "ignore_eos": "test_server.py::test_stop_string_and_length",
    "min_tokens": "test_request_fields.py::test_min_tokens_holds_off_the_end",
    "skip_special_tokens": "test_request_fields.py::test_skip_special_tokens_false_shows_them",
    "include_stop_str_in_output": "test_request_fields.py::test_include_stop_str_in_output_cuts_after_the_stop_string",
    "truncate_prompt_tokens": "test_request_fields.py::test_truncate_prompt_tokens_keeps_the_last_tokens",
    "allowed_token_ids": "test_request_fields.py::test_allowed_token_ids_greedy_choices_and_raw_logprobs",
    "bad_words": "test_request_fields.py::test_bad_words_greedy_choices_follow_the_rule",
    "prompt_logprobs": "test_request_fields.py::test_prompt_logprobs_match_transformers",
    "priority": "test_admission.py::test_high_priority_arrival_into_a_full_server_finishes_before_the_running_low_ones",
    "request_id": "test_voice_turns.py::"
                  "test_a_draft_cancelled_by_its_request_id_ends_with_abort_and_its_prompt_serves_the_follow_up",
    "include_timings": "test_voice_turns.py::test_timings_are_opt_in_and_add_up",
    "kv_transfer_params": "test_disaggregated.py::test_decode_worker_continues_from_the_transferred_kv",
    "thinking_token_budget": "test_reasoning.py::"
                             "test_a_budget_of_n_emits_n_reasoning_tokens_then_the_close_then_the_answer",
    "response_format": "test_structured.py::test_json_schema_outputs_validate_for_50_seeded_requests",
    "structured_outputs": "test_structured.py::test_choice_regex_and_grammar_always_match",
    "guided_json": "test_request_fields.py::test_guided_json_and_guided_grammar_constrain_the_output",
    "guided_regex": "test_structured.py::test_n_streaming_logprobs_and_stop",
    "guided_choice": "test_structured.py::test_choice_regex_and_grammar_always_match",
    "guided_grammar": "test_request_fields.py::test_guided_json_and_guided_grammar_constrain_the_output",
    # chat
    "messages": "test_server.py::test_chat",
    "max_completion_tokens": "test_streaming.py::test_streaming_chat_equals_non_streamed",
    "logprobs": "test_server.py::test_chat_logprobs",
    "top_logprobs": "test_server.py::test_chat_logprobs",
    "tools": "test_tool_calling.py::test_required_and_named_choices_always_parse",
    "tool_choice": "test_tool_calling.py::test_required_and_named_choices_always_parse",
    "parallel_tool_calls": "test_tool_calling.py::test_required_and_named_choices_always_parse",
    "reasoning_effort": "test_reasoning.py::test_reasoning_effort_maps_to_a_budget",
    "add_generation_prompt": "test_server.py::test_continue_final_message",
    "continue_final_message": "test_server.py::test_continue_final_message",
    "chat_template_kwargs": "test_reasoning.py::test_enable_thinking_false_leaves_the_reply_all_content",
    # completions
    "prompt": "test_server.py::test_completions_with_logprobs_and_echo",
    "echo": "test_server.py::test_completions_with_logprobs_and_echo",
    "add_special_tokens": "test_loader.py::test_tokenizer_basics_match_transformers",
    # tokenize, detokenize
    "return_token_strs": "test_server.py::test_tokenize_detokenize",
    "tokens": "test_server.py::test_tokenize_detokenize",
    # messages, stream_options
    "role": "test_server.py::test_chat",
    "content": "test_server.py::test_chat_content_parts_equal_string_content",
    "name": "test_request_fields.py::test_tokenize_renders_tools_reasoning_and_names_as_transformers",
    "tool_calls": "test_tool_calling.py::test_tool_result_continues_the_conversation",
    "tool_call_id": "test_tool_calling.py::test_tool_result_continues_the_conversation",
    "reasoning_content": "test_request_fields.py::test_tokenize_renders_tools_reasoning_and_names_as_transformers",
    "reasoning": "test_request_fields.py::test_tokenize_renders_tools_reasoning_and_names_as_transformers",
    "include_usage": "test_streaming.py::test_stream_without_include_usage_has_no_usage_chunk",
    "continuous_usage_stats": "test_streaming.py::test_continuous_usage_stats_chat",
}
REQUEST_MODELS = [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, ChatMessage,
                  StreamOptions]


def _test_exists(ref: str) -> bool:
    file, name = ref.split("::")
    tree = ast.parse((TESTS / file).read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


@pytest.mark.parametrize("model", REQUEST_MODELS, ids=lambda m: m.__name__)
def test_every_accepted_field_is_decided(model) -> None:
    """A field added to a request model fails here until it is shown to change the result (COVERED),
    or is metadata that changes nothing (METADATA_FIELDS), or is taken only at its no-effect value."""
    undecided = set(model.model_fields) - METADATA_FIELDS - NO_EFFECT_FIELDS - set(REPLY_ONLY) - COVERED.keys()
    assert not undecided, f"{model.__name__} accepts {sorted(undecided)} without a decision"
    assert model.model_config["extra"] == "forbid"
    for field in set(model.model_fields) & COVERED.keys():
        assert _test_exists(COVERED[field]), f"{field}: no test {COVERED[field]}"


def test_metadata_changes_nothing(client: openai.OpenAI) -> None:
    plain = chat(client, max_tokens=8).choices[0].message.content
    metadata = dict(user="u-1", store=True, service_tier="flex", metadata={"team": "x"}, safety_identifier="s",
                    prompt_cache_key="k", prompt_cache_retention="24h",
                    prediction={"type": "content", "content": "Hello there"})
    assert set(metadata) | {"include_obfuscation"} == METADATA_FIELDS
    assert chat(client, max_tokens=8, **metadata).choices[0].message.content == plain
    streamed = chat(client, max_tokens=8, stream=True, stream_options={"include_obfuscation": True}, **metadata)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain


# -- truncate_prompt_tokens -------------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: Server, hf_tok) -> None:
    """A text prompt keeps its last N tokens as transformers truncates on the left (vLLM's
    tokenizer setting), and is served as that token prompt would be; a chat prompt likewise."""
    text = "The quick brown fox jumps over the lazy dog, and then the capital of France is"
    hf_tok.truncation_side = "left"
    kept = hf_tok(text, truncation=True, max_length=6)["input_ids"]
    assert len(kept) == 6
    cut = ok(server, "/completions", prompt=text, truncate_prompt_tokens=6, max_tokens=5, echo=True, **GREEDY)
    as_ids = ok(server, "/completions", prompt=kept, max_tokens=5, **GREEDY)
    assert cut["usage"]["prompt_tokens"] == 6
    assert cut["choices"][0]["text"] == hf_tok.decode(kept) + as_ids["choices"][0]["text"]
    rendered = hf_tok.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    last = hf_tok(rendered, add_special_tokens=False)["input_ids"][-7:]
    chat_cut = ok(server, "/chat/completions", messages=HELLO, truncate_prompt_tokens=7, max_tokens=5, **GREEDY)
    assert chat_cut["usage"]["prompt_tokens"] == 7
    assert chat_cut["choices"][0]["message"]["content"] == \
        ok(server, "/completions", prompt=last, max_tokens=5, **GREEDY)["choices"][0]["text"]


def test_truncation_keeps_the_special_tokens_a_tokenizer_adds(smollm2_dir: Path, tmp_path: Path) -> None:
    """With a tokenizer that adds a BOS, the last N tokens are the BOS and the text's last N - 1, as
    transformers truncates on the left (and so vLLM, for text prompts)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from ladle.model.tokenizer import Tokenizer

    backend = Backend.from_file(str(smollm2_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                           special_tokens=[("<|endoftext|>", 0)])
    backend.save(str(tmp_path / "tokenizer.json"))
    text = "The quick brown fox jumps over the lazy dog"
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), truncation_side="left")
    ours = Tokenizer.from_folder(tmp_path)
    for keep in (3, 5, 100):
        expected = hf(text, truncation=True, max_length=keep)["input_ids"]
        assert expected[0] == 0 and ours.encode(text, add_special_tokens=True, keep_last=keep) == expected
    assert ours.encode(text, keep_last=3) == hf(text, add_special_tokens=False)["input_ids"][-3:]


def test_truncate_prompt_tokens_minus_one_and_its_limit(tiny_server: Server) -> None:
    """vLLM's rules: -1 keeps what the context leaves after max_tokens; more than that is refused;
    token prompts keep ids[-N:]."""
    ids = (PROMPT * 3)[:80]  # longer than the context
    room = TINY_CONTEXT - 4
    whole = ok(tiny_server, "/completions", prompt=ids, truncate_prompt_tokens=-1, max_tokens=4, logprobs=0, **GREEDY)
    assert whole["usage"]["prompt_tokens"] == room
    same = ok(tiny_server, "/completions", prompt=ids[-room:], max_tokens=4, logprobs=0, **GREEDY)
    assert whole["choices"][0]["logprobs"]["tokens"] == same["choices"][0]["logprobs"]["tokens"]
    assert whole["choices"][0]["logprobs"]["token_logprobs"] == \
        pytest.approx(same["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    for keep, status in [(room, 200), (room + 1, 400), (0, 400), (-2, 400)]:
        r = post(tiny_server, "/completions", {"prompt": ids, "truncate_prompt_tokens": keep, "max_tokens": 4})
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["param"] == "truncate_prompt_tokens"
    assert post(tiny_server, "/completions", {"prompt": ids, "max_tokens": 4}).status_code == 400  # over the context


# -- allowed_token_ids ----------------------------------------------------------------------------


def test_allowed_token_ids_greedy_choices_and_raw_logprobs(tiny: Tiny, tiny_server: Server, hf_tok) -> None:
    """Every greedy choice is the reference's argmax over the allowed tokens; the logprobs are the
    model's over the whole vocabulary (vLLM's raw_logprobs), not renormalised over the allowed."""
    z0 = ref_logits(tiny[1], PROMPT)[-1]
    allowed = z0.argsort(descending=True)[3:11].tolist()  # the three most likely are not allowed
    choice = ok(tiny_server, "/completions", prompt=PROMPT, allowed_token_ids=allowed, max_tokens=12, logprobs=2,
                ignore_eos=True, **GREEDY)["choices"][0]
    out = token_ids_of(choice, hf_tok)
    z = ref_logits(tiny[1], PROMPT + out)[len(PROMPT) - 1 :]
    for k, token in enumerate(out):
        assert token in allowed and z[k][token] >= z[k][allowed].max() - 1e-4, f"step {k}"
    raw = torch.log_softmax(z[: len(out)], -1)
    reported = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
    assert torch.allclose(reported, raw[range(len(out)), out], atol=1e-4)
    top = [max(entry.values()) for entry in choice["logprobs"]["top_logprobs"]]
    assert top == pytest.approx(raw.max(-1).values.tolist(), abs=1e-4)  # the most likely token, allowed or not


def test_allowed_token_ids_sample_the_restricted_distribution(tiny: Tiny, tiny_server: Server, hf_tok) -> None:
    z = ref_logits(tiny[1], PROMPT)[-1]
    allowed = z.argsort(descending=True)[2:8].tolist()
    bodies = [dict(prompt=PROMPT, allowed_token_ids=allowed, max_tokens=1, n=128, seed=128 * i, temperature=1.0,
                   logprobs=0, ignore_eos=True) for i in range(8)]
    tokens = [token_ids_of(c, hf_tok)[0] for body in bodies for c in ok(tiny_server, "/completions", **body)["choices"]]
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    expected[allowed] = z[allowed].softmax(-1)
    assert set(tokens) <= set(allowed)
    assert chi_square_p(torch.bincount(torch.tensor(tokens), minlength=VOCAB), expected) > P_MIN


def test_allowed_token_ids_must_be_in_the_vocabulary(tiny_server: Server) -> None:
    for ids in ([VOCAB], [], [-1]):
        error = refused(tiny_server, "/completions", {"prompt": PROMPT, "allowed_token_ids": ids})
        assert error["param"] == "allowed_token_ids"


# -- bad_words ------------------------------------------------------------------------------------


def bad_word_sequences(hf_tok, words: list[str], vocab: int) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word, and the word after a space where that gives a new
    first token and as many tokens; sequences a model of this vocabulary cannot generate need no ban."""
    out = []
    for word in words:
        alone = hf_tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = hf_tok.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return [s for s in out if max(s) < vocab]


def banned_after(sequences: list[list[int]], output: list[int]) -> set[int]:
    """vLLM's rule: a word's last token is banned where the output so far ends with the rest of it."""
    return {s[-1] for s in sequences if len(s) - 1 <= len(output) and output[len(output) - len(s) + 1 :] == s[:-1]}


def test_bad_words_greedy_choices_follow_the_rule(tiny: Tiny, tiny_server: Server, hf_tok) -> None:
    """Words picked from transformers' own greedy continuation: one token everywhere, and a
    two-token word whose second token may follow anything but its first."""
    ref_out: list[int] = []
    for _ in range(24):
        ref_out.append(int(ref_logits(tiny[1], PROMPT + ref_out)[-1].argmax()))
    single = Counter(ref_out).most_common(1)[0][0]
    pair = next(((a, b) for a, b in zip(ref_out, ref_out[1:]) if single not in (a, b)
                 and hf_tok.encode(hf_tok.decode([a, b]), add_special_tokens=False) == [a, b]), None)
    assert pair is not None, f"no two-token word in {ref_out}"
    words = [hf_tok.decode([single]), hf_tok.decode(list(pair))]
    sequences = bad_word_sequences(hf_tok, words, VOCAB)
    assert [single] in sequences and list(pair) in sequences
    choice = ok(tiny_server, "/completions", prompt=PROMPT, bad_words=words, max_tokens=24, logprobs=0,
                ignore_eos=True, **GREEDY)["choices"][0]
    out = token_ids_of(choice, hf_tok)
    z = ref_logits(tiny[1], PROMPT + out)[len(PROMPT) - 1 :]
    changed = 0
    for k, token in enumerate(out):
        banned = banned_after(sequences, out[:k])
        scores = z[k].clone()
        scores[list(banned)] = float("-inf")
        assert token not in banned and scores[token] >= scores.max() - 1e-4, f"step {k}"
        changed += int(int(z[k].argmax()) in banned)
    assert changed >= 1 and single not in out


def test_bad_words_ban_a_word_and_its_spaced_form(server: Server, hf_tok) -> None:
    prompt = "The capital of France is"
    plain = ok(server, "/completions", prompt=prompt, max_tokens=6, **GREEDY)["choices"][0]["text"]
    assert "Paris" in plain  # what the ban has to change
    # the rule bans the word's spaced form (what follows "is") where it is as many tokens as the word alone
    spaced, alone = (hf_tok.encode(w, add_special_tokens=False) for w in (" Paris", "Paris"))
    assert len(spaced) == len(alone) and spaced[0] != alone[0]
    text = ok(server, "/completions", prompt=prompt, max_tokens=6, bad_words=["Paris"], **GREEDY)["choices"][0]["text"]
    assert "Paris" not in text
    assert refused(server, "/completions", {"prompt": prompt, "bad_words": [" "]})["param"] == "bad_words"


# -- prompt_logprobs -------------------------------------------------------------------------------


def test_prompt_logprobs_match_transformers(tiny: Tiny, tiny_server: Server, hf_tok) -> None:
    """vLLM's shape: per prompt token (None for the first), its own entry first with its rank, then
    the k most likely ranked 1..k; the values are transformers' float64 log_softmax."""
    k = 3
    choice = ok(tiny_server, "/completions", prompt=PROMPT, prompt_logprobs=k, max_tokens=1, **GREEDY)["choices"][0]
    got = choice["prompt_logprobs"]
    assert len(got) == len(PROMPT) and got[0] is None
    ref = torch.log_softmax(ref_logits(tiny[1], PROMPT), -1)
    for i in range(1, len(PROMPT)):
        row, token = ref[i - 1], PROMPT[i]
        top = row.topk(k).indices.tolist()
        entries = got[i]
        assert list(entries)[0] == str(token) and set(entries) == {str(t) for t in [token] + top}
        assert entries[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entries[str(token)]["rank"] == int((row >= row[token]).sum())
        assert [entries[str(t)]["rank"] for t in top] == [1, 2, 3]
        assert all(entries[str(t)]["decoded_token"] == hf_tok.decode([t]) for t in [token] + top)


def test_prompt_logprobs_on_chat_and_with_echo(server: Server) -> None:
    r = ok(server, "/chat/completions", messages=HELLO, prompt_logprobs=0, max_tokens=2)
    lps = r["prompt_logprobs"]
    assert len(lps) == r["usage"]["prompt_tokens"] and lps[0] is None
    assert all(len(entry) == 1 and entry[next(iter(entry))]["logprob"] <= 0 for entry in lps[1:])
    assert "prompt_logprobs" not in ok(server, "/chat/completions", messages=HELLO, max_tokens=2)
    # echoed logprobs keep their own count when prompt_logprobs asks for more
    c = ok(server, "/completions", prompt="Hello world, how", echo=True, logprobs=1, prompt_logprobs=4,
           max_tokens=2, **GREEDY)["choices"][0]
    assert all(len(top) <= 2 for top in c["logprobs"]["top_logprobs"][1:])
    assert all(len(entry) >= 4 for entry in c["prompt_logprobs"][1:])
    for body in ({"stream": True, "prompt_logprobs": 1}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        assert refused(server, "/chat/completions", {**CHAT, **body})["param"] == "prompt_logprobs"


# -- min_tokens, include_stop_str_in_output, skip_special_tokens -------------------------------------


def test_min_tokens_holds_off_the_end(client: openai.OpenAI) -> None:
    """vLLM's rule: before min_tokens tokens, EOS and stop_token_ids cannot be sampled."""
    short = chat(client, max_tokens=60)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens + 5
    held = chat(client, max_tokens=60, extra_body={"min_tokens": n})
    assert held.usage.completion_tokens >= n
    with pytest.raises(openai.BadRequestError) as err:  # stop strings would end it before min_tokens
        chat(client, stop=["x"], extra_body={"min_tokens": 3})
    assert err.value.body["param"] == "min_tokens"


def test_include_stop_str_in_output_cuts_after_the_stop_string(server: Server, client: openai.OpenAI) -> None:
    """vLLM's rule: the text ends with the stop string that ended it (else it is cut before it)."""
    text = chat(client).choices[0].message.content
    stop = text.split()[1]
    expected = text[: text.index(stop) + len(stop)]
    kept = chat(client, stop=[stop], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.message.content == expected and kept.finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        client, stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True}) if c.choices)
    assert streamed == expected
    prompt = "The capital of France is"
    whole = ok(server, "/completions", prompt=prompt, max_tokens=8, **GREEDY)["choices"][0]["text"]
    word = whole.split()[0]
    got = ok(server, "/completions", prompt=prompt, max_tokens=8, stop=[word], include_stop_str_in_output=True,
             **GREEDY)["choices"][0]
    assert got["text"] == whole[: whole.index(word) + len(word)] and got["stop_reason"] == word


def test_include_stop_str_in_output_offline(tiny_llm: LLM) -> None:
    llm = tiny_llm
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    whole = llm.generate([PROMPT], SamplingParams(**greedy))[0].outputs[0].text
    stop = whole[3:5]
    cut = llm.generate([PROMPT], SamplingParams(stop=[stop], **greedy))[0].outputs[0].text
    kept = llm.generate([PROMPT], SamplingParams(stop=[stop], include_stop_str_in_output=True, **greedy))[0].outputs[0]
    assert cut == whole[: whole.index(stop)] and kept.text == cut + stop and kept.stop_reason == stop
    banned = llm.generate([PROMPT], SamplingParams(bad_words=[whole[0]], **greedy))[0].outputs[0].text
    assert whole[0] not in banned  # the offline API tokenizes bad_words too


def test_the_engine_checks_allowed_ids_and_tokenizes_bad_words_itself(tiny_llm: LLM) -> None:
    """Straight to LLMEngine.add_request (as the async engine's callers may): an id outside the vocabulary
    is refused there, not met by the sampler mid-step, and bad_words not yet tokenized are tokenized."""
    llm = tiny_llm
    engine, greedy = llm.engine, dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", PROMPT, SamplingParams(allowed_token_ids=[VOCAB], **greedy))
    assert err.value.param == "allowed_token_ids" and not engine.has_unfinished_requests()
    whole = llm.generate([PROMPT], SamplingParams(**greedy))[0].outputs[0].text
    engine.add_request("ban", PROMPT, SamplingParams(bad_words=[whole[0]], **greedy))
    text = []
    while engine.has_unfinished_requests():
        text += [d.text for out in engine.step() for d in out.deltas]
    assert whole[0] not in "".join(text)


def test_skip_special_tokens_false_shows_them(client: openai.OpenAI) -> None:
    end = "<|im_end|>"
    kw = dict(max_tokens=40, extra_body={"ignore_eos": True})
    shown = chat(client, **{**kw, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}})
    assert end in shown.choices[0].message.content
    assert end not in chat(client, **kw).choices[0].message.content


# -- structured outputs by vLLM's older names --------------------------------------------------------


def test_guided_json_and_guided_grammar_constrain_the_output(server: Server) -> None:
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["age"], "additionalProperties": False}
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(3):
        common = dict(temperature=1.0, seed=seed, max_tokens=40)
        text = ok(server, "/completions", prompt="Her age as JSON:", guided_json=schema, **common)["choices"][0]["text"]
        jsonschema.validate(json.loads(text), schema)
        text = ok(server, "/completions", prompt="A sum:", guided_grammar=grammar, stop=["\n\n"],
                  **common)["choices"][0]["text"]
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text), text


# -- tools on /tokenize, reasoning and names through the template; tool strict ------------------------

TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};"
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}>"
    "{% if m.reasoning_content %}[thinking: {{ m.reasoning_content }}]{% endif %}{{ m.content }}</{{ m.role }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def test_tokenize_renders_tools_reasoning_and_names_as_transformers(async_engine, server: Server, hf_tok) -> None:
    """/tokenize with tools renders them through the chat template, as the chat route does (vLLM's
    TokenizeChatRequest); an assistant's reasoning_content (or vLLM's newer `reasoning`) and a
    message's name reach the template as transformers passes them."""
    messages = [{"role": "user", "content": "Add 2 and 3.", "name": "ann"},
                {"role": "assistant", "content": "5", "reasoning_content": "2 + 3 is 5"},
                {"role": "user", "content": "Now 4 and 4."}]
    text = hf_tok.apply_chat_template(messages, tools=[ADD], chat_template=TOOL_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
    assert "add:" in text and "[thinking: 2 + 3 is 5]" in text and "name=ann" in text
    expected = hf_tok(text, add_special_tokens=False)["input_ids"]
    thread = ServerThread(create_app(async_engine, MODEL, chat_template=TOOL_TEMPLATE)).start()
    try:
        templated = Server(thread.url, async_engine)
        got = ok(templated, "/tokenize", messages=messages, tools=[ADD])
        assert got["tokens"] == expected
        renamed = [*messages[:1], {**messages[1], "reasoning": messages[1]["reasoning_content"]}, *messages[2:]]
        del renamed[1]["reasoning_content"]
        assert ok(templated, "/tokenize", messages=renamed, tools=[ADD])["tokens"] == expected
        reply = ok(templated, "/chat/completions", messages=messages, tools=[ADD], tool_choice="none", max_tokens=1)
        assert reply["usage"]["prompt_tokens"] == len(expected)
    finally:
        thread.stop()
    # the default template knows no tools: they go in ladle's fallback convention, as for a chat request
    plain = ok(server, "/tokenize", messages=HELLO)["count"]
    with_tools = ok(server, "/tokenize", messages=HELLO, tools=[ADD])["count"]
    reply = ok(server, "/chat/completions", messages=HELLO, tools=[ADD], tool_choice="none", max_tokens=1)
    assert with_tools > plain and reply["usage"]["prompt_tokens"] == with_tools


def test_tool_strict_false_allows_properties_the_schema_does_not_name(async_engine) -> None:
    """strict false: the arguments' grammar reads the schema as JSON Schema does (jsonschema accepts an
    unnamed property); strict true or unset: OpenAI's strict mode, no unnamed property."""
    import xgrammar

    arguments = '{"a": 2, "b": 3, "note": "sum"}'
    jsonschema.validate(json.loads(arguments), ADD["function"]["parameters"])
    named = {"type": "function", "function": {"name": "add"}}

    def accepts(strict: bool | None) -> bool:
        tool = {**ADD, "function": {**ADD["function"], "strict": strict}}
        req = ChatCompletionRequest(messages=HELLO, tools=[tool], tool_choice=named)
        grammar = tool_plan_of(req, None).grammar
        return xgrammar.GrammarMatcher(async_engine.engine.grammars.compile(grammar)).accept_string(arguments)

    assert accepts(False) and not accepts(True) and not accepts(None)


def test_required_tools_mixing_strictness_are_refused(server: Server) -> None:
    tools = [{**ADD, "function": {**ADD["function"], "strict": True}},
             {"type": "function", "function": {"name": "sub", "parameters": {"type": "object"}, "strict": False}}]
    error = refused(server, "/chat/completions", {**CHAT, "tools": tools, "tool_choice": "required"})
    assert error["param"] == "tools[1].function.strict"
