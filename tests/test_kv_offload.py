"""The second KV tier in the engine: a session whose prefix the cache evicted under pressure is read
back from disk on its next turn, not recomputed, and continues exactly as if never evicted; a
corrupt or missing file means recompute, never wrong output; the tier's bound holds."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from ladle import LLM
from ladle.engine.request import TokenLogprob
from ladle.engine.sampling_params import SamplingParams
from ladle.model.attention import KVCache

POOL_BLOCKS = 24  # 384 tokens: one session's prompt fits, two others push it out
PRESSURE = (2, 3, 4)  # three other prompts of 180 tokens: every block of the session's is evicted
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def block_gib(model_dir: Path, blocks: int) -> float:
    from ladle.model.config import ModelConfig

    c = ModelConfig.from_folder(model_dir)
    return blocks * KVCache.bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim) / 2**30


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 40000) for _ in range(n)]


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], list[TokenLogprob], int]:
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.outputs[0].logprobs, out.num_cached_tokens


def session(llm: LLM, evict: bool) -> tuple[list[int], list[TokenLogprob], int]:
    """Turn 1 of a session; with evict, other prompts then fill the pool; then turn 2, which
    extends turn 1's prompt and output. Returns turn 2's output, logprobs and cached tokens."""
    first = tokens(1, 176)
    out, _, _ = run(llm, first)
    if evict:
        for seed in PRESSURE:
            run(llm, tokens(seed, 180))
    return run(llm, first + out + tokens(9, 40))


def assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.kv
    assert all(c == 0 for c in kv.pool.ref_counts), "a block is still referenced"
    assert kv.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def never_evicted(smollm2_dir: Path) -> dict[bool, tuple]:
    """Turn 2 on a pool big enough that nothing is ever evicted, per deterministic mode."""
    out = {}
    for deterministic in (True, False):
        llm = LLM(str(smollm2_dir), num_kv_blocks=256, deterministic=deterministic)
        out[deterministic] = session(llm, evict=False)
    return out


def offload_llm(model_dir: Path, tmp_path: Path, blocks: int = 64, **kw) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=POOL_BLOCKS, kv_offload_gib=block_gib(model_dir, blocks),
               kv_offload_dir=str(tmp_path), **kw)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_an_evicted_session_is_restored_and_continues_as_never_evicted(smollm2_dir: Path, tmp_path: Path,
                                                                       never_evicted: dict, deterministic: bool) -> None:
    llm = offload_llm(smollm2_dir, tmp_path, deterministic=deterministic)
    tier = llm.engine.kv.offload.tier
    out, logprobs, cached = session(llm, evict=True)
    want_out, want_logprobs, want_cached = never_evicted[deterministic]
    assert tier.stats.stored >= 11  # turn 1's prompt blocks went to disk
    # and came back (those the tree had not kept) rather than recomputed: the whole prefix is a hit
    assert tier.stats.restored >= 5 and cached >= 176
    # every whole block is back; a partly filled last block stays only in the tree, never on disk
    assert cached == want_cached // 16 * 16
    assert out == want_out
    if deterministic:  # restored K/V are the bits that were computed: the logprobs too
        assert [lp.logprob for lp in logprobs] == [lp.logprob for lp in want_logprobs]
    assert_no_leak(llm)


def test_without_the_tier_the_session_is_recomputed(smollm2_dir: Path, never_evicted: dict) -> None:
    llm = LLM(str(smollm2_dir), num_kv_blocks=POOL_BLOCKS)
    out, _, cached = session(llm, evict=True)
    assert cached < 176 and llm.engine.kv.offload is None
    assert out == never_evicted[False][0]


def test_a_reset_prefix_cache_empties_the_tier_too(smollm2_dir: Path, tmp_path: Path) -> None:
    """After reset_prefix_cache, turn 1's prompt is computed again: neither the tree nor the tier has it."""
    llm = offload_llm(smollm2_dir, tmp_path)
    tier = llm.engine.kv.offload.tier
    first = tokens(1, 176)
    want, _, _ = run(llm, first)
    for seed in PRESSURE[:2]:  # evicts turn 1's blocks to the tier
        run(llm, tokens(seed, 180))
    assert tier.num_blocks > 0 and llm.engine.kv.num_cached_blocks > 0
    assert llm.engine.reset_prefix_cache()
    assert tier.num_blocks == llm.engine.kv.num_cached_blocks == 0 and not list(Path(tier.directory).glob("*.kv"))
    out, _, cached = run(llm, first)
    assert cached == 0 and tier.stats.restored == 0 and out == want
    assert_no_leak(llm)


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_tier_file_falls_back_to_recompute(smollm2_dir: Path, tmp_path: Path, never_evicted: dict,
                                                     damage: str) -> None:
    llm = offload_llm(smollm2_dir, tmp_path, deterministic=True)
    tier = llm.engine.kv.offload.tier
    first = tokens(1, 176)
    out, _, _ = run(llm, first)
    for seed in PRESSURE:
        run(llm, tokens(seed, 180))
    files = sorted(Path(tier.directory).glob("*.kv"))
    assert len(files) == tier.num_blocks >= 11
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "corrupt":
            data[-7] ^= 0x5A
            f.write_bytes(bytes(data))
        elif damage == "truncate":
            f.write_bytes(bytes(data[: len(data) // 2]))
        else:
            f.unlink()
    dropped = tier.stats.dropped
    second, logprobs, cached = run(llm, first + out + tokens(9, 40))
    assert tier.stats.restored == 0 and tier.stats.dropped > dropped
    assert cached < 176  # recomputed
    want_out, want_logprobs, _ = never_evicted[True]
    assert second == want_out
    assert [lp.logprob for lp in logprobs] == [lp.logprob for lp in want_logprobs]
    assert_no_leak(llm)


def test_the_tier_stays_within_its_bound(smollm2_dir: Path, tmp_path: Path) -> None:
    llm = offload_llm(smollm2_dir, tmp_path, blocks=6)
    tier = llm.engine.kv.offload.tier
    for seed in range(5):
        run(llm, tokens(10 + seed, 200))
    assert tier.stats.stored > 6 and tier.stats.dropped > 0
    assert tier.num_blocks <= 6 and tier.used_bytes <= tier.capacity_bytes
    assert len(list(Path(tier.directory).glob("*.kv"))) == tier.num_blocks
    assert_no_leak(llm)


def test_the_tier_needs_prefix_caching(smollm2_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(str(smollm2_dir), num_kv_blocks=POOL_BLOCKS, kv_offload_gib=0.01, kv_offload_dir=str(tmp_path),
            enable_prefix_caching=False)


def test_the_server_reports_the_tier_in_metrics(smollm2_dir: Path, tmp_path: Path) -> None:
    from server_utils import own_server

    from ladle.config import EngineConfig

    config = EngineConfig(model=str(smollm2_dir), num_kv_blocks=POOL_BLOCKS, kv_offload_dir=str(tmp_path),
                          kv_offload_gib=block_gib(smollm2_dir, 64))
    with own_server(config) as server:
        def complete(prompt: list[int]) -> dict:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()["usage"]

        first = tokens(1, 176)
        complete(first)
        for seed in PRESSURE:
            complete(tokens(seed, 180))
        usage = complete(first + tokens(9, 40))
        metrics = server.scrape()
    assert usage["prompt_tokens_details"]["cached_tokens"] == 176  # the session's prefix, read back
    assert metrics["ladle:kv_offload_restored_blocks_total"] >= 5
    assert metrics["ladle:kv_offload_stored_blocks_total"] >= 11
    assert metrics["ladle:kv_offload_dropped_blocks_total"] == 0
    assert metrics["ladle:kv_offload_restore_seconds_per_block"] > 0
