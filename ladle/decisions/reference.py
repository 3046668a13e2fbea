"""The reference dialect of POST /v1/decisions (SGLang's): questions with ids, answers keyed by id."""

from __future__ import annotations

from ladle.decisions.extensions import Extensions
from ladle.decisions.pipeline import Decided, Decisions, decide
from ladle.decisions.protocol import (
    ChoiceQuestion, DecisionAnswer, DecisionsRequest, DecisionsResponse, ScoreQuestion, YesNoQuestion,
)
from ladle.decisions.question import (
    MAX_LETTER_OPTIONS, MAX_LEVELS, MAX_QUESTIONS, Option, Question, check_count, check_option_names, is_blank,
)
from ladle.decisions.render import PROMPT_FORMAT_VERSION, render_json_or_text
from ladle.engine.async_engine import AsyncEngine
from ladle.errors import InvalidRequestError
from ladle.server.protocol import Usage


def to_questions(req: DecisionsRequest) -> list[Question]:
    """The request's questions, checked; raises InvalidRequestError naming the question id."""
    if len(req.questions) > MAX_QUESTIONS:
        raise InvalidRequestError(f"questions: at most {MAX_QUESTIONS} per request (got {len(req.questions)})",
                                  param="questions")
    seen: set[str] = set()
    out = []
    for i, rq in enumerate(req.questions):
        where = f"questions[{i}]"
        if is_blank(rq.id):
            raise InvalidRequestError(f"{where}.id must not be blank", param=f"{where}.id")
        if rq.id in seen:
            raise InvalidRequestError(f"question id {rq.id!r} is used twice", param=f"{where}.id")
        seen.add(rq.id)
        q = _question(rq, where)
        if is_blank(q.text):
            raise q.refuse("question must not be blank", "question")
        out.append(q)
    return out


def _question(rq: ChoiceQuestion | ScoreQuestion | YesNoQuestion, where: str) -> Question:
    q = _typed_question(rq, where)
    q.calibration, q.head = rq.calibration, rq.head
    return q


def _typed_question(rq: ChoiceQuestion | ScoreQuestion | YesNoQuestion, where: str) -> Question:
    if isinstance(rq, ChoiceQuestion):
        q = Question(rq.id, where, "choice", rq.question, [Option(o.name, o.description) for o in rq.options])
        check_count(q, "options", len(q.options), 2, MAX_LETTER_OPTIONS)
        check_option_names(q, "options")
        return q
    if isinstance(rq, ScoreQuestion):
        q = Question(rq.id, where, "score", rq.question, [Option(level) for level in rq.levels])
        check_count(q, "levels", len(q.options), 2, MAX_LEVELS)
        for j, level in enumerate(rq.levels):
            if is_blank(level):
                raise q.refuse("level texts must not be blank", f"levels[{j}]")
        return q
    return Question(rq.id, where, "yes_no", rq.question, [Option("yes", rq.yes), Option("no", rq.no)])


async def handle(engine: AsyncEngine, model_name: str, req: DecisionsRequest,
                 extensions: Extensions | None = None) -> DecisionsResponse:
    if req.prompt_format_version is not None and req.prompt_format_version != PROMPT_FORMAT_VERSION:
        raise InvalidRequestError(f"prompt_format_version {req.prompt_format_version} is not served here: this "
                                  f"server renders prompt format version {PROMPT_FORMAT_VERSION}",
                                  param="prompt_format_version", code="prompt_format_version_mismatch")
    input_text = render_json_or_text(req.input, "input")
    questions = to_questions(req)
    result = await decide(engine, input_text, questions, req.temperature, req.chat_template_kwargs, extensions)
    return response(model_name, result, req.return_prompt_token_ids)


def response(model_name: str, result: Decisions, with_token_ids: bool) -> DecisionsResponse:
    answers = {d.question.key: _answer(d, with_token_ids) for d in result.answers}
    return DecisionsResponse(model=model_name, prompt_format_version=PROMPT_FORMAT_VERSION, answers=answers,
                             usage=Usage.of(result.prompt_tokens, 0, result.cached_tokens))


def _answer(d: Decided, with_token_ids: bool) -> DecisionAnswer:
    q, s = d.question, d.scores
    if q.kind == "choice":
        keys = [o.name for o in q.options]
    elif q.kind == "score":
        keys = [str(i) for i in range(len(q.options))]
    else:
        keys = ["yes", "no"]
    return DecisionAnswer(
        type=q.kind, probabilities=dict(zip(keys, s.probabilities)), label_mass=s.label_mass,
        choice=keys[s.best] if q.kind == "choice" else None,
        score=s.mean_index if q.kind == "score" else None,
        prompt_token_ids=d.prepared.prompt_ids if with_token_ids else None,
        label_token_ids=d.prepared.label_ids if with_token_ids else None,
        raw_probabilities=dict(zip(keys, d.raw_probabilities)) if d.raw_probabilities is not None else None,
        answered_by=d.answered_by,
    )
