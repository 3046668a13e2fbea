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
from gguf.quants import dequantize, quantize
from test_canonical_linear import to_float32

from ladle import LLM, SamplingParams
from ladle.model import gguf_blocks
from ladle.model.quantization import GroupedWeight, Int8Linear

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
    for rows in (1, 2, 5, 12, 13, 25, 40):
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
