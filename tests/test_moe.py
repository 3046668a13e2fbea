"""Mixture-of-experts models (Qwen2-MoE with its shared expert, Qwen3-MoE, Mixtral) against transformers
on the same weights, one process: greedy tokens, logprobs, chunked prefill, preemption, the prefix
cache, canonical scoring's bits, and the per-expert token counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from test_engine_vs_hf import ENGINE_CASES, LOGPROB_TOL, PROMPTS, check_greedy_batch, check_logprobs
from tiny_models import build_tiny_model

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

MOE_KINDS = ["qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"]


@pytest.fixture(scope="module", params=MOE_KINDS)
def tiny_moe(request, tmp_path_factory, smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), smollm2_dir)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", ["plain", "chunked32", "preempting"])
def test_moe_greedy_matches_transformers(tiny_moe, case: str) -> None:
    folder, hf_model = tiny_moe
    check_greedy_batch(LLM(str(folder), dtype="float32", **ENGINE_CASES[case]), hf_model, case)


def test_moe_logprobs_match_transformers(tiny_moe) -> None:
    folder, hf_model = tiny_moe
    llm = LLM(str(folder), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=1)
    for prompt, res in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert check_logprobs(res, hf_model, 5) < LOGPROB_TOL, prompt


def test_moe_expert_counts_add_up_to_routed_tokens(tiny_moe) -> None:
    folder, _ = tiny_moe
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=False)
    res = llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    moe = llm.engine.model_config.moe
    tokens = sum(len(r.prompt_token_ids) + 4 - 1 for r in res)  # the last sampled token is never fed back
    load = llm.engine.expert_load()
    assert sorted(load) == sorted(moe.sparse_layers)
    for counts in load.values():
        assert len(counts) == moe.num_experts and sum(counts) == tokens * moe.top_k
        assert sum(c > 0 for c in counts) > 1  # the router spreads tokens


def test_moe_canonical_scoring_is_bit_identical_cold_cached_and_batched(tmp_path: Path, smollm2_dir: Path) -> None:
    """Under --deterministic each token's experts and their sum run in a fixed order: the same bits
    whatever shares the step, and from the prefix cache."""
    folder = build_tiny_model("qwen2_moe", tmp_path / "m", smollm2_dir)
    llm = LLM(str(folder), dtype="float32", deterministic=True, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=5)
    prompt = PROMPTS[6]

    def top(results):
        return [[(t, lp) for t, lp in step.top] for step in results.outputs[0].logprobs]

    cold = top(llm.generate([prompt], params)[0])
    cached = top(llm.generate([prompt], params)[0])
    batched = top(llm.generate([PROMPTS[4], prompt, PROMPTS[7]], params)[1])
    assert cold == cached == batched
