"""Weight-only int8: the quantiser, the int8 canonical kernel against float64 and its own FMA-chain
definition on every instruction set, and a quantised model against its float original."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from test_canonical_linear import SHAPES, to_float32

from ladle import LLM, SamplingParams
from ladle.model.kernels import loader
from ladle.model.quantization import Int8Linear, dequantize_int8, quantize_int8

TEXT = ("The river rose through the night, and by morning the low fields were under water. Farmers moved "
        "their animals to the hills, and the school opened its doors to families who had nowhere else to go.")


def operands(k: int, n: int, rows: int = 40):
    gen = torch.Generator().manual_seed(k * 7 + n)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)  # rows of different ranges
    return torch.randn(rows, k, generator=gen), w, torch.randn(n, generator=gen)


def test_quantiser_error_is_half_a_step() -> None:
    _, w, _ = operands(300, 70)
    w[3] = 0.0  # an all-zero row stays zero
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and (q[3] == 0).all()
    assert ((dequantize_int8(q, scales) - w).abs() <= scales[:, None] / 2 + 1e-7).all()
    assert (q.abs().amax(dim=1)[[i for i in range(70) if i != 3]] == 127).all()  # each row uses the full range


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_kernel_matches_float64_and_is_row_invariant(isa_kernels, shape) -> None:
    k, n = shape
    x, w, b = operands(k, n)
    q, scales = quantize_int8(w)
    packed = isa_kernels.pack_panels(q)
    assert packed.dtype == torch.int8
    y = isa_kernels.canonical_linear(x, packed, n, b, scales)
    ref = x.double() @ dequantize_int8(q, scales).double().T + b.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    for rows in (1, 2, 5, 12, 13, 25, 40):
        assert torch.equal(isa_kernels.canonical_linear(x[:rows], packed, n, b, scales), y[:rows]), rows
    with pytest.raises(ValueError, match="scales"):
        isa_kernels.canonical_linear(x, packed, n, b)


def test_int8_kernel_is_the_fma_chain_then_the_scale(isa_kernels) -> None:
    x, w, b = operands(61, 19, rows=3)
    q, scales = quantize_int8(w)
    y = isa_kernels.canonical_linear(x, isa_kernels.pack_panels(q), 19, b, scales)
    for row, col in ((0, 0), (1, 16), (2, 18)):
        acc = 0.0
        for xi, qi in zip(x[row].tolist(), q[col].tolist()):
            acc = to_float32(Fraction(xi) * qi + Fraction(acc))
        scaled = to_float32(Fraction(acc) * Fraction(scales[col].item()))
        assert y[row, col].item() == to_float32(Fraction(scaled) + Fraction(b[col].item()))


def test_int8_linear_without_native_kernels_is_the_dequantised_float_layer(monkeypatch) -> None:
    x, w, b = operands(96, 40, rows=5)
    native = Int8Linear(w, b)
    monkeypatch.setenv("LADLE_NATIVE_KERNELS", "0")
    loader.reset()
    try:
        fallback = Int8Linear(w, b)
        assert not fallback.quantized and fallback.nbytes == 40 * 96 * 4
        q, scales = quantize_int8(w)
        assert torch.equal(fallback(x), torch.nn.functional.linear(x, dequantize_int8(q, scales), b))
    finally:
        monkeypatch.undo()
        loader.reset()
    if loader.enabled():
        assert native.quantized and native.nbytes == 48 * 96 + 40 * 4  # panels of 16 columns, and the scales
        assert torch.allclose(native(x), fallback(x), rtol=1e-5, atol=1e-5)
        # any layout of the input: rows of a 3-D batch, a transposed (column-major) matrix
        assert torch.equal(native(x.reshape(5, 1, 96)).reshape(5, 40), native(x))
        assert torch.equal(native(x.T.contiguous().T), native(x))


@pytest.fixture(scope="module")
def float_and_int8(smollm2_float_dir) -> tuple[LLM, LLM]:
    """A float checkpoint, and the same quantised per row at load."""
    return LLM(str(smollm2_float_dir)), LLM(str(smollm2_float_dir), quantization="int8")


def _prompt_logprobs(llm: LLM, ids: list[int]) -> list:
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    return out[0].prompt_logprobs[1:]


def test_int8_model_tracks_the_float_model(float_and_int8) -> None:
    """On a fixed text: the int8 model's top-1 next token agrees with float32's at >= 90% of
    positions, and the log-probability of each actual next token moves by < 0.15 on average."""
    fp, q8 = float_and_int8
    ids = fp.tokenizer.encode(TEXT)
    ref, got = _prompt_logprobs(fp, ids), _prompt_logprobs(q8, ids)
    agree = sum(r.top[0][0] == g.top[0][0] for r, g in zip(ref, got)) / len(ref)
    delta = sum(abs(r.logprob - g.logprob) for r, g in zip(ref, got)) / len(ref)
    nll = {name: -sum(lp.logprob for lp in lps) / len(lps) for name, lps in (("fp", ref), ("q8", got))}
    assert agree >= 0.9 and delta < 0.15, (agree, delta)
    assert abs(math.exp(nll["q8"]) / math.exp(nll["fp"]) - 1) < 0.05, nll  # perplexity within 5%
    assert sum(lin.nbytes for lin in q8.engine.runner.model.linears) * 3.5 < \
        sum(lin.nbytes for lin in fp.engine.runner.model.linears)
    assert q8.engine.runtime_info()["quantization"] == "int8" and q8.engine.runtime_info()["weights"] == "int8 per row"
    assert fp.engine.runtime_info()["weights"] == "float"


def test_int8_scoring_is_bit_identical_alone_batched_and_cached(float_and_int8) -> None:
    _, q8 = float_and_int8
    tok = q8.tokenizer
    prompts = [tok.encode(f"Question {i}: is the sky blue? Answer yes or no.\nAnswer:") for i in range(3)]
    labels = [tok.encode(" yes")[0], tok.encode(" no")[0]]
    params = SamplingParams(label_token_ids=labels)
    alone = q8.generate([prompts[1]], params)[0].outputs[0].label_logprobs
    batched = q8.generate(prompts, params)[1].outputs[0].label_logprobs
    cached = q8.generate([prompts[1]], params)[0].outputs[0].label_logprobs
    assert alone == batched == cached
