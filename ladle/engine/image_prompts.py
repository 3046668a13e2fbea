"""A prompt with images made into what the engine runs: each image marker of the rendered prompt
expanded into its placeholders by the checkpoint's own processor (transformers': resizing, image
splitting, the tile marks), the tiles encoded (once per distinct image, through the encoder cache),
and the placeholder runs found in the token ids as spans with their embeddings.

SmolVLM/Idefics3 for now: `<image>` marks an image in the prompt, as its chat template writes it."""

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

IMAGE_MODEL_TYPES = ("idefics3", "smolvlm")
VISION_PREFIXES = ("model.vision_model.", "model.connector.")


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


class ImagePrompts:
    """Idefics3/SmolVLM's prompts with images."""

    marker = "<image>"

    def __init__(self, processor, vision: Idefics3Vision, tokenizer: "Tokenizer", cache: EncoderCache):
        self.processor = processor
        self.vision = vision
        self.tokenizer = tokenizer
        self.cache = cache
        self.stats = EncoderStats()
        self.image_token_id = tokenizer.token_to_id(processor.image_token)

    @classmethod
    def from_folder(cls, folder: Path, tokenizer: "Tokenizer", dtype: torch.dtype,
                    cache_bytes: int) -> "ImagePrompts":
        from transformers import AutoProcessor

        config = json.loads((Path(folder) / "config.json").read_text())
        vision = Idefics3Vision.from_weights(_vision_weights(folder, dtype), config)
        return cls(AutoProcessor.from_pretrained(str(folder)), vision, tokenizer, EncoderCache(cache_bytes))

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
        return ids, self._spans(ids, [(h, i, tile) for h, e in zip(hashes, encoded) for i, tile in enumerate(e.tiles)])

    def encode(self, image: "Image", key: bytes) -> EncodedImage:
        """The image's placeholders and tile embeddings: from the cache, or processed and encoded now."""
        self.stats.images += 1
        cached = self.cache.get(key)
        if cached is not None:
            self.stats.hits += 1
            return cached
        start = time.perf_counter()
        out = self.processor.image_processor(images=[[image.convert("RGB")]], return_row_col_info=True,
                                             return_tensors="pt")
        placeholders = self.processor.replace_image_token({"rows": out["rows"], "cols": out["cols"]}, 0)
        if not bool(out["pixel_attention_mask"].all()):  # transformers masks padded tiles' patches: not here yet
            raise InvalidRequestError("an image that leaves a tile partly padded (no image splitting) is not "
                                      "supported yet", param="images")
        tiles = [self.vision(tile) for tile in out["pixel_values"][0]]
        encoded = EncodedImage(placeholders, tiles)
        self.stats.runs += 1
        self.stats.seconds += time.perf_counter() - start
        self.cache.put(key, encoded)
        return encoded

    def _spans(self, ids: list[int], tiles: list[tuple[bytes, int, torch.Tensor]]) -> tuple[ImageSpan, ...]:
        """The runs of placeholder tokens in ids, matched in order to the tiles' embeddings."""
        runs, start = [], None
        for pos, token in enumerate([*ids, -1]):
            if token == self.image_token_id and start is None:
                start = pos
            elif token != self.image_token_id and start is not None:
                runs.append((start, pos - start))
                start = None
        if len(runs) != len(tiles) or any(n != t.shape[0] for (_, n), (_, _, t) in zip(runs, tiles)):
            raise InvalidRequestError(f"the prompt's {self.processor.image_token} tokens do not match its images' "
                                      "tiles (is the marker in the text too?)", param="images")
        return tuple(ImageSpan(offset, tile, span_key(h, i)) for (offset, _), (h, i, tile) in zip(runs, tiles))
