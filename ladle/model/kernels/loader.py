"""Builds the C++ kernels next to this file into one library and loads it (ladle.model.kernels.native
calls it through ctypes).

Compiled with torch.utils.cpp_extension on first use (a few seconds: the sources
include no torch headers) into the ladle cache, once per instruction set: `amx` (the
AVX-512 build plus AMX-BF16 tiles for decode-sized bf16 matmuls), `avx512` (AVX-512F and
what the host adds, AMX masked off), `avx2` (AVX2 + FMA) or `scalar`. The best one the CPU
runs is chosen at start-up; LADLE_ISA=avx512 (or avx2, scalar) forces a lower one, so the
fallbacks are tested on any machine. LADLE_NATIVE_KERNELS=0 turns the kernels off; any
failure to build or load logs one warning and leaves callers on their torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ladle.model.kernels.native import NativeKernels

logger = logging.getLogger(__name__)

ISAS = ("amx", "avx512", "avx2", "scalar")  # best first
AMX_FLAGS = {"amx_tile", "amx_bf16"}
# Compiler flags per instruction set: the host's own (-march=native) with the higher sets masked off.
_ISA_FLAGS = {"amx": [], "avx512": [], "avx2": ["-mno-avx512f"], "scalar": ["-mno-avx"]}
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]  # given only where the host has AMX
KERNELS_DIR = Path(__file__).parent
_SOURCES = sorted(KERNELS_DIR.glob("*.cpp"))
_lock = threading.Lock()
_loaded = False
_kernels: NativeKernels | None = None


def enabled() -> bool:
    return os.environ.get("LADLE_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def requested_isa() -> str:
    """LADLE_ISA: `auto` (the best the CPU runs) or one of ISAS."""
    isa = os.environ.get("LADLE_ISA", "auto").strip().lower() or "auto"
    if isa not in ("auto",) + ISAS:
        raise ValueError(f"LADLE_ISA must be auto or one of {ISAS}, not {isa!r}")
    return isa


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split(":")[-1].split())
    except OSError:
        return set()


def supported_isas(flags: set[str] | None = None) -> list[str]:
    """The instruction sets of ISAS this CPU runs, best first (x86 only; elsewhere just scalar)."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["scalar"]
    isas = ["scalar"] if "avx" in flags else []
    if {"avx2", "fma"} <= flags:
        isas.insert(0, "avx2")
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        isas.insert(0, "avx512")
        if AMX_FLAGS <= flags:
            isas.insert(0, "amx")
    return isas or ["scalar"]


def chosen_isa() -> str:
    """The instruction set the kernels are built for: LADLE_ISA if the CPU runs it, else the best."""
    supported = supported_isas()
    isa = requested_isa()
    if isa == "auto":
        return supported[0]
    if isa not in supported:
        logger.warning("LADLE_ISA=%s: this CPU does not run it; using %s", isa, supported[0])
        return supported[0]
    return isa


def native_kernels() -> NativeKernels | None:
    """The kernels, built on the first call; None if disabled or they could not be built."""
    global _loaded, _kernels
    if not _loaded:
        with _lock:
            if not _loaded:
                _kernels = _load() if enabled() else None
                _loaded = True
    return _kernels


def reset() -> None:
    """Forget the loaded kernels, so the next call re-reads LADLE_NATIVE_KERNELS (tests)."""
    global _loaded, _kernels
    with _lock:
        _loaded, _kernels = False, None


@functools.cache
def sources_digest() -> str:
    """The kernels' sources (every .cpp and .h in KERNELS_DIR) as 12 hex digits. What is measured on one
    build (the matmul routes, the auto dtype) is kept under it, so changed kernels are measured again."""
    digest = hashlib.sha1()
    for path in sorted([*KERNELS_DIR.glob("*.cpp"), *KERNELS_DIR.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def build_dir(isa: str | None = None) -> Path:
    """Under the ladle cache, per torch version, CPU and instruction set."""
    root = os.environ.get("LADLE_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "ladle"
    return base / "kernels" / f"torch{torch.__version__}-{_cpu_tag()}-{isa or chosen_isa()}"


def write_atomically(path: Path, text: str) -> None:
    """text into path (its folders made), through a partial file renamed over it, so a reader in another
    process never sees half of it; OSError where the cache cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def _cpu_tag() -> str:
    return hashlib.sha1(f"{platform.machine()} {' '.join(sorted(cpu_flags()))}".encode()).hexdigest()[:12]


def _load() -> NativeKernels | None:
    try:
        start = time.perf_counter()
        isa = chosen_isa()
        kernels = NativeKernels(ctypes.CDLL(_build(isa)))
        _check(kernels)
        logger.info("native kernels (%s) ready in %.1f s", kernels.isa, time.perf_counter() - start)
        return kernels
    except Exception as e:  # no compiler, no ninja, a wrong answer: torch still works
        first_line = (str(e).strip().splitlines() or [""])[0]
        logger.warning("native kernels unavailable, using torch (%s: %s)", type(e).__name__, first_line)
        return None


def _build(isa: str) -> str:
    from torch.utils import cpp_extension

    _find_ninja()
    directory = build_dir(isa)
    directory.mkdir(parents=True, exist_ok=True)
    path = cpp_extension.load(
        name=f"ladle_kernels_{isa}",
        sources=[str(s) for s in _SOURCES],
        # -ffp-contract=off: no fused multiply-adds the source did not ask for, so plain loops stay IEEE
        extra_cflags=["-O3", "-march=native", *_isa_flags(isa), "-ffp-contract=off", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
    )
    if not isinstance(path, str):  # documented to return nothing; torch 2.13 returns the path
        path = str(directory / f"ladle_kernels_{isa}.so")
    return path


def _isa_flags(isa: str) -> list[str]:
    return _ISA_FLAGS[isa] + (_NO_AMX if isa != "amx" and AMX_FLAGS <= cpu_flags() else [])


def _find_ninja() -> None:
    # pip's ninja lands next to the interpreter, which is not on PATH unless the venv is activated.
    bin_dir = Path(sys.executable).parent
    if shutil.which("ninja") is None and (bin_dir / "ninja").exists():
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def _check(kernels: NativeKernels) -> None:
    """Small cases against torch, so a miscompiled library is never used."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=gen)
    w = torch.randn(13, 40, generator=gen)
    b = torch.randn(13, generator=gen)
    norm = torch.randn(40, generator=gen)
    close = torch.allclose(kernels.linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    close &= torch.allclose(kernels.rms_norm(x, norm, 1e-6), torch.nn.functional.rms_norm(x, (40,), norm, 1e-6),
                            rtol=1e-5, atol=1e-6)
    k_cache, v_cache = torch.randn(2, 4, 1, 8, generator=gen), torch.randn(2, 4, 1, 8, generator=gen)
    q = torch.randn(1, 2, 8, generator=gen)  # two query heads sharing one KV head; 6 tokens in blocks 1, 0
    out = kernels.decode_attention(q, k_cache, v_cache, torch.tensor([[1, 0]]), torch.tensor([6]), 8**-0.5)
    k, v = torch.cat([k_cache[1], k_cache[0]])[:6, 0], torch.cat([v_cache[1], v_cache[0]])[:6, 0]
    expect = torch.softmax(q[0] @ k.T * 8**-0.5, dim=-1) @ v
    close &= torch.allclose(out, expect.reshape(1, 16), rtol=1e-5, atol=1e-6)
    y = kernels.canonical_linear(x, kernels.pack_panels(w), 13, b)
    close &= torch.allclose(y, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    if not close:
        raise RuntimeError("self-check against torch failed")
    if kernels.amx:
        _check_amx(kernels, gen)


def _check_amx(kernels: NativeKernels, gen: torch.Generator) -> None:
    """The AMX kernels on tile-and-tail shapes: the bf16 one against torch, the int8 one against the
    int8 dot-product kernel bit for bit (the same arithmetic). A wrong answer turns that kernel off alone."""
    x, w = torch.randn(19, 80, generator=gen).bfloat16(), torch.randn(21, 80, generator=gen).bfloat16()
    if not _holds(lambda: torch.allclose(kernels.amx_linear(x, w).float(), x.float() @ w.float().T, rtol=2**-7,
                                         atol=1e-2), "the AMX kernel", "bf16 decode matmuls"):
        kernels.amx = False
    if kernels.amx_int8:
        q = torch.randint(-127, 128, (40, 96), generator=gen, dtype=torch.int8)  # an odd panel; two x halves
        packed, scales = kernels.pack_dot(q, torch.rand(40, generator=gen) + 0.5)
        x = torch.randn(19, 96, generator=gen)
        if not _holds(lambda: torch.equal(kernels.int8_amx_linear(x, packed, scales, 40),
                                          kernels.int8_dot_linear(x, packed, scales, 40)),
                      "the int8 AMX kernel", "int8 decode matmuls"):
            kernels.amx_int8 = False


def _holds(check: Callable[[], bool], kernel: str, matmuls: str) -> bool:
    """Whether a kernel's self-check holds; if not, a warning names why and who does its work instead."""
    try:
        if check():
            return True
        why = "a wrong answer"
    except RuntimeError as e:
        why = str(e)
    logger.warning("%s failed its self-check (%s); %s use the others", kernel, why, matmuls)
    return False
