"""Sampling parameters and stop handling through the real engine and default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from ladle import LLM, SamplingParams
from ladle.engine.stop import OutputTextTracker
from ladle.errors import InvalidRequestError

PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nList the days of the week, separated by commas.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    llm = LLM(str(smollm2_dir), kv_cache_memory_gib=0.5)
    assert llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List the days of the week, separated by commas."}]) == PROMPT
    return llm


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def text_of(llm: LLM, prompt: str, params: SamplingParams) -> str:
    return llm.generate([prompt], params)[0].outputs[0].text


def test_stop_string_is_cut_and_not_returned(llm: LLM) -> None:
    full = text_of(llm, PROMPT, greedy(max_tokens=24, ignore_eos=True))
    assert "," in full
    stop = full[full.index(",") : full.index(",") + 2]  # a stop string that spans token edges
    out = llm.generate([PROMPT], greedy(max_tokens=24, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_token_ids_and_length(llm: LLM) -> None:
    ref = llm.generate([PROMPT], greedy(max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 10
    target = ref.token_ids[4]
    out = llm.generate([PROMPT], greedy(max_tokens=10, stop_token_ids=[target], ignore_eos=True))[0].outputs[0]
    first = ref.token_ids.index(target)
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_eos_ends_a_chat_answer(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy(max_tokens=64))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert "Paris" in out.outputs[0].text
    assert "<|im_end|>" not in out.outputs[0].text


def test_min_tokens_holds_off_eos(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "Say OK."}]
    short = llm.chat(msgs, greedy(max_tokens=40))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    longer = llm.chat(msgs, greedy(max_tokens=40, min_tokens=20))[0].outputs[0]
    assert len(longer.token_ids) >= 20


def test_n_seeded_choices_differ_and_reproduce(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = [o.token_ids for o in llm.generate([PROMPT], params)[0].outputs]
    b = [o.token_ids for o in llm.generate([PROMPT], params)[0].outputs]
    assert a == b and len({tuple(x) for x in a}) == 3


def test_top_k_one_and_min_p_one_are_greedy(llm: LLM) -> None:
    ref = llm.generate([PROMPT], greedy(max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    for params in (SamplingParams(top_k=1, seed=1, max_tokens=12, ignore_eos=True),
                   SamplingParams(min_p=1.0, seed=2, max_tokens=12, ignore_eos=True),
                   SamplingParams(top_p=1e-6, seed=3, max_tokens=12, ignore_eos=True)):
        assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == ref


def test_penalties_reduce_repetition(llm: LLM) -> None:
    prompt = "Repeat after me: la la la la la la la la"
    plain = llm.generate([prompt], greedy(max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    for params in (greedy(max_tokens=12, ignore_eos=True, repetition_penalty=5.0),
                   greedy(max_tokens=12, ignore_eos=True, frequency_penalty=2.0)):
        penalised = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert len(set(penalised)) > len(set(plain))


def test_penalty_arithmetic_matches_vllm() -> None:
    import torch

    from ladle.engine.request import Sequence
    from ladle.engine.sampler import Sampler

    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=[1, 2, 3, 3, 3], num_prompt_tokens=2,
                   params=params, arrival_time=0.0)
    x = torch.tensor([4.0, 4.0, -4.0, 4.0, 4.0])
    Sampler()._penalise(x, seq)
    # repetition (prompt and output): positive /2, negative *2; presence and frequency
    # (output only): token 3, generated three times, loses 0.5 + 3 * 0.25
    assert x.tolist() == [4.0, 2.0, -8.0, 4.0 / 2 - 0.5 - 0.75, 4.0]


def test_multibyte_text_streams_whole_characters(llm: LLM) -> None:
    prompt = "Translate to Japanese: good morning, thank you very much. Japanese:"
    res = llm.generate([prompt], greedy(max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert res.text == llm.tokenizer.decode(res.token_ids)
    assert "\ufffd" not in res.text


def test_refusals_name_the_field(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["x " * 9000], greedy(max_tokens=4))
    assert e.value.param == "prompt" and "maximum context length" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["hello"], greedy(max_tokens=9000))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(top_p=0.0)
    assert e.value.param == "top_p"
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["hello"], greedy(stop_token_ids=[10**9]))
    assert e.value.param == "stop_token_ids"
    assert not llm.engine.has_unfinished_requests()


class _Chars:
    def __init__(self, pieces: list[str]):
        self.pieces = iter(pieces)

    def step(self, token_id: int) -> str:
        return next(self.pieces)


def test_stop_text_is_held_back_until_it_cannot_match() -> None:
    tracker = OutputTextTracker(_Chars(["Hello", " wor", "ld", "!", " END", " more"]), stop=["world!", " END"])
    released = []
    for i in range(3):
        assert tracker.append(i) is None
        released.append(tracker.release(finished=False))
    assert "".join(released) == "Hello "  # "world" might still become "world!"
    assert tracker.append(3) == "world!"
    assert tracker.text == "Hello " and tracker.release(finished=True) == ""
