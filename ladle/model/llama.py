"""The Llama family forward (Llama, SmolLM2, Qwen2/2.5, Qwen3, Mistral, Gemma 3 and 4, and the MoE ones:
Qwen2-MoE, Qwen3-MoE, Mixtral) over a flat, packed token batch.

Tokens of all sequences in a step are concatenated into one [T, hidden] matrix, so the
linear layers never see padding; only attention needs to know where sequences begin.
A tensor-parallel rank builds the same model from its shard of the weights (its heads, its
share of each MLP, its rows of the vocabulary) and reduces the row-parallel outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ladle.config import QUANTIZATIONS
from ladle.model import kernels
from ladle.model.attention import AttentionBackend, AttentionMetadata
from ladle.model.collectives import Single
from ladle.model.config import ModelConfig
from ladle.model.decode_loop import DecodeLoop, plain_layers
from ladle.model.decode_loop import enabled as decode_loop_enabled
from ladle.model.kernels.routing import MatmulRouting, choose_routing, forced_routing
from ladle.model.layers import Linear, RotaryEmbedding
from ladle.model.linear_attention import LinearAttentionLayer, LinearStatePool, load_linear_attention
from ladle.model.moe import MoEBlock, load_gemma4_moe_block, load_moe_block
from ladle.model.ops import TORCH_OPS, LayerOps
from ladle.model.quantization import GroupedWeight, cat_weights, choose_prefill_route, dense, make_linear
from ladle.model.sharding import Shard, head_rows, padded_spans

if TYPE_CHECKING:
    from ladle.lora.slots import LoRABatch


@dataclass
class DecoderLayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # q, k and v projections fused: hidden -> (H + 2*KVH) * D
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Linear
    post_attn_norm: torch.Tensor
    gate_up: Linear | None  # gate and up projections fused: hidden -> 2 * intermediate (dense layers)
    down: Linear | None
    moe: MoEBlock | None = None  # the MLP of a mixture-of-experts layer (Gemma 4: beside the dense one)
    # Gemma 4's MoE layers: the norms of the dense MLP's and the experts' outputs, before they are summed
    dense_out_norm: torch.Tensor | None = None
    experts_out_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma: norms on the attention's and the MLP's outputs
    mlp_out_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # gpt-oss: float32 [heads], a logit per head in the softmax's denominator
    v_norm: torch.Tensor | None = None  # Gemma 4: the values normed per head, without a scale (ones)
    k_eq_v: bool = False  # Gemma 4's global layers: qkv holds q and k only, V is the K projection
    kv_source: int | None = None  # Gemma 4's KV-shared layers: qkv holds q only, K/V are this layer's
    # Gemma 4's per-layer inputs: hidden -> per-layer width, gated by the layer's input, back to hidden, normed
    per_layer_gate: Linear | None = None
    per_layer_projection: Linear | None = None
    per_layer_norm: torch.Tensor | None = None
    layer_scalar: torch.Tensor | None = None  # Gemma 4: multiplies the residual stream after the layer
    attn_gate: bool = False  # Qwen3.5: qkv also holds an output gate per head, after v
    linear_attn: LinearAttentionLayer | None = None  # Qwen3.5's Gated DeltaNet layers, in place of attention

    @property
    def linears(self) -> tuple[Linear, ...]:
        mlp = (tuple(self.moe.linears) if self.moe is not None else ()) + \
            ((self.gate_up, self.down) if self.gate_up is not None else ())
        per_layer = (self.per_layer_gate, self.per_layer_projection) if self.per_layer_gate is not None else ()
        mixer = self.linear_attn.linears if self.linear_attn is not None else (self.qkv, self.o_proj)
        return mixer + mlp + per_layer


def _layer_weights(w: dict[str, torch.Tensor | GroupedWeight], i: int, cfg: ModelConfig, shard: Shard,
                   linear: Callable[[torch.Tensor | GroupedWeight, torch.Tensor | None], Linear],
                   cat: Callable[[list], torch.Tensor | GroupedWeight], comm: object) -> DecoderLayerWeights:
    """Layer i's weights (this rank's shard of them), taken out of w."""
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    kv_heads, d = cfg.attention_shape(i)
    spans = {"q": head_rows(shard, cfg.num_attention_heads, d), "k": head_rows(shard, kv_heads, d),
             "v": head_rows(shard, kv_heads, d)}
    gemma = cfg.gemma is not None  # its post_attention_layernorm norms the attention's output
    gemma4 = gemma and cfg.gemma.version == 4
    k_eq_v = gemma4 and cfg.gemma.attention_k_eq_v and i in cfg.gemma.full_layers
    kv_source = cfg.gemma.kv_sources.get(i) if gemma4 else None
    projections = "q" if kv_source is not None else "qk" if k_eq_v else "qkv"
    hybrid = cfg.hybrid
    linear_attn = None
    if hybrid is not None and i in hybrid.linear_layers:
        index = sorted(hybrid.linear_layers).index(i)
        linear_attn = load_linear_attention(w, i, index, hybrid, cfg.rms_norm_eps, linear)
    elif hybrid is not None:  # each head's query rows, then its gate's: the gates go after v
        # an FP8 checkpoint's in float32 (exact): the fused q/k/v/g below takes the compute dtype
        q_and_gate = dense(w.pop(attn + "q_proj.weight"), torch.float32).view(cfg.num_attention_heads, 2, d, -1)
        w[attn + "q_proj.weight"] = q_and_gate[:, 0].reshape(-1, q_and_gate.shape[-1])
        w[attn + "g_proj.weight"] = q_and_gate[:, 1].reshape(-1, q_and_gate.shape[-1])
        projections += "g"
        spans["g"] = spans["q"]
    bias = None
    if cfg.attention_bias:
        bias = torch.cat([shard.rows(w.pop(attn + f"{n}_proj.bias"), spans[n]) for n in projections])
    moe = None
    if cfg.moe and i in cfg.moe.sparse_layers and gemma4:
        moe = load_gemma4_moe_block(w, i, cfg, linear)
    elif cfg.moe and i in cfg.moe.sparse_layers:
        moe = load_moe_block(w, i, cfg, shard, linear, cat, comm)
    gate_up = down = None
    if moe is None or gemma4:  # Gemma 4 runs its experts beside the dense MLP
        gate, up = shard.column_parallel([w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")])
        down_w = w.pop(p + "mlp.down_proj.weight")
        gate_up, down = linear(cat([gate, up]), None), linear(shard.columns(down_w, shard.span(down_w.shape[1])), None)

    def norm(name: str) -> torch.Tensor:
        return _norm_weight(w.pop(name), cfg)

    if linear_attn is not None:
        return DecoderLayerWeights(input_norm=norm(p + "input_layernorm.weight"), qkv=None, q_norm=None, k_norm=None,
                                   o_proj=None, post_attn_norm=norm(p + "post_attention_layernorm.weight"),
                                   gate_up=gate_up, down=down, moe=moe, linear_attn=linear_attn)
    o_proj = w.pop(attn + "o_proj.weight")

    per_layer = gemma4 and cfg.gemma.per_layer_input_size > 0
    return DecoderLayerWeights(
        input_norm=norm(p + "input_layernorm.weight"),
        qkv=linear(cat([shard.rows(w.pop(attn + f"{n}_proj.weight"), spans[n]) for n in projections]), bias),
        q_norm=norm(attn + "q_norm.weight") if cfg.qk_norm else None,
        k_norm=norm(attn + "k_norm.weight") if cfg.qk_norm and kv_source is None else None,
        o_proj=linear(shard.columns(o_proj, spans["q"]),
                      shard.row_parallel_bias(w.pop(attn + "o_proj.bias")) if cfg.o_proj_bias else None),
        post_attn_norm=norm(p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")),
        gate_up=gate_up, down=down, moe=moe,
        attn_out_norm=norm(p + "post_attention_layernorm.weight") if gemma else None,
        mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
        sinks=shard.rows(w.pop(attn + "sinks"), shard.span(cfg.num_attention_heads)).float().contiguous()
        if cfg.attention_sinks else None,
        v_norm=torch.ones(d, device=o_proj.device) if gemma4 else None, k_eq_v=k_eq_v, kv_source=kv_source,
        layer_scalar=w.pop(p + "layer_scalar").to(o_proj.dtype) if gemma4 else None,
        per_layer_gate=linear(w.pop(p + "per_layer_input_gate.weight"), None) if per_layer else None,
        per_layer_projection=linear(w.pop(p + "per_layer_projection.weight"), None) if per_layer else None,
        per_layer_norm=norm(p + "post_per_layer_input_norm.weight") if per_layer else None,
        attn_gate=hybrid is not None,
        dense_out_norm=norm(p + "post_feedforward_layernorm_1.weight") if gemma4 and moe else None,
        experts_out_norm=norm(p + "post_feedforward_layernorm_2.weight") if gemma4 and moe else None,
    )


def _norm_weight(weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """An RMSNorm's scale as ladle multiplies by it: Gemma's and Qwen3.5's norms multiply by (1 + weight)
    (Gemma 3, Qwen3.5) or by weight (Gemma 4), kept in float32, where transformers multiplies before
    rounding to the compute dtype (layers.rms_norm)."""
    return cfg.norm_offset + weight.float() if cfg.gemma is not None or cfg.hybrid is not None else weight


@dataclass
class PerLayerInputs:
    """Gemma 4's per-layer embeddings (its E2B and E4B): each token gets a small vector per layer, the sum of
    its row of a second embedding table and a projection of its (scaled) embedding, which each layer gates
    and adds to its output."""

    embed: torch.Tensor  # [vocab, layers * width]
    embed_scale: torch.Tensor  # sqrt(width), rounded to the dtype as transformers rounds it
    projection: Linear  # hidden -> layers * width
    norm: torch.Tensor  # over each layer's width, after the projection
    num_layers: int
    width: int
    eps: float
    hidden_size: int

    @classmethod
    def of(cls, w: dict[str, torch.Tensor], cfg: ModelConfig, linear: Callable) -> "PerLayerInputs":
        embed = w.pop("model.embed_tokens_per_layer.weight")
        width = cfg.gemma.per_layer_input_size
        return cls(embed, torch.tensor(width**0.5).to(embed.dtype),
                   linear(w.pop("model.per_layer_model_projection.weight"), None),
                   _norm_weight(w.pop("model.per_layer_projection_norm.weight"), cfg), cfg.num_hidden_layers, width,
                   cfg.rms_norm_eps, cfg.hidden_size)

    def __call__(self, input_ids: torch.Tensor, embedded: torch.Tensor, inv: bool, ops: LayerOps) -> torch.Tensor:
        """[T, layers, width]: each token's input to each layer, from its id and its scaled embedding."""
        shape = (input_ids.shape[0], self.num_layers, self.width)
        from_ids = (F.embedding(input_ids, self.embed) * self.embed_scale).view(shape)
        projected = (self.projection(embedded, inv) * self.hidden_size**-0.5).view(shape)
        return (ops.rms_norm(projected, self.norm, self.eps) + from_ids) * 2**-0.5


@dataclass
class KeptStates:
    """Hidden states a forward keeps: these rows of the flat batch, after these layers, numbered
    as transformers' output_hidden_states (0 the embeddings, i the output of decoder layer i,
    num_hidden_layers the final normed output)."""

    layers: frozenset[int]
    rows: torch.Tensor  # int64 row indices
    states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [len(rows), hidden] float32

    def keep(self, layer: int, h: torch.Tensor) -> None:
        if layer in self.layers:
            self.states[layer] = h.index_select(0, self.rows).float()


class LlamaForCausalLM:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor | GroupedWeight],
                 attention: AttentionBackend, quantization: str = "auto", shard: Shard = Shard(),
                 comm: object = Single(), ops: LayerOps = TORCH_OPS):
        """quantization (ladle.model.quantization): "auto" keeps grouped int8 weights (a GGUF's blocks)
        as they are and float ones float, "none" dequantises all, "int8" quantises the float ones too,
        the LM head included; the embedding lookup keeps the compute dtype. shard: the part of the model
        this rank computes (ladle.model.sharding); comm: the collectives joining it to the others; ops:
        the norms, rotary and activation between the matmuls (ladle.model.ops: the platform's)."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, not {quantization!r}")
        shard.check(cfg)
        w = dict(weights)
        self.cfg = cfg
        self.shard, self.comm = shard, comm
        self.attention = attention
        self.ops = ops
        self.quantization = quantization
        self.embed = w.pop("model.embed_tokens.weight")
        dtype = self.embed.dtype
        linear = functools.partial(make_linear, quantization=quantization, dtype=dtype)
        cat = functools.partial(cat_weights, dtype=dtype)
        self.layers = [_layer_weights(w, i, cfg, shard, linear, cat, comm) for i in range(cfg.num_hidden_layers)]
        per_layer_inputs = cfg.gemma is not None and cfg.gemma.per_layer_input_size > 0
        self.per_layer_inputs = PerLayerInputs.of(w, cfg, linear) if per_layer_inputs else None
        self.cfg = cfg = shard.local_config(cfg)  # from here on, the shapes this rank computes with
        self.norm = _norm_weight(w.pop("model.norm.weight"), cfg)
        # a tied head is the embedding, unless the checkpoint keeps it quantised (a GGUF's blocks)
        lm_head = w.pop("lm_head.weight", None)
        if lm_head is None or (cfg.tie_word_embeddings and not isinstance(lm_head, GroupedWeight)):
            lm_head = self.embed
        self.vocab_counts = [s.stop - s.start for s in padded_spans(cfg.vocab_size, shard.world)]
        self.lm_head = linear(shard.rows(lm_head, shard.padded_span(cfg.vocab_size)), None)
        # Gemma: the sliding layers rotate with their own base, and embeddings are scaled by sqrt(hidden)
        self.local_rotary, self.local_layers, self.embed_scale = None, frozenset(), None
        self.act = ops.silu_and_mul
        if cfg.gemma is not None:
            g = cfg.gemma
            self.local_layers = frozenset(i for i, window in enumerate(cfg.layer_windows) if window is not None)
            if g.full_layers is not None:
                self.local_layers = frozenset(range(cfg.num_hidden_layers)) - g.full_layers
            self.local_rotary = RotaryEmbedding(self._head_dim(local=True), cfg.max_position_embeddings,
                                                g.local_rope_theta, g.local_rope_scaling, device=self.embed.device)
            self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(dtype)  # rounded to the dtype, as transformers
            self.act = ops.gelu_tanh_and_mul
        self.kv_sources = frozenset(cfg.gemma.kv_sources.values()) if cfg.gemma is not None else frozenset()
        # Qwen3.5 rotates only the first rotary_dim numbers of each head
        self.rotary_dim = cfg.hybrid.rotary_dim if cfg.hybrid is not None else self._head_dim(local=False)
        self.cache_layers = {layer: index for index, layer in enumerate(cfg.kv_layers)}
        self.states: LinearStatePool | None = None  # hybrid models: the engine sets the linear layers' state pool
        self.rotary = RotaryEmbedding(self.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, device=self.embed.device)
        for lin in self.linears:  # now, not on the first canonical (scoring) request
            lin.pack()
        layer_linears = [lin for layer in self.layers for lin in layer.linears if not lin.quantized]
        if not self.embed.is_cpu:  # the native kernels are the CPU's; elsewhere torch's matmuls (cuBLAS)
            self.routing = MatmulRouting("torch", "torch", f"torch on {self.embed.device.type}")
        elif not layer_linears:
            self.routing = forced_routing() or (choose_prefill_route(self.layers[0].linears) if self.layers
                                                else MatmulRouting("canonical", "canonical"))
        else:  # int8 layers always take their kernel; the float ones take what measures fastest
            self.routing = choose_routing(kernels.native_kernels(), [lin.weight for lin in layer_linears],
                                          [lin.packed for lin in layer_linears])
        if ops.name == "triton":  # canonical rows on the fixed-tile Triton matmul, as the CUDA path runs them
            self.routing = replace(self.routing, invariant="triton")
        for lin in self.linears:
            lin.routing = self.routing
        native = kernels.native_kernels() if self.embed.is_cpu else None
        self.decode_loop = DecodeLoop(self, native) if native and decode_loop_enabled() and plain_layers(self) else None

    def _head_dim(self, local: bool) -> int:
        """The head dim of the sliding layers (local) or of the others: Gemma 4's global layers' is wider."""
        layers = [i for i in range(self.cfg.num_hidden_layers) if (i in self.local_layers) == local]
        return self.cfg.attention_shape(layers[0])[1] if layers else self.cfg.head_dim

    @property
    def linears(self) -> list[Linear]:
        per_layer = [self.per_layer_inputs.projection] if self.per_layer_inputs is not None else []
        return [lin for layer in self.layers for lin in layer.linears] + per_layer + [self.lm_head]

    @property
    def moe_blocks(self) -> dict[int, MoEBlock]:
        """The MoE layers' blocks by layer index (none in a dense model)."""
        return {i: layer.moe for i, layer in enumerate(self.layers) if layer.moe is not None}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: KeptStates | None = None, num_layers: int | None = None,
                lora: LoRABatch | None = None,
                input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] (M-RoPE: [3, T]). Returns the final normed hidden states [T, hidden]; fills
        `keep` with the rows and layers it names. num_layers: run only the first ones, then the
        final norm (an early exit: self-speculative drafting). lora: each row's adapter term is
        added to the projections' outputs (ladle.lora). input_embeds: (rows, embeddings) that stand in for
        those rows' token embeddings (an image's placeholders)."""
        if self.decode_loop is not None and keep is None and num_layers is None and lora is None \
                and input_embeds is None:
            out = self.decode_loop(input_ids, positions, meta)
            if out is not None:
                return out
        inv = meta.batch_invariant
        ops = self.ops
        self.attention.prepare(meta)
        h = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if input_embeds is not None:
            h[input_embeds[0]] = input_embeds[1].to(h.dtype)
        per_layer = None if self.per_layer_inputs is None else self.per_layer_inputs(input_ids, h, inv, self.ops)
        tables = self.rotary.tables(positions) if positions.dim() == 1 else \
            self.rotary.mrope_tables(positions, self.cfg.mrope_section)  # [3, T]: Qwen2.5-VL's M-RoPE
        rope = tuple(t.to(h.dtype) for t in tables)  # as transformers rounds them
        local_rope = None if self.local_rotary is None else tuple(
            t.to(h.dtype) for t in self.local_rotary.tables(positions))
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        last = len(layers)
        if keep is not None:
            keep.rows = keep.rows.to(h.device)
            keep.keep(0, h)
        eps = self.cfg.rms_norm_eps
        # h, the residual stream, is updated in place; x is the normed input of what comes next
        x = ops.rms_norm(h, layers[0].input_norm if layers else self.norm, eps)
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # Gemma 4: K/V that later layers read
        if meta.states is not None:
            self.states.begin_step(meta.states)
        for i, layer in enumerate(layers):
            layer_rope = local_rope if i in self.local_layers else rope
            if layer.linear_attn is not None:
                attended = self._linear_attention(layer, x, meta)
            else:
                attended = self._attention(i, layer, x, layer_rope, meta, lora, shared_kv)
            x = ops.add_rms_norm(h, self._normed(attended, layer.attn_out_norm), layer.post_attn_norm, eps)
            following = layers[i + 1].input_norm if i + 1 < last else self.norm
            mlp_out = self._normed(self._mlp(i, layer, x, inv, lora, h), layer.mlp_out_norm)
            x = self._add_mlp_output(h, mlp_out, layer, following, None if per_layer is None else per_layer[:, i], inv)
            if keep is not None and i + 1 < last:
                keep.keep(i + 1, h)
        out = x
        if keep is not None:
            keep.keep(last, out)
        return out

    def _add_mlp_output(self, h: torch.Tensor, out: torch.Tensor, layer: DecoderLayerWeights, following: torch.Tensor,
                        per_layer_input: torch.Tensor | None, inv: bool) -> torch.Tensor:
        """h += out (in place), then (Gemma 4) its per-layer input's term and times the layer's scalar;
        the next norm of h."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        if layer.layer_scalar is None:
            return ops.add_rms_norm(h, out, following, eps)
        h.add_(out)
        if per_layer_input is not None:
            gated = F.gelu(layer.per_layer_gate(h, inv), approximate="tanh").mul_(per_layer_input)
            h.add_(ops.rms_norm(layer.per_layer_projection(gated, inv), layer.per_layer_norm, eps))
        h.mul_(layer.layer_scalar)
        return ops.rms_norm(h, following, eps)

    def _normed(self, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """A sublayer's output, normed where the model norms it before the residual add (Gemma)."""
        return out if norm is None else self.ops.rms_norm(out, norm, self.cfg.rms_norm_eps)

    def _mlp(self, i: int, layer: DecoderLayerWeights, x: torch.Tensor, inv: bool, lora: LoRABatch | None,
             residual: torch.Tensor) -> torch.Tensor:
        """The MLP's output for its normed input x; residual: the stream x was normed from (Gemma 4's
        experts read it through norms of their own)."""
        if layer.moe is not None and layer.gate_up is None:
            return layer.moe(x, inv)
        dense = self._dense_mlp(i, layer, x, inv, lora)
        if layer.moe is None:
            return dense
        eps = self.cfg.rms_norm_eps  # Gemma 4: the dense MLP's and the experts' outputs, each normed, summed
        return self.ops.rms_norm(dense, layer.dense_out_norm, eps) + \
            self.ops.rms_norm(layer.moe(residual, inv), layer.experts_out_norm, eps)

    def _dense_mlp(self, i: int, layer: DecoderLayerWeights, x: torch.Tensor, inv: bool,
                   lora: LoRABatch | None) -> torch.Tensor:
        gate_up = layer.gate_up(x, inv)
        if lora is not None:
            lora.add(i, "gate_up", x, gate_up)
        act = self.act(gate_up)
        down = layer.down(act, inv)
        if lora is not None:
            lora.add(i, "down", act, down)
        return self.comm.all_reduce(down, ordered=inv)

    def _linear_attention(self, layer: DecoderLayerWeights, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A Gated DeltaNet layer's output, each sequence's state read from and written to its slot."""
        rows = [(span.start, span.end) for span in meta.prefills]
        return layer.linear_attn(x, meta.states, rows, self.states, meta.batch_invariant)

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on the first rotary_dim numbers of each head of x [T, heads, D] (all of them but in Qwen3.5)."""
        if x.shape[-1] == self.rotary_dim:
            return self.ops.rotary(x, *rope)
        rotated = self.ops.rotary(x[..., : self.rotary_dim].contiguous(), *rope)
        return torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)

    def _attention(self, i: int, layer: DecoderLayerWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   meta: AttentionMetadata, lora: LoRABatch | None,
                   shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Layer i's attention output. shared_kv: this step's K/V of the layers that KV-shared layers read
        (filled as those layers run)."""
        cfg, ops = self.cfg, self.ops
        t = x.shape[0]
        heads = cfg.num_attention_heads
        kv_heads, d = cfg.attention_shape(i)
        q_size, kv_size = heads * d, kv_heads * d
        qkv = layer.qkv(x, meta.batch_invariant)
        if lora is not None:
            lora.add(i, "qkv", x, qkv)
        if layer.kv_source is not None:  # KV sharing: the queries attend over an earlier layer's keys and values
            q = ops.rotary(ops.rms_norm(qkv.view(t, heads, d), layer.q_norm, cfg.rms_norm_eps), *rope)
            k, v = shared_kv[layer.kv_source]
            return self._attended(i, layer, layer.kv_source, q, k, v, meta, lora)
        # k_eq_v: the values are the keys as projected, before their norm and rotation
        v = qkv[:, q_size : q_size + kv_size] if layer.k_eq_v else qkv[:, q_size + kv_size : q_size + 2 * kv_size]
        v = v.view(t, kv_heads, d)
        gate = qkv[:, q_size + 2 * kv_size :] if layer.attn_gate else None
        if layer.q_norm is None:  # q and k side by side: rotate them in one go
            qk = ops.rotary(qkv[:, : q_size + kv_size].view(t, heads + kv_heads, d), *rope)
            q, k = qk.split([heads, kv_heads], dim=1)
        else:
            q = ops.rms_norm(qkv[:, :q_size].view(t, heads, d), layer.q_norm, cfg.rms_norm_eps)
            k = ops.rms_norm(qkv[:, q_size : q_size + kv_size].view(t, kv_heads, d), layer.k_norm, cfg.rms_norm_eps)
            q, k = self._rotate(q, rope), self._rotate(k, rope)
        if layer.v_norm is not None:
            v = ops.rms_norm(v, layer.v_norm, cfg.rms_norm_eps)
        self.attention.write_kv(self.cache_layers[i], k, v, meta)
        if i in self.kv_sources:
            shared_kv[i] = (k, v)
        return self._attended(i, layer, i, q, k, v, meta, lora, gate)

    def _attended(self, i: int, layer: DecoderLayerWeights, kv_layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, meta: AttentionMetadata, lora: LoRABatch | None,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's attention over the cache of kv_layer (its own, or the one it shares), projected out;
        gate: Qwen3.5's output gate, through a sigmoid, on each head's output."""
        o = self.attention.attend(self.cache_layers[kv_layer], q, k, v, meta, layer.sinks)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        out = layer.o_proj(o, meta.batch_invariant)
        if lora is not None:
            lora.add(i, "o_proj", o, out)
        return self.comm.all_reduce(out, ordered=meta.batch_invariant)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """float32 logits, whatever the compute dtype (each rank's rows of the vocabulary, gathered)."""
        logits = self.lm_head(hidden, batch_invariant).float()
        if not self.shard.whole:
            logits = self.comm.all_gather_rows(logits.t().contiguous(), self.vocab_counts).t().contiguous()
        cap = self.cfg.gemma.final_logit_softcapping if self.cfg.gemma is not None else None
        return logits if cap is None else torch.tanh(logits / cap) * cap
