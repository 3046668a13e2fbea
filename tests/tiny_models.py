"""Tiny random Llama and Qwen2 checkpoints, built and saved by transformers for the tests."""

from __future__ import annotations

from pathlib import Path

import torch

SMOLLM2_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_model(kind: str, out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Save a small random model of `kind` ("llama" or "qwen2") with a real tokenizer.

    Weights are drawn with a wide init so next-token logits are peaked: greedy
    comparisons against transformers then test the maths, not float ties.
    """
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = 49152  # the SmolLM2 tokenizer's
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
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
    else:
        raise ValueError(kind)
    model.save_pretrained(out)
    for name in SMOLLM2_TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out
