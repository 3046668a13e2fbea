"""ladle on CUDA against transformers on the same GPU, in bf16, on tiny random Llama, Qwen2 and Qwen3
models: greedy tokens and logprobs, chunked prefill, preemption, the prefix cache, CUDA graphs against
eager steps, decisions' label probabilities, hidden states, seeded sampling, 8-bit KV caches, LoRA and
speculative decoding.

bf16 rounds at every op and the two engines order their sums differently, so tokens are compared up to
the first position where transformers' own top two are a near tie (past it the continuations may
rightly differ), and logprobs within LOGPROB_TOL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams

pytestmark = pytest.mark.cuda

PROMPTS = [
    "Hi",
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. The crew was " * 3,
]
MAX_TOKENS = 16
LOGPROB_TOL = 0.08  # nats: bf16 logits of a peaked tiny model, two engines' op orders
NEAR_TIE = 0.15  # nats between transformers' top two: where bf16 rounding may pick either
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
ENGINE = dict(device="cuda", dtype="bfloat16", kv_cache_memory_gib=0.25, max_num_seqs=16)


@pytest.fixture(scope="module")
def hf_models(tiny_models: dict[str, Path]):
    from transformers import AutoModelForCausalLM

    return {arch: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa")
            .cuda().eval() for arch, folder in tiny_models.items()}


def hf_greedy(model, prompt_ids: list[int], n: int = MAX_TOKENS) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and its log-probabilities [n, vocab] (float32, on the CPU)."""
    ids = torch.tensor([prompt_ids], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    logprobs = torch.stack(out.logits)[:, 0].float().log_softmax(-1).cpu()
    return out.sequences[0, ids.shape[1]:].tolist(), logprobs


def assert_matches_hf(results, hf_model) -> int:
    """Each result's greedy tokens and logprobs against transformers; returns the tokens compared."""
    compared = 0
    for r in results:
        tokens, logprobs = hf_greedy(hf_model, r.prompt_token_ids)
        ours = r.outputs[0]
        for i, (mine, theirs) in enumerate(zip(ours.token_ids, tokens)):
            row = logprobs[i]
            assert abs(ours.logprobs[i].logprob - float(row[mine])) < LOGPROB_TOL, (r.prompt_token_ids[:8], i)
            if mine != theirs:
                gap = float(row[theirs] - row[mine])
                assert gap < NEAR_TIE, f"token {i}: {mine} where transformers says {theirs} ({gap:.3f} nats apart)"
                break
            compared += 1
    return compared


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_greedy_matches_transformers(arch: str, graphs: bool, tiny_models, hf_models) -> None:
    llm = LLM(str(tiny_models[arch]), enforce_eager=not graphs, **ENGINE)
    assert (llm.engine.runner.graphs is not None) == graphs
    results = llm.generate(PROMPTS, GREEDY)
    assert assert_matches_hf(results, hf_models[arch]) >= len(PROMPTS) * MAX_TOKENS // 2
    if graphs:
        assert llm.engine.runner.graphs.replays > 0


def test_graphs_and_eager_steps_agree(tiny_models) -> None:
    """The same batch with and without CUDA graphs: the same greedy tokens, logprobs within bf16 noise."""
    runs = [LLM(str(tiny_models["llama"]), enforce_eager=eager, **ENGINE).generate(PROMPTS, GREEDY)
            for eager in (False, True)]
    for graph, eager in zip(*runs):
        assert graph.outputs[0].token_ids == eager.outputs[0].token_ids
        for a, b in zip(graph.outputs[0].logprobs, eager.outputs[0].logprobs):
            assert abs(a.logprob - b.logprob) < 2e-2


@pytest.mark.parametrize("case", [
    dict(max_num_batched_tokens=32, long_prefill_token_threshold=32),  # chunked prefill
    dict(num_kv_blocks=12, block_size=16, max_num_batched_tokens=64, kv_cache_memory_gib=None),  # preemption
], ids=["chunked", "preempting"])
def test_chunked_prefill_and_preemption_match_transformers(case: dict, tiny_models, hf_models) -> None:
    llm = LLM(str(tiny_models["qwen2"]), **{**ENGINE, **case})
    results = llm.generate(PROMPTS, GREEDY)
    assert assert_matches_hf(results, hf_models["qwen2"]) >= len(PROMPTS) * MAX_TOKENS // 2
    if "num_kv_blocks" in case:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hit_matches_transformers(tiny_models, hf_models) -> None:
    llm = LLM(str(tiny_models["llama"]), **ENGINE)
    shared = PROMPTS[3]
    llm.generate(shared, GREEDY)
    [hit] = llm.generate(shared + " And then the dog", GREEDY)
    assert hit.num_cached_tokens >= 16
    assert_matches_hf([hit], hf_models["llama"])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decision_label_probabilities_match_transformers(arch: str, tiny_models, hf_models) -> None:
    llm = LLM(str(tiny_models[arch]), **ENGINE)
    labels = [11, 12, 13, 14, 15]
    results = llm.generate(PROMPTS, [SamplingParams(label_token_ids=labels)] * len(PROMPTS))
    for r in results:
        with torch.no_grad():
            logits = hf_models[arch](torch.tensor([r.prompt_token_ids], device="cuda")).logits[0, -1]
        want = logits.float().log_softmax(-1)[labels].cpu()
        got = torch.tensor(r.outputs[0].label_logprobs)
        assert (got - want).abs().max() < LOGPROB_TOL


def test_hidden_states_match_transformers(tiny_models, hf_models) -> None:
    llm = LLM(str(tiny_models["llama"]), **ENGINE)
    [r] = llm.generate(PROMPTS[5], SamplingParams(hidden_state_layers=[1, 2]))
    with torch.no_grad():
        hf = hf_models["llama"](torch.tensor([r.prompt_token_ids], device="cuda"), output_hidden_states=True)
    for layer in (1, 2):
        want = hf.hidden_states[layer][0, -1].float().cpu()
        got = torch.tensor(r.outputs[0].hidden_states[layer])
        assert (got - want).norm() / want.norm() < 2e-2, layer


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_models) -> None:
    llm = LLM(str(tiny_models["qwen3"]), **ENGINE)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)] * 5
    batched = llm.generate([PROMPTS[1]] + PROMPTS[:5], [seeded] + others)[0].outputs[0].token_ids
    assert alone == batched
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate(PROMPTS[1], other_seed)[0].outputs[0].token_ids != alone


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_8bit_kv_caches_match_transformers(kv: str, tiny_models, hf_models) -> None:
    llm = LLM(str(tiny_models["llama"]), kv_cache_dtype=kv, **ENGINE)
    results = llm.generate(PROMPTS, GREEDY)
    compared = 0
    for r in results:  # 8 bits per value: tokens agree up to near ties, logprobs loosely
        tokens, _ = hf_greedy(hf_models["llama"], r.prompt_token_ids)
        compared += next((i for i, (a, b) in enumerate(zip(r.outputs[0].token_ids, tokens)) if a != b), MAX_TOKENS)
    assert compared >= len(PROMPTS) * MAX_TOKENS // 2


@pytest.mark.parametrize("method", ["ngram", "early_exit"])
def test_speculation_keeps_greedy_output(method: str, tiny_models) -> None:
    plain = LLM(str(tiny_models["llama"]), **ENGINE).generate(PROMPTS, GREEDY)
    llm = LLM(str(tiny_models["llama"]), speculative_config={"method": method, "num_speculative_tokens": 3,
                                                             "disable_by_batch_size": 32}, **ENGINE)
    spec = llm.generate(PROMPTS, GREEDY)
    if method == "early_exit":  # it drafts every step: its verification steps are replayed graphs
        assert llm.engine.stats.spec.num_draft_tokens > llm.engine.stats.spec.num_drafts > 0
        assert llm.engine.runner.graphs.replays >= MAX_TOKENS // 2
    for a, b in zip(plain, spec):
        n = next((i for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)) if x != y),
                 MAX_TOKENS)
        assert n >= MAX_TOKENS // 2  # verification steps batch rows differently: bf16 may flip a near tie late


def test_lora_matches_peft(tiny_models, tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16), tmp_path / "adapter"
    ).cuda().eval()
    llm = LLM(str(tiny_models["llama"]), enable_lora=True, lora_modules={"a": str(tmp_path / "adapter")},
              max_lora_rank=8, **ENGINE)
    from ladle.llm import LoRARequest

    results = llm.generate(PROMPTS[:4], GREEDY, lora_request=LoRARequest("a"))
    assert assert_matches_hf(results, reference) >= 4 * MAX_TOKENS // 2


def test_gpu_memory_utilization_sizes_the_pool(tiny_models) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(str(tiny_models["llama"]), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2, max_num_seqs=8)
    pool = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_cache.tensors())
    in_use_without_pool = torch.cuda.memory_allocated() - pool
    assert 0 < pool <= 0.2 * total - in_use_without_pool
    assert pool > 0.1 * total  # a tiny model leaves nearly all of the share to the pool
    del llm
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        LLM(str(tiny_models["llama"]), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.001)


def test_fp8_weights_follow_their_bf16_source_and_score_bit_identically(tiny_models) -> None:
    """--quantization fp8 on the FP8 tensor cores: the first greedy token agrees with the bf16 engine's on
    most prompts (a tiny random model is a harsh case for e4m3), and decisions replay bit for bit alone,
    batched and cached, their rows through the fixed-shape chunks."""
    fp8 = LLM(str(tiny_models["llama"]), quantization="fp8", **ENGINE)
    bf16 = LLM(str(tiny_models["llama"]), **ENGINE)
    assert fp8.engine.runtime_info()["weights"] == "fp8 e4m3 per row (quantised at load)"
    ours, theirs = fp8.generate(PROMPTS, GREEDY), bf16.generate(PROMPTS, GREEDY)
    assert sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(ours, theirs)) >= 4
    score = SamplingParams(label_token_ids=[20, 21, 22, 23])
    alone = fp8.generate(PROMPTS[3], score)[0].outputs[0].label_logprobs
    batched = fp8.generate(PROMPTS, [score] * len(PROMPTS))[3].outputs[0].label_logprobs
    assert alone == batched == fp8.generate(PROMPTS[3], score)[0].outputs[0].label_logprobs


@pytest.mark.parametrize("fmt, source", [("ct-channel", "checkpoint"),
                                         ("hf-block", "checkpoint, blocks re-quantised per row")])
def test_an_fp8_checkpoint_stays_fp8_under_auto(tiny_models, tmp_path: Path, fmt: str, source: str) -> None:
    """FP8 checkpoints on an FP8 GPU, no flag: a per-channel compressed-tensors one's e4m3 values as they are, a
    block-scaled HF one's re-quantised per row; the first greedy tokens follow the bf16 source's."""
    from test_fp8_checkpoints import write_checkpoint

    folder = tmp_path / fmt
    write_checkpoint(tiny_models["llama"], folder, fmt, block=(16, 16))
    fp8, bf16 = LLM(str(folder), **ENGINE), LLM(str(tiny_models["llama"]), **ENGINE)
    assert fp8.engine.runtime_info()["weights"].startswith(f"fp8 e4m3 per row ({source})")
    ours, theirs = fp8.generate(PROMPTS, GREEDY), bf16.generate(PROMPTS, GREEDY)
    assert sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(ours, theirs)) >= 4


def test_canonical_rows_take_the_fixed_tile_triton_matmul(tiny_models) -> None:
    llm = LLM(str(tiny_models["llama"]), **ENGINE)
    assert llm.engine.runner.model.routing.invariant == "triton"
