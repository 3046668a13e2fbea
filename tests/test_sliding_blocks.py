"""Blocks behind a sliding window go back to the pool: a model whose every layer has a window holds
about window / block_size + 1 blocks a sequence, however long it runs; one with full layers keeps
every block. The prefix cache lets go of such blocks too (its nodes go hollow), and a later prompt
still hits through them as long as the blocks its window reads are cached. Checked on the block
manager, then end to end against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_deterministic import question
from test_engine_vs_hf import PROMPTS
from test_sliding_window import WINDOW, check_against_transformers
from tiny_models import build_tiny_model

from ladle import LLM, SamplingParams
from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.prefix_cache import HOLLOW
from ladle.engine.request import Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BS = 4  # block size of the block-manager tests (their window is WINDOW = 8: two blocks)


def seq(tokens: list[int], canonical: bool = False) -> Sequence:
    return Sequence(seq_id=0, request_id="r", index=0, token_ids=tokens, num_prompt_tokens=len(tokens),
                    params=GREEDY, arrival_time=0.0, canonical=canonical)


def run(kv: KVCacheManager, s: Sequence, chunk: int = 7) -> list[int]:
    """Compute s chunk by chunk as the scheduler steps it; returns the blocks it held at each step."""
    held = []
    while s.num_computed_tokens < s.num_tokens:
        n = min(chunk, s.num_tokens - s.num_computed_tokens)
        kv.release_out_of_window(s)
        assert kv.allocate_slots(s, n)
        assert all(b != HOLLOW for b in s.block_table[kv.first_needed_block(s.num_computed_tokens) :])
        held.append(sum(b != HOLLOW for b in s.block_table))
        s.num_computed_tokens += n
        kv.cache_full_blocks(s)
    return held


def assert_baseline(kv: KVCacheManager) -> None:
    assert all(c == 0 for c in kv.pool.ref_counts), "a block is still referenced"
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_sequence_holds_its_window_and_gives_back_the_rest(prefix_caching: bool) -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS, enable_prefix_caching=prefix_caching, window=WINDOW)
    s = seq(list(range(100)))
    held = run(kv, s)
    # the window's blocks, a 7-token step's, and a partial block at each end
    assert max(held) <= (WINDOW + 7) // BS + 2 and held[-1] < kv.blocks_for(100) // 4
    if not prefix_caching:  # nothing caches them: the blocks behind the window are free again
        assert len(kv.pool.free_ids) == 64 - held[-1]
    kv.free(s)
    assert_baseline(kv)


def test_without_a_window_every_block_is_held() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    held = run(kv, s := seq(list(range(100))))
    assert held[-1] == kv.blocks_for(98) and HOLLOW not in s.block_table
    kv.free(s)
    assert_baseline(kv)


def test_evicted_inner_blocks_go_hollow_and_a_hit_needs_only_the_window() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS, window=WINDOW)
    a = seq(list(range(40)))
    run(kv, a)  # 10 blocks, all cached; 0..7 fell behind the window, unreferenced
    kv.free(a)
    filler = seq(list(range(1000, 1012)))  # 3 blocks: 2 free ones, and the oldest cached one evicted
    run(kv, filler)
    root = kv.cache.root()
    first = root.children[tuple(range(BS))]
    assert first.hollow and first.children and not first.detached  # the path is kept, its K/V are gone
    kv.free(filler)
    # A prompt sharing all 40 tokens: its window reaches back to blocks 8 and 9, both cached
    b = seq(list(range(40)) + [7, 7, 7, 7])
    assert kv.match_prefix(b) == 40
    needed = kv.first_needed_block(40)
    assert b.block_table[:needed] == [HOLLOW] * needed and HOLLOW not in b.block_table[needed:]
    assert [kv.pool.ref_counts[x] for x in b.block_table[needed:]] == [1] * (10 - needed)
    run(kv, b)
    kv.free(b)
    assert_baseline(kv)


def test_a_hit_stops_where_the_window_would_read_a_hollow_block_and_recomputing_fills_it() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, window=WINDOW)
    a = seq(list(range(40)))
    run(kv, a)  # a keeps running: it holds blocks 8 and 9; 0..7 are cached and unreferenced
    for _ in range(5):
        kv._evict_one()  # the five oldest: blocks 0..4 go hollow
    b = seq(list(range(24)) + [5, 5, 5])
    assert kv.cached_prefix_len(b) == 0  # every shorter hit's window reads one of blocks 0..4
    assert kv.match_prefix(b) == 0
    run(kv, b)  # b computes blocks 0..5 again: the hollow nodes take its blocks
    node = kv.cache.root()
    for k in range(6):
        node = node.children[tuple(range(k * BS, (k + 1) * BS))]
        assert not node.hollow and kv.cache.by_block[node.block_id] is node
    kv.free(a)
    kv.free(b)
    assert_baseline(kv)
    assert kv.reset_prefix_cache() and not kv.cache.root().children  # hollow leaves went with the rest


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model("mistral", tmp_path_factory.mktemp("mistral"), smollm2_dir, sliding_window=WINDOW)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def blocks_held_while_running(llm: LLM, prompt: str, max_tokens: int) -> list[int]:
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held += [sum(b != HOLLOW for b in s.block_table) for s in engine.scheduler.running]
    return held


def test_a_windowed_model_holds_its_window_and_the_pool_comes_back(mistral) -> None:
    folder, hf_model = mistral
    llm = LLM(str(folder), dtype="float32", block_size=8, max_num_batched_tokens=16)
    prompt = PROMPTS[6] * 2
    held = blocks_held_while_running(llm, prompt, 24)
    assert len(llm.tokenizer.encode(prompt)) > 12 * WINDOW
    assert max(held) <= (WINDOW + 16) // 8 + 2  # its window, a step's tokens, a partial block at each end
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    check_against_transformers(llm, hf_model, [prompt])


def test_a_model_with_full_layers_keeps_every_block(tmp_path: Path, smollm2_dir: Path) -> None:
    folder = build_tiny_model("gemma3", tmp_path, smollm2_dir)  # windows on alternate layers
    llm = LLM(str(folder), dtype="float32", block_size=8, max_num_batched_tokens=16)
    assert llm.engine.kv.window is None
    prompt = PROMPTS[6] * 2
    held = blocks_held_while_running(llm, prompt, 8)
    assert held[-1] == llm.engine.kv.blocks_for(len(llm.tokenizer.encode(prompt)) + 7)


def test_hits_through_hollow_blocks_match_transformers_and_score_the_same_bits(mistral, kernels: str) -> None:
    """A pool so small that a long prompt's early blocks are evicted (hollow) by the next prompts; the
    long prompt extended then starts from its window's cached blocks, generation matches
    transformers, and a canonical question scores the same bits cold and from such a hit: on the native
    kernels, and on torch's block-aligned tiles (which read a released block as block 0, masked)."""
    folder, hf_model = mistral
    llm = LLM(str(folder), dtype="float32", block_size=8, num_kv_blocks=24, max_num_batched_tokens=16)
    kv = llm.engine.kv
    prefix = PROMPTS[6] * 2
    llm.generate([prefix], SamplingParams(max_tokens=1))
    llm.generate([PROMPTS[4], PROMPTS[7]], SamplingParams(max_tokens=1))  # evicts the oldest blocks
    assert any(node.hollow for node in kv.cache.match(llm.tokenizer.encode(prefix), 64))
    hits = kv.stats.hits
    check_against_transformers(llm, hf_model, [prefix + " The mission"], prompt_logprobs=False)
    assert kv.stats.hits - hits >= 8 * WINDOW

    text = " ".join(["alpha", "ticket", "billing", "server", "network"] * 30)
    labels = [llm.tokenizer.encode(x)[0] for x in ("A", "B")]
    score = SamplingParams(label_token_ids=labels)
    cold = LLM(str(folder), dtype="float32", block_size=8, max_num_batched_tokens=16)
    want = cold.generate([question(cold, text, 0)], score)[0].outputs[0].label_logprobs
    llm.generate([question(llm, text, 0)], score)
    llm.generate([PROMPTS[4], PROMPTS[7]], SamplingParams(max_tokens=1))
    hollow = [node.hollow for node in kv.cache.match(llm.tokenizer.encode(question(llm, text, 0)), 64, True)]
    assert hollow[0] and not hollow[-1]
    hits = kv.stats.hits
    got = llm.generate([question(llm, text, 0)], score)[0].outputs[0].label_logprobs
    assert kv.stats.hits - hits > 8 * WINDOW and got == want
    assert kv.num_free_blocks == kv.num_blocks


def test_random_traffic_keeps_the_books_straight() -> None:
    """Prompts sharing random prefixes, computed in random chunks, some freed mid-way (preempted), some
    finished, under a pool small enough that the tree evicts and hollows all the time. After every
    operation: each block is free, cached or referenced, and counted once; every block a sequence's
    window reads is held; and at the end the pool is back at its baseline."""
    import random

    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=40, block_size=BS, window=WINDOW)
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(4, 40))] for _ in range(5)]
    running: list[Sequence] = []

    def check() -> None:
        referenced = {b for b, c in enumerate(kv.pool.ref_counts) if c > 0}
        cached = {b for b in kv.cache.by_block if kv.pool.ref_counts[b] == 0}
        free = set(kv.pool.free_ids)
        assert len(free) == len(kv.pool.free_ids), "a block is on the free list twice"
        assert not (free & referenced) and not (free & cached) and len(free | referenced | cached) == kv.num_blocks
        assert kv.num_cached_unreferenced == len(cached) and set(kv.cache.evictable) == cached
        for s in running:
            live = s.block_table[kv.first_needed_block(s.num_computed_tokens) :]
            assert all(b != HOLLOW and kv.pool.ref_counts[b] > 0 for b in live)
            released = sum(b == HOLLOW for b in s.block_table)
            assert all(b == HOLLOW for b in s.block_table[:released])  # the released blocks lead the table

    for step in range(400):
        action = rng.random()
        if action < 0.35 or not running:
            tokens = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
            s = seq(tokens)
            kv.match_prefix(s)
            running.append(s)
        elif action < 0.85:
            s = rng.choice(running)
            left = s.num_tokens - s.num_computed_tokens
            if left == 0:
                s.token_ids.append(rng.randrange(1000))  # a generated token
                left = 1
            n = min(left, rng.randrange(1, 12))
            kv.release_out_of_window(s)
            if kv.allocate_slots(s, n):
                s.num_computed_tokens += n
                kv.cache_full_blocks(s)
            else:  # preempted: back to nothing, recomputed later from whatever the cache still has
                kv.free(s)
                s.num_computed_tokens = 0
                kv.match_prefix(s)
        else:
            s = running.pop(rng.randrange(len(running)))
            kv.free(s, keep_partial=True)
        check()
    for s in running:
        kv.free(s, keep_partial=True)
    running.clear()
    check()
    assert_baseline(kv)
    assert kv.stats.evictions > 20  # the pool was tight: the tree evicted and hollowed throughout
