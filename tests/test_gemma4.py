"""Gemma 4's text models against transformers: its rotary tables (proportional RoPE on the global layers)
and norms bit for bit, its configs read as transformers reads them, what ladle does not compute yet
refused by name. The tiny Gemma 4's tokens and logprobs (plain, chunked across the window, preempted,
from a long prefix-cache hit, scoring bit-identical) are tests/test_sliding_window.py's, run on it."""

from __future__ import annotations

import pytest
import torch

from ladle.model.config import GEMMA4_UNSUPPORTED, ModelConfig
from ladle.model.layers import RotaryEmbedding, rms_norm

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

BASE = {"model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "global_head_dim": 32, "sliding_window": 512, "hidden_size_per_layer_input": 0}


def test_a_gemma4_config_is_read_as_transformers_reads_it() -> None:
    """Every sixth layer global (the last forced global), the sliding layers' RoPE plain at 10k, the global
    ones proportional, q . k unscaled, norms by their weight, logits capped where the config says."""
    cfg = ModelConfig.from_hf_dict({**BASE, "final_logit_softcapping": 30.0})
    assert cfg.layer_windows == (512,) * 5 + (None,)
    assert cfg.rope_scaling["rope_type"] == "proportional" and cfg.rope_theta == 1e6
    assert (cfg.gemma.local_rope_theta, cfg.gemma.local_rope_scaling) == (10000.0, None)
    assert cfg.attention_scale == 1.0 and cfg.gemma.norm_offset == 0.0 and cfg.qk_norm
    assert cfg.gemma.final_logit_softcapping == 30.0
    image_and_text = ModelConfig.from_hf_dict({"model_type": "gemma4", "text_config": BASE})
    assert image_and_text.layer_windows == cfg.layer_windows and image_and_text.gemma.final_logit_softcapping is None


@pytest.mark.parametrize("field", GEMMA4_UNSUPPORTED)
def test_what_ladle_does_not_compute_yet_is_refused_by_name(field: str) -> None:
    value = 256 if field == "hidden_size_per_layer_input" else 2 if field == "num_kv_shared_layers" else True
    extra = {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32} if field == "enable_moe_block" else {}
    with pytest.raises(ValueError, match=f"Gemma 4's {field} is not supported yet"):
        ModelConfig.from_hf_dict({**BASE, field: value, **extra}, name="google/x")


def test_per_layer_attention_shapes_are_refused_by_name() -> None:
    """The Hub's Gemma 4s give their global layers wider heads (global_head_dim, 512 by default)."""
    config = {k: v for k, v in BASE.items() if k != "global_head_dim"}
    with pytest.raises(ValueError, match="global_head_dim and num_global_key_value_heads"):
        ModelConfig.from_hf_dict(config)


@pytest.mark.parametrize("kind", ["sliding_attention", "full_attention"])
def test_rotary_tables_are_transformers_bit_for_bit(kind: str) -> None:
    """The global layers' proportional RoPE turns only a quarter of each head's frequency pairs."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    d = {k: v for k, v in BASE.items() if k != "model_type"}
    d["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1e6, "factor": 2.0}}
    positions = torch.arange(4096)
    cos, sin = Gemma4TextRotaryEmbedding(Gemma4TextConfig(**d))(torch.zeros(1), positions[None], kind)
    cfg = ModelConfig.from_hf_dict({**d, "model_type": "gemma4_text"})
    theta, scaling = ((cfg.gemma.local_rope_theta, cfg.gemma.local_rope_scaling) if kind == "sliding_attention"
                      else (cfg.rope_theta, cfg.rope_scaling))
    ours_cos, ours_sin = RotaryEmbedding(cfg.head_dim, 4096, theta, scaling).tables(positions)
    half = cfg.head_dim // 2  # ladle's sin carries rotate_half's sign in its first half
    assert torch.equal(ours_cos[:, 0], cos[0])
    assert torch.equal(ours_sin[:, 0, half:], sin[0, :, half:])
    assert torch.equal(-ours_sin[:, 0, :half], sin[0, :, :half])
    assert (kind == "full_attention") == bool((cos[0] == 1).all(dim=0).any())  # some pairs never turn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma4_norms_round_as_transformers_does(dtype: torch.dtype) -> None:
    """Gemma 4's norms multiply the normed float32 row by the weight itself before rounding: ladle's norm
    with the float32 weight is transformers' module bit for bit; the value norm (no weight) too."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    gen = torch.Generator().manual_seed(4)
    norm, unscaled = Gemma4RMSNorm(256, eps=1e-6), Gemma4RMSNorm(256, eps=1e-6, with_scale=False)
    with torch.no_grad():
        norm.weight.copy_((torch.rand(256, generator=gen) * 2).to(dtype))  # as a checkpoint holds it
    x = (torch.randn(64, 256, generator=gen) * 3).to(dtype)
    with torch.no_grad():
        expected, expected_unscaled = norm.to(dtype)(x), unscaled(x)
    assert torch.equal(rms_norm(x, norm.weight.detach().float(), 1e-6), expected)
    assert torch.equal(rms_norm(x, torch.ones(256), 1e-6), expected_unscaled)
