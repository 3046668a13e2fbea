"""Sliding-window attention against transformers: tiny random models whose window (8 tokens) is far
shorter than the prompts: one windowing every layer (Mistral), one alternating windowed and global
layers (Qwen3, as gpt-oss does), and Gemma 3 (alternating, each kind with its RoPE base, and Gemma's
own norms, scales and gating). Plain, chunked across the window's edge, preempted, from a
prefix-cache hit longer than the window, without the native kernels; and canonical scoring
bit-identical cold, cached and batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_deterministic import check_scoring_is_bit_identical, question
from test_engine_vs_hf import ENGINE_CASES, LOGPROB_TOL, PROMPTS, check_logprobs, hf_greedy
from tiny_models import build_tiny_model

from ladle import LLM, SamplingParams
from ladle.model import mxfp4
from ladle.model.config import ModelConfig

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

WINDOW = 8
SLIDING = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),  # transformers' Mistral windows every layer
    "alternating": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "num_hidden_layers": 4,
                              "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "gemma3": ("gemma3", {}),  # tiny_models' Gemma 3 has a window of 8 on alternate layers
    "gpt-oss": ("gpt_oss", {}),  # and its gpt-oss, with sinks, MoE and YaRN
    "gemma4": ("gemma4", {}),  # and its Gemma 4: weight-scaled norms, normed values, layer scalars, soft-capping
}
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=SLIDING)
def sliding(request, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    kind, overrides = SLIDING[request.param]
    folder = build_tiny_model(kind, tmp_path_factory.mktemp(request.param), smollm2_dir, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf_model


def check_against_transformers(llm: LLM, hf_model, prompts: list[str] = PROMPTS, prompt_logprobs: bool = True) -> None:
    """Greedy tokens equal to transformers' generate, and sampled (and prompt) logprobs within tolerance.
    Prompt logprobs compute every prompt position: without them a prompt can start from the prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5,
                            prompt_logprobs=1 if prompt_logprobs else None)
    for prompt, res in zip(prompts, llm.generate(prompts, params), strict=True):
        assert res.outputs[0].token_ids == hf_greedy(hf_model, res.prompt_token_ids, MAX_TOKENS), prompt
        if prompt_logprobs:
            assert check_logprobs(res, hf_model, 5) < LOGPROB_TOL, prompt
        else:
            ids = res.prompt_token_ids + res.outputs[0].token_ids
            with torch.no_grad():
                ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
            for i, lp in enumerate(res.outputs[0].logprobs, start=len(res.prompt_token_ids) - 1):
                assert abs(lp.logprob - ref[i, lp.token_id].item()) < LOGPROB_TOL, prompt
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # nothing leaked


def test_the_windows_are_read_as_transformers_reads_them(sliding) -> None:
    folder, hf_model = sliding
    cfg = ModelConfig.from_folder(folder)
    kinds = getattr(hf_model.config, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers  # Mistral
    expected = [WINDOW if kind == "sliding_attention" else None for kind in kinds]
    assert list(cfg.layer_windows) == expected and WINDOW in expected


@pytest.mark.parametrize("case", ["plain", "chunked32", "preempting"])
def test_sliding_models_match_transformers(sliding, case: str) -> None:
    """chunked32: prefill chunks of 32 tokens, each crossing the window's edge; preempting: sequences
    recomputed after losing their blocks."""
    folder, hf_model = sliding
    engine_args = dict(ENGINE_CASES[case])
    if case == "preempting" and ModelConfig.from_folder(folder).kv_window is not None:
        # a sequence holds its window's blocks and a step's only: squeeze the pool and the steps harder
        engine_args.update(num_kv_blocks=8, max_num_batched_tokens=16)
    llm = LLM(str(folder), dtype="float32", **engine_args)
    assert max(len(llm.tokenizer.encode(p)) for p in PROMPTS) > 4 * WINDOW
    check_against_transformers(llm, hf_model)
    if case == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_every_attention_path_matches_transformers(sliding, kernels: str, deterministic: bool) -> None:
    """The native kernels and torch without them, each as batches compute (native decodes, masked SDPA
    for prompts) and as --deterministic does (the row-invariant prompt kernel, or block-aligned tiles)."""
    folder, hf_model = sliding
    llm = LLM(str(folder), dtype="float32", deterministic=deterministic, **ENGINE_CASES["chunked32"])
    assert (llm.engine.runtime_info()["kernels"] == "torch") == (kernels == "torch")
    check_against_transformers(llm, hf_model, PROMPTS[3:])


def test_a_prefix_cache_hit_longer_than_the_window(sliding) -> None:
    """A prompt whose first 48+ tokens are cached: the sliding layers read only the cached K/V in
    their window, the global ones all of it."""
    folder, hf_model = sliding
    llm = LLM(str(folder), dtype="float32")
    prefix = PROMPTS[6]
    llm.generate([prefix], SamplingParams(max_tokens=1))
    hits = llm.engine.kv.stats.hits
    check_against_transformers(llm, hf_model, [prefix + " The mission"], prompt_logprobs=False)
    assert llm.engine.kv.stats.hits - hits >= 6 * WINDOW


def test_scoring_is_bit_identical_cold_cached_and_batched(sliding, kernels: str) -> None:
    """Label log-probabilities of a 200-token question: cold, cached, batched, and from a partly
    shared block, the same bits, on the native kernels and on torch's block-aligned tiles; and
    transformers' within tolerance."""
    folder, hf_model = sliding
    text = " ".join(["alpha", "ticket", "billing", "server", "network"] * 30)
    check_scoring_is_bit_identical(folder, text, kernels, dtype="float32")
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=96)
    prompt = question(llm, text, 0)
    labels = [llm.tokenizer.encode(x)[0] for x in ("A", "B")]
    got = llm.generate([prompt], SamplingParams(label_token_ids=labels))[0].outputs[0].label_logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([llm.tokenizer.encode(prompt)])).logits[0, -1].float(), dim=-1)
    assert max(abs(g - ref[t].item()) for g, t in zip(got, labels, strict=True)) < LOGPROB_TOL


def test_sliding_window_config_rules() -> None:
    """Shapes of real configs: Mistral-7B-v0.1 windows every layer (4096 of 32768); v0.2 (null) and the
    Qwen2.5s (a sliding_window present but use_sliding_window false) none; Qwen slides the layers from
    max_window_layers on, or those layer_types names; a window as long as the context is none."""
    base = {"vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 32768}
    cases = [
        ({"model_type": "mistral", "sliding_window": 4096}, (4096, 4096)),
        ({"model_type": "mixtral", "sliding_window": 4096, "num_local_experts": 4, "num_experts_per_tok": 2},
         (4096, 4096)),
        ({"model_type": "mistral", "sliding_window": None}, ()),
        ({"model_type": "mistral"}, ()),
        ({"model_type": "mistral", "sliding_window": 32768}, ()),
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 0}, ()),
        ({"model_type": "qwen3", "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 0}, ()),
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 2}, ()),
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 1},
         (None, 4096)),
        ({"model_type": "qwen3", "sliding_window": 4096, "use_sliding_window": True,
          "layer_types": ["sliding_attention", "full_attention"]}, (4096, None)),
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 0,
          "layer_types": ["full_attention"] * 2}, ()),
        # transformers' Llama has no window, whatever the config says
        ({"model_type": "llama", "sliding_window": 4096}, ()),
    ]
    for extra, windows in cases:
        assert ModelConfig.from_hf_dict({**base, **extra}).layer_windows == windows, extra


def test_gemma3_config_rules() -> None:
    """Gemma 3 configs as transformers 5 writes them (rope_parameters by layer type) and as the Hub's
    checkpoints have them (rope_theta, rope_local_base_freq, linear scaling of the global layers only,
    every sixth layer global); Gemma 2's soft-capping refused by name."""
    base = {"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
            "max_position_embeddings": 131072, "sliding_window": 1024}
    hub = ModelConfig.from_hf_dict({**base, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                    "query_pre_attn_scalar": 256})
    assert hub.layer_windows == ((1024,) * 5 + (None,)) * 2
    assert (hub.rope_theta, hub.rope_scaling["factor"]) == (1000000.0, 8.0)
    assert (hub.gemma.local_rope_theta, hub.gemma.local_rope_scaling) == (10000.0, None)
    assert hub.attention_scale == 256**-0.5 and hub.qk_norm
    ropes = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    v5 = ModelConfig.from_hf_dict({**base, "query_pre_attn_scalar": 24, "rope_parameters": ropes,
                                   "layer_types": ["sliding_attention", "full_attention"] * 6})
    assert v5.layer_windows == (1024, None) * 6 and (v5.rope_theta, v5.rope_scaling) == (1e6, None)
    assert v5.gemma.local_rope_theta == 1e4 and v5.attention_scale == 24**-0.5
    for capped in ("attn_logit_softcapping", "final_logit_softcapping"):
        with pytest.raises(ValueError, match=f"'google/x' sets {capped}=30.0"):
            ModelConfig.from_hf_dict({**base, capped: 30.0}, name="google/x")


def test_gpt_oss_config_and_its_shards() -> None:
    """Its clamped SwiGLU, sinks and windows read from the config; on two ranks (TP or EP) it splits evenly,
    and a row-parallel bias (its output projection's, its experts' down projections') is added by rank 0
    alone, as the summed outputs need (tests/test_tensor_parallel.py runs it against transformers)."""
    import torch

    from ladle.model.sharding import Shard

    cfg = ModelConfig.from_hf_dict({"model_type": "gpt_oss", "vocab_size": 100, "hidden_size": 64,
                                    "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2,
                                    "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                                    "layer_types": ["sliding_attention", "full_attention"]})
    assert cfg.moe.clamped_swiglu == (1.702, 7.0) and cfg.attention_sinks and cfg.layer_windows == (8, None)
    bias = torch.ones(3)
    for expert_parallel in (False, True):
        Shard(0, 2, expert_parallel).check(cfg)
        assert Shard(0, 2, expert_parallel).row_parallel_bias(bias) is bias
        assert Shard(1, 2, expert_parallel).row_parallel_bias(bias) is None


def test_an_mxfp4_gpt_oss_gives_its_dequantised_twins_tokens(tmp_path: Path, smollm2_dir: Path) -> None:
    """A gpt-oss checkpoint whose experts are MXFP4 (random codes and scales: any bytes are a valid
    packing, no packer of ladle's involved) against transformers on its twin dequantised by
    transformers' own converter: the same greedy tokens, logprobs within tolerance."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    twin = build_tiny_model("gpt_oss", tmp_path / "twin", smollm2_dir)
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    for f in twin.iterdir():
        if f.suffix != ".safetensors":
            (packed / f.name).write_bytes(f.read_bytes())
    tensors, quantized = {}, {}
    for f in twin.glob("*.safetensors"):
        tensors.update(load_file(f))
    gen = torch.Generator().manual_seed(7)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors[name].shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 127, (experts, outputs, inputs // 32), generator=gen, dtype=torch.uint8)
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
        assert torch.equal(mxfp4.dequantize(blocks, scales).transpose(-1, -2), tensors[name])
    save_file(tensors, twin / "model.safetensors")
    save_file({**{n: t for n, t in tensors.items() if not n.endswith(("gate_up_proj", "down_proj"))}, **quantized},
              packed / "model.safetensors")
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    (packed / "config.json").write_text(json.dumps(config))
    hf_model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    check_against_transformers(LLM(str(packed), dtype="float32"), hf_model, PROMPTS[:4])


def test_decisions_match_transformers(sliding) -> None:
    """A decision over HTTP on each family: its options' probabilities are the softmax of transformers'
    logits for the option tokens at the end of the prompt ladle rendered (returned with the answer)."""
    import httpx
    from server_utils import own_server

    from ladle.config import EngineConfig

    folder, hf_model = sliding
    question = {"id": "team", "type": "choice", "question": "Which team should handle this ticket?",
                "options": [{"name": "billing"}, {"name": "technical"}, {"name": "sales"}]}
    body = {"input": "The integration keeps failing. " * 4, "questions": [question], "return_prompt_token_ids": True}
    with own_server(EngineConfig(model=str(folder), dtype="float32")) as server:
        r = httpx.post(f"{server.url}/v1/decisions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()["answers"]["team"]
    assert len(answer["prompt_token_ids"]) > 4 * WINDOW
    with torch.no_grad():
        logits = hf_model(torch.tensor([answer["prompt_token_ids"]])).logits[0, -1].double()
    expected = torch.softmax(logits[answer["label_token_ids"]], dim=0)
    got = torch.tensor(list(answer["probabilities"].values()), dtype=torch.float64)
    assert (got - expected).abs().max() < 1e-4, (got, expected)


def test_a_gemma3_image_and_text_checkpoint_serves_text(tmp_path: Path, smollm2_dir: Path) -> None:
    """Gemma 3's 4B-27B checkpoints hold a vision tower beside the language model: ladle reads the
    language model alone (its config's text_config, defaults filled in as transformers fills them)
    and matches transformers' image-and-text class on text."""
    from transformers import AutoModelForImageTextToText

    folder = build_tiny_model("gemma3-vision", tmp_path / "gemma3-vision", smollm2_dir)
    hf_model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "Gemma3ForConditionalGeneration"
    llm = LLM(str(folder), dtype="float32")
    assert llm.engine.model_config.layer_windows == (WINDOW, None) * 2
    check_against_transformers(llm, hf_model, PROMPTS[:4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma_norms_round_as_transformers_does(dtype: torch.dtype) -> None:
    """In reduced precision Gemma multiplies the normed float32 row by (1 + weight) before rounding,
    where Llama rounds first: ladle's norm with Gemma's float32 scale is transformers' module bit for bit."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from ladle.model.layers import rms_norm

    gen = torch.Generator().manual_seed(4)
    norm = Gemma3RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256, generator=gen).to(dtype))  # as a checkpoint holds it
    x = (torch.randn(64, 256, generator=gen) * 3).to(dtype)
    with torch.no_grad():
        expected = norm.to(dtype)(x)
    assert torch.equal(rms_norm(x, 1.0 + norm.weight.detach().float(), 1e-6), expected)
