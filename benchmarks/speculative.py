"""Speculative decoding side by side: per-user output speed with and without it, and what it accepted.

Workloads (ignore_eos, 128 output tokens per request):
  quote    the model asked to repeat a paragraph it was given (greedy): drafts from the prompt hit
  code     code whose continuation repeats its own patterns (greedy)
  random   random-token prompts, sampled at temperature 1 (seeded): drafts should miss (greedy
           output after a random prompt soon loops, which prompt lookup predicts)
Each at concurrency 1, 4 and 16 (that many identical-length requests at once); the embedded model,
with each method: ngram (k=4, k=2), early_exit (its first quarter of layers), draft_model (the
embedded model drafting for itself: no smaller model sharing its tokenizer is at hand offline).

Per row: per-user output tok/s (a request's output tokens over its own wall time), the ratio to no
speculation in the same round, the acceptance rate a (kept drafts / drafted tokens), and tokens per
verification step measured ((kept + steps) / steps) against the i.i.d. expectation
(1 - a^(k+1)) / (1 - a) for the k drafted per step. Methods and baseline run in interleaved rounds
(the best round counts), so a noisy host's drift does not land on one of them.

Usage: python benchmarks/speculative.py [--rounds 3] [--tokens 128] [--png docs/speculative.png] [--quick]
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

METHODS = {"none": None, "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
           "ngram k=2": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4},
           "early_exit k=2": {"method": "early_exit", "num_speculative_tokens": 2},
           # no smaller model sharing SmolLM2's tokenizer is at hand offline: the model drafts for itself,
           # which keeps every greedy draft and shows what the draft model's own passes cost
           "draft=self k=2": {"method": "draft_model", "model": None, "num_speculative_tokens": 2}}
PARAGRAPHS = [
    "The river rose through the night, and by morning the low fields were under water. Farmers moved their "
    "animals to the hills, and the school opened its doors to families who had nowhere else to go.",
    "Libraries have always been more than rooms full of books. Today they lend laptops, teach children to "
    "read, and offer a quiet, warm place to anyone who walks in.",
    "To repair a bicycle puncture, remove the wheel, lever the tyre off the rim and pull out the inner tube. "
    "Find the hole, roughen the area around it, apply glue and press the patch firmly in place.",
    "The committee met on Tuesday to review the budget. It agreed to fund the new playground, postpone the "
    "road repairs until spring, and ask the council for a second survey of the old bridge.",
]
CODE = ("def area_of_square(side):\n    return side * side\n\n\ndef area_of_rectangle(width, height):\n"
        "    return width * height\n\n\ndef area_of_triangle(base, height):\n    return base * height / 2\n\n\n"
        "def perimeter_of_square(side):\n    return 4 * side\n\n\ndef perimeter_of_rectangle(width, height):\n")


def workload(llm: LLM, name: str, count: int, rng: random.Random) -> list[str | list[int]]:
    if name == "quote":
        return [llm.tokenizer.apply_chat_template([{"role": "user", "content":
                f"Repeat this text exactly, twice:\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"}]) for i in range(count)]
    if name == "code":
        return [CODE] * count
    return [random_prompt_ids(rng, 64) for _ in range(count)]


def run(llm: LLM, prompts: list, tokens: int, sampled: bool) -> tuple[float, int, int, int]:
    """Per-user output tok/s, and the speculation counters' growth: (tok/s, drafts, drafted, kept)."""
    spec = llm.engine.stats.spec
    before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    params = [SamplingParams(temperature=1.0 if sampled else 0.0, seed=i, max_tokens=tokens, ignore_eos=True)
              for i in range(len(prompts))]
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    assert all(len(r.outputs[0].token_ids) == tokens for r in out)
    after = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    return tokens / wall, *(b - a for a, b in zip(before, after))


def with_draft_model(cfg: dict | None) -> dict | None:
    if cfg is None or cfg["method"] != "draft_model":
        return cfg
    from ladle.model.loader import resolve_model_path

    return {**cfg, "model": str(resolve_model_path(None))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--png", default=None, help="also draw per-user speed ratios as a bar chart")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the quote workload alone, one round at c=1, 8 output tokens")
    args = ap.parse_args()
    works = ("quote", "code", "random")
    if args.quick:
        args.rounds, args.tokens, args.concurrency, works = 1, 8, "1", ("quote",)
    print(f"# {machine()}", flush=True)
    engines = {name: LLM(speculative_config=with_draft_model(cfg), max_num_seqs=32) for name, cfg in METHODS.items()}
    levels = [int(c) for c in args.concurrency.split(",")]
    for llm in engines.values():  # first-touch costs (KV pages, activation buffers) before any timing
        run(llm, workload(llm, "code", max(levels), random.Random(0)), min(16, args.tokens), sampled=False)
    best: dict[tuple[str, int, str], tuple] = {}
    for r in range(args.rounds):
        for work in works:
            for c in levels:
                prompts = workload(engines["none"], work, c, random.Random(c))
                for name, llm in engines.items():
                    result = run(llm, prompts, args.tokens, sampled=work == "random")
                    key = (work, c, name)
                    if key not in best or result[0] > best[key][0]:
                        best[key] = result
                print(f"  round {r + 1}/{args.rounds}: {work} c={c} done", flush=True)
    print(f"\n{'workload':8} {'c':>3} {'method':14} {'tok/s/user':>10} {'ratio':>6} {'accept':>7} "
          f"{'tok/step':>8} {'expected':>8}")
    ratios = {}
    for (work, c, name), (speed, drafts, drafted, kept) in best.items():
        base = best[(work, c, "none")][0]
        ratio = speed / base
        ratios[(work, c, name)] = ratio
        if drafts:
            a = kept / drafted
            k = drafted / drafts  # drafted per step (lookups may find fewer than num_speculative_tokens)
            expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
            extra = f"{a:7.1%} {(kept + drafts) / drafts:8.2f} {expected:8.2f}"
        else:
            extra = f"{'-':>7} {'-':>8} {'-':>8}"
        print(f"{work:8} {c:3d} {name:14} {speed:10.1f} {ratio:6.2f} {extra}")
    if args.png:
        draw(ratios, levels, args.png, works)


def draw(ratios: dict, levels: list[int], path: str, works: tuple[str, ...] = ("quote", "code", "random")) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if m != "none"]
    fig, axes = plt.subplots(1, len(works), figsize=(4 * len(works), 3.2), sharey=True, squeeze=False)
    axes = axes[0]
    width = 0.8 / len(methods)
    for ax, work in zip(axes, works):
        for j, method in enumerate(methods):
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(levels))]
            ax.bar(xs, [ratios[(work, c, method)] for c in levels], width=width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(levels)), [f"c={c}" for c in levels])
        ax.set_title(work)
    axes[0].set_ylabel("per-user speed / no speculation")
    axes[0].legend()
    fig.suptitle(f"speculative decoding, {machine().split(' cores')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
