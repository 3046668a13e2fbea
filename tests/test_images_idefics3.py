"""SmolVLM/Idefics3 end to end against transformers on a tiny random checkpoint and drawn images:
ladle's prompt ids equal the processor's, its greedy tokens transformers' argmax, its sampled and
prompt logprobs within tolerance; one image and two; prefill chunks that cut through image spans; a
batch preempted in a tight pool; the prefix cache keyed by the image (the same image hits, another image
with the same text misses); scoring with an image bit-identical cold, cached and batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from tiny_vlm import build_tiny_idefics3, drawn_image

LOGPROB_TOL = 2e-3
QUESTION = "User:<image>What is drawn here?<end_of_utterance>\nAssistant:"
TWO = "User:<image>and<image>Which one is brighter?<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_idefics3(tmp_path_factory.mktemp("idefics3"), smollm2_dir)


@pytest.fixture(scope="module")
def reference(folder: Path):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(folder))


def hf_logprobs(reference, prompt: str, images: list, output: list[int]) -> tuple[list[int], torch.Tensor]:
    """The processor's prompt ids, and transformers' log-probabilities after each position of prompt + output."""
    model, processor = reference
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    full = torch.tensor([ids + output])
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), pixel_values=inputs["pixel_values"],
                       pixel_attention_mask=inputs["pixel_attention_mask"]).logits[0]
    return ids, torch.log_softmax(logits.double(), dim=-1)


def check_against_transformers(result, reference, prompt: str, images: list) -> None:
    out = result.outputs[0]
    ids, want = hf_logprobs(reference, prompt, images, out.token_ids)
    assert result.prompt_token_ids == ids
    n = len(ids)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token == int(want[n - 1 + i].argmax())  # greedy: transformers picks the same token
        assert abs(lp.logprob - want[n - 1 + i, token].item()) < LOGPROB_TOL
    for pos, lp in enumerate((result.prompt_logprobs or [None])[1:], start=1):  # placeholders' positions too
        assert abs(lp.logprob - want[pos - 1, ids[pos]].item()) < LOGPROB_TOL, pos


GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0, prompt_logprobs=0)
CACHED = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)  # prompt logprobs skip the cache


def run(llm: LLM, prompt: str, images: list, params: SamplingParams = GREEDY):
    return llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params)[0]


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 23, "long_prefill_token_threshold": 23}],
                         ids=["plain", "chunked23"])
def test_one_and_two_images_match_transformers(folder: Path, reference, engine_args: dict) -> None:
    """chunked23: 23-token prefill chunks cut the 16-placeholder spans at every offset."""
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.05, enable_prefix_caching=False, **engine_args)
    one = [drawn_image(1)]
    two = [drawn_image(2, (40, 64)), drawn_image(3, (30, 30))]
    check_against_transformers(run(llm, QUESTION, one), reference, QUESTION, one)
    check_against_transformers(run(llm, TWO, two), reference, TWO, two)
    assert llm.engine.images.stats.runs == 3


def test_a_batch_in_a_tight_pool_is_preempted_and_recomputed_with_its_images(folder: Path, reference) -> None:
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32, block_size=8, max_num_batched_tokens=64)
    one, two = [drawn_image(1)], [drawn_image(2, (40, 64)), drawn_image(3, (30, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    results = llm.generate([{"prompt": QUESTION, "multi_modal_data": {"image": one}},
                            {"prompt": TWO, "multi_modal_data": {"image": two}}], params)
    assert llm.engine.scheduler.num_preemptions > 0
    check_against_transformers(results[0], reference, QUESTION, one)
    check_against_transformers(results[1], reference, TWO, two)


def test_prefix_cache_hits_on_the_same_image_and_misses_on_another(folder: Path, reference) -> None:
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.05, block_size=16)
    image, other = drawn_image(4), drawn_image(5)
    first = run(llm, QUESTION, [image], CACHED)
    again = QUESTION.replace("What is drawn here?", "Is there a circle?")
    hit = run(llm, again, [image], CACHED)
    assert hit.num_cached_tokens >= 80  # the image's tiles, in whole blocks
    check_against_transformers(hit, reference, again, [image])
    miss = run(llm, QUESTION, [other], CACHED)
    assert miss.prompt_token_ids == first.prompt_token_ids  # the same ids: only the image differs
    assert miss.num_cached_tokens < 16  # no block holding a placeholder is shared
    check_against_transformers(miss, reference, QUESTION, [other])
    assert miss.outputs[0].logprobs[0].logprob != first.outputs[0].logprobs[0].logprob
    assert llm.engine.images.stats.runs == 2 and llm.engine.images.stats.hits == 1


def test_scoring_with_an_image_is_bit_identical_cold_cached_and_batched(folder: Path) -> None:
    args = dict(dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=40, block_size=16)
    llm = LLM(str(folder), **args)
    labels = [llm.tokenizer.encode(x)[0] for x in ("A", "B", "C")]
    score = SamplingParams(label_token_ids=labels)
    chat = SamplingParams(temperature=0.0, max_tokens=3)
    image = drawn_image(6)
    prompt = {"prompt": QUESTION, "multi_modal_data": {"image": image}}
    cold = llm.generate(prompt, score)[0].outputs[0].label_logprobs
    hits = llm.engine.kv.stats.hits
    warm = llm.generate(prompt, score)[0].outputs[0].label_logprobs
    assert llm.engine.kv.stats.hits > hits
    other = {"prompt": TWO, "multi_modal_data": {"image": [drawn_image(7), image]}}
    mixed = llm.generate([other, "Tell me a story. " * 8, prompt], [score, chat, score])
    fresh = LLM(str(folder), **{**args, "max_num_batched_tokens": 64}).generate(prompt, score)[0]
    assert cold == warm == mixed[2].outputs[0].label_logprobs == fresh.outputs[0].label_logprobs
