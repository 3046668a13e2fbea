"""The think-block parser: whole replies, and the same replies streamed in deltas cut anywhere."""

from __future__ import annotations

import random

import pytest

from ladle.reasoning.parser import (
    THINK_PARSERS, ReasoningStream, ThinkTags, prompt_opens_reasoning, split_reasoning, tags_for,
)

CASES = [  # (reply, whether the prompt opened the block, (reasoning_content, content))
    # the prompt opened the block
    ("abc</think>\n\nAnswer here", True, ("abc", "Answer here")),
    ("<think>abc</think>x", True, ("abc", "x")),  # a repeated start tag is dropped
    ("\n <think>\nabc \n</think>x", True, ("\nabc \n", "x")),  # with the whitespace before it
    ("ab<think>c</think>x", True, ("ab<think>c", "x")),  # not at the top: kept
    ("thinking, never done", True, ("thinking, never done", None)),  # unclosed: all reasoning
    ("\n", True, ("\n", None)),
    ("", True, ("", None)),
    ("</think>", True, ("", None)),
    ("  </think>\n\n", True, ("  ", None)),
    ("<thi", True, ("<thi", None)),
    ("a<b</think>c</think>d<think>e", True, ("a<b", "c</think>d<think>e")),  # one block only
    ("1 < 2 </thin> </think>  3 > 2", True, ("1 < 2 </thin> ", "3 > 2")),
    # the reply opens the block itself, or opens none
    ("<think>\nhmm</think> ok", False, ("\nhmm", "ok")),
    ("  \n<think>a</think>", False, ("a", None)),
    ("<think></think>", False, ("", None)),
    ("<think>", False, ("", None)),
    (" <think>", False, ("", None)),
    ("<think>unclosed </th", False, ("unclosed </th", None)),
    ("<think><think>x</think>y", False, ("<think>x", "y")),
    ("plain <think>text</think>", False, (None, "plain <think>text</think>")),  # a later tag is content
    ("</think>stray", False, (None, "</think>stray")),
    ("  \nAnswer  ", False, (None, "  \nAnswer  ")),  # no block: content as written
    ("<thi", False, (None, "<thi")),
    (" <thinking>", False, (None, " <thinking>")),
    ("  ", False, (None, "  ")),
    ("", False, (None, None)),
]


def stream_all(parts: list[str], in_reasoning: bool) -> tuple[str, str, bool]:
    """The parts fed one by one, then finished: the reasoning and content released, and reasoning_started."""
    stream, reasoning, content = ReasoningStream(in_reasoning), "", ""
    for part in parts:
        r, c = stream.feed(part)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c, stream.reasoning_started


def random_splits(text: str, rng: random.Random, n: int = 200) -> list[list[str]]:
    splits = []
    for _ in range(n):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text) + 1, 8))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return splits


@pytest.mark.parametrize("text,in_reasoning,want", CASES)
def test_whole_replies(text: str, in_reasoning: bool, want: tuple) -> None:
    assert split_reasoning(text, in_reasoning) == want


@pytest.mark.parametrize("text,in_reasoning,want", CASES)
def test_a_stream_one_character_at_a_time_gives_the_whole_replys_parts(text: str, in_reasoning: bool,
                                                                       want: tuple) -> None:
    reasoning, content, started = stream_all(list(text), in_reasoning)
    assert (reasoning, content) == (want[0] or "", want[1] or "")
    assert started == (want[0] is not None)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("in_reasoning", [True, False])
def test_streams_cut_at_random_agree_with_the_whole_reply(seed: int, in_reasoning: bool) -> None:
    rng = random.Random(seed)
    texts = [text for text, _, _ in CASES]
    pieces = ["<think>", "</think>", "<", "</", "<th", "</thi", " ", "\n", "a", "b c", ">", "think"]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(20)]
    for text in texts:
        reasoning, content = split_reasoning(text, in_reasoning)
        for parts in random_splits(text, rng):
            assert stream_all(parts, in_reasoning) == (reasoning or "", content or "", reasoning is not None), parts


def test_a_stream_holds_back_only_what_may_become_a_tag() -> None:
    stream = ReasoningStream(in_reasoning=True)
    assert stream.feed("abc</th") == ("abc", "")
    assert stream.feed("ink>xyz") == ("", "xyz")
    stream = ReasoningStream(in_reasoning=True)
    assert stream.feed("go a<") == ("go a", "")
    assert stream.feed("b") == ("<b", "")
    assert stream.feed("1 < 2") == ("1 < 2", "")  # "<" followed by a space is no tag
    assert stream.finish() == ("", "")


def test_whitespace_after_the_end_tag_is_dropped_across_deltas() -> None:
    stream = ReasoningStream(in_reasoning=True)
    assert stream.feed("r</think>\n") == ("r", "")
    assert stream.feed(" \n") == ("", "")
    assert stream.feed("\nAnswer") == ("", "Answer")
    assert stream.feed(" \n more") == ("", " \n more")  # only the leading whitespace


def test_an_undecided_reply_is_held_until_it_opens_a_block_or_not() -> None:
    stream = ReasoningStream(in_reasoning=False)
    assert stream.feed("\n<thi") == ("", "")  # may yet open a block
    assert stream.feed("s is no tag") == ("", "\n<this is no tag")
    assert not stream.reasoning_started
    stream = ReasoningStream(in_reasoning=False)
    assert stream.feed(" <thi") == ("", "")
    assert stream.feed("nk>hm") == ("hm", "")
    assert stream.reasoning_started


def test_finishing_an_undecided_reply() -> None:
    stream = ReasoningStream(in_reasoning=False)
    assert stream.feed("\n<th") == ("", "")
    assert stream.finish() == ("", "\n<th")  # never became a tag: content
    assert not stream.reasoning_started
    stream = ReasoningStream(in_reasoning=True)
    assert stream.feed(" <th") == ("", "")
    assert stream.finish() == (" <th", "")  # the open block's reasoning
    stream = ReasoningStream(in_reasoning=False)
    assert stream.feed("\n<think>") == ("", "")
    assert stream.finish() == ("", "")  # an empty block, but a block
    assert stream.reasoning_started


def test_the_prompts_open_block_counts_as_started() -> None:
    assert ReasoningStream(in_reasoning=True).reasoning_started
    assert not ReasoningStream(in_reasoning=False).reasoning_started


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜><think>\n")  # DeepSeek-R1's generation prompt
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert prompt_opens_reasoning("<think>a</think> then <think>\n")
    assert not prompt_opens_reasoning("<think>a</think>")


def test_custom_tags() -> None:
    tags = ThinkTags("[T]", "[/T]")
    assert split_reasoning(" [T]a[/T] b", False, tags) == ("a", "b")
    assert prompt_opens_reasoning("x[T]", tags)
    stream = ReasoningStream(in_reasoning=True, tags=tags)
    assert stream.feed("a[/") == ("a", "")
    assert stream.feed("T]b") == ("", "b")


def test_parser_names() -> None:
    assert {tags_for(name) for name in THINK_PARSERS} == {ThinkTags()}  # gpt-oss's: test_harmony_parser.py
    with pytest.raises(ValueError, match="deepseek_r1, qwen3, think"):
        tags_for("granite")
