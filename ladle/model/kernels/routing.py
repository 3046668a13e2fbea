"""Which matmul kernel serves which call, chosen by measurement on the machine at hand.

Three kernels can compute a linear layer: the native small-row kernel (row-major W, AVX2),
the native canonical kernel (packed panels, AVX-512 where the CPU has it) and torch (MKL,
or oneDNN for bf16); a fourth on CPUs with AMX-BF16, the native AMX kernel for decode-sized
bf16 calls (row-major W, never on other CPUs: it exists only in the `amx` build). Which is
fastest depends on the CPU: on an AVX2-only EPYC the
small-row kernel beats MKL for decode steps; on an AVX-512 Xeon MKL's and the canonical
kernel's wider paths win. So at start-up each candidate is timed on the model's own
weights, for a decode-sized and a prefill-sized call, and the fastest is used from then on.
It is timed as the model runs it: one pass over enough layers' weights that they come from
memory, not from a cache that a single repeated call would keep them in (the canonical
kernel prefetches the weights it will read next; MKL's cost differs).

The best kernel also depends on the call's row count: one row is bound by reading W, and a
kernel that streams it once wins; at 16 or 64 rows the FLOPs start to count, and a kernel with
wider register tiles (or oneDNN's) may win instead. So decode-sized calls are measured in
ROW_BUCKETS (1, 2-4, 5-16, 17-64 rows, each timed at its largest), prompt-sized ones at
PREFILL_ROWS, and each bucket gets its own winner. The choice is kept per machine, beside the
kernels built for it and their sources (`matmul-routes/<dtype and shapes>.json`; delete it to measure
again), as the dtype choice is: a restart computes the same way, and a second engine does not re-measure.

A busy machine must not decide for a quiet one: the candidates are timed in interleaved rounds
(each round times every candidate once, and each keeps its fastest), so a burst of load slows
one sample of each rather than every sample of one; and where a candidate's rounds spread by more
than NOISY (its slowest over its fastest), the machine was busy: the choice serves this process
and is not kept, and the next start measures again. (Routes measured while a test suite loaded
both cores once kept the torch route for 5-16 rows on an EPYC, and with it a 2x slower decode.)
LADLE_MATMUL=DECODE:PREFILL (say `small:torch` or `canonical:canonical`) skips the
measurement and forces a route, so tests can run every path on any machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ladle.model.kernels.native import NativeKernels

logger = logging.getLogger(__name__)

KERNELS = ("small", "canonical", "torch", "amx")
ROW_BUCKETS = (1, 4, 16, 64)  # decode-sized calls: up to 1, 4, 16 and 64 rows; more is prompt-sized
PREFILL_ROWS = 128  # a prefill chunk
MEASURED_BYTES = 256 << 20  # weights per timed pass: more than the caches hold
ROUNDS = 3  # timed passes per candidate, interleaved with the others'
NOISY = 1.5  # a candidate's slowest round over its fastest beyond which the timings are not kept
ROUTES_VERSION = 2  # kept routes of another version are measured again (1: sequential timings, kept however noisy)
_chosen: dict[tuple, MatmulRouting] = {}


@dataclass(frozen=True)
class MatmulRouting:
    """Kernel names per call size: `small` (native small-row), `canonical` (native panels), `torch`.
    by_rows, when measured, names one per ROW_BUCKETS bucket; otherwise `decode` serves them all."""

    decode: str = "small"  # decode-sized calls (up to ROW_BUCKETS[-1] rows), unless by_rows says otherwise
    prefill: str = "torch"  # larger calls
    measured: str = ""  # the timings behind the choice, for the start log
    by_rows: tuple[str, ...] = ()
    # canonical (batch-invariant) rows, whatever their count: the native canonical kernel on the CPU,
    # the fixed-tile Triton matmul where the layer ops are Triton's (CUDA)
    invariant: str = "canonical"

    @property
    def buckets(self) -> tuple[str, ...]:
        """The kernel for each ROW_BUCKETS bucket."""
        return self.by_rows or (self.decode,) * len(ROW_BUCKETS)

    def kernel_for(self, rows: int) -> str:
        return next((kernel for limit, kernel in zip(ROW_BUCKETS, self.buckets) if rows <= limit), self.prefill)

    def table(self) -> str:
        """The route per row bucket, as the start log and the benchmarks print it."""
        lows = (1,) + tuple(limit + 1 for limit in ROW_BUCKETS[:-1])
        cells = [f"{lo}-{hi} {k}" if lo < hi else f"{lo} {k}" for lo, hi, k in zip(lows, ROW_BUCKETS, self.buckets)]
        return ", ".join(cells + [f"{ROW_BUCKETS[-1] + 1}+ {self.prefill}"])


def choose_routing(native: NativeKernels | None, weights: list[torch.Tensor],
                   packed: list[torch.Tensor] | None = None) -> MatmulRouting:
    """Time each kernel that can take `weights` (the model's linear weights in the order it runs
    them, [out, in]; `packed`: the same in the canonical kernel's layout) at decode and prefill
    sizes, in passes over the first MEASURED_BYTES of them; the fastest pass wins each size."""
    if native is None:
        return MatmulRouting("torch", "torch", "no native kernels")
    forced = forced_routing()
    if forced is not None:
        return forced
    key = (native.isa, weights[0].dtype, tuple(tuple(w.shape) for w in weights))
    if key not in _chosen:
        _chosen[key] = _kept(native.isa, key) or _measure_and_keep(native, key, weights, packed)
    return _chosen[key]


def _measure_and_keep(native: NativeKernels, key: tuple, weights: list[torch.Tensor],
                      packed: list[torch.Tensor] | None) -> MatmulRouting:
    routing, steady = _measure(native, *_measured_prefix(native, weights, packed))
    if steady:
        return _keep(native.isa, key, routing)
    logger.warning("matmul routes measured on a busy machine (a kernel's timings spread by more than %.1fx): "
                   "used by this process, not kept; the next start measures again", NOISY)
    return routing


def routes_file(isa: str, key: tuple) -> Path:
    """Where the routes for these weights (dtype and shapes) are kept on this machine, for these kernels'
    sources: changed kernels are measured again."""
    from ladle.model.kernels.loader import build_dir, sources_digest

    digest = hashlib.sha1(repr((sources_digest(), *key[1:])).encode()).hexdigest()[:16]
    return build_dir(isa) / "matmul-routes" / f"{str(key[1]).removeprefix('torch.')}-{digest}.json"


def _kept(isa: str, key: tuple) -> MatmulRouting | None:
    path = routes_file(isa, key)
    try:
        saved = json.loads(path.read_text())
        if saved.get("version") != ROUTES_VERSION:
            return None
        by_rows = tuple(saved["by_rows"])
        if len(by_rows) != len(ROW_BUCKETS) or not set(by_rows) | {saved["prefill"]} <= set(KERNELS):
            return None
        return MatmulRouting(by_rows[-1], saved["prefill"], f"{saved['measured']} (measured once: {path})", by_rows)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep(isa: str, key: tuple, routing: MatmulRouting) -> MatmulRouting:
    from ladle.model.kernels.loader import write_atomically

    path = routes_file(isa, key)
    try:
        write_atomically(path, json.dumps({"version": ROUTES_VERSION, "by_rows": routing.by_rows,
                                           "prefill": routing.prefill, "measured": routing.measured}))
    except OSError as e:  # a read-only cache: measure again next time
        logger.warning("could not keep the matmul routes in %s: %s", path, e)
    return routing


def forced_routing() -> MatmulRouting | None:
    """The route LADLE_MATMUL names, if set."""
    value = os.environ.get("LADLE_MATMUL", "").strip().lower()
    if not value:
        return None
    decode, _, prefill = value.partition(":")
    if decode not in KERNELS or prefill not in KERNELS:
        raise ValueError(f"LADLE_MATMUL must be DECODE:PREFILL with each one of {KERNELS}, not {value!r}")
    if "amx" in (decode, prefill):
        from ladle.model.kernels.loader import native_kernels

        native = native_kernels()
        if native is None or not native.amx:
            raise ValueError(f"LADLE_MATMUL={value}: the amx kernel needs a CPU with AMX-BF16 and the amx build "
                             f"(these kernels: {native.isa if native is not None else 'none'})")
    return MatmulRouting(decode, prefill, "forced by LADLE_MATMUL")


def best_seconds(call: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls after a warm-up, so another process's time slice
    does not decide a choice."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def _measured_prefix(native: NativeKernels, weights: list[torch.Tensor],
                     packed: list[torch.Tensor] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    count, total = 0, 0
    while count < len(weights) and total < MEASURED_BYTES:
        total += weights[count].numel() * weights[count].element_size()
        count += 1
    weights = weights[:count]
    return weights, packed[:count] if packed is not None else [native.pack_panels(w) for w in weights]


def _measure(native: NativeKernels, weights: list[torch.Tensor],
             packed: list[torch.Tensor]) -> tuple[MatmulRouting, bool]:
    """The fastest candidate per size, and whether every candidate's timings were steady (see NOISY)."""
    decode = ["canonical", "torch"] + (["small"] if weights[0].dtype == torch.float32 else []) + \
        (["amx"] if native.amx and weights[0].dtype == torch.bfloat16 else [])
    sizes = [(rows, decode) for rows in ROW_BUCKETS] + [(PREFILL_ROWS, ["canonical", "torch"])]
    timings: dict[int, dict[str, float]] = {}
    steady = True
    for rows, names in sizes:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
                  for w in weights}
        passes = {name: _pass(native, name, weights, packed, inputs) for name in names}
        samples = interleaved_seconds(passes, ROUNDS)
        timings[rows] = {name: min(times) for name, times in samples.items()}
        steady = steady and is_steady(samples)
    best = {rows: min(timings[rows], key=timings[rows].get) for rows, _ in sizes}
    measured = "; ".join(f"{rows} rows: " + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in sorted(ts.items()))
                         for rows, ts in timings.items())
    by_rows = tuple(best[rows] for rows in ROW_BUCKETS)
    return MatmulRouting(best[ROW_BUCKETS[-1]], best[PREFILL_ROWS], measured, by_rows), steady


def interleaved_seconds(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each call's seconds in `rounds` rounds (after a warm-up), every round timing each call once."""
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return samples


def is_steady(samples: dict[str, list[float]]) -> bool:
    """Whether no candidate's slowest round took more than NOISY times its fastest."""
    return all(max(times) <= NOISY * min(times) for times in samples.values())


def _pass(native: NativeKernels, name: str, weights: list[torch.Tensor], packed: list[torch.Tensor],
          inputs: dict[int, torch.Tensor]) -> Callable[[], object]:
    """One pass of kernel `name` over the weights, each layer on its input width's rows."""
    calls = [_call(native, name, w, p, inputs[w.shape[1]]) for w, p in zip(weights, packed)]
    return lambda: [call() for call in calls]


def _call(native: NativeKernels, name: str, w: torch.Tensor, packed: torch.Tensor,
          x: torch.Tensor) -> Callable[[], object]:
    if name == "small":
        return lambda: native.linear(x, w)
    if name == "canonical":  # as the model calls it: bf16 rows for bf16 weights
        xc = x.to(torch.bfloat16) if w.dtype == torch.bfloat16 else x
        return lambda: native.canonical_linear(xc, packed, w.shape[0])
    xt = x.to(w.dtype)
    if name == "amx":
        return lambda: native.amx_linear(xt, w)
    return lambda: torch.nn.functional.linear(xt, w)
