"""An LLMEngine driven by its own thread, for asyncio callers (the HTTP server).

The engine is not thread-safe, so one background thread owns it: submissions and
aborts are queued and applied between steps, and each step's outputs are handed to
the event loop that asked for them with `call_soon_threadsafe`. The thread sleeps
on a condition variable while there is nothing to do.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from ladle.engine.admission import CompletionRate, QueueFullError
from ladle.engine.engine import LLMEngine
from ladle.engine.kv_offload import OffloadStats
from ladle.engine.request import Sequence, StepOutput
from ladle.engine.sampling_params import SamplingParams
from ladle.engine.stop import keep_stop_strings
from ladle.engine.threads import claim_compute, release_openmp_team
from ladle.lora.adapter import AdapterRef
from ladle.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:
    from ladle.engine.kv_events import KVEventLog
    from ladle.engine.adapter_engine import AdapterEngine

log = logging.getLogger("ladle")
T = TypeVar("T")


class EngineStoppedError(RuntimeError):
    """The engine thread is gone (shut down, or it failed); the request cannot finish."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state as of the last step or queue drain; safe to read from any thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_unfinished_requests: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found cached
    prefix_cache_evictions: int = 0  # blocks evicted from the prefix cache
    num_cached_blocks: int = 0  # blocks in the prefix cache, referenced or not
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # speculative decoding's totals
    kv_offload: OffloadStats | None = None  # the second KV tier's totals; None: no tier
    # its measured break-even: seconds to read a block back, and to prefill a block's tokens
    kv_offload_restore_s: float | None = None
    kv_offload_prefill_s: float | None = None
    running_loras: tuple[str, ...] = ()  # adapters of running sequences (sorted names)
    waiting_loras: tuple[str, ...] = ()  # adapters of waiting sequences
    taken_at: float = 0.0  # time.time() of the snapshot


@dataclass(frozen=True)
class StepReport:
    """What a step listener (metrics) sees after each step, on the engine thread."""

    outputs: list[StepOutput]
    started: float
    finished: float
    snapshot: EngineSnapshot
    # the engine's live sequences of each request in `outputs` (timings, finish reasons):
    # read them in the listener, never keep or change them
    sequences: dict[str, list[Sequence]] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)  # requests aborted since the last report


StepListener = Callable[[StepReport], None]


class RequestStream:
    """The outputs of one request, in order; iterate it on the event loop that submitted it.

    Leaving early is the caller's to signal with `abort()` (`AsyncEngine.generate` does it).
    """

    def __init__(self, request_id: str, engine: "AsyncEngine", loop: asyncio.AbstractEventLoop,
                 keeps_stop_strings: bool = False):
        self.request_id = request_id
        self.prompt_token_ids: list[int] = []
        self.finished = False
        self.keeps_stop_strings = keeps_stop_strings  # include_stop_str_in_output
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._aborted = False

    def _put(self, item: StepOutput | BaseException) -> None:  # on the event loop
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished or self._aborted:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return keep_stop_strings(item) if self.keeps_stop_strings else item

    def abort(self) -> None:
        """Drop the request in the engine unless it already finished; idempotent."""
        if not self.finished and not self._aborted:
            self._aborted = True
            self._engine.abort(self.request_id)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    stream: RequestStream
    accepted: asyncio.Future
    arrival_time: float
    lora: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


_Op = _Add | _Abort | _Call


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.runtime_info = engine.runtime_info()
        self.cache_config_info = engine.cache_config_info()
        self.vocab_size = engine.model_config.vocab_size
        self.num_hidden_layers = engine.model_config.num_hidden_layers
        self.max_waiting_requests = engine.config.max_waiting_requests  # None: no bound
        self.num_rejected = 0  # requests refused with QueueFullError
        self._cond = threading.Condition()
        self._ops: list[_Op] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._sequences: dict[str, list[Sequence]] = {}  # engine thread only
        self._aborted: list[str] = []  # engine thread only
        self._listeners: list[StepListener] = []  # replaced, never mutated: the engine thread iterates it
        self._snapshot = EngineSnapshot()
        self._error: BaseException | None = None
        # admission: submissions not yet in the engine (queued, or being applied), under _cond
        self._num_pending = 0
        self._num_applying = 0
        self._completions = CompletionRate()  # under _cond
        release_openmp_team()  # the engine thread computes from now on (see engine/threads.py)

    # -- lifecycle ------------------------------------------------------------

    def hidden_state_index(self, layer: int) -> int:
        """transformers' hidden_states index of `layer` (0 the embeddings, i decoder layer i's output,
        negative from the end: -1 the final normed state). Raises ValueError when out of range."""
        states = self.num_hidden_layers + 1
        if not -states <= layer < states:
            raise ValueError(f"layer must be in [{-states}, {states - 1}] for this model")
        return layer % states

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="ladle-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the thread after its current step; unfinished requests fail with EngineStoppedError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.engine.close()

    @property
    def is_running(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return alive and not self._stopping and self._error is None and self.engine.healthy

    def add_step_listener(self, listener: StepListener) -> None:
        """Call `listener(StepReport)` on the engine thread after every step (keep it cheap)."""
        self._listeners = [*self._listeners, listener]

    def remove_step_listener(self, listener: StepListener) -> None:
        self._listeners = [x for x in self._listeners if x is not listener]

    @property
    def kv_events(self) -> "KVEventLog | None":
        """The prefix cache's stored and evicted blocks (thread-safe); None without a prefix cache."""
        return self.engine.kv_events

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def num_waiting(self) -> int:
        """Sequences not yet running: in the engine's queue (as of the last step), or submitted
        and not yet accepted."""
        with self._cond:
            return self._num_waiting()

    def _num_waiting(self) -> int:
        return self._num_pending + self._num_applying + self._snapshot.num_waiting

    # -- requests (event loop side) -------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, lora: str | None = None) -> RequestStream:
        """Submit a request (on the LoRA adapter named `lora`, if given) and wait until the engine
        has accepted it.

        Raises what LLMEngine.add_request raises (InvalidRequestError for a bad request)
        before anything is streamed, EngineStoppedError, or QueueFullError (at once, without
        waiting) when `max_waiting_requests` requests are already waiting.
        """
        self.start()
        if params.structured_outputs is not None:  # compiled here, so the engine thread meets a cache hit
            await asyncio.to_thread(self.engine.grammars.compile, params.structured_outputs)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop, params.include_stop_str_in_output)
        accepted = loop.create_future()
        self._submit(_Add(request_id, prompt, params, priority, stream, accepted, time.time(), lora))
        try:
            stream.prompt_token_ids = await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0, lora: str | None = None) -> AsyncIterator[StepOutput]:
        """Outputs of one request; leaving the loop early (or being cancelled) aborts it.

        After a `break` the abort runs when the generator is closed: wrap it in
        `contextlib.aclosing` to close it at once rather than when it is collected.
        """
        stream = await self.add_request(request_id, prompt, params, priority, lora)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    # -- LoRA adapters (the registry is thread-safe: no trip through the engine thread) ----

    @property
    def lora_enabled(self) -> bool:
        return self.engine.loras is not None

    async def add_lora(self, name: str, path: str) -> AdapterRef:
        """Load and serve an adapter (its folder is read off the event loop); raises AdapterError."""
        return await asyncio.to_thread(self.engine.add_lora, name, path)

    def remove_lora(self, name: str) -> bool:
        return self.engine.remove_lora(name)

    def list_loras(self) -> list[AdapterRef]:
        return self.engine.list_loras()

    def with_lora(self, lora: str | None) -> AsyncEngine | AdapterEngine:
        """This engine, with every request it takes run on adapter `lora` (None: the base model)."""
        from ladle.engine.adapter_engine import AdapterEngine

        return self if lora is None else AdapterEngine(self, lora)

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the blocks are free once the engine thread has drained its queue."""
        self._submit(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """fn(engine) run on the engine thread between two steps (the engine is not thread-safe), and
        what it returns or raises; snapshot() shows its effect by the time it returns."""
        self.start()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._submit(_Call(fn, done, loop))
        return await done

    async def reset_prefix_cache(self) -> bool:
        """LLMEngine.reset_prefix_cache, between two steps."""
        return await self.call(LLMEngine.reset_prefix_cache)

    def _submit(self, op: _Op) -> None:
        with self._cond:
            if self._stopping or self._error is not None:
                if not isinstance(op, _Abort):
                    raise EngineStoppedError("the engine is not running") from self._error
                return
            failure = self.engine.failure
            if failure is not None and isinstance(op, _Add):
                raise EngineStoppedError(f"the engine cannot compute: {failure}")
            if isinstance(op, _Add):
                self._admit()
                self._num_pending += op.params.n  # sequences, as the scheduler counts them
            self._ops.append(op)
            self._cond.notify()

    def _admit(self) -> None:  # under _cond
        limit, waiting = self.max_waiting_requests, self._num_waiting()
        if limit is not None and waiting >= limit:
            self.num_rejected += 1
            raise QueueFullError(waiting, limit, self._completions.retry_after(waiting - limit + 1))

    # -- the engine thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            claim_compute(self.engine.config.num_threads)
            self._serve()
        except Exception as e:  # a bug, not a client error: fail everything, stop serving
            log.exception("engine failed; stopping the engine")
            with self._cond:
                self._error = e
                ops, self._ops = self._ops, []
            self._fail_all(ops, EngineStoppedError(f"engine failed: {e!r}"))

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._ops or self._stopping or engine.has_unfinished_requests()):
                    self._cond.wait()
                ops, self._ops = self._ops, []
                self._num_applying, self._num_pending = self._num_pending, 0
                stopping = self._stopping
            if stopping:
                self._fail_all(ops, EngineStoppedError("the engine was shut down"))
                return
            calls = self._apply(ops)
            try:
                snapshot = self._publish()
            finally:  # answered after the snapshot that shows their effect
                for settle in calls:
                    settle()
            if not engine.has_unfinished_requests():
                if self._aborted and self._listeners:  # no step to carry them: report the aborts now
                    now = time.time()
                    self._notify(StepReport([], now, now, snapshot, {}, self._aborted))
                self._aborted = []
                continue
            started = time.time()
            outputs = engine.step()
            now = time.time()
            snapshot = self._publish(completed=sum(out.finished for out in outputs), at=now)
            aborted, self._aborted = self._aborted, []
            if self._listeners:  # before delivery: what a client has seen, metrics have counted
                sequences = {out.request_id: self._sequences.get(out.request_id, []) for out in outputs}
                self._notify(StepReport(outputs, started, now, snapshot, sequences, aborted))
            self._deliver(outputs)

    def _publish(self, completed: int = 0, at: float = 0.0) -> EngineSnapshot:
        """A fresh snapshot; the requests just applied now count as waiting through it."""
        snapshot = self._take_snapshot()
        with self._cond:
            self._snapshot = snapshot
            self._num_applying = 0
            for _ in range(completed):
                self._completions.record(at)
        return snapshot

    def _apply(self, ops: list[_Op]) -> list[Callable[[], None]]:
        """Apply the queued operations; returns how to answer the calls among them."""
        calls = []
        for op in ops:
            if isinstance(op, _Call):
                calls.append(self._run_call(op))
                continue
            if isinstance(op, _Abort):
                stream = self._streams.pop(op.request_id, None)
                self._sequences.pop(op.request_id, None)
                last = self.engine.abort_request(op.request_id)
                if last is not None:
                    self._aborted.append(op.request_id)
                    if stream is not None:  # a reader still reading (someone else aborted) sees it end
                        _call_soon(stream._loop, stream._put, last)
                continue
            try:
                ids = self.engine.add_request(op.request_id, op.prompt, op.params, op.priority,
                                              arrival_time=op.arrival_time, lora=op.lora)
            except Exception as e:
                _resolve(op.stream._loop, op.accepted, error=e)
                continue
            self._streams[op.request_id] = op.stream
            self._sequences[op.request_id] = self.engine.requests[op.request_id]
            _resolve(op.stream._loop, op.accepted, value=ids)
        return calls

    def _run_call(self, op: _Call) -> Callable[[], None]:
        try:
            value = op.fn(self.engine)
        except Exception as e:
            return functools.partial(_resolve, op.loop, op.done, error=e)
        return functools.partial(_resolve, op.loop, op.done, value=value)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StepOutput]]] = {}
        for out in outputs:
            if out.finished:
                self._sequences.pop(out.request_id, None)
            stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream._loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _fail_all(self, ops: list[_Op], error: BaseException) -> None:
        for op in ops:
            if isinstance(op, _Add):
                _resolve(op.stream._loop, op.accepted, error=error)
            elif isinstance(op, _Call):
                _resolve(op.loop, op.done, error=error)
        for rid, stream in list(self._streams.items()):
            _call_soon(stream._loop, stream._put, error)
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("could not abort request %s", rid)
        self._streams.clear()
        self._sequences.clear()

    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        return EngineSnapshot(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            num_unfinished_requests=len(e.requests), num_blocks=e.kv.num_blocks,
            num_free_blocks=e.kv.num_free_blocks, kv_cache_usage=e.kv.usage,
            num_preemptions=e.scheduler.num_preemptions, prompt_tokens=e.stats.prompt_tokens,
            generation_tokens=e.stats.generation_tokens, steps=e.stats.steps,
            prefix_cache_queries=e.kv.stats.queries, prefix_cache_hits=e.kv.stats.hits,
            prefix_cache_evictions=e.kv.stats.evictions, num_cached_blocks=e.kv.num_cached_blocks,
            spec_decode=replace(e.stats.spec, accepted_per_pos=list(e.stats.spec.accepted_per_pos)),
            kv_offload=replace(e.kv.offload.tier.stats) if e.kv.offload is not None else None,
            kv_offload_restore_s=e.kv.offload.load_s_per_block if e.kv.offload is not None else None,
            kv_offload_prefill_s=(e.kv.offload.prefill_s_per_token * e.kv.block_size
                                  if e.kv.offload is not None and e.kv.offload.prefill_s_per_token else None),
            running_loras=_adapter_names(e.scheduler.running), waiting_loras=_adapter_names(e.scheduler.waiting),
            taken_at=time.time(),
        )

    def _notify(self, report: StepReport) -> None:
        for listener in self._listeners:
            try:
                listener(report)
            except Exception:
                log.exception("step listener failed")


def _adapter_names(seqs: list[Sequence]) -> tuple[str, ...]:
    return tuple(sorted({s.lora.name for s in seqs if s.lora is not None}))


def _put_all(items: list[tuple[RequestStream, StepOutput]]) -> None:
    for stream, out in items:
        stream._put(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop is closed: nobody is listening any more
        pass


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value=None,
             error: BaseException | None = None) -> None:
    def settle() -> None:
        if fut.done():  # the caller was cancelled while waiting
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    _call_soon(loop, settle)
