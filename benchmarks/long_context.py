"""Sliding windows on long prompts: the KV blocks a sequence holds, decode speed, and how many
sequences a fixed pool holds at once, for a gpt-oss-shaped model (random weights, scaled down) whose
windows are kept, against the same model with its windows turned into full attention.

Three layouts of the one model:
  sliding      every layer windowed: a sequence gives back the blocks behind its window;
  alternating  gpt-oss's own layout, windowed and full layers in turn: the full layers need every
               block, so the pool frees none (vLLM's hybrid manager gives each kind its own pool);
  full         the windows turned into full attention.

Prompts are 4x the window. Figures: blocks held per sequence at the end of decoding, decode tok/s at
batch 8, the most sequences running at once in a pool of --pool-blocks blocks (with the preemptions
it took), and whether ladle's greedy tokens equal transformers' on the same model.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, write_results  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402
from ladle.engine.prefix_cache import HOLLOW  # noqa: E402
from ladle.model.loader import resolve_model_path  # noqa: E402

LAYOUTS = ("sliding", "alternating", "full")
VOCAB = 8192


def build(layout: str, folder: Path, args: argparse.Namespace) -> Path:
    """gpt-oss scaled down: 64-wide heads (8 query, 2 K/V), sinks, 8 experts (top 2), YaRN, window W."""
    from transformers import GptOssConfig, GptOssForCausalLM

    kinds = {"sliding": ["sliding_attention"] * args.layers, "full": ["full_attention"] * args.layers,
             "alternating": ["sliding_attention", "full_attention"] * (args.layers // 2)}[layout]
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                       num_local_experts=8, num_experts_per_tok=2, sliding_window=args.window, layer_types=kinds,
                       max_position_embeddings=131072, initializer_range=0.1, eos_token_id=VOCAB - 1,
                       bos_token_id=VOCAB - 2, pad_token_id=VOCAB - 3)
    torch.manual_seed(0)  # the same weights for every layout: only the attention's reach differs
    GptOssForCausalLM(cfg).save_pretrained(folder)
    tokenizer = resolve_model_path(None)  # prompts are token ids; the engine loads a tokenizer all the same
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 8, (length,), generator=rng).tolist() for _ in range(n)]


def held_blocks(llm: LLM) -> list[int]:
    return [sum(b != HOLLOW for b in s.block_table) for s in llm.engine.scheduler.running]


def decode_rate(folder: Path, args: argparse.Namespace) -> dict:
    """8 sequences in a pool big enough for all of them: decode tok/s and the blocks each holds."""
    llm = LLM(str(folder), dtype="float32", block_size=args.block_size, num_kv_blocks=4096,
              enable_prefix_caching=False)
    batch = prompts(args.batch, 4 * args.window)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    try:
        llm.generate([batch[0][:16]], SamplingParams(max_tokens=2))  # warm-up
        for i, p in enumerate(batch):
            llm.engine.add_request(str(i), p, greedy)
        outputs: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
        held, decode_s, steps = [], 0.0, 0
        while llm.engine.has_unfinished_requests():
            decoding = all(s.num_computed_tokens >= s.num_prompt_tokens for s in llm.engine.scheduler.running)
            t = time.perf_counter()
            for out in llm.engine.step():
                outputs[out.request_id] += [t for d in out.deltas for t in d.token_ids]
            if decoding and llm.engine.scheduler.running:
                decode_s += time.perf_counter() - t
                steps += 1
                held = held_blocks(llm)
        return {"decode_tok_s": args.batch * steps / max(decode_s, 1e-9), "blocks_per_seq": max(held),
                "tokens": [outputs[str(i)] for i in range(len(batch))], "prompts": batch}
    finally:
        llm.engine.close()


def max_batch(folder: Path, args: argparse.Namespace) -> dict:
    """As many sequences as wait, in a pool of --pool-blocks blocks: the most that run at once."""
    llm = LLM(str(folder), dtype="float32", block_size=args.block_size, num_kv_blocks=args.pool_blocks,
              max_num_seqs=256, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    try:
        for i, p in enumerate(prompts(args.waiting, 4 * args.window, seed=1)):
            llm.engine.add_request(str(i), p, greedy)
        most = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            most = max(most, len(llm.engine.scheduler.running))
        return {"max_running": most, "preemptions": llm.engine.scheduler.num_preemptions}
    finally:
        llm.engine.close()


def transformers_agrees(folder: Path, run: dict, n: int) -> bool:
    """ladle's greedy tokens for the first n prompts equal transformers' generate on the same model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, got in list(zip(run["prompts"], run["tokens"]))[:n]:
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=len(got), do_sample=False,
                                 min_new_tokens=len(got))[0, len(prompt):].tolist()
        if ref != got:
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per sequence")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pool-blocks", type=int, default=256, help="the fixed pool of the max-batch run")
    ap.add_argument("--waiting", type=int, default=48, help="sequences queued for the max-batch run")
    ap.add_argument("--check", type=int, default=2, help="prompts checked against transformers per layout")
    ap.add_argument("--out", default=None, help="default: docs/long_context.json (--quick: none written)")
    ap.add_argument("--quick", action="store_true", help="smoke run: window 16, hidden 128, 2 layers")
    args = ap.parse_args()
    if args.quick:
        args.window, args.hidden, args.layers, args.gen, args.pool_blocks, args.waiting, args.check = \
            16, 128, 2, 8, 64, 16, 1
    elif args.out is None:
        args.out = "docs/long_context.json"
    print(f"machine: {machine()}")
    print(f"gpt-oss-shaped: hidden {args.hidden}, {args.layers} layers, 8 experts (top 2), window {args.window}, "
          f"prompts {4 * args.window} tokens, {args.gen} generated, block size {args.block_size}")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, layout in enumerate(LAYOUTS, 1):
            folder = build(layout, Path(tmp) / layout, args)
            print(f"[{i}/{len(LAYOUTS)}] {layout}: decode at batch {args.batch} ...", flush=True)
            run = decode_rate(folder, args)
            print(f"      max batch in {args.pool_blocks} blocks ({args.waiting} queued) ...", flush=True)
            fit = max_batch(folder, args)
            print(f"      against transformers ({args.check} prompts) ...", flush=True)
            agrees = transformers_agrees(folder, run, args.check)
            res[layout] = {"blocks_per_seq": run["blocks_per_seq"], "decode_tok_s": run["decode_tok_s"], **fit,
                           "transformers_agrees": agrees}
    print(f"\n| layout | KV blocks held per sequence | decode tok/s (batch {args.batch}) | "
          f"max batch in {args.pool_blocks} blocks | preemptions | greedy == transformers |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layout, r in res.items():
        print(f"| {layout} | {r['blocks_per_seq']} | {r['decode_tok_s']:.1f} | {r['max_running']} | "
              f"{r['preemptions']} | {r['transformers_agrees']} |")
    full = res["full"]
    for layout in ("sliding", "alternating"):
        r = res[layout]
        print(f"{layout} / full: {full['blocks_per_seq'] / r['blocks_per_seq']:.2f}x fewer blocks per sequence, "
              f"{r['max_running'] / full['max_running']:.2f}x the batch, "
              f"{r['decode_tok_s'] / full['decode_tok_s']:.2f}x decode tok/s")
    write_results(args.out, args, res)


if __name__ == "__main__":
    main()
