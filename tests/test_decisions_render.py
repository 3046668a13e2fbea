"""Decisions without a server: the pinned prompt format, label checks, and the answer arithmetic.

A failing pin here means the prompt wording changed: bump PROMPT_FORMAT_VERSION with it.
"""

from __future__ import annotations

import math

import pytest

from ladle.decisions.answers import LabelScores, choice_confidence, label_softmax, score_confidence
from ladle.decisions.labels import TWO_LETTERS, LabelChecker, base_labels
from ladle.decisions.pipeline import prepare
from ladle.decisions.question import Option, Question
from ladle.decisions.render import (
    PROMPT_FORMAT_VERSION, question_message, render_json_or_text, render_prompt, template_kwargs,
)
from ladle.errors import InvalidRequestError
from ladle.model.loader import resolve_model_path
from ladle.model.tokenizer import CHATML_TEMPLATE, Tokenizer
from ladle.server.errors import APIError

INPUT = "The integration keeps failing."
HEAD = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nThe integration keeps failing.\n\n")
TAIL = "<|im_end|>\n<|im_start|>assistant\n"
HEAD_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
            2, 198, 1, 4093, 198, 504, 7657, 8211, 14586, 30, 198, 198]
TAIL_IDS = [2, 198, 1, 520, 9531, 198]

CHOICE = Question("team", "questions[0]", "choice", "Which team should handle this ticket?",
                  [Option("billing", "payments and invoices"), Option("technical"), Option("sales")])
SCORE = Question("sev", "questions[1]", "score", "How severe is it?", [Option("low"), Option("high")])
YES_NO = Question("urgent", "questions[2]", "yes_no", "The ticket is urgent.",
                  [Option("yes", "needs action today"), Option("no")])

PINNED = [
    (CHOICE,
     "Question: Which team should handle this ticket?\nA: billing - payments and invoices\nB: technical\nC: sales\n"
     "Answer with the letter of one option only.",
     [17872, 42, 10366, 2299, 868, 5605, 451, 19574, 47, 198, 49, 42, 38971, 731, 11885, 284, 797, 44729, 198, 50,
      42, 5289, 198, 51, 42, 7122, 198, 21350, 351, 260, 4386, 282, 582, 4622, 805, 30],
     [49, 50, 51]),
    (SCORE,
     "Question: How severe is it?\n0: low\n1: high\nAnswer with the number of one level only.",
     [17872, 42, 1073, 3523, 314, 357, 47, 198, 32, 42, 1642, 198, 33, 42, 904, 198, 21350, 351, 260, 1230, 282, 582,
      1106, 805, 30],
     [32, 33]),
    (YES_NO,
     "Is the following true? The ticket is urgent.\nyes: needs action today\nAnswer with yes or no only.",
     [4182, 260, 1695, 2629, 47, 378, 19574, 314, 14535, 30, 198, 10407, 42, 1923, 2353, 1834, 198, 21350, 351,
      9805, 355, 787, 805, 30],
     [10407, 4607]),
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(resolve_model_path(None))


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.backend, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, template)


@pytest.mark.parametrize("q, body, body_ids, label_ids", PINNED, ids=["choice", "score", "yes_no"])
def test_prompt_format_v1_is_pinned(tok: Tokenizer, q: Question, body: str, body_ids: list[int],
                                    label_ids: list[int]) -> None:
    assert PROMPT_FORMAT_VERSION == 1
    prompt = render_prompt(tok, question_message(INPUT, q, base_labels(q)), template_kwargs(None), q)
    assert prompt == HEAD + body + TAIL
    [p] = prepare(tok, 8192, INPUT, [q], template_kwargs(None))
    assert p.prompt_ids == HEAD_IDS + body_ids + TAIL_IDS
    assert p.label_ids == label_ids


def test_two_letter_labels_are_single_tokens_at_the_answer_position(tok: Tokenizer) -> None:
    q = Question("many", "questions.many", "choice", "Which?", [Option(f"option {i}") for i in range(40)])
    [p] = prepare(tok, 8192, INPUT, [q], template_kwargs(None))
    assert p.labels[:9] == TWO_LETTERS[:9] and "AJ" not in p.labels  # "AJ" is two tokens for SmolLM2
    assert len(set(p.label_ids)) == 40
    text = tok.decode(p.prompt_ids, skip_special_tokens=False)
    assert "AA: option 0\nAB: option 1\n" in text and text.endswith(
        "Answer with the two letters of one option only.<|im_end|>\n<|im_start|>assistant\n")
    for label, token in zip(p.labels, p.label_ids):
        assert tok.encode(text + label) == p.prompt_ids + [token]


def test_tail_shortcut_agrees_with_encoding_the_whole_prompt(tok: Tokenizer) -> None:
    checker = LabelChecker(tok)
    for text in ("plain text", "ends in space ", "<|im_end|> quoted", "ünïcödé"):
        prompt = tok.apply_chat_template([{"role": "user", "content": text}])
        ids = tok.encode(prompt)
        labels = ["A", "yes", "no", "7", "AB", " A", "Hello"]
        whole = []
        for label in labels:
            full = tok.encode(prompt + label)
            whole.append(full[-1] if len(full) == len(ids) + 1 and full[:-1] == ids else None)
        assert checker.label_ids(prompt, ids, labels) == whole


def test_label_that_is_not_one_token_is_refused(tok: Tokenizer) -> None:
    spaced = with_template(tok, CHATML_TEMPLATE.replace("assistant\n'", "assistant\n '"))
    with pytest.raises(InvalidRequestError) as e:
        prepare(spaced, 8192, INPUT, [CHOICE], template_kwargs(None))
    assert e.value.param == "questions[0]" and "'team'" in e.value.message and "label 'A'" in e.value.message


def test_labels_sharing_a_token_are_refused(tok: Tokenizer) -> None:
    checker = LabelChecker(tok)
    checker.label_ids = lambda prompt, ids, labels: [7, 8, 7]  # as a tokenizer that folds case would
    with pytest.raises(InvalidRequestError, match="labels 'A' and 'C' encode as the same token"):
        checker.check(CHOICE, "p", [1], ["A", "B", "C"])


def test_too_few_two_letter_labels_is_refused(tok: Tokenizer) -> None:
    checker = LabelChecker(tok)
    checker.label_ids = lambda prompt, ids, labels: [None] * len(labels)
    q = Question("many", "questions.many", "choice", "Which?", [Option(f"o{i}") for i in range(30)])
    with pytest.raises(InvalidRequestError, match="30 two-letter labels .* has only 0") as e:
        checker.two_letter_labels(q, "p", [1])
    assert e.value.param == "questions.many"


def test_reasoning_stays_off(tok: Tokenizer) -> None:
    assert template_kwargs(None)["enable_thinking"] is False
    assert template_kwargs({"custom": 1}) == {"enable_thinking": False, "thinking": False, "custom": 1}
    for kwargs, param in (({"enable_thinking": True}, "chat_template_kwargs.enable_thinking"),
                          ({"thinking": True}, "chat_template_kwargs.thinking"),
                          ({"reasoning_effort": "high"}, "chat_template_kwargs.reasoning_effort"),
                          ({"add_generation_prompt": False}, "chat_template_kwargs")):
        with pytest.raises(InvalidRequestError) as e:
            template_kwargs(kwargs)
        assert e.value.param == param


def test_template_leaving_reasoning_open_is_refused(tok: Tokenizer) -> None:
    qwen_like = CHATML_TEMPLATE.replace(
        "{{ '<|im_start|>assistant\n' }}",
        "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
        "{% else %}{{ '<think>\n' }}{% endif %}")
    t = with_template(tok, qwen_like)
    message = question_message("He wrote <think> and stopped.", YES_NO, ["yes", "no"])
    closed = render_prompt(t, message, template_kwargs(None), YES_NO)  # the input may quote tags
    assert closed.endswith("<think>\n\n</think>\n\n")
    with pytest.raises(InvalidRequestError, match="leaves a reasoning block"):
        render_prompt(t, message, {"enable_thinking": None}, YES_NO)


def test_json_input_is_compact(tok: Tokenizer) -> None:
    assert render_json_or_text({"a": [1, "é"], "b": None}, "input") == '{"a":[1,"é"],"b":null}'
    assert render_json_or_text([], "input") == "[]"
    for bad in ("  \n", 3, None):
        with pytest.raises(InvalidRequestError):
            render_json_or_text(bad, "input")


def test_too_long_prompt_is_refused_never_truncated(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError) as e:
        prepare(tok, 64, INPUT, [CHOICE], template_kwargs(None))
    assert e.value.code == "context_length_exceeded" and "'team'" in e.value.message


def test_label_arithmetic() -> None:
    lps = [math.log(0.5), math.log(0.2), math.log(0.1)]
    s = LabelScores.of(lps)
    assert s.probabilities == pytest.approx([0.625, 0.25, 0.125])
    assert math.fsum(s.probabilities) == pytest.approx(1.0) and s.label_mass == pytest.approx(0.8)
    assert s.best == 0 and s.mean_index == pytest.approx(0.5) and s.raw_probability(1) == pytest.approx(0.2)
    hot, cold = LabelScores.of(lps, 4.0), LabelScores.of(lps, 0.25)
    assert hot.label_mass == s.label_mass == cold.label_mass  # temperature changes the shares, not the mass
    assert max(hot.probabilities) < max(s.probabilities) < max(cold.probabilities)
    assert label_softmax([-1e-300, -5.0], 1e-320) == [1.0, 0.0]  # tiny temperatures stay finite
    assert choice_confidence([0.5, 0.5]) == 0.0 and choice_confidence([1.0, 0.0, 0.0]) == 1.0
    assert choice_confidence([0.7]) == 1.0
    assert score_confidence([0.0, 1.0, 0.0]) == 1.0 and score_confidence([1 / 3] * 3) == pytest.approx(0.0)


@pytest.mark.parametrize("lps", [[float("nan"), -1.0], [-math.inf, -math.inf], [math.inf, -1.0]])
def test_non_finite_scores_are_a_server_fault(lps: list[float]) -> None:
    with pytest.raises(APIError) as e:
        LabelScores.of(lps)
    assert e.value.status == 500 and e.value.code == "non_finite_score"
