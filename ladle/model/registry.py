"""Which forward runs a model: the Llama family's (ladle.model.llama) or a family with its own attention."""

from __future__ import annotations

from ladle.model.config import ModelConfig


def causal_lm_class(cfg: ModelConfig) -> type:
    """The class that builds cfg's model from its weights (imported only when asked for)."""
    if cfg.model_type == "deepseek_v3":
        from ladle.model.deepseek import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM
    from ladle.model.llama import LlamaForCausalLM

    return LlamaForCausalLM
