"""`ladle router` against real workers: two `ladle serve` processes, the router in this process.

Which worker served a request is read from the workers themselves (their engine stats and
metrics) where it matters, not only from the router's bookkeeping.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ladle.cli import main as ladle_main
from ladle.router.app import build_app
from ladle.router.config import RouterConfig
from tests.server_utils import MODEL, ServerThread, free_port

pytestmark = pytest.mark.slow  # starts worker processes: make test-fast leaves it out

GREEDY = dict(temperature=0.0)
TEAM = {"id": "team", "type": "choice", "question": "Which team should handle this ticket?",
        "options": [{"name": "billing"}, {"name": "technical"}, {"name": "sales"}]}
_unique = itertools.count()


@dataclass
class WorkerProcess:
    url: str
    proc: subprocess.Popen

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/engine/stats").json()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def start_workers(n: int, extra: list[list[str]] | None = None) -> list[WorkerProcess]:
    """n `ladle serve` processes (started together; extra[i]: more flags for the i-th), each
    answering GET /health."""
    workers = []
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "ladle.cli", "serve", "--port", str(port), "--num-threads", "1",
               "--num-kv-blocks", "256", "--no-webui", "--uvicorn-log-level", "warning", *(extra or [[]] * n)[i]]
        workers.append(WorkerProcess(f"http://127.0.0.1:{port}", subprocess.Popen(cmd, stderr=subprocess.DEVNULL)))
    deadline = time.monotonic() + 120
    for w in workers:
        while not _answers(f"{w.url}/health"):
            assert w.proc.poll() is None, "a worker exited at start"
            assert time.monotonic() < deadline, "a worker did not start"
            time.sleep(0.2)
    return workers


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    procs = start_workers(2)
    try:
        yield procs
    finally:
        for w in procs:
            w.stop()


@contextmanager
def router(urls: list[str] | None = None, wait: bool = True, **config) -> Iterator[str]:
    """The router app in a thread; its URL once it sees a healthy worker (unless wait=False)."""
    thread = ServerThread(build_app(RouterConfig(workers=urls or [], **config))).start()
    try:
        deadline = time.monotonic() + 30
        while wait and not _answers(f"{thread.url}/health"):
            assert time.monotonic() < deadline, "the router saw no healthy worker"
            time.sleep(0.05)
        yield thread.url
    finally:
        thread.stop()


def urls(workers: list[WorkerProcess]) -> list[str]:
    return [w.url for w in workers]


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def served(router_url: str) -> dict[str, int]:
    """The router's count of requests per worker URL."""
    return {w["url"]: w["requests_total"] for w in httpx.get(f"{router_url}/workers").json()}


def scrape(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def complete(url: str, prompt: str, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **GREEDY, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def long_prefix() -> str:
    """A few hundred tokens of text no other test sent."""
    n = next(_unique)
    return f"Document {n}-{time.monotonic_ns()}. " + " ".join(f"Clause {n}.{i} says the parties agree on item {i}."
                                                               for i in range(30))


# -- the OpenAI surface, unchanged -----------------------------------------------------


def test_sdk_through_router_equals_worker(workers) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    with router(urls(workers)) as url:
        via, direct = sdk(url), sdk(workers[0].url)
        chat = via.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
        own = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
        assert chat.choices[0].message.content == own.choices[0].message.content
        stream = via.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True, **GREEDY)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == own.choices[0].message.content
        text = via.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, **GREEDY)
        assert text.choices[0].text == direct.completions.create(model=MODEL, prompt="Once upon a time",
                                                                 max_tokens=8, **GREEDY).choices[0].text
        assert [m.id for m in via.models.list()] == [MODEL]
        decision = via.post("/decisions", body={"model": MODEL, "input": "The integration keeps failing.",
                                                "questions": [TEAM]}, cast_to=object)
        assert set(decision["answers"]["team"]["probabilities"]) == {"billing", "technical", "sales"}
        assert httpx.post(f"{url}/tokenize", json={"prompt": "Hello"}).json()["count"] >= 1
        assert sum(served(url).values()) >= 6


# -- policies ----------------------------------------------------------------------------


def test_cache_aware_keeps_a_prefix_on_one_worker(workers) -> None:
    prefix = long_prefix()
    before = [w.stats() for w in workers]
    with router(urls(workers), policy="cache_aware") as url:
        for q in ("first", "second", "third"):
            assert complete(url, f"{prefix} Question: {q}?").status_code == 200
        after = [w.stats() for w in workers]
        got = [a["prompt_tokens"] - b["prompt_tokens"] > 0 for a, b in zip(after, before)]
        assert got.count(True) == 1, got  # every request of the prefix on one worker
        home = got.index(True)
        hits = after[home]["prefix_cache_hits"] - before[home]["prefix_cache_hits"]
        assert hits >= 2 * 200, hits  # the 2nd and 3rd found the prefix cached there
        decisions = scrape(url)
        assert decisions["ladle_router_routing_decisions_total{policy=cache_aware,reason=cache_hit}"] == 2
        for _ in range(2):  # new prefixes go to the emptier tree: the other worker
            assert complete(url, long_prefix()).status_code == 200
        assert all(n >= 1 for n in served(url).values())


def test_round_robin_alternates(workers) -> None:
    with router(urls(workers), policy="round_robin") as url:
        order = []
        for _ in range(4):
            before = served(url)
            assert complete(url, "Hi").status_code == 200
            order.append(next(u for u, n in served(url).items() if n > before[u]))
        assert order[0] != order[1] and order[:2] == order[2:]


def test_least_load_avoids_the_busy_worker_and_hangup_aborts(workers) -> None:
    with router(urls(workers), policy="least_load") as url:
        body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 2000, "stream": True,
                "ignore_eos": True, **GREEDY}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert all(next(lines) is not None for _ in range(4))
            busy = wait_for_worker_running(workers)
            idle = next(w for w in workers if w is not busy)
            counts = served(url)
            for _ in range(3):
                assert complete(url, "Hello").status_code == 200
            assert served(url)[idle.url] == counts[idle.url] + 3
        deadline = time.monotonic() + 10  # the client hung up: the worker must abort, long before 2000 tokens
        while busy.stats()["num_unfinished_requests"]:
            assert time.monotonic() < deadline, "the worker kept generating for a closed stream"
            time.sleep(0.05)


def wait_for_worker_running(workers: list[WorkerProcess]) -> WorkerProcess:
    """The worker whose engine runs a request (its stats are a snapshot of its last step: poll)."""
    deadline = time.monotonic() + 10
    while True:
        busy = [w for w in workers if w.stats()["num_unfinished_requests"] == 1]
        if busy:
            return busy[0]
        assert time.monotonic() < deadline, "no worker runs the request"
        time.sleep(0.05)


def test_kv_events_routes_to_the_worker_holding_the_blocks(workers) -> None:
    with router(urls(workers), policy="kv_events") as url:
        deadline = time.monotonic() + 15
        while any(w["kv_blocks"] is None for w in httpx.get(f"{url}/workers").json()):
            assert time.monotonic() < deadline, "no KV event stream from the workers"
            time.sleep(0.05)
        prefix = long_prefix()
        blocks = {w["url"]: w["kv_blocks"] for w in httpx.get(f"{url}/workers").json()}
        counts = served(url)
        assert complete(url, f"{prefix} Question: first?").status_code == 200
        home = next(u for u, n in served(url).items() if n > counts[u])
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/workers").json()[urls(workers).index(home)]["kv_blocks"] <= blocks[home] + 10:
            assert time.monotonic() < deadline, "the router's view did not gain the request's blocks"
            time.sleep(0.05)
        for q in ("second", "third"):
            assert complete(url, f"{prefix} Question: {q}?").status_code == 200
        assert served(url)[home] == counts[home] + 3
        assert scrape(url)["ladle_router_routing_decisions_total{policy=kv_events,reason=kv_hit}"] == 2


# -- workers coming and going ---------------------------------------------------------------


def test_drain_and_undrain(workers) -> None:
    a, b = urls(workers)
    with router([a, b], policy="round_robin") as url:
        assert httpx.post(f"{url}/workers/drain", json={"url": a}).status_code == 200
        counts = served(url)
        for _ in range(3):
            assert complete(url, "Hi").status_code == 200
        assert served(url) == {a: counts[a], b: counts[b] + 3}
        assert httpx.post(f"{url}/workers/undrain", json={"url": a}).status_code == 200
        for _ in range(2):
            assert complete(url, "Hi").status_code == 200
        assert served(url)[a] == counts[a] + 1
        assert httpx.post(f"{url}/workers/drain", json={"url": "http://nowhere:1"}).status_code == 404


def test_failover_when_a_worker_dies(workers) -> None:
    [doomed] = start_workers(1)
    try:
        # no health checks during the test: the router learns of the death from the failed request
        with router([doomed.url, workers[0].url], policy="round_robin", health_check_interval=600) as url:
            for i in range(6):
                if i == 2:
                    doomed.stop()
                assert complete(url, f"Say {i}", max_tokens=4).status_code == 200
            state = {w["url"]: w for w in httpx.get(f"{url}/workers").json()}
            assert not state[doomed.url]["healthy"] and state[workers[0].url]["healthy"]
            metrics = scrape(url)
            assert metrics[f"ladle_router_worker_failures_total{{worker={doomed.url}}}"] == 1
            assert metrics["ladle_router_retries_total"] == 1
            assert metrics[f"ladle_router_worker_healthy{{worker={doomed.url}}}"] == 0
    finally:
        doomed.stop()


def test_sticky_cancel_reaches_the_right_worker(workers) -> None:
    with router(urls(workers), policy="round_robin") as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000,
                "ignore_eos": True, "stream": True, "request_id": f"sticky-{time.monotonic_ns()}"}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            next(lines)
            # round robin would send a second request elsewhere: the cancel must follow the request
            assert httpx.post(f"{url}/v1/requests/{body['request_id']}/cancel").status_code == 200
            rest = "\n".join(lines)
        assert '"finish_reason":"abort"' in rest.replace(" ", "")


# -- errors ---------------------------------------------------------------------------------


def test_unknown_policy_is_a_cli_error() -> None:
    with pytest.raises(SystemExit) as e:
        ladle_main(["router", "--worker", "http://127.0.0.1:1", "--policy", "random"])
    assert e.value.code == 2
    assert ladle_main(["router", "--prefill", "http://127.0.0.1:1"]) == 2  # --decode missing


def test_no_healthy_worker_is_503_in_openai_shape() -> None:
    with router([f"http://127.0.0.1:{free_port()}"], wait=False) as url:
        assert httpx.get(f"{url}/health").status_code == 503
        r = complete(url, "Hi")
        assert r.status_code == 503
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_worker_4xx_passes_through_unretried(workers) -> None:
    with router(urls(workers)) as url:
        bad = {"model": MODEL, "prompt": "Hi", "max_tokens": -1}
        via = httpx.post(f"{url}/v1/completions", json=bad)
        direct = httpx.post(f"{workers[0].url}/v1/completions", json=bad)
        assert (via.status_code, via.json()) == (direct.status_code, direct.json()) and via.status_code == 400
        metrics = scrape(url)
        assert metrics["ladle_router_retries_total"] == 0
        assert all(w["healthy"] for w in httpx.get(f"{url}/workers").json())


# -- disaggregated prefill/decode -------------------------------------------------------------


def test_prefill_then_decode_hands_the_kv_over() -> None:
    producer = json.dumps({"kv_role": "kv_producer", "kv_port": free_port()})
    prefill, decode = start_workers(2, [["--kv-transfer-config", producer],
                                        ["--kv-transfer-config", '{"kv_role": "kv_consumer"}']])
    try:
        messages = [{"role": "user", "content": f"{long_prefix()} Summarise."}]
        with router(prefill=[prefill.url], decode=[decode.url]) as url:
            got = sdk(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
            own = sdk(prefill.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
            assert got.choices[0].message.content == own.choices[0].message.content
            metrics = scrape(url)
            assert metrics["ladle_router_pd_prefill_seconds_count"] == 1
            assert metrics["ladle_router_pd_fallbacks_total"] == 0  # the decode worker got the prefill's params
    finally:
        prefill.stop()
        decode.stop()


def test_prefill_failure_falls_back_to_decode_recomputing(workers) -> None:
    prefill, decode = workers  # plain workers: the prefill hop is refused (no --kv-transfer-config)
    messages = [{"role": "user", "content": f"{long_prefix()} Summarise."}]
    own = sdk(decode.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    with router(prefill=[prefill.url], decode=[decode.url]) as url:
        got = sdk(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
        assert got.choices[0].message.content == own.choices[0].message.content
        metrics = scrape(url)
        assert metrics["ladle_router_pd_prefill_seconds_count"] == 1 and metrics["ladle_router_pd_fallbacks_total"] == 1
        sdk(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=2, n=2, **GREEDY)
        assert scrape(url)["ladle_router_pd_prefill_seconds_count"] == 1  # n > 1: no prefill hop
        assert {w["role"] for w in httpx.get(f"{url}/workers").json()} == {"prefill", "decode"}


def test_streams_on_a_killed_worker_end_in_an_error_the_sdk_raises(workers) -> None:
    """8 long streams over two workers, one worker SIGKILLed while they run: its streams end in an error
    event (never [DONE]) and the SDK raises; the other worker's finish with [DONE]; the next requests
    succeed; and the router counts the broken streams."""
    import concurrent.futures
    import threading

    [doomed] = start_workers(1)
    try:
        with router([doomed.url, workers[0].url], policy="round_robin", health_check_interval=600) as url:
            client = sdk(url)
            first_token = threading.Barrier(9)

            def stream(i: int) -> str:
                chunks = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Story {i}: tell me a long story."}],
                    max_tokens=160, stream=True, extra_body={"ignore_eos": True}, **GREEDY)
                try:
                    for n, _ in enumerate(chunks):
                        if n == 2:
                            first_token.wait(timeout=120)
                    return "done"
                except openai.APIError as e:
                    return f"raised: {e}"

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(stream, i) for i in range(8)]
                first_token.wait(timeout=120)  # every stream is under way
                doomed.proc.kill()
                outcomes = [f.result(timeout=300) for f in futures]
            raised = [o for o in outcomes if o.startswith("raised")]
            assert len(raised) == 4 and outcomes.count("done") == 4, outcomes
            assert all("failed mid-way" in o or "without its last event" in o for o in raised), raised
            for i in range(3):  # the router took the dead worker out: these go to the live one
                assert complete(url, f"After {i}", max_tokens=2).status_code == 200
            failed = sum(v for k, v in scrape(url).items() if k.startswith("ladle_router_streams_failed_total"))
            assert failed == 4
    finally:
        doomed.stop()


def test_mixed_load_with_a_worker_killed_midway_cuts_no_stream_silently(workers) -> None:
    """A bounded load test: 64 mixed requests (chat and completion streams, plain requests, streams the
    client drops early) at concurrency 16 through the router, one of its two workers SIGKILLed a third of
    the way in. Every stream read to its end has [DONE] or an error event; plain requests succeed or get
    an OpenAI-shaped 5xx; and after the kill the live worker takes everything."""
    import concurrent.futures
    import random
    import threading

    [doomed] = start_workers(1)
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def count(kind: str) -> None:
        with lock:
            outcomes[kind] = outcomes.get(kind, 0) + 1

    def one(url: str, i: int) -> None:
        rng = random.Random(i)
        kind = rng.choice(["chat", "completion", "plain", "dropped"])
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        body = {"model": MODEL, "max_tokens": rng.randrange(8, 48), "ignore_eos": True, **GREEDY}
        body.update({"messages": [{"role": "user", "content": f"Tell me about {i}."}]} if kind == "chat"
                    else {"prompt": f"Item {i} is"})
        if kind == "plain":
            r = httpx.post(url + path, json=body, timeout=120)
            assert r.status_code == 200 or (r.status_code >= 500 and "error" in r.json()), r.text
            count("plain ok" if r.status_code == 200 else "plain 5xx")
            return
        body["stream"] = True
        with httpx.stream("POST", url + path, json=body, timeout=120) as r:
            if r.status_code != 200:
                assert r.status_code >= 500 and "error" in json.loads(r.read()), r.status_code
                count("stream refused")
                return
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                if kind == "dropped" and len(events) == 2:
                    count("dropped")
                    return
        if events and events[-1] == "data: [DONE]":
            count("done")
        else:
            assert events and '"error"' in events[-1], events[-3:]  # never cut silently
            count("error event")

    try:
        with router([doomed.url, workers[0].url], policy="round_robin", health_check_interval=600) as url:
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                futures = [pool.submit(one, url, i) for i in range(64)]
                while sum(f.done() for f in futures) < 20:
                    time.sleep(0.05)
                doomed.proc.kill()
                for f in futures:
                    f.result(timeout=300)
            metrics = scrape(url)
    finally:
        doomed.stop()
    assert sum(outcomes.values()) == 64 and outcomes.get("done", 0) > 16, outcomes
    failed = sum(v for k, v in metrics.items() if k.startswith("ladle_router_streams_failed_total"))
    # every error event the clients read was counted; a stream its client dropped as its worker died may be too
    errors = outcomes.get("error event", 0)
    assert errors > 0  # streams were running on the worker when it died
    assert errors <= failed <= errors + outcomes.get("dropped", 0), (failed, outcomes)
