"""What --deterministic costs: the default model with and without it, side by side in one process.

  decode   batch-1 ms/token: 64 greedy tokens after a short prompt, less that prompt's time
  prefill  a 512-token prompt, one output token (prefix cache off, so every run computes it)

Runs alternate between the two engines (--repeats rounds) and the best of each counts, so a
busy moment of the machine does not land on one side only.

Usage: python benchmarks/deterministic.py [--model PATH] [--repeats 5] [--dtype float32] [--quick]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, random_prompt_ids  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402

DECODE_TOKENS = 64


def seconds(llm: LLM, prompt: list[int], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params)
    return time.perf_counter() - start


def measure(llm: LLM, rng: random.Random, decode_tokens: int = DECODE_TOKENS,
            prefill_len: int = 512) -> dict[str, float]:
    short = random_prompt_ids(rng, 16)
    decode = (seconds(llm, short, decode_tokens + 1) - seconds(llm, short, 1)) / decode_tokens
    return {"decode_ms": decode * 1e3, "prefill_s": seconds(llm, random_prompt_ids(rng, prefill_len), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round, 8 decode tokens, a 64-token prompt")
    args = ap.parse_args()
    sizes = (8, 64) if args.quick else (DECODE_TOKENS, 512)
    if args.quick:
        args.repeats = 1
    print(f"machine: {machine()}")
    engines = {mode: LLM(args.model, deterministic=mode, enable_prefix_caching=False, dtype=args.dtype,
                         kv_cache_memory_gib=0.5) for mode in (False, True)}
    info = engines[False].engine.runtime_info()
    print(f"dtype {info['dtype']}, kernels {info['kernels']}, matmul {info['matmul']}")
    best: dict[bool, dict[str, float]] = {}
    for r in range(args.repeats):
        for mode, llm in engines.items():
            got = measure(llm, random.Random(r), *sizes)
            best[mode] = {k: min(v, best.get(mode, {}).get(k, float("inf"))) for k, v in got.items()}
        print(f"  round {r + 1}/{args.repeats} done", flush=True)
    off, on = best[False], best[True]
    print(f"batch-1 decode: {on['decode_ms']:.1f} ms/token with --deterministic, {off['decode_ms']:.1f} without "
          f"({on['decode_ms'] / off['decode_ms']:.2f}x)")
    print(f"{sizes[1]}-token prompt: {on['prefill_s']:.2f} s with --deterministic, {off['prefill_s']:.2f} s without "
          f"({on['prefill_s'] / off['prefill_s']:.2f}x)")


if __name__ == "__main__":
    main()
