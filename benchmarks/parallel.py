"""Tensor and expert parallelism on this machine, and what they would buy on a multi-device one.

Models: random Qwen2-shaped weights (dense, and a Qwen2-MoE with the same active MLP size: 8
experts of half the width, top 2) saved by transformers with the SmolLM2 tokenizer.

(1) TP=1 (one process, all cores) against TP=2 (two ranks, the cores split between them):
prefill tok/s, decode tok/s at batch 1 and 8, and the collectives' share of a step. Two
cores cannot show TP's point (a model larger than one device, or more devices' bandwidth):
here both layouts have the same cores and TP=2 adds communication, so expect it slower.
(2) MoE against the dense model of the same active size, one process: tok/s, and with
expert parallelism on two ranks.
(3) A paper estimate, from the per-layer compute measured in (1) and stated link figures, of
TP and EP on a machine with several devices: an estimate, not a measurement.

Usage: python benchmarks/parallel.py [--hidden 1024] [--layers 8] [--prompt 256] [--out docs/parallel.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402
from ladle.model.loader import resolve_model_path  # noqa: E402

# assumed links for the paper estimate (per direction): NVLink-class and PCIe/Ethernet-class
LINKS = {"nvlink 300 GB/s, 5 us": (300e9, 5e-6), "pcie 25 GB/s, 15 us": (25e9, 15e-6)}


def build(kind: str, folder: Path, hidden: int, layers: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    common = dict(vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                  tie_word_embeddings=True, initializer_range=0.02)
    torch.manual_seed(0)
    if kind == "dense":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:  # same active MLP width: 2 of 8 experts, each half the dense width
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                                                   moe_intermediate_size=hidden * 3 // 2,
                                                   shared_expert_intermediate_size=0))
    model.save_pretrained(folder)
    tok = resolve_model_path(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, folder / name)
    return folder


def measure(folder: Path, prompt_len: int, **engine_args) -> dict:
    llm = LLM(str(folder), dtype="float32", **engine_args)
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(200, 40000, (prompt_len,), generator=rng).tolist() for _ in range(8)]
    try:
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm-up
        stats = llm.engine.collective_stats()
        out = {}
        comm0 = stats.seconds if stats else 0.0
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1))
        out["prefill_tok_s"] = 8 * prompt_len / (time.perf_counter() - t)
        for batch in (1, 8):
            few = [p[:32] for p in prompts[:batch]]
            params = SamplingParams(max_tokens=33, ignore_eos=True, temperature=0)
            t = time.perf_counter()
            llm.generate(few, params)
            first = time.perf_counter()
            llm.generate(few, SamplingParams(max_tokens=1))
            one = time.perf_counter() - first  # the prompt's share, subtracted
            out[f"decode_b{batch}_tok_s"] = batch * 32 / max(1e-9, first - t - one)
        steps = llm.engine.stats.steps
        if stats:
            out["collective_s"] = stats.seconds - comm0
            out["collective_calls"] = stats.calls
            out["ms_in_collectives_per_step"] = 1000 * stats.seconds / max(1, steps)
        out["layer_ms_decode_b1"] = 1000 / out["decode_b1_tok_s"] / llm.engine.model_config.num_hidden_layers
    finally:
        llm.engine.close()
    return out


def paper_estimate(res: dict, hidden: int, layers: int) -> list[str]:
    """Per decode step at batch 8: compute split N ways plus two all-reduces of [8, hidden] float32
    per layer (TP), or two all-to-alls of the routed rows plus a gather (EP)."""
    lines = []
    compute = 1 / res["tp1"]["decode_b8_tok_s"] * 8  # seconds per step here
    payload = 8 * hidden * 4
    for link, (bw, lat) in LINKS.items():
        for n in (2, 4, 8):
            ring = 2 * (n - 1) / n * payload / bw + 2 * (n - 1) * lat  # one ring all-reduce
            tp = compute / n + layers * 2 * ring
            ep_comm = layers * (2 * (payload * 2 / n / bw + lat) + payload / bw + lat)
            lines.append(f"  {link:24s} N={n}: TP step {1000 * tp:7.2f} ms ({compute / tp:4.2f}x of 1 device), "
                         f"MoE EP comm {1000 * ep_comm:6.3f} ms/step")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out", default=None, help="default: docs/parallel.json (--quick: none written)")
    ap.add_argument("--quick", action="store_true", help="smoke run: hidden 128, 2 layers, 32-token prompts")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.prompt = 128, 2, 32
    elif args.out is None:
        args.out = "docs/parallel.json"
    print(f"machine: {machine()}")
    cores = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        dense = build("dense", Path(tmp) / "dense", args.hidden, args.layers)
        moe = build("moe", Path(tmp) / "moe", args.hidden, args.layers)
        res = {}
        runs = [("tp1", dense, {"num_threads": cores}), ("tp2", dense, {"tensor_parallel_size": 2}),
                ("moe_tp1", moe, {"num_threads": cores}),
                ("moe_ep2", moe, {"tensor_parallel_size": 2, "enable_expert_parallel": True})]
        for i, (name, folder, engine_args) in enumerate(runs, 1):
            print(f"[{i}/{len(runs)}] {name} {engine_args} ...", flush=True)
            res[name] = measure(folder, args.prompt, **engine_args)
            print("   " + ", ".join(f"{k} {v:.2f}" for k, v in res[name].items()), flush=True)
    print(f"\n(1) dense, hidden {args.hidden}, {args.layers} layers; TP=1: one process, {cores} threads; "
          f"TP=2: two ranks, {max(1, cores // 2)} thread(s) each")
    print(f"{'':10s} {'prefill tok/s':>14s} {'decode b1':>10s} {'decode b8':>10s} {'ms/step in collectives':>24s}")
    for name in ("tp1", "tp2", "moe_tp1", "moe_ep2"):
        r = res[name]
        print(f"{name:10s} {r['prefill_tok_s']:14.1f} {r['decode_b1_tok_s']:10.1f} {r['decode_b8_tok_s']:10.1f} "
              f"{r.get('ms_in_collectives_per_step', 0):24.2f}")
    for key in ("prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s"):
        print(f"  TP=2 / TP=1 {key}: {res['tp2'][key] / res['tp1'][key]:.2f}x;  "
              f"MoE / dense {key}: {res['moe_tp1'][key] / res['tp1'][key]:.2f}x;  "
              f"MoE EP=2 / MoE {key}: {res['moe_ep2'][key] / res['moe_tp1'][key]:.2f}x")
    print("\n(3) paper estimate (assumed links; per-layer compute from TP=1 here):")
    estimate = paper_estimate(res, args.hidden, args.layers)
    print("\n".join(estimate))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"machine": machine(), "results": res, "estimate": estimate}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
