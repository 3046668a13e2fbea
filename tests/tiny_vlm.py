"""A tiny random SmolVLM/Idefics3 checkpoint built by transformers: SigLIP tower, pixel shuffle, a Llama
text model; SmolLM2's tokenizer with the image tokens Idefics3's processor expects; the processor's
config (image splitting into 32-pixel tiles of 16 placeholders each) and SmolVLM's chat template.
And a few drawn images (never downloaded)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tiny_models import SMOLLM2_TOKENIZER_FILES

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + \
    [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
# SmolVLM's chat template: "User:<image>question<end_of_utterance>\nAssistant:"
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def build_tiny_idefics3(out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Save the checkpoint into out (created); returns out."""
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    for name in SMOLLM2_TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)
    (out / "chat_template.jinja").write_text(SMOLVLM_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                       do_image_splitting=True)
    Idefics3Processor(images, tokenizer, image_seq_len=16, chat_template=SMOLVLM_TEMPLATE).save_pretrained(str(out))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 4}
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": len(tokenizer), "rms_norm_eps": 1e-6, "initializer_range": 0.2,
            "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2}
    cfg = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg)
    with torch.no_grad():  # LayerNorms and biases off 1 and 0, a projector wide enough for images to matter
        for p in model.model.vision_model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        model.model.connector.modality_projection.proj.weight.normal_(0, 0.5)
    model.save_pretrained(str(out))
    return out


def drawn_image(kind: int, size: tuple[int, int] = (60, 40)):
    """A small PIL drawing: a few shapes whose colours and places depend on kind."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(kind)
    colour = lambda: tuple(int(c) for c in torch.randint(0, 256, (3,), generator=g))  # noqa: E731
    image = Image.new("RGB", size, colour())
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x, y = (int(v) for v in torch.randint(0, min(size), (2,), generator=g))
        draw.rectangle([x, y, x + size[0] // 3, y + size[1] // 3], fill=colour())
        draw.ellipse([y, x // 2, y + 12, x // 2 + 9], fill=colour())
    return image


QWEN_IMAGE_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{m['role']}}\n{% if m['content'] is string %}{{m['content']}}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{p['text']}}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen2_5_vl(out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL: a window-attention tower (4-pixel patches, 16-pixel windows, one full
    block), a Qwen2 text model with M-RoPE (sections 2, 3, 3 of its 8 frequencies); SmolLM2's tokenizer
    with Qwen's vision tokens, Qwen2-VL's image processor (images resized to 16..64^2 pixels), saved
    as the Hub names them (visual.*)."""
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_IMAGE_TOKENS})
    tokenizer.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=64 * 64, patch_size=4, merge_size=2,
                             temporal_patch_size=2).save_pretrained(str(out))
    vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 4,
              "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 16, "fullatt_block_indexes": [1],
              "out_hidden_size": 64, "in_channels": 3}
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": len(tokenizer), "rms_norm_eps": 1e-6, "initializer_range": 0.2,
            "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"), ("video_token_id", "<|video_pad|>"))}
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=vision, text_config=text, **ids))
    with torch.no_grad():  # norms and biases off 1 and 0, a merger wide enough for images to matter
        for p in model.model.visual.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        model.model.visual.merger.mlp[2].weight.normal_(0, 0.5)
    model.save_pretrained(str(out))
    return out
