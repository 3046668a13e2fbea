"""`--load-format dummy`: random weights of the shapes a config.json gives, made where they are used.

As vLLM's dummy format: for measuring a model's shape (an 8B benchmark on a GPU) without its
checkpoint. Weights are normal with std 0.02, norms are ones: activations stay in range, so
timings are those of real numbers, never of zeros or NaNs.
"""

from __future__ import annotations

import torch

from ladle.model.config import ModelConfig

STD = 0.02


def dummy_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """A dense Llama-family checkpoint's tensors, by Hugging Face name."""
    if cfg.moe is not None:
        raise ValueError("--load-format dummy builds dense models only (this config is mixture-of-experts)")
    if cfg.gemma is not None:  # its extra norms, Gemma 4's scalars, per-layer shapes and inputs
        raise ValueError(f"--load-format dummy builds Llama-shaped models only (this config is {cfg.model_type})")
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = _shapes(cfg)
    return {name: _norm_weight(shape, dtype, device) if _is_norm(name) else _random(shape, dtype, device, gen)
            for name, shape in shapes.items()}


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                       p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, cfg.intermediate_size)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _norm_weight(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    return torch.ones(shape, dtype=dtype, device=device)


def _random(shape: tuple[int, ...], dtype: torch.dtype, device, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, STD, generator=gen)
