"""Gemma 4's text models against transformers: its rotary tables (proportional RoPE on the global layers)
and norms bit for bit, its configs read as transformers reads them, what ladle does not compute yet
refused by name, and its image-and-text checkpoints serving text. The tiny Gemma 4's tokens and logprobs
(plain, chunked across the window, preempted, from a long prefix-cache hit, scoring bit-identical) are
tests/test_sliding_window.py's, run on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_vs_hf import ENGINE_CASES, PROMPTS
from test_sliding_window import check_against_transformers
from tiny_models import build_tiny_model

from ladle import LLM
from ladle.model.attention import KVCache
from ladle.model.config import ModelConfig
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


def test_what_ladle_does_not_serve_is_refused_by_name() -> None:
    """Attention that is not causal for text, another activation; bidirectional attention for images only
    (the image-and-text checkpoints') leaves text causal and is served."""
    with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
        ModelConfig.from_hf_dict({**BASE, "use_bidirectional_attention": "all"}, name="google/x")
    with pytest.raises(ValueError, match="hidden_activation 'silu' is not Gemma 4's"):
        ModelConfig.from_hf_dict({**BASE, "hidden_activation": "silu"}, name="google/x")
    assert ModelConfig.from_hf_dict({**BASE, "use_bidirectional_attention": "vision"}).layer_windows


def test_per_layer_attention_shapes_are_read_as_transformers_reads_them() -> None:
    """The Hub's Gemma 4s give their global layers wider heads (global_head_dim, 512 by default) and, with
    attention_k_eq_v, fewer KV heads (num_global_key_value_heads); transformers 5 saves them per layer."""
    config = {k: v for k, v in BASE.items() if k != "global_head_dim"}
    hub = ModelConfig.from_hf_dict({**config, "num_global_key_value_heads": 1, "attention_k_eq_v": True})
    assert hub.layer_attention_shapes == ((2, 32),) * 5 + ((1, 512),)
    assert (hub.num_key_value_heads, hub.head_dim) == (2, 32) and hub.gemma.attention_k_eq_v
    assert hub.gemma.full_layers == {5}
    saved = ModelConfig.from_hf_dict({**BASE, "per_layer_config": {"5": {"head_dim": 64}}})
    assert saved.layer_attention_shapes == ((2, 32),) * 5 + ((2, 64),) and not saved.gemma.attention_k_eq_v
    assert ModelConfig.from_hf_dict(BASE).layer_attention_shapes == ()  # one shape: the model's


def test_a_cache_of_layers_differing_in_shape() -> None:
    """One stack per shape, each layer's view contiguous, its bytes counted by its own shape; tensors() lists
    the stacks (what handoff and offload copy block by block) and copy_prefix copies in each."""
    shapes = ((2, 32), (1, 64), (2, 32), (1, 64))
    cache = KVCache(4, 6, 8, 2, 32, layer_shapes=shapes)
    assert [tuple(cache.k[i].shape) for i in range(4)] == [(6, 8, *s) for s in shapes]
    assert all(cache.k[i].is_contiguous() and cache.layer_shape(i) == shapes[i] for i in range(4))
    assert [tuple(t.shape) for t in cache.tensors()] == [(2, 6, 8, 2, 32), (2, 6, 8, 1, 64)] * 2
    assert KVCache.bytes_per_block(4, 8, 2, 32, layer_shapes=shapes) == sum(t[:, 0].numel() * 4
                                                                              for t in cache.tensors())
    cache.k[3][1, :5] = 1.0
    cache.copy_prefix(1, 4, 3, layer=3)
    cache.copy_prefix(1, 2, 5)
    assert cache.k[3][4].sum() == 3 * 64 and cache.k[3][2].sum() == 5 * 64 and cache.k[1][4].sum() == 0


def test_gemma4_runs_on_one_rank_only() -> None:
    from ladle.model.sharding import Shard

    cfg = ModelConfig.from_hf_dict({**BASE, "global_head_dim": 64})
    with pytest.raises(ValueError, match="Gemma 4 runs on one rank only"):
        Shard(0, 2).check(cfg)


@pytest.mark.parametrize("kind", ["sliding_attention", "full_attention"])
def test_rotary_tables_are_transformers_bit_for_bit(kind: str) -> None:
    """The global layers' proportional RoPE turns only a quarter of each head's (wider) frequency pairs."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    d = {k: v for k, v in BASE.items() if k != "model_type"} | {"global_head_dim": 64}
    d["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1e6, "factor": 2.0}}
    positions = torch.arange(4096)
    cos, sin = Gemma4TextRotaryEmbedding(Gemma4TextConfig(**d))(torch.zeros(1), positions[None], kind)
    cfg = ModelConfig.from_hf_dict({**d, "model_type": "gemma4_text"})
    layer, theta, scaling = ((0, cfg.gemma.local_rope_theta, cfg.gemma.local_rope_scaling)
                             if kind == "sliding_attention" else (5, cfg.rope_theta, cfg.rope_scaling))
    head_dim = cfg.attention_shape(layer)[1]
    ours_cos, ours_sin = RotaryEmbedding(head_dim, 4096, theta, scaling).tables(positions)
    half = head_dim // 2  # ladle's sin carries rotate_half's sign in its first half
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


def test_kv_sharing_is_read_as_transformers_reads_it() -> None:
    """The last num_kv_shared_layers layers read the K/V of the last earlier layer of their kind (the ones
    transformers' kv_sharing_modes has store them), and the cache holds the others only."""
    from transformers import Gemma4TextConfig

    d = {**BASE, "layer_types": ["sliding_attention", "full_attention"] * 3, "num_kv_shared_layers": 3}
    cfg = ModelConfig.from_hf_dict(d)
    modes = Gemma4TextConfig(**{k: v for k, v in d.items() if k != "model_type"}).kv_sharing_modes
    assert cfg.gemma.kv_sources == {3: 1, 4: 2, 5: 1}
    assert set(cfg.gemma.kv_sources.values()) == {i for i, mode in enumerate(modes) if mode == "store"}
    assert [i for i, mode in enumerate(modes) if mode == "reuse"] == [3, 4, 5] and cfg.num_kv_layers == 3
    with pytest.raises(ValueError, match="leaves no earlier full_attention layer"):
        ModelConfig.from_hf_dict({**BASE, "num_kv_shared_layers": 1})  # only the last layer is global


def test_a_gemma4_image_and_text_checkpoint_serves_text(tmp_path: Path, smollm2_dir: Path) -> None:
    """The tiny Gemma 4 (wider global heads with K = V, two KV-shared layers, per-layer inputs) inside its
    image-and-text checkpoint: ladle reads the language model alone, caches the 4 layers that compute K/V
    in a stack per shape, and matches transformers' image-and-text class on text."""
    from transformers import AutoModelForImageTextToText

    folder = build_tiny_model("gemma4-vision", tmp_path / "gemma4-vision", smollm2_dir)
    hf_model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "Gemma4ForConditionalGeneration"
    llm = LLM(str(folder), dtype="float32")
    cache = llm.engine.runner.kv_cache
    assert [tuple(t.shape[:1] + t.shape[3:]) for t in cache.tensors()] == [(2, 2, 32), (2, 1, 64)] * 2
    check_against_transformers(llm, hf_model, PROMPTS[:4])


def test_the_moe_block_matches_transformers(tmp_path: Path, smollm2_dir: Path) -> None:
    """The 26B-A4B's layers: 4 experts (top 2) beside each dense MLP, routed on the residual stream with
    the router's norm, scale and per-expert scales; plain and chunked across the window's edge."""
    from transformers import AutoModelForCausalLM

    moe = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
    folder = build_tiny_model("gemma4", tmp_path / "gemma4-moe", smollm2_dir, **moe)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for case in ("plain", "chunked32"):
        llm = LLM(str(folder), dtype="float32", **ENGINE_CASES[case])
        check_against_transformers(llm, hf_model, PROMPTS[2:6])
    routed = [int(block.tokens_per_expert.sum()) for block in llm.engine.runner.model.moe_blocks.values()]
    assert len(routed) == 6 and min(routed) > 0


def test_the_triton_kernels_refuse_layers_of_different_shapes(tmp_path: Path, smollm2_dir: Path) -> None:
    """The CUDA path's kernels take one K/V shape for every layer: refused at start, not served wrong."""
    folder = build_tiny_model("gemma4", tmp_path / "gemma4", smollm2_dir)
    with pytest.raises(ValueError, match="--attention-backend torch"):
        LLM(str(folder), dtype="float32", attention_backend="triton")
