"""Start-up costs of the default model, each in a fresh process, as a new user meets them.

  kernels   building the native kernels on first use (C++ through torch's cpp_extension), an
            empty cache
  convert   the first start's one-off conversion of the embedded Q4_1 GGUF to a float32
            safetensors folder
  load      a later start: LLM() with everything cached (model load, kernel load, the start-up
            matmul measurement)
  serve     a later `ladle serve`: from the command to /health answering 200

Every step runs in a temporary LADLE_CACHE_DIR (never the user's cache), --repeats times; the
best run counts for `load` and `serve`, the first for the one-off steps.

Usage: python benchmarks/startup.py [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, free_port, running_server  # noqa: E402

PYTHON = sys.executable
STEPS = {
    "kernels": "from ladle.model.kernels import loader; assert loader.native_kernels() is not None",
    "convert": "from ladle.model.loader import resolve_model_path; resolve_model_path(None)",
    "load": "from ladle import LLM; LLM(None)",
}


def run_step(code: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([PYTHON, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def serve_until_healthy(env: dict[str, str], log: Path, timeout: float = 300.0) -> float:
    port = free_port()
    cmd = [str(Path(PYTHON).parent / "ladle"), "serve", "--port", str(port)]
    start = time.perf_counter()
    with running_server(cmd, env, port, log, timeout, poll_s=0.05):
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: every step once, the first-start steps in the warm cache")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 1
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="ladle-startup-") as cache:
        # --quick runs every step's code, but in this machine's own (warm) cache: a first start's kernel
        # build and conversion are what the suite's tests/test_kernels.py and tests/test_loader.py time
        env = dict(os.environ) if args.quick else {**os.environ, "LADLE_CACHE_DIR": cache}
        first = {step: run_step(STEPS[step], env) for step in ("kernels", "convert")}
        label = "first start (--quick: the warm cache, nothing built)" if args.quick else "first start"
        print(f"{label}: kernel build {first['kernels']:.1f} s, GGUF conversion {first['convert']:.1f} s")
        loads, serves = [], []
        for i in range(args.repeats):
            loads.append(run_step(STEPS["load"], env))
            serves.append(serve_until_healthy(env, Path(cache) / f"serve-{i + 1}.log"))
            print(f"  run {i + 1}/{args.repeats}: LLM() {loads[-1]:.1f} s, ladle serve to /health {serves[-1]:.1f} s",
                  flush=True)
        print(f"later starts (best of {args.repeats}): LLM() {min(loads):.1f} s, "
              f"ladle serve to /health {min(serves):.1f} s")


if __name__ == "__main__":
    main()
