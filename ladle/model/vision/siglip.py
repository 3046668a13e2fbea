"""SigLIP's vision transformer as Idefics3 and SmolVLM run it: square patches embedded by a strided
convolution, a learned position per cell of the pretraining grid, and pre-norm encoder layers
(LayerNorm, bidirectional attention with biases, a GELU MLP), then a final LayerNorm.

An image (or an image tile) of any size within the pretraining one gets its positions by bucketing
each patch's fractional coordinates into the pretraining grid (NaViT's "Patch n' Pack"), so a
smaller tile keeps positions spread over the whole grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class EncoderLayer:
    norm1: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias
    qkv: tuple[torch.Tensor, torch.Tensor]  # [3 * width, width], [3 * width]: q, k and v stacked
    out: tuple[torch.Tensor, torch.Tensor]
    norm2: tuple[torch.Tensor, torch.Tensor]
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]


@dataclass
class SiglipVision:
    patch: torch.Tensor  # conv weight [width, channels, p, p]
    patch_bias: torch.Tensor
    positions: torch.Tensor  # [grid * grid, width]
    layers: list[EncoderLayer]
    post_norm: tuple[torch.Tensor, torch.Tensor]
    heads: int
    eps: float

    @property
    def patch_size(self) -> int:
        return self.patch.shape[-1]

    @property
    def grid(self) -> int:
        return int(self.positions.shape[0] ** 0.5)

    @classmethod
    def from_weights(cls, w: dict[str, torch.Tensor], prefix: str, num_layers: int, heads: int,
                     eps: float) -> "SiglipVision":
        """The tower's tensors named as in transformers (prefix: e.g. "model.vision_model.")."""
        def pair(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return w[name + ".weight"], w[name + ".bias"]

        layers = []
        for i in range(num_layers):
            p = f"{prefix}encoder.layers.{i}."
            q, k, v = (pair(p + f"self_attn.{n}_proj") for n in "qkv")
            qkv = torch.cat([q[0], k[0], v[0]]), torch.cat([q[1], k[1], v[1]])
            layers.append(EncoderLayer(pair(p + "layer_norm1"), qkv, pair(p + "self_attn.out_proj"),
                                       pair(p + "layer_norm2"), pair(p + "mlp.fc1"), pair(p + "mlp.fc2")))
        return cls(w[prefix + "embeddings.patch_embedding.weight"], w[prefix + "embeddings.patch_embedding.bias"],
                   w[prefix + "embeddings.position_embedding.weight"], layers, pair(prefix + "post_layernorm"),
                   heads, eps)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """image [channels, H, W] (H and W multiples of the patch size) -> [patches, width], row-major."""
        x = F.conv2d(image[None].to(self.patch.dtype), self.patch, self.patch_bias, stride=self.patch_size)[0]
        rows, cols = x.shape[1:]
        x = x.flatten(1).T + self.positions[self.position_ids(rows, cols)]
        for layer in self.layers:
            x = x + self._attention(layer, F.layer_norm(x, x.shape[-1:], *layer.norm1, self.eps))
            h = F.layer_norm(x, x.shape[-1:], *layer.norm2, self.eps)
            x = x + F.linear(F.gelu(F.linear(h, *layer.fc1), approximate="tanh"), *layer.fc2)
        return F.layer_norm(x, x.shape[-1:], *self.post_norm, self.eps)

    def position_ids(self, rows: int, cols: int) -> torch.Tensor:
        """Each patch's cell of the pretraining grid: its fractional coordinates bucketed."""
        boundaries = torch.arange(1 / self.grid, 1.0, 1 / self.grid)

        def buckets(n: int) -> torch.Tensor:
            coords = (torch.arange(n, dtype=torch.float32) * (1.0 / n)).clamp(max=1.0 - 1e-6)
            return torch.bucketize(coords, boundaries, right=True)

        return (buckets(rows)[:, None] * self.grid + buckets(cols)[None, :]).flatten()

    def _attention(self, layer: EncoderLayer, x: torch.Tensor) -> torch.Tensor:
        n, width = x.shape
        q, k, v = F.linear(x, *layer.qkv).view(n, 3, self.heads, width // self.heads).permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return F.linear(out.transpose(0, 1).reshape(n, width), *layer.out)
