"""Idefics3's (and SmolVLM's) image side: each image tile through the SigLIP tower, then the
connector: a pixel shuffle that folds each scale x scale square of patches into one vector (fewer,
wider tokens), projected to the language model's width. Each tile becomes (patches / scale^2)
embeddings, the rows of its <image> placeholder tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.model.vision.siglip import SiglipVision


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[side * side, width] patches (row-major) -> [(side / scale)^2, width * scale^2]: each scale x scale
    square's patches concatenated row by row."""
    side = int(x.shape[0] ** 0.5)
    width = x.shape[1]
    x = x.view(side // scale, scale, side // scale, scale, width)  # (block row, row in it, block col, col in it)
    return x.permute(0, 2, 1, 3, 4).reshape((side // scale) ** 2, scale * scale * width)


@dataclass
class Idefics3Vision:
    tower: SiglipVision
    projection: torch.Tensor  # [text width, vision width * scale^2]
    scale: int

    @classmethod
    def from_weights(cls, w: dict[str, torch.Tensor], config: dict, prefix: str = "model.") -> "Idefics3Vision":
        """config: the checkpoint's config.json (vision_config, scale_factor)."""
        vision = config["vision_config"]
        tower = SiglipVision.from_weights(w, prefix + "vision_model.", vision["num_hidden_layers"],
                                          vision["num_attention_heads"], vision.get("layer_norm_eps", 1e-6))
        return cls(tower, w[prefix + "connector.modality_projection.proj.weight"], config.get("scale_factor", 2))

    def tokens_per_tile(self, tile_size: int) -> int:
        return (tile_size // self.tower.patch_size) ** 2 // self.scale**2

    def __call__(self, tile: torch.Tensor) -> torch.Tensor:
        """tile [channels, H, W] -> its placeholders' embeddings [tokens, text width]."""
        return pixel_shuffle(self.tower(tile), self.scale) @ self.projection.T
