"""A GGUF's quantised blocks served as they are: the repacking against gguf-py's dequantisation
(exact), the grouped int8 kernel against float64 and its own definition on every instruction
set, and the embedded Q4_1 model served from its blocks against the same model dequantised."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors import safe_open
from test_canonical_linear import to_float32

from ladle import LLM, SamplingParams
from ladle.model import gguf_blocks
from ladle.model.gguf import convert_gguf
from ladle.model.loader import load_weights
from ladle.model.quantization import GroupedWeight, Int8Linear, cat_weights

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1]
# the embedded model: Q4_1 layers, and a tied Q8_0 embedding serving the LM head
EMBEDDED_WEIGHTS = "4-bit in groups of 32 (GGUF blocks) + int8 in groups of 32 (GGUF blocks)"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_repack_to_exactly_gguf_pys_weights(qtype: Q) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((7, 160)) * rng.random((7, 1)) * 3).astype(np.float32)
    w[2] = 0.0
    blocks = quantize(w, qtype)
    q, scales, mins = (None if a is None else torch.from_numpy(a) for a in gguf_blocks.unpack(blocks, qtype, 7, 160))
    grouped = GroupedWeight(q, scales, mins)
    assert q.dtype == torch.int8 and grouped.size == 32 and (mins is None) == (qtype == Q.Q8_0)
    assert grouped.four_bit == (qtype != Q.Q8_0)  # the 4-bit types keep q in 0..15, offsets in the minimums
    assert torch.equal(grouped.dequantize(), torch.from_numpy(dequantize(blocks, qtype).reshape(7, 160)))
    with pytest.raises(ValueError, match="does not hold"):
        gguf_blocks.unpack(blocks, qtype, 7, 128)


def grouped_operands(k: int, n: int, size: int, rows: int = 40, mins: bool = True, four_bit: bool = False):
    gen = torch.Generator().manual_seed(k + n)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8) if four_bit else \
        torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // size, generator=gen) * 0.02
    m = torch.randn(n, k // size, generator=gen) * 0.1 if mins else None
    return torch.randn(rows, k, generator=gen), GroupedWeight(q, scales, m), torch.randn(n, generator=gen)


@pytest.mark.parametrize("four_bit", [False, True], ids=["int8", "4-bit"])
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("shape", [(64, 5), (576, 960), (1536, 576), (96, 33)])
def test_grouped_kernel_matches_float64_and_is_row_invariant(isa_kernels, shape, mins: bool, four_bit: bool) -> None:
    k, n = shape
    x, w, b = grouped_operands(k, n, 32, mins=mins, four_bit=four_bit)
    packed = isa_kernels.pack_panels(w.q, four_bit=four_bit)
    assert packed.dtype == (torch.uint8 if four_bit else torch.int8) and packed.numel() == -(-n // 16) * 16 * k // (
        1 + four_bit)
    groups = (32, isa_kernels.pack_groups(w.scales), None if w.mins is None else isa_kernels.pack_groups(w.mins))
    y = isa_kernels.canonical_linear(x, packed, n, b, groups=groups)
    ref = x.double() @ w.dequantize(torch.float64).T + b.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    for rows in (1, 2, 3, 5, 12, 13, 25, 40):
        assert torch.equal(isa_kernels.canonical_linear(x[:rows], packed, n, b, groups=groups), y[:rows]), rows
    with pytest.raises(ValueError, match="tile"):
        isa_kernels.canonical_linear(x, packed, n, b, groups=(48, groups[1], groups[2]))
    with pytest.raises(ValueError, match="scales or groups"):
        isa_kernels.canonical_linear(x, packed, n, b, torch.ones(n), groups)


@pytest.mark.parametrize("four_bit", [False, True], ids=["int8", "4-bit"])
def test_grouped_kernel_is_each_groups_chain_folded_in(isa_kernels, four_bit: bool) -> None:
    """The definition, element by element: each group's FMA chain from zero, then
    acc = fma(chain, scale, acc) and acc = fma(x's group sum, min, acc); then + bias."""
    x, w, b = grouped_operands(64, 19, 16, rows=3, four_bit=four_bit)
    groups = (16, isa_kernels.pack_groups(w.scales), isa_kernels.pack_groups(w.mins))
    y = isa_kernels.canonical_linear(x, isa_kernels.pack_panels(w.q, four_bit=four_bit), 19, b, groups=groups)
    for row, col in ((0, 0), (1, 16), (2, 18)):
        acc = 0.0
        for g in range(4):
            part, xsum = 0.0, 0.0
            for i in range(16 * g, 16 * g + 16):
                part = to_float32(Fraction(x[row, i].item()) * int(w.q[col, i]) + Fraction(part))
                xsum = to_float32(Fraction(xsum) + Fraction(x[row, i].item()))
            acc = to_float32(Fraction(part) * Fraction(w.scales[col, g].item()) + Fraction(acc))
            acc = to_float32(Fraction(xsum) * Fraction(w.mins[col, g].item()) + Fraction(acc))
        assert y[row, col].item() == to_float32(Fraction(acc) + Fraction(b[col].item()))


def test_4bit_panels_hold_the_same_values_as_int8_panels(isa_kernels) -> None:
    """Two values to a byte is only storage: every row count (the wide decode tile, several row
    tiles sharing widened panels) gives the int8 panels' very bits."""
    x, w, b = grouped_operands(320, 70, 32, rows=30, four_bit=True)
    groups = (32, isa_kernels.pack_groups(w.scales), isa_kernels.pack_groups(w.mins))
    int8, four = isa_kernels.pack_panels(w.q), isa_kernels.pack_panels(w.q, four_bit=True)
    for rows in (1, 2, 3, 13, 30):
        assert torch.equal(isa_kernels.canonical_linear(x[:rows], four, 70, b, groups=groups),
                           isa_kernels.canonical_linear(x[:rows], int8, 70, b, groups=groups)), rows
    with pytest.raises(ValueError, match="0..15"):
        isa_kernels.pack_panels(w.q - 1, four_bit=True)
    with pytest.raises(ValueError, match="4-bit panels"):
        isa_kernels.canonical_linear(x, four, 70, b, groups=(5, isa_kernels.pack_groups(torch.rand(70, 64)), None))
    with pytest.raises(ValueError, match="4-bit panels"):  # the kernel reads 4-bit panels only in groups
        isa_kernels.canonical_linear(x, four, 70, b, torch.ones(70))


@pytest.mark.parametrize("four_bit", [False, True], ids=["int8", "4-bit"])
def test_fp16_group_parameters_give_the_float32_ones_bits(isa_kernels, four_bit: bool) -> None:
    """Scales and minimums that are fp16 values (a GGUF's) held as fp16 are widened exactly: the
    same outputs to the bit as the same values held as float32, in every tile shape."""
    x, w, b = grouped_operands(320, 70, 32, rows=30, four_bit=four_bit)
    w.scales, w.mins = w.scales.half().float(), w.mins.half().float()
    packed = isa_kernels.pack_panels(w.q, four_bit=four_bit)
    for mins in (w.mins, None):
        wide = [(32, isa_kernels.pack_groups(w.scales, dtype), None if mins is None else
                 isa_kernels.pack_groups(mins, dtype)) for dtype in (torch.float32, torch.float16)]
        assert wide[1][1].dtype == torch.float16
        for rows in (1, 2, 3, 13, 30):
            assert torch.equal(isa_kernels.canonical_linear(x[:rows], packed, 70, b, groups=wide[1]),
                               isa_kernels.canonical_linear(x[:rows], packed, 70, b, groups=wide[0])), rows
    with pytest.raises(ValueError, match="not all exactly float16"):
        isa_kernels.pack_groups(torch.tensor([[0.1]]), torch.float16)
    with pytest.raises(ValueError, match="share a dtype"):
        isa_kernels.canonical_linear(x, packed, 70, b, groups=(32, wide[1][1], wide[0][1]))


@pytest.fixture(scope="module")
def blocks_and_float(smollm2_dir: Path) -> tuple[LLM, LLM]:
    return LLM(str(smollm2_dir)), LLM(str(smollm2_dir), quantization="none")


def test_the_embedded_model_is_served_from_its_blocks(blocks_and_float) -> None:
    """auto serves the Q4_1 layers (and the tied Q8_0 head) from their blocks: the same weights as the
    dequantised model, so outputs agree to float rounding, at under a third of the bytes."""
    blocks, floats = blocks_and_float
    info = blocks.engine.runtime_info()
    assert info["quantization"] == "auto" and info["weights"] == EMBEDDED_WEIGHTS
    assert floats.engine.runtime_info()["weights"] == "float"
    assert all(isinstance(lin, Int8Linear) and lin.group_size == 32 for lin in blocks.engine.runner.model.linears)
    read = [sum(lin.nbytes for lin in llm.engine.runner.model.linears) for llm in (blocks, floats)]
    assert read[0] * 4.5 < read[1]
    for lin in blocks.engine.runner.model.layers[0].linears:  # Q4_1: half a byte, fp16 scale and min per 32
        assert lin._groups[1].dtype == torch.float16
        assert lin.nbytes == pytest.approx(0.625 * lin.in_features * -(-lin.out_features // 16) * 16)
    ids = blocks.tokenizer.encode("The river rose through the night, and by morning the low fields were under water.")
    params = SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=1, logprobs=1)
    a, b = (llm.generate([ids], params)[0] for llm in (blocks, floats))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    deltas = [abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
    assert max(deltas) < 1e-3, max(deltas)


def test_scoring_on_blocks_is_bit_identical_alone_batched_and_cached(blocks_and_float) -> None:
    blocks, _ = blocks_and_float
    tok = blocks.tokenizer
    prompts = [tok.encode(f"Question {i}: is the sky blue? Answer yes or no.\nAnswer:") for i in range(3)]
    params = SamplingParams(label_token_ids=[tok.encode(" yes")[0], tok.encode(" no")[0]])
    alone = blocks.generate([prompts[1]], params)[0].outputs[0].label_logprobs
    batched = blocks.generate(prompts, params)[1].outputs[0].label_logprobs
    cached = blocks.generate([prompts[1]], params)[0].outputs[0].label_logprobs
    assert alone == batched == cached


# --- the other types of llama.cpp's Q4_K_M files: Q4_K, Q6_K, and Q5_0 / Q5_1 where rows do not
# split into 256s ---

FACTORS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q5_1: (0, 2)}  # offsets of the fp16 factors


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks (gguf-py quantises no k-quant) whose fp16 factors are small, finite numbers."""
    inputs, size = GGML_QUANT_SIZES[qtype]
    factors = FACTORS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // inputs, size), dtype=np.uint8)
    for at in factors:
        values = (rng.random(blocks.shape[0]) * 4e-4 + 1e-4).astype(np.float16)
        blocks[:, at:at + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize("qtype", list(FACTORS), ids=lambda t: t.name)
def test_k_quant_and_5_bit_blocks_repack_to_exactly_gguf_pys_weights(qtype: Q) -> None:
    blocks = random_blocks(qtype, 3, 512, np.random.default_rng(1))
    q, scales, mins = (None if a is None else torch.from_numpy(a) for a in gguf_blocks.unpack(blocks, qtype, 3, 512))
    grouped = GroupedWeight(q, scales, mins)
    assert grouped.size == (16 if qtype == Q.Q6_K else 32)
    assert grouped.four_bit == (qtype == Q.Q4_K)  # Q6_K's values (-32..31) and 5-bit ones are int8
    assert torch.equal(grouped.dequantize(), torch.from_numpy(np.asarray(dequantize(blocks, qtype)).reshape(3, 512)))
    with pytest.raises(ValueError, match="does not hold"):
        gguf_blocks.unpack(blocks, qtype, 6, 256 + 32)


def test_groups_of_different_sizes_fuse_in_the_smaller_size() -> None:
    rng = np.random.default_rng(2)
    parts = [GroupedWeight(*(None if a is None else torch.from_numpy(a)
                             for a in gguf_blocks.unpack(random_blocks(qtype, 2, 256, rng), qtype, 2, 256)))
             for qtype in (Q.Q4_K, Q.Q6_K)]
    fused = cat_weights(parts, torch.float32)
    assert isinstance(fused, GroupedWeight) and fused.size == 16 and not fused.four_bit
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def _write_q4_k_m_gguf(path: Path) -> None:
    """A tiny random llama whose layers mix types as a Q4_K_M file does (attn_v and ffn_down in Q6_K,
    the rest Q4_K) and as its fallbacks do (attn_k in Q5_0, ffn_up in Q5_1), the embedding in Q8_0,
    norms in F32."""
    from test_loader import _tokenizer_fields

    rng = np.random.default_rng(3)
    hidden, inter, layers, vocab = 256, 512, 2, 49152
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(layers), w.add_context_length(512), w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter), w.add_head_count(4), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0), w.add_rope_dimension_count(64)
    for key, (value, vtype, sub_type) in _tokenizer_fields().items():
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    embed = (rng.standard_normal((vocab, hidden)) * 0.05).astype(np.float32)
    w.add_tensor("token_embd.weight", quantize(embed, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    shapes = {"attn_q": (hidden, hidden), "attn_k": (128, hidden), "attn_v": (128, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    for i in range(layers):
        for name, (rows, cols) in shapes.items():
            qtype = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "attn_k": Q.Q5_0, "ffn_up": Q.Q5_1}.get(name, Q.Q4_K)
            blocks = random_blocks(qtype, rows, cols, rng).reshape(rows, -1)
            w.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def test_a_q4_k_m_model_is_served_from_its_blocks(tmp_path: Path) -> None:
    """Q4_K layers held as 4-bit groups of 32, Q6_K ones as int8 groups of 16, 5-bit ones as int8
    groups of 32 (q/k/v fused in groups of 16, gate/up as int8): the very weights gguf-py
    dequantises to, so the same greedy tokens and prompt log-probabilities to float rounding, on
    prompts long enough for the widened path too."""
    path = tmp_path / "tiny-Q4_K_M.gguf"
    _write_q4_k_m_gguf(path)
    folder = convert_gguf(path, tmp_path / "converted")
    grouped = {name: w for name, w in load_weights(folder).items() if isinstance(w, GroupedWeight)}
    assert len(grouped) == 2 * 7 + 1  # and the tied Q8_0 embedding as the LM head
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:  # gguf-py's dequantisation
        for name, w in grouped.items():
            float_name = "model.embed_tokens.weight" if name == "lm_head.weight" else name  # tied
            assert torch.equal(w.dequantize(), f.get_tensor(float_name)), name
    blocks, floats = LLM(str(path)), LLM(str(path), quantization="none")
    weights = blocks.engine.runtime_info()["weights"]
    assert "4-bit in groups of 32" in weights and "int8 in groups of 16" in weights and "float" not in weights
    assert "int8 in groups of 32" in weights
    layer = blocks.engine.runner.model.layers[0]
    assert [(lin.bits, lin.group_size) for lin in layer.linears] == [(8, 16), (4, 32), (8, 32), (8, 16)]
    for ids in ([1, 400, 3000, 17, 9000, 42], list(range(100, 400))):
        params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1)
        a, b = (llm.generate([ids], params)[0] for llm in (blocks, floats))
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        deltas = [abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
        assert max(deltas) < 1e-3, max(deltas)
