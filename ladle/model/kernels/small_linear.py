"""Loader for small_linear.cpp: x @ W^T (+ b) for the few rows of a decode step.

Compiled with torch.utils.cpp_extension on first use (about a second: the source
includes no torch headers) into the ladle cache, then called through ctypes.
LADLE_NATIVE_KERNELS=0 turns it off; any failure to build or load logs one warning
and leaves callers on their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAX_ROWS = 8  # must match kMaxRows in small_linear.cpp
_SOURCE = Path(__file__).with_name("small_linear.cpp")
_lock = threading.Lock()
_loaded = False
_kernel: SmallLinear | None = None


class SmallLinear:
    """y[M, out] = x[M, in] @ weight[out, in]^T (+ bias), M <= MAX_ROWS.

    All operands contiguous float32 on the CPU; the caller checks, the kernel trusts.
    """

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.ladle_small_linear
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = None
        self._fn = fn

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows, k = x.shape
        n = weight.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        self._fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                 rows, k, n, torch.get_num_threads())
        return y


def enabled() -> bool:
    return os.environ.get("LADLE_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def small_linear() -> SmallLinear | None:
    """The kernel, built on the first call; None if disabled or it could not be built."""
    global _loaded, _kernel
    if not _loaded:
        with _lock:
            if not _loaded:
                _kernel = _load() if enabled() else None
                _loaded = True
    return _kernel


def reset() -> None:
    """Forget the loaded kernel, so the next call re-reads LADLE_NATIVE_KERNELS (tests)."""
    global _loaded, _kernel
    with _lock:
        _loaded, _kernel = False, None


def build_dir() -> Path:
    """Under the ladle cache, per torch version and CPU: the library is built for the host's instruction set."""
    root = os.environ.get("LADLE_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "ladle"
    return base / "kernels" / f"torch{torch.__version__}-{_cpu_tag()}"


def _cpu_tag() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def _load() -> SmallLinear | None:
    try:
        start = time.perf_counter()
        kernel = SmallLinear(ctypes.CDLL(_build()))
        _check(kernel)
        logger.info("native small_linear kernel ready in %.1f s", time.perf_counter() - start)
        return kernel
    except Exception as e:  # no compiler, no ninja, a wrong answer: torch still works
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        logger.warning("native kernels unavailable, using torch matmuls (%s: %s)", type(e).__name__, first_line)
        return None


def _build() -> str:
    from torch.utils import cpp_extension

    _find_ninja()
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = cpp_extension.load(
        name="ladle_small_linear",
        sources=[str(_SOURCE)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
    )
    if not isinstance(path, str):  # documented to return nothing; torch 2.13 returns the path
        path = str(directory / "ladle_small_linear.so")
    return path


def _find_ninja() -> None:
    # pip's ninja lands next to the interpreter, which is not on PATH unless the venv is activated.
    bin_dir = Path(sys.executable).parent
    if shutil.which("ninja") is None and (bin_dir / "ninja").exists():
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def _check(kernel: SmallLinear) -> None:
    """One small product against torch, so a miscompiled kernel is never used."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=gen)
    w = torch.randn(13, 40, generator=gen)
    b = torch.randn(13, generator=gen)
    if not torch.allclose(kernel(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4):
        raise RuntimeError("self-check against torch failed")
