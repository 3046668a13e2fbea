"""Speculative decoding (ngram prompt lookup, early-exit self-speculation): lossless against the same
engine without it, the target's distribution kept (against transformers' float64 softmax), KV and
metrics accounted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from server_utils import MODEL, own_server
from tiny_models import build_tiny_model
from conftest import VOCAB, EnginePool, Tiny
from test_sampling_semantics import P_MIN, chi_square_p, ref_logits

from ladle import LLM, SamplingParams
from ladle.config import EngineConfig
from ladle.engine.request import Sequence
from ladle.engine.sampler import Sampler
from ladle.llm import GenerationResult
from ladle.spec_decode.config import SpeculativeConfig
from ladle.spec_decode.ngram import propose
from ladle.spec_decode.verify import verify_all

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

# speculation on for batches of any size here (by default it stops at 4 sequences)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": 64}
# the embedded model was not trained for early exits: its last layers draft, to keep some drafts
EARLY_EXIT = {"method": "early_exit", "num_speculative_tokens": 3, "draft_layers": 24, "disable_by_batch_size": 64}
METHODS = [NGRAM, EARLY_EXIT, "draft_model"]  # draft_model: a tiny random model sharing the tokenizer
IDS = ["ngram", "early_exit", "draft_model"]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama with the embedded model's tokenizer: its drafts are mostly rejected."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("draft"), smollm2_dir)


Baseline = Callable[..., list[GenerationResult]]


@pytest.fixture(scope="module")
def baseline(engine_pool: EnginePool, smollm2_dir: Path) -> Baseline:
    """baseline(prompts, params, **engine_args): the answers without speculation, computed once per
    module for each (prompts, params, engine arguments), on a pooled engine with an empty prefix cache."""
    answers: dict[str, list[GenerationResult]] = {}

    def get(prompts: list[str], params: SamplingParams | list[SamplingParams], **engine_args) -> list[GenerationResult]:
        key = repr((prompts, params, sorted(engine_args.items())))
        if key not in answers:
            answers[key] = engine_pool.get(smollm2_dir, **engine_args).generate(prompts, params)
        return answers[key]

    return get


def spec_config(method: dict | str, tiny_draft: Path) -> dict:
    if method == "draft_model":
        return {"method": "draft_model", "model": str(tiny_draft), "num_speculative_tokens": 3,
                "disable_by_batch_size": 64}
    return method
QUOTE = ("Repeat this text exactly.\n\nThe quick brown fox jumps over the lazy dog while the cat sleeps on the "
         "warm mat by the door. Every morning the farmer walks to the field, feeds the hens, and checks the "
         "fences before breakfast.\n\nRepeated text:\n")
PROMPTS = [QUOTE, "List the days of the week: Monday, Tuesday,", "Write a haiku about the sea.",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "Count from one to twenty: one, two, three,"]


def token_ids(results: list[GenerationResult]) -> list[list[list[int]]]:
    return [[c.token_ids for c in r.outputs] for r in results]


def test_ngram_proposals_follow_the_latest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose(tokens, 3, 1, 3) == [7, 8, 5]  # the latest earlier "1 2 3" was followed by 7 8 5
    assert propose(tokens, 2, 1, 3) == [7, 8]
    assert propose([4, 5, 6], 3, 1, 2) == []  # no earlier occurrence of any suffix
    assert propose([5, 6, 5], 3, 1, 2) == [6, 5]  # "5" seen before: what followed it, up to the end
    assert propose([5, 6, 5], 3, 2, 2) == []  # "6 5" was not


def test_the_load_aware_policy_shrinks_then_stops() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8)
    assert [spec.tokens_at(b) for b in range(1, 10)] == [4, 4, 2, 2, 1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_token": 4}')
    with pytest.raises(ValueError, match="not served"):
        SpeculativeConfig.parse({"method": "medusa"})


@pytest.mark.parametrize("method", METHODS, ids=IDS)
@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 16},  # chunked prefill, drafts cut by budget
    {"num_kv_blocks": 18, "block_size": 8, "max_num_batched_tokens": 64},  # a pool too small: preemption
], ids=["plain", "chunked", "preempted"])
def test_greedy_output_is_unchanged(smollm2_dir: Path, tiny_draft: Path, baseline: Baseline, engine_args: dict,
                                    method) -> None:
    greedy = [SamplingParams(temperature=0.0, max_tokens=24, logprobs=2), SamplingParams(temperature=0.0, max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=16, stop=["."]),
              # penalties and min_tokens read the tokens before each row, drafts included
              SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.2, frequency_penalty=0.4),
              SamplingParams(temperature=0.0, max_tokens=24, presence_penalty=0.5, min_tokens=20)]
    spec = LLM(str(smollm2_dir), speculative_config=spec_config(method, tiny_draft), **engine_args)
    want = baseline(PROMPTS, greedy, **engine_args)
    got = spec.generate(PROMPTS, greedy)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text and g.outputs[0].finish_reason == w.outputs[0].finish_reason
    # logprobs are the target's, position by position
    for lw, lg in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert lg.token_id == lw.token_id and abs(lg.logprob - lw.logprob) < 1e-4
        assert [t for t, _ in lg.top] == [t for t, _ in lw.top]
    stats = spec.engine.stats.spec
    assert stats.num_draft_tokens > 50
    if method != "draft_model":  # the random draft model's drafts are (rightly) rejected
        assert stats.num_accepted_tokens > 10
    if "num_kv_blocks" in engine_args:
        assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.num_blocks  # nothing leaked by rejected drafts


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_seeded_samples_and_n_are_unchanged(smollm2_dir: Path, tiny_draft: Path, baseline: Baseline, method) -> None:
    """One draw per emitted token, in order: a seeded request emits the same tokens with speculation."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=16, n=2) for s in range(5)]
    base = token_ids(baseline(PROMPTS, params))
    spec_llm = LLM(str(smollm2_dir), speculative_config=spec_config(method, tiny_draft))
    assert token_ids(spec_llm.generate(PROMPTS, params)) == base
    assert spec_llm.engine.stats.spec.num_draft_tokens > 0


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_prefix_cache_holds_only_verified_tokens(smollm2_dir: Path, tiny_draft: Path, method) -> None:
    llm = LLM(str(smollm2_dir), speculative_config=spec_config(method, tiny_draft), block_size=4)
    results = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    stats = llm.engine.stats.spec
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # some drafts were rejected
    texts = [r.prompt_token_ids + r.outputs[0].token_ids for r in results]
    cache = llm.engine.kv.cache
    for block_id, node in cache.by_block.items():
        path = []
        while node is not None and node.key:
            path = list(node.key) + path
            node = node.parent
        # every cached block's tokens, from the root, are a prefix of what some request really holds
        assert any(t[: len(path)] == path for t in texts), block_id
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampled_tokens_keep_the_targets_distribution(tiny: Tiny, seeded: bool) -> None:
    """Thousands of samples through drafts that are often kept, each token against softmax(z / T) of
    transformers' float64 logits: the second token (the verification step's first row) and the third
    (its second row, reached only when the draft was kept). Seeded rows are verified row by row,
    unseeded ones all at once."""
    folder, hf = tiny
    temperature = 0.5
    filler = [20, 21, 22, 23, 24]

    def favourite(ids: list[int]) -> tuple[int, float]:
        probs = torch.softmax(ref_logits(hf, ids)[-1] / temperature, -1)
        return int(probs.argmax()), float(probs.max())

    def context(head: list[int]) -> tuple[list[int], int, int, float]:
        """A prompt ending in `head`, which once before was followed by `last` and `x`: when the model
        samples `last` first, prompt lookup drafts `x`. Both settle on the tokens the model likes."""
        last, x = 26, 27
        for _ in range(5):
            prompt = head + [last, x, 25] + filler + head
            last, p1 = favourite(prompt)
            x, p2 = favourite(prompt + [last])
        return head + [last, x, 25] + filler + head, last, x, p1 * p2

    prompt, last, x, p_both = max((context([a, b, a + 7]) for a in range(30, 40) for b in (41, 47)),
                                  key=lambda found: found[3])
    assert p_both > 0.1 and propose(prompt + [last], 1, 1, 4) == [x]
    llm = LLM(str(folder), dtype="float32", max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=1100,
              speculative_config={"method": "ngram", "num_speculative_tokens": 1, "disable_by_batch_size": 10**6})
    n = 4000
    results = llm.generate([prompt] * n, [SamplingParams(temperature=temperature, seed=s if seeded else None,
                                                         max_tokens=3) for s in range(n)])
    tokens = torch.tensor([(r.outputs[0].token_ids + [-1, -1])[:3] for r in results])  # -1: after an EOS

    def check(rows: torch.Tensor, position: int, context_ids: list[int]) -> None:
        assert len(rows) > 300
        probs = torch.softmax(ref_logits(hf, context_ids)[-1] / temperature, -1)
        assert chi_square_p(torch.bincount(rows[:, position], minlength=VOCAB), probs) > P_MIN

    after_last = tokens[tokens[:, 0] == last]
    check(after_last, 1, prompt + [last])  # the verification step's first row
    after_draft = after_last[after_last[:, 1] == x]
    check(after_draft, 2, prompt + [last, x])  # its second row: the draft was kept
    assert llm.engine.stats.spec.accepted_per_pos[0] == len(after_draft)


def test_metrics_count_drafts_and_acceptances(smollm2_dir: Path) -> None:
    with own_server(EngineConfig(speculative_config=SpeculativeConfig(**NGRAM))) as server:
        r = httpx.post(f"{server.base_url}/completions", json={
            "model": MODEL, "prompt": QUOTE, "max_tokens": 48, "temperature": 0}, timeout=120).json()
        tokens = r["usage"]["completion_tokens"]
        stats = server.engine.snapshot().spec_decode
        metrics = server.scrape()
        name = "vllm:spec_decode_num_{}_total"
        assert metrics[name.format("drafts")] == stats.num_drafts > 0
        assert metrics[name.format("draft_tokens")] == stats.num_draft_tokens
        assert metrics[name.format("accepted_tokens")] == stats.num_accepted_tokens
        per_pos = [metrics[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"]
                   for i in range(len(stats.accepted_per_pos))]
        assert sum(per_pos) == stats.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
        # each verification step emits its kept drafts and one drawn token; other steps one token
        assert stats.num_accepted_tokens + stats.num_drafts <= tokens


def test_the_serve_flag_takes_vllms_json() -> None:
    import argparse

    from ladle.config import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}']))
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)
    assert engine_config_from_args(parser.parse_args([])).speculative_config is None
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        engine_config_from_args(parser.parse_args(["--speculative-config", '{"prompt_lookup_min": 5}']))


def test_a_decision_in_a_speculating_batch_is_bit_identical(smollm2_dir: Path, engine_pool: EnginePool) -> None:
    llm = LLM(str(smollm2_dir), speculative_config=NGRAM)
    question = llm.tokenizer.apply_chat_template([{"role": "user", "content":
                                                   f"{QUOTE}\nIs this about animals? Answer yes or no."}])
    score = SamplingParams(label_token_ids=[llm.tokenizer.encode(w)[0] for w in ("yes", "no")])
    alone = engine_pool.get(smollm2_dir).generate([question], score)[0].outputs[0].label_logprobs
    engine = llm.engine
    engine.add_request("quote", QUOTE, SamplingParams(temperature=0.0, max_tokens=64))
    while engine.stats.spec.num_drafts == 0:  # the quote is speculating now
        engine.step()
    engine.add_request("question", question, score)
    drafts_before, labels = engine.stats.spec.num_drafts, None
    while labels is None:
        for out in engine.step():
            if out.request_id == "question":
                labels = out.deltas[0].label_logprobs
    assert engine.stats.spec.num_drafts > drafts_before  # verified drafts in the very steps that scored
    assert labels == alone


def test_streams_with_logprobs_n_and_stop_strings_are_unchanged(smollm2_dir: Path) -> None:
    """Through the server and the SDK: a step may now emit several tokens (one chunk with their text
    and logprobs), and what the client assembles is the same."""
    import openai

    def run(server) -> tuple:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUOTE}], max_tokens=60, temperature=0, n=2,
            stream=True, logprobs=True, top_logprobs=2, stream_options={"include_usage": True}))
        texts, logprobs = ["", ""], [[], []]
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                for lp in (choice.logprobs.content or []) if choice.logprobs else []:
                    logprobs[choice.index].append((lp.token, round(lp.logprob, 3), [t.token for t in lp.top_logprobs]))
        stopped = client.completions.create(model=MODEL, prompt=QUOTE, max_tokens=40, temperature=0, stop=["fox"])
        return texts, logprobs, chunks[-1].usage.completion_tokens, stopped.choices[0].text, len(chunks)

    with own_server(EngineConfig(num_kv_blocks=512)) as base, \
            own_server(EngineConfig(num_kv_blocks=512, speculative_config=SpeculativeConfig(**NGRAM))) as spec:
        want, got = run(base), run(spec)
        assert got[:4] == want[:4] and "fox" not in got[3]
        assert got[4] < want[4]  # fewer chunks: steps that kept drafts sent several tokens at once
        assert spec.engine.snapshot().spec_decode.num_accepted_tokens > 0


def test_structured_outputs_speculate_under_their_grammar(smollm2_dir: Path, baseline: Baseline) -> None:
    """Each row is masked by the grammar as advanced over the drafts kept before it; the output is
    the same as without speculation, and valid."""
    import json

    import jsonschema

    from ladle.structured.spec import StructuredOutputsParams

    schema = {"type": "object", "properties": {"people": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}}, "required": ["people"],
        "additionalProperties": False}
    prompt = "Three people with their names and ages, as JSON:"
    grammar = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=grammar),
              SamplingParams(temperature=0.7, seed=3, max_tokens=120, structured_outputs=grammar)]
    base = baseline([prompt, prompt], params)
    spec = LLM(str(smollm2_dir), speculative_config=NGRAM)
    got = spec.generate([prompt, prompt], params)
    for w, g in zip(base, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        jsonschema.validate(json.loads(g.outputs[0].text), schema)
    assert spec.engine.stats.spec.num_accepted_tokens > 10  # the repeated keys were drafted and kept


def test_the_model_itself_as_draft_model_keeps_every_draft(smollm2_dir: Path, baseline: Baseline) -> None:
    """Greedy drafts of the target's own weights are the target's tokens: every one is kept, which
    only holds if the draft model's cache follows each sequence exactly (kept, rejected, new)."""
    llm = LLM(str(smollm2_dir), speculative_config={"method": "draft_model", "model": str(smollm2_dir),
                                                    "num_speculative_tokens": 3, "disable_by_batch_size": 64})
    base = baseline(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    got = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert [g.outputs[0].token_ids for g in got] == [b.outputs[0].token_ids for b in base]
    stats = llm.engine.stats.spec
    assert stats.num_accepted_tokens >= 0.97 * stats.num_draft_tokens > 0
    assert llm.engine.proposer.draft_model.kv.num_free_blocks == llm.engine.proposer.draft_model.kv.num_blocks  # released at the finish


def test_rows_verified_at_once_see_the_drafts_before_them() -> None:
    """A frequency penalty counts the drafts before a row. Row 1 favours token 3 again (4.0 against
    token 5's 2.5) but, token 3 drafted once before it, pays 2.0 for it and picks 5: so draft 1 is
    rejected there, as a run without speculation, having emitted 3, would pick 5 next. Both rows went
    through the sampler in one call."""
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0, max_tokens=8)
    seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=[1, 2], num_prompt_tokens=2, params=params,
                   arrival_time=0.0)
    rows = torch.full((3, 8), -1.0)
    rows[0, 3] = 4.0
    rows[1, 3], rows[1, 5] = 4.0, 2.5
    rows[2, 6] = 4.0
    calls = []

    def sample(logits: torch.Tensor, seqs: list) -> list:
        calls.append(len(seqs))
        return Sampler()(logits, seqs)

    assert [t for t, _ in verify_all([(rows, seq, [3, 3])], sample)[0]] == [3, 5]
    assert calls == [3] and seq.token_ids == [1, 2]
    seeded = Sequence(seq_id=1, request_id="s", index=0, token_ids=[1, 2], num_prompt_tokens=2, arrival_time=0.0,
                      params=SamplingParams(temperature=0.7, seed=1, max_tokens=8))
    seeded.generator = torch.Generator().manual_seed(1)
    calls.clear()
    verify_all([(rows, seeded, [3, 3])], sample)  # a seeded row draws once per emitted token: row by row
    assert all(n == 1 for n in calls)
