"""POST /v1/systemone: the request shape of TypeSafe's System One API (OpenAPI 0.2.0).

Unknown fields are ignored (its SDKs may send newer ones), except the /v1/decisions-only
fields, which are refused by name so nobody believes they took effect.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ladle.decisions.answers import choice_confidence, score_confidence
from ladle.decisions.extensions import Extensions
from ladle.decisions.pipeline import Decided, decide
from ladle.decisions.question import (
    MAX_LEVELS, MAX_OPTIONS, MAX_QUESTIONS, Option, Question, check_count, check_option_names, is_blank,
)
from ladle.decisions.render import render_json_or_text
from ladle.engine.async_engine import AsyncEngine
from ladle.errors import InvalidRequestError

DECISIONS_ONLY = ("temperature", "prompt_format_version", "return_prompt_token_ids")

Entry = str | dict[str, Any] | list[Any]  # text, or JSON rendered compactly


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Extensible(_Lenient):
    x_calibration: str | None = None  # ladle's extensions (decisions.md)
    x_head: str | None = None


class NoulCriteria(_Lenient):
    true: str | None = None
    false: str | None = None


class NoulQuestion(_Extensible):
    type: Literal["noul"]
    instructions: Entry | None = None
    criteria: NoulCriteria | None = None


class ChoiceQuestion(_Extensible):
    type: Literal["choice"]
    instructions: Entry
    criteria: dict[str, str | None]


class ScoreQuestion(_Extensible):
    type: Literal["score"]
    instructions: Entry
    criteria: list[str]


class SystemOneRequest(_Lenient):
    state: Entry
    model: str | None = None
    questions: dict[str, Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]]


class SystemOneUsage(BaseModel):
    input_tokens: int
    output_tokens: int = 0
    x_cached_tokens: int = 0


class SystemOneResponse(BaseModel):
    model: str
    answers: dict[str, dict[str, Any]]
    usage: SystemOneUsage


def refuse_decisions_fields(data: Any) -> None:
    if isinstance(data, dict):
        for name in DECISIONS_ONLY:
            if name in data:
                raise InvalidRequestError(f"{name} is a /v1/decisions field; /v1/systemone does not take it",
                                          param=name)


def to_questions(req: SystemOneRequest) -> list[Question]:
    if not 1 <= len(req.questions) <= MAX_QUESTIONS:
        raise InvalidRequestError(f"questions must have 1 to {MAX_QUESTIONS} entries (got {len(req.questions)})",
                                  param="questions")
    out = []
    for key, sq in req.questions.items():
        where = f"questions.{key}"
        if is_blank(key):
            raise InvalidRequestError("question ids must not be blank", param="questions")
        instructions = _instructions(sq.instructions, f"{where}.instructions")
        q = Question(key, where, {"noul": "yes_no", "choice": "choice", "score": "score"}[sq.type], instructions, [],
                     sq.x_calibration, sq.x_head, "x_")
        if isinstance(sq, NoulQuestion):
            crit = sq.criteria or NoulCriteria()
            if is_blank(instructions) and is_blank(crit.true) and is_blank(crit.false):
                raise q.refuse("a noul needs instructions or a criteria.true or criteria.false description")
            q.options = [Option("yes", crit.true), Option("no", crit.false)]
        else:
            if is_blank(instructions):
                raise q.refuse("instructions must not be blank", "instructions")
            if isinstance(sq, ChoiceQuestion):
                check_count(q, "criteria", len(sq.criteria), 1, MAX_OPTIONS)
                q.options = [Option(name, desc) for name, desc in sq.criteria.items()]
                check_option_names(q, "criteria")
            else:
                check_count(q, "criteria", len(sq.criteria), 1, MAX_LEVELS)
                for j, level in enumerate(sq.criteria):
                    if is_blank(level):
                        raise q.refuse("level texts must not be blank", f"criteria[{j}]")
                q.options = [Option(level) for level in sq.criteria]
        out.append(q)
    return out


def _instructions(value: Entry | None, where: str) -> str:
    """Text or compact JSON; "" when absent or blank (the question types decide whether that is allowed)."""
    if value is None or (isinstance(value, str) and is_blank(value)):
        return ""
    return render_json_or_text(value, where)


async def handle(engine: AsyncEngine, model_name: str, req: SystemOneRequest,
                 extensions: Extensions | None = None) -> SystemOneResponse:
    state = render_json_or_text(req.state, "state")
    result = await decide(engine, state, to_questions(req), extensions=extensions)
    answers = {d.question.key: _answer(d) for d in result.answers}
    usage = SystemOneUsage(input_tokens=result.prompt_tokens, x_cached_tokens=result.cached_tokens)
    return SystemOneResponse(model=model_name, answers=answers, usage=usage)


def _answer(d: Decided) -> dict[str, Any]:
    answer = _typed_answer(d)
    if d.answered_by is not None:
        answer.update(x_raw_probabilities=d.raw_probabilities, x_answered_by=d.answered_by)
    return answer


def _typed_answer(d: Decided) -> dict[str, Any]:
    q, s = d.question, d.scores
    if q.kind == "yes_no":
        return {"type": "noul", "noul": s.probabilities[0], "x_label_mass": s.label_mass}
    if q.kind == "choice":
        names = [o.name for o in q.options]
        return {"type": "choice", "choice": names[s.best], "confidence": choice_confidence(s.probabilities),
                "probabilities": dict(zip(names, s.probabilities)), "x_label_mass": s.label_mass}
    keys = [str(i) for i in range(len(q.options))]
    return {"type": "score", "score": s.mean_index, "confidence": score_confidence(s.probabilities),
            "legend": {k: o.name for k, o in zip(keys, q.options)},
            "probabilities": dict(zip(keys, s.probabilities)), "x_label_mass": s.label_mass}
