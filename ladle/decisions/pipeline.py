"""Questions in, label scores out: render, check labels, score, count usage. Shared by every dialect."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ladle.decisions import scoring
from ladle.decisions.answers import LabelScores
from ladle.decisions.extensions import Calibration, Extensions
from ladle.decisions.labels import TWO_LETTERS, LabelChecker, base_labels
from ladle.decisions.question import Question
from ladle.decisions.render import question_message, render_prompt, template_kwargs
from ladle.engine.async_engine import AsyncEngine
from ladle.engine.image_prompts import ImagePrompts
from ladle.engine.multimodal import ImageSpan
from ladle.errors import InvalidRequestError
from ladle.heads.head import DecisionHead
from ladle.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass
class Prepared:
    question: Question
    labels: list[str]
    prompt_ids: list[int]
    label_ids: list[int]
    images: tuple[ImageSpan, ...] = ()  # its images' placeholder spans, where the input has images


@dataclass
class Decided:
    prepared: Prepared
    scores: LabelScores  # probabilities: what the answer reports (calibrated, or the head's)
    raw_probabilities: list[float] | None = None  # the label softmax, where a calibration or head replaced it
    answered_by: str | None = None  # "labels" or "head", where the question named an extension

    @property
    def question(self) -> Question:
        return self.prepared.question


@dataclass
class Decisions:
    answers: list[Decided]  # in question order
    prompt_tokens: int
    cached_tokens: int
    cache_write_tokens: int  # prompt tokens computed into full prefix-cache blocks


def prepare(tokenizer: Tokenizer, max_model_len: int, input_text: str, questions: list[Question],
            kwargs: dict[str, Any], images: ImagePrompts | None = None,
            sent: tuple[Image, ...] = ()) -> list[Prepared]:
    """Render and tokenize every question; raises InvalidRequestError naming the question at fault.
    images: a vision model's prompts, and sent: the images input_text marks (only on the engine thread,
    which owns the encoder cache)."""
    checker = LabelChecker(tokenizer)
    marker = images.marker if images is not None else None
    out = []
    for q in questions:
        labels = base_labels(q)
        if labels is None:  # more than 26 options: pick two-letter labels at this template's answer position
            probe = render_prompt(tokenizer, question_message(input_text, q, TWO_LETTERS[: len(q.options)]), kwargs,
                                  q, marker)
            labels = checker.two_letter_labels(q, probe, tokenizer.encode(probe))
        prompt = render_prompt(tokenizer, question_message(input_text, q, labels), kwargs, q, marker)
        ids, spans = images.prompt(prompt, list(sent)) if sent else (tokenizer.encode(prompt), ())
        if len(ids) >= max_model_len:
            raise q.refuse(f"the prompt is {len(ids)} tokens, and this model's context holds {max_model_len} "
                           "(prompt and answer token); decisions never truncate: shorten the input",
                           code="context_length_exceeded")
        out.append(Prepared(q, labels, ids, checker.check(q, prompt, ids, labels), spans))
    return out


async def decide(engine: AsyncEngine, input_text: str, questions: list[Question], temperature: float = 1.0,
                 chat_template_kwargs: dict[str, Any] | None = None,
                 extensions: Extensions | None = None, images: tuple[Image, ...] = ()) -> Decisions:
    """images: those input_text marks (a vision model's marker at each), encoded once for every question."""
    fitted = [_extension(q, extensions, temperature) for q in questions]
    kwargs = template_kwargs(chat_template_kwargs)
    vision = engine.engine.images
    if images:  # expanded and encoded where the encoder cache lives: on the engine thread
        prepared = await engine.call(lambda e: prepare(e.tokenizer, e.max_model_len, input_text, questions, kwargs,
                                                       vision, images))
    else:  # rendering and tokenizing hundreds of prompts would stall the event loop: do it off it
        prepared = await asyncio.to_thread(prepare, engine.tokenizer, engine.max_model_len, input_text, questions,
                                           kwargs, vision)
    layers = [_head_layer(engine, q, f) for q, f in zip(questions, fitted)]
    jobs = [_job(p, f, layer) for p, f, layer in zip(prepared, fitted, layers)]
    results = await scoring.score(engine, jobs)
    answers = [_decided(p, r, f, layer, temperature) for p, r, f, layer in zip(prepared, results, fitted, layers)]
    return Decisions(answers, *usage(engine, [(r.num_prompt_tokens, r.num_cached_tokens) for r in results]))


def _head_layer(engine: AsyncEngine, question: Question, fitted: Calibration | DecisionHead | None) -> int | None:
    if not isinstance(fitted, DecisionHead):
        return None
    try:
        return engine.hidden_state_index(fitted.layer)
    except ValueError as e:  # a head fitted on a deeper model
        raise question.refuse(f"head: {e}", question.field_name("head")) from None


def _job(p: Prepared, fitted: Calibration | DecisionHead | None, layer: int | None) -> scoring.ScoreJob:
    if not isinstance(fitted, DecisionHead):
        return scoring.ScoreJob(p.prompt_ids, p.label_ids, images=p.images)
    if fitted.pooling == "mean" and fitted.pool_from >= len(p.prompt_ids):
        raise p.question.refuse(f"head pools from token {fitted.pool_from}, past this prompt's end",
                                p.question.field_name("head"))
    return scoring.ScoreJob(p.prompt_ids, p.label_ids, [layer], fitted.pooling, fitted.pool_from, p.images)


def _extension(q: Question, extensions: Extensions | None, temperature: float) -> Calibration | DecisionHead | None:
    if extensions is not None:
        return extensions.resolve(q, temperature)
    if q.calibration is not None or q.head is not None:
        field = q.field_name("calibration" if q.calibration is not None else "head")
        raise InvalidRequestError(f"{field}: this endpoint serves no calibrations or heads", param=field)
    return None


def _decided(p: Prepared, r: scoring.ScoreResult, fitted: Calibration | DecisionHead | None, layer: int | None,
             temperature: float) -> Decided:
    scores = LabelScores.of(r.label_logprobs, temperature)
    if fitted is None:
        return Decided(p, scores)
    raw = scores.probabilities
    if isinstance(fitted, DecisionHead):
        probs = [float(x) for x in fitted.probabilities(r.hidden_states[layer])]
    else:
        probs = fitted.apply(raw)
    answered_by = "head" if isinstance(fitted, DecisionHead) else "labels"
    return Decided(p, LabelScores(scores.logprobs, probs, scores.label_mass), raw, answered_by)


def usage(engine: AsyncEngine, counts: list[tuple[int, int]]) -> tuple[int, int, int]:
    """(prompt tokens, cached tokens, cache write tokens) over (prompt tokens, cached tokens) pairs."""
    config = engine.engine.config
    bs = config.block_size
    written = sum(max(0, n // bs * bs - c) for n, c in counts) if config.enable_prefix_caching else 0
    return sum(n for n, _ in counts), sum(c for _, c in counts), written
