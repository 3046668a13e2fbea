"""`ladle bench` against a fake OpenAI server with a known delay schedule (no engine, no model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import uvicorn

from ladle.bench.client import RequestResult, Target
from ladle.bench.datasets import SampleRequest
from ladle.bench.metrics import compute_metrics, is_good, parse_goodput, parse_percentiles, request_itl, tpot
from ladle.bench.runner import LoadSpec, arrival_times, run_load
from ladle.bench.sweep import find_knee
from ladle.cli import main as ladle_main

# ---------------------------------------------------------------- the fake server


async def read_body(receive: Any) -> bytes:
    """An ASGI request's whole body."""
    raw = b""
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            return raw


class FakeOpenAI:
    """ASGI app: streaming /v1/completions on a fixed schedule, from the moment a request is admitted:
    the first text chunk after `ttft`, then one every `itl` (absolute deadlines, so jitter does not
    accumulate). With `capacity`, at most that many requests are served at once and the rest wait in
    line, so their TTFT grows with load. Also /version, /v1/models, /tokenize (one token a word) and
    /v1/decisions. With `cached_fraction` the usage reports that share of the prompt as cached; with
    `reasoning_chunks` a chat reply's first chunks are thinking (a reasoning model), under the delta key
    `reasoning_field` (reasoning_content, or reasoning as vLLM sends it now)."""

    def __init__(self, ttft: float = 0.1, itl: float = 0.02, capacity: int | None = None, usage: bool = True,
                 tokens_per_chunk: int = 1, empty_first_chunk: bool = False, decision_delay: float = 0.03,
                 cached_fraction: float | None = None, reasoning_chunks: int = 0,
                 reasoning_field: str = "reasoning_content") -> None:
        self.ttft, self.itl, self.capacity, self.usage = ttft, itl, capacity, usage
        self.tokens_per_chunk, self.empty_first_chunk, self.decision_delay = tokens_per_chunk, empty_first_chunk, \
            decision_delay
        self.cached_fraction, self.reasoning_chunks = cached_fraction, reasoning_chunks
        self.reasoning_field = reasoning_field
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.spans: list[tuple[str, float, float]] = []  # (prompt, admitted, finished)
        self.in_flight = self.peak_in_flight = 0
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = await read_body(receive)
        body = json.loads(raw) if raw else {}
        path = scope["path"]
        self.bodies.append((path, body))
        if path == "/version":
            await _send_json(send, {"version": "fake-1.0"})
        elif path == "/v1/models":
            await _send_json(send, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        elif path == "/tokenize":
            words = (body.get("prompt") or body.get("content") or "").split()
            await _send_json(send, {"count": len(words), "tokens": list(range(len(words)))})
        elif path == "/v1/decisions":
            await asyncio.sleep(self.decision_delay)
            answers = {q["id"]: {"type": q["type"], "probabilities": {}} for q in body["questions"]}
            tokens = len(body["input"].split()) * len(body["questions"])
            await _send_json(send, {"object": "decisions", "answers": answers,
                                    "usage": {"prompt_tokens": tokens, "completion_tokens": 0}})
        elif path in ("/v1/completions", "/v1/chat/completions"):
            await self._complete(body, send, chat=path.endswith("chat/completions"))
        else:
            await _send_json(send, {"error": {"message": "not found"}}, status=404)

    async def _complete(self, body: dict[str, Any], send: Any, chat: bool) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})

        async def chunk(data: Any) -> None:
            text = data if isinstance(data, str) else json.dumps(data)
            await send({"type": "http.response.body", "body": f"data: {text}\n\n".encode(), "more_body": True})

        def piece(text: str, k: int = -1) -> dict[str, Any]:
            if chat and k < self.reasoning_chunks and k >= 0:
                return {"index": 0, "delta": {self.reasoning_field: text}}
            return {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}

        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if self.empty_first_chunk:  # as chat servers send the role first
            await chunk({"choices": [{**piece(""), **({"delta": {"role": "assistant"}} if chat else {})}]})
        if self.capacity and self._slots is None:
            self._slots = asyncio.Semaphore(self.capacity)
        n = int(body["max_tokens"])
        async with self._slots or contextlib.nullcontext():
            loop = asyncio.get_running_loop()
            admitted = loop.time()
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            for k in range(n):
                await asyncio.sleep(max(0.0, admitted + self.ttft + k * self.itl - loop.time()))
                await chunk({"choices": [piece(f" w{k}", k)]})
            self.in_flight -= 1
            self.spans.append((prompt, admitted, loop.time()))
        if self.usage:
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n * self.tokens_per_chunk}
            if self.cached_fraction is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": int(len(prompt.split()) * self.cached_fraction)}
            await chunk({"choices": [], "usage": usage})
        await chunk("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_json(send: Any, data: Any, status: int = 200) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(data).encode()})


@contextlib.contextmanager
def serve(app: FakeOpenAI) -> Iterator[str]:
    """Run `app` with uvicorn in a thread on a free loopback port; yield its base URL."""
    # IPPROTO_TCP: only then does asyncio set TCP_NODELAY on accepted connections;
    # without it every response with a body waits ~40 ms on a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _run(url: str, requests: list[SampleRequest], load: LoadSpec | None = None):
    return asyncio.run(run_load(Target(base_url=url, model="fake-model"), requests, load or LoadSpec(),
                                progress=False))


def _close(measured: float, expected: float, rel: float = 0.15, abs_ms: float = 3.0) -> bool:
    return abs(measured - expected) <= rel * expected + abs_ms


# ---------------------------------------------------------------- timing semantics


def test_timing_matches_the_servers_schedule():
    app = FakeOpenAI(ttft=0.1, itl=0.02)
    requests = [SampleRequest(prompt=f"p{i} a b c", prompt_len=1, output_len=11) for i in range(8)]
    with serve(app) as url:
        # evenly spaced arrivals: a burst of new connections on a busy 2-core box would time the harness
        run = _run(url, requests, LoadSpec(request_rate=25.0, burstiness=math.inf))
    m = compute_metrics(run.results, run.duration, [50, 90, 99])
    assert m["completed"] == 8 and m["failed"] == 0
    # TTFT: 100 ms of server delay, plus loopback and scheduling overhead (never less)
    assert 99.0 <= m["median_ttft_ms"] and _close(m["median_ttft_ms"], 100.0)
    # p90 of 8 is the second slowest, which one stall of this busy box's scheduler decides: checked as
    # the percentile of the measured TTFTs (numpy's, linear), most of which must be near 100 ms
    ttfts = [r.ttft * 1000.0 for r in run.results]
    assert m["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts, 90))
    assert sum(_close(t, 100.0, rel=0.5) for t in ttfts) >= 6
    # 11 chunks every 20 ms: TPOT = (E2EL - TTFT) / 10 = 20 ms; ITL gaps of 20 ms
    assert _close(m["mean_tpot_ms"], 20.0) and _close(m["median_tpot_ms"], 20.0)
    assert _close(m["median_itl_ms"], 20.0)
    assert _close(m["p90_itl_ms"], 20.0, rel=0.5)
    assert _close(m["median_e2el_ms"], 300.0)
    assert m["total_output_tokens"] == 8 * 11 and m["total_input_tokens"] == 8 * 4  # from usage
    assert all(len(r.itl) == 10 for r in run.results)
    sent = [b for path, b in app.bodies if path == "/v1/completions"]
    assert sent[0]["stream"] and sent[0]["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_ttft_waits_for_text_and_tpot_counts_usage_tokens(endpoint: str):
    # an empty chunk at once must not count as the first token; 2 tokens per chunk halve TPOT, not ITL
    app = FakeOpenAI(ttft=0.06, itl=0.02, empty_first_chunk=True, tokens_per_chunk=2)
    with serve(app) as url:
        run = asyncio.run(run_load(Target(base_url=url, model="m", endpoint=endpoint),
                                   [SampleRequest(prompt="x", prompt_len=1, output_len=6) for _ in range(4)],
                                   LoadSpec(request_rate=25.0, burstiness=math.inf), progress=False))
    m = compute_metrics(run.results, run.duration, [50])
    assert 59.0 <= m["median_ttft_ms"] < 90.0  # the empty chunk came at once: counted, TTFT would be ~1 ms
    assert all(r.output_tokens == 12 for r in run.results)
    assert _close(m["median_itl_ms"], 20.0)
    assert _close(m["median_tpot_ms"], 5 * 20.0 / 11)  # 100 ms over 11 tokens after the first


def test_output_tokens_fall_back_to_chunks_without_usage():
    app = FakeOpenAI(ttft=0.01, itl=0.005, usage=False)
    with serve(app) as url:
        run = _run(url, [SampleRequest(prompt="a b", prompt_len=7, output_len=5) for _ in range(3)])
    assert all(r.success and r.output_tokens == 5 and not r.usage_reported for r in run.results)
    assert all(r.prompt_len == 7 for r in run.results)  # the dataset's estimate stands in


def test_max_concurrency_caps_requests_in_flight():
    app = FakeOpenAI(ttft=0.02, itl=0.005)
    with serve(app) as url:
        run = _run(url, [SampleRequest(prompt=f"{i}", prompt_len=1, output_len=4) for i in range(6)],
                   LoadSpec(max_concurrency=2))
    assert app.peak_in_flight == 2
    assert compute_metrics(run.results, run.duration, [99])["max_concurrent_requests"] <= 2
    assert max(r.queue_time for r in run.results) > 0.03  # the last ones waited for a slot


def test_errors_are_results_not_exceptions():
    app = FakeOpenAI()
    with serve(app) as url:
        run = asyncio.run(run_load(Target(base_url=url, model="m", endpoint="/v1/nope"),
                                   [SampleRequest(prompt="a", prompt_len=1, output_len=2)], LoadSpec(),
                                   progress=False))
    r = run.results[0]
    assert not r.success and "404" in r.error
    assert compute_metrics(run.results, run.duration, [99])["failed"] == 1


# ---------------------------------------------------------------- goodput, percentiles, arrivals


def _result(ttft: float, latency: float, tokens: int, success: bool = True) -> RequestResult:
    return RequestResult(success=success, ttft=ttft, latency=latency, output_tokens=tokens, prompt_len=10,
                         itl=[(latency - ttft) / max(tokens - 1, 1)] * max(tokens - 1, 0), start_time=0.0)


def test_goodput_needs_every_slo():
    r = _result(ttft=0.1, latency=1.0, tokens=10)  # TPOT 100 ms
    assert tpot(r) == pytest.approx(0.1)
    assert is_good(r, {"ttft": 200, "tpot": 150, "e2el": 1000})
    assert not is_good(r, {"ttft": 200, "tpot": 50})
    assert not is_good(r, {"ttft": 50})
    assert not is_good(r, {"e2el": 999})
    assert not is_good(_result(0.1, 1.0, 10, success=False), {"ttft": 1e9})
    assert is_good(_result(0.1, 0.1, 1), {"tpot": 1})  # one token: TPOT counts as 0
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["ttft:500,e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["itl5"], ["ttft"], ["ttft:-1"], ["ttft:abc"], ["ttfb:5"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_the_itl_slo_holds_each_requests_p99_gap():
    """Ten gaps of 20 ms and one stall of 300 ms: TPOT (their mean, 45 ms) hides the stall, the p99 gap
    (numpy's linear interpolation: 20 + 0.9 x 280 = 272 ms) does not."""
    r = _result(ttft=0.1, latency=0.1 + 0.5, tokens=12)
    r.itl = [0.02] * 10 + [0.3]
    assert tpot(r) * 1000 == pytest.approx(500 / 11)
    assert request_itl(r) * 1000 == pytest.approx(272.0)
    assert is_good(r, {"tpot": 50}) and not is_good(r, {"itl": 250}) and is_good(r, {"itl": 275})
    assert is_good(_result(0.1, 0.1, 1), {"itl": 1})  # one token: no gap
    assert parse_goodput(["itl:200"]) == {"itl": 200.0}


def test_token_goodput_counts_the_good_requests_output_tokens():
    """By hand: 3 requests over 2 s; the two within TTFT 300 ms made 10 + 30 tokens: 20 tok/s, 1 req/s."""
    results = [_result(0.1, 1.0, 10), _result(0.2, 1.0, 30), _result(0.5, 1.0, 50)]
    m = compute_metrics(results, duration=2.0, percentiles=[99], slo={"ttft": 300})
    assert m["goodput_tok_s"] == pytest.approx(20.0) and m["request_goodput"] == pytest.approx(1.0)
    assert m["good_completed"] == 2 and m["output_throughput"] == pytest.approx(45.0)
    assert compute_metrics(results, 2.0, [99])["goodput_tok_s"] is None


def test_metrics_fields_and_goodput_arithmetic():
    results = [_result(0.1 * (i + 1), 0.1 * (i + 1) + 0.9, 10) for i in range(10)]  # TTFT 100..1000 ms
    results.append(_result(0, 0, 0, success=False))
    m = compute_metrics(results, duration=2.0, percentiles=[50, 90, 99, 99.9], slo={"ttft": 500})
    ttfts = np.arange(1, 11) * 100.0
    assert m["completed"] == 10 and m["failed"] == 1
    assert m["request_throughput"] == pytest.approx(5.0)
    assert m["request_goodput"] == pytest.approx(2.5)  # TTFT <= 500 ms: 5 of 10, over 2 s
    assert m["request_goodput"] <= m["request_throughput"]
    assert m["total_output_tokens"] == 100 and m["total_input_tokens"] == 100
    assert m["output_throughput"] == pytest.approx(50.0) and m["total_token_throughput"] == pytest.approx(100.0)
    assert m["mean_ttft_ms"] == pytest.approx(ttfts.mean()) and m["median_ttft_ms"] == pytest.approx(550.0)
    for p in (50, 90, 99, 99.9):
        key = f"p{p}_ttft_ms"
        assert m[key] == pytest.approx(np.percentile(ttfts, p))
    assert m["mean_tpot_ms"] == pytest.approx(100.0) and m["p99_itl_ms"] == pytest.approx(100.0)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", f"p99_{metric}_ms"} <= m.keys()
    assert compute_metrics(results, 2.0, [99])["request_goodput"] is None  # no SLO, as vLLM
    assert parse_percentiles("50,90,99") == [50.0, 90.0, 99.0]
    with pytest.raises(ValueError):
        parse_percentiles("0,101")


def test_arrival_times():
    rng = np.random.default_rng(0)
    assert not arrival_times(5, math.inf, 1.0, rng).any()
    poisson = arrival_times(4000, 10.0, 1.0, np.random.default_rng(1))
    assert poisson[-1] == pytest.approx(400.0) and np.all(np.diff(poisson) >= 0)
    cv = lambda t: np.diff(t).std() / np.diff(t).mean()  # noqa: E731 - gamma(shape b) has CV 1/sqrt(b)
    assert cv(poisson) == pytest.approx(1.0, rel=0.1)
    assert cv(arrival_times(4000, 10.0, 4.0, np.random.default_rng(1))) == pytest.approx(0.5, rel=0.1)
    assert cv(arrival_times(4000, 10.0, 0.25, np.random.default_rng(1))) == pytest.approx(2.0, rel=0.15)
    assert np.allclose(np.diff(arrival_times(5, 2.0, math.inf, rng)), 0.5)


# ---------------------------------------------------------------- the CLI end to end


def test_serve_cli_writes_vllm_named_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    app = FakeOpenAI(ttft=0.02, itl=0.005)
    with serve(app) as url:
        rc = ladle_main(["bench", "serve", "--base-url", url + "/v1", "--num-prompts", "6", "--random-input-len",
                         "24", "--random-output-len", "5", "--request-rate", "50", "--goodput", "ttft:1000",
                         "tpot:100", "--percentiles", "50,90,99", "--save-result", "--result-dir", str(tmp_path),
                         "--disable-tqdm"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Request goodput (req/s):" in out and "P90 TTFT (ms):" in out
    [path] = tmp_path.glob("openai-50qps-fake-model-*.json")
    result = json.loads(path.read_text())
    for key in ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "completed",
                "total_input_tokens", "total_output_tokens", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p90_tpot_ms", "p99_itl_ms", "p50_e2el_ms", "duration", "request_rate",
                "burstiness", "max_concurrency", "model_id"):
        assert key in result, key
    assert result["completed"] == 6 and result["model_id"] == "fake-model"  # from /v1/models
    assert "per_turn" not in result and "agent" not in result and "Agent Turns" not in out  # not an agent run
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["total_output_tokens"] == 30
    prov = result["provenance"]
    assert prov["target_version"] == {"version": "fake-1.0"} and prov["tool_version"]
    assert prov["machine"]["cpu_count"] and prov["flags"]["num_prompts"] == 6
    assert result["tokens_per_word_source"] == "tokenize" and result["tokens_per_word"] == pytest.approx(1.0)
    sent = [b for p, b in app.bodies if p == "/v1/completions"]
    assert len(sent) == 7 and all(b["ignore_eos"] and b["max_tokens"] == 5 for b in sent)  # 1 initial test
    assert all(len(b["prompt"].split()) == 24 for b in sent)


def test_warmups_are_sent_first_and_left_out_of_every_figure(tmp_path: Path):
    app = FakeOpenAI(ttft=0.01, itl=0.002)
    with serve(app) as url:
        rc = ladle_main(["bench", "serve", "--base-url", url, "--num-prompts", "4", "--num-warmups", "3",
                         "--random-input-len", "8", "--random-output-len", "3", "--skip-initial-test",
                         "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename",
                         "r.json"])
    assert rc == 0
    result = json.loads((tmp_path / "r.json").read_text())
    completions = [body["prompt"] for path, body in app.bodies if path == "/v1/completions"]
    assert len(completions) == 7 and result["completed"] == 4 and result["num_warmups"] == 3
    assert result["total_output_tokens"] == 4 * 3 and result["cache"] == "warm"
    assert not set(completions[:3]) & set(completions[3:])  # the warm-ups are prompts of their own
    with serve(FakeOpenAI()) as url:  # a server without the route: a clear error, not a silent warm run
        assert ladle_main(["bench", "serve", "--base-url", url, "--num-prompts", "1", "--reset-cache",
                           "--skip-initial-test", "--disable-tqdm"]) == 1


def test_decisions_cli(tmp_path: Path):
    app = FakeOpenAI(decision_delay=0.02)
    with serve(app) as url:
        rc = ladle_main(["bench", "serve", "--base-url", url, "--model", "m", "--dataset", "decisions",
                         "--num-prompts", "4", "--decisions-input-len", "10", "--save-result", "--result-dir",
                         str(tmp_path), "--result-filename", "d.json", "--disable-tqdm"])
    assert rc == 0
    result = json.loads((tmp_path / "d.json").read_text())
    assert result["completed"] == 4 and result["total_output_tokens"] == 0
    assert result["total_input_tokens"] == 4 * 30 and result["median_ttft_ms"] >= 19.0
    decided = [b for p, b in app.bodies if p == "/v1/decisions"]
    assert decided and all(b["model"] == "m" and len(b["questions"]) == 3 for b in decided)


# ---------------------------------------------------------------- sweep and knee


def _step(load: float, goodput: float, throughput: float, n: int = 100, e2el_ms: float = 200.0) -> dict[str, Any]:
    return {"load": load, "request_goodput": goodput, "request_throughput": throughput, "completed": n,
            "failed": 0, "good_completed": round(goodput / throughput * n) if throughput else 0,
            "median_e2el_ms": e2el_ms}


def test_find_knee():
    # rate: a 100-request run at 10 req/s with 200 ms E2EL completes at 100 / 10.2 s = 9.8 req/s
    steps = [_step(1, 0.998, 0.998), _step(10, 9.7, 9.8), _step(20, 15.0, 19.0), _step(40, 4.0, 30.0)]
    assert find_knee(steps, "rate") == 1
    assert find_knee([_step(1, 0.5, 1.0)] + steps[1:], "rate") is None
    assert find_knee(steps[:2], "rate", fraction=0.999) == 0
    # concurrency: goodput per slot must hold up and most requests be good
    conc = [_step(1, 5.0, 5.0), _step(2, 9.8, 9.9), _step(4, 19.0, 19.5), _step(8, 20.0, 38.0)]
    assert find_knee(conc, "concurrency") == 2


def test_sweep_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    import matplotlib.image

    # one request at a time, 10 ms + 7 x 5 ms = 45 ms each: about 22 req/s of capacity. 40 requests a
    # step and a 250 ms TTFT target. The first step, at 8 req/s, uses a third of the capacity, so that a
    # stall of this VM under the loaded suite (600 ms, seen in CI) spoils too few requests to move the knee:
    # a first step at 16 req/s, three quarters of the capacity, drained the queue a stall left too slowly,
    # and lost two thirds of its requests to it. Past capacity the queue still grows well beyond 250 ms.
    app = FakeOpenAI(ttft=0.01, itl=0.005, capacity=1)
    with serve(app) as url:
        rc = ladle_main(["bench", "sweep", "--base-url", url, "--model", "fake-model", "--num-prompts", "40",
                         "--random-input-len", "16", "--random-output-len", "8", "--loads", "8,16,32,64,128",
                         "--burstiness", "50", "--goodput", "ttft:250", "tpot:50", "--result-dir", str(tmp_path),
                         "--result-filename", "sweep.json", "--disable-tqdm"])
    assert rc == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    steps = sweep["steps"]
    assert 3 <= len(steps) <= 5 and [s["load"] for s in steps] == [8, 16, 32, 64, 128][: len(steps)]
    for s in steps:
        assert s["request_goodput"] <= s["request_throughput"] + 1e-9
        assert {"p99_ttft_ms", "p99_tpot_ms", "request_rate", "tracks_offered_load"} <= s.keys()
    peak = max(s["request_goodput"] for s in steps)
    assert steps[-1]["request_goodput"] < 0.5 * peak and "peak" in sweep["stop_reason"]
    assert sweep["knee"] is not None and sweep["knee"]["load"] in (8, 16)
    assert sweep["knee"]["load"] < steps[-1]["load"]
    assert sweep["provenance"]["target_version"] == {"version": "fake-1.0"}
    assert "knee: rate" in capsys.readouterr().out
    image = matplotlib.image.imread(tmp_path / "sweep.png")
    assert image.shape[0] >= 400 and image.shape[1] >= 600 and image.shape[2] in (3, 4)
    assert image.std() > 0.01  # not a blank canvas


def test_sweep_by_concurrency_finds_the_servers_capacity(tmp_path: Path):
    # the server runs two requests at a time: per-slot goodput holds up to concurrency 2, then halves.
    # A request takes ~130 ms; waiting for a slot puts TTFT past 130 ms, far from the 80 ms target,
    # and without waiting it is 10 ms: a VM stall of tens of ms moves neither side across.
    app = FakeOpenAI(ttft=0.01, itl=0.015, capacity=2)
    with serve(app) as url:
        rc = ladle_main(["bench", "sweep", "--by", "concurrency", "--base-url", url, "--model", "m", "--num-prompts",
                         "16", "--random-input-len", "8", "--random-output-len", "8", "--loads", "1,2,4,8",
                         "--goodput", "ttft:80", "--result-dir", str(tmp_path), "--result-filename", "c.json",
                         "--no-plot", "--disable-tqdm"])
    assert rc == 0
    sweep = json.loads((tmp_path / "c.json").read_text())
    assert sweep["by"] == "concurrency" and sweep["knee"]["load"] == 2
    assert [s["max_concurrency"] for s in sweep["steps"]] == [1, 2, 4, 8][: len(sweep["steps"])]
    assert all(s["request_goodput"] <= s["request_throughput"] + 1e-9 for s in sweep["steps"])
    assert not (tmp_path / "c.png").exists()


def test_a_trace_replays_on_its_clock_with_its_shared_blocks(tmp_path: Path):
    """Arrivals at 0, 400, 600 and 1000 ms replayed twice as fast: sent 0, 200, 300 and 500 ms in, each
    within 60 ms; lines sharing hash ids share those blocks' text, and a ShareGPT-style line is sent as is."""
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 5000, "input_length": 24, "output_length": 2, "hash_ids": [7, 8]},
             {"timestamp": 5400, "input_length": 20, "output_length": 3, "hash_ids": [7, 9]},
             {"timestamp": 5600, "conversations": [{"from": "human", "value": "tell me a story"},
                                                   {"from": "gpt", "value": "once"}], "output_length": 2},
             {"timestamp": 6000, "input_length": 8, "output_length": 2}]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    app = FakeOpenAI(ttft=0.005, itl=0.001)
    with serve(app) as url:
        rc = ladle_main(["bench", "serve", "--base-url", url, "--dataset", "trace", "--dataset-path", str(trace),
                         "--trace-speedup", "2", "--trace-block-len", "10", "--num-prompts", "4",
                         "--tokens-per-word", "1", "--skip-initial-test", "--disable-tqdm"])
    assert rc == 0
    starts = sorted(admitted for _, admitted, _ in app.spans)
    assert [round(t - starts[0], 3) for t in starts] == pytest.approx([0, 0.2, 0.3, 0.5], abs=0.06)
    prompts = [body["prompt"] for path, body in app.bodies if path == "/v1/completions"]
    first, second = (p.split() for p in prompts[:2])
    assert first[:10] == second[:10] and first[10:20] != second[10:20]  # block 7 shared, 8 and 9 not
    assert len(first) == 24 and len(second) == 20 and prompts[2] == "tell me a story"
    with serve(FakeOpenAI()) as url:
        assert ladle_main(["bench", "serve", "--base-url", url, "--dataset", "trace", "--dataset-path", str(trace),
                           "--request-rate", "5", "--skip-initial-test", "--disable-tqdm"]) == 1
    trace.write_text(json.dumps({"timestamp": 1, "input_length": 4, "output_length": 1, "cached": 3}) + "\n")
    with pytest.raises(ValueError, match="unknown trace fields"):
        from ladle.bench.trace import trace_dataset
        trace_dataset(np.random.default_rng(0), trace, 1, 1.0, 512, 1.0)


def test_the_goodput_search_finds_a_planted_knee(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A server that runs 5 requests at a time (100 ms to the first token, 340 ms a request): up to
    concurrency 5 every TTFT is ~100 ms, past it a request waits a whole turn for a slot (440 ms or more),
    far beyond the 250 ms SLO. Doubling meets at 1, 2, 4 and misses at 8; bisecting tries 6 (a miss:
    one request of the ten waits) and 5 (meets). The 150 ms below the SLO absorb a loaded machine's
    stalls (with 70 ms, one request of ten once missed at concurrency 1 while the suite ran)."""
    app = FakeOpenAI(ttft=0.1, itl=0.04, capacity=5)
    with serve(app) as url:
        rc = ladle_main(["bench", "sweep", "--search", "goodput", "--by", "concurrency", "--base-url", url,
                         "--num-prompts", "10", "--random-input-len", "8", "--random-output-len", "7",
                         "--goodput", "ttft:250", "--attainment", "0.95", "--skip-initial-test", "--disable-tqdm",
                         "--result-dir", str(tmp_path), "--result-filename", "search.json"])
    assert rc == 0
    found = json.loads((tmp_path / "search.json").read_text())
    assert found["best"]["load"] == 5 and found["first_miss"] == 6
    assert [s["load"] for s in found["steps"]] == [1, 2, 4, 5, 6, 8]
    assert all(s["meets_target"] == (s["load"] <= 5) for s in found["steps"])
    assert "highest concurrency meeting 95% attainment: 5" in capsys.readouterr().out
    assert (tmp_path / "search.png").stat().st_size > 10_000
