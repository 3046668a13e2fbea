"""Hybrid linear attention (Qwen3.5) and latent attention (DeepSeek V3) against same-size full-attention twins:
what a token costs in the KV pool, how many sequences a fixed memory budget holds, decode speed, and what a
prefix-cache hit saves on a long shared prefix. Random weights, scaled down for a CPU.

Four models, each of --layers layers, hidden --hidden:
  qwen3.5      Gated DeltaNet layers and full ones, 3 to 1 (Qwen3.5's layout): the linear layers keep a fixed
               state per sequence, the full ones K/V per token (8 heads of 64, 2 K/V heads, output gate);
  qwen3 twin   the same with every layer full attention (Qwen3: the same heads and norms, no gate);
  deepseek-v3  MLA: one latent of kv_lora_rank + rope per token and layer; DeepSeek's MoE;
  mha twin     a Llama with DeepSeek's 8 heads as plain multi-head attention, heads of 64 (the width of
               DeepSeek's values, narrower than its keys: the twin is the cheaper side).

Figures, by model: KV bytes per token (and per sequence, the hybrid's state); the most sequences running at
once when a --budget-mib pool holds them all (prompts of --prompt tokens, --gen generated; the hybrid's
state slots come out of the same budget); decode tok/s at batch 1 and 16; and TTFT of a --prefix-token
shared prefix plus a short suffix, cold and from the prefix cache.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, write_results  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402
from ladle.engine.kv_report import kv_bytes_per_token  # noqa: E402
from ladle.model.attention import KVCache  # noqa: E402
from ladle.model.config import ModelConfig  # noqa: E402
from ladle.model.loader import resolve_model_path  # noqa: E402

MODELS = ("qwen3.5", "qwen3 twin", "deepseek-v3", "mha twin")
VOCAB = 8192


def build(name: str, folder: Path, args: argparse.Namespace) -> Path:
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=8, max_position_embeddings=8192,
                  initializer_range=0.05, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, tie_word_embeddings=True)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(0)
    if name == "qwen3.5":
        kinds = ["linear_attention"] * 3 + ["full_attention"]
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(
            **common, num_key_value_heads=2, head_dim=64, layer_types=kinds * (args.layers // 4),
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
            rope_parameters={**rope, "partial_rotary_factor": 0.25}))
    elif name == "qwen3 twin":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=64, rope_parameters=rope))
    elif name == "deepseek-v3":
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **common, num_key_value_heads=8, moe_intermediate_size=args.hidden // 2, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            q_lora_rank=args.hidden // 2, kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=64, qk_rope_head_dim=32,
            v_head_dim=64, rope_parameters=rope))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=8, head_dim=64, rope_parameters=rope))
    model.save_pretrained(folder)
    tokenizer = resolve_model_path(None)  # prompts are token ids; the engine loads a tokenizer all the same
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / file, folder / file)
    return folder


def random_ids(n: int, rng: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB - 8, (n,), generator=rng).tolist()


def costs(folder: Path, block_size: int) -> dict:
    """What the pool holds per token (by attention kind), per block, and a hybrid's state per sequence."""
    cfg = ModelConfig.from_folder(folder)
    per_block = KVCache.bytes_per_block(cfg.num_kv_layers, block_size, cfg.num_key_value_heads, cfg.head_dim,
                                        torch.float32, cfg.cache_layer_shapes)
    return {"bytes_per_token": kv_bytes_per_token(cfg, torch.float32), "bytes_per_block": per_block,
            "state_bytes_per_seq": cfg.hybrid.state_bytes if cfg.hybrid is not None else 0}


def max_running(folder: Path, cost: dict, args: argparse.Namespace) -> dict:
    """Sequences queued well beyond what fits, in a pool sized from --budget-mib: the most that run at once.
    A hybrid's max_num_seqs state slots come out of the budget first, so it is set to what the budget holds."""
    budget = args.budget_mib * 2**20
    seq_blocks = -(-(args.prompt + args.gen) // args.block_size)
    per_seq = seq_blocks * cost["bytes_per_block"] + cost["state_bytes_per_seq"]
    max_seqs = min(256, budget // per_seq) if cost["state_bytes_per_seq"] else 256
    blocks = (budget - max_seqs * cost["state_bytes_per_seq"]) // cost["bytes_per_block"]
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=blocks, max_num_seqs=max_seqs,
              enable_prefix_caching=False, max_num_batched_tokens=4096)
    rng = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    try:
        for i in range(budget // per_seq + 8 if cost["state_bytes_per_seq"] else args.waiting):
            llm.engine.add_request(str(i), random_ids(args.prompt, rng), greedy)
        most = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            most = max(most, len(llm.engine.scheduler.running))
        return {"max_running": most, "preemptions": llm.engine.scheduler.num_preemptions, "pool_blocks": blocks}
    finally:
        llm.engine.close()


def decode_rate(folder: Path, batch: int, args: argparse.Namespace) -> float:
    """tok/s over the steps where every sequence of the batch decodes."""
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=4096, enable_prefix_caching=False, max_num_seqs=batch)
    rng = torch.Generator().manual_seed(2)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.decode_gen, ignore_eos=True)
    try:
        llm.generate([random_ids(16, rng)], SamplingParams(max_tokens=2))  # warm-up
        for i in range(batch):
            llm.engine.add_request(str(i), random_ids(args.decode_prompt, rng), greedy)
        seconds, steps = 0.0, 0
        while llm.engine.has_unfinished_requests():
            decoding = all(s.num_computed_tokens >= s.num_prompt_tokens for s in llm.engine.scheduler.running)
            t = time.perf_counter()
            llm.engine.step()
            if decoding and len(llm.engine.scheduler.running) == batch:
                seconds += time.perf_counter() - t
                steps += 1
        return batch * steps / max(seconds, 1e-9)
    finally:
        llm.engine.close()


def ttft(folder: Path, args: argparse.Namespace) -> dict:
    """Median TTFT of a --prefix-token prefix and a 16-token suffix: cold (a prefix never seen) and cached
    (the same prefix as the request before it, another suffix)."""
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=4096, max_num_batched_tokens=4096)
    rng = torch.Generator().manual_seed(3)
    first = SamplingParams(temperature=0.0, max_tokens=1)

    def timed(ids: list[int]) -> tuple[float, int]:
        t = time.perf_counter()
        res = llm.generate([ids], first)[0]
        return time.perf_counter() - t, res.num_cached_tokens

    try:
        timed(random_ids(args.prefix + 16, rng))  # warm-up
        cold, cached, hits = [], [], []
        for _ in range(args.repeats):
            prefix = random_ids(args.prefix, rng)
            cold.append(timed(prefix + random_ids(16, rng))[0])
            seconds, hit = timed(prefix + random_ids(16, rng))
            cached.append(seconds)
            hits.append(hit)
        return {"ttft_cold_s": statistics.median(cold), "ttft_cached_s": statistics.median(cached),
                "cached_tokens": min(hits)}
    finally:
        llm.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-lora-rank", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget-mib", type=int, default=128, help="the memory budget of the max-running run")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens of the max-running run")
    ap.add_argument("--gen", type=int, default=32, help="tokens generated in the max-running run")
    ap.add_argument("--waiting", type=int, default=96, help="sequences queued in the max-running run")
    ap.add_argument("--decode-prompt", type=int, default=128, help="prompt tokens of the decode runs")
    ap.add_argument("--decode-gen", type=int, default=48, help="tokens generated in the decode runs")
    ap.add_argument("--prefix", type=int, default=2000, help="shared prefix tokens of the TTFT run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: docs/hybrid.json (--quick: none written)")
    ap.add_argument("--quick", action="store_true", help="smoke run: hidden 128, 4 layers, small runs")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.kv_lora_rank, args.budget_mib, args.prompt, args.gen = 128, 4, 32, 4, 64, 4
        args.waiting, args.decode_prompt, args.decode_gen, args.prefix, args.repeats = 24, 16, 4, 128, 1
    elif args.out is None:
        args.out = "docs/hybrid.json"
    print(f"machine: {machine()}")
    print(f"models: hidden {args.hidden}, {args.layers} layers, float32, block size {args.block_size}; budget "
          f"{args.budget_mib} MiB for prompts of {args.prompt} + {args.gen}; TTFT over a {args.prefix}-token prefix")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(MODELS, 1):
            folder = build(name, Path(tmp) / name.replace(" ", "_"), args)
            cost = costs(folder, args.block_size)
            print(f"[{i}/{len(MODELS)}] {name}: max running in {args.budget_mib} MiB ...", flush=True)
            fit = max_running(folder, cost, args)
            print("      decode at batch 1 and 16 ...", flush=True)
            rates = {f"decode_tok_s_b{b}": decode_rate(folder, b, args) for b in (1, 16)}
            print(f"      TTFT, {args.prefix}-token prefix cold and cached ...", flush=True)
            res[name] = {**cost, **fit, **rates, **ttft(folder, args)}
    print(f"\n| model | KV bytes per token | state bytes per sequence | max running in {args.budget_mib} MiB | "
          f"decode tok/s batch 1 | batch 16 | TTFT cold | TTFT cached | cold / cached |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in res.items():
        per_token = ", ".join(f"{kind} {n}" for kind, n in r["bytes_per_token"].items())
        print(f"| {name} | {per_token} | {r['state_bytes_per_seq']} | {r['max_running']} | "
              f"{r['decode_tok_s_b1']:.1f} | {r['decode_tok_s_b16']:.1f} | {r['ttft_cold_s'] * 1e3:.1f} ms | "
              f"{r['ttft_cached_s'] * 1e3:.1f} ms | {r['ttft_cold_s'] / r['ttft_cached_s']:.1f}x |")
    for name, twin in (("qwen3.5", "qwen3 twin"), ("deepseek-v3", "mha twin")):
        a, b = res[name], res[twin]
        print(f"{name} / {twin}: {b['bytes_per_block'] / a['bytes_per_block']:.2f}x fewer KV bytes per token, "
              f"{a['max_running'] / b['max_running']:.2f}x the sequences in {args.budget_mib} MiB; "
              f"prefix hit cuts TTFT {a['ttft_cold_s'] / a['ttft_cached_s']:.1f}x "
              f"({a['cached_tokens']} cached tokens)")
    write_results(args.out, args, res)


if __name__ == "__main__":
    main()
