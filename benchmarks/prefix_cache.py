"""What the prefix cache buys, on the offline engine.

  ttft    a request whose 2,000-token prefix is cached, against the same request cold
          (median of --repeats fresh prefixes; each is first run cold, then again with a
          new suffix, so both runs see the same engine, pool and prefix length)
  shared  output tokens/s of N requests sharing one long system prompt, with distinct
          questions, with the cache on and off (ignore_eos, greedy)

Usage: python benchmarks/prefix_cache.py [--model PATH] [--quick] [--save out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, random_prompt_ids  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def ttft(llm: LLM, prompt: list[int]) -> float:
    """Seconds from submission to the first token, stepping the engine by hand."""
    engine = llm.engine
    rid = f"ttft-{time.perf_counter_ns()}"
    t = time.perf_counter()
    engine.add_request(rid, prompt, FIRST_TOKEN)
    while engine.has_unfinished_requests():
        if any(out.request_id == rid and any(d.token_ids for d in out.deltas) for out in engine.step()):
            break
    return time.perf_counter() - t


def bench_ttft(llm: LLM, prefix_len: int, suffix_len: int, repeats: int) -> dict:
    rng = random.Random(0)
    ttft(llm, random_prompt_ids(rng, 64))  # warm up
    cold, cached = [], []
    for r in range(repeats):
        prefix = random_prompt_ids(rng, prefix_len)
        cold.append(ttft(llm, prefix + random_prompt_ids(rng, suffix_len)))
        hits = llm.engine.kv.stats.hits
        cached.append(ttft(llm, prefix + random_prompt_ids(rng, suffix_len)))
        hit = llm.engine.kv.stats.hits - hits
        print(f"  [{r + 1}/{repeats}] cold {cold[-1] * 1000:.0f} ms | cached {cached[-1] * 1000:.0f} ms "
              f"({hit} prefix tokens from the cache)", flush=True)
    row = {"prefix_tokens": prefix_len, "suffix_tokens": suffix_len, "cold_ttft_s": statistics.median(cold),
           "cached_ttft_s": statistics.median(cached)}
    row["speedup"] = row["cold_ttft_s"] / row["cached_ttft_s"]
    return row


def shared_prefix_workload(n: int, prefix_len: int, question_len: int) -> list[list[int]]:
    rng = random.Random(1)
    system = random_prompt_ids(rng, prefix_len)
    return [system + random_prompt_ids(rng, question_len) for _ in range(n)]


def bench_shared(model: str | None, prompts: list[list[int]], out_len: int, **engine_args) -> dict:
    row = {}
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    outputs = {}
    for label, on in (("on", True), ("off", False)):
        llm = LLM(model, enable_prefix_caching=on, **engine_args)
        llm.generate(random_prompt_ids(random.Random(99), 32), FIRST_TOKEN)  # warm up, sharing nothing
        print(f"  cache {label}: {len(prompts)} requests ...", flush=True)
        t = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - t
        outputs[label] = [r.outputs[0].token_ids for r in results]
        tokens = sum(len(o) for o in outputs[label])
        row[f"cache_{label}_tok_s"] = tokens / elapsed
        row[f"cache_{label}_s"] = elapsed
        print(f"  cache {label}: {tokens} output tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} tok/s "
              f"(prefix cache hits {llm.engine.kv.stats.hits} tokens)", flush=True)
        del llm
    row["speedup"] = row["cache_on_tok_s"] / row["cache_off_tok_s"]
    row["same_outputs"] = outputs["on"] == outputs["off"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and requests, for a smoke run")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--save", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    engine_args = dict(max_num_seqs=16, max_num_batched_tokens=args.max_num_batched_tokens)
    print(f"machine: {machine()}")
    report: dict = {"machine": machine()}

    print(f"\n[ttft] {args.prefix_len}-token prefix + 32-token suffix, cached against cold")
    llm = LLM(args.model, **engine_args)
    report["model"] = str(llm.engine.model_path)
    report["ttft"] = t = bench_ttft(llm, args.prefix_len, 32, 2 if args.quick else 5)
    del llm
    print(f"  median TTFT: cold {t['cold_ttft_s'] * 1000:.0f} ms | cached {t['cached_ttft_s'] * 1000:.0f} ms | "
          f"{t['speedup']:.1f}x lower with the prefix cached")

    n = 8 if args.quick else 16
    prompts = shared_prefix_workload(n, 1000, 32)
    print(f"\n[shared] {n} requests: one 1,000-token system prompt + a 32-token question each, 32 tokens out")
    report["shared"] = s = bench_shared(args.model, prompts, 32, **engine_args)
    print(f"  output tokens/s: cache on {s['cache_on_tok_s']:.1f} | off {s['cache_off_tok_s']:.1f} | "
          f"{s['speedup']:.2f}x with the cache; same outputs: {s['same_outputs']}")
    if args.save:
        Path(args.save).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
