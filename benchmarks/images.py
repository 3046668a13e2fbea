"""Image decisions on a small vision-language model (SmolVLM/Idefics3's shape, random weights): 16 decisions
of 4 questions each about 4 distinct drawn images, 4 decisions in flight at a time, through the decisions
pipeline the server runs (an in-process AsyncEngine), with caching on (the encoder cache by image content
hash, and the prefix cache keyed by the image) and off (--mm-encoder-cache-mib 0 --no-prefix-cache).

Figures per run: encoder runs and seconds, prompt tokens and prefill tokens (those computed, not found in
the prefix cache), and decisions/s. With caching on the encoder runs once per distinct image: 4 runs.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, write_results  # noqa: E402

from ladle.config import EngineConfig  # noqa: E402
from ladle.decisions.openai_dialect import OpenAIDecisionRequest, to_questions  # noqa: E402
from ladle.decisions.pipeline import decide  # noqa: E402
from ladle.engine.async_engine import AsyncEngine  # noqa: E402
from ladle.engine.engine import LLMEngine  # noqa: E402
from ladle.model.loader import resolve_model_path  # noqa: E402

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + \
    [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
QUESTIONS = [
    {"type": "choice", "instructions": "What is in the picture?",
     "choices": [{"value": "parcel"}, {"value": "person"}, {"value": "document"}, {"value": "vehicle"}]},
    {"type": "predicate", "instructions": "The item looks damaged."},
    {"type": "score", "instructions": "How clear is the picture?",
     "levels": [{"label": "unreadable"}, {"label": "blurry"}, {"label": "clear"}]},
    {"type": "choice", "instructions": "Which team should look at it?",
     "choices": [{"value": "claims"}, {"value": "logistics"}, {"value": "support"}]},
]


def build(folder: Path, args: argparse.Namespace) -> Path:
    """A random Idefics3 checkpoint of this shape with SmolLM2's tokenizer (the image tokens added), the
    processor's config (tiles of --tile pixels, images split up to --longest-edge) and SmolVLM's template."""
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    source = resolve_model_path(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    per_tile = (args.tile // args.patch) ** 2 // args.scale**2
    images = Idefics3ImageProcessorPil(size={"longest_edge": args.longest_edge},
                                       max_image_size={"longest_edge": args.tile}, do_image_splitting=True)
    Idefics3Processor(images, tokenizer, image_seq_len=per_tile, chat_template=SMOLVLM_TEMPLATE).save_pretrained(
        str(folder))
    (folder / "chat_template.jinja").write_text(SMOLVLM_TEMPLATE)
    vision = {"hidden_size": args.vision_hidden, "intermediate_size": 4 * args.vision_hidden,
              "num_hidden_layers": args.vision_layers, "num_attention_heads": args.vision_hidden // 64,
              "image_size": args.tile, "patch_size": args.patch}
    text = {"hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 192),
            "vocab_size": len(tokenizer), "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2}
    torch.manual_seed(0)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=args.scale,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    Idefics3ForConditionalGeneration(config).save_pretrained(str(folder))
    return folder


def drawn(kind: int, size: int):
    """A drawing: shapes whose colours and places depend on kind."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(kind)
    colour = lambda: tuple(int(c) for c in torch.randint(0, 256, (3,), generator=g))  # noqa: E731
    image = Image.new("RGB", (size, size * 3 // 4), colour())
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x, y = (int(v) for v in torch.randint(0, size // 2, (2,), generator=g))
        draw.rectangle([x, y, x + size // 4, y + size // 5], fill=colour())
    return image


async def run(folder: Path, caching: bool, args: argparse.Namespace) -> dict:
    engine = AsyncEngine(LLMEngine(EngineConfig(
        model=str(folder), dtype="float32", kv_cache_memory_gib=0.5, enable_prefix_caching=caching,
        mm_encoder_cache_mib=256 if caching else 0, max_num_batched_tokens=2048)))
    try:
        engine.start()
        marker = engine.engine.images.marker
        questions = to_questions(OpenAIDecisionRequest(model="m", input="x", questions=QUESTIONS))
        images = [drawn(i, args.image_size) for i in range(args.images)]
        text = f"{marker}\nA photo sent with a claim."
        slots = asyncio.Semaphore(args.concurrency)

        async def one(i: int):
            async with slots:
                return await decide(engine, text, questions, images=(images[i % len(images)],))

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(args.decisions)))
        seconds = time.perf_counter() - start
        stats = engine.engine.images.stats
        prompt = sum(r.prompt_tokens for r in results)
        return {"encoder_runs": stats.runs, "encoder_seconds": stats.seconds, "images": stats.images,
                "prompt_tokens": prompt, "prefill_tokens": prompt - sum(r.cached_tokens for r in results),
                "decisions_per_s": args.decisions / seconds, "seconds": seconds}
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576, help="the language model's width (SmolVLM-256M's)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vision-hidden", type=int, default=384)
    ap.add_argument("--vision-layers", type=int, default=6)
    ap.add_argument("--tile", type=int, default=256, help="tile side in pixels")
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--scale", type=int, default=4, help="pixel shuffle factor")
    ap.add_argument("--longest-edge", type=int, default=512, help="images are resized to at most this, then split")
    ap.add_argument("--image-size", type=int, default=480, help="the drawings' width")
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--decisions", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", default=None, help="results as JSON (default: none written)")
    ap.add_argument("--quick", action="store_true", help="smoke run: a tiny shape, small tiles")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vision_hidden, args.vision_layers = 128, 2, 64, 2
        args.tile, args.patch, args.scale, args.longest_edge, args.image_size = 32, 4, 2, 64, 60
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp), args)
        results = {name: asyncio.run(run(folder, caching, args)) for name, caching in (("on", True), ("off", False))}
    print(f"{args.decisions} decisions x {len(QUESTIONS)} questions on {args.images} distinct images, "
          f"{args.concurrency} in flight")
    print("| caching | encoder runs | encoder s | prompt tokens | prefill tokens | decisions/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['encoder_runs']} | {r['encoder_seconds']:.3f} | {r['prompt_tokens']} | "
              f"{r['prefill_tokens']} | {r['decisions_per_s']:.2f} |")
    on, off = results["on"], results["off"]
    print(f"caching on: {on['encoder_runs']} encoder runs for {args.images} distinct images; "
          f"{off['decisions_per_s'] and on['decisions_per_s'] / off['decisions_per_s']:.2f}x the decisions/s, "
          f"{off['prefill_tokens'] / max(1, on['prefill_tokens']):.1f}x fewer prefill tokens")
    write_results(args.out, args, results)


if __name__ == "__main__":
    main()
