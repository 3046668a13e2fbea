"""Prefill-only hidden states (SamplingParams.hidden_state_layers) against transformers'
output_hidden_states on the same weights: last-position and mean pooling, alone, batched,
chunked, and from a cached prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.errors import InvalidRequestError

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Customer: my invoice was charged twice this month, please refund the duplicate payment.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
]
TOL = 2e-3  # relative to each state's largest magnitude (fp32, different op order)


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), kv_cache_memory_gib=0.5, dtype="float32", max_num_batched_tokens=48)


def reference(hf_smollm2, ids: list[int]) -> tuple[torch.Tensor, ...]:
    model, _ = hf_smollm2
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states


def states(llm: LLM, prompts: list[list[int]], layers: list[int], pooling: str) -> list[dict[int, torch.Tensor]]:
    params = SamplingParams(max_tokens=1, hidden_state_layers=layers, hidden_state_pooling=pooling)
    outs = llm.generate(prompts, params)
    return [{k: torch.tensor(v) for k, v in o.outputs[0].hidden_states.items()} for o in outs]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= TOL * scale, (got - want).abs().max().item() / scale


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_states_match_transformers_batched_and_chunked(llm: LLM, hf_smollm2, pooling: str) -> None:
    layers = [0, 1, 15, 29, 30]  # embeddings, first layer, middle, last layer before the norm, final norm
    prompts = [llm.engine.tokenizer.encode(p) for p in PROMPTS]
    assert max(map(len, prompts)) > 48  # so the longest is prefilled in chunks
    for ids, got in zip(prompts, states(llm, prompts, layers, pooling)):
        ref = reference(hf_smollm2, ids)
        assert sorted(got) == layers
        for layer in layers:
            want = ref[layer][0, -1] if pooling == "last" else ref[layer][0].mean(0)
            assert_close(got[layer], want)


def test_last_position_state_from_a_cached_prefix(llm: LLM, hf_smollm2) -> None:
    base = llm.engine.tokenizer.encode(PROMPTS[0])
    states(llm, [base], [20], "last")  # cache the prefix
    longer = base + llm.engine.tokenizer.encode(" And then it rests.")
    out = llm.generate([longer], SamplingParams(max_tokens=1, hidden_state_layers=[20]))
    assert out[0].num_cached_tokens >= 32  # started from the cache
    assert_close(torch.tensor(out[0].outputs[0].hidden_states[20]), reference(hf_smollm2, longer)[20][0, -1])


def test_mean_pooling_never_starts_from_a_cached_prefix(llm: LLM, hf_smollm2) -> None:
    base = llm.engine.tokenizer.encode(PROMPTS[1])
    states(llm, [base], [20], "last")
    longer = base + llm.engine.tokenizer.encode(" Thanks.")
    out = llm.generate([longer], SamplingParams(max_tokens=1, hidden_state_layers=[20], hidden_state_pooling="mean"))
    assert out[0].num_cached_tokens == 0
    assert_close(torch.tensor(out[0].outputs[0].hidden_states[20]), reference(hf_smollm2, longer)[20][0].mean(0))


def test_mean_from_a_start_position_reuses_the_cache_only_before_it(llm: LLM, hf_smollm2) -> None:
    base = llm.engine.tokenizer.encode(PROMPTS[2])
    states(llm, [base], [20], "last")
    longer = base + llm.engine.tokenizer.encode(" # memoised")
    params = SamplingParams(max_tokens=1, hidden_state_layers=[20], hidden_state_pooling="mean", hidden_state_start=20)
    out = llm.generate([longer], params)
    assert out[0].num_cached_tokens == 20  # everything before the start (a block and a copied part), nothing past
    assert_close(torch.tensor(out[0].outputs[0].hidden_states[20]), reference(hf_smollm2, longer)[20][0, 20:].mean(0))


def test_bad_layers_and_pooling_are_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="hidden_state_layers"):
        llm.generate(["hello"], SamplingParams(max_tokens=1, hidden_state_layers=[31]))
    with pytest.raises(InvalidRequestError, match="hidden_state_start"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, hidden_state_layers=[3], hidden_state_pooling="mean",
                                                 hidden_state_start=3))
    with pytest.raises(InvalidRequestError, match="hidden_state_pooling"):
        SamplingParams(max_tokens=1, hidden_state_layers=[3], hidden_state_pooling="max")
