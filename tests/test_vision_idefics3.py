"""Idefics3/SmolVLM's image side (ladle.model.vision) against transformers' Idefics3Model on a tiny
random model: full tiles, a smaller tile (its positions bucketed over the pretraining grid), and the
pixel shuffle's order."""

from __future__ import annotations

import pytest
import torch

from ladle.model.vision.idefics3 import Idefics3Vision, pixel_shuffle

TILE, PATCH, SCALE = 32, 4, 2  # 8 x 8 patches a tile: 16 embeddings after the shuffle


@pytest.fixture(scope="module")
def idefics3():
    from transformers import Idefics3Config, Idefics3Model

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": TILE, "patch_size": PATCH}
    text = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256}
    cfg = Idefics3Config(vision_config=vision, text_config=text, scale_factor=SCALE)
    torch.manual_seed(0)
    model = Idefics3Model(cfg).eval()
    with torch.no_grad():
        for p in model.vision_model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # LayerNorms and biases off their initial 1 and 0
    weights = {f"model.{n}": t.detach() for n, t in model.state_dict().items()}
    return model, Idefics3Vision.from_weights(weights, cfg.to_dict())


def test_full_tiles_match_transformers(idefics3) -> None:
    model, vision = idefics3
    tiles = torch.randn(3, 3, TILE, TILE)
    with torch.no_grad():
        want = model.get_image_features(tiles[None]).pooler_output[0].view(3, -1, 48)
    got = torch.stack([vision(t) for t in tiles])
    assert got.shape == (3, vision.tokens_per_tile(TILE), 48) == want.shape
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item() + 1e-6


def test_a_smaller_tile_spreads_its_positions_over_the_grid(idefics3) -> None:
    """A 16 x 24 tile (4 x 6 patches): transformers pads it to the full size and masks the padding."""
    model, vision = idefics3
    tile = torch.randn(3, 16, 24)
    padded = torch.zeros(1, 1, 3, TILE, TILE)
    padded[0, 0, :, :16, :24] = tile
    mask = torch.zeros(1, 1, TILE, TILE, dtype=torch.bool)
    mask[0, 0, :16, :24] = True
    with torch.no_grad():
        hidden = model.vision_model(padded[0], patch_attention_mask=mask[0, :, ::PATCH, ::PATCH].contiguous()).last_hidden_state
    real = hidden[0].view(TILE // PATCH, TILE // PATCH, -1)[:4, :6].reshape(24, -1)
    assert torch.allclose(vision.tower(tile), real, atol=1e-5)
    assert vision.tower.position_ids(4, 6).tolist()[:6] == [0, 1, 2, 4, 5, 6]  # 6 columns over the 8 cells


def test_pixel_shuffle_folds_each_square_row_by_row() -> None:
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    x = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)  # a 4 x 4 grid of 3-wide patches
    want = Idefics3Connector.pixel_shuffle(None, x[None], 2)[0]
    assert torch.equal(pixel_shuffle(x, 2), want)
    assert pixel_shuffle(x, 2)[0].tolist() == [*x[0].tolist(), *x[1].tolist(), *x[4].tolist(), *x[5].tolist()]
