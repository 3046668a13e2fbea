"""ladle's engine against transformers on the same weights: greedy tokens, logprobs, seeds.

Every case runs 8 prompts of different lengths as ONE batch through ladle and compares
each with transformers' `generate` on that prompt alone.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from tiny_models import build_tiny_model

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. The crew was " * 3,
    "Énergie, naïveté, 東京, and emojis 🙂 all in one prompt: " * 4,
]
MAX_TOKENS = 12
# The reference computes in float32; ladle's dtype "auto" may pick bfloat16 on some CPUs, so pin it.
LOGPROB_TOL = 2e-3  # absolute, on log-probabilities (fp32, different op order)

# Engine set-ups every model must pass: plain, tiny prefill chunks, and a pool so small
# that sequences get preempted and recomputed.
ENGINE_CASES = {
    "plain": {},  # the Q4_1 layers served from their blocks (grouped int8)
    "dequantised": {"quantization": "none"},
    "chunked32": {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 32},
    "preempting": {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 64},
}


@pytest.fixture(scope="module")
def smollm2_gguf_llm_factory(smollm2_dir: Path):
    """LLMs loaded from the default GGUF file itself (the conversion cache makes this quick)."""
    from ladle.model.loader import default_gguf_path

    return lambda **engine_args: LLM(str(default_gguf_path()), kv_cache_memory_gib=1.0, dtype="float32", **engine_args)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_gguf_llm_factory) -> LLM:
    return smollm2_gguf_llm_factory()


# Per model, dropped with it: an id() key could be reused by the next module's model.
_HF_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, computed once per model and prompt."""
    cache = _HF_CACHE.setdefault(model, {})
    key = (tuple(prompt_ids), n)
    if key not in cache:
        cache[key] = _hf_greedy(model, prompt_ids, n)
    return cache[key]


def _hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def check_greedy_batch(llm: LLM, hf_model, case: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = llm.generate(PROMPTS, params)
    for prompt, res in zip(PROMPTS, results):
        assert res.outputs[0].token_ids == hf_greedy(hf_model, res.prompt_token_ids, MAX_TOKENS), (case, prompt)
    if case == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # nothing leaked


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3-rope", "qwen3", "mistral"])
def tiny(request, tmp_path_factory, smollm2_dir: Path):
    folder = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), smollm2_dir)
    from transformers import AutoModelForCausalLM

    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_tiny_models_greedy_match_transformers(tiny, case: str) -> None:
    folder, hf_model = tiny
    check_greedy_batch(LLM(str(folder), dtype="float32", **ENGINE_CASES[case]), hf_model, case)


def check_logprobs(res, hf_model, k: int) -> float:
    """A result's sampled and prompt logprobs against one transformers forward over prompt + output;
    returns the largest gap seen."""
    out = res.outputs[0]
    ids = torch.tensor([res.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
    gaps = [0.0]
    start = len(res.prompt_token_ids) - 1
    assert len(out.logprobs) == len(out.token_ids)
    for i, lp in enumerate(out.logprobs):
        row = ref[start + i]
        assert lp.token_id == out.token_ids[i]
        gaps.append(abs(lp.logprob - float(row[lp.token_id])))
        # each of ladle's top-k at transformers' value, and the k best values the same (robust to near-ties)
        gaps += [abs(v - float(row[t])) for t, v in lp.top]
        gaps += [abs(a - b) for (_, a), b in zip(lp.top, row.topk(k).values.tolist(), strict=True)]
    assert res.prompt_logprobs is not None and res.prompt_logprobs[0] is None
    assert len(res.prompt_logprobs) == len(res.prompt_token_ids)
    for pos, lp in enumerate(res.prompt_logprobs[1:], start=1):
        assert lp.token_id == res.prompt_token_ids[pos]
        gaps.append(abs(lp.logprob - float(ref[pos - 1, lp.token_id])))
    return max(gaps)


@pytest.mark.parametrize("case", ["plain", "chunked32"])
def test_tiny_models_logprobs_match_transformers(tiny, case: str) -> None:
    """Sampled, top-k and prompt logprobs of every prompt, run as one batch; chunked32 splits
    the long prompts' prefill (and so their prompt logprobs) over many steps."""
    folder, hf_model = tiny
    llm = LLM(str(folder), dtype="float32", **ENGINE_CASES[case])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=1)
    for prompt, res in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert check_logprobs(res, hf_model, 5) < LOGPROB_TOL, (case, prompt)
    if case == "chunked32":
        longest = max(len(llm.tokenizer.encode(prompt)) for prompt in PROMPTS)
        assert longest > 2 * ENGINE_CASES[case]["max_num_batched_tokens"]


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_smollm2_gguf_greedy_matches_transformers(smollm2_gguf_llm_factory, hf_smollm2, case: str) -> None:
    check_greedy_batch(smollm2_gguf_llm_factory(**ENGINE_CASES[case]), hf_smollm2[0], case)


@pytest.mark.parametrize("route", ["small:torch", "canonical:canonical", "torch:torch", "canonical:torch"])
def test_every_matmul_route_matches_transformers(smollm2_gguf_llm_factory, hf_smollm2, route: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up measurement picks the matmul kernels per float model and machine; each route it can
    pick, forced (on the dequantised weights: int8 blocks always take their kernel)."""
    monkeypatch.setenv("LADLE_MATMUL", route)
    # prefill chunks past the 64-row decode buckets
    llm = smollm2_gguf_llm_factory(max_num_batched_tokens=128, quantization="none")
    decode, prefill = route.split(":")
    assert (llm.engine.runner.model.routing.decode, llm.engine.runner.model.routing.prefill) == (decode, prefill)
    assert llm.engine.runtime_info()["matmul"] == \
        f"1 {decode}, 2-4 {decode}, 5-16 {decode}, 17-64 {decode}, 65+ {prefill}"
    check_greedy_batch(llm, hf_smollm2[0], route)


def test_smollm2_logprobs_match_transformers(smollm2_llm: LLM, hf_smollm2) -> None:
    hf_model = hf_smollm2[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    for res in smollm2_llm.generate(PROMPTS[:4], params):
        out = res.outputs[0]
        ids = torch.tensor([res.prompt_token_ids + out.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
        start = len(res.prompt_token_ids) - 1
        for i, lp in enumerate(out.logprobs):
            row = ref[start + i]
            assert lp.token_id == out.token_ids[i]
            assert abs(lp.logprob - float(row[lp.token_id])) < LOGPROB_TOL
            ref_top = row.topk(5)
            assert [t for t, _ in lp.top] == ref_top.indices.tolist()
            assert max(abs(a - b) for (_, a), b in zip(lp.top, ref_top.values.tolist())) < LOGPROB_TOL


def test_prompt_logprobs_match_transformers(smollm2_llm: LLM, hf_smollm2) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    res = smollm2_llm.generate([PROMPTS[4]], params)[0]
    ids = torch.tensor([res.prompt_token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2[0](ids).logits[0].float(), dim=-1)
    assert res.prompt_logprobs[0] is None
    assert len(res.prompt_logprobs) == len(res.prompt_token_ids)
    for pos, lp in enumerate(res.prompt_logprobs[1:], start=1):
        assert lp.token_id == res.prompt_token_ids[pos]
        assert abs(lp.logprob - float(ref[pos - 1, lp.token_id])) < LOGPROB_TOL


def test_seeded_sampling_reproducible_alone_and_in_batch(smollm2_llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = smollm2_llm.generate([PROMPTS[1]], seeded)[0].outputs[0].token_ids
    again = smollm2_llm.generate([PROMPTS[1]], seeded)[0].outputs[0].token_ids
    assert alone == again
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)  # unseeded neighbours
    batch = smollm2_llm.generate(PROMPTS[:6], [others, seeded, others, others, others, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    assert smollm2_llm.generate([PROMPTS[1]], other_seed)[0].outputs[0].token_ids != alone
