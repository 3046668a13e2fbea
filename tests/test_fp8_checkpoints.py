"""FP8 checkpoints (ladle.model.fp8_checkpoints): a tiny Llama quantised to e4m3 by this test's own
quantiser and written in the HF "fp8" format (block scales, or one scale per tensor with static
activation scales) and in compressed-tensors' float-quantized one (per channel, per block). On the
CPU ladle dequantises them and must serve what transformers serves on the same weights: the
block-scaled HF checkpoint read by transformers' own FP8 loader, the others on the weights this
test dequantises in float64. Under --quantization fp8 the checkpoint's e4m3 values are kept as
they are."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_vs_hf import check_logprobs
from tiny_models import build_tiny_model, transformers_on

from ladle import LLM, SamplingParams
from ladle.model.fp8 import FP8, Fp8Linear, Fp8Weight, cat_fp8
from ladle.model.fp8_checkpoints import KEPT, is_fp8_config

PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "Write a haiku about the sea."]
BLOCK = (64, 64)


def quantise(w: torch.Tensor, block: tuple[int, int],
             scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] in blocks of `block` -> (e4m3 values, the scale grid in scale_dtype, the float32 weights they
    stand for, dequantised in float64)."""
    (rows, cols), (br, bc) = w.shape, block
    grid = w.double().reshape(rows // br, br, cols // bc, bc)
    scales = (grid.abs().amax(dim=(1, 3)) / 448.0).to(scale_dtype)
    spread = scales.double().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    q = (w.double() / spread).clamp(-448, 448).to(FP8)
    return q, scales, (q.double() * spread).float()


def write_checkpoint(src: Path, out: Path, fmt: str, block: tuple[int, int] = BLOCK) -> dict[str, torch.Tensor]:
    """The float tiny model at `src` in FP8 into `out` (fmt: hf-block, hf-tensor, ct-channel, ct-block), every
    projection (NAME_proj.weight: attention's, the MLPs', the experts'); returns the dequantised weights by HF
    name."""
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    dequant = {}
    for name in [n.removesuffix(".weight") for n in tensors if n.endswith("_proj.weight") and tensors[n].dim() == 2]:
        w = tensors.pop(name + ".weight")
        scaled = {"hf-tensor": tuple(w.shape), "ct-channel": (1, w.shape[1])}.get(fmt, block)
        scale_dtype = torch.bfloat16 if fmt == "ct-channel" else torch.float32  # as llm-compressor writes them
        q, scales, dequant[name + ".weight"] = quantise(w, scaled, scale_dtype)
        tensors[name + ".weight"] = q
        if fmt == "hf-block":
            tensors[name + ".weight_scale_inv"] = scales
        elif fmt == "hf-tensor":  # AutoFP8's: a 0-d scale, and a static activation scale ladle drops
            tensors[name + ".weight_scale"] = scales.reshape(())
            tensors[name + ".input_scale"] = torch.tensor(0.05)
            if name.endswith("k_proj"):  # and static KV scales, dropped too
                tensors[name.removesuffix("k_proj") + "k_scale"] = torch.tensor(0.1)
        else:
            tensors[name + ".weight_scale"] = scales
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    if fmt.startswith("hf"):
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic" if fmt == "hf-block" else "static"}
        if fmt == "hf-block":
            qc["weight_block_size"] = list(block)
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "channel" if fmt == "ct-channel" else "block"}
        if fmt == "ct-block":
            weights["block_structure"] = list(block)
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                  "num_bits": 8, "type": "float", "dynamic": True, "strategy": "token"}}}}
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (out / f.name).write_bytes(f.read_bytes())
    return dequant


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_dir: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("float"), smollm2_dir, hidden_size=128,
                            intermediate_size=256)


PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=1)


def test_block_scaled_hf_checkpoint_serves_what_transformers_fp8_loader_serves(tiny_llama: Path,
                                                                               tmp_path: Path) -> None:
    """transformers reads the HF format itself (its FineGrainedFP8 loader, dequantising on a CPU)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    folder = tmp_path / "hf-block"
    dequant = write_checkpoint(tiny_llama, folder, "hf-block")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    assert torch.equal(hf.model.layers[1].mlp.down_proj.weight, dequant["model.layers.1.mlp.down_proj.weight"])
    llm = LLM(str(folder), dtype="float32")
    assert llm.engine.runtime_info()["weights"] == "float"  # the CPU has no fp8 matmul: dequantised
    ours = llm.engine.runner.model.layers[1].down.weight
    assert torch.equal(ours, dequant["model.layers.1.mlp.down_proj.weight"])
    for res in llm.generate(PROMPTS, PARAMS):
        assert check_logprobs(res, hf, 3) < 2e-4


@pytest.mark.parametrize("fmt", ["hf-tensor", "ct-channel", "ct-block"])
def test_fp8_checkpoint_matches_transformers_on_its_dequantised_weights(tiny_llama: Path, tmp_path: Path, fmt: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    dequant = write_checkpoint(tiny_llama, tmp_path / fmt, fmt)
    caplog.set_level(logging.INFO)
    llm = LLM(str(tmp_path / fmt), dtype="float32")
    if fmt == "hf-tensor":  # its static scales: dropped, and said so
        assert "16 static activation and KV scales dropped" in caplog.text
    assert llm.engine.runtime_info()["weights"] == "float"
    o_proj = llm.engine.runner.model.layers[0].o_proj
    assert torch.equal(o_proj.weight, dequant["model.layers.0.self_attn.o_proj.weight"])
    hf = transformers_on(tiny_llama, dequant)
    for res in llm.generate(PROMPTS, PARAMS):
        assert check_logprobs(res, hf, 3) < 2e-4, fmt


def test_quantization_fp8_keeps_a_per_channel_checkpoints_values(tiny_llama: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ct-channel"
    write_checkpoint(tiny_llama, folder, "ct-channel")
    stored = load_file(folder / "model.safetensors")
    fp8, floats = LLM(str(folder), quantization="fp8", dtype="float32"), LLM(str(folder), dtype="float32")
    weights = fp8.engine.runtime_info()["weights"]
    assert weights == "fp8 e4m3 per row (checkpoint) + fp8 e4m3 per row (quantised at load)"  # the float LM head
    down = fp8.engine.runner.model.layers[1].down  # the checkpoint's bytes and scales, not quantised again
    assert isinstance(down, Fp8Linear) and down.source == "checkpoint"
    name = "model.layers.1.mlp.down_proj"
    assert torch.equal(down.qweight_t.t().view(torch.uint8), stored[name + ".weight"].view(torch.uint8))
    assert torch.equal(down.scales_t.t(), stored[name + ".weight_scale"].float())
    qkv = fp8.engine.runner.model.layers[0].qkv  # q, k and v stacked with their own row scales
    rows = [stored[f"model.layers.0.self_attn.{p}_proj.weight"].view(torch.uint8) for p in "qkv"]
    assert torch.equal(qkv.qweight_t.t().view(torch.uint8), torch.cat(rows))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ours = [r.outputs[0].token_ids[0] for r in fp8.generate(PROMPTS, params)]
    theirs = [r.outputs[0].token_ids[0] for r in floats.generate(PROMPTS, params)]
    assert sum(a == b for a, b in zip(ours, theirs)) >= 2  # activations in e4m3 too: most first tokens agree


def test_quantization_fp8_requantises_block_scales_per_row(tiny_llama: Path, tmp_path: Path) -> None:
    folder = tmp_path / "hf-block"
    dequant = write_checkpoint(tiny_llama, folder, "hf-block")
    llm = LLM(str(folder), quantization="fp8", dtype="float32")
    down = llm.engine.runner.model.layers[0].down
    assert down.source == "checkpoint, blocks re-quantised per row"
    exact = dequant["model.layers.0.mlp.down_proj.weight"]
    # one more e4m3 rounding, at most half a step (2^-4 relative) where the values are normal
    err = (down.dequantized() - exact).abs()
    normal = exact.abs() >= down.scales_t.t() * 2.0**-6
    assert (err[normal] <= exact.abs()[normal] * 2.0**-4 * (1 + 1e-6)).all()


def test_fp8_weights_cut_and_stack_as_their_dequantised_matrices() -> None:
    """Tensor-parallel cuts (rows, columns) and fused projections (stacked rows) against the float matrix."""
    g = torch.Generator().manual_seed(0)
    q, scales, exact = quantise(torch.randn(128, 192, generator=g), BLOCK)
    w = Fp8Weight(q, scales, BLOCK)
    assert torch.equal(w.dequantize(), exact)
    assert torch.equal(w.rows(slice(64, 128)).dequantize(), exact[64:])
    assert torch.equal(w.columns(slice(0, 128)).dequantize(), exact[:, :128])
    with pytest.raises(ValueError, match="blocks of 64 rows do not split at 32:96"):
        w.rows(slice(32, 96))
    per_row = Fp8Weight(*quantise(torch.randn(48, 64, generator=g), (1, 64))[:2], (1, 64))
    assert torch.equal(per_row.columns(slice(16, 48)).dequantize(), per_row.dequantize()[:, 16:48])
    per_tensor = Fp8Weight(*quantise(torch.randn(16, 64, generator=g), (16, 64))[:2], (16, 64))
    fused = cat_fp8([per_row, per_tensor])  # both one scale per row: they stack
    assert fused.block == (1, 64) and torch.equal(fused.dequantize(),
                                                  torch.cat([per_row.dequantize(), per_tensor.dequantize()]))
    assert cat_fp8([w, per_tensor]) is None  # blocks and rows: dequantised by the caller


def test_which_layers_stay_fp8_and_which_configs_are_fp8() -> None:
    assert KEPT.search("model.layers.3.self_attn.q_proj.weight") and KEPT.search("lm_head.weight")
    assert KEPT.search("model.layers.0.block_sparse_moe.experts.2.w1.weight")
    assert not KEPT.search("model.layers.0.self_attn.kv_b_proj.weight")  # MLA's latent: float
    assert not KEPT.search("model.layers.0.linear_attn.in_proj_qkvz.weight")
    assert is_fp8_config({"quant_method": "fp8"})
    assert not is_fp8_config({"quant_method": "compressed-tensors", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int"}}}})


@pytest.mark.parametrize("field, value, message", [
    ("fmt", "e5m2", "quantization_config.fmt 'e5m2'"),
    ("weight_block_size", [32, 32], "does not fit weight"),
])
def test_unreadable_fp8_checkpoints_are_refused_by_name(tiny_llama: Path, tmp_path: Path, field: str, value,
                                                        message: str) -> None:
    folder = tmp_path / "hf-block"
    write_checkpoint(tiny_llama, folder, "hf-block")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"][field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder))
