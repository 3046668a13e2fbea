"""Writes gptqmodel_int4.safetensors and quantization_configs.json (tests/test_int4_checkpoints.py) with
GPTQModel's own packers, format converter and dequantisers: a reference for ladle's GPTQ/AWQ loader that
does not share its code or the test's.

The quantised model is the test's tiny Llama (tests/tiny_models.py: hidden 64, intermediate 128, one
layer, seed 0). Each projection is rounded to a grid of 4-bit codes in groups of 32 inputs (fp16 scales;
asymmetric: integer zero points, symmetric: zero 8; act-order: inputs in a random order, groups
scattered by g_idx), then packed by GPTQModel into each checkpoint format:
  gptq-sym, gptq-asym   GPTQ v1 (TorchLinear.pack, then GPTQModel's v2 -> v1 conversion: zeros - 1)
  gptq-asym-v2          GPTQ v2 (TorchLinear.pack as it is)
  awq                   AWQ GEMM (AwqTorchLinear.pack: AutoAWQ's interleaved columns)
  gptq-act-order        GPTQ v1 with desc_act (g_idx scattered)
The reference for each quantisation (sym, asym, act-order) is the weights GPTQModel dequantises from
every format that carries it (TorchLinear.dequantize_weight; dequantize_gemm for AWQ) in float32,
checked equal bit for bit across the formats, and stored as its codes, zero points and fp16 scales
(scale * (code - zero) in float32 is exact: 4 times smaller than float32 weights).

GPTQModel needs torch >= 2.14.1, so it is no test dependency: this ran once in a throwaway venv that
sees ladle's (torch 2.13.0) and has gptqmodel installed without its dependencies, plus the few small
packages its imports need:

    python3.11 -m venv /tmp/gq
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/gq/lib/python3.11/site-packages/ladle.pth
    /tmp/gq/bin/pip install --no-deps gptqmodel==7.7.0 pypcre logbar device-smi tokenicer defuser
    PYTHONPATH=$PWD /tmp/gq/bin/python tests/data/gptqmodel_int4/make.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: tiny_models

GROUP = 32
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1)  # tests/test_int4_checkpoints.py's
QUANTISATIONS = {"sym": dict(sym=True, act_order=False), "asym": dict(sym=False, act_order=False),
                 "act-order": dict(sym=False, act_order=True)}
CHECKPOINTS = {"gptq-sym": ("sym", "gptq"), "gptq-asym": ("asym", "gptq"), "gptq-asym-v2": ("asym", "gptq_v2"),
               "awq": ("asym", "awq"), "gptq-act-order": ("act-order", "gptq")}


def grid(w: torch.Tensor, sym: bool, g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit parameters of w [out, in]: codes [out, in], zeros and fp16 scales [out, groups]."""
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(w.shape[0], groups), torch.empty(w.shape[0], groups, dtype=torch.int32)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s = (cols.abs().amax(1) / 7.5).half().float()
            z = torch.full_like(s, 8, dtype=torch.int32)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).half().float()
            z = torch.round(-lo / s).clamp(0, 15).to(torch.int32)
        scales[:, g], zeros[:, g] = s, z
    codes = torch.round(w / scales[:, g_idx] + zeros[:, g_idx]).clamp(0, 15).to(torch.int32)
    return codes, zeros, scales


def main() -> None:
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module
    from tiny_models import build_tiny_model

    from ladle.model.loader import resolve_model_path

    import gptqmodel
    from gptqmodel import QuantizeConfig

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model("llama", Path(tmp), resolve_model_path(None), **MODEL)
        floats = load_file(folder / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    configs: dict[str, dict] = {}
    for case, (quant, fmt) in CHECKPOINTS.items():
        spec = QUANTISATIONS[quant]
        qc = QuantizeConfig(bits=4, group_size=GROUP, sym=spec["sym"], desc_act=spec["act_order"],
                            **({"quant_method": "awq", "format": "gemm"} if fmt == "awq" else
                               {"format": "gptq_v2" if fmt == "gptq_v2" else "gptq"}))
        configs[case] = qc.to_dict()
        configs[case]["meta"].pop("offload_to_disk_path", None)  # a temporary folder of this run
    for case, (quant, fmt) in CHECKPOINTS.items():
        spec = QUANTISATIONS[quant]
        for i in range(MODEL["num_hidden_layers"]):
            for proj in PROJECTIONS:
                name = f"model.layers.{i}.{proj}"
                w = floats[name + ".weight"]
                n_out, n_in = w.shape
                g_idx = torch.arange(n_in, dtype=torch.int32) // GROUP
                if spec["act_order"]:  # GPTQ's desc_act: inputs quantised in a permuted order, groups scattered
                    perm = torch.randperm(n_in, generator=torch.Generator().manual_seed(i))
                    g_idx[perm] = torch.arange(n_in, dtype=torch.int32) // GROUP
                codes, zeros, scales = grid(w, spec["sym"], g_idx)
                on_grid = (scales[:, g_idx] * (codes - zeros[:, g_idx]).float())
                linear = torch.nn.Linear(n_in, n_out, bias=False)
                linear.weight.data = on_grid.clone()
                if fmt == "awq":
                    m = AwqTorchLinear(bits=4, group_size=GROUP, sym=False, desc_act=False, in_features=n_in,
                                      out_features=n_out, bias=False, register_buffers=True)
                    m.pack(linear, scales, zeros.float())
                    dq = dequantize_gemm(m.qweight, m.qzeros, m.scales.float(), 4, GROUP).T
                    tensors = {"qweight": m.qweight, "qzeros": m.qzeros, "scales": m.scales}
                else:
                    m = TorchLinear(bits=4, group_size=GROUP, sym=spec["sym"], desc_act=spec["act_order"],
                                    in_features=n_in, out_features=n_out, bias=False)
                    m.pack(linear, scales, zeros.float(), g_idx)
                    m.post_init()
                    half = m.scales
                    m.scales = half.float()  # dequantised in float32, not in fp16
                    dq = m.dequantize_weight().T
                    m.scales = half
                    if fmt == "gptq":  # the v1 checkpoint format, as GPTQModel saves it
                        convert_gptq_v2_to_v1_format_module(m, QuantizeConfig(bits=4, group_size=GROUP))
                    tensors = {"qweight": m.qweight, "qzeros": m.qzeros, "scales": m.scales, "g_idx": m.g_idx}
                assert torch.equal(dq, on_grid), (case, name)  # GPTQModel's own dequantisation gives the grid back
                for k, v in tensors.items():
                    out[f"{case}/{name}.{k}"] = v.clone().contiguous()
                ref = f"reference-{quant}/{name}"
                if ref + ".codes" in out:  # every format of one quantisation dequantises to the same weights
                    assert torch.equal(out[ref + ".codes"], codes.to(torch.uint8)), (case, name)
                out[ref + ".codes"] = codes.to(torch.uint8)
                out[ref + ".zeros"] = zeros.to(torch.uint8)
                out[ref + ".scales"] = scales.half()
                out[ref + ".g_idx"] = g_idx.clone()
    save_file(out, str(HERE / "gptqmodel_int4.safetensors"),
              metadata={"made_by": f"gptqmodel {gptqmodel.__version__}, tests/data/gptqmodel_int4/make.py"})
    (HERE / "quantization_configs.json").write_text(json.dumps(configs, indent=1, sort_keys=True) + "\n")
    print({k: v for k, v in configs.items()})


if __name__ == "__main__":
    main()
