"""Scaled RoPE (linear, Llama 3, YaRN) against transformers' own rotary embeddings, bit for bit, and a
YaRN model's greedy tokens against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_vs_hf import check_greedy_batch
from tiny_models import build_tiny_model

from ladle import LLM
from ladle.model.config import ModelConfig
from ladle.model.layers import RotaryEmbedding

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, {}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}, {}),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, {}),
    # gpt-oss's: no truncation of the ramp
    "yarn-untruncated": ({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                          "original_max_position_embeddings": 64}, {}),
    # Qwen's legacy "type", the trained context a field of the config itself
    "yarn-qwen": ({"type": "yarn", "factor": 4.0}, {"original_max_position_embeddings": 512}),
    # DeepSeek's: the attention factor from mscale and mscale_all_dim
    "yarn-mscale": ({"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                     "original_max_position_embeddings": 256}, {}),
}


@pytest.mark.parametrize("name", SCALINGS)
@pytest.mark.filterwarnings("ignore")  # transformers warns where a factor is not max / original positions
def test_rotary_tables_are_transformers_bit_for_bit(name: str) -> None:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    scaling, extra = SCALINGS[name]
    d = dict(vocab_size=100, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
             max_position_embeddings=2048, rope_theta=1e6, rope_scaling=scaling, **extra)
    positions = torch.arange(2048)
    cos, sin = Qwen2RotaryEmbedding(Qwen2Config(**d))(torch.zeros(1), positions[None])
    cfg = ModelConfig.from_hf_dict({**d, "model_type": "qwen2"})
    ours_cos, ours_sin = RotaryEmbedding(cfg.head_dim, 2048, cfg.rope_theta, cfg.rope_scaling).tables(positions)
    half = cfg.head_dim // 2  # ladle's sin carries rotate_half's sign in its first half
    assert torch.equal(ours_cos[:, 0], cos[0])
    assert torch.equal(ours_sin[:, 0, half:], sin[0, :, half:])
    assert torch.equal(-ours_sin[:, 0, :half], sin[0, :, :half])


def test_a_yarn_model_matches_transformers(tmp_path: Path, smollm2_dir: Path) -> None:
    """A trained context of 16 positions stretched 4x: the prompts run past it, so every part of the
    ramp turns."""
    from transformers import AutoModelForCausalLM

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e6}
    folder = build_tiny_model("qwen2", tmp_path / "yarn", smollm2_dir, rope_parameters=scaling)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf_model.config.rope_parameters["rope_type"] == "yarn"
    assert ModelConfig.from_folder(folder).rope_scaling["rope_type"] == "yarn"
    check_greedy_batch(LLM(str(folder), dtype="float32"), hf_model, "plain")
