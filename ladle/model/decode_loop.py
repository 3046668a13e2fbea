"""A decode step's decoder layers in one native call (kernels/layer_loop.cpp), for the plain Llama layers
(Llama, SmolLM2, Qwen2, Mistral) in float32 or bfloat16 on the CPU.

The loop calls the kernels the Python forward would call, with the same operands, in the same order, so
its outputs have the same bits (tests/test_decode_loop.py holds it to that). What it saves is the host's
work around them: at one row of a small model, each of a layer's ten kernel calls costs as much in Python
and ctypes as in arithmetic. A step it cannot take exactly as the Python forward would (a prefill in the
batch, a matmul routed to torch or AMX, LoRA, kept hidden states) returns None and runs in Python.
LADLE_LAYER_LOOP=0 turns it off.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ladle.model.kernels.native import KV_TYPES, WEIGHT_TYPES, NativeKernels
from ladle.model.layers import Linear
from ladle.model.quantization import AMX_INT8_ROWS, WIDEN_ROWS, Int8Linear

if TYPE_CHECKING:
    from ladle.model.attention import AttentionMetadata
    from ladle.model.llama import LlamaForCausalLM

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
CANONICAL, SMALL, DOT = 0, 1, 2  # layer_loop.cpp's Kernel
# the caches a step of each compute dtype writes as the Python forward does (a bfloat16 step: bfloat16 only)
CACHE_DTYPES = {torch.float32: (torch.float32, torch.int8, torch.float8_e4m3fn), torch.bfloat16: (torch.bfloat16,)}


class LoopLinear(ctypes.Structure):
    _fields_ = [("kernel", _i64), ("weights", _ptr), ("weight_type", _i64), ("scales", _ptr),
                ("group_scales", _ptr), ("group_mins", _ptr), ("half", _i64), ("group_size", _i64), ("bias", _ptr),
                ("k", _i64), ("n", _i64)]


class LoopLayer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_attn_norm", _ptr), ("qkv", LoopLinear), ("o", LoopLinear),
                ("gate_up", LoopLinear), ("down", LoopLinear), ("k_cache", _ptr), ("v_cache", _ptr),
                ("k_scales", _ptr), ("v_scales", _ptr), ("window", _i64)]


class LoopStep(ctypes.Structure):
    _fields_ = [("layers", _i64), ("layer", ctypes.POINTER(LoopLayer)), ("final_norm", _ptr), ("hidden", _i64),
                ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("bf16", _i64), ("kv_type", _i64),
                ("num_blocks", _i64),
                ("block_size", _i64), ("rows", _i64), ("cos", _ptr), ("sin", _ptr), ("slots", _ptr),
                ("block_tables", _ptr), ("max_blocks", _i64), ("row_starts", _ptr), ("row_counts", _ptr),
                ("first_positions", _ptr), ("h", _ptr), ("x", _ptr), ("qkv", _ptr), ("attn", _ptr), ("out", _ptr),
                ("gate_up", _ptr), ("q32", _ptr), ("attn32", _ptr), ("threads", _i64), ("seconds", _ptr)]


def enabled() -> bool:
    return os.environ.get("LADLE_LAYER_LOOP", "1") != "0"


def plain_layers(model: LlamaForCausalLM) -> bool:
    """Whether every layer is a plain Llama layer in float32 or bfloat16 on the CPU: attention with rotary on
    every head dim, no per-head norms, sinks or gates, a dense SwiGLU MLP; one rank; the CPU's layer ops."""
    cfg = model.cfg
    if (cfg.gemma is not None or cfg.hybrid is not None or model.per_layer_inputs is not None
            or model.embed_scale is not None or model.local_rotary is not None or not model.shard.whole
            or model.ops.name != "torch" or model.embed.dtype not in CACHE_DTYPES or not model.embed.is_cpu
            or model.rotary_dim != cfg.head_dim or cfg.head_dim % 2 or not model.layers):
        return False
    linear_kinds, dtype = (Linear, Int8Linear), model.embed.dtype
    return model.norm.dtype == dtype and model.norm.is_contiguous() and all(
        layer.moe is None and layer.linear_attn is None and layer.q_norm is None and layer.k_norm is None
        and layer.sinks is None and layer.v_norm is None and not layer.k_eq_v and layer.kv_source is None
        and layer.layer_scalar is None and not layer.attn_gate and layer.attn_out_norm is None
        and layer.mlp_out_norm is None and layer.per_layer_gate is None
        and all(type(lin) in linear_kinds for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        and all(t.dtype == dtype and t.is_contiguous() for t in (layer.input_norm, layer.post_attn_norm))
        and cfg.attention_shape(i) == (cfg.num_key_value_heads, cfg.head_dim)
        and layer.qkv.out_features == (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        and layer.o_proj.in_features == cfg.num_attention_heads * cfg.head_dim
        and layer.gate_up.out_features == 2 * layer.down.in_features == 2 * model.layers[0].down.in_features
        for i, layer in enumerate(model.layers))


def _kernel(lin: Linear, rows: int, batch_invariant: bool, strided: bool, bf16: bool) -> int | None:
    """The kernel `lin(x)` runs for `rows` float32 or bfloat16 rows (strided: rows not back to back), as
    Linear.__call__ and Int8Linear.__call__ choose it; None where that is not one of the loop's. bfloat16
    rows take the canonical kernel only (widened in the kernel as Int8Linear widens them before it)."""
    if isinstance(lin, Int8Linear):
        if lin._int8_panels is None or (not batch_invariant and rows > WIDEN_ROWS and lin.routing.prefill == "torch"):
            return None
        if lin._dot:
            return None if bf16 or (lin._kernels.amx_int8 and rows in AMX_INT8_ROWS) else DOT
        return CANONICAL
    route = lin.routing.invariant if batch_invariant else lin.routing.kernel_for(rows)
    if route == "canonical":
        return CANONICAL if lin.packed is not None else None
    if bf16:
        return None
    # the small kernel takes whole rows back to back; others go to F.linear (a [1, n] view counts as whole)
    if route == "small" and lin._native_ok and (rows == 1 or not strided):
        return SMALL
    return None


def _linear(lin: Linear, kernel: int) -> LoopLinear:
    bias = lin.bias if kernel == SMALL else lin._bias32
    out = LoopLinear(kernel=kernel, bias=None if bias is None else bias.data_ptr(), k=lin.in_features,
                     n=lin.out_features)
    if kernel == SMALL:
        out.weights = lin.weight.data_ptr()
    elif isinstance(lin, Int8Linear):
        out.weights, out.weight_type = lin._int8_panels.data_ptr(), WEIGHT_TYPES[lin._int8_panels.dtype]
        out.scales = None if lin.scales is None else lin.scales.data_ptr()
        if lin._groups is not None:
            size, scales, mins = lin._groups
            out.group_size, out.group_scales, out.half = size, scales.data_ptr(), int(scales.dtype == torch.float16)
            out.group_mins = None if mins is None else mins.data_ptr()
    else:
        out.weights, out.weight_type = lin.packed.data_ptr(), WEIGHT_TYPES[lin.packed.dtype]
    return out


class DecodeLoop:
    """Runs a model's decode steps through ladle_decode_layers where it can (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM, native: NativeKernels):
        self.model = model
        self._run = native.decode_layers
        self._kinds: dict[tuple[int, bool], tuple[int, ...] | None] = {}  # each linear's kernel, by rows
        self._plans: dict[tuple, ctypes.Array] = {}  # by the kernels chosen and the cache's tensors
        # float64 [matmul, attention (the K/V writes and the attention)]: where set, each step adds its
        # seconds in them (benchmarks/throughput.py's split of a step)
        self.seconds: torch.Tensor | None = None
        self.steps = 0  # decode steps it has run

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor | None:
        """The final normed hidden states [T, hidden] of a step of decodes, or None: not a step the loop takes."""
        attention = self.model.attention
        cache = getattr(attention, "cache", None)
        rows = input_ids.shape[0]
        if (meta.prefills or meta.decode_rows is None or meta.in_step_copies or meta.states is not None
                or positions.dim() != 1 or cache is None or not getattr(attention, "_prompt_kernel_ok", False)
                or cache.k[0].dtype not in CACHE_DTYPES[self.model.embed.dtype] or rows != meta.num_decodes):
            return None
        layers = self._plan(rows, meta.batch_invariant)
        if layers is None:
            return None
        out = self._step(layers, input_ids, positions, meta)
        self.steps += 1
        return out

    def _plan(self, rows: int, batch_invariant: bool) -> ctypes.Array | None:
        """The layers laid out for this many rows, or None where a matmul's kernel is not one of the loop's."""
        key = (rows, batch_invariant)
        if key not in self._kinds:  # the routes are fixed when the model is built: chosen once per row count
            self._kinds[key] = self._kernels(rows, batch_invariant)
        kinds = self._kinds[key]
        if kinds is None:
            return None
        cache = self.model.attention.cache
        plan_key = (kinds, cache.k[0].data_ptr())
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = self._plans[plan_key] = self._layers(kinds)
        return plan

    def _kernels(self, rows: int, batch_invariant: bool) -> tuple[int, ...] | None:
        kinds = []
        bf16 = self.model.embed.dtype == torch.bfloat16
        for layer in self.model.layers:
            for lin, strided in ((layer.qkv, False), (layer.o_proj, False), (layer.gate_up, False), (layer.down, True)):
                kernel = _kernel(lin, rows, batch_invariant, strided, bf16)
                if kernel is None:
                    return None
                kinds.append(kernel)
        return tuple(kinds)

    def _layers(self, kinds: tuple[int, ...]) -> ctypes.Array:
        attention, model = self.model.attention, self.model
        cache = attention.cache
        layers = (LoopLayer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            c = model.cache_layers[i]
            qkv, o, gate_up, down = (_linear(lin, kind) for lin, kind in zip(
                (layer.qkv, layer.o_proj, layer.gate_up, layer.down), kinds[4 * i : 4 * i + 4]))
            scales = (cache.k_scale[c].data_ptr(), cache.v_scale[c].data_ptr()) if cache.quantized else (None, None)
            layers[i] = LoopLayer(layer.input_norm.data_ptr(), layer.post_attn_norm.data_ptr(), qkv, o, gate_up, down,
                                  cache.k[c].data_ptr(), cache.v[c].data_ptr(), *scales, attention.window(c) or 0)
        return layers

    def _step(self, layers: ctypes.Array, input_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
        model, cfg = self.model, self.model.cfg
        cache = model.attention.cache
        rows, hidden, d = input_ids.shape[0], cfg.hidden_size, cfg.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        intermediate = model.layers[0].down.in_features
        dtype = model.embed.dtype
        h = F.embedding(input_ids, model.embed)
        cos, sin = (t.to(dtype) for t in model.rotary.tables(positions))  # rounded as the Python forward rounds them
        decodes = meta.decode_rows
        operands = [t.to(torch.int64).contiguous() for t in (meta.slot_mapping, decodes.block_tables,
                                                             decodes.row_starts, decodes.row_counts,
                                                             decodes.first_positions)]
        x, out = torch.empty(rows, hidden, dtype=dtype), torch.empty(rows, hidden, dtype=dtype)
        qkv = torch.empty(rows, (heads + 2 * kv_heads) * d, dtype=dtype)
        attn, gate_up = torch.empty(rows, heads * d, dtype=dtype), torch.empty(rows, 2 * intermediate, dtype=dtype)
        bf16 = dtype == torch.bfloat16
        q32, attn32 = (torch.empty(rows, heads * d) for _ in range(2)) if bf16 else (None, None)
        num_blocks, block_size = cache.k[0].shape[:2]
        slots, tables, starts, counts, firsts = (t.data_ptr() for t in operands)
        step = LoopStep(
            layers=len(model.layers), layer=layers, final_norm=model.norm.data_ptr(), hidden=hidden, heads=heads,
            kv_heads=kv_heads, head_dim=d, intermediate=intermediate, eps=cfg.rms_norm_eps,
            scale=model.attention.scale, bf16=int(bf16), kv_type=KV_TYPES[cache.k[0].dtype],
            num_blocks=num_blocks, block_size=block_size, rows=rows, cos=cos.data_ptr(), sin=sin.data_ptr(),
            slots=slots, block_tables=tables, max_blocks=operands[1].shape[1], row_starts=starts, row_counts=counts,
            first_positions=firsts, h=h.data_ptr(), x=x.data_ptr(), qkv=qkv.data_ptr(), attn=attn.data_ptr(),
            out=out.data_ptr(), gate_up=gate_up.data_ptr(), q32=None if q32 is None else q32.data_ptr(),
            attn32=None if attn32 is None else attn32.data_ptr(), threads=torch.get_num_threads(),
            seconds=None if self.seconds is None else self.seconds.data_ptr())
        self._run(step)  # the pointers are the model's and the cache's, and this frame's tensors
        return x
