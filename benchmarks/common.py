"""Shared helpers for the benchmarks: machine facts, token-exact prompts, timing."""

from __future__ import annotations

import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")


def cpu_name() -> str:
    """The CPU model and the flags that decide ladle's paths, e.g. 'AMD EPYC 7B13 [avx2]'."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return f"{name or platform.machine()} [{' '.join(f for f in ISA_FLAGS if f in flags)}]"


def machine() -> str:
    return f"{cpu_name()} cores={os.cpu_count()} torch_threads={torch.get_num_threads()}"


def write_results(out: str | None, args: object, results: dict) -> None:
    """A script's results as JSON at `out` (none: nothing written), with the machine and the arguments."""
    if not out:
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"machine": machine(), "args": vars(args), "results": results}, indent=1))
    print(f"wrote {out}")


def random_prompt_ids(rng: random.Random, length: int, vocab_lo: int = 200, vocab_hi: int = 40000) -> list[int]:
    """A prompt of exactly `length` ordinary tokens (no specials), so both engines see the same ids."""
    return [rng.randrange(vocab_lo, vocab_hi) for _ in range(length)]


@contextmanager
def timed(label: str, sink: dict):
    print(f"  {label} ...", flush=True)
    t = time.perf_counter()
    yield
    sink[label] = time.perf_counter() - t
    print(f"  {label}: {sink[label]:.2f} s", flush=True)


def read_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """Streaming read bandwidth: the best of a few sums over a buffer far larger than the caches."""
    buf = torch.randn(mib * 2**20 // 4)  # random: identical pages could be merged by the host and read from cache
    buf.sum()
    best = min(_time(lambda: buf.sum()) for _ in range(repeats))
    return buf.numel() * 4 / best / 1e9


def matmul_gflops(m: int = 512, k: int = 576, n: int = 1536, repeats: int = 20,
                  dtype: torch.dtype = torch.float32) -> float:
    """torch matmul throughput in `dtype` on shapes like a prefill chunk through an MLP."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    best = min(_time(lambda: a @ b) for _ in range(repeats))
    return 2 * m * k * n / best / 1e9


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(cmd: list[str], env: dict, port: int, log: Path, timeout_s: float,
                   poll_s: float = 0.1) -> Iterator[str]:
    """Start `cmd` in its own process group, yield its base URL once /health answers 200, then stop it."""
    with running_servers([(cmd, port, log)], env, timeout_s, poll_s) as [base]:
        yield base


@contextmanager
def running_servers(servers: list[tuple[list[str], int, Path]], env: dict, timeout_s: float,
                    poll_s: float = 0.1) -> Iterator[list[str]]:
    """Start every (cmd, port, log) at once, yield their base URLs once each answers /health (they
    load side by side), then stop them all."""
    procs: list[subprocess.Popen] = []
    try:
        for cmd, _, log in servers:
            print(f"  $ {shlex.join(cmd)}  (log: {log})", flush=True)
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout_s
        bases = [f"http://127.0.0.1:{port}" for _, port, _ in servers]
        for proc, base, (_, _, log) in zip(procs, bases, servers):
            _wait_healthy(proc, base, log, deadline, timeout_s, poll_s)
        yield bases
    finally:
        for proc in procs:
            stop(proc)


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path, deadline: float, timeout_s: float,
                  poll_s: float) -> None:
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with {proc.returncode} before /health:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no /health within {timeout_s:.0f} s")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)  # the group this script created: the server and its workers
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
