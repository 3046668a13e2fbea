"""Qwen2.5-VL end to end against transformers on a tiny random checkpoint and drawn images: its tower at
each image's own resolution, M-RoPE positions (an image's tokens by row and column, the text after it
going on from its largest), prompt ids, greedy tokens and logprobs with one image and two, prefill chunks
cutting through image spans, the prefix cache keyed by the image, scoring bit-identical cold, cached and
batched, and the server's chat path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from tiny_vlm import build_tiny_qwen2_5_vl, drawn_image

LOGPROB_TOL = 2e-3
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTION = f"<|im_start|>user\n{IMAGE}What is drawn here?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{IMAGE} and {IMAGE}Which is brighter?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0, prompt_logprobs=0)
CACHED = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"), smollm2_dir)


@pytest.fixture(scope="module")
def reference(folder: Path):
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, AutoImageProcessor.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(folder))


def hf_logprobs(reference, prompt: str, images: list, output: list[int]) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids with each <|image_pad|> expanded as Qwen2.5-VL's processor expands it, and
    transformers' log-probabilities after each position of prompt + output."""
    model, processor, tokenizer = reference
    pixels = processor(images=images, return_tensors="pt")
    pieces = prompt.split("<|image_pad|>")
    counts = [int(g.prod()) // 4 for g in pixels["image_grid_thw"]]
    text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    full = torch.tensor([ids + output])
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), pixel_values=pixels["pixel_values"],
                       image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(full == pad).int()).logits[0]
    return ids, torch.log_softmax(logits.double(), dim=-1)


def check_against_transformers(result, reference, prompt: str, images: list) -> None:
    out = result.outputs[0]
    ids, want = hf_logprobs(reference, prompt, images, out.token_ids)
    assert result.prompt_token_ids == ids
    n = len(ids)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token == int(want[n - 1 + i].argmax())
        assert abs(lp.logprob - want[n - 1 + i, token].item()) < LOGPROB_TOL
    for pos, lp in enumerate((result.prompt_logprobs or [None])[1:], start=1):
        assert abs(lp.logprob - want[pos - 1, ids[pos]].item()) < LOGPROB_TOL, pos


def run(llm: LLM, prompt: str, images: list, params: SamplingParams = GREEDY):
    return llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params)[0]


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 13, "long_prefill_token_threshold": 13, "block_size": 8}],
                         ids=["plain", "chunked13"])
def test_one_and_two_images_match_transformers(folder: Path, reference, engine_args: dict) -> None:
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.05, enable_prefix_caching=False, **engine_args)
    one = [drawn_image(1)]
    two = [drawn_image(2, (40, 64)), drawn_image(3, (30, 30))]
    check_against_transformers(run(llm, QUESTION, one), reference, QUESTION, one)
    check_against_transformers(run(llm, TWO, two), reference, TWO, two)


def test_prefix_cache_hits_on_the_same_image_and_misses_on_another(folder: Path, reference) -> None:
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.05, block_size=8)
    image, other = drawn_image(4), drawn_image(5)
    first = run(llm, QUESTION, [image], CACHED)
    again = QUESTION.replace("What is drawn here?", "Is there a circle?")
    hit = run(llm, again, [image], CACHED)
    assert hit.num_cached_tokens >= 40
    check_against_transformers(hit, reference, again, [image])
    miss = run(llm, QUESTION, [other], CACHED)
    assert miss.prompt_token_ids == first.prompt_token_ids and miss.num_cached_tokens < 8
    check_against_transformers(miss, reference, QUESTION, [other])


def test_scoring_with_an_image_is_bit_identical_cold_cached_and_batched(folder: Path) -> None:
    args = dict(dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=24, block_size=8)
    llm = LLM(str(folder), **args)
    labels = [llm.tokenizer.encode(x)[0] for x in ("A", "B", "C")]
    score = SamplingParams(label_token_ids=labels)
    prompt = {"prompt": QUESTION, "multi_modal_data": {"image": drawn_image(7)}}
    cold = llm.generate(prompt, score)[0].outputs[0].label_logprobs
    hits = llm.engine.kv.stats.hits
    warm = llm.generate(prompt, score)[0].outputs[0].label_logprobs
    assert llm.engine.kv.stats.hits > hits
    other = {"prompt": TWO, "multi_modal_data": {"image": [drawn_image(8), drawn_image(7)]}}
    mixed = llm.generate([other, "Tell me a story. " * 8, prompt],
                         [score, SamplingParams(temperature=0.0, max_tokens=3), score])
    fresh = LLM(str(folder), **{**args, "max_num_batched_tokens": 64}).generate(prompt, score)[0]
    assert cold == warm == mixed[2].outputs[0].label_logprobs == fresh.outputs[0].label_logprobs


@pytest.mark.parametrize("engine_args, what", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
    ({"tensor_parallel_size": 2}, "tensor parallelism"),
])
def test_what_m_rope_does_not_run_yet_is_refused_by_name(folder: Path, engine_args: dict, what: str) -> None:
    with pytest.raises(ValueError, match=f"{what} on M-RoPE models"):
        LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.05, **engine_args)


def test_chat_with_a_data_url_answers_as_transformers(folder: Path, reference) -> None:
    """The server's chat path on Qwen2.5-VL: the image part placed by its template between the vision
    marks, expanded, encoded and answered as transformers generates."""
    import base64
    import io

    import openai

    from ladle.config import EngineConfig
    from server_utils import MODEL, own_server

    model, processor, tokenizer = reference
    image = drawn_image(6)
    prompt = QUESTION.replace("What is drawn here?", "Describe it.")
    pixels = processor(images=[image], return_tensors="pt")
    pieces = prompt.split("<|image_pad|>")
    text = pieces[0] + "<|image_pad|>" * (int(pixels["image_grid_thw"][0].prod()) // 4) + pieces[1]
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels["pixel_values"],
                             image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(ids == pad).int(),
                             max_new_tokens=4, do_sample=False, eos_token_id=2, pad_token_id=0)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    with own_server(EngineConfig(model=str(folder), dtype="float32", kv_cache_memory_gib=0.05)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe it."}]}])
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == ids.shape[1]
