"""Batch-invariant numerics: scoring always, and every request under --deterministic."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ladle import LLM, SamplingParams
from ladle.model.kernels import loader

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

WORDS = ["alpha", "beta", "ticket", "failing", "integration", "billing", "server", "network"]


def question(llm: LLM, text: str, i: int) -> str:
    msg = f"{text}\n\nQuestion {i}: which team? A: billing B: technical\nAnswer with the letter of one option only."
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": msg}])


@pytest.fixture(scope="module")
def text() -> str:
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(48))  # 99 tokens rendered: past the 96-token chunk


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_scoring_is_bit_identical_cold_cached_and_batched(smollm2_dir: Path, text: str, deterministic: bool,
                                                          kernels: str, dtype: str) -> None:
    check_scoring_is_bit_identical(smollm2_dir, text, kernels, deterministic=deterministic, dtype=dtype)


def check_scoring_is_bit_identical(smollm2_dir: Path, text: str, kernels: str, **engine_args) -> None:
    """Label log-probabilities: cold, cached, batched, and from a partly shared block, all the same bits."""
    # A small token budget forces chunked prefill, so chunk boundaries differ run to run.
    engine_args = dict(kv_cache_memory_gib=0.5, max_num_batched_tokens=96, **engine_args)
    llm = LLM(str(smollm2_dir), **engine_args)
    # the native case really runs the native kernels (a failed build would fall back to torch silently)
    assert (loader.native_kernels() is not None) == (kernels == "native")
    assert (llm.engine.runtime_info()["kernels"] == "torch") == (kernels == "torch")
    labels = [llm.tokenizer.encode(x)[0] for x in ("A", "B")]
    score = SamplingParams(label_token_ids=labels)
    chat = SamplingParams(temperature=0.0, max_tokens=6)
    cold = llm.generate([question(llm, text, 0)], score)[0].outputs[0].label_logprobs
    hits_before = llm.engine.kv.stats.hits
    warm = llm.generate([question(llm, text, 0)], score)[0].outputs[0].label_logprobs
    assert llm.engine.kv.stats.hits > hits_before  # really served from the cache
    mixed = llm.generate([question(llm, text, 1), "Tell me a story. " * 12, question(llm, text, 0)],
                         [score, chat, score])
    assert cold == warm == mixed[2].outputs[0].label_logprobs
    # A fresh engine that first caches question 1: question 0 then reuses the block
    # where the two prompts diverge only in part (its shared start is copied).
    other = LLM(str(smollm2_dir), **engine_args)
    other.generate([question(llm, text, 1)], score)
    hits_before = other.engine.kv.stats.hits
    partial = other.generate([question(llm, text, 0)], score)[0].outputs[0].label_logprobs
    assert (other.engine.kv.stats.hits - hits_before) % other.engine.config.block_size != 0
    assert partial == cold


def test_scoring_never_reuses_blocks_that_generation_computed(smollm2_dir: Path, text: str) -> None:
    """A chat caches the very prompt a question then scores: its blocks came from batched,
    non-canonical arithmetic, so scoring recomputes them and matches a cold engine exactly."""
    llm = LLM(str(smollm2_dir), kv_cache_memory_gib=0.5)
    prompt = question(llm, text, 0)
    labels = [llm.tokenizer.encode(x)[0] for x in ("A", "B")]
    score = SamplingParams(label_token_ids=labels)
    llm.generate([prompt, "Tell me a story."], SamplingParams(temperature=0.0, max_tokens=4))
    assert llm.engine.kv.num_cached_blocks > 0
    hits_before = llm.engine.kv.stats.hits
    after_chat = llm.generate([prompt], score)[0].outputs[0].label_logprobs
    assert llm.engine.kv.stats.hits == hits_before
    cold = LLM(str(smollm2_dir), kv_cache_memory_gib=0.5).generate([prompt], score)[0].outputs[0].label_logprobs
    assert after_chat == cold
    hits_before = llm.engine.kv.stats.hits
    assert llm.generate([prompt], score)[0].outputs[0].label_logprobs == cold  # now cached canonically
    assert llm.engine.kv.stats.hits > hits_before


def test_deterministic_generation_ignores_batch_neighbours(smollm2_dir: Path) -> None:
    llm = LLM(str(smollm2_dir), deterministic=True, kv_cache_memory_gib=0.5)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    prompt = "The three primary colours are"
    alone = llm.generate([prompt], params)[0].outputs[0]
    others = ["Once upon a time " * 8, "List five fruits:", "def add(a, b):"]
    batched = llm.generate(others[:1] + [prompt] + others[1:], params)[1].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert [lp.logprob for lp in batched.logprobs] == [lp.logprob for lp in alone.logprobs]


def test_a_chat_prefilled_beside_a_scoring_request_samples_from_its_own_row(smollm2_dir: Path, text: str) -> None:
    """A scoring request's row comes first in the step, so the chat's row is not the step's first: the
    chat still samples from its own."""
    llm = LLM(str(smollm2_dir), kv_cache_memory_gib=0.5)
    labels = [llm.tokenizer.encode(x)[0] for x in ("A", "B")]
    chat, params = "The capital of France is", SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    alone = llm.generate([chat], params)[0].outputs[0]
    llm.engine.reset_prefix_cache()
    steps_before = llm.engine.stats.steps
    beside = llm.generate([question(llm, text, 0), chat], [SamplingParams(label_token_ids=labels), params])
    assert llm.engine.stats.steps - steps_before == 4  # both prompts in the first step
    assert beside[1].outputs[0].token_ids == alone.token_ids
    assert [lp.logprob for lp in beside[1].outputs[0].logprobs] == pytest.approx([lp.logprob for lp in alone.logprobs],
                                                                                abs=1e-4)
