"""Weight formats side by side: what a decode step reads, how fast each path runs, what accuracy costs.

Per model and format (float32, and int8 weight-only as `--quantization int8`):
  bytes     linear weights read per decode token (decoder layers + LM head)
  decode    batch-1 ms/token (median step, 256-token prompt) against that format's bandwidth
            bound (bytes per token / measured read bandwidth)
  c16       output tok/s of 16 requests at once (256-token prompts, 64 out, ignore_eos)
  prefill   prompt tok/s (8 prompts x 512 tokens, one output token)
  accuracy  perplexity on a fixed text and top-1 agreement with float32 at every position

Not yet here (issue 14): GGUF Q8_0/Q4_x served quantised, 4-bit checkpoints, the 8-bit KV cache.

Usage: python benchmarks/quantisation.py [--models embedded,~/.cache/ladle/bench-models/qwen2-0.5b-shape]
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, random_prompt_ids, read_bandwidth_gbs  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402

FORMATS = ("none", "int8")
TEXT = ("The river rose through the night, and by morning the low fields were under water. Farmers moved their "
        "animals to the hills, and the school opened its doors to families who had nowhere else to go. By noon "
        "the rain had stopped, but the water kept rising for two more days, fed by the snow melting in the "
        "mountains. When it finally fell, it left behind a layer of mud, broken fences and a town that would "
        "spend the summer rebuilding what it had lost.")


def bytes_per_token(llm: LLM) -> int:
    m = llm.engine.runner.model
    return sum(lin.nbytes for layer in m.layers for lin in layer.linears) + m.lm_head.nbytes


def decode_ms(llm: LLM, steps: int = 48) -> float:
    engine = llm.engine
    ids = random_prompt_ids(random.Random(1), 256, vocab_hi=min(40000, engine.model_config.vocab_size))
    engine.add_request("decode", ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def tokens_per_second(llm: LLM, n: int, prompt_len: int, out_len: int) -> tuple[float, float]:
    """(output tok/s, prompt tok/s) of n requests at once."""
    rng = random.Random(0)
    vocab = min(40000, llm.engine.model_config.vocab_size)
    prompts = [random_prompt_ids(rng, prompt_len, vocab_hi=vocab) for _ in range(n)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    elapsed = time.perf_counter() - t
    return n * out_len / elapsed, n * prompt_len / elapsed


def text_logprobs(llm: LLM) -> list:
    ids = llm.tokenizer.encode(TEXT)
    return llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0].prompt_logprobs[1:]


def measure(model: str | None, fmt: str, bandwidth: float, reference: list | None) -> dict:
    llm = LLM(model, dtype="float32", quantization=fmt)
    row = {"format": "float32" if fmt == "none" else fmt, "mb": bytes_per_token(llm) / 1e6}
    row["decode_ms"] = decode_ms(llm)
    row["bound_ms"] = row["mb"] * 1e6 / (bandwidth * 1e9) * 1e3
    row["c16"] = tokens_per_second(llm, 16, 256, 64)[0]
    row["prefill"] = tokens_per_second(llm, 8, 512, 1)[1]
    lps = text_logprobs(llm)
    row["ppl"] = math.exp(-sum(lp.logprob for lp in lps) / len(lps))
    ref = reference or lps
    row["top1"] = sum(a.top[0][0] == b.top[0][0] for a, b in zip(ref, lps)) / len(lps)
    row["logprobs"] = lps
    del llm
    gc.collect()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    home = Path.home() / ".cache/ladle/bench-models/qwen2-0.5b-shape"
    ap.add_argument("--models", default="embedded" + (f",{home}" if home.is_dir() else ""),
                    help="comma-separated: 'embedded' or HF folders / .gguf files")
    args = ap.parse_args()
    bandwidth = read_bandwidth_gbs()
    print(f"{machine()}; read bandwidth {bandwidth:.1f} GB/s; compute float32\n", flush=True)
    for model in args.models.split(","):
        path = None if model == "embedded" else model
        rows: list[dict] = []
        for fmt in FORMATS:
            print(f"  {model}: {fmt} ...", flush=True)
            rows.append(measure(path, fmt, bandwidth, rows[0]["logprobs"] if rows else None))
        base = rows[0]
        print(f"\n## {Path(model).name if path else 'SmolLM2-135M-Instruct (embedded)'}\n")
        print("| weights | MB read per token | batch-1 ms/token | bound ms | % of bound | vs float32 | "
              "c=16 tok/s | prefill tok/s | perplexity | top-1 agreement |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['format']} | {r['mb']:.0f} | {r['decode_ms']:.2f} | {r['bound_ms']:.2f} | "
                  f"{100 * r['bound_ms'] / r['decode_ms']:.0f}% | {base['decode_ms'] / r['decode_ms']:.2f}x | "
                  f"{r['c16']:.1f} | {r['prefill']:.0f} | {r['ppl']:.3f} | {100 * r['top1']:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
