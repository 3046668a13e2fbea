"""Tensor and expert parallelism over torch.distributed (gloo): two worker processes' shards give the
single-process outputs and transformers', and a worker that dies turns into a clear error."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.config import EngineConfig
from test_engine_vs_hf import PROMPTS, hf_greedy
from tiny_models import build_tiny_model
from tests.server_utils import own_server

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

# Absolute, on log-probabilities: two ranks sum each row-parallel layer's halves, so the bits differ
# from one process; measured at most 2e-5 on these models.
TP_LOGPROB_TOL = 2e-4
NEW_TOKENS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)


@pytest.fixture(autouse=True)
def _restore_threads():
    """A TP engine sets this process's thread count to its share of the cores; later tests get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run(llm: LLM) -> list:
    try:
        return llm.generate(PROMPTS, PARAMS)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("kind, expert_parallel", [
    ("llama", False), ("qwen2", False), ("qwen2_moe", False), ("qwen2_moe", True), ("qwen3_moe", True),
    ("mixtral", True), ("gemma3", False),  # Gemma 3: sliding windows and its norms on each rank
    ("gpt_oss", False), ("gpt_oss", True),  # its sinks split by head, its output and expert biases added once
])
def test_two_ranks_match_one_process_and_transformers(tmp_path: Path, smollm2_dir: Path, kind: str,
                                                       expert_parallel: bool) -> None:
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(kind, tmp_path / kind, smollm2_dir)
    single = run(LLM(str(folder), dtype="float32"))
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              max_num_batched_tokens=64)  # chunked: prefill chunks beside decodes
    parallel = run(llm)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for a, b in zip(single, parallel):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids == hf_greedy(hf_model, a.prompt_token_ids,
                                                                             NEW_TOKENS)
        gaps = [abs(x.logprob - y.logprob) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)]
        assert max(gaps) < TP_LOGPROB_TOL
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    stats = llm.engine.collective_stats()
    layers = llm.engine.model_config.num_hidden_layers
    assert stats.calls >= 2 * layers and stats.seconds > 0  # attention's and the MLP's collectives ran
    if llm.engine.model_config.moe is not None:
        assert sum(map(sum, llm.engine.expert_load().values())) > 0


def test_canonical_scoring_is_bit_identical_across_batches_on_two_ranks(tmp_path: Path, smollm2_dir: Path) -> None:
    folder = build_tiny_model("qwen2_moe", tmp_path / "m", smollm2_dir)
    llm = LLM(str(folder), dtype="float32", deterministic=True, tensor_parallel_size=2, enable_expert_parallel=True,
              max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=5)
    try:
        alone = llm.generate([PROMPTS[6]], params)[0].outputs[0].logprobs
        batched = llm.generate([PROMPTS[4], PROMPTS[6]], params)[1].outputs[0].logprobs
    finally:
        llm.engine.close()
    assert [s.top for s in alone] == [s.top for s in batched]


def test_bad_parallel_settings_are_refused_before_any_worker_starts(smollm2_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_attention_heads=9"):  # SmolLM2-135M: 9 heads, 3 KV heads
        LLM(str(smollm2_dir), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(str(smollm2_dir), enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_lora"):
        EngineConfig(tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="mpi")


def test_server_reports_expert_load_and_a_dead_worker(tmp_path: Path, smollm2_dir: Path) -> None:
    folder = build_tiny_model("mixtral", tmp_path / "m", smollm2_dir)
    config = EngineConfig(model=str(folder), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
    with own_server(config) as server:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        metrics = httpx.get(f"{server.url}/metrics").text
        counts = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("ladle:moe_expert_tokens_total{")]
        assert len(counts) == 2 * 4 and sum(counts) > 0  # 2 layers x 4 experts
        assert 'ladle:tensor_parallel_size{expert_parallel="true"' in metrics
        (pid,) = server.engine.engine.runner.workers.ranks.pids
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health").status_code == 200:
            assert time.monotonic() < deadline, "the dead worker was not noticed"
            time.sleep(0.1)
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "exited with code -9" in health.json()["error"]["message"]
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)  # fails fast, no hang
        assert reply.status_code == 503 and "worker" in reply.json()["error"]["message"]


@pytest.mark.slow  # a Ray head and its actors
def test_ray_backend_places_the_ranks_on_a_local_ray_head(tmp_path: Path, smollm2_dir: Path) -> None:
    """--distributed-executor-backend ray: the same shards as `mp`, so the same bits; a killed actor is noticed."""
    folder = build_tiny_model("llama", tmp_path / "m", smollm2_dir)
    with pytest.raises(ValueError, match="cannot place 1 tensor-parallel worker"):  # more CPUs than this machine has
        LLM(str(folder), dtype="float32", tensor_parallel_size=2, num_threads=(os.cpu_count() or 1) + 1,
            distributed_executor_backend="ray")
    # deterministic: the same kernels whatever start-up measures, so the two placements can agree bit for bit
    local = run(LLM(str(folder), dtype="float32", tensor_parallel_size=2, deterministic=True))
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, deterministic=True,
              distributed_executor_backend="ray")
    try:
        on_ray = llm.generate(PROMPTS, PARAMS)
        for a, b in zip(local, on_ray):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
            assert [s.logprob for s in b.outputs[0].logprobs] == [s.logprob for s in a.outputs[0].logprobs]
        workers = llm.engine.runner.workers
        (pid,) = workers.ranks.pids
        assert pid != os.getpid()  # an actor's process
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while llm.engine.healthy:
            assert time.monotonic() < deadline, "the dead actor was not noticed"
            time.sleep(0.1)
        assert "rank 1 (Ray actor" in llm.engine.failure and "died" in llm.engine.failure
    finally:
        llm.engine.close()
