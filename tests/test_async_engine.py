"""AsyncEngine's threading contract, on a scripted stand-in for LLMEngine (fast, deterministic)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest

from ladle.engine.admission import CompletionRate, QueueFullError
from ladle.engine.async_engine import AsyncEngine, EngineStoppedError, StepReport
from ladle.engine.request import CompletionDelta, StepOutput
from ladle.engine.sampling_params import SamplingParams
from ladle.errors import InvalidRequestError
from ladle.spec_decode.stats import SpecDecodeStats


class ScriptedEngine:
    """Each step emits one token (its count) per live request; checks it is only ever driven by one thread."""

    def __init__(self, fail_at_step: int | None = None, max_waiting_requests: int | None = None):
        self.config = SimpleNamespace(max_waiting_requests=max_waiting_requests, num_threads=None)
        self.tokenizer = None
        self.max_model_len = 100
        self.model_config = SimpleNamespace(vocab_size=10, num_hidden_layers=2)
        self.model_path = "scripted"
        self.requests: dict[str, list] = {}  # id -> [generated, max_tokens]
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0)
        self.kv = SimpleNamespace(num_blocks=8, num_free_blocks=8, usage=0.0, num_cached_blocks=0, offload=None,
                                  stats=SimpleNamespace(queries=0, hits=0, evictions=0))
        self.stats = SimpleNamespace(prompt_tokens=0, generation_tokens=0, steps=0, spec=SpecDecodeStats())
        self.aborted: list[str] = []
        self.fail_at_step = fail_at_step
        self.threads: set[int] = set()
        self.failure: str | None = None  # a dead tensor-parallel rank's story; none here
        self.healthy = True

    def close(self) -> None:
        pass

    def runtime_info(self) -> dict[str, str]:
        return {"dtype": "scripted"}

    def cache_config_info(self) -> dict[str, str]:
        return {"num_gpu_blocks": "8"}

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None, lora=None):
        self.threads.add(threading.get_ident())
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        self.requests[request_id] = [0, params.max_tokens]
        self.kv.num_free_blocks -= 1
        return list(prompt)

    def abort_request(self, request_id):
        self.threads.add(threading.get_ident())
        if self.requests.pop(request_id, None) is None:
            return None
        self.aborted.append(request_id)
        self.kv.num_free_blocks += 1
        return StepOutput(request_id, [1], [CompletionDelta(0, [], "", [], "abort")], finished=True)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.threads.add(threading.get_ident())
        self.stats.steps += 1
        if self.stats.steps == self.fail_at_step:
            raise RuntimeError("boom")
        time.sleep(0.002)
        outs = []
        for rid, state in list(self.requests.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outs.append(StepOutput(rid, [1], [CompletionDelta(0, [state[0]], str(state[0]), [],
                                                              "length" if done else None)], finished=done))
            if done:
                del self.requests[rid]
                self.kv.num_free_blocks += 1
        return outs


@pytest.fixture
def scripted():
    engine = ScriptedEngine()
    ae = AsyncEngine(engine)
    yield engine, ae
    ae.shutdown()


def test_outputs_arrive_in_order_from_one_engine_thread(scripted) -> None:
    engine, ae = scripted

    async def run(rid: str, n: int) -> list[int]:
        return [t for out in [o async for o in ae.generate(rid, [1, 2], SamplingParams(max_tokens=n))]
                for d in out.deltas for t in d.token_ids]

    async def main():
        return await asyncio.gather(*(run(f"r{i}", 3 + i) for i in range(8)))

    results = asyncio.run(main())
    assert results == [list(range(1, 4 + i)) for i in range(8)]
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads
    assert engine.stats.steps < sum(3 + i for i in range(8))  # requests shared steps


def test_invalid_request_raises_before_streaming(scripted) -> None:
    _, ae = scripted
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(ae.add_request("bad", [], SamplingParams()))
    assert err.value.param == "prompt"


def test_leaving_early_or_being_cancelled_aborts(scripted) -> None:
    engine, ae = scripted

    async def leave_early():
        async with contextlib.aclosing(ae.generate("early", [1], SamplingParams(max_tokens=10_000))) as gen:
            async for _ in gen:
                break

    async def cancelled():
        async def consume():
            async for _ in ae.generate("cancelled", [1], SamplingParams(max_tokens=10_000)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(leave_early())
    asyncio.run(cancelled())
    deadline = time.monotonic() + 10
    while ae.snapshot().num_unfinished_requests or len(engine.aborted) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sorted(engine.aborted) == ["cancelled", "early"]
    assert ae.snapshot().num_free_blocks == 8


def test_abort_by_someone_else_ends_the_reader(scripted) -> None:
    _, ae = scripted

    async def main():
        stream = await ae.add_request("x", [1], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        ae.abort("x")
        rest = [out async for out in stream]
        assert rest[-1].finished and rest[-1].deltas[-1].finish_reason == "abort"

    asyncio.run(main())


def test_step_listener_and_idle_thread(scripted) -> None:
    engine, ae = scripted
    reports: list[StepReport] = []
    ae.add_step_listener(reports.append)

    async def main():
        async for _ in ae.generate("a", [1], SamplingParams(max_tokens=3)):
            pass

    asyncio.run(main())
    steps = engine.stats.steps
    assert len(reports) == steps == 3 and reports[-1].outputs[0].finished
    assert all(r.finished >= r.started for r in reports)
    time.sleep(0.2)
    assert engine.stats.steps == steps  # idle: no stepping while there is nothing to do


def test_shutdown_fails_running_requests_and_refuses_new_ones(scripted) -> None:
    _, ae = scripted

    async def main():
        stream = await ae.add_request("long", [1], SamplingParams(max_tokens=10**9))
        await stream.__anext__()
        await asyncio.to_thread(ae.shutdown)
        with pytest.raises(EngineStoppedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineStoppedError):
            await ae.add_request("late", [1], SamplingParams())

    asyncio.run(main())
    assert not ae.is_running


def test_a_call_runs_between_steps_on_the_engine_thread(scripted) -> None:
    """call(fn): fn(engine) on the engine thread while a request streams; its value or its error comes back,
    the snapshot already shows its effect, and the engine goes on; once shut down, calls are refused."""
    engine, ae = scripted

    def take_blocks(e: ScriptedEngine) -> int:
        e.threads.add(threading.get_ident())
        e.kv.num_free_blocks -= 3
        return e.kv.num_free_blocks

    async def main():
        stream = await ae.add_request("long", [1], SamplingParams(max_tokens=10**9))
        await stream.__anext__()
        free = await ae.call(take_blocks)
        assert ae.snapshot().num_free_blocks == free == 4  # 8, one held by the request, three taken
        with pytest.raises(ZeroDivisionError):
            await ae.call(lambda e: 1 / 0)
        before = (await stream.__anext__()).deltas[0].token_ids[0]
        assert (await stream.__anext__()).deltas[0].token_ids == [before + 1]  # still stepping
        stream.abort()
        await asyncio.to_thread(ae.shutdown)
        with pytest.raises(EngineStoppedError):
            await ae.call(take_blocks)

    asyncio.run(main())
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads


def test_a_failing_step_fails_its_requests_instead_of_hanging() -> None:
    ae = AsyncEngine(ScriptedEngine(fail_at_step=2))

    async def main():
        with pytest.raises(EngineStoppedError, match="boom"):
            async for _ in ae.generate("a", [1], SamplingParams(max_tokens=5)):
                pass

    asyncio.run(main())
    assert not ae.is_running
    ae.shutdown()


def test_a_failure_outside_the_step_fails_requests_instead_of_hanging() -> None:
    engine = ScriptedEngine()
    engine.config.num_threads = "two"  # the engine thread's set-up raises before any step
    ae = AsyncEngine(engine)

    async def main():
        with pytest.raises(EngineStoppedError):
            async for _ in ae.generate("a", [1], SamplingParams(max_tokens=5)):
                pass

    asyncio.run(asyncio.wait_for(main(), 30))
    assert not ae.is_running
    ae.shutdown()


def test_waiting_bound_refuses_at_once_with_a_retry_estimate() -> None:
    engine = ScriptedEngine(max_waiting_requests=3)
    ae = AsyncEngine(engine)

    async def main():
        # nothing runs yet: the engine thread is not started, so every submission stays pending
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(ae.add_request(f"r{i}", [1], SamplingParams(max_tokens=2))) for i in range(5)]
        await asyncio.sleep(0)  # each task submits synchronously, then waits to be accepted
        return tasks

    async def run():
        ae.start = lambda: None  # hold the thread back until every submission has been made
        tasks = await main()
        refused = [t for t in tasks if t.done() and isinstance(t.exception(), QueueFullError)]
        assert len(refused) == 2 and ae.num_rejected == 2 and ae.num_waiting() == 3
        err = refused[0].exception()
        assert (err.num_waiting, err.limit, err.retry_after) == (3, 3, 1)  # nothing completed yet: 1 s
        del ae.start
        ae.start()
        streams = [await t for t in tasks if t not in refused]
        for s in streams:
            async for _ in s:
                pass
        assert ae.num_waiting() == 0

    asyncio.run(run())
    ae.shutdown()


def test_completion_rate_retry_after() -> None:
    rate = CompletionRate()
    assert rate.retry_after(5, now=100.0) == 1  # no data
    for t in range(10):
        rate.record(90.0 + t)  # 10 completions over the last 10 s: 1/s
    assert rate.retry_after(5, now=100.0) == 5
    assert rate.retry_after(1000, now=100.0) == CompletionRate.MAX_RETRY_S
    assert rate.retry_after(5, now=1000.0) == 1  # stale
