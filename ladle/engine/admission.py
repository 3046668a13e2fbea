"""Admission control: a bound on the waiting queue, and when a refused client should come back.

Past the bound a request is refused at once instead of queued (the server answers 429),
so admitted requests keep their latency. A place in the queue frees up each time a
request completes, so a refused client should wait about (excess / completion rate)
seconds: the rate is measured over the recent completions.
"""

from __future__ import annotations

import math
import time
from collections import deque


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; retry after `retry_after` seconds (an integer, >= 1)."""

    def __init__(self, num_waiting: int, limit: int, retry_after: int):
        super().__init__(f"the server is at capacity: {num_waiting} requests are waiting (the limit is {limit}); "
                         f"retry in {retry_after} s")
        self.num_waiting, self.limit, self.retry_after = num_waiting, limit, retry_after


class CompletionRate:
    """Times of the last completions, for a Retry-After estimate. Not thread-safe: lock around it."""

    WINDOW_S = 60.0  # completions older than this say nothing about the present
    MAX_RETRY_S = 60
    NO_DATA_RETRY_S = 1  # nothing completed lately (a cold start): no basis for more

    def __init__(self, maxlen: int = 64):
        self._times: deque[float] = deque(maxlen=maxlen)

    def record(self, t: float) -> None:
        self._times.append(t)

    def per_second(self, now: float | None = None) -> float | None:
        now = time.time() if now is None else now
        recent = [t for t in self._times if now - t <= self.WINDOW_S]
        if not recent:
            return None
        # at least a second: a burst that just finished together is no steady rate
        return len(recent) / max(now - recent[0], 1.0)

    def retry_after(self, excess: int, now: float | None = None) -> int:
        """Seconds until `excess` requests have completed at the recent rate, in [1, MAX_RETRY_S]."""
        rate = self.per_second(now)
        if rate is None:
            return self.NO_DATA_RETRY_S
        return min(self.MAX_RETRY_S, max(1, math.ceil(excess / rate)))
