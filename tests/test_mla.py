"""Multi-head latent attention (ladle.model.mla), absorbed into the latent space, against transformers'
DeepseekV3Attention, which expands every head's keys and values: whole prompts, and a prompt continued
from a cache of latents; with and without a q LoRA, interleaved rotary dims or not, YaRN's mscale."""

from __future__ import annotations

import pytest
import torch

from ladle.model.mla import MLAWeights, mla, softmax_scale

HIDDEN, HEADS, NOPE, ROPE, V, RANK = 64, 4, 16, 8, 12, 24
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}


def deepseek_attention(q_lora_rank: int | None, interleave: bool, yarn: bool):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                           q_lora_rank=q_lora_rank, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                           v_head_dim=V, rope_interleave=interleave, max_position_embeddings=256,
                           rope_parameters=YARN if yarn else {"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return cfg, attn, DeepseekV3RotaryEmbedding(cfg)


def weights_of(attn, interleave: bool) -> MLAWeights:
    p = {n: t.detach() for n, t in attn.named_parameters()}
    lora = "q_a_proj.weight" in p
    return MLAWeights(p.get("q_a_proj.weight"), p.get("q_a_layernorm.weight"),
                      p["q_b_proj.weight" if lora else "q_proj.weight"], p["kv_a_proj_with_mqa.weight"],
                      p["kv_a_layernorm.weight"], p["kv_b_proj.weight"], p["o_proj.weight"], HEADS, NOPE, ROPE, V,
                      eps=attn.kv_a_layernorm.variance_epsilon, interleaved=interleave)


@pytest.mark.parametrize("q_lora_rank", [None, 32], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_absorbed_latent_attention_matches_deepseek_v3(q_lora_rank: int | None, interleave: bool, yarn: bool) -> None:
    cfg, attn, rotary = deepseek_attention(q_lora_rank, interleave, yarn)
    t = 40
    x = torch.randn(1, t, HIDDEN)
    positions = torch.arange(t)[None]
    cos, sin = rotary(x, positions)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = attn(x, (cos, sin), mask)[0][0]
    scale = softmax_scale(NOPE + ROPE, cfg.rope_parameters)
    assert scale == pytest.approx(attn.scaling, rel=1e-12)
    w = weights_of(attn, interleave)
    whole, _ = mla(w, x[0], cos[0], sin[0], scale)
    assert (whole - want).abs().max().item() < 1e-4 * want.abs().max().item()
    # the same prompt in two calls, the second reading the first's cached latents
    first, cache = mla(w, x[0, :23], cos[0, :23], sin[0, :23], scale)
    rest, cache = mla(w, x[0, 23:], cos[0, 23:], sin[0, 23:], scale, cache)
    assert torch.allclose(torch.cat([first, rest]), whole, atol=1e-5)
    assert cache[0].shape == (t, RANK) and cache[1].shape == (t, ROPE)  # what each token costs the cache
