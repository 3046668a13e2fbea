"""Model hyper-parameters, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Gated DeltaNet layers beside full-attention ones: Qwen3.5 (dense and MoE) and Qwen3-Next
HYBRID_ARCHITECTURES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral", "gemma3_text",
                           "gemma4_text", "gpt_oss", *HYBRID_ARCHITECTURES)
GEMMA_ARCHITECTURES = ("gemma3_text", "gemma4_text")
MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe_text", "qwen3_next")

SHARED_EXPERT_MOE = ("qwen2_moe", "qwen3_next")  # a dense expert every token takes, sigmoid-gated

MLA_ARCHITECTURES = ("deepseek_v3",)  # multi-head latent attention (ladle.model.mla), routed experts
SUPPORTED_ARCHITECTURES += MLA_ARCHITECTURES
MOE_ARCHITECTURES += MLA_ARCHITECTURES


@dataclass
class MoEConfig:
    """A mixture-of-experts MLP: each token goes to the top k of num_experts SwiGLU experts."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool  # renormalise the k chosen probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated
    sparse_layers: frozenset[int] = frozenset()  # the layers with a MoE MLP (the others are dense)
    # gpt-oss: the router and the experts carry biases, the weights are the softmax of the top k logits,
    # and each expert's SwiGLU is clamped: (alpha, limit)
    biases: bool = False
    softmax_of_top_k: bool = False
    clamped_swiglu: tuple[float, float] | None = None
    # DeepSeek V3 ("noaux_tc"): sigmoid scores, a learned bias added to them only to choose, the top k chosen
    # within the topk_group best of n_group expert groups (a group scored by its two best), the weights
    # renormalised then times routed_scaling_factor; n_shared_experts ungated experts every token takes
    # (fused into one of shared_expert_intermediate_size)
    scoring: str = "softmax"  # or "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], model_type: str, num_layers: int) -> "MoEConfig":
        if model_type == "deepseek_v3":
            return cls._deepseek(d, num_layers)
        # transformers 5 names the count num_local_experts for Qwen3-MoE too
        num_experts = d.get("num_experts") or d["num_local_experts"]
        if model_type == "gemma4_text":  # every layer, its experts beside a dense MLP (ladle.model.moe)
            return cls(num_experts, d["top_k_experts"], d["moe_intermediate_size"], True,
                       sparse_layers=frozenset(range(num_layers)))
        if model_type == "gpt_oss":
            return cls(num_experts, d["num_experts_per_tok"], d["intermediate_size"], True,
                       sparse_layers=frozenset(range(num_layers)), biases=True, softmax_of_top_k=True,
                       clamped_swiglu=(float(d.get("swiglu_alpha", 1.702)), float(d.get("swiglu_limit", 7.0))))
        if model_type == "mixtral":
            return cls(num_experts, d["num_experts_per_tok"], d["intermediate_size"], True,
                       sparse_layers=frozenset(range(num_layers)))
        if model_type == "qwen3_5_moe_text":  # every layer routes, the top k renormalised, beside a shared expert
            return cls(num_experts, d["num_experts_per_tok"], d["moe_intermediate_size"], True,
                       d["shared_expert_intermediate_size"], frozenset(range(num_layers)))
        step = d.get("decoder_sparse_step", 1) or 1
        dense = set(d.get("mlp_only_layers") or [])
        sparse = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(num_experts, d["num_experts_per_tok"], d["moe_intermediate_size"],
                   bool(d.get("norm_topk_prob", False)),
                   d.get("shared_expert_intermediate_size", 0) if model_type in SHARED_EXPERT_MOE else 0, sparse)

    @classmethod
    def _deepseek(cls, d: dict[str, Any], num_layers: int) -> "MoEConfig":
        """DeepSeek V3's experts: its first first_k_dense_replace layers dense, the others routed."""
        if d.get("topk_method", "noaux_tc") != "noaux_tc" or d.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"DeepSeek routing {d.get('topk_method')!r} with {d.get('scoring_func')!r} scores: "
                             "ladle routes DeepSeek V3's way only (noaux_tc, sigmoid)")
        shared = int(d.get("n_shared_experts") or 0)
        return cls(d["n_routed_experts"], d["num_experts_per_tok"], d["moe_intermediate_size"],
                   bool(d.get("norm_topk_prob", True)), shared * d["moe_intermediate_size"],
                   frozenset(range(int(d.get("first_k_dense_replace") or 0), num_layers)), scoring="sigmoid",
                   n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
                   routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)), n_shared_experts=shared)


@dataclass
class MLAConfig:
    """Multi-head latent attention's shapes (DeepSeek V3, ladle.model.mla): queries through a LoRA of
    q_lora_rank (None: one projection), keys and values from a latent of kv_lora_rank per token, each
    head's key qk_nope_head_dim numbers from the latent and qk_rope_head_dim rotated ones shared by all
    heads, its value v_head_dim; rope_interleave: the rotated numbers lie in interleaved pairs."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """What the paged cache holds per token and layer, as a KVCache layer shape: one vector, the normed
        latent and the rotated shared key side by side, and no V."""
        return (1, self.kv_lora_rank + self.qk_rope_head_dim, 0)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "MLAConfig":
        q_lora_rank = d.get("q_lora_rank")
        return cls(None if q_lora_rank is None else int(q_lora_rank), d["kv_lora_rank"], d["qk_nope_head_dim"],
                   d["qk_rope_head_dim"], d["v_head_dim"], bool(d.get("rope_interleave", True)))


@dataclass
class GemmaConfig:
    """Gemma 3: embeddings scaled by sqrt(hidden), norms that multiply by (1 + weight), a norm on each
    sublayer's output too ("sandwich"), GELU (tanh) gating, q . k scaled by query_pre_attn_scalar^-0.5,
    and the sliding layers' own RoPE base.

    Gemma 4 (version 4) departs from it: its norms multiply by the weight itself, the values are normed
    (without a scale) as the keys are, q . k is not scaled (query_pre_attn_scalar 1), each layer's output
    is multiplied by its layer_scalar, the logits may be soft-capped, and the global layers' RoPE is
    "proportional" (rope_scaling). Its global layers may have wider heads and fewer KV heads
    (ModelConfig.layer_attention_shapes), and take their values from the key projection (attention_k_eq_v).
    Its last num_kv_shared_layers layers compute no K/V: each attends over those of the last earlier layer of
    its kind (kv_sources), and holds no cache of its own. Its small models add a per-layer embedding of each
    token to each layer's output (per_layer_input_size: hidden_size_per_layer_input); its 26B-A4B runs experts
    beside each layer's dense MLP (enable_moe_block: ModelConfig.moe, ladle.model.moe.Gemma4MoEBlock)."""

    query_pre_attn_scalar: float
    local_rope_theta: float
    local_rope_scaling: dict[str, Any] | None = None
    version: int = 3
    final_logit_softcapping: float | None = None  # logits become tanh(logits / cap) * cap
    full_layers: frozenset[int] | None = None  # Gemma 4: the global layers (None: those without a window)
    attention_k_eq_v: bool = False  # Gemma 4: the global layers' V is their K projection (before k_norm and RoPE)
    kv_sources: dict[int, int] = field(default_factory=dict)  # Gemma 4: shared layer -> the layer whose K/V it reads
    per_layer_input_size: int = 0  # Gemma 4: the width of each layer's per-layer embedding (0: none)

    @property
    def norm_offset(self) -> float:
        """What the norms add to their weight before multiplying: 1 for Gemma 3, 0 for Gemma 4."""
        return 1.0 if self.version == 3 else 0.0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str) -> "GemmaConfig":
        if d.get("model_type") == "gemma4_text":
            return cls._gemma4(d, name)
        for capped in ("attn_logit_softcapping", "final_logit_softcapping"):
            if d.get(capped) is not None:
                raise ValueError(f"model {name!r} sets {capped}={d[capped]} (Gemma 2's soft-capping): ladle does "
                                 "not implement it, so it refuses the model")
        if d.get("use_bidirectional_attention"):
            raise ValueError(f"model {name!r} sets use_bidirectional_attention: ladle attends causally only")
        if d.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"model {name!r}: hidden_activation {d['hidden_activation']!r} is not Gemma 3's "
                             "gelu_pytorch_tanh")
        local = (d.get("rope_parameters") or {}).get("sliding_attention")
        if local is None:  # configs before transformers 5: rope_local_base_freq, and no scaling on local layers
            local = {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", 10000.0)}
        return cls(float(d.get("query_pre_attn_scalar", 256)), float(local["rope_theta"]), _rope_scaling(local))

    @classmethod
    def _gemma4(cls, d: dict[str, Any], name: str) -> "GemmaConfig":
        """d: a Gemma 4 text config completed by gemma4_text_config."""
        # "vision" lets image tokens see each other: text alone attends causally, as transformers masks it
        if d.get("use_bidirectional_attention") == "all":
            raise ValueError(f"model {name!r} sets use_bidirectional_attention='all': ladle attends causally only")
        if d.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"model {name!r}: hidden_activation {d['hidden_activation']!r} is not Gemma 4's "
                             "gelu_pytorch_tanh")
        local = d["rope_parameters"]["sliding_attention"]
        cap = d.get("final_logit_softcapping")
        full = frozenset(i for i, kind in enumerate(d["layer_types"]) if kind == "full_attention")
        return cls(1.0, float(local["rope_theta"]), _rope_scaling(local), version=4,
                   final_logit_softcapping=None if cap is None else float(cap), full_layers=full,
                   attention_k_eq_v=bool(d.get("attention_k_eq_v")), kv_sources=_gemma4_kv_sources(d, name),
                   per_layer_input_size=int(d.get("hidden_size_per_layer_input") or 0))


def gemma3_text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a Gemma 3 image-and-text checkpoint, its defaults filled in as
    transformers fills them (the Hub's configs name only what differs from Gemma3TextConfig's)."""
    from transformers import Gemma3TextConfig

    text = Gemma3TextConfig(**{k: v for k, v in d.get("text_config", {}).items() if k != "model_type"}).to_dict()
    return {**text, "model_type": "gemma3_text"}


def _gemma4_kv_sources(d: dict[str, Any], name: str) -> dict[int, int]:
    """Gemma 4's KV sharing, as transformers' kv_sharing_modes reads it: each of the last num_kv_shared_layers
    layers reads the K/V of the last layer before them of its kind."""
    kinds, shared = d["layer_types"], d.get("num_kv_shared_layers") or 0
    first = len(kinds) - shared
    sources = {}
    for layer in range(first, len(kinds)):
        earlier = [i for i in range(first) if kinds[i] == kinds[layer]]
        if not earlier:
            raise ValueError(f"model {name!r}: num_kv_shared_layers={shared} leaves no earlier {kinds[layer]} layer "
                             f"to share its K/V with layer {layer}")
        sources[layer] = earlier[-1]
    return sources


def gemma4_text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 4 language model's config (a gemma4_text config, or a gemma4 image-and-text config's
    text_config), its defaults filled in as transformers' Gemma4TextConfig fills them: the layers'
    kinds, the RoPE of each kind, and each layer's attention shape (per_layer_config, which the Hub's
    configs give as global_head_dim and num_global_key_value_heads)."""
    from transformers import Gemma4TextConfig

    text = d.get("text_config", {}) if d.get("model_type") == "gemma4" else d
    resolved = Gemma4TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    shapes = [(layer.num_key_value_heads, layer.head_dim) for layer in resolved.per_layer_config]
    return {**resolved.to_dict(), "model_type": "gemma4_text", "layer_attention_shapes": shapes}


def gemma4_layer_shapes(d: dict[str, Any]) -> list[tuple[int, int]]:
    """Each layer's (num_key_value_heads, head_dim) in a config from gemma4_text_config."""
    return [tuple(shape) for shape in d["layer_attention_shapes"]]


def rope_type(scaling: dict[str, Any] | None) -> str:
    """A rope_scaling dict's kind ("type" in older configs); "default" for none."""
    return "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))


def _rope_scaling(rope: dict[str, Any] | None) -> dict[str, Any] | None:
    """A rope_scaling dict, None for plain RoPE."""
    return None if rope_type(rope) == "default" else rope


@dataclass
class HybridConfig:
    """Qwen3.5's and Qwen3-Next's departures from Llama: most layers are Gated DeltaNet (linear attention,
    ladle.model.gated_delta) with a fixed-size state per sequence; the rest attend over the whole context
    with an output gate (q_proj doubled: each head's query, then its gate) and rotate only the first
    rotary_dim numbers of each head. Their norms multiply by (1 + weight)."""

    linear_layers: frozenset[int]
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    rotary_dim: int
    fused_projections: bool = False  # Qwen3-Next: in_proj_qkvz and in_proj_ba, grouped by key head

    @property
    def conv_channels(self) -> int:
        """The short convolution's channels: q, k and v side by side."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def state_bytes(self) -> int:
        """One sequence's state over every linear layer: the convolution's last inputs and the delta rule's
        matrices, float32."""
        per_layer = self.conv_channels * (self.conv_kernel - 1) + self.value_heads * self.key_dim * self.value_dim
        return 4 * per_layer * len(self.linear_layers)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], model_type: str, head_dim: int) -> "HybridConfig":
        kinds = d.get("layer_types") or [
            "full_attention" if (i + 1) % d.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(d["num_hidden_layers"])]
        rope = d.get("rope_parameters") or {}
        factor = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
        return cls(frozenset(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
                   d["linear_num_key_heads"], d["linear_num_value_heads"], d["linear_key_head_dim"],
                   d["linear_value_head_dim"], d["linear_conv_kernel_dim"], int(head_dim * factor),
                   fused_projections=model_type == "qwen3_next")


def hybrid_text_config(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's image-and-text checkpoints (qwen3_5, qwen3_5_moe): their language model's config."""
    return {**d.get("text_config", {}), "model_type": d["model_type"] + "_text"}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q, k and v projections
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k
    o_proj_bias: bool = False  # gpt-oss: a bias on the attention's output projection too
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    moe: MoEConfig | None = None  # Qwen2-MoE, Qwen3-MoE, Mixtral
    # each layer's sliding window (it attends to the last `window` positions), None where it sees the whole
    # context; empty: no layer has one
    layer_windows: tuple[int | None, ...] = ()
    gemma: GemmaConfig | None = None  # Gemma 3's and 4's departures from Llama
    # each layer's (num_key_value_heads, head_dim) where they differ by layer (Gemma 4's global layers);
    # empty: every layer has the model's
    layer_attention_shapes: tuple[tuple[int, int], ...] = ()
    mla: MLAConfig | None = None  # DeepSeek V3: multi-head latent attention, a latent vector cached per token
    hybrid: HybridConfig | None = None  # Qwen3.5, Qwen3-Next: linear-attention layers beside full ones
    # Qwen2.5-VL's M-RoPE: how many of each head's rotary frequencies turn with a token's time, row and
    # column position (an image's tokens have their own rows and columns); empty: plain RoPE
    mrope_section: tuple[int, ...] = ()

    @property
    def norm_offset(self) -> float:
        """What the RMSNorms add to their weight before multiplying (Gemma 3's, Qwen3.5's: 1)."""
        if self.gemma is not None:
            return self.gemma.norm_offset
        return 1.0 if self.hybrid is not None else 0.0

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V in the paged cache, in cache order (a hybrid's full-attention ones)."""
        layers = range(self.num_kv_layers) if self.hybrid is None else range(self.num_hidden_layers)
        return tuple(i for i in layers if self.hybrid is None or i not in self.hybrid.linear_layers)

    @property
    def num_kv_layers(self) -> int:
        """How many layers hold K/V in the cache: the first ones (Gemma 4's KV-shared layers, last, hold none)."""
        if self.hybrid is not None:
            return self.num_hidden_layers - len(self.hybrid.linear_layers)
        return self.num_hidden_layers - (len(self.gemma.kv_sources) if self.gemma is not None else 0)

    @property
    def cache_layer_shapes(self) -> tuple[tuple[int, int], ...]:
        """The cache's layers' (num_key_value_heads, head_dim) where they differ by layer; empty: one shape.
        MLA's layers hold a latent vector per token and no V (MLAConfig.cache_shape)."""
        if self.mla is not None:
            return (self.mla.cache_shape,) * self.num_kv_layers
        return self.layer_attention_shapes[: self.num_kv_layers]

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """Layer's (num_key_value_heads, head_dim)."""
        if self.layer_attention_shapes:
            return self.layer_attention_shapes[layer]
        return self.num_key_value_heads, self.head_dim

    @property
    def kv_window(self) -> int | None:
        """How far back any layer reads the K/V cache when every layer has a sliding window (the
        largest window); None when some layer sees the whole context."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(self.layer_windows)

    @property
    def attention_scale(self) -> float:
        """What q . k is multiplied by before the softmax."""
        return (self.gemma.query_pre_attn_scalar if self.gemma else self.head_dim) ** -0.5

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str | None = None) -> "ModelConfig":
        """`name` (the model's folder, say) only labels errors."""
        if d.get("model_type") == "gemma3":  # Gemma 3's image-and-text checkpoints: their language model
            d = gemma3_text_config(d)
        elif d.get("model_type") in ("gemma4", "gemma4_text"):  # and Gemma 4's, or its text-only model
            d = gemma4_text_config(d)
        elif d.get("model_type") in ("qwen3_5", "qwen3_5_moe"):
            d = hybrid_text_config(d)
        elif d.get("model_type") in ("idefics3", "smolvlm"):  # SmolVLM: a Llama beside the vision tower
            d = {"model_type": "llama", **d["text_config"]}
        elif d.get("model_type") == "qwen2_5_vl":  # a Qwen2 whose rotary positions are M-RoPE's
            d = {**d["text_config"], "model_type": "qwen2",
                 "mrope_section": (d["text_config"].get("rope_parameters") or {}).get("mrope_section")}
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; ladle runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        max_positions = d.get("max_position_embeddings", 4096)
        windows = _layer_windows(d, model_type, d["num_hidden_layers"])
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        # transformers >= 5 nests rope settings under rope_parameters (by layer type where types differ)
        rope = dict(d.get("rope_parameters") or {})
        rope = dict(rope.get("full_attention", rope))
        rope_theta = float(d.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = _rope_scaling(d.get("rope_scaling") or rope)
        if rope_type(scaling) == "yarn":
            # the context the model was trained on: the config's own field first, as transformers reads it
            original = d.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
            original = original or max_positions
            scaling = {**scaling, "original_max_position_embeddings": original,
                       "factor": scaling.get("factor") or max_positions / original}
        gemma = GemmaConfig.from_hf_dict(d, name or model_type) if model_type in GEMMA_ARCHITECTURES else None
        kv_heads, head_dim = d.get("num_key_value_heads") or heads, d.get("head_dim") or d["hidden_size"] // heads
        shapes = tuple(gemma4_layer_shapes(d)) if model_type == "gemma4_text" else ()
        if len(set(shapes)) == 1:  # one shape for every layer (global or sliding alike): the model's
            (kv_heads, head_dim), shapes = shapes[0], ()
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or 0,  # Qwen3.5-MoE has no dense MLP
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", d.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
            qk_norm=model_type in ("qwen3", "qwen3_moe", *GEMMA_ARCHITECTURES, *HYBRID_ARCHITECTURES),
            o_proj_bias=(model_type == "gpt_oss" and bool(d.get("attention_bias", True)))
            or (model_type == "gemma4_text" and bool(d.get("attention_bias"))),
            attention_sinks=model_type == "gpt_oss",
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            moe=MoEConfig.from_hf_dict(d, model_type, d["num_hidden_layers"])
            if model_type in MOE_ARCHITECTURES or (model_type == "gemma4_text" and d.get("enable_moe_block")) else None,
            # a window as long as the longest context changes nothing
            layer_windows=windows if any(w is not None and w < max_positions for w in windows) else (),
            gemma=gemma,
            layer_attention_shapes=shapes,
            mla=MLAConfig.from_hf_dict(d) if model_type in MLA_ARCHITECTURES else None,
            hybrid=HybridConfig.from_hf_dict(d, model_type, head_dim) if model_type in HYBRID_ARCHITECTURES else None,
            mrope_section=tuple(d.get("mrope_section") or ()),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads((Path(folder) / "config.json").read_text()), name=str(folder))


def _layer_windows(d: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers reads the config (None: the whole context)."""
    window = d.get("sliding_window")
    if window is None or model_type == "llama":  # transformers' Llama has no window, whatever the config says
        return ()
    layer_types = d.get("layer_types")
    if model_type.startswith("qwen"):
        # Qwen configs carry a sliding_window that only applies with use_sliding_window, and then only to
        # the layers that layer_types marks (by default those from max_window_layers on)
        if not d.get("use_sliding_window", False):
            return ()
        if layer_types is None:
            layer_types = ["sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
                           for i in range(num_layers)]
    elif model_type in ("mistral", "mixtral"):  # transformers' Mistral and Mixtral window every layer
        layer_types = ["sliding_attention"] * num_layers
    elif model_type == "gemma3_text" and layer_types is None:  # every sliding_window_pattern-th layer is global
        pattern = d.get("sliding_window_pattern", 6)
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if layer_types is None:
        raise ValueError(f"sliding_window={window} on a {model_type} model: ladle does not know which layers it "
                         "applies to")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
