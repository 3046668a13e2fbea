"""Which matmul kernel serves which call, chosen by measurement on the machine at hand.

Three kernels can compute a linear layer: the native small-row kernel (row-major W, AVX2),
the native canonical kernel (packed panels, AVX-512 where the CPU has it) and torch (MKL,
or oneDNN for bf16). Which is fastest depends on the CPU: on an AVX2-only EPYC the
small-row kernel beats MKL for decode steps; on an AVX-512 Xeon MKL's and the canonical
kernel's wider paths win. So at start-up each candidate is timed on the model's own
weights, for a decode-sized and a prefill-sized call, and the fastest is used from then on.
It is timed as the model runs it: one pass over enough layers' weights that they come from
memory, not from a cache that a single repeated call would keep them in (the canonical
kernel prefetches the weights it will read next; MKL's cost differs). The choice is kept
per process for the same shapes, so a second engine on the same model does not re-measure.
LADLE_MATMUL=DECODE:PREFILL (say `small:torch` or `canonical:canonical`) skips the
measurement and forces a route, so tests can run every path on any machine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladle.model.kernels.loader import MAX_ROWS
from ladle.model.kernels.native import NativeKernels

logger = logging.getLogger(__name__)

KERNELS = ("small", "canonical", "torch")
DECODE_ROWS = 8  # a typical decode batch
PREFILL_ROWS = 128  # a prefill chunk
MEASURED_BYTES = 256 << 20  # weights per timed pass: more than the caches hold
_chosen: dict[tuple, MatmulRouting] = {}


@dataclass(frozen=True)
class MatmulRouting:
    """Kernel names per call size: `small` (native small-row), `canonical` (native panels), `torch`."""

    decode: str = "small"  # calls of up to MAX_ROWS rows
    prefill: str = "torch"  # larger calls
    measured: str = ""  # the timings behind the choice, for the start log

    def kernel_for(self, rows: int) -> str:
        return self.decode if rows <= MAX_ROWS else self.prefill


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
        _chosen[key] = _measure(native, *_measured_prefix(native, weights, packed))
    return _chosen[key]


def forced_routing() -> MatmulRouting | None:
    """The route LADLE_MATMUL names, if set."""
    value = os.environ.get("LADLE_MATMUL", "").strip().lower()
    if not value:
        return None
    decode, _, prefill = value.partition(":")
    if decode not in KERNELS or prefill not in KERNELS:
        raise ValueError(f"LADLE_MATMUL must be DECODE:PREFILL with each one of {KERNELS}, not {value!r}")
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


def _measure(native: NativeKernels, weights: list[torch.Tensor], packed: list[torch.Tensor]) -> MatmulRouting:
    dtype = weights[0].dtype
    decode = ["canonical", "torch"] + (["small"] if dtype == torch.float32 else [])
    prefill = ["canonical", "torch"]
    timings = {}
    for size, rows, names in (("decode", DECODE_ROWS, decode), ("prefill", PREFILL_ROWS, prefill)):
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
                  for w in weights}
        for name in names:
            calls = [_call(native, name, w, p, inputs[w.shape[1]]) for w, p in zip(weights, packed)]
            timings[size, name] = best_seconds(lambda: [call() for call in calls], repeats=2)
    best = {size: min((t, name) for (s, name), t in timings.items() if s == size)[1] for size in ("decode", "prefill")}
    measured = ", ".join(f"{size} {name} {t * 1e3:.2f} ms" for (size, name), t in sorted(timings.items()))
    return MatmulRouting(best["decode"], best["prefill"], measured)


def _call(native: NativeKernels, name: str, w: torch.Tensor, packed: torch.Tensor,
          x: torch.Tensor) -> Callable[[], object]:
    if name == "small":
        return lambda: native.linear(x, w)
    if name == "canonical":
        return lambda: native.canonical_linear(x, packed, w.shape[0])
    xt = x.to(w.dtype)
    return lambda: torch.nn.functional.linear(xt, w)
