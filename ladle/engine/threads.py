"""One thread computes: the OpenMP team behind torch's CPU ops belongs to the engine thread.

libgomp gives each thread that opens a parallel region a team of worker threads of its
own, and once a process holds more OpenMP threads than it has CPUs it stops spin-waiting
between regions, so every region pays a futex wake-up. Loading a model on the main thread
leaves the main thread such a team; an engine stepping on its own thread afterwards ran
its steps 13-35% slower on 2 cores (many small regions suffer most). So the thread that
built the engine releases its team before handing it over, and the engine thread applies
the thread count itself (OpenMP settings are per thread).
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch

log = logging.getLogger("ladle")

_OMP_PAUSE_SOFT = 1


def release_openmp_team() -> None:
    """Let the calling thread's OpenMP workers exit (a no-op if it has none); the next
    parallel region this thread opens builds a new team."""
    for lib in _openmp_runtimes():
        lib.omp_pause_resource_all(_OMP_PAUSE_SOFT)


def claim_compute(num_threads: int | None) -> None:
    """Set the thread count (if configured) for the calling thread, the one that will step."""
    if num_threads:
        torch.set_num_threads(num_threads)


@cache
def _openmp_runtimes() -> tuple[ctypes.CDLL, ...]:
    """The libgomp copies this process has loaded (torch's own, on Linux wheels)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:  # not Linux: nothing to release
        return ()
    libs = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            libs.append(lib)
        except (OSError, AttributeError):  # an old libgomp without OpenMP 5 pause
            log.debug("cannot release OpenMP threads through %s", path)
    return tuple(libs)
