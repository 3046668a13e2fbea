"""Multi-LoRA throughput: output tok/s at concurrency 16 on the embedded model, base only against
requests spread over 1, 4 and 16 distinct adapters, with the native gather kernel and with torch's
loop over adapters (the baseline: one pair of matmuls per adapter per projection); and how long an
adapter takes to load.

Adapters are random, rank 16 on all seven projections (the costliest kind), written in PEFT's format.
Every configuration is run in interleaved rounds (the best round counts), so a noisy host's drift
does not land on one of them. 16 requests at once, 128-token random prompts, 64 output tokens each
(ignore_eos).

Usage: python benchmarks/lora.py [--rounds 3] [--tokens 64] [--png docs/lora.png] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, random_prompt_ids  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from ladle import LLM, LoRARequest, SamplingParams  # noqa: E402
from ladle.lora.adapter import projection_shapes  # noqa: E402

RANK = 16
CONCURRENCY = 16
PROMPT_LEN = 128


def write_adapter(folder: Path, cfg, seed: int) -> Path:
    """A random rank-16 adapter on every projection, in PEFT's format."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, (d_in, d_out) in projection_shapes(cfg).items():
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, d_in, generator=gen) / d_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, RANK, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "bias": "none",
        "target_modules": list(projection_shapes(cfg))}))
    return folder


def run(llm: LLM, prompts: list, adapters: list[str | None], tokens: int, kernel: str) -> float:
    """Output tok/s of all prompts at once, each on its adapter."""
    os.environ["LADLE_LORA_KERNEL"] = kernel
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    requests = [None if a is None else LoRARequest(a) for a in adapters]
    start = time.perf_counter()
    out = llm.generate(prompts, params, lora_request=requests)
    wall = time.perf_counter() - start
    assert all(len(r.outputs[0].token_ids) == tokens for r in out)
    return len(prompts) * tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--png", default=None, help="also draw the throughputs as a bar chart")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 requests of 16 tokens over 2 and 4 adapters, 4 output tokens, one round")
    args = ap.parse_args()
    global CONCURRENCY, PROMPT_LEN
    few, many = 4, 16  # distinct adapters in the two spread configurations
    if args.quick:
        CONCURRENCY, PROMPT_LEN, few, many, args.rounds, args.tokens = 4, 16, 2, 4, 1, 4
    print(f"# {machine()}", flush=True)
    base = LLM(max_num_seqs=32)
    cfg = base.engine.model_config
    root = Path(tempfile.mkdtemp(prefix="ladle-lora-bench-"))
    folders = {f"a{i}": write_adapter(root / f"a{i}", cfg, i) for i in range(many)}
    engines = {"base": base,
               f"max-loras {few}": LLM(max_num_seqs=32, enable_lora=True, max_loras=few, max_lora_rank=RANK),
               f"max-loras {many}": LLM(max_num_seqs=32, enable_lora=True, max_loras=many, max_lora_rank=RANK)}
    load_times = []
    for name, folder in folders.items():
        for key in (f"max-loras {few}", f"max-loras {many}"):
            start = time.perf_counter()
            engines[key].engine.add_lora(name, str(folder))
            load_times.append(time.perf_counter() - start)
    rng = random.Random(0)
    prompts = [random_prompt_ids(rng, PROMPT_LEN) for _ in range(CONCURRENCY)]
    names = list(folders)
    # (label, engine, adapters per request, kernel)
    spread = [names[i % few] for i in range(CONCURRENCY)]
    configs = [("base only", "base", [None] * CONCURRENCY, "auto"),
               ("base only, LoRA on", f"max-loras {few}", [None] * CONCURRENCY, "auto"),
               ("1 adapter", f"max-loras {few}", ["a0"] * CONCURRENCY, "native"),
               (f"{few} adapters", f"max-loras {few}", spread, "native"),
               (f"{many} adapters", f"max-loras {many}", names[:CONCURRENCY], "native"),
               (f"{few} adapters, loop", f"max-loras {few}", spread, "loop"),
               (f"{many} adapters, loop", f"max-loras {many}", names[:CONCURRENCY], "loop")]
    for label, key, adapters, kernel in configs:  # first touches (slots, KV pages) before any timing
        run(engines[key], prompts, adapters, 4, kernel)
    best: dict[str, float] = {}
    for r in range(args.rounds):
        for label, key, adapters, kernel in configs:
            best[label] = max(best.get(label, 0.0), run(engines[key], prompts, adapters, args.tokens, kernel))
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    reference = best["base only"]
    print(f"\nc={CONCURRENCY}, {PROMPT_LEN}-token prompts, {args.tokens} output tokens, rank {RANK} on q/k/v/o/gate/up/down")
    print(f"{'configuration':22} {'out tok/s':>9} {'vs base':>8}")
    for label, *_ in configs:
        print(f"{label:22} {best[label]:9.1f} {best[label] / reference:8.2f}")
    for n in (few, many):
        print(f"native kernel / loop over adapters, {n} adapters: "
              f"{best[f'{n} adapters'] / best[f'{n} adapters, loop']:.2f}x")
    load_times.sort()
    print(f"adapter load (read + check, {len(load_times)} loads): median {load_times[len(load_times) // 2] * 1e3:.0f} ms,"
          f" max {load_times[-1] * 1e3:.0f} ms")
    if args.png:
        draw(best, [c[0] for c in configs], reference, args.png)


def draw(best: dict[str, float], labels: list[str], reference: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.4))
    colours = ["grey" if "base" in lab else "tab:red" if "loop" in lab else "tab:blue" for lab in labels]
    ax.barh(labels[::-1], [best[lab] for lab in labels[::-1]], color=colours[::-1])
    ax.axvline(0.7 * reference, color="black", linestyle="--", linewidth=0.8, label="70% of base only")
    ax.set_xlabel(f"output tok/s, c={CONCURRENCY}")
    ax.legend(loc="lower right")
    ax.set_title(f"multi-LoRA, {machine().split(' cores')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
