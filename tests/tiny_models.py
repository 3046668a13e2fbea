"""Tiny random Llama, Qwen2, Qwen3, Mistral, Gemma 3 and mixture-of-experts (Qwen2-MoE, Qwen3-MoE,
Mixtral) checkpoints, built and saved by transformers for the tests."""

from __future__ import annotations

from pathlib import Path

import torch

SMOLLM2_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_model(kind: str, out: Path, tokenizer_from: Path, seed: int = 0, **config_overrides) -> Path:
    """Save a small random model of `kind` ("llama", "llama3-rope", "qwen2", "qwen3", "mistral", "gemma3",
    "gemma3-vision", "gemma4", "qwen2_moe", "qwen3_moe", "mixtral" or "gpt_oss")
    with a real tokenizer; `config_overrides` go to the transformers config.

    Weights are drawn with a wide init so next-token logits are peaked: greedy
    comparisons against transformers then test the maths, not float ties.
    """
    import shutil

    from transformers import (
        Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
        Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM,
        Qwen3MoeConfig, Qwen3MoeForCausalLM,
    )

    vocab = 49152  # the SmolLM2 tokenizer's
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    common.update(config_overrides)
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    elif kind == "llama3-rope":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random qkv biases, so the bias path is exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "qwen3":
        # head_dim 32 with 4 heads: q is wider than the hidden size, as in the real Qwen3s
        cfg = Qwen3Config(**{"head_dim": 32, **common}, rope_theta=1000000.0, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(cfg)
        with torch.no_grad():  # per-channel q/k norm weights far from 1, so a skipped or misapplied norm shows
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.25, 2.5)
    elif kind == "mistral":
        cfg = MistralConfig(**{"sliding_window": None, **common}, rope_theta=1000000.0, tie_word_embeddings=False)
        model = MistralForCausalLM(cfg)
    elif kind in ("gemma3", "gemma3-vision"):
        # windowed and global layers alternating, each kind with its RoPE base; q . k scaled by
        # query_pre_attn_scalar^-0.5 (24, not head_dim 32), so a missed Gemma departure shows
        cfg = Gemma3TextConfig(**{"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
                                  "sliding_window_pattern": 2, **common,
                                  "num_hidden_layers": config_overrides.get("num_hidden_layers", 4)})
        if kind == "gemma3":
            model = Gemma3ForCausalLM(cfg)
        else:  # the image-and-text checkpoint: a small SigLIP tower and its projector beside the same language model
            from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

            vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=28, patch_size=14)
            both = Gemma3Config(text_config=cfg.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
            model = Gemma3ForConditionalGeneration(both)
        with torch.no_grad():  # norm weights start at 0 (a scale of 1 + 0): spread them, so a missed +1 shows
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.6, 0.6)
    elif kind == "gemma4":
        model = _tiny_gemma4(common, config_overrides)
    elif kind == "gpt_oss":
        # windowed and global layers alternating, 4 experts (top 2) with biases and the clamped SwiGLU,
        # YaRN over a trained context of 64 positions, and a sink per head
        yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 150000.0}
        cfg = GptOssConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                              "rope_parameters": yarn, **common,
                              "intermediate_size": config_overrides.get("intermediate_size", 32),
                              "num_hidden_layers": config_overrides.get("num_hidden_layers", 4)})
        model = GptOssForCausalLM(cfg)
        with torch.no_grad():  # biases start at 0: draw them (and the sinks) so that each one shows
            for name, param in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    param.normal_(0, 1.5 if name.endswith("sinks") else 0.5)
    elif kind == "qwen2_moe":  # 8 experts, top 2, a shared expert; layer 1 dense (mlp_only_layers)
        cfg = Qwen2MoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 64, "mlp_only_layers": [1], **common},
                             rope_theta=1000000.0, tie_word_embeddings=True)
        model = Qwen2MoeForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "qwen3_moe":  # top-k renormalised, q/k norms
        cfg = Qwen3MoeConfig(**{"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True, **common},
                             rope_theta=1000000.0, tie_word_embeddings=True)
        model = Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.25, 2.5)
    elif kind == "mixtral":
        cfg = MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None, **common},
                            rope_theta=1000000.0, tie_word_embeddings=False)
        model = MixtralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    if kind.endswith("moe") or kind in ("mixtral", "gpt_oss"):
        _spread_router(model)
    model.save_pretrained(out)
    for name in SMOLLM2_TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def _tiny_gemma4(common: dict, overrides: dict):
    """A Gemma 4 text model: windowed and global layers alternating (the global ones with proportional RoPE),
    logits soft-capped, norm weights spread around 1 (Gemma 4 multiplies by the weight, not 1 + weight) and
    each layer's output scalar drawn, so that each departure from Gemma 3 shows."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    defaults = {"head_dim": 32, "global_head_dim": 32, "sliding_window": 8, "final_logit_softcapping": 30.0,
                "hidden_size_per_layer_input": 0, "num_hidden_layers": 4,
                "layer_types": ["sliding_attention", "full_attention"] * (overrides.get("num_hidden_layers", 4) // 2)}
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**common, **defaults, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.4, 1.6)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    return model


def _spread_router(model) -> None:
    """Router weights drawn wide, so top-k choices are not near ties that the last bit decides."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            routes = name.endswith(("gate.weight", "router.weight")) and "shared_expert_gate" not in name
            if routes and param.dim() == 2:
                param.normal_(0, 1.0)
