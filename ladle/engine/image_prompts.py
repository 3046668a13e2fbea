"""A prompt with images made into what the engine runs: each image marker of the rendered prompt
expanded into its placeholders by the checkpoint's own processor (transformers': resizing, image
splitting, the tile marks), the tiles encoded (once per distinct image, through the encoder cache),
and the placeholder runs found in the token ids as spans with their embeddings.

Two families: SmolVLM/Idefics3 (`<image>` marks an image, as its chat template writes it; tiles of a
fixed size) and Qwen2.5-VL (`<|image_pad|>` between its vision marks; one span per image at its own
resolution, its rows and columns kept for M-RoPE)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ladle.engine.encoder_cache import EncodedImage, EncoderCache, EncoderStats
from ladle.engine.multimodal import ImageSpan, span_key
from ladle.errors import InvalidRequestError
from ladle.model.vision.idefics3 import Idefics3Vision

if TYPE_CHECKING:
    from PIL.Image import Image

    from ladle.model.tokenizer import Tokenizer

IMAGE_MODEL_TYPES = ("idefics3", "smolvlm", "qwen2_5_vl")
VISION_PREFIXES = ("model.vision_model.", "model.connector.", "visual.", "model.visual.")


def takes_images(folder: Path) -> bool:
    """Whether the checkpoint in folder has a vision tower ladle runs."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return config.get("model_type") in IMAGE_MODEL_TYPES


def image_hash(image: "Image") -> bytes:
    """The decoded image's content hash (mode, size and pixels): one key for one picture, however sent."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.digest()


def _vision_weights(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    weights = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(VISION_PREFIXES):
                    weights[name] = f.get_tensor(name).to(dtype)
    return weights


class Idefics3Images:
    """SmolVLM/Idefics3: the processor splits an image into tiles (and a downscaled whole), each of a
    fixed number of <image> placeholders between tile marks."""

    marker = "<image>"

    def __init__(self, folder: Path, config: dict, dtype: torch.dtype):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(folder))
        self.vision = Idefics3Vision.from_weights(_vision_weights(folder, dtype), config)
        self.image_token = self.processor.image_token

    def encode(self, image: "Image") -> EncodedImage:
        out = self.processor.image_processor(images=[[image.convert("RGB")]], return_row_col_info=True,
                                             return_tensors="pt")
        placeholders = self.processor.replace_image_token({"rows": out["rows"], "cols": out["cols"]}, 0)
        if not bool(out["pixel_attention_mask"].all()):  # transformers masks padded tiles' patches: not here yet
            raise InvalidRequestError("an image that leaves a tile partly padded (no image splitting) is not "
                                      "supported yet", param="images")
        return EncodedImage(placeholders, [self.vision(tile) for tile in out["pixel_values"][0]])


class Qwen25Images:
    """Qwen2.5-VL: the image processor resizes an image to whole 28-pixel squares; its patches go through
    the tower at that resolution into one run of <|image_pad|> tokens, a grid of rows and columns."""

    marker = image_token = "<|image_pad|>"

    def __init__(self, folder: Path, config: dict, dtype: torch.dtype):
        from transformers import AutoImageProcessor

        from ladle.model.vision.qwen2_5_vl import Qwen25Vision

        self.processor = AutoImageProcessor.from_pretrained(str(folder))
        self.vision = Qwen25Vision.from_weights(_vision_weights(folder, dtype), config["vision_config"],
                                                prefix=_visual_prefix(folder))

    def encode(self, image: "Image") -> EncodedImage:
        out = self.processor(images=[image.convert("RGB")], return_tensors="pt")
        _, rows, cols = (int(n) for n in out["image_grid_thw"][0])
        m = self.vision.merge
        tokens = self.vision(out["pixel_values"], rows, cols)
        return EncodedImage(self.marker * tokens.shape[0], [tokens], [(rows // m, cols // m)])


def _visual_prefix(folder: Path) -> str:
    """Where Qwen2.5-VL's tower is: the Hub's checkpoints name it visual.*, transformers 5's model.visual.*."""
    from safetensors import safe_open

    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if any(name.startswith("model.visual.") for name in f.keys()):
                return "model.visual."
    return "visual."


FAMILIES = {"idefics3": Idefics3Images, "smolvlm": Idefics3Images, "qwen2_5_vl": Qwen25Images}


class ImagePrompts:
    """A vision model's prompts with images: its family expands and encodes each image."""

    def __init__(self, family: Idefics3Images | Qwen25Images, tokenizer: "Tokenizer", cache: EncoderCache):
        self.family = family
        self.marker = family.marker
        self.tokenizer = tokenizer
        self.cache = cache
        self.stats = EncoderStats()
        self.image_token_id = tokenizer.token_to_id(family.image_token)

    @classmethod
    def from_folder(cls, folder: Path, tokenizer: "Tokenizer", dtype: torch.dtype,
                    cache_bytes: int) -> "ImagePrompts":
        config = json.loads((Path(folder) / "config.json").read_text())
        return cls(FAMILIES[config["model_type"]](folder, config, dtype), tokenizer, EncoderCache(cache_bytes))

    def prompt(self, text: str, images: list["Image"]) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """text (its images marked by `marker`, one per image, in order) -> token ids and the spans."""
        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(images):
            raise InvalidRequestError(f"the prompt marks {len(pieces) - 1} image(s) with {self.marker} but "
                                      f"{len(images)} were sent", param="images")
        hashes = [image_hash(image) for image in images]
        encoded = [self.encode(image, h) for image, h in zip(images, hashes)]
        full = pieces[0] + "".join(e.placeholders + piece for e, piece in zip(encoded, pieces[1:]))
        ids = self.tokenizer.encode(full)
        tiles = [(h, i, tile, (e.grids or [None] * len(e.tiles))[i]) for h, e in zip(hashes, encoded)
                 for i, tile in enumerate(e.tiles)]
        return ids, self._spans(ids, tiles)

    def encode(self, image: "Image", key: bytes) -> EncodedImage:
        """The image's placeholders and tile embeddings: from the cache, or processed and encoded now."""
        self.stats.images += 1
        cached = self.cache.get(key)
        if cached is not None:
            self.stats.hits += 1
            return cached
        start = time.perf_counter()
        encoded = self.family.encode(image)
        self.stats.runs += 1
        self.stats.seconds += time.perf_counter() - start
        self.cache.put(key, encoded)
        return encoded

    def _spans(self, ids: list[int], tiles: list[tuple[bytes, int, torch.Tensor, tuple[int, int] | None]]
               ) -> tuple[ImageSpan, ...]:
        """The runs of placeholder tokens in ids, matched in order to the tiles' embeddings."""
        runs, start = [], None
        for pos, token in enumerate([*ids, -1]):
            if token == self.image_token_id and start is None:
                start = pos
            elif token != self.image_token_id and start is not None:
                runs.append((start, pos - start))
                start = None
        if len(runs) != len(tiles) or any(n != t.shape[0] for (_, n), (_, _, t, _) in zip(runs, tiles)):
            raise InvalidRequestError(f"the prompt's {self.family.image_token} tokens do not match its images' "
                                      "tiles (is the marker in the text too?)", param="images")
        return tuple(ImageSpan(offset, tile, span_key(h, i), grid)
                     for (offset, _), (h, i, tile, grid) in zip(runs, tiles))
