"""4-bit GPTQ and AWQ checkpoints: a tiny Llama quantised to 4 bits in groups of 32, written in each
format by this test's own packers, served by ladle and compared with transformers running the same
model on the dequantised weights (scale * (q - zero), in float32). And the independent reference:
checkpoints packed by GPTQModel (GPTQ v1 and v2, symmetric, asymmetric and act-order; AWQ GEMM), with the
weights GPTQModel's own dequantisers give (tests/data/gptqmodel_int4, written by its make.py): ladle's
float weights equal them bit for bit, and its 4-bit layers serve them as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_vs_hf import check_logprobs
from tiny_models import build_tiny_model, transformers_on

from ladle import LLM, SamplingParams
from ladle.model.quantization import Int8Linear

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

GROUP = 32
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "Write a haiku about the sea."]


def quantise(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> q [in, out] (0..15), zeros and fp16 scales [in / GROUP, out], as GPTQ and AWQ lay them out."""
    g = w.T.reshape(-1, GROUP, w.shape[0])  # [groups, GROUP, out]
    if sym:
        scales = (g.abs().amax(1) / 7.5).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        lo, hi = g.amin(1), g.amax(1)
        scales = ((hi - lo) / 15).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, 15).to(torch.int32)
    q = torch.round(g / scales.float()[:, None] + zeros[:, None]).clamp(0, 15).to(torch.int32)
    return q.reshape(w.shape[1], w.shape[0]), zeros, scales


def dequantised(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    return (scales.float()[g_idx] * (q - zeros[g_idx]).float()).T.contiguous()


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight: eight rows per int32 row, row 8i + j in bits 4j."""
    v = values.to(torch.int64).reshape(-1, 8, values.shape[1])
    return _as_int32(sum(v[:, j] << (4 * j) for j in range(8)))


def pack_columns(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight columns per int32 column, column 8c + order[j] in bits 4j (GPTQ's qzeros; AWQ's everything)."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    return _as_int32(sum(v[:, :, order[j]] << (4 * j) for j in range(8)))


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_checkpoint(src: Path, out: Path, method: str, sym: bool = False, act_order: bool = False,
                     v2: bool = False) -> dict[str, torch.Tensor]:
    """The float tiny model at `src` quantised into `out`; returns the dequantised weights by HF name."""
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    layers = config["num_hidden_layers"]
    dequant = {}
    for i in range(layers):
        for proj in PROJECTIONS:
            name = f"model.layers.{i}.{proj}"
            w = tensors.pop(name + ".weight")
            in_features = w.shape[1]
            g_idx = torch.arange(in_features, dtype=torch.int32) // GROUP
            if act_order:  # GPTQ's desc_act: inputs quantised in a permuted order, groups scattered
                perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(i))
                q, zeros, scales = quantise(w[:, perm], sym)
                g_idx = torch.empty_like(g_idx)
                g_idx[perm] = torch.arange(in_features, dtype=torch.int32) // GROUP
                inverse = torch.argsort(perm)
                q = q[inverse]
            else:
                q, zeros, scales = quantise(w, sym)
            dequant[name + ".weight"] = dequantised(q, zeros, scales, g_idx.long())
            if method == "awq":
                tensors[name + ".qweight"] = pack_columns(q, AWQ_PACK_ORDER)
                tensors[name + ".qzeros"] = pack_columns(zeros, AWQ_PACK_ORDER)
            else:
                tensors[name + ".qweight"] = pack_rows(q)
                tensors[name + ".qzeros"] = pack_columns(zeros if v2 else zeros - 1)
                tensors[name + ".g_idx"] = g_idx
            tensors[name + ".scales"] = scales
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    qc = {"quant_method": method, "bits": 4, "group_size": GROUP}
    qc.update({"version": "gemm", "zero_point": True} if method == "awq" else
              {"desc_act": act_order, "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (out / f.name).write_bytes(f.read_bytes())
    return dequant


AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble j takes column order[j]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_dir: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("float"), smollm2_dir, hidden_size=128,
                            intermediate_size=256)


CASES = {
    "gptq-sym": dict(method="gptq", sym=True),
    "gptq-asym-v2": dict(method="gptq", v2=True),
    "gptq-asym": dict(method="gptq"),
    "awq": dict(method="awq"),
}


@pytest.mark.parametrize("case", CASES)
def test_4bit_checkpoint_matches_transformers_on_its_dequantised_weights(tiny_llama: Path, tmp_path: Path,
                                                                        case: str) -> None:
    dequant = write_checkpoint(tiny_llama, tmp_path / case, **CASES[case])
    llm = LLM(str(tmp_path / case), dtype="float32")
    layers = [lin for layer in llm.engine.runner.model.layers for lin in layer.linears]
    assert all(isinstance(lin, Int8Linear) and lin.quantized and lin.group_size == GROUP for lin in layers)
    method = CASES[case]["method"].upper()
    assert llm.engine.runtime_info()["weights"] == f"4-bit in groups of {GROUP} ({method}) + float"  # + the LM head
    assert all(lin._int8_panels.dtype == torch.uint8 for lin in layers)  # two 4-bit values to a byte:
    # half a byte per weight, and a float32 scale and minimum per 32 (1.25 bytes held as int8)
    assert sum(lin.nbytes for lin in layers) < 0.8 * sum(lin.in_features * lin.out_features for lin in layers)
    hf = transformers_on(tiny_llama, dequant)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    for res in llm.generate(PROMPTS, params):
        assert check_logprobs(res, hf, 3) < 2e-4, case


def test_act_order_gptq_is_served_as_float_with_the_same_weights(tiny_llama: Path, tmp_path: Path) -> None:
    dequant = write_checkpoint(tiny_llama, tmp_path / "act", "gptq", act_order=True)
    llm = LLM(str(tmp_path / "act"), dtype="float32")
    assert llm.engine.runtime_info()["weights"] == "float"
    hf = transformers_on(tiny_llama, dequant)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    for res in llm.generate(PROMPTS, params):
        assert check_logprobs(res, hf, 3) < 2e-4


def test_quantization_none_dequantises_a_4bit_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    write_checkpoint(tiny_llama, tmp_path / "awq", "awq")
    grouped, floats = LLM(str(tmp_path / "awq"), dtype="float32"), LLM(str(tmp_path / "awq"), quantization="none")
    assert floats.engine.runtime_info()["weights"] == "float"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert ([r.outputs[0].token_ids for r in grouped.generate(PROMPTS, params)]
            == [r.outputs[0].token_ids for r in floats.generate(PROMPTS, params)])


@pytest.mark.parametrize("field, value, message", [
    ("bits", 8, "bits 8"),
    ("quant_method", "bitsandbytes", "quant_method 'bitsandbytes'"),
    ("version", "gemv", "version 'gemv'"),
])
def test_unreadable_quantization_configs_are_refused_by_name(tiny_llama: Path, tmp_path: Path, field: str,
                                                             value, message: str) -> None:
    folder = tmp_path / "awq"
    write_checkpoint(tiny_llama, folder, "awq")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"][field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"quantization_config.{message}"):
        LLM(str(folder))


# -- checkpoints packed by GPTQModel -------------------------------------------------------------------------

GPTQMODEL = Path(__file__).parent / "data" / "gptqmodel_int4"
# each checkpoint in gptqmodel_int4.safetensors, and the quantisation (the reference weights) it carries
GPTQMODEL_CASES = {"gptq-sym": "sym", "gptq-asym": "asym", "gptq-asym-v2": "asym", "awq": "asym",
                   "gptq-act-order": "act-order"}


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory, smollm2_dir: Path) -> Path:
    """The float model GPTQModel's checkpoints were quantised from (make.py's MODEL): its other tensors."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("float1"), smollm2_dir, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=1)


def gptqmodel_checkpoint(src: Path, out: Path, case: str) -> dict[str, torch.Tensor]:
    """A checkpoint folder: `src`'s tensors less the projections' float weights, GPTQModel's packed tensors of
    `case` and GPTQModel's quantization_config. Returns the reference weights by HF name: GPTQModel's
    dequantisation (scale * (code - zero) in float32, from the codes make.py stored)."""
    packed = load_file(GPTQMODEL / "gptqmodel_int4.safetensors")
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items()
               if not k.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))}
    tensors |= {k.split("/", 1)[1]: v for k, v in packed.items() if k.startswith(case + "/")}
    reference = {}
    for key in packed:
        if key.startswith(f"reference-{GPTQMODEL_CASES[case]}/") and key.endswith(".codes"):
            name = key.split("/", 1)[1].removesuffix(".codes")
            codes, zeros, scales, g_idx = (packed[f"reference-{GPTQMODEL_CASES[case]}/{name}.{part}"]
                                           for part in ("codes", "zeros", "scales", "g_idx"))
            g = g_idx.long()
            reference[name + ".weight"] = scales.float()[:, g] * (codes.float() - zeros.float()[:, g])
    assert len(reference) == len(PROJECTIONS)
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    qc = json.loads((GPTQMODEL / "quantization_configs.json").read_text())[case]
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (out / f.name).write_bytes(f.read_bytes())
    return reference


@pytest.mark.parametrize("case", GPTQMODEL_CASES)
def test_gptqmodels_checkpoints_dequantise_to_gptqmodels_weights(one_layer_llama: Path, tmp_path: Path,
                                                                 case: str) -> None:
    """--quantization none: ladle's float weights are GPTQModel's dequantisation, bit for bit."""
    reference = gptqmodel_checkpoint(one_layer_llama, tmp_path / case, case)
    llm = LLM(str(tmp_path / case), dtype="float32", quantization="none", kv_cache_memory_gib=0.05)
    assert llm.engine.runtime_info()["weights"] == "float"
    (layer,) = llm.engine.runner.model.layers
    ref = {p.split(".")[1]: reference[f"model.layers.0.{p}.weight"] for p in PROJECTIONS}
    assert torch.equal(layer.qkv.weight, torch.cat([ref["q_proj"], ref["k_proj"], ref["v_proj"]]))
    assert torch.equal(layer.o_proj.weight, ref["o_proj"])
    assert torch.equal(layer.gate_up.weight, torch.cat([ref["gate_proj"], ref["up_proj"]]))
    assert torch.equal(layer.down.weight, ref["down_proj"])


@pytest.mark.parametrize("case", GPTQMODEL_CASES)
def test_gptqmodels_checkpoints_serve_as_transformers_on_gptqmodels_weights(one_layer_llama: Path, tmp_path: Path,
                                                                           case: str) -> None:
    """The 4-bit layers (act-order: float, as ladle serves it) against transformers on GPTQModel's weights."""
    reference = gptqmodel_checkpoint(one_layer_llama, tmp_path / case, case)
    llm = LLM(str(tmp_path / case), dtype="float32", kv_cache_memory_gib=0.05)
    method = "AWQ" if case == "awq" else "GPTQ"
    expect = "float" if case == "gptq-act-order" else f"4-bit in groups of {GROUP} ({method}) + float"
    assert llm.engine.runtime_info()["weights"] == expect
    hf = transformers_on(one_layer_llama, reference)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    for res in llm.generate(PROMPTS, params):
        assert check_logprobs(res, hf, 3) < 2e-4, case
