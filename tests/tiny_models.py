"""Tiny random Llama, Qwen2, Qwen3, Mistral, Gemma 3 and mixture-of-experts (Qwen2-MoE, Qwen3-MoE,
Mixtral, gpt-oss) checkpoints, built and saved by transformers for the tests. They speak SmolLM2's
tokenizer; gpt-oss's has harmony's special tokens added and a harmony chat template (written here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SMOLLM2_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SMOLLM2_VOCAB = 49152
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
HARMONY_VOCAB = SMOLLM2_VOCAB + len(HARMONY_TOKENS)  # the added tokens take the next ids, in this order
# gpt-oss's chat template in shape: the system message with the reasoning effort, a developer message
# with the instructions and the tools as a TypeScript namespace, the turns (a call as a message to
# functions.NAME, its result as that function's message), and the assistant's open header
HARMONY_TEMPLATE = """
{%- macro ts_type(s) -%}
  {%- if s.enum -%}{{ s.enum | map("tojson") | join(" | ") }}
  {%- elif s.type == "string" -%}string
  {%- elif s.type in ("integer", "number") -%}number
  {%- elif s.type == "boolean" -%}boolean
  {%- elif s.type == "array" -%}{{ ts_type(s["items"] or {}) }}[]
  {%- else -%}any
  {%- endif -%}
{%- endmacro -%}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n" -}}
{{- "Knowledge cutoff: 2024-06\n\nReasoning: " + (reasoning_effort or "medium") + "\n\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- "<|end|>" -}}
{%- set instructions = messages[0].content if messages[0].role in ("system", "developer") else "" -%}
{%- if instructions or tools -%}
  {{- "<|start|>developer<|message|>" -}}
  {%- if instructions -%}{{- "# Instructions\n\n" + instructions + "\n\n" -}}{%- endif -%}
  {%- if tools -%}
    {{- "# Tools\n\n## functions\n\nnamespace functions {\n\n" -}}
    {%- for tool in tools -%}
      {%- set f = tool.function -%}
      {%- set schema = f.parameters or {} -%}
      {%- if f.description -%}{{- "// " + f.description + "\n" -}}{%- endif -%}
      {%- if schema.properties -%}
        {{- "type " + f.name + " = (_: {\n" -}}
        {%- for name, spec in schema.properties.items() -%}
          {%- if spec.description -%}{{- "// " + spec.description + "\n" -}}{%- endif -%}
          {{- name + ("" if name in (schema.required or []) else "?") + ": " + ts_type(spec) + ",\n" -}}
        {%- endfor -%}
        {{- "}) => any;\n\n" -}}
      {%- else -%}
        {{- "type " + f.name + " = () => any;\n\n" -}}
      {%- endif -%}
    {%- endfor -%}
    {{- "} // namespace functions" -}}
  {%- endif -%}
  {{- "<|end|>" -}}
{%- endif -%}
{%- set last_call = namespace(name="") -%}
{%- for m in messages if m.role not in ("system", "developer") -%}
  {%- if m.role == "user" -%}
    {{- "<|start|>user<|message|>" + m.content + "<|end|>" -}}
  {%- elif m.role == "tool" -%}
    {{- "<|start|>functions." + last_call.name + " to=assistant<|channel|>commentary<|message|>" -}}
    {{- m.content + "<|end|>" -}}
  {%- elif m.tool_calls -%}
    {%- if m.thinking -%}
      {{- "<|start|>assistant<|channel|>analysis<|message|>" + m.thinking + "<|end|>" -}}
    {%- endif -%}
    {%- for call in m.tool_calls -%}
      {%- set last_call.name = call.function.name -%}
      {{- "<|start|>assistant to=functions." + call.function.name + "<|channel|>commentary json<|message|>" -}}
      {{- call.function.arguments | tojson + "<|call|>" -}}
    {%- endfor -%}
  {%- else -%}
    {{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}
"""


def build_tiny_model(kind: str, out: Path, tokenizer_from: Path, seed: int = 0, **config_overrides) -> Path:
    """Save a small random model of `kind` ("llama", "llama3-rope", "qwen2", "qwen3", "mistral", "gemma3",
    "gemma3-vision", "gemma4", "gemma4-vision", "qwen2_moe", "qwen3_moe", "mixtral" or "gpt_oss")
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
    elif kind in ("gemma4", "gemma4-vision"):
        model = _tiny_gemma4(common, config_overrides, with_vision=kind == "gemma4-vision")
    elif kind == "gpt_oss":
        # windowed and global layers alternating, 4 experts (top 2) with biases and the clamped SwiGLU,
        # YaRN over a trained context of 64 positions, and a sink per head
        yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 150000.0}
        # its vocabulary holds harmony's tokens, and its replies stop at <|return|> or <|call|>
        cfg = GptOssConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                              "rope_parameters": yarn, **common,
                              "vocab_size": config_overrides.get("vocab_size", HARMONY_VOCAB),
                              "eos_token_id": [harmony_id("<|return|>"), harmony_id("<|call|>")],
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
    elif kind in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        model = _tiny_hybrid(kind, common, config_overrides)
    else:
        raise ValueError(kind)
    if kind.endswith("moe") or kind in ("mixtral", "gpt_oss", "qwen3_next"):
        _spread_router(model)
    model.save_pretrained(out)
    if kind == "gpt_oss":
        _save_harmony_tokenizer(tokenizer_from, out)
        return out
    for name in SMOLLM2_TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def _tiny_hybrid(kind: str, common: dict, overrides: dict):
    """Qwen3.5 (dense or MoE) or Qwen3-Next: Gated DeltaNet layers (2 key heads, 4 value heads of 16, a
    kernel of 4) and full-attention layers alternating, heads of 32 of which 8 rotate, every norm's weight
    spread around its centre (0: Qwen3.5 multiplies by 1 + weight) so a missed offset shows. The MoE ones
    route to 2 of 8 experts beside a gated shared expert."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    layers = overrides.get("num_hidden_layers", 4)
    hybrid = {"num_hidden_layers": layers, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
              "layer_types": ["linear_attention", "full_attention"] * (layers // 2),
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 48}
    config = {**common, **hybrid, **(moe if kind != "qwen3_5" else {}), **overrides}
    if kind == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config))
    elif kind == "qwen3_5_moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config))
    else:
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**{"norm_topk_prob": True, **config}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                param.uniform_(-0.6, 0.6)
            elif name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("dt_bias"):
                param.normal_(0, 1.0)
    return model


def _tiny_gemma4(common: dict, overrides: dict, with_vision: bool = False):
    """A Gemma 4 text model: windowed and global layers alternating, the global ones with proportional RoPE,
    wider heads, one KV head and their values taken from the keys (attention_k_eq_v); the last two layers
    reading the K/V of the two before them (num_kv_shared_layers), with MLPs twice as wide; a per-layer
    embedding of 16 per token and layer (hidden_size_per_layer_input, as the E2B and E4B); logits
    soft-capped, norm weights spread around 1 (Gemma 4 multiplies by the weight, not 1 + weight) and each
    layer's output scalar drawn, so that each departure from Gemma 3 shows. with_vision: the image-and-text
    checkpoint, a small vision tower and its projector beside the same language model. With enable_moe_block
    (and num_experts, top_k_experts, moe_intermediate_size) its router and scales are drawn wide too."""
    from transformers import (
        Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig,
    )

    defaults = {"head_dim": 32, "global_head_dim": 64, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
                "sliding_window": 8, "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 16,
                "vocab_size_per_layer_input": common["vocab_size"],
                "num_hidden_layers": 6, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                "layer_types": ["sliding_attention", "full_attention"] * (overrides.get("num_hidden_layers", 6) // 2)}
    text = Gemma4TextConfig(**{**common, **defaults, **overrides})
    if with_vision:
        vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=16)
        model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                            audio_config=None))
    else:
        model = Gemma4ForCausalLM(text)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("router.scale", "per_expert_scale")):
                param.uniform_(0.4, 1.6)
            elif name.endswith("router.proj.weight"):
                param.normal_(0, 1.0)
        for layer in (model.model.language_model if with_vision else model.model).layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    return model


def harmony_id(token: str) -> int:
    """The id of one of harmony's tokens in the tiny gpt-oss's tokenizer."""
    return SMOLLM2_VOCAB + HARMONY_TOKENS.index(token)


def _save_harmony_tokenizer(tokenizer_from: Path, out: Path) -> None:
    """SmolLM2's tokenizer with harmony's special tokens added, and the harmony chat template."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_from / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == HARMONY_VOCAB
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
              "unk_token": "<|endoftext|>", "model_max_length": 2048}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "chat_template.jinja").write_text(HARMONY_TEMPLATE.strip() + "\n")


def _spread_router(model) -> None:
    """Router weights drawn wide, so top-k choices are not near ties that the last bit decides."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            routes = name.endswith(("gate.weight", "router.weight")) and "shared_expert_gate" not in name
            if routes and param.dim() == 2:
                param.normal_(0, 1.0)


def transformers_on(folder: Path, weights: dict[str, torch.Tensor]):
    """transformers' float32 model of the checkpoint in `folder`, its weights replaced by `weights` (HF names):
    the reference for a quantised checkpoint, run on the weights it dequantises to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    return model
