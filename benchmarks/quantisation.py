"""Weight and KV-cache formats side by side: bytes per token, how fast each runs, what accuracy costs.

Per model, each weight format it has (a float checkpoint: float32, and int8 per row quantised at
load, `--quantization int8`; a GGUF: float32 dequantised, `--quantization none`, and its
Q8_0/Q4_0/Q4_1 blocks served as they are, the default `auto`), each with each KV cache (float32;
int8 or fp8 e4m3 with a scale per token and head, `--kv-cache-dtype`):
  MB        linear weights read per decode token (decoder layers + LM head)
  KV tok/GiB  tokens the KV pool holds per GiB
  decode    batch-1 ms/token (median step) after a 256-token and a 2048-token prompt, against
            that format's bandwidth bound ((weight bytes + the context's KV bytes) / read bandwidth,
            the best of one measurement at the start and one per round)
  c16       output tok/s of 16 requests at once (256-token prompts, 64 out, ignore_eos)
  prefill   prompt tok/s (8 prompts x 512 tokens, one output token)
  accuracy  perplexity on a fixed ~340-token text and top-1 agreement with the model's first
            row (float32 weights and KV) at every position (teacher-forced, in chunks of 128
            tokens: the arithmetic of decode steps and scoring)

A model's formats are loaded together and timed in interleaved rounds (each round times every
format once, on fresh prompts; the best round counts), so a noisy host's drift does not land
on one row.

4-bit GPTQ and AWQ checkpoints load into the same grouped layers as a GGUF's Q4 blocks (ladle.model.int4_checkpoints).

Usage: python benchmarks/quantisation.py [--models embedded,~/.cache/ladle/bench-models/qwen2-0.5b-shape,x.gguf]
                                         [--kv float32,int8,fp8] [--rounds 2] [--quick]
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
from ladle.model.attention import KVCache  # noqa: E402
from ladle.model.quantization import WIDEN_ROWS  # noqa: E402

WEIGHTS = {"none": "float32", "int8": "int8 per row", "auto": "GGUF blocks"}  # --quantization -> row label
TEXT = "\n\n".join([
    "The river rose through the night, and by morning the low fields were under water. Farmers moved their "
    "animals to the hills, and the school opened its doors to families who had nowhere else to go. By noon "
    "the rain had stopped, but the water kept rising for two more days, fed by the snow melting in the "
    "mountains. When it finally fell, it left behind a layer of mud, broken fences and a town that would "
    "spend the summer rebuilding what it had lost.",
    "Libraries have always been more than rooms full of books. In the nineteenth century they were places "
    "where working people could educate themselves after long days in factories; today they lend laptops, "
    "teach children to read, and offer a quiet, warm place to anyone who walks in. Their budgets are small, "
    "but the number of people who depend on them is large and growing.",
    "To repair a bicycle puncture, remove the wheel, lever the tyre off the rim and pull out the inner tube. "
    "Pump a little air into the tube and listen for the hiss, or pass it through a bowl of water and watch "
    "for bubbles. Roughen the area around the hole, apply glue, wait until it is tacky, and press the patch "
    "firmly in place. Check the inside of the tyre for the thorn or glass that caused the damage before you "
    "put everything back together.",
    "The first astronomers had only their eyes. They noticed that a few bright points wandered against the "
    "fixed pattern of the stars, and they called them planets, the wanderers. Centuries of careful records "
    "let later thinkers work out that the earth itself is one of them, circling the sun with the others.",
])


def bytes_per_token(llm: LLM) -> int:
    m = llm.engine.runner.model
    return sum(lin.nbytes for layer in m.layers for lin in layer.linears) + m.lm_head.nbytes


# the workloads' sizes (--quick shrinks them): decode contexts, c16's (requests, prompt, output), prefill's
SIZES = {"contexts": (256, 2048), "c16": (16, 256, 64), "prefill": (8, 512, 1), "steps": 32, "bandwidth_mib": 1024}


def decode_ms(llm: LLM, prompt_len: int, seed: int, steps: int = 32) -> float:
    engine = llm.engine
    ids = random_prompt_ids(random.Random(seed), prompt_len, vocab_hi=min(40000, engine.model_config.vocab_size))
    engine.add_request("decode", ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    while engine.requests["decode"][0].num_computed_tokens < prompt_len:  # the prefill, in chunks
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def tokens_per_second(llm: LLM, n: int, prompt_len: int, out_len: int, seed: int) -> tuple[float, float]:
    """(output tok/s, prompt tok/s) of n requests at once."""
    rng = random.Random(seed)
    vocab = min(40000, llm.engine.model_config.vocab_size)
    prompts = [random_prompt_ids(rng, prompt_len, vocab_hi=vocab) for _ in range(n)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    elapsed = time.perf_counter() - t
    return n * out_len / elapsed, n * prompt_len / elapsed


def text_logprobs(llm: LLM) -> list:
    """Teacher-forced log-probabilities of TEXT, fed in chunks of WIDEN_ROWS tokens: the arithmetic
    decode steps and scoring run (for int8 per row, 8-bit activations), not a long prompt's GEMM
    on widened float weights."""
    ids = llm.tokenizer.encode(TEXT)
    config = llm.engine.scheduler.config
    budget, config.max_num_batched_tokens = config.max_num_batched_tokens, WIDEN_ROWS
    try:
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    finally:
        config.max_num_batched_tokens = budget
    return out[0].prompt_logprobs[1:]


def weight_formats(model: str | None) -> list[str]:
    """The --quantization values that give this model's distinct weight formats."""
    return ["none", "auto"] if model is None or model.endswith(".gguf") else ["none", "int8"]


def load(model: str | None, weights: str, kv: str) -> tuple[LLM, dict]:
    """The engine for one format, and its row's sizes."""
    llm = LLM(model, dtype="float32", quantization=weights, kv_cache_dtype=kv, kv_cache_memory_gib=2.0)
    c = llm.engine.model_config
    kv_token_bytes = KVCache.bytes_per_block(c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim,
                                             llm.engine.kv_dtype)
    return llm, {"weights": WEIGHTS[weights], "kv": kv, "mb": bytes_per_token(llm) / 1e6,
                 "kv_token_bytes": kv_token_bytes, "kv_tokens_gib": 2**30 // kv_token_bytes}


def time_round(llm: LLM, row: dict, seed: int) -> None:
    """One round of timings, each kept if it is the best so far."""
    for context in SIZES["contexts"]:
        ms = decode_ms(llm, context, seed, SIZES["steps"])
        row[f"decode_{context}"] = min(row.get(f"decode_{context}", math.inf), ms)
    row["c16"] = max(row.get("c16", 0.0), tokens_per_second(llm, *SIZES["c16"], seed)[0])
    row["prefill"] = max(row.get("prefill", 0.0), tokens_per_second(llm, *SIZES["prefill"], seed)[1])


def measure_model(model: str | None, kvs: list[str], bandwidths: list[float], rounds: int) -> list[dict]:
    """Every format of one model, timed in interleaved rounds, the read bandwidth measured again
    in each (into `bandwidths`: the bound takes the best of them, so a slow moment of the host
    never flatters a row); accuracy against the first row."""
    formats = [(weights, kv) for weights in weight_formats(model) for kv in kvs]
    loaded = [load(model, weights, kv) for weights, kv in formats]
    for seed in range(1, rounds + 1):
        bandwidths.append(read_bandwidth_gbs(SIZES["bandwidth_mib"]))
        for (weights, kv), (llm, row) in zip(formats, loaded):
            print(f"  round {seed}/{rounds}: weights {WEIGHTS[weights]}, KV {kv} ...", flush=True)
            time_round(llm, row, seed)
    bandwidth = max(bandwidths)
    rows = []
    for llm, row in loaded:
        for context in SIZES["contexts"]:
            row[f"bound_{context}"] = (row["mb"] * 1e6 + context * row["kv_token_bytes"]) / (bandwidth * 1e9) * 1e3
        lps = text_logprobs(llm)
        row["ppl"] = math.exp(-sum(lp.logprob for lp in lps) / len(lps))
        ref = rows[0]["logprobs"] if rows else lps
        row["top1"] = sum(a.top[0][0] == b.top[0][0] for a, b in zip(ref, lps)) / len(lps)
        row["logprobs"] = lps
        rows.append(row)
    del loaded
    gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    home = Path.home() / ".cache/ladle/bench-models/qwen2-0.5b-shape"
    ap.add_argument("--models", default="embedded" + (f",{home}" if home.is_dir() else ""),
                    help="comma-separated: 'embedded' or HF folders / .gguf files")
    ap.add_argument("--kv", default="float32,int8", help="comma-separated KV cache dtypes")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds (the best counts)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the first model alone, float32 KV, one round, 32/64-token contexts, "
                         "4 requests for c16")
    args = ap.parse_args()
    if args.quick:
        args.models, args.kv, args.rounds = args.models.split(",")[0], "float32", 1
        SIZES.update(contexts=(32, 64), c16=(4, 32, 8), prefill=(2, 64, 1), steps=8, bandwidth_mib=64)
    low, high = SIZES["contexts"]
    bandwidths = [read_bandwidth_gbs(SIZES["bandwidth_mib"])]
    print(f"{machine()}; read bandwidth {bandwidths[0]:.1f} GB/s; compute float32\n", flush=True)
    for model in args.models.split(","):
        path = None if model == "embedded" else model
        print(f"  {model}:", flush=True)
        rows = measure_model(path, args.kv.split(","), bandwidths, args.rounds)
        base = rows[0]
        print(f"\n## {Path(model).name if path else 'SmolLM2-135M-Instruct (embedded)'}\n")
        print(f"Bounds at {max(bandwidths):.1f} GB/s, the best of {len(bandwidths)} read-bandwidth measurements "
              f"({min(bandwidths):.1f} to {max(bandwidths):.1f} GB/s).\n")
        print(f"| weights | KV | weight MB per token | KV tokens per GiB | ms/token @{low} (% of bound) | "
              f"ms/token @{high} (% of bound) | vs first row @{low} / @{high} | c={SIZES['c16'][0]} tok/s | "
              "prefill tok/s | perplexity | top-1 agreement |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['weights']} | {r['kv']} | {r['mb']:.0f} | {r['kv_tokens_gib']:,} | "
                  f"{r[f'decode_{low}']:.2f} ({100 * r[f'bound_{low}'] / r[f'decode_{low}']:.0f}%) | "
                  f"{r[f'decode_{high}']:.2f} ({100 * r[f'bound_{high}'] / r[f'decode_{high}']:.0f}%) | "
                  f"{base[f'decode_{low}'] / r[f'decode_{low}']:.2f}x / {base[f'decode_{high}'] / r[f'decode_{high}']:.2f}x | "
                  f"{r['c16']:.1f} | {r['prefill']:.0f} | {r['ppl']:.3f} | {100 * r['top1']:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
