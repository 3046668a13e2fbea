"""What the KV pool holds per token, by attention kind, for the engine's start log: "full" (K and V of every
KV head, the Llama family's), "latent" (MLA's one vector of kv_lora_rank + rope per layer, DeepSeek V3's); and
"linear", the fixed-size state a hybrid model's linear-attention layers keep per sequence (Qwen3.5's)."""

from __future__ import annotations

import torch

from ladle.model.attention import KVCache
from ladle.model.config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype) -> dict[str, int]:
    """Bytes one token's K/V take in the paged cache over every layer that caches them, keyed by the kind of
    attention that caches them (as the pool is sized: KVCache.bytes_per_block of a one-token block)."""
    per_token = KVCache.bytes_per_block(cfg.num_kv_layers, 1, cfg.num_key_value_heads, cfg.head_dim, kv_dtype,
                                        cfg.cache_layer_shapes)
    return {"latent" if cfg.mla is not None else "full": per_token}


def describe_kv_bytes(cfg: ModelConfig, kv_dtype: torch.dtype) -> str:
    """kv_bytes_per_token as the start log says it, e.g. "full 9216 B/token", and a hybrid model's linear layers'
    state, which is per sequence, not per token: "full 4096 B/token, linear 81920 B/sequence"."""
    kinds = [f"{kind} {n} B/token" for kind, n in kv_bytes_per_token(cfg, kv_dtype).items()]
    if cfg.hybrid is not None:
        kinds.append(f"linear {cfg.hybrid.state_bytes} B/sequence")
    return ", ".join(kinds)
