"""The datasets of `ladle bench`: lengths, parsing, shared prefixes, agent sessions, decisions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ladle.bench.datasets import (SampleRequest, agent_dataset, decisions_dataset, load_sharegpt, prefix_dataset,
                                  random_dataset, sharegpt_dataset)


def test_random_dataset_lengths():
    rng = np.random.default_rng(0)
    reqs = random_dataset(rng, 50, input_len=100, output_len=20, range_ratio=0.5, prefix_len=30, tokens_per_word=1.0)
    prefix = reqs[0].prompt.split()[:30]
    for r in reqs:
        words = r.prompt.split()
        assert words[:30] == prefix
        assert 30 + 50 <= len(words) == r.prompt_len <= 30 + 150
        assert 10 <= r.output_len <= 30
    assert len({r.prompt for r in reqs}) == 50
    half = random_dataset(np.random.default_rng(0), 1, 100, 20, 0.0, 0, tokens_per_word=2.0)[0]
    assert len(half.prompt.split()) == 50 and half.prompt_len == 100


def test_sharegpt_parsing(tmp_path: Path):
    long_q, long_a = "What is a paged KV cache? " * 3, "It splits the cache into fixed-size blocks. " * 3
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": long_q}, {"from": "gpt", "value": long_a}]},
        {"id": "one-turn", "conversations": [{"from": "human", "value": long_q}]},
        {"id": "too-short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_a}]},
        {"id": "b", "conversations": [{"role": "user", "content": "Explain continuous batching in detail."},
                                      {"role": "assistant", "content": long_a}, {"from": "human", "value": "x"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    pairs = load_sharegpt(path)
    assert len(pairs) == 3 and pairs[0] == (long_q, long_a)
    reqs = sharegpt_dataset(np.random.default_rng(0), 5, pairs)
    assert len(reqs) == 5  # two usable conversations, oversampled
    assert {r.prompt for r in reqs} == {long_q, "Explain continuous batching in detail."}
    assert all(r.output_len == round(len(long_a) / 4) for r in reqs)
    assert all(r.output_len == 32 for r in sharegpt_dataset(np.random.default_rng(0), 3, pairs, output_len=32))


def test_prefix_dataset_shares_the_prefix():
    reqs = prefix_dataset(np.random.default_rng(0), 20, prefix_len=64, suffix_len=16, num_prefixes=1,
                          output_len=8, tokens_per_word=1.0)
    shared = reqs[0].prompt.split("\n\nUser:")[0]
    assert len(shared.split()) >= 64
    assert all(r.prompt.startswith(shared + "\n\nUser:") for r in reqs)
    assert len({r.prompt for r in reqs}) == 20  # tails vary
    two = prefix_dataset(np.random.default_rng(0), 20, 64, 16, 2, 8, 1.0)
    assert len({r.prompt.split("\n\nUser:")[0] for r in two}) == 2


def test_agent_sessions_grow():
    reqs = agent_dataset(np.random.default_rng(0), 14, turns=4, system_len=64, burst_len=32, output_len=8,
                         tokens_per_word=1.0)
    assert len(reqs) == 14 and [r.session_id for r in reqs[:4]] == [0, 1, 2, 3]  # interleaved by turn
    system = reqs[0].prompt.split("\n\nUser:")[0]
    sessions: dict[int, list[SampleRequest]] = {}
    for r in reqs:
        assert r.prompt.startswith(system)
        sessions.setdefault(r.session_id, []).append(r)
    assert sorted(len(s) for s in sessions.values()) == [3, 3, 4, 4]
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for before, after in zip(turns, turns[1:]):
            assert after.prompt.startswith(before.prompt) and after.prompt_len > before.prompt_len
            assert "<tool_result>" in after.prompt[len(before.prompt):]


def test_agent_think_times_are_seeded_with_the_mean_asked_for():
    def times(seed: int, mean: float = 2.0) -> list[float]:
        reqs = agent_dataset(np.random.default_rng(seed), 2000, turns=5, system_len=4, burst_len=4, output_len=1,
                             tokens_per_word=1.0, think_time=mean)
        assert all(r.think_time == 0 for r in reqs if r.turn == 0)  # nothing runs before a session's first turn
        return [r.think_time for r in reqs if r.turn]

    assert times(1) == times(1) != times(2)
    assert len(times(1)) == 1600 and min(times(1)) > 0
    assert np.mean(times(1)) == pytest.approx(2.0, rel=0.1)
    assert np.std(times(1)) == pytest.approx(2.0, rel=0.15)  # exponential: as spread as its mean
    assert not any(times(1, mean=0.0))
    with pytest.raises(ValueError):
        agent_dataset(np.random.default_rng(0), 4, 2, 4, 4, 1, 1.0, think_time=-1.0)


def test_decisions_dataset_shape():
    reqs = decisions_dataset(np.random.default_rng(0), 3, input_len=32, num_questions=3, num_options=5,
                             tokens_per_word=1.0)
    for r in reqs:
        assert r.endpoint == "/v1/decisions" and r.output_len == 0
        qs = r.body["questions"]
        assert [q["type"] for q in qs] == ["choice", "yes_no", "score"]
        assert len({q["id"] for q in qs}) == 3
        names = [o["name"] for o in qs[0]["options"]]
        assert len(names) == 5 == len({n.casefold() for n in names})
        assert 2 <= len(qs[2]["levels"]) <= 10 and r.body["input"].strip()
