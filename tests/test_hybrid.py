"""Hybrid models against transformers: Qwen3.5 (dense and MoE) and Qwen3-Next, tiny random models whose
Gated DeltaNet layers keep a recurrent state per sequence beside the paged K/V of their full-attention
layers. Plain, chunked at odd sizes, preempted, from prefix-cache hits at and just past a block boundary
(the state restored from a snapshot); canonical scoring bit-identical cold, cached and batched; decisions
reusing their shared input; and the state slots back to baseline after every run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from server_utils import own_server
from test_decisions import SEVERITY, TEAM, URGENT, decide, fresh_input, shared_prefix
from test_deterministic import question
from test_engine_vs_hf import LOGPROB_TOL, PROMPTS, check_logprobs, hf_greedy
from tiny_models import build_tiny_model

from ladle import LLM, SamplingParams
from ladle.config import EngineConfig
from ladle.engine.kv_report import describe_kv_bytes
from ladle.model.config import ModelConfig

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
CASES = {
    "plain": {},
    "chunked-odd": {"max_num_batched_tokens": 19, "long_prefill_token_threshold": 7},  # pieces cut mid-block
    "preempting": {"num_kv_blocks": 12, "max_num_batched_tokens": 64},
}
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=1)


@pytest.fixture(scope="module", params=KINDS)
def hybrid(request, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), smollm2_dir)
    return folder, Reference(*(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, experts_implementation="eager")
                               .eval() for dtype in (torch.float32, torch.float64)))


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), smollm2_dir)


@dataclass
class Reference:
    """transformers' model in float32 (greedy continuations) and in float64 (logprobs: the reference's own float32
    rounding, in its chunked delta rule and its experts, would eat the tolerance)."""

    fp32: object
    fp64: object

    @property
    def config(self):
        return self.fp32.config


def check_against_transformers(llm: LLM, hf: Reference, prompts: list[str], params: SamplingParams = GREEDY) -> list:
    """Greedy tokens equal to transformers', sampled and prompt logprobs within tolerance, and nothing held after."""
    results = llm.generate(prompts, params)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.outputs[0].token_ids == hf_greedy(hf.fp32, res.prompt_token_ids, MAX_TOKENS), prompt
        if params.prompt_logprobs:
            assert check_logprobs(res, hf.fp64, 5) < LOGPROB_TOL, prompt
    assert_baseline(llm)
    return results


def assert_baseline(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks, "a KV block is still held"
    assert kv.states.idle, "a state slot is still held"
    assert all(node.snapshot in kv.states.attached for node in kv.states.attached.values())


def test_the_configs_are_read_as_transformers_reads_them(hybrid) -> None:
    folder, hf_model = hybrid
    cfg = ModelConfig.from_folder(folder)
    kinds = hf_model.config.layer_types
    assert cfg.hybrid.linear_layers == {i for i, kind in enumerate(kinds) if kind == "linear_attention"}
    assert cfg.kv_layers == tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    assert cfg.hybrid.rotary_dim == 8 and cfg.norm_offset == 1.0
    # the start log: K/V of 2 full layers (2 KV heads of 32), and 2 linear layers' state per sequence: the
    # convolution's last 3 inputs of 2 * 2 * 16 + 4 * 16 channels, and 4 value heads' 16 x 16 matrices
    assert describe_kv_bytes(cfg, torch.float32) == \
        f"full {2 * 2 * 2 * 32 * 4} B/token, linear {2 * 4 * (128 * 3 + 4 * 16 * 16)} B/sequence"


def test_an_image_and_text_checkpoint_serves_its_language_model(qwen3_5: Path, tmp_path: Path) -> None:
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration: its config nests the text model's, its weights sit
    under model.language_model beside a vision tower that text alone never reads."""
    import shutil

    from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = AutoModelForCausalLM.from_pretrained(qwen3_5, dtype=torch.float32).eval()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
    both = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision))
    both.model.language_model.load_state_dict(text.model.state_dict())
    both.lm_head.load_state_dict(text.lm_head.state_dict())
    both.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (qwen3_5 / name).exists():
            shutil.copy(qwen3_5 / name, tmp_path / name)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.engine.model_config.model_type == "qwen3_5_text"
    res = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert res.outputs[0].token_ids == hf_greedy(text, res.prompt_token_ids, MAX_TOKENS)


@pytest.mark.parametrize("case", CASES)
def test_hybrid_models_match_transformers(hybrid, case: str) -> None:
    folder, hf_model = hybrid
    llm = LLM(str(folder), dtype="float32", **CASES[case])
    check_against_transformers(llm, hf_model, PROMPTS[1::2])  # 5, 70, 18 and 105 tokens
    if case == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_hits_restore_the_state_at_a_block_boundary(hybrid) -> None:
    """Prompts sharing 2 or 3 blocks of a cached one, and some a few tokens more: each starts from the cache at
    the last shared boundary (its state restored from the snapshot there), whether it diverges at it or just
    past it."""
    folder, hf_model = hybrid
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=19)  # the first is computed in 19-token steps
    ids = llm.tokenizer.encode(PROMPTS[-1])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([ids[:60]], params)[0]
    assert first.outputs[0].token_ids == hf_greedy(hf_model.fp32, first.prompt_token_ids, MAX_TOKENS)
    for depth in (32, 35, 48, 51):  # at a boundary and just past one, at two depths
        res = llm.generate([ids[:depth] + [11, 12, 13]], params)[0]
        assert res.num_cached_tokens == depth // 16 * 16, depth
        assert res.outputs[0].token_ids == hf_greedy(hf_model.fp32, res.prompt_token_ids, MAX_TOKENS), depth
    assert_baseline(llm)


def test_without_snapshots_a_prompt_is_recomputed(qwen3_5: Path) -> None:
    llm = LLM(str(qwen3_5), dtype="float32", max_state_snapshots=0)
    prompt = list(range(100, 150))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    cold = llm.generate([prompt], params)[0]
    warm = llm.generate([prompt], params)[0]
    assert warm.num_cached_tokens == 0 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_baseline(llm)


def test_snapshots_stay_within_their_bound(qwen3_5: Path) -> None:
    """Two snapshots for prompts of many blocks: the least recently used go, the deepest stay, and a
    repeated prompt hits at the deepest boundary that kept one."""
    llm = LLM(str(qwen3_5), dtype="float32", max_state_snapshots=2)
    prompts = [list(range(1000 * k, 1000 * k + 70)) for k in (1, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompts[:1], params)
    llm.generate(prompts[1:], params)
    states = llm.engine.kv.states
    assert len(states.attached) == 2 and not states.free_snapshots
    again = llm.generate(prompts[1:], params)[0]
    assert again.num_cached_tokens == 64  # the second prompt's last boundary kept its snapshot
    assert llm.generate(prompts[:1], params)[0].num_cached_tokens == 0  # the first one's went
    assert_baseline(llm)


@pytest.mark.parametrize("deterministic", [False, True])
def test_scoring_is_bit_identical_cold_cached_and_batched(hybrid, deterministic: bool) -> None:
    folder, _ = hybrid
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=96, deterministic=deterministic)
    text = " ".join(["the invoice was charged twice and the app crashes on sync"] * 12)
    labels = [llm.tokenizer.encode(x)[0] for x in ("A", "B")]
    score = SamplingParams(label_token_ids=labels)
    cold = llm.generate([question(llm, text, 0)], score)[0].outputs[0].label_logprobs
    hits_before = llm.engine.kv.stats.hits
    warm = llm.generate([question(llm, text, 0)], score)[0].outputs[0].label_logprobs
    assert llm.engine.kv.stats.hits > hits_before  # really served from the cache, state restored
    mixed = llm.generate([question(llm, text, 1), "Tell me a story. " * 12, question(llm, text, 0)],
                         [score, SamplingParams(temperature=0.0, max_tokens=6), score])
    assert cold == warm == mixed[2].outputs[0].label_logprobs
    assert_baseline(llm)


def test_decisions_reuse_their_shared_input(hybrid) -> None:
    folder, _ = hybrid
    questions = [TEAM, SEVERITY, URGENT, {**TEAM, "id": "team2", "question": "Who owns this?"}]
    with own_server(EngineConfig(model=str(folder), dtype="float32")) as server:
        body = decide(server, input=fresh_input() + " " + "It fails every night. " * 12, questions=questions,
                      return_prompt_token_ids=True)
        ids = [a["prompt_token_ids"] for a in body["answers"].values()]
        shared = min(shared_prefix(ids[0], x) for x in ids[1:]) // 16 * 16
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * shared > 0
        server.wait_idle()
        assert server.engine.engine.kv.states.idle


@pytest.mark.parametrize("flags", [{"enable_lora": True}, {"speculative_config": {"method": "ngram",
                                                                                 "num_speculative_tokens": 2}},
                                   {"kv_offload_gib": 0.1}])
def test_what_the_state_cannot_follow_is_refused(qwen3_5: Path, flags: dict) -> None:
    with pytest.raises(ValueError, match="linear-attention state"):
        LLM(str(qwen3_5), dtype="float32", **flags)
