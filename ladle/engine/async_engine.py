"""An LLMEngine driven by its own thread, for asyncio callers (the HTTP server).

The engine is not thread-safe, so one background thread owns it: submissions and
aborts are queued and applied between steps, and each step's outputs are handed to
the event loop that asked for them with `call_soon_threadsafe`. The thread sleeps
on a condition variable while there is nothing to do.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ladle.engine.engine import LLMEngine
from ladle.engine.request import StepOutput
from ladle.engine.sampling_params import SamplingParams

log = logging.getLogger("ladle")


class EngineStoppedError(RuntimeError):
    """The engine thread is gone (shut down, or a step failed); the request cannot finish."""


class RequestAbortedError(RuntimeError):
    """Someone other than the reader aborted the request (the reader's own abort just ends it)."""


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


@dataclass(frozen=True)
class StepReport:
    """What a step listener (metrics) sees after each step, on the engine thread."""

    outputs: list[StepOutput]
    started: float
    finished: float
    snapshot: EngineSnapshot


StepListener = Callable[[StepReport], None]


class RequestStream:
    """The outputs of one request, in order; iterate it on the event loop that submitted it.

    Leaving early is the caller's to signal with `abort()` (`AsyncEngine.generate` does it).
    """

    def __init__(self, request_id: str, engine: "AsyncEngine", loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.prompt_token_ids: list[int] = []
        self.finished = False
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
        return item

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


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self._cond = threading.Condition()
        self._ops: list[_Add | _Abort] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._listeners: list[StepListener] = []
        self._snapshot = EngineSnapshot()
        self._error: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------

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

    @property
    def is_running(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return alive and not self._stopping and self._error is None

    def add_step_listener(self, listener: StepListener) -> None:
        """Call `listener(StepReport)` on the engine thread after every step (keep it cheap)."""
        self._listeners.append(listener)

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # -- requests (event loop side) -------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0) -> RequestStream:
        """Submit a request and wait until the engine has accepted it.

        Raises what LLMEngine.add_request raises (InvalidRequestError for a bad request)
        before anything is streamed, or EngineStoppedError.
        """
        self.start()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        accepted = loop.create_future()
        self._submit(_Add(request_id, prompt, params, priority, stream, accepted))
        try:
            stream.prompt_token_ids = await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[StepOutput]:
        """Outputs of one request; leaving the loop early (or being cancelled) aborts it.

        After a `break` the abort runs when the generator is closed: wrap it in
        `contextlib.aclosing` to close it at once rather than when it is collected.
        """
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the blocks are free once the engine thread has drained its queue."""
        self._submit(_Abort(request_id))

    def _submit(self, op: _Add | _Abort) -> None:
        with self._cond:
            if self._stopping or self._error is not None:
                if isinstance(op, _Add):
                    raise EngineStoppedError("the engine is not running") from self._error
                return
            self._ops.append(op)
            self._cond.notify()

    # -- the engine thread ----------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._ops or self._stopping or engine.has_unfinished_requests()):
                    self._cond.wait()
                ops, self._ops = self._ops, []
                stopping = self._stopping
            if stopping:
                self._fail_all(ops, EngineStoppedError("the engine was shut down"))
                return
            self._apply(ops)
            if not engine.has_unfinished_requests():
                self._snapshot = self._take_snapshot()
                continue
            started = time.time()
            try:
                outputs = engine.step()
            except Exception as e:  # a bug, not a client error: fail everything, stop serving
                log.exception("engine step failed; stopping the engine")
                with self._cond:
                    self._error = e
                    ops, self._ops = self._ops, []
                self._fail_all(ops, EngineStoppedError(f"engine step failed: {e!r}"))
                return
            self._deliver(outputs)
            self._snapshot = self._take_snapshot()
            if self._listeners:
                self._notify(StepReport(outputs, started, time.time(), self._snapshot))

    def _apply(self, ops: list[_Add | _Abort]) -> None:
        for op in ops:
            if isinstance(op, _Abort):
                stream = self._streams.pop(op.request_id, None)
                if self.engine.abort_request(op.request_id) and stream is not None:
                    _call_soon(stream._loop, stream._put, RequestAbortedError(f"request {op.request_id} was aborted"))
                continue
            try:
                ids = self.engine.add_request(op.request_id, op.prompt, op.params, op.priority)
            except Exception as e:
                _resolve(op.stream._loop, op.accepted, error=e)
                continue
            self._streams[op.request_id] = op.stream
            _resolve(op.stream._loop, op.accepted, value=ids)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StepOutput]]] = {}
        for out in outputs:
            stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream._loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _fail_all(self, ops: list[_Add | _Abort], error: BaseException) -> None:
        for op in ops:
            if isinstance(op, _Add):
                _resolve(op.stream._loop, op.accepted, error=error)
        for rid, stream in list(self._streams.items()):
            _call_soon(stream._loop, stream._put, error)
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("could not abort request %s", rid)
        self._streams.clear()

    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        return EngineSnapshot(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            num_unfinished_requests=len(e.requests), num_blocks=e.kv.num_blocks,
            num_free_blocks=e.kv.num_free_blocks, kv_cache_usage=e.kv.usage,
            num_preemptions=e.scheduler.num_preemptions, prompt_tokens=e.stats.prompt_tokens,
            generation_tokens=e.stats.generation_tokens, steps=e.stats.steps,
        )

    def _notify(self, report: StepReport) -> None:
        for listener in self._listeners:
            try:
                listener(report)
            except Exception:
                log.exception("step listener failed")


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
