"""The native decode loop (ladle.model.decode_loop) against the Python layers it stands in for: the same
tokens and the same logprobs, bit for bit, for every kernel it calls (4-bit and int8 groups, per-row int8
on the dot kernel and on FMA chains, float panels, the small-row kernel), in float32 and bfloat16, 8-bit
KV caches, sliding windows and biases; steps it cannot take left to Python. That the Python layers match transformers is
test_engine_vs_hf's (which runs the loop too, as the engine does by default)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from tiny_models import build_tiny_model

pytestmark = pytest.mark.isa  # the kernels it calls are the instruction set's

PROMPTS = ["Hi", "The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
           "The quick brown fox jumps over the lazy dog. " * 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)


def outputs(llm: LLM, prompts: list[str], loop: bool) -> tuple[list, int]:
    """Each prompt's tokens and logprobs, the decoder layers in the native loop or in Python; and how many
    steps the loop ran."""
    model = llm.engine.runner.model
    decode_loop = model.decode_loop
    assert decode_loop is not None
    steps = decode_loop.steps
    if not loop:
        model.decode_loop = None
    try:
        assert llm.engine.reset_prefix_cache()
        results = llm.generate(prompts, GREEDY)
    finally:
        model.decode_loop = decode_loop
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results], decode_loop.steps - steps


def check_same_bits(llm: LLM, prompts: list[str] = PROMPTS, loop_steps: bool = True) -> None:
    native, steps = outputs(llm, prompts, loop=True)
    python, python_steps = outputs(llm, prompts, loop=False)
    assert python_steps == 0
    assert (steps >= GREEDY.max_tokens - 1) if loop_steps else steps == 0
    for (tokens, logprobs), (tokens_py, logprobs_py) in zip(native, python):
        assert tokens == tokens_py
        assert logprobs == logprobs_py  # every float equal, the top-3 alternatives included


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), smollm2_dir)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_embedded_model_on_its_4_bit_and_int8_groups(engine_pool, dtype: str) -> None:
    from ladle.model.loader import default_gguf_path

    check_same_bits(engine_pool.get(default_gguf_path(), dtype=dtype, kv_cache_memory_gib=0.25))


@pytest.mark.parametrize("env, engine_args", [
    ({"LADLE_MATMUL": "canonical:canonical"}, {}),  # float panels
    ({"LADLE_MATMUL": "canonical:canonical"}, {"kv_cache_dtype": "int8"}),
    ({"LADLE_MATMUL": "canonical:canonical"}, {"kv_cache_dtype": "fp8"}),
    ({}, {"quantization": "int8"}),  # per-row int8 on integer dot products
    ({"LADLE_INT8_DOT": "0"}, {"quantization": "int8"}),  # per-row int8 on FMA chains
    ({"LADLE_MATMUL": "canonical:canonical"}, {"dtype": "bfloat16"}),  # bf16 panels and activations
    ({"LADLE_INT8_DOT": "0"}, {"quantization": "int8", "dtype": "bfloat16"}),
], ids=["float", "int8-kv", "fp8-kv", "int8-dot", "int8-chains", "bf16", "bf16-int8-chains"])
def test_tiny_llama_kernels_and_caches(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, env: dict,
                                       engine_args: dict) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    check_same_bits(LLM(str(tiny_llama), **{"dtype": "float32", **engine_args}))


def test_the_small_row_kernel_takes_one_row_and_leaves_strided_rows_to_python(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the small kernel reads rows back to back; the MLP's activations are every other half-row, which the
    # Python layers send to torch: the loop runs one row, and no batch
    monkeypatch.setenv("LADLE_MATMUL", "small:canonical")
    llm = LLM(str(tiny_llama), dtype="float32")
    check_same_bits(llm, PROMPTS[:1])
    check_same_bits(llm, PROMPTS, loop_steps=False)


@pytest.mark.parametrize("kind, overrides", [("qwen2", {}), ("mistral", {"sliding_window": 8})],
                         ids=["qwen2-bias", "mistral-window"])
def test_biases_and_sliding_windows(kind: str, overrides: dict, tmp_path: Path, smollm2_dir: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LADLE_MATMUL", "canonical:canonical")  # a tiny model's measured routes may pick torch
    folder = build_tiny_model(kind, tmp_path / kind, smollm2_dir, **overrides)
    llm = LLM(str(folder), dtype="float32")
    if overrides:
        assert llm.engine.runner.model.attention.window(0) == 8
    check_same_bits(llm)


def test_a_slot_outside_the_cache_is_refused_as_python_refuses_it(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    model = llm.engine.runner.model
    seen = []
    forward = model.forward

    def keep_decode_steps(input_ids, positions, meta, *args, **kwargs):
        if not meta.prefills:
            seen.append((input_ids, positions, meta))
        return forward(input_ids, positions, meta, *args, **kwargs)

    model.forward = keep_decode_steps
    try:
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    finally:
        del model.forward
    input_ids, positions, meta = seen[-1]
    bad = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, 10**9), backend_data=None)
    with pytest.raises(IndexError, match="outside the KV cache"):
        model.forward(input_ids, positions, bad)
    loop, model.decode_loop = model.decode_loop, None
    try:
        with pytest.raises(IndexError, match="outside the KV cache"):
            model.forward(input_ids, positions, bad)
    finally:
        model.decode_loop = loop


@pytest.mark.parametrize("env, engine_args", [
    ({"LADLE_MATMUL": "small:canonical"}, {"dtype": "bfloat16"}),  # the small kernel takes float32 rows only
    ({}, {"quantization": "int8", "dtype": "bfloat16"}),  # and the dot kernel too: torch widens bf16 rows first
], ids=["bf16-small", "bf16-int8-dot"])
def test_bf16_steps_on_float32_only_kernels_stay_in_python(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                            env: dict, engine_args: dict) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    check_same_bits(LLM(str(tiny_llama), **engine_args), loop_steps=False)


def test_ladle_layer_loop_0_keeps_the_layers_in_python(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LADLE_LAYER_LOOP", "0")
    llm = LLM(str(tiny_llama), dtype="float32")
    assert llm.engine.runner.model.decode_loop is None
    assert len(llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_models_it_does_not_take_keep_their_layers_in_python(tmp_path: Path, smollm2_dir: Path) -> None:
    folder = build_tiny_model("qwen3", tmp_path / "qwen3", smollm2_dir)  # per-head norms on q and k
    assert LLM(str(folder), dtype="float32").engine.runner.model.decode_loop is None
