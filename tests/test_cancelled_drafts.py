"""Cancelled drafts (a voice agent's eager replies): what they computed stays in the prefix cache,
down to the tokens of their last, partly filled block, and thousands of them leak no block."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ladle import LLM, SamplingParams
from ladle.engine.engine import LLMEngine
from test_prefix_cache import assert_no_leak, ids
from tiny_models import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_dir: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), smollm2_dir)


def draft(engine: LLMEngine, request_id: str, prompt: list[int], steps: int) -> None:
    """Start a request, run `steps` engine steps, then cancel it."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(steps):
        engine.step()
    assert engine.abort_request(request_id)


def follow_up(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    result = llm.generate([prompt], GREEDY)[0]
    return result.outputs[0].token_ids, result.num_cached_tokens


@pytest.mark.parametrize("steps", [1, 3])  # cancelled right after its prefill, or while decoding
def test_a_cancelled_drafts_prompt_is_hit_by_the_follow_up_down_to_its_partial_block(tiny_llama: Path, steps: int):
    rng = random.Random(steps)
    prompt = ids(rng, 5 * BLOCK + 3)  # five full blocks and three tokens of a sixth
    longer = prompt + ids(rng, 13)  # the caller kept talking: the final transcript extends the draft's
    llm = LLM(str(tiny_llama), block_size=BLOCK)
    draft(llm.engine, "draft", prompt, steps)
    assert_no_leak(llm)  # cancelling returned every block at once
    tokens, cached = follow_up(llm, longer)
    assert cached == len(prompt)  # the full blocks shared, the partial block's three tokens copied
    assert tokens == follow_up(LLM(str(tiny_llama), block_size=BLOCK, enable_prefix_caching=False), longer)[0]
    assert_no_leak(llm)


def test_a_draft_cancelled_mid_prefill_keeps_what_it_computed(tiny_llama: Path):
    rng = random.Random(7)
    prompt = ids(rng, 12 * BLOCK)
    llm = LLM(str(tiny_llama), block_size=BLOCK, max_num_batched_tokens=4 * BLOCK + 5)  # chunked prefill
    draft(llm.engine, "draft", prompt, 1)  # one chunk: four blocks and five tokens
    longer = prompt + ids(rng, 4)
    tokens, cached = follow_up(llm, longer)
    assert cached == 4 * BLOCK + 5
    assert tokens == follow_up(LLM(str(tiny_llama), block_size=BLOCK, enable_prefix_caching=False), longer)[0]
    assert_no_leak(llm)


def test_a_finished_requests_partial_block_serves_the_next_turn(tiny_llama: Path):
    """The same rule for a reply that ran to the end: the next turn starts where the last one stopped."""
    rng = random.Random(3)
    llm = LLM(str(tiny_llama), block_size=BLOCK)
    first = ids(rng, 3 * BLOCK + 2)
    reply = llm.generate([first], GREEDY)[0].outputs[0].token_ids  # computes all but the last reply token
    nxt = first + reply + ids(rng, 9)
    _, cached = follow_up(llm, nxt)
    assert cached == len(first) + len(reply) - 1
    assert_no_leak(llm)


def test_the_partial_block_is_not_used_while_it_is_only_a_pending_copy(tiny_llama: Path):
    """A draft cancelled before its first step had its block's copy still pending: nothing to keep."""
    rng = random.Random(4)
    llm = LLM(str(tiny_llama), block_size=BLOCK)
    base = ids(rng, 2 * BLOCK + 6)
    llm.generate([base], SamplingParams(temperature=0.0, max_tokens=1))  # caches two blocks and six tokens
    engine = llm.engine
    engine.add_request("d", base[:-2] + ids(rng, 5), GREEDY)
    engine.scheduler.schedule()  # admitted: a copy of four tokens is pending, never run
    seq = engine.requests["d"][0]
    assert seq.pending_copy is not None and seq.num_computed_tokens == len(base) - 2
    unwritten = seq.block_table[2]  # the third block, which the copy was to fill
    engine.abort_request("d")
    assert not engine.kv.cache.contains_block(unwritten)
    assert_no_leak(llm)
    longer = base + ids(rng, 3)
    tokens, cached = follow_up(llm, longer)
    assert cached == len(base)  # from the first request's partial block, not the aborted one's
    assert tokens == follow_up(LLM(str(tiny_llama), block_size=BLOCK, enable_prefix_caching=False), longer)[0]


def test_thousands_of_cancelled_drafts_leak_no_block(tiny_llama: Path):
    rng = random.Random(11)
    llm = LLM(str(tiny_llama), block_size=BLOCK, num_kv_blocks=48, max_num_seqs=4)
    engine = llm.engine
    history = ids(rng, 2 * BLOCK + 1)
    for i in range(2000):
        if i % 50 == 0:  # a new turn: the conversation grows, so older partial blocks go stale
            history += ids(rng, rng.randrange(1, 2 * BLOCK))
        prompt = history + ids(rng, rng.randrange(1, 3 * BLOCK))
        if len(prompt) > 20 * BLOCK:
            history = ids(rng, 2 * BLOCK + 1)
            continue
        draft(engine, f"d{i}", prompt, rng.randrange(0, 3))
        assert engine.kv.num_free_blocks == engine.kv.num_blocks  # usage back to baseline every time
    assert engine.kv.stats.evictions > 0 and engine.kv.stats.hits > 0
    assert_no_leak(llm)
    before = engine.kv.usage
    tokens, _ = follow_up(llm, history + ids(rng, 5))
    assert before == 0.0 and len(tokens) == GREEDY.max_tokens
    assert_no_leak(llm)
