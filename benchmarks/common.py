"""Shared helpers for the benchmarks: machine facts, token-exact prompts, timing."""

from __future__ import annotations

import os
import platform
import random
import time
from contextlib import contextmanager

import torch


def machine() -> str:
    return f"{platform.machine()} {platform.processor() or ''} cores={os.cpu_count()} torch_threads={torch.get_num_threads()}".strip()


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


def matmul_gflops(m: int = 512, k: int = 576, n: int = 1536, repeats: int = 20) -> float:
    """fp32 matmul throughput on shapes like a prefill chunk through an MLP."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best = min(_time(lambda: a @ b) for _ in range(repeats))
    return 2 * m * k * n / best / 1e9


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
