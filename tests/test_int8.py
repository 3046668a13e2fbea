"""Weight-only int8: the quantiser; the integer dot-product kernel (8-bit activations) against float64
within its rounding and against its own definition bit for bit, on every instruction set; the exact
FMA-chain kernel that serves inputs off its block size; and a quantised model against its float original."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from test_canonical_linear import to_float32

from ladle import LLM, SamplingParams
from ladle.model.kernels import loader
from ladle.model.kernels.native import DOT_BLOCK
from ladle.model.quantization import WIDEN_ROWS, Int8Linear, dequantize_int8, quantize_int8

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

TEXT = ("The river rose through the night, and by morning the low fields were under water. Farmers moved "
        "their animals to the hills, and the school opened its doors to families who had nowhere else to go. "
        "By noon the rain had stopped, but the water kept rising for two more days, fed by the snow melting in "
        "the mountains.\n\nLibraries have always been more than rooms full of books. In the nineteenth century "
        "they were places where working people could educate themselves after long days in factories; today "
        "they lend laptops, teach children to read, and offer a quiet, warm place to anyone who walks in.\n\n"
        "To repair a bicycle puncture, remove the wheel, lever the tyre off the rim and pull out the inner "
        "tube. Pump a little air into the tube and listen for the hiss, or pass it through a bowl of water "
        "and watch for bubbles.")


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


DOT_SHAPES = [(32, 5), (64, 40), (576, 960), (1536, 576), (896, 1001)]  # (in, out): panel tails, one block


def quantised_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activations, by its definition: per block of 32 inputs, xq = x * (127 / a) in
    float32 rounded to nearest even (a = max |x| over the block) and the scale a / 127."""
    blocks = x.view(x.shape[0], -1, DOT_BLOCK)
    a = blocks.abs().amax(dim=-1, keepdim=True)
    xq = torch.where(a > 0, torch.round(blocks * (127.0 / a)), torch.zeros_like(blocks))
    return xq.view_as(x), (a / 127.0).squeeze(-1)


@pytest.mark.parametrize("shape", DOT_SHAPES)
def test_int8_dot_kernel_is_within_its_activation_rounding_of_float64(isa_kernels, shape) -> None:
    """Against float64 on the dequantised weights, each output within the rounding of its 8-bit
    activations (half a step per input, times |W|) plus float32 summation; and row-invariant."""
    k, n = shape
    x, w, b = operands(k, n)
    q, scales = quantize_int8(w)
    packed, padded = isa_kernels.pack_dot(q, scales)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-n // 16), k // 4, 16, 4)
    y = isa_kernels.int8_dot_linear(x, packed, padded, n, b)
    wf = dequantize_int8(q, scales).double()
    ref = x.double() @ wf.T + b.double()
    _, sx = quantised_rows(x)
    step = sx.double().repeat_interleave(DOT_BLOCK, dim=1)  # [rows, k]: each input's step
    bound = 0.5 * step @ wf.abs().T + 1e-6 * (x.double().abs() @ wf.abs().T + b.double().abs())
    assert ((y.double() - ref).abs() <= bound).all()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    for rows in (1, 2, 3, 5, 12, 13, 25, 40):
        assert torch.equal(isa_kernels.int8_dot_linear(x[:rows], packed, padded, n, b), y[:rows]), rows
    with pytest.raises(ValueError, match="do not take rows"):
        isa_kernels.int8_dot_linear(x[:, :-DOT_BLOCK].contiguous(), packed, padded, n, b)


def test_int8_dot_kernel_is_its_integer_sums_folded_in_by_block(isa_kernels) -> None:
    """Bit for bit the definition (so the same bits on every instruction set): per block the exact
    integer sum of q * xq, folded in as fma(float(sum), block scale, acc), then * s + bias."""
    x, w, b = operands(96, 19, rows=3)
    x[1, 32:64] = 0.0  # an all-zero block
    q, scales = quantize_int8(w)
    y = isa_kernels.int8_dot_linear(x, *isa_kernels.pack_dot(q, scales), 19, b)
    xq, sx = quantised_rows(x)
    for row, col in ((0, 0), (1, 16), (2, 18)):
        acc = 0.0
        for block in range(3):
            part = slice(32 * block, 32 * (block + 1))
            isum = int((xq[row, part].long() * q[col, part].long()).sum())
            acc = to_float32(Fraction(isum) * Fraction(sx[row, block].item()) + Fraction(acc))
        scaled = to_float32(Fraction(acc) * Fraction(scales[col].item()))
        assert y[row, col].item() == to_float32(Fraction(scaled) + Fraction(b[col].item()))


def test_int8_dot_kernel_carries_non_finite_inputs(isa_kernels) -> None:
    x, w, b = operands(64, 16, rows=2)
    x[0, 5] = float("nan")
    q, scales = quantize_int8(w)
    y = isa_kernels.int8_dot_linear(x, *isa_kernels.pack_dot(q, scales), 16, b)
    assert y[0].isnan().all() and y[1].isfinite().all()


def test_dot_panels_widen_to_the_dequantised_weights(isa_kernels) -> None:
    _, w, _ = operands(128, 37)
    q, scales = quantize_int8(w)
    packed, padded = isa_kernels.pack_dot(q, scales)
    out = torch.full((128, 3 * 16 + 5), float("nan"))[:, :48]  # a strided destination
    isa_kernels.widen_dot_panels(packed, padded, out)
    assert torch.equal(out[:, :37].T, dequantize_int8(q, scales))
    part = torch.empty(128, 16)
    isa_kernels.widen_dot_panels(packed, padded, part, first_panel=1)
    assert torch.equal(part.T, dequantize_int8(q, scales)[16:32])


@pytest.mark.parametrize("shape", [(37, 5), (300, 40)])
def test_int8_fma_kernel_serves_inputs_off_the_block_size(isa_kernels, shape) -> None:
    """Per-row int8 over a number of inputs that is no multiple of 32: the canonical kernel's exact
    FMA chains on int8 panels, then the scale."""
    k, n = shape
    x, w, b = operands(k, n)
    q, scales = quantize_int8(w)
    packed = isa_kernels.pack_panels(q)
    assert packed.dtype == torch.int8
    y = isa_kernels.canonical_linear(x, packed, n, b, scales)
    ref = x.double() @ dequantize_int8(q, scales).double().T + b.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    for rows in (1, 2, 3, 5, 12, 13, 25, 40):
        assert torch.equal(isa_kernels.canonical_linear(x[:rows], packed, n, b, scales), y[:rows]), rows
    with pytest.raises(ValueError, match="scales"):
        isa_kernels.canonical_linear(x, packed, n, b)


def test_int8_fma_kernel_is_the_fma_chain_then_the_scale(isa_kernels) -> None:
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
        assert native.quantized and native.nbytes == 48 * 96 + 48 * 4  # panels of 16 columns, and their scales
        ref = fallback(x)
        assert ((native(x) - ref).abs().max() / ref.abs().max()).item() < 3e-2  # 8-bit activations
        # any layout of the input: rows of a 3-D batch, a transposed (column-major) matrix
        assert torch.equal(native(x.reshape(5, 1, 96)).reshape(5, 40), native(x))
        assert torch.equal(native(x.T.contiguous().T), native(x))


@pytest.fixture(scope="module")
def float_and_int8(smollm2_float_dir) -> tuple[LLM, LLM]:
    """A float checkpoint, and the same quantised per row at load (prompts in chunks of at most
    WIDEN_ROWS tokens, so that they take the integer dot-product kernel decode steps take)."""
    return LLM(str(smollm2_float_dir)), LLM(str(smollm2_float_dir), quantization="int8",
                                            max_num_batched_tokens=WIDEN_ROWS)


def _prompt_logprobs(llm: LLM, ids: list[int]) -> list:
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    return out[0].prompt_logprobs[1:]


def test_int8_model_tracks_the_float_model(float_and_int8) -> None:
    """On a fixed text: the int8 model's top-1 next token agrees with float32's at >= 92% of
    positions, and the log-probability of each actual next token moves by < 0.15 on average."""
    fp, q8 = float_and_int8
    ids = fp.tokenizer.encode(TEXT)
    ref, got = _prompt_logprobs(fp, ids), _prompt_logprobs(q8, ids)
    agree = sum(r.top[0][0] == g.top[0][0] for r, g in zip(ref, got)) / len(ref)
    delta = sum(abs(r.logprob - g.logprob) for r, g in zip(ref, got)) / len(ref)
    nll = {name: -sum(lp.logprob for lp in lps) / len(lps) for name, lps in (("fp", ref), ("q8", got))}
    assert agree >= 0.92 and delta < 0.15, (agree, delta)
    # perplexity within 3%: measured -1.4% on an AMX Xeon (the VNNI kernel) and -1.9% on the forced AVX2 path,
    # fixed for given kernels; the margin covers another CPU's rounding of the 8-bit activations (the two
    # paths differ by 0.5 points) with room for one more such step, and a broken kernel moves it by far more
    assert abs(math.exp(nll["q8"]) / math.exp(nll["fp"]) - 1) < 0.03, nll
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
