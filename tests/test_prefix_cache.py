"""Prefix caching, eviction and priority scheduling in the engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ladle import LLM, SamplingParams
from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.request import Sequence
from ladle.engine.scheduler import common_prefix_len
from tiny_models import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.kv
    assert not llm.engine.has_unfinished_requests()
    assert all(c == 0 for c in kv.pool.ref_counts), "a block is still referenced"
    assert kv.num_free_blocks == kv.num_blocks
    assert len(kv.pool.free_ids) + kv.num_cached_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_dir: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), smollm2_dir)


def test_shared_1000_token_prefix_prefills_only_the_suffix(smollm2_dir: Path) -> None:
    rng = random.Random(0)
    prefix = ids(rng, 1000)
    prompts = [prefix + ids(rng, 24), prefix + ids(rng, 40)]
    cached = LLM(str(smollm2_dir), kv_cache_memory_gib=0.5)
    first = cached.generate([prompts[0]], GREEDY)[0]
    queries, hits = cached.engine.kv.stats.queries, cached.engine.kv.stats.hits
    second = cached.generate([prompts[1]], GREEDY)[0]
    hit = cached.engine.kv.stats.hits - hits
    assert hit == 1000  # 62 full blocks, then the shared start of the 63rd copied from the cache
    assert cached.engine.kv.stats.queries - queries == len(prompts[1])
    plain = LLM(str(smollm2_dir), kv_cache_memory_gib=0.5, enable_prefix_caching=False)
    cold = plain.generate(prompts, GREEDY)
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [c.outputs[0].token_ids for c in cold]
    assert plain.engine.kv.stats.hits == 0
    assert_no_leak(cached)
    assert_no_leak(plain)


def test_full_hit_still_computes_the_last_token(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), block_size=8)
    prompt = ids(random.Random(1), 64)  # exactly 8 full blocks
    a = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    b = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert a == b
    assert llm.engine.kv.stats.hits == 63  # all but the last token, which must be computed for logits
    assert_no_leak(llm)


def test_eviction_under_a_small_pool_keeps_outputs_right(tiny_llama: Path) -> None:
    rng = random.Random(2)
    prefixes = [ids(rng, 96) for _ in range(6)]  # 6 distinct prefixes x 12 blocks > 40 blocks
    prompts = [p + ids(rng, 8) for p in prefixes for _ in range(2)]
    rng.shuffle(prompts)
    small = LLM(str(tiny_llama), num_kv_blocks=40, block_size=8, max_num_seqs=2)
    got = []
    for i in range(0, len(prompts), 3):  # waves, so later ones find (or lost) earlier prefixes
        got += [r.outputs[0].token_ids for r in small.generate(prompts[i : i + 3], GREEDY)]
    assert small.engine.kv.stats.evictions > 0
    assert small.engine.kv.stats.hits > 0
    ref = LLM(str(tiny_llama), enable_prefix_caching=False)
    assert got == [r.outputs[0].token_ids for r in ref.generate(prompts, GREEDY)]
    assert_no_leak(small)


def test_concurrent_identical_prompts_share_blocks(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), block_size=8)
    prompt = ids(random.Random(3), 80)
    outs = llm.generate([prompt] * 4, GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    # all four admitted in the first step, the last three on the first one's blocks: each
    # computes only its last prompt token (whose logits it needs)
    assert llm.engine.stats.steps == GREEDY.max_tokens
    assert llm.engine.kv.stats.hits == 3 * (len(prompt) - 1)
    assert_no_leak(llm)


def test_requests_arriving_together_share_a_prefix_in_flight(tiny_llama: Path) -> None:
    """Four prompts with a common 61-token start, submitted at once: the first computes the
    start, the others join in the same step on its blocks (the partial eighth block's 5
    tokens copied layer by layer as they are written) and compute only their own ends."""
    rng = random.Random(7)
    start = ids(rng, 61)
    prompts = [start + ids(rng, 9) for _ in range(4)]
    llm = LLM(str(tiny_llama), block_size=8)
    together = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
    assert llm.engine.stats.steps == GREEDY.max_tokens  # all four admitted in the first step
    assert llm.engine.kv.stats.hits == 3 * 61  # each later prompt skipped the whole shared start
    alone = [LLM(str(tiny_llama), block_size=8, enable_prefix_caching=False).generate([p], GREEDY)[0]
             for p in prompts]
    assert together == [r.outputs[0].token_ids for r in alone]
    assert_no_leak(llm)


def test_scoring_in_flight_shares_are_bit_identical(tiny_llama: Path) -> None:
    """Scoring prompts submitted together (so later ones start on blocks the first is still
    computing) give exactly the log-probabilities each gets alone on a cold engine."""
    rng = random.Random(8)
    start = ids(rng, 45)
    prompts = [start + ids(rng, 6 + i) for i in range(5)]
    params = SamplingParams(label_token_ids=[5, 6, 7])
    llm = LLM(str(tiny_llama), block_size=16)
    together = [r.outputs[0].label_logprobs for r in llm.generate(prompts, params)]
    assert llm.engine.stats.steps == 1 and llm.engine.kv.stats.hits == 4 * 45
    for prompt, got in zip(prompts, together):
        cold = LLM(str(tiny_llama), block_size=16).generate([prompt], params)[0].outputs[0].label_logprobs
        assert got == cold
    assert_no_leak(llm)


def test_common_prefix_len() -> None:
    a = list(range(100))
    assert common_prefix_len(a, a, 40) == 40
    assert common_prefix_len(a, a[:30] + [-1] + a[31:], 100) == 30
    assert common_prefix_len(a, [-1] + a[1:], 100) == 0
    assert common_prefix_len(a, a[:10], 100) == 10


def test_radix_tree_bookkeeping() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)

    def seq(tokens: list[int]) -> Sequence:
        return Sequence(seq_id=0, request_id="r", index=0, token_ids=tokens, num_prompt_tokens=len(tokens),
                        params=GREEDY, arrival_time=0.0)

    a = seq(list(range(13)))
    assert kv.match_prefix(a) == 0 and kv.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 3 and kv.usage == 4 / 8
    kv.free(a)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    b = seq(list(range(8)) + [99] * 5)
    assert kv.match_prefix(b) == 8  # two blocks shared, the third differs
    assert kv.allocate_slots(b, 5)
    kv.free(b)
    big = seq(list(range(100, 132)))  # needs all 8 blocks: evicts every cached one
    assert kv.allocate_slots(big, 32)
    assert kv.stats.evictions == 3 and kv.num_cached_blocks == 0
    kv.free(big)


def test_canonical_sequences_reuse_only_canonical_blocks() -> None:
    """Scoring must not read K/V that batched generation computed: it skips such blocks,
    recomputes them, and its canonical copy then takes the tree node over; the generating
    sequence keeps its own block, and nothing leaks."""
    kv = KVCacheManager(num_blocks=8, block_size=4)

    def seq(tokens: list[int], canonical: bool) -> Sequence:
        return Sequence(seq_id=0, request_id="r", index=0, token_ids=tokens, num_prompt_tokens=len(tokens),
                        params=GREEDY, arrival_time=0.0, canonical=canonical)

    def compute(s: Sequence) -> None:
        assert kv.allocate_slots(s, s.num_tokens - s.num_computed_tokens)
        s.num_computed_tokens = s.num_tokens
        kv.cache_full_blocks(s)

    chat = seq(list(range(10)), canonical=False)
    assert kv.match_prefix(chat) == 0
    compute(chat)  # caches blocks [0..4) and [4..8), not canonical
    chat_blocks = list(chat.block_table)
    scoring = seq(list(range(8)) + [50, 51, 52], canonical=True)
    assert kv.match_prefix(scoring) == 0 and scoring.pending_copy is None  # neither full nor partial reuse
    compute(scoring)
    assert scoring.block_table[:2] != chat_blocks[:2]  # its own K/V, now the tree's
    assert [kv.cache.by_block.get(b) for b in chat_blocks[:2]] == [None, None]
    later = seq(list(range(8)) + [60], canonical=True)
    assert kv.match_prefix(later) == 8 and later.block_table == scoring.block_table[:2]
    other_chat = seq(list(range(8)) + [70], canonical=False)
    assert kv.match_prefix(other_chat) == 8  # generation reuses canonical blocks freely
    for s in (chat, scoring, later, other_chat):
        kv.free(s)
    assert all(c == 0 for c in kv.pool.ref_counts)
    assert kv.num_free_blocks == kv.num_blocks
    assert len(kv.pool.free_ids) + kv.num_cached_blocks == kv.num_blocks


def test_priority_arrival_preempts_and_finishes_first(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), scheduling_policy="priority", max_num_seqs=2)
    eng = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    rng = random.Random(4)
    eng.add_request("low-1", ids(rng, 20), long, priority=10)
    eng.add_request("low-2", ids(rng, 20), long, priority=10)
    for _ in range(3):
        eng.step()
    assert len(eng.scheduler.running) == 2  # the server is full
    eng.add_request("urgent", ids(rng, 20), short, priority=0)
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
    assert finished[0] == "urgent"
    assert eng.scheduler.num_preemptions >= 1
    assert_no_leak(llm)


def test_lpm_policy_runs_the_longest_cached_prefix_first(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), scheduling_policy="lpm", max_num_seqs=1, block_size=8)
    eng = llm.engine
    rng = random.Random(5)
    shared = ids(rng, 64)
    llm.generate([shared + ids(rng, 4)], GREEDY)  # warm the cache with `shared`
    eng.add_request("cold", ids(rng, 70), GREEDY)
    eng.add_request("warm", shared + ids(rng, 6), GREEDY)
    first = eng.step()
    assert eng.scheduler.running[0].request_id == "warm" or any(o.request_id == "warm" for o in first)
    while eng.has_unfinished_requests():
        eng.step()
    assert_no_leak(llm)


def test_prompt_logprobs_bypass_the_cache(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), block_size=8)
    prompt = ids(random.Random(6), 40)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    first = llm.generate([prompt], params)[0].prompt_logprobs
    second = llm.generate([prompt], params)[0].prompt_logprobs  # its prefix is cached by now
    assert len(first) == len(second) == len(prompt) and first[0] is None
    assert [lp.logprob for lp in first[1:]] == [lp.logprob for lp in second[1:]]
    assert_no_leak(llm)


def absorb(out: dict[str, tuple[list[int], int]], outputs) -> None:
    """Gather step outputs: request id -> (its tokens so far, its prompt tokens found cached)."""
    for o in outputs:
        tokens, _ = out.get(o.request_id, ([], 0))
        out[o.request_id] = (tokens + o.deltas[0].token_ids, o.num_cached_tokens)


def test_reset_prefix_cache_drops_what_no_request_holds(tiny_llama: Path) -> None:
    """After a reset a cached prompt is a miss; a running request's blocks stay cached and it finishes
    as it would have, though a long prompt then takes every free block (the freed ones first)."""
    rng = random.Random(9)
    cached, running, filler = ids(rng, 64), ids(rng, 40), ids(rng, 200)
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cold = LLM(str(tiny_llama), block_size=8, enable_prefix_caching=False).generate([cached, running], [GREEDY, long])
    llm = LLM(str(tiny_llama), block_size=8, num_kv_blocks=48)
    engine, kv, out = llm.engine, llm.engine.kv, {}
    assert llm.generate([cached], GREEDY)[0].outputs[0].token_ids == cold[0].outputs[0].token_ids
    engine.add_request("running", running, long)
    for _ in range(3):  # prefilled and decoding: it holds its blocks, and its prompt's are cached
        absorb(out, engine.step())
    table = engine.requests["running"][0].block_table
    held = {b for b in table if kv.cache.contains_block(b)}
    assert len(held) == 5 and kv.num_cached_blocks > len(held)
    assert engine.reset_prefix_cache() is False  # the running request's blocks stay
    assert set(kv.cache.by_block) == held and kv.num_free_blocks == kv.num_blocks - len(table)
    engine.add_request("again", cached, GREEDY)
    engine.add_request("filler", filler, GREEDY)
    while engine.has_unfinished_requests():
        absorb(out, engine.step())
    assert out["again"] == (cold[0].outputs[0].token_ids, 0)  # a miss, and the same tokens
    assert out["running"][0] == cold[1].outputs[0].token_ids
    assert engine.reset_prefix_cache() is True
    assert kv.num_cached_blocks == 0 and len(kv.pool.free_ids) == kv.num_blocks
    assert engine.kv_events.snapshot().blocks == []  # every drop was published
    assert kv.stats.evictions == 0  # dropped, not evicted for room
    assert_no_leak(llm)
