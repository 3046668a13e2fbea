"""The CUDA path's engine on the CPU: ladle's Triton attention backend and layer ops (run by Triton's
interpreter) inside the real engine, against transformers in float32 on tiny models; and the decode
graphs' bookkeeping (static buffers, padded batches) with an eager stand-in for CUDA graph replay.

What these cannot cover (the kernels' speed, bf16 tensor cores, real graph capture) runs on the GPU in
tests/gpu.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.engine.cuda_graphs import DecodeGraphs, eager_capture
from tiny_models import build_tiny_model

PROMPTS = [
    "Hi",
    "The capital of France is",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]
MAX_TOKENS = 4
LOGPROB_TOL = 2e-3
# 8-bit K/V may flip the random tiny model's near-ties (two tokens within a few hundredths of a nat):
# a token that far below transformers' best passes, a wrong kernel's tokens are whole nats below
INT8_KV_TIE = 0.05
TRITON = dict(attention_backend="triton", dtype="float32", block_size=8, num_kv_blocks=96, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), smollm2_dir)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def assert_matches_transformers(results, hf_model) -> None:
    for r in results:
        ids = torch.tensor([r.prompt_token_ids + r.outputs[0].token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(ids).logits[0], dim=-1)
        start = len(r.prompt_token_ids) - 1
        for i, lp in enumerate(r.outputs[0].logprobs):
            assert lp.token_id == int(ref[start + i].argmax()), (r.prompt_token_ids, i)
            assert abs(lp.logprob - float(ref[start + i, lp.token_id])) < LOGPROB_TOL


@pytest.mark.parametrize("case", [
    {},
    {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 16},  # chunks starting mid-block
    {"num_kv_blocks": 10, "max_num_batched_tokens": 32},  # preempted and recomputed
    {"kv_cache_dtype": "int8"},
], ids=["plain", "chunked", "preempting", "int8-kv"])
def test_triton_backend_matches_transformers(model, case: dict) -> None:
    folder, hf_model = model
    llm = LLM(str(folder), **{**TRITON, **case})
    assert llm.engine.isa.startswith("triton")
    results = llm.generate(PROMPTS, GREEDY)
    if case.get("kv_cache_dtype") == "int8":  # 8-bit K/V: each token transformers' best or a near-tie of it
        for r in results:
            ids = torch.tensor([r.prompt_token_ids + r.outputs[0].token_ids])
            with torch.no_grad():
                ref = torch.log_softmax(hf_model(ids).logits[0], dim=-1)
            start = len(r.prompt_token_ids) - 1
            for i, token in enumerate(r.outputs[0].token_ids):
                assert ref[start + i, token] >= ref[start + i].max() - INT8_KV_TIE, (r.prompt_token_ids, i)
    else:
        assert_matches_transformers(results, hf_model)
    if "num_kv_blocks" in case:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_prefix_cache_hits_read_the_cached_blocks(model) -> None:
    folder, hf_model = model
    llm = LLM(str(folder), **TRITON)
    llm.generate(PROMPTS[2], GREEDY)
    [hit] = llm.generate(PROMPTS[2] + " The end", GREEDY)
    assert hit.num_cached_tokens >= 16
    assert_matches_transformers([hit], hf_model)


def test_scoring_is_bit_identical_alone_batched_and_cached(model) -> None:
    """Canonical rows: the extend kernel's key tiles start at key 0, so a prompt's label logprobs do not
    depend on what shares its step or on how much of it was cached."""
    folder, _ = model
    llm = LLM(str(folder), **TRITON)
    scoring = SamplingParams(label_token_ids=[20, 21, 22, 23])
    alone = llm.generate(PROMPTS[2], scoring)[0].outputs[0].label_logprobs
    batched = llm.generate(PROMPTS[:3], [scoring] * 3)[2].outputs[0].label_logprobs
    cached = llm.generate(PROMPTS[2], scoring)[0]
    assert cached.num_cached_tokens > 0
    assert alone == batched == cached.outputs[0].label_logprobs


def test_decode_graph_bookkeeping_gives_the_eager_steps_results(model) -> None:
    """Padded batches replayed from static buffers (eager_capture standing in for CUDA graph replay)
    compute what the eager steps do, and every decode step went through a replay."""
    folder, hf_model = model
    llm = LLM(str(folder), **TRITON)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, 8, -(-llm.engine.max_model_len // 8) + 1, runner.device,
                                 capture=eager_capture)
    runner.graphs.capture()
    assert sorted(runner.graphs.steps) == [1, 2, 4, 8]
    results = llm.generate(PROMPTS[:3], GREEDY)  # three sequences: padded to the graph of 4
    assert runner.graphs.replays == MAX_TOKENS - 1
    assert_matches_transformers(results, hf_model)


def test_verification_steps_replay_as_decode_rows(model) -> None:
    """Speculative verification through the decode graphs, each drafted token a decode row of its own:
    greedy output stays transformers' (speculation stays lossless), and every step after the prompts'
    is a replay, drafts verified in them."""
    folder, hf_model = model
    # the model drafts for itself, so drafts are kept and the rows after them count (a random model
    # repeats nothing for a lookup to find)
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    llm = LLM(str(folder), speculative_config=spec, **TRITON)
    assert llm.engine.config.decode_graph_rows == 14  # 7 sequences with a draft each; 2 with 3 take 8
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, llm.engine.config.decode_graph_rows,
                                 -(-llm.engine.max_model_len // 8) + 1, runner.device, capture=eager_capture)
    runner.graphs.capture()
    assert sorted(runner.graphs.steps) == [1, 2, 4, 8, 14]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    steps_before = llm.engine.stats.steps
    results = llm.generate(PROMPTS[2:], params)
    stats = llm.engine.stats.spec
    assert stats.num_accepted_tokens > stats.num_drafts > 0, stats
    assert runner.graphs.replays == llm.engine.stats.steps - steps_before - 1
    assert_matches_transformers(results, hf_model)
