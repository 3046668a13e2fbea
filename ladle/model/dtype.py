"""The compute dtype: what `--dtype auto|float32|bfloat16|float16` resolves to on this CPU, and why.

bf16 halves the bytes every decode step reads, but only pays where the CPU handles it
natively: AMX-BF16 runs bf16 matmuls several times faster than fp32, while on
AVX512-BF16 alone torch's bf16 matmuls are slower than fp32 (oneDNN: 166 against 280
GFLOP/s on a 2-core Xeon) yet ladle's own kernels read bf16 weights at half the bytes
and widen them on the fly (decode steps twice as fast, prefill about 0.9x). Without
either bf16 is emulated at about 1 GFLOP/s. So `auto` takes bf16 on AMX, measures the
matmuls ladle would run on AVX512-BF16, and stays fp32 elsewhere.

That measurement is taken once per machine and kept beside the kernels built for it: a
restart on a busy host must not flip the dtype, and with it every probability the server
answers (two starts of one server on one machine compute alike). Nor may a busy host decide
for a quiet one: the two dtypes are timed in interleaved rounds, and a decision whose timings
spread beyond the matmul routes' NOISY serves that process only and is taken again next start.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ladle.model.kernels.loader import build_dir, cpu_flags, native_kernels, sources_digest, write_atomically
from ladle.model.kernels.routing import ROUNDS, interleaved_seconds, is_steady

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"auto": "auto", "float": "float32", "fp32": "float32", "float32": "float32", "bf16": "bfloat16",
           "bfloat16": "bfloat16", "half": "float16", "fp16": "float16", "float16": "float16"}
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# Hardware that computes each reduced dtype natively; without it torch emulates it slowly.
NATIVE_FLAGS = {"bfloat16": ("amx_bf16", "avx512_bf16"), "float16": ("amx_fp16", "avx512_fp16")}
MIN_SPEEDUP = 1.2  # auto takes bf16 without AMX only if its matmuls measure at least this much faster
SERVING_TOKENS = 256  # the measured mix: this many prompt tokens in one prefill, and as many decode steps
DECODE_STEPS_TIMED = 16  # one-row calls per timed sample: a sample long enough to time steadily


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # float32, bfloat16 or float16
    reason: str  # one line for the start log and /version

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]


def canonical_name(dtype: str) -> str:
    name = ALIASES.get(dtype.strip().lower())
    if name is None:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, not {dtype!r}")
    return name


def choose_dtype(requested: str = "auto", flags: set[str] | None = None, quantized: bool = False) -> DtypeChoice:
    """Resolve `requested` for this CPU; warns when an explicit reduced dtype has no hardware behind it.
    quantized: the linear weights are int8 or 4-bit, which the native kernels compute with in float32."""
    name = canonical_name(requested)
    if name == "auto" and quantized and native_kernels() is not None:
        # bf16 activations would only add conversions around them (0.5B-shaped int8 model on a Zen 5
        # EPYC: 14.2 ms a token in float32, 15.8 in bf16)
        return DtypeChoice("float32", "auto: the linear weights are quantised, and their kernels compute in float32")
    if name == "auto":
        return _auto_on_this_machine() if flags is None else _auto(flags)
    flags = cpu_flags() if flags is None else flags
    if name == "float32":
        return DtypeChoice(name, "requested")
    native = [f for f in NATIVE_FLAGS[name] if f in flags]
    if native:
        return DtypeChoice(name, f"requested; the CPU computes it natively ({', '.join(native)})")
    reason = (f"requested, but this CPU has no native {name} ({' or '.join(NATIVE_FLAGS[name])}): its matmuls are "
              "emulated, typically 10-100x slower than float32")
    logger.warning("--dtype %s: %s", name, reason)
    return DtypeChoice(name, reason)


def _auto_on_this_machine() -> DtypeChoice:
    """`auto` for this CPU, as first decided here (the file names the kernels' build: torch
    version, CPU flags, instruction set); delete the file to measure again."""
    path = auto_choice_file()
    try:
        saved = json.loads(path.read_text())
        return DtypeChoice(canonical_name(saved["name"]), f"{saved['reason']} (decided once: {path})")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    choice, steady = _decide(cpu_flags())
    if not steady:
        logger.warning("the dtype choice was timed on a busy machine: used by this process, not kept")
        return choice
    try:
        write_atomically(path, json.dumps({"name": choice.name, "reason": choice.reason}))
    except OSError as e:  # a read-only cache: decide again next time
        logger.warning("could not keep the dtype choice in %s: %s", path, e)
    return choice


def auto_choice_file() -> Path:
    """Where this machine's `auto` choice is kept: beside its native kernels, under their sources'
    digest (changed kernels decide again), or (without them) in the torch build's folder."""
    if native_kernels() is None:
        return build_dir("torch") / "dtype-auto.json"
    return build_dir() / f"dtype-auto-{sources_digest()}.json"


def _auto(flags: set[str]) -> DtypeChoice:
    return _decide(flags)[0]


def _decide(flags: set[str]) -> tuple[DtypeChoice, bool]:
    """`auto` for these CPU flags, and whether the timings behind it (where it took any) were steady."""
    if "amx_bf16" in flags:
        return DtypeChoice("bfloat16", "auto: the CPU has AMX-BF16"), True
    if "avx512_bf16" not in flags:
        return DtypeChoice("float32", "auto: no native bf16 on this CPU (no AMX-BF16 or AVX512-BF16)"), True
    (fp32, bf16), steady = serving_matmul_ms((torch.float32, torch.bfloat16))
    measured = (f"{SERVING_TOKENS} prefill + {SERVING_TOKENS} decode tokens through a 896x4864 matmul take "
                f"{bf16:.1f} ms in bf16 against {fp32:.1f} in fp32")
    if fp32 >= MIN_SPEEDUP * bf16:
        return DtypeChoice("bfloat16", f"auto: AVX512-BF16 without AMX, {measured}"), steady
    return DtypeChoice("float32", f"auto: AVX512-BF16 without AMX, {measured}: fp32 is as fast here"), steady


def serving_matmul_ms(dtypes: tuple[torch.dtype, ...], k: int = 896, n: int = 4864) -> tuple[tuple[float, ...], bool]:
    """Milliseconds one linear layer spends, in each dtype, on a prefill of SERVING_TOKENS rows plus
    as many one-row decode steps, on the kernel ladle would use: the native canonical kernel (its
    bf16 path widens the weights on the fly) or, without it, torch. The dtypes are timed in
    interleaved rounds; the flag says whether every timing was steady (ladle.model.kernels.routing)."""
    calls = {}
    for dtype in dtypes:
        prefill, decode = _serving_calls(dtype, k, n)
        calls[f"{dtype} prefill"], calls[f"{dtype} decode"] = prefill, decode
    samples = interleaved_seconds(calls, ROUNDS)
    step = {name: min(times) for name, times in samples.items()}
    ms = tuple((step[f"{d} prefill"] + SERVING_TOKENS * step[f"{d} decode"] / DECODE_STEPS_TIMED) * 1e3
               for d in dtypes)
    return ms, is_steady(samples)


def _serving_calls(dtype: torch.dtype, k: int, n: int) -> tuple:
    """(a prefill of SERVING_TOKENS rows, DECODE_STEPS_TIMED one-row steps) through a k -> n layer in dtype."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(dtype)
    prefill_rows, decode_row = torch.randn(SERVING_TOKENS, k, generator=gen), torch.randn(1, k, generator=gen)
    native = native_kernels()
    if native is not None:
        packed = native.pack_panels(w)
        run = lambda x: native.canonical_linear(x, packed, n)  # noqa: E731
    else:
        run = lambda x: torch.nn.functional.linear(x.to(dtype), w)  # noqa: E731
    return lambda: run(prefill_rows), lambda: [run(decode_row) for _ in range(DECODE_STEPS_TIMED)]
