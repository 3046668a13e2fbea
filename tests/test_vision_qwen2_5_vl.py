"""Qwen2.5-VL's vision tower (ladle.model.vision.qwen2_5_vl) against transformers' on a tiny random tower:
window attention (windows that do not divide the image, so some are partial), a full-attention block
between window ones, 2D rotary positions and the 2 x 2 merger; and the tensors named as the whole
checkpoint names them."""

from __future__ import annotations

import pytest
import torch

from ladle.model.vision.qwen2_5_vl import Qwen25Vision

VISION = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 4,
          "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 16, "fullatt_block_indexes": [1],
          "out_hidden_size": 48, "in_channels": 3}


@pytest.fixture(scope="module")
def tower():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 128}
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=VISION, text_config=text)).eval()
    with torch.no_grad():  # norms and biases off their initial 1 and 0, weights wide enough to matter
        for p in model.model.visual.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    weights = {n: t.detach() for n, t in model.state_dict().items()}
    vision = model.config.vision_config.to_dict()
    return model.model.visual, Qwen25Vision.from_weights(weights, vision)


@pytest.mark.parametrize("rows, cols", [(12, 10), (8, 8), (4, 6)])
def test_the_tower_matches_transformers(tower, rows: int, cols: int) -> None:
    """12 x 10 patches: 3 x 3 windows of 4 x 4, the last row and column of them partial; 8 x 8: whole windows;
    4 x 6: one row of windows."""
    reference, ours = tower
    patches = torch.randn(rows * cols, 3 * 2 * 4 * 4)
    with torch.no_grad():
        want = reference(patches, grid_thw=torch.tensor([[1, rows, cols]])).pooler_output
    got = ours(patches, rows, cols)
    assert got.shape == want.shape == (rows * cols // 4, 48)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_windows_matter(tower) -> None:
    """Every block attending over the whole image gives other numbers: the windows are really applied."""
    reference, ours = tower
    patches = torch.randn(12 * 10, 96)
    whole = Qwen25Vision(**{**ours.__dict__, "full_blocks": frozenset(range(len(ours.blocks)))})
    with torch.no_grad():
        want = reference(patches, grid_thw=torch.tensor([[1, 12, 10]])).pooler_output
    assert (whole(patches, 12, 10) - want).abs().max().item() > 1e-3
