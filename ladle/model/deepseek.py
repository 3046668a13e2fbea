"""DeepSeek V3's forward over a flat, packed token batch: multi-head latent attention (ladle.model.mla)
over a latent KV cache (ladle.model.mla_attention), its first first_k_dense_replace layers' MLPs dense
and the others routed experts beside shared ones (ladle.model.moe.DeepseekMoEBlock).

The same interface as LlamaForCausalLM (the runner, the engine and speculative decoding call either):
forward, compute_logits, linears, moe_blocks, routing. One rank only for now: the tensor-parallel ranks
build their KV caches with full K/V (ladle.distributed.tensor_parallel), which the latent cache is not.

A checkpoint's multi-token prediction layer (num_nextn_predict_layers: model.layers.{num_hidden_layers}.*)
is kept as `mtp` where its weights are there: it drafts for `--speculative-config '{"method": "mtp"}'`
(ladle.spec_decode.mtp) from the final hidden states that forward keeps per cache slot (keep_hidden).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ladle.config import QUANTIZATIONS
from ladle.model import kernels
from ladle.model.attention import AttentionMetadata
from ladle.model.collectives import Single
from ladle.model.config import ModelConfig
from ladle.model.kernels.routing import MatmulRouting, choose_routing, forced_routing
from ladle.model.layers import Linear, RotaryEmbedding
from ladle.model.llama import KeptStates
from ladle.model.mla import rotate, softmax_scale
from ladle.model.mla_attention import LatentHeads, MLAPagedAttention
from ladle.model.moe import MoEBlock, load_moe_block
from ladle.model.ops import TORCH_OPS, LayerOps
from ladle.model.quantization import GroupedWeight, cat_weights, choose_prefill_route, dense, make_linear
from ladle.model.sharding import Shard, head_rows

if TYPE_CHECKING:
    from ladle.lora.slots import LoRABatch

LORA_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's: transformers builds them with its default eps


@dataclass
class DeepseekLayer:
    input_norm: torch.Tensor
    q_a: Linear | None  # hidden -> q_lora_rank; None where q_b maps the hidden state itself (q_proj)
    q_a_norm: torch.Tensor | None
    q_b: Linear  # -> heads * (nope + rope)
    kv_a: Linear  # hidden -> kv_lora_rank + rope: the latent and the shared rotary key
    kv_a_norm: torch.Tensor
    heads: LatentHeads  # kv_b_proj: latent -> each head's key (without RoPE) and value
    o_proj: Linear
    post_attn_norm: torch.Tensor
    gate_up: Linear | None  # the dense layers' MLP
    down: Linear | None
    moe: MoEBlock | None  # the others'

    @property
    def linears(self) -> tuple[Linear, ...]:
        attention = ((self.q_a,) if self.q_a is not None else ()) + (self.q_b, self.kv_a, self.heads.kv_b, self.o_proj)
        mlp = tuple(self.moe.linears) if self.moe is not None else (self.gate_up, self.down)
        return attention + mlp


@dataclass
class MTPLayer:
    """DeepSeek V3's multi-token prediction module: the next token's embedding (enorm) and the hidden state
    that predicted it (hnorm) joined by eh_proj, through one more decoder layer, then its own head's norm
    and the LM head: a guess at the token after next."""

    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: Linear  # [embedding ; hidden] -> hidden
    layer: DeepseekLayer
    head_norm: torch.Tensor  # shared_head.norm
    head: Linear  # shared_head.head, or the model's LM head where the checkpoint leaves it out
    embed: torch.Tensor  # its embed_tokens, or the model's

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.eh_proj, *self.layer.linears)


def _mtp_layer(w: dict[str, torch.Tensor | GroupedWeight], cfg: ModelConfig, linear: Callable, cat: Callable,
               dtype: torch.dtype, embed: torch.Tensor, lm_head: Linear) -> MTPLayer | None:
    """The first MTP layer, taken out of w; None where the checkpoint holds none (transformers saves none)."""
    n = cfg.num_hidden_layers
    p = f"model.layers.{n}."
    if p + "eh_proj.weight" not in w:
        return None
    head = w.pop(p + "shared_head.head.weight", None)
    own_embed = w.pop(p + "embed_tokens.weight", None)
    mtp = MTPLayer(w.pop(p + "enorm.weight"), w.pop(p + "hnorm.weight"), linear(w.pop(p + "eh_proj.weight"), None),
                   _layer(w, n, cfg, linear, cat, dtype), w.pop(p + "shared_head.norm.weight"),
                   lm_head if head is None else linear(head, None), embed if own_embed is None else own_embed)
    for key in [k for k in w if k.startswith("model.layers.") and int(k.split(".")[2]) > n]:
        w.pop(key)  # further MTP layers: ladle drafts with the first
    return mtp


def _layer(w: dict[str, torch.Tensor | GroupedWeight], i: int, cfg: ModelConfig,
           linear: Callable[[torch.Tensor | GroupedWeight, torch.Tensor | None], Linear],
           cat: Callable[[list], torch.Tensor | GroupedWeight], dtype: torch.dtype,
           shard: Shard = Shard(), comm: object = Single()) -> DeepseekLayer:
    """Layer i's weights (this rank's shard of them: its heads, its share of the dense MLP, its experts or its
    share of each), taken out of w (dtype: the compute dtype). Every rank computes the whole latent: q_a and
    kv_a are not split, so each rank's cache holds every token's latent, as one rank's does."""
    p, m = f"model.layers.{i}.", cfg.mla
    attn = p + "self_attn."
    lora = m.q_lora_rank is not None
    heads = cfg.num_attention_heads
    # the MTP layer (after the last) routes as the layers before it do
    sparse = i in cfg.moe.sparse_layers or (i >= cfg.num_hidden_layers and bool(cfg.moe.sparse_layers))
    moe = load_moe_block(w, i, cfg, shard, linear, cat, comm) if sparse else None
    gate_up = down = None
    if moe is None:
        gate, up = shard.column_parallel([w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")])
        down_w = w.pop(p + "mlp.down_proj.weight")
        gate_up, down = linear(cat([gate, up]), None), linear(shard.columns(down_w, shard.span(down_w.shape[1])), None)
    # kv_b stays float whatever the quantization: the absorbed decode reads it per head
    kv_b = Linear(dense(shard.rows(w.pop(attn + "kv_b_proj.weight"),
                                    head_rows(shard, heads, m.qk_nope_head_dim + m.v_head_dim)), dtype))
    q_b = w.pop(attn + ("q_b_proj.weight" if lora else "q_proj.weight"))
    o_proj = w.pop(attn + "o_proj.weight")
    return DeepseekLayer(
        input_norm=w.pop(p + "input_layernorm.weight"),
        q_a=linear(w.pop(attn + "q_a_proj.weight"), None) if lora else None,
        q_a_norm=w.pop(attn + "q_a_layernorm.weight") if lora else None,
        q_b=linear(shard.rows(q_b, head_rows(shard, heads, m.qk_nope_head_dim + m.qk_rope_head_dim)), None),
        kv_a=linear(w.pop(attn + "kv_a_proj_with_mqa.weight"), None),
        kv_a_norm=w.pop(attn + "kv_a_layernorm.weight"),
        heads=LatentHeads.of(kv_b, heads // shard.world, m.qk_nope_head_dim, m.v_head_dim),
        o_proj=linear(shard.columns(o_proj, head_rows(shard, heads, m.v_head_dim)), None),
        post_attn_norm=w.pop(p + "post_attention_layernorm.weight"),
        gate_up=gate_up, down=down, moe=moe)


class DeepseekV3ForCausalLM:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor | GroupedWeight],
                 attention: object, quantization: str = "auto", shard: Shard = Shard(),
                 comm: object = Single(), ops: LayerOps = TORCH_OPS):
        """As LlamaForCausalLM's. attention: the platform's backend over the runner's KV cache, a latent one
        (ModelConfig.cache_layer_shapes); the model attends through MLAPagedAttention over that cache."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, not {quantization!r}")
        shard.check(cfg)
        if cfg.attention_bias:
            raise ValueError("DeepSeek V3 with attention_bias is not supported")
        w = dict(weights)
        self.cfg, self.shard, self.comm, self.ops, self.quantization = cfg, shard, comm, ops, quantization
        m = cfg.mla
        self.states = None  # the hybrid models' per-sequence state pool (the runner asks): none here
        self.scale = softmax_scale(m.qk_nope_head_dim + m.qk_rope_head_dim, cfg.rope_scaling)
        self.attention = attention
        self.embed = w.pop("model.embed_tokens.weight")
        dtype = self.embed.dtype
        linear = functools.partial(make_linear, quantization=quantization, dtype=dtype)
        cat = functools.partial(cat_weights, dtype=dtype)
        self.layers = [_layer(w, i, cfg, linear, cat, dtype, shard, comm) for i in range(cfg.num_hidden_layers)]
        self.cfg = cfg = shard.local_config(cfg)  # from here on, the heads this rank computes
        self.norm = w.pop("model.norm.weight")
        lm_head = w.pop("lm_head.weight", None)
        if lm_head is None or (cfg.tie_word_embeddings and not isinstance(lm_head, GroupedWeight)):
            lm_head = self.embed
        self.lm_head = linear(lm_head, None)
        # speculation runs on one rank (EngineConfig refuses mtp under tensor parallel)
        self.mtp = _mtp_layer(w, cfg, linear, cat, dtype, self.embed, self.lm_head) if shard.whole else None
        self.hidden_cache: torch.Tensor | None = None  # [slots, hidden]: keep_hidden
        self._hidden_block_size = 0
        self.rotary = RotaryEmbedding(m.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, device=self.embed.device)
        for lin in self.linears:  # now, not on the first canonical (scoring) request
            lin.pack()
        self.routing = self._choose_routing()
        if ops.name == "triton":  # canonical rows on the fixed-tile Triton matmul, as the CUDA path runs them
            self.routing = replace(self.routing, invariant="triton")
        for lin in self.linears:
            lin.routing = self.routing

    @property
    def attention(self) -> MLAPagedAttention | None:
        return self._attention

    @attention.setter
    def attention(self, backend: object) -> None:
        """The runner sets the platform's backend (on start, and when it reallocates the pool): the model
        attends over that backend's cache, its latents."""
        if backend is None or isinstance(backend, MLAPagedAttention):
            self._attention = backend
            return
        m = self.cfg.mla
        self._attention = MLAPagedAttention(backend.cache, m.kv_lora_rank, m.qk_rope_head_dim, self.scale)

    def _choose_routing(self) -> MatmulRouting:
        """Where the float matmuls run, as LlamaForCausalLM chooses (the float32 routers left out)."""
        dtype = self.embed.dtype
        measured = [lin for layer in self.layers for lin in layer.linears
                    if not lin.quantized and lin.weight.dtype == dtype]
        if not self.embed.is_cpu:
            return MatmulRouting("torch", "torch", f"torch on {self.embed.device.type}")
        if not measured:
            return forced_routing() or choose_prefill_route(self.layers[0].linears)
        return choose_routing(kernels.native_kernels(), [lin.weight for lin in measured],
                              [lin.packed for lin in measured])

    @property
    def linears(self) -> list[Linear]:
        mtp = list(self.mtp.linears) + ([self.mtp.head] if self.mtp.head is not self.lm_head else []) \
            if self.mtp is not None else []
        return [lin for layer in self.layers for lin in layer.linears] + [self.lm_head] + mtp

    def keep_hidden(self, num_blocks: int, block_size: int) -> None:
        """From now on every full forward keeps each token's final hidden state by its cache slot (the MTP
        drafter reads the states of positions computed in earlier steps, prompts' included)."""
        self.hidden_cache = torch.zeros(num_blocks * block_size, self.cfg.hidden_size, dtype=self.embed.dtype,
                                        device=self.embed.device)
        self._hidden_block_size = block_size

    def _keep_hidden(self, x: torch.Tensor, meta: AttentionMetadata) -> None:
        """x's rows into their slots, then the step's in-step copies (as the K/V's)."""
        self.hidden_cache.index_copy_(0, meta.slot_mapping, x)
        bs = self._hidden_block_size
        for src, dst, n in meta.in_step_copies:
            self.hidden_cache[dst * bs : dst * bs + n] = self.hidden_cache[src * bs : src * bs + n]

    @property
    def moe_blocks(self) -> dict[int, MoEBlock]:
        """The MoE layers' blocks by layer index (the first first_k_dense_replace layers are dense)."""
        return {i: layer.moe for i, layer in enumerate(self.layers) if layer.moe is not None}

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, rope] at positions, each frequency's angle twice (halves), rounded to the dtype
        as transformers rounds them."""
        cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: KeptStates | None = None, num_layers: int | None = None,
                lora: LoRABatch | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward: the final normed hidden states [T, hidden]."""
        if lora is not None:
            raise ValueError("LoRA adapters on DeepSeek models are not supported yet")
        inv, ops, eps = meta.batch_invariant, self.ops, self.cfg.rms_norm_eps
        self.attention.prepare(meta)
        h = F.embedding(input_ids, self.embed)
        rope = self._rope(positions, h.dtype)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        last = len(layers)
        if keep is not None:
            keep.rows = keep.rows.to(h.device)
            keep.keep(0, h)
        # h, the residual stream, is updated in place; x is the normed input of what comes next
        x = ops.rms_norm(h, layers[0].input_norm if layers else self.norm, eps)
        for i, layer in enumerate(layers):
            x = ops.add_rms_norm(h, self._mla(i, layer, x, rope, meta), layer.post_attn_norm, eps)
            following = layers[i + 1].input_norm if i + 1 < last else self.norm
            x = ops.add_rms_norm(h, self._mlp(layer, x, inv), following, eps)
            if keep is not None and i + 1 < last:
                keep.keep(i + 1, h)
        if keep is not None:
            keep.keep(last, x)
        if self.hidden_cache is not None and num_layers is None:
            self._keep_hidden(x, meta)
        return x

    @torch.inference_mode()
    def mtp_forward(self, tokens: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor,
                    meta: AttentionMetadata, attention: MLAPagedAttention) -> torch.Tensor:
        """The MTP layer at positions: each row joins the embedding of the token after its position
        (tokens) with the hidden state at its position (previous: the model's final one, or the MTP layer's
        own output when drafting further), attending over the MTP layer's latent cache (attention, its
        layer 0). Returns the layer's output [T, hidden], before its head's norm. As vLLM's DeepSeek MTP,
        position 0's embedding is zeroed."""
        mtp, ops, eps = self.mtp, self.ops, self.cfg.rms_norm_eps
        embedded = F.embedding(tokens, mtp.embed).masked_fill((positions == 0)[:, None], 0)
        joined = torch.cat([ops.rms_norm(embedded, mtp.enorm, eps), ops.rms_norm(previous, mtp.hnorm, eps)], dim=-1)
        h = mtp.eh_proj(joined, False)
        attention.prepare(meta)
        x = ops.rms_norm(h, mtp.layer.input_norm, eps)
        x = ops.add_rms_norm(h, self._mla(0, mtp.layer, x, self._rope(positions, h.dtype), meta, attention),
                             mtp.layer.post_attn_norm, eps)
        h.add_(self._mlp(mtp.layer, x, False))
        return h

    @torch.inference_mode()
    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the MTP layer's outputs, through its head's norm and the head."""
        return self.mtp.head(self.ops.rms_norm(hidden, self.mtp.head_norm, self.cfg.rms_norm_eps), False).float()

    def _mla(self, i: int, layer: DeepseekLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
             meta: AttentionMetadata, attention: MLAPagedAttention | None = None) -> torch.Tensor:
        """Layer i's MLA output: the step's latents and shared keys written to the cache (the model's, or
        attention's: the MTP layer's), then attended."""
        attention = attention or self.attention
        m, ops, inv = self.cfg.mla, self.ops, meta.batch_invariant
        t, heads = x.shape[0], self.cfg.num_attention_heads
        q_in = x if layer.q_a is None else ops.rms_norm(layer.q_a(x, inv), layer.q_a_norm, LORA_NORM_EPS)
        q = layer.q_b(q_in, inv).view(t, heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_pe = rotate(q_pe, *rope, m.rope_interleave)
        latent, k_pe = layer.kv_a(x, inv).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = ops.rms_norm(latent.contiguous(), layer.kv_a_norm, LORA_NORM_EPS)
        k_pe = rotate(k_pe, *rope, m.rope_interleave)
        attention.write(i, latent, k_pe, meta)
        o = attention.attend(i, q_nope, q_pe, latent, k_pe, layer.heads, meta)
        return self.comm.all_reduce(layer.o_proj(o, inv), ordered=inv)

    def _mlp(self, layer: DeepseekLayer, x: torch.Tensor, inv: bool) -> torch.Tensor:
        if layer.moe is not None:
            return layer.moe(x, inv)
        return self.comm.all_reduce(layer.down(self.ops.silu_and_mul(layer.gate_up(x, inv)), inv), ordered=inv)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """float32 logits, whatever the compute dtype."""
        return self.lm_head(hidden, batch_invariant).float()
