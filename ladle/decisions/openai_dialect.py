"""OpenAI's dialect of POST /v1/decisions, as the `openai` SDK's `client.decisions.create` sends it.

Questions carry `instructions` (which the reference dialect refuses); answers come back as a
list in question order. Rendering and scoring are the reference dialect's.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictStr, model_serializer

from ladle.decisions.extensions import Extensions
from ladle.decisions.pipeline import Decided, Decisions, decide
from ladle.decisions.protocol import Strict, parse
from ladle.decisions.question import (
    MAX_LEVELS, MAX_OPTIONS, MAX_QUESTIONS, Option, Question, check_count, has_control_chars, is_blank,
)
from ladle.decisions.render import render_json_or_text
from ladle.engine.async_engine import AsyncEngine
from ladle.errors import InvalidRequestError

if TYPE_CHECKING:
    from PIL.Image import Image

LoadImages = Callable[[list[tuple[str, str]]], Awaitable[tuple["Image", ...]]]

# -- request -------------------------------------------------------------------------


class TextPart(Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None


class ImagePart(Strict):
    type: Literal["input_image"]
    image_url: str
    detail: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class JSONPart(Strict):
    type: Literal["input_json"]
    data: dict[str, Any] | list[Any]


class OutputTextPart(Strict):
    type: Literal["output_text"]
    text: str


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[TextPart | ImagePart | JSONPart | OutputTextPart | RefusalPart, Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "developer", "system", "assistant"]
    content: str | list[Part]
    type: Literal["message"] | None = None
    phase: str | None = None


class ChoiceItem(Strict):
    value: StrictStr | StrictBool  # a string and a boolean with the same text are different values
    description: str | None = None


class Level(Strict):
    label: str
    description: str | None = None


class _Question(Strict):
    instructions: str | list[Part]
    name: str | None = None
    x_calibration: str | None = None  # ladle's extensions (decisions.md)
    x_head: str | None = None


class PredicateQuestion(_Question):
    type: Literal["predicate"]


class ChoiceQuestion(_Question):
    type: Literal["choice"]
    choices: list[ChoiceItem]


class ScoreQuestion(_Question):
    type: Literal["score"]
    levels: list[Level]


class OpenAIDecisionRequest(Strict):
    model: str
    input: str | list[dict[str, Any]]
    questions: list[Annotated[PredicateQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]]
    prompt_cache_key: str | None = None  # caller metadata: accepted, changes no answer
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None


# -- response ------------------------------------------------------------------------


class ChoiceProbability(BaseModel):
    value: StrictStr | StrictBool
    probability: float


class LevelProbability(BaseModel):
    value: int
    label: str
    probability: float


class _Answer(BaseModel):
    """ladle's extension fields, present only where a calibration or head answered."""

    x_raw_probabilities: list[float] | None = None  # the label softmax, in the question's order
    x_answered_by: Literal["labels", "head"] | None = None

    @model_serializer(mode="wrap")
    def _drop_extension_fields(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if self.x_answered_by is None:
            data.pop("x_raw_probabilities", None)
            data.pop("x_answered_by", None)
        return data


class PredicateAnswer(_Answer):
    type: Literal["predicate"] = "predicate"
    name: str | None
    probability: float


class ChoiceAnswer(_Answer):
    type: Literal["choice"] = "choice"
    name: str | None
    choice: StrictStr | StrictBool
    confidence: float
    probabilities: list[ChoiceProbability]


class ScoreAnswer(_Answer):
    type: Literal["score"] = "score"
    name: str | None
    score: float
    confidence: float
    probabilities: list[LevelProbability]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class DecisionUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class OpenAIDecision(BaseModel):
    model: str
    answers: list[PredicateAnswer | ChoiceAnswer | ScoreAnswer]  # ladle never declines one question alone
    usage: DecisionUsage


# -- request -> questions -> answers ---------------------------------------------------


def _parts_text(parts: str | list, where: str, images: InputImages | None = None) -> str:
    """The parts' text; an image part, where images are taken, becomes the model's marker and its
    (part name, URL) joins images.found."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, ImagePart) and images is not None and images.marker is not None:
            if part.detail not in (None, "auto"):
                raise InvalidRequestError(f"{where}[{j}].detail {part.detail!r} is not supported (only 'auto')",
                                          param=f"{where}[{j}].detail")
            images.found.append((f"{where}[{j}].image_url", part.image_url))
            texts.append(images.marker)
            continue
        if isinstance(part, ImagePart):
            why = "this server serves a text model" if images is not None else "images go in input"
            raise InvalidRequestError(f"{where}[{j}]: images are not supported here ({why})",
                                      param=f"{where}[{j}]", code="unsupported_content")
        if isinstance(part, JSONPart):
            texts.append(json.dumps(part.data, ensure_ascii=False, separators=(",", ":")))
        else:
            texts.append(part.refusal if isinstance(part, RefusalPart) else part.text)
    return "\n".join(texts)


@dataclass
class InputImages:
    """The input's image parts: marked in its text with the model's marker (None: a text model, which
    refuses them), collected as (part name, URL) in order."""

    marker: str | None
    found: list[tuple[str, str]] = field(default_factory=list)


def input_text(value: str | list[dict[str, Any]], images: InputImages | None = None) -> str:
    """A string as is; one user message as its text; several messages as a `role: text` transcript.
    images: where image parts are taken (marked, and collected into it)."""
    if isinstance(value, str):
        return render_json_or_text(value, "input")
    if not value:
        raise InvalidRequestError("input must not be empty", param="input")
    messages = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind != "message":
            raise InvalidRequestError(f"input[{i}]: items of type {kind!r} are not supported (only messages)",
                                      param=f"input[{i}].type", code="unsupported_content")
        m = parse(Message, item, ("input", i))
        messages.append((m.role, _parts_text(m.content, f"input[{i}].content", images)))
    if len(messages) == 1 and messages[0][0] == "user":
        return render_json_or_text(messages[0][1], "input[0].content")
    return render_json_or_text("\n\n".join(f"{role}: {text}" for role, text in messages), "input")


def to_questions(req: OpenAIDecisionRequest) -> list[Question]:
    if not 1 <= len(req.questions) <= MAX_QUESTIONS:
        raise InvalidRequestError(f"questions must have 1 to {MAX_QUESTIONS} items (got {len(req.questions)})",
                                  param="questions")
    return [_question(rq, f"questions[{i}]") for i, rq in enumerate(req.questions)]


def _question(rq: PredicateQuestion | ChoiceQuestion | ScoreQuestion, where: str) -> Question:
    text = _parts_text(rq.instructions, f"{where}.instructions")
    kind = {"predicate": "yes_no", "choice": "choice", "score": "score"}[rq.type]
    q = Question(rq.name if rq.name is not None else where, where, kind, text, [], rq.x_calibration, rq.x_head, "x_")
    if is_blank(text):
        raise q.refuse("instructions must not be blank", "instructions")
    if isinstance(rq, PredicateQuestion):
        q.options = [Option("yes"), Option("no")]
    elif isinstance(rq, ChoiceQuestion):
        check_count(q, "choices", len(rq.choices), 2, MAX_OPTIONS)
        seen: set[tuple[type, Any]] = set()
        for j, c in enumerate(rq.choices):
            name = c.value if isinstance(c.value, str) else str(c.value).lower()
            if is_blank(name) or has_control_chars(name):
                raise q.refuse("choice values must be non-blank text on one line", f"choices[{j}].value")
            if (type(c.value), c.value) in seen:
                raise q.refuse(f"the choice value {c.value!r} is given twice", f"choices[{j}].value")
            seen.add((type(c.value), c.value))
            q.options.append(Option(name, c.description))
    else:
        check_count(q, "levels", len(rq.levels), 2, MAX_LEVELS)
        for j, level in enumerate(rq.levels):
            if is_blank(level.label):
                raise q.refuse("level labels must not be blank", f"levels[{j}].label")
        q.options = [Option(level.label, level.description) for level in rq.levels]
    return q


async def handle(engine: AsyncEngine, model_name: str, req: OpenAIDecisionRequest,
                 extensions: Extensions | None = None, load_images: LoadImages | None = None) -> OpenAIDecision:
    """load_images: fetches and decodes the input's image parts ((part name, URL) in order); None: none taken."""
    vision = engine.engine.images
    images = InputImages(vision.marker if vision is not None and load_images is not None else None)
    text = input_text(req.input, images)
    questions = to_questions(req)
    loaded = await load_images(images.found) if images.found else ()
    result = await decide(engine, text, questions, extensions=extensions, images=loaded)
    return response(model_name, req, result)


def response(model_name: str, req: OpenAIDecisionRequest, result: Decisions) -> OpenAIDecision:
    answers = [_answer(rq, d) for rq, d in zip(req.questions, result.answers)]
    usage = DecisionUsage(input_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens,
                          input_tokens_details=InputTokensDetails(cached_tokens=result.cached_tokens,
                                                                  cache_write_tokens=result.cache_write_tokens))
    return OpenAIDecision(model=model_name, answers=answers, usage=usage)


def _answer(rq: PredicateQuestion | ChoiceQuestion | ScoreQuestion, d: Decided) -> _Answer:
    answer = _typed_answer(rq, d)
    answer.x_raw_probabilities, answer.x_answered_by = d.raw_probabilities, d.answered_by
    return answer


def _typed_answer(rq: PredicateQuestion | ChoiceQuestion | ScoreQuestion, d: Decided) -> _Answer:
    s, best = d.scores, d.scores.best
    # confidence: the winner's probability over the whole vocabulary (uncalibrated, as the reference servers)
    if isinstance(rq, PredicateQuestion):
        return PredicateAnswer(name=rq.name, probability=s.probabilities[0])
    if isinstance(rq, ChoiceQuestion):
        probs = [ChoiceProbability(value=c.value, probability=p) for c, p in zip(rq.choices, s.probabilities)]
        return ChoiceAnswer(name=rq.name, choice=rq.choices[best].value, confidence=s.raw_probability(best),
                            probabilities=probs)
    probs = [LevelProbability(value=i, label=level.label, probability=p)
             for i, (level, p) in enumerate(zip(rq.levels, s.probabilities))]
    return ScoreAnswer(name=rq.name, score=s.mean_index, confidence=s.raw_probability(best), probabilities=probs)
