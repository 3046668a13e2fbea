"""Prompts on int8 and 4-bit weights: calls of many rows widen the panels back to float a slice at a
time and multiply on torch's GEMM. The widening against the checkpoint's own dequantisation (exact,
on every instruction set), the layer's route by row count and flag, and the embedded model's
prompts on its blocks against the same model dequantised."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_gguf_blocks import grouped_operands
from test_int8 import TEXT, operands

from ladle import LLM, SamplingParams
from ladle.model import quantization
from ladle.model.kernels.routing import MatmulRouting
from ladle.model.quantization import WIDEN_ROWS, GroupedWeight, Int8Linear, dequantize_int8, quantize_int8

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again


def _grouped(k: int, n: int, four_bit: bool, mins: bool, half: bool) -> GroupedWeight:
    _, w, _ = grouped_operands(k, n, 32, mins=mins, four_bit=four_bit)
    if half:  # fp16 values, as a GGUF's are: held as fp16
        w.scales = w.scales.half().float()
        w.mins = None if w.mins is None else w.mins.half().float()
    return w


@pytest.mark.parametrize("half", [False, True], ids=["fp32-params", "fp16-params"])
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("four_bit", [False, True], ids=["int8", "4-bit"])
def test_widened_grouped_panels_are_the_dequantised_weights(isa_kernels, four_bit: bool, mins: bool,
                                                            half: bool) -> None:
    k, n = 320, 70  # 5 panels, the last one part padding
    w = _grouped(k, n, four_bit, mins, half)
    dtype = torch.float16 if half else torch.float32
    groups = (32, isa_kernels.pack_groups(w.scales, dtype),
              None if w.mins is None else isa_kernels.pack_groups(w.mins, dtype))
    packed = isa_kernels.pack_panels(w.q, four_bit=four_bit)
    dequantised = w.dequantize().T
    whole = isa_kernels.widen_panels(packed, k, torch.empty(k, 80), groups=groups)
    assert torch.equal(whole[:, :n], dequantised) and (whole[:, n:] == 0).all()
    # panels 1..3 into columns of a wider buffer (row stride 100): only those columns are written
    buffer = torch.full((k, 100), -7.0)
    isa_kernels.widen_panels(packed, k, buffer[:, 4:52], first_panel=1, groups=groups)
    assert torch.equal(buffer[:, 4:52], dequantised[:, 16:64])
    assert (buffer[:, :4] == -7).all() and (buffer[:, 52:] == -7).all()


def test_widened_per_row_panels_are_the_dequantised_weights(isa_kernels) -> None:
    _, w, _ = operands(200, 40)
    q, scales = quantize_int8(w)
    out = isa_kernels.widen_panels(isa_kernels.pack_panels(q), 200, torch.empty(200, 48), scales=scales)
    assert torch.equal(out[:, :40], dequantize_int8(q, scales).T)
    with pytest.raises(ValueError, match="scales or groups"):
        isa_kernels.widen_panels(isa_kernels.pack_panels(q), 200, torch.empty(200, 48))
    with pytest.raises(ValueError, match="int8 or 4-bit"):
        isa_kernels.widen_panels(isa_kernels.pack_panels(w), 200, torch.empty(200, 48), scales=scales)


@pytest.mark.parametrize("weight", ["per-row", "4-bit"])
def test_prompt_sized_calls_take_widened_slices(isa_kernels, monkeypatch, weight: str) -> None:
    """More than WIDEN_ROWS rows: torch's GEMM on the widened weights, slice by slice (small slices
    here, so that several run), within float rounding of float64; fewer rows, batch-invariant calls
    and a route forced to the canonical kernel keep the canonical kernel's bits."""
    monkeypatch.setattr(quantization, "WIDEN_SLICE_BYTES", 3 * 16 * 4 * 320)  # three panels at a time
    x, _, b = grouped_operands(320, 150, 32, rows=WIDEN_ROWS + 7)
    if weight == "4-bit":
        w = _grouped(320, 150, four_bit=True, mins=True, half=True)
        lin, reference = Int8Linear(w, b), w.dequantize(torch.float64)
    else:
        _, dense, _ = operands(320, 150)
        lin = Int8Linear(dense, b)
        reference = dequantize_int8(*quantize_int8(dense)).double()
    lin.routing = MatmulRouting("canonical", "torch")
    y = lin(x)
    ref = x.double() @ reference.T + b.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    canonical = lin(x, batch_invariant=True)
    assert not torch.equal(y, canonical)  # another summation order: this call did not take the canonical kernel
    assert torch.equal(lin(x[:WIDEN_ROWS]), canonical[:WIDEN_ROWS])
    assert torch.equal(lin(x[:5]), canonical[:5])
    lin.routing = MatmulRouting("canonical", "canonical")
    assert torch.equal(lin(x), canonical)


@pytest.fixture(scope="module")
def blocks_and_float(smollm2_dir: Path) -> Iterator[tuple[LLM, LLM]]:
    """The embedded model on its blocks, prompts forced onto widened slices (where the measurement
    may send them elsewhere on this CPU), and dequantised."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LADLE_MATMUL", "canonical:torch")
        blocks = LLM(str(smollm2_dir))
    yield blocks, LLM(str(smollm2_dir), quantization="none")


def test_quantised_prompts_take_the_route_that_measured_faster(smollm2_float_dir: Path) -> None:
    routing = LLM(str(smollm2_float_dir), quantization="int8", kv_cache_memory_gib=0.05).engine.runner.model.routing
    kernel, widened = map(float, re.findall(r"kernel ([0-9.]+) ms, widened slices on torch ([0-9.]+) ms",
                                            routing.measured)[0])
    assert routing.decode == "canonical" and routing.prefill == ("canonical" if kernel < widened else "torch")


def test_long_prompts_on_blocks_match_the_dequantised_model(blocks_and_float) -> None:
    """A prompt of several hundred tokens runs its prefill on widened slices: the dequantised
    model's weights on the same GEMM, so its prompt log-probabilities agree to float rounding;
    scoring the same prompt (canonical) stays on the canonical kernel and bit-identical cached."""
    blocks, floats = blocks_and_float
    assert blocks.engine.runtime_info()["matmul"] == \
        "1 canonical, 2-4 canonical, 5-16 canonical, 17-64 canonical, 65+ torch"
    ids = blocks.tokenizer.encode(" ".join([TEXT] * 4))  # 704 tokens
    assert len(ids) > 2 * WIDEN_ROWS
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1)
    a, b = (llm.generate([ids], params)[0] for llm in (blocks, floats))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    deltas = [abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
    assert max(deltas) < 1e-3, max(deltas)
    labels = SamplingParams(label_token_ids=blocks.tokenizer.encode(" the")[:1])
    cold = blocks.generate([ids[:300]], labels)[0].outputs[0].label_logprobs
    assert blocks.generate([ids[:300]], labels)[0].outputs[0].label_logprobs == cold
