"""Qwen2.5-VL's vision tower: an image at its own resolution cut into 14-pixel patches (two frames deep: a
still image is its own second frame), each embedded by one linear map (the checkpoint's Conv3d), then
RMSNorm blocks of bidirectional attention with 2D rotary positions (a patch's row on half the rotated
dims, its column on the other half) and a gated SiLU MLP. Most blocks attend within windows of
window_size pixels; the blocks fullatt_block_indexes names attend over the whole image. A merger then
folds each 2 x 2 square of patches into one vector of the language model's width: the rows of the
image's placeholder tokens.

Patches come in the processor's order, square by square (each merge unit's 4 patches in a row), which
is the order of the outputs too. Windows are whole merge units, so window attention is attention masked
to the same window: transformers' reordering into windows and back gives the same numbers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Pair = tuple[torch.Tensor, torch.Tensor]  # a linear layer's weight and bias


@dataclass
class VisionBlock:
    norm1: torch.Tensor
    qkv: Pair
    proj: Pair
    norm2: torch.Tensor
    gate: Pair
    up: Pair
    down: Pair


@dataclass
class Qwen25Vision:
    patch: torch.Tensor  # [width, channels * frames * patch * patch]: the Conv3d as one linear map
    blocks: list[VisionBlock]
    full_blocks: frozenset[int]  # blocks that attend over the whole image, not within windows
    merger_norm: torch.Tensor
    merger_fc1: Pair
    merger_fc2: Pair
    heads: int
    merge: int  # spatial_merge_size: a merge unit is merge x merge patches
    window_units: int  # a window's side in merge units
    rope_theta: float
    eps: float = 1e-6

    @classmethod
    def from_weights(cls, w: dict[str, torch.Tensor], vision: dict, prefix: str = "model.visual.") -> "Qwen25Vision":
        """vision: the checkpoint's vision_config; the tensors named as transformers names them."""
        def pair(name: str) -> Pair:
            return w[name + ".weight"], w[name + ".bias"]

        blocks = []
        for i in range(vision["depth"]):
            p = f"{prefix}blocks.{i}."
            blocks.append(VisionBlock(w[p + "norm1.weight"], pair(p + "attn.qkv"), pair(p + "attn.proj"),
                                      w[p + "norm2.weight"], pair(p + "mlp.gate_proj"), pair(p + "mlp.up_proj"),
                                      pair(p + "mlp.down_proj")))
        patch = w[prefix + "patch_embed.proj.weight"]
        merge, size = vision.get("spatial_merge_size", 2), vision.get("patch_size", 14)
        theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(patch.reshape(patch.shape[0], -1), blocks, frozenset(vision.get("fullatt_block_indexes", ())),
                   w[prefix + "merger.ln_q.weight"], pair(prefix + "merger.mlp.0"), pair(prefix + "merger.mlp.2"),
                   vision["num_heads"], merge, vision.get("window_size", 112) // merge // size, theta)

    def __call__(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """patches [rows * cols, channels * frames * patch^2] of one image (grid_thw (1, rows, cols)), in the
        processor's order -> [rows * cols / merge^2, text width]."""
        x = patches.to(self.patch.dtype) @ self.patch.T
        rope = self._rotary(rows, cols)
        same_window = self._windows(rows, cols)
        for i, block in enumerate(self.blocks):
            mask = None if i in self.full_blocks else same_window
            x = x + self._attention(block, self._rms(x, block.norm1), rope, mask)
            h = self._rms(x, block.norm2)
            x = x + F.linear(F.silu(F.linear(h, *block.gate)) * F.linear(h, *block.up), *block.down)
        merged = self._rms(x, self.merger_norm).reshape(-1, x.shape[-1] * self.merge**2)
        return F.linear(F.gelu(F.linear(merged, *self.merger_fc1)), *self.merger_fc2)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _unit_coords(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) in the image, in the processor's square-by-square order."""
        m = self.merge
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        shape = (rows // m, m, cols // m, m)
        return r.reshape(shape).transpose(1, 2).flatten(), c.reshape(shape).transpose(1, 2).flatten()

    def _rotary(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [patches, head dim]: the row's angles on the first quarter, the column's on the second,
        repeated for the other half (rotate-half layout)."""
        d = self.blocks[0].qkv[0].shape[1] // self.heads
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, d // 2, 2, dtype=torch.float) / (d // 2)))
        r, c = self._unit_coords(rows, cols)
        angles = torch.cat([r[:, None].float() * inv_freq, c[:, None].float() * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _windows(self, rows: int, cols: int) -> torch.Tensor:
        """[patches, patches] bool: whether two patches are in the same attention window."""
        r, c = self._unit_coords(rows, cols)
        span = self.window_units * self.merge
        window = (r // span) * (cols // span + 1) + c // span
        return window[:, None] == window[None, :]

    def _attention(self, block: VisionBlock, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   mask: torch.Tensor | None) -> torch.Tensor:
        n, width = x.shape
        q, k, v = F.linear(x, *block.qkv).view(n, 3, self.heads, width // self.heads).unbind(1)
        cos, sin = (t[:, None, :] for t in rope)
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        return F.linear(out.transpose(0, 1).reshape(n, width), *block.proj)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
