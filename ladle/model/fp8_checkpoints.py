"""FP8 checkpoints as people download them, read into Fp8Weights (ladle.model.fp8).

Two formats hold a linear layer NAME as NAME.weight in float8 e4m3 [out, in] with float scales:

    HF "fp8"            quant_method "fp8"; weight_block_size [128, 128]: NAME.weight_scale_inv
                        [ceil(out / 128), ceil(in / 128)], one per block (DeepSeek-V3's, Qwen3's
                        FP8 releases); without a block size, NAME.weight_scale, one per tensor
                        (AutoFP8's)
    compressed-tensors  quant_method "compressed-tensors", format "float-quantized", config_groups
                        whose weights are 8-bit floats: NAME.weight_scale [out, 1] (strategy
                        "channel"), [1] ("tensor") or [out / b0, in / b1] ("block", block_structure
                        [b0, b1])

and weight[n, k] = q[n, k] * scale[n // b0, k // b1] in both (HF's "scale_inv" multiplies too).
A static activation scale (NAME.input_scale) is dropped: ladle scales activations per token, as
each call comes, which is at least as accurate. So are static KV cache scales (k_scale, v_scale:
compressed-tensors' kv_cache_scheme): --kv-cache-dtype fp8 keeps a scale per token and head.

The engine decides whether the weights stay in FP8 (`--quantization fp8`, or `auto` on a GPU with
FP8 tensor cores) or are dequantised at load, exactly in float32 (the CPU has no FP8 matmul). Only
the attention and MLP projections and the LM head stay in FP8; any other FP8 tensor (MLA's
latent projections, linear attention's, 3-D fused experts) is dequantised, as the layers that
read it take float tensors.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from ladle.model.fp8 import FP8, Fp8Weight

log = logging.getLogger(__name__)

# the layers kept in FP8 when the engine serves FP8: each becomes one Linear (ladle.model.quantization)
KEPT = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3|lm_head)\.weight$")
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
STATIC_SCALES = (".input_scale", ".k_scale", ".v_scale")


def is_fp8_config(qc: dict[str, Any] | None) -> bool:
    """Whether a config.json's quantization_config describes FP8 weights (either format)."""
    if not qc:
        return False
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return True
    if method != "compressed-tensors":
        return False
    groups = (qc.get("config_groups") or {}).values()
    return any((g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits") == 8
               for g in groups)


def config_block(qc: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, inputs) of the checkpoint's weight blocks where its config names one."""
    block = qc.get("weight_block_size")
    for group in (qc.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("strategy") == "block":
            block = weights.get("block_structure")
    if block is None:
        return None
    if isinstance(block, str):  # early compressed-tensors wrote "128x128"
        block = block.lower().split("x")
    if len(block) != 2:
        raise ValueError(f"quantization_config block size {block!r}: expected [rows, inputs]")
    return int(block[0]), int(block[1])


def check_config(qc: dict[str, Any]) -> None:
    """Refuse what ladle cannot read, naming the field."""
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r}: ladle reads e4m3 FP8 checkpoints")
    if str(qc.get("quant_method")).lower() == "compressed-tensors":
        fmt = str(qc.get("format", "float-quantized"))
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"quantization_config.format {fmt!r}: ladle reads compressed-tensors' "
                             "'float-quantized' FP8 checkpoints")


def weight_of(name: str, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> Fp8Weight:
    """NAME's e4m3 values and scale tensor as an Fp8Weight, its block from the config or, where the
    config names none, from the scale's shape (one per tensor, or one per row)."""
    if q.dtype != FP8:
        raise ValueError(f"{name}: {q.dtype} weights; ladle reads float8_e4m3fn ones")
    rows, cols = q.shape
    scale = scale.float().reshape(1, 1) if scale.numel() == 1 else scale.float().reshape(scale.shape[0], -1)
    if block is None or scale.shape == (1, 1) or scale.shape == (rows, 1):
        block = (rows // scale.shape[0], cols // scale.shape[1])
    if scale.shape != (-(-rows // block[0]), -(-cols // block[1])):
        raise ValueError(f"{name}: scale {tuple(scale.shape)} does not fit weight {tuple(q.shape)} "
                         f"in blocks of {block}")
    return Fp8Weight(q, scale.contiguous(), block)


def read_checkpoint(weights: dict[str, torch.Tensor], qc: dict[str, Any], keep: bool,
                    dtype: torch.dtype) -> dict[str, torch.Tensor | Fp8Weight]:
    """`weights` with each FP8 layer's values and scales replaced by NAME.weight: an Fp8Weight where
    `keep` and the layer is one KEPT names, else float in `dtype`."""
    check_config(qc)
    block = config_block(qc)
    out = dict(weights)
    dropped = [out.pop(n) for n in [n for n in weights if n.endswith(STATIC_SCALES)]]
    if dropped:
        log.info("fp8 checkpoint: %d static activation and KV scales dropped (ladle scales activations per "
                 "token, an 8-bit KV cache per token and head)", len(dropped))
    for name in [n for n, t in weights.items() if n.endswith(".weight") and t.dtype == FP8]:
        base = name.removesuffix(".weight")
        scale = next((out.pop(base + s) for s in SCALE_SUFFIXES if base + s in out), None)
        if scale is None:
            raise ValueError(f"fp8 layer {base} has no {base}.weight_scale_inv or {base}.weight_scale")
        q = out[name]
        if q.dim() != 2:  # fused experts [E, out, in]: dequantised expert by expert
            out[name] = torch.stack([weight_of(name, q[e], scale[e], block).dequantize(dtype) for e in range(len(q))])
            continue
        weight = weight_of(name, q, scale, block)
        out[name] = weight if keep and KEPT.search(name) else weight.dequantize(dtype)
    return out
