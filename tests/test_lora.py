"""Multi-LoRA in the engine against transformers + peft (pinned) on the same adapters: greedy outputs
alone and in a batch mixing three adapters and the base, logprobs against the merged weights, the
prefix cache kept apart per adapter, the --max-loras bound, paging, and folders ladle refuses.

The adapters are random (B drawn wide enough to change what the model says), built and saved in
PEFT's format by the tests (tests/lora_adapters.py), and loaded from disk.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import kept_reference
from lora_adapters import ADAPTERS, build_adapter, peft_model

from ladle import LLM, LoRARequest, SamplingParams
from ladle.errors import InvalidRequestError
from ladle.lora.adapter import AdapterError, load_adapter
from ladle.model.loader import default_gguf_path

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
LOGPROB_TOL = 2e-3  # absolute, on log-probabilities: float32 both sides, int8-blocked base vs dequantised


@pytest.fixture(scope="module")
def adapters(lora_adapters) -> dict[str, Path]:
    return lora_adapters


@pytest.fixture(scope="module")
def references(hf_smollm2, adapters) -> dict[str | None, list[list[int]]]:
    """peft's greedy continuation of every prompt, per adapter (None: the base model). Kept once per
    machine (conftest.kept_reference), keyed by the base model's folder (named by its GGUF's content),
    the adapters' files and the prompts: transformers decodes ~15 s for it."""
    base, tok = hf_smollm2

    def compute() -> dict[str, list[list[int]]]:
        out = {}
        for name in [None, *adapters]:
            model = base if name is None else peft_model(base, adapters[name])
            out[str(name)] = [_hf_greedy(model, tok.encode(p)) for p in PROMPTS]
        return out

    # the base's folder is named by its GGUF's content and the transformers version that read it
    inputs: list[Path | str] = [Path(base.name_or_path).name, json.dumps([PROMPTS, MAX_TOKENS])]
    for name in sorted(adapters):
        inputs += [_canonical_config(adapters[name]), adapters[name] / "adapter_model.safetensors"]
    kept = kept_reference("lora-greedy", inputs, compute)
    return {None if name == "None" else name: ids for name, ids in kept.items()}


def _canonical_config(folder: Path) -> str:
    """adapter_config.json with its lists of names sorted: peft writes target_modules from a set, in an
    order that changes from one process to the next."""
    config = json.loads((folder / "adapter_config.json").read_text())
    return json.dumps({k: sorted(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else v
                       for k, v in config.items()}, sort_keys=True)


def _hf_greedy(model, ids: list[int]) -> list[int]:
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _llm(adapters: dict[str, Path], **args) -> LLM:
    return LLM(str(default_gguf_path()), kv_cache_memory_gib=0.5, dtype="float32", enable_lora=True,
               lora_modules={name: str(path) for name, path in adapters.items()}, **args)


@pytest.fixture(scope="module")
def llm(adapters) -> LLM:
    return _llm(adapters, max_loras=4)


@pytest.fixture(params=["native", "loop"])
def lora_kernel(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of adding the adapters' terms: the native gather kernel and torch's loop over adapters."""
    monkeypatch.setenv("LADLE_LORA_KERNEL", request.param)
    return request.param


def _greedy(llm: LLM, prompts: list[str], loras: list[str | None]) -> list[list[int]]:
    requests = [None if name is None else LoRARequest(name) for name in loras]
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY, lora_request=requests)]


def test_each_adapter_alone_matches_peft(llm: LLM, references, lora_kernel: str) -> None:
    for name in ADAPTERS:
        assert _greedy(llm, PROMPTS, [name] * len(PROMPTS)) == references[name], name
        assert references[name] != references[None]  # the adapter changes what the model says


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(llm: LLM, references, lora_kernel: str) -> None:
    mix = [None, "attn", "mlp", "mixed"]
    prompts = [p for p in PROMPTS for _ in mix]
    loras = mix * len(PROMPTS)
    got = _greedy(llm, prompts, loras)
    for i, (name, tokens) in enumerate(zip(loras, got)):
        assert tokens == references[name][i // len(mix)], (name, prompts[i])


def test_logprobs_match_the_merged_weights(llm: LLM, hf_smollm2, adapters) -> None:
    base, tok = hf_smollm2
    for name in ("all", "mixed"):
        merged = peft_model(base, adapters[name]).merge_and_unload()
        [result] = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=6, logprobs=5),
                                lora_request=LoRARequest(name))
        ids = tok.encode(PROMPTS[2]) + result.outputs[0].token_ids
        with torch.no_grad():
            logits = merged(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)
        start = len(ids) - len(result.outputs[0].token_ids) - 1
        for i, lp in enumerate(result.outputs[0].logprobs):
            for token, value in lp.top:
                assert abs(value - ref[start + i, token].item()) < LOGPROB_TOL, (name, i, token)


def test_the_prefix_cache_never_shares_blocks_across_adapters(llm: LLM, references) -> None:
    prompt = "A lighthouse keeper counted the ships. " + "The village had a well, a mill and a bakery. " * 4
    cold_base = llm.generate(prompt, GREEDY)[0]
    on_attn = llm.generate(prompt, GREEDY, lora_request=LoRARequest("attn"))[0]
    assert on_attn.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    again = llm.generate(prompt, GREEDY, lora_request=LoRARequest("attn"))[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == on_attn.outputs[0].token_ids
    warm_base = llm.generate(prompt, GREEDY)[0]
    assert warm_base.num_cached_tokens >= 32 and warm_base.outputs[0].token_ids == cold_base.outputs[0].token_ids
    assert on_attn.outputs[0].token_ids != cold_base.outputs[0].token_ids


def test_more_adapters_than_slots_all_finish_within_the_bound(adapters, references, lora_kernel: str) -> None:
    llm = _llm(adapters, max_loras=2, max_cpu_loras=2)  # 4 adapters, 2 slots, 2 kept in memory
    engine = llm.engine
    names = list(ADAPTERS) * 2
    for i, name in enumerate(names):
        engine.add_request(str(i), PROMPTS[i % len(PROMPTS)], GREEDY, lora=name)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(t for d in out.deltas for t in d.token_ids)
        running = {s.lora.id for s in engine.scheduler.running if s.lora is not None}
        assert len(running) <= 2
    for i, name in enumerate(names):
        assert outputs[str(i)] == references[name][i % len(PROMPTS)], name
    assert engine.loras.num_in_memory() <= 2
    assert engine.loras.num_loads > len(ADAPTERS)  # paged out and read again
    assert engine.runner.lora_slots.num_writes > 2  # slots were reused


def test_loading_and_unloading_at_run_time(llm: LLM, adapters, references) -> None:
    llm.engine.add_lora("attn-again", str(adapters["attn"]))
    assert _greedy(llm, PROMPTS[:1], ["attn-again"]) == references["attn"][:1]
    assert llm.engine.remove_lora("attn-again") and not llm.engine.remove_lora("attn-again")
    with pytest.raises(Exception, match="no LoRA adapter named 'attn-again'"):
        llm.engine.add_request("x", PROMPTS[0], GREEDY, lora="attn-again")


def _copy(src: Path, dst: Path, config_changes: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "adapter_config.json").read_text())
        config.update(config_changes)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def test_folders_ladle_cannot_serve_are_refused_with_the_reason(llm: LLM, adapters, tmp_path: Path) -> None:
    cfg = llm.engine.model_config
    cases = {
        "missing": (tmp_path / "nowhere", "is not a folder"),
        "dora": (_copy(adapters["attn"], tmp_path / "dora", {"use_dora": True}), "DoRA"),
        "bias": (_copy(adapters["attn"], tmp_path / "bias", {"bias": "all"}), "bias"),
        "saved": (_copy(adapters["attn"], tmp_path / "saved", {"modules_to_save": ["lm_head"]}), "modules_to_save"),
        "prefix": (_copy(adapters["attn"], tmp_path / "prefix", {"peft_type": "PREFIX_TUNING"}), "LORA"),
    }
    no_weights = _copy(adapters["attn"], tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    cases["no weights"] = (no_weights, "adapter_model.safetensors")
    for name, (path, words) in cases.items():
        with pytest.raises(AdapterError, match=words):
            load_adapter(name, path, cfg, max_rank=16)
    with pytest.raises(AdapterError, match="over --max-lora-rank 8"):
        load_adapter("big", adapters["mixed"], cfg, max_rank=8)  # rank 16
    with pytest.raises(AdapterError, match="already loaded"):
        llm.engine.add_lora("attn", str(adapters["mlp"]))


def test_an_adapter_for_another_base_is_refused(llm: LLM, tiny, tmp_path: Path) -> None:
    _, tiny_model = tiny
    folder = build_adapter(tiny_model, tmp_path / "tiny", 0, r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="do not fit this model's q_proj"):
        load_adapter("tiny", folder, llm.engine.model_config, max_rank=16)


def test_scaling_follows_rslora_and_alpha_pattern(adapters, llm: LLM) -> None:
    _, weights = load_adapter("mlp", adapters["mlp"], llm.engine.model_config, max_rank=16)
    from safetensors.torch import load_file

    raw = load_file(str(adapters["mlp"] / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]
    assert torch.allclose(weights.modules[(0, "up_proj")][1], b * (8 / math.sqrt(4)))  # rsLoRA: alpha / sqrt(r)
    _, mixed = load_adapter("mixed", adapters["mixed"], llm.engine.model_config, max_rank=16)
    raw = load_file(str(adapters["mixed"] / "adapter_model.safetensors"))
    v = raw["base_model.model.model.layers.3.self_attn.v_proj.lora_B.weight"]
    assert torch.allclose(mixed.modules[(3, "v_proj")][1], v * (32 / 16))  # alpha_pattern
    assert mixed.modules[(3, "down_proj")][0].shape[0] == 4  # rank_pattern
    assert (25, "q_proj") not in mixed.modules  # layers_to_transform


def test_an_adapter_whose_folder_went_while_paged_out_is_refused_not_fatal(adapters, references,
                                                                          tmp_path: Path) -> None:
    folders = {name: _copy(adapters[name], tmp_path / name) for name in ("attn", "mlp")}
    llm = _llm(folders, max_loras=1, max_cpu_loras=1)  # registering mlp paged attn out
    shutil.rmtree(folders["attn"])
    with pytest.raises(InvalidRequestError, match="'attn' could not be paged in again"):
        llm.engine.add_request("gone", PROMPTS[0], GREEDY, lora="attn")
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request("kept", PROMPTS[0], GREEDY, lora="mlp")  # pinned while it runs
    shutil.rmtree(folders["mlp"])
    tokens = []
    while llm.engine.has_unfinished_requests():
        tokens += [t for out in llm.engine.step() for d in out.deltas for t in d.token_ids]
    assert tokens == references["mlp"][0]
