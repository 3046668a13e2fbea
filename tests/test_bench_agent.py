"""`ladle bench` agent sessions: turn order, think times, cache figures per turn, reasoning replies."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ladle.bench.client import RequestResult
from ladle.bench.datasets import SampleRequest, agent_dataset
from ladle.bench.metrics import agent_turn_metrics, per_request_fields
from ladle.bench.report import format_turn_table
from ladle.bench.runner import LoadSpec
from ladle.cli import main as ladle_main
from test_bench import FakeOpenAI, _close, _run, serve


def _sessions(thinks: list[list[float]], output_len: int) -> list[SampleRequest]:
    """One session per list of think times, interleaved turn by turn as agent_dataset does."""
    sessions = [[SampleRequest(prompt=f"session {s} turn {t}", prompt_len=4, output_len=output_len, session_id=s,
                               turn=t, think_time=think) for t, think in enumerate(session)]
                for s, session in enumerate(thinks)]
    return [turn for turns in zip(*sessions) for turn in turns]


# ---------------------------------------------------------------- when turns go out


def test_agent_turns_are_sent_in_session_order():
    app = FakeOpenAI(ttft=0.01, itl=0.004)
    reqs = agent_dataset(np.random.default_rng(0), 9, turns=3, system_len=16, burst_len=8, output_len=4,
                         tokens_per_word=1.0)
    with serve(app) as url:
        run = _run(url, reqs)
    assert all(r.success for r in run.results)
    span = {prompt: (start, end) for prompt, start, end in app.spans}
    for before, after in zip(reqs, reqs[3:]):  # turn k of session s, then turn k+1 of s
        assert before.session_id == after.session_id
        assert span[after.prompt][0] >= span[before.prompt][1]


def test_think_time_passes_after_the_answer_and_is_neither_queue_time_nor_ttft():
    # each turn streams ~170 ms; session 0's second turn follows at once, its third after 250 ms
    app = FakeOpenAI(ttft=0.02, itl=0.01)
    reqs = _sessions([[0.0, 0.0, 0.25], [0.0, 0.15, 0.2]], output_len=16)
    with serve(app) as url:
        run = _run(url, reqs)
    assert all(r.success for r in run.results)
    span = {prompt: (start, end) for prompt, start, end in app.spans}
    for k, (before, after) in enumerate(zip(reqs, reqs[2:])):
        prev, result = run.results[k], run.results[k + 2]
        server_gap = span[after.prompt][0] - span[before.prompt][1]
        client_gap = result.start_time - (prev.start_time + prev.latency)
        assert after.think_time - 0.002 <= server_gap < after.think_time + 0.15  # the tool ran, then the turn left
        assert client_gap >= after.think_time - 0.002
        # neither the wait for the previous answer (170 ms) nor the tool's run (150+ ms) is latency
        assert result.queue_time < 0.08 and 0.019 <= result.ttft < 0.12


def test_only_a_sessions_first_turn_keeps_its_slot_in_the_schedule():
    # 6 requests at 2 req/s, evenly spaced: slots at 0.5, 1.0, ..., 3.0 s. The sessions start at 0.5 and
    # 1.0 s; their later turns follow their answers after 50 ms each, not the 1.5..3 s slots.
    app = FakeOpenAI(ttft=0.01, itl=0.005)
    reqs = _sessions([[0.0, 0.05, 0.05], [0.0, 0.05, 0.05]], output_len=2)
    with serve(app) as url:
        run = _run(url, reqs, LoadSpec(request_rate=2.0, burstiness=math.inf))
    assert all(r.success for r in run.results)
    starts = [r.start_time for r in run.results]
    assert _close((starts[1] - starts[0]) * 1000, 500.0, rel=0.1, abs_ms=20.0)
    assert run.arrival_span == pytest.approx(1.0)
    assert starts[2] - starts[0] < 0.3 and starts[4] - starts[0] < 0.5  # session 0 ran on, slots unwaited
    assert run.duration < 2.0  # the last slot was at 3 s


# ---------------------------------------------------------------- what the client reads


def test_cached_tokens_come_from_the_usage_and_turns_from_the_request():
    reqs = _sessions([[0.0, 0.0]], output_len=2) + [SampleRequest(prompt="a b c d e f", prompt_len=6, output_len=2)]
    with serve(FakeOpenAI(ttft=0.01, itl=0.002, cached_fraction=0.5)) as url:
        cached = _run(url, reqs).results
    with serve(FakeOpenAI(ttft=0.01, itl=0.002)) as url:
        plain = _run(url, reqs[2:]).results
    assert [r.cached_tokens for r in cached] == [2, 2, 3]  # half of 4, 4 and 6 prompt tokens
    assert [r.turn for r in cached] == [0, 1, None]
    assert plain[0].success and plain[0].cached_tokens is None  # the server said nothing
    fields = per_request_fields(cached)
    assert fields["cached_tokens"] == [2, 2, 3] and fields["turns"] == [0, 1, None]
    assert "cached_tokens" not in per_request_fields(plain) and "turns" not in per_request_fields(plain)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_a_reasoning_reply_counts_its_thinking_for_ttft(field: str):
    app = FakeOpenAI(ttft=0.05, itl=0.05, reasoning_chunks=3, reasoning_field=field)
    req = SampleRequest(prompt="think please", prompt_len=2, output_len=5, endpoint="/v1/chat/completions")
    with serve(app) as url:
        result = _run(url, [req]).results[0]
    assert result.success and 49.0 <= result.ttft * 1000 < 150.0  # the first content came at 200 ms
    assert result.reasoning_text == " w0 w1 w2" and result.generated_text == " w3 w4"
    assert len(result.itl) == 4


# ---------------------------------------------------------------- per-turn figures


def _done(turn: int | None, prompt: int, cached: int | None, ttft: float, success: bool = True) -> RequestResult:
    return RequestResult(success=success, prompt_len=prompt, cached_tokens=cached, ttft=ttft, turn=turn)


def test_agent_turn_metrics_by_hand():
    results = [
        _done(0, 100, 0, 0.1), _done(0, 100, 50, 0.3),
        _done(1, 200, 150, 0.2), _done(1, 220, None, 0.4), _done(1, 300, 200, 0.6), _done(1, 999, 0, 9.0, False),
        _done(2, 500, 500, 1.0, success=False),  # a turn whose every request failed
        _done(None, 1000, 0, 5.0),  # not part of a session
    ]
    m = agent_turn_metrics(results)
    turn0, turn1, turn2 = m["per_turn"]
    assert turn0 == pytest.approx({"turn": 0, "requests": 2, "ttft_p50_ms": 200.0, "ttft_p99_ms": 298.0,
                                   "prompt_tokens_mean": 100.0, "cached_tokens_mean": 25.0, "prefix_hit_rate": 0.25,
                                   "reprefilled_tokens_mean": 75.0})
    # cache figures over the two requests that reported cached tokens; TTFT and prompt over all three
    assert turn1 == pytest.approx({"turn": 1, "requests": 3, "ttft_p50_ms": 400.0, "ttft_p99_ms": 596.0,
                                   "prompt_tokens_mean": 240.0, "cached_tokens_mean": 175.0, "prefix_hit_rate": 0.7,
                                   "reprefilled_tokens_mean": 75.0})
    assert turn2["turn"] == 2 and turn2["requests"] == 0
    assert all(turn2[k] is None for k in turn2 if k not in ("turn", "requests"))
    assert m["agent"] == pytest.approx({"prefix_hit_rate": 400 / 700, "reprefilled_tokens_total": 300,
                                        "reprefilled_tokens_per_turn_mean": 75.0})  # turn 1's 50 and 100
    assert agent_turn_metrics([_done(None, 10, 5, 0.1)]) is None  # no sessions, no agent figures
    silent = agent_turn_metrics([_done(0, 10, None, 0.1), _done(1, 20, None, 0.1)])  # a server without cache figures
    assert [t["requests"] for t in silent["per_turn"]] == [1, 1] and silent["per_turn"][1]["prefix_hit_rate"] is None
    assert silent["agent"] == {"prefix_hit_rate": None, "reprefilled_tokens_total": None,
                               "reprefilled_tokens_per_turn_mean": None}


def test_turn_table():
    m = agent_turn_metrics([_done(0, 100, 0, 0.1), _done(0, 100, 50, 0.3), _done(1, 200, None, 0.2)])
    lines = format_turn_table(m["per_turn"], m["agent"]).splitlines()
    assert "Agent Turns" in lines[0] and lines[1].split()[:2] == ["turn", "reqs"]
    assert lines[2].split() == ["0", "2", "200.0", "298.0", "100", "25", "25.0%", "75"]
    assert lines[3].split() == ["1", "1", "200.0", "200.0", "200", "-", "-", "-"]
    assert lines[-2] == "all turns: hit rate 25.0%, re-prefilled 150 tokens, - a turn after the first"
    assert "all turns" not in format_turn_table(m["per_turn"])


def test_agent_cli_reports_each_turns_cache_hits(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    app = FakeOpenAI(ttft=0.01, itl=0.002, cached_fraction=0.75)
    with serve(app) as url:
        rc = ladle_main(["bench", "serve", "--base-url", url, "--model", "m", "--dataset", "agent", "--num-prompts",
                         "6", "--agent-turns", "3", "--agent-system-len", "40", "--agent-burst-len", "20",
                         "--agent-output-len", "2", "--agent-think-time", "0.02", "--save-result", "--save-detailed",
                         "--result-dir", str(tmp_path), "--result-filename", "a.json", "--disable-tqdm",
                         "--skip-initial-test"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.index("Serving Benchmark Result") < out.index("Agent Turns") < out.index("all turns: hit rate")
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["provenance"]["flags"]["agent_think_time"] == 0.02
    assert result["turns"] == [0, 0, 1, 1, 2, 2]
    prompts = result["input_lens"]  # the usage's prompt tokens, in request order
    assert sorted(prompts) == sorted(len(b["prompt"].split()) for p, b in app.bodies if p == "/v1/completions")
    cached = [int(n * 0.75) for n in prompts]
    assert result["cached_tokens"] == cached
    assert [t["turn"] for t in result["per_turn"]] == [0, 1, 2] and all(t["requests"] == 2 for t in result["per_turn"])
    first = result["per_turn"][0]
    assert first["prompt_tokens_mean"] == pytest.approx(np.mean(prompts[:2]))
    assert first["reprefilled_tokens_mean"] == pytest.approx(np.mean([p - c for p, c in zip(prompts[:2], cached)]))
    assert result["agent"]["prefix_hit_rate"] == pytest.approx(sum(cached) / sum(prompts))
    assert result["agent"]["reprefilled_tokens_total"] == sum(prompts) - sum(cached)
    later = [p - c for p, c in zip(prompts[2:], cached[2:])]
    assert result["agent"]["reprefilled_tokens_per_turn_mean"] == pytest.approx(np.mean(later))
