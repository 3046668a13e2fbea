"""Bodies of the reference dialect of /v1/decisions and of /v1/score, and strict parsing for all dialects."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from ladle.server.errors import validation_error
from ladle.server.protocol import Usage

M = TypeVar("M", bound=BaseModel)

# Values of `type` that pick a union member: pydantic puts them in error locations, we do not.
_UNION_TAGS = {"choice", "score", "yes_no", "predicate", "noul", "input_text", "input_image", "input_json",
               "output_text", "refusal"}


def parse(model: type[M], raw: bytes | str | dict[str, Any], prefix: tuple = ()) -> M:
    """Validate, turning the first problem into a 400 naming the field (never a 422)."""
    try:
        return model.model_validate(raw) if isinstance(raw, dict) else model.model_validate_json(raw)
    except ValidationError as e:
        errors = [{**err, "loc": prefix + _loc(err)} for err in e.errors()]
        raise validation_error(errors) from None


def _loc(err: dict[str, Any]) -> tuple:
    loc = tuple(err.get("loc", ()))
    loc = tuple(x for i, x in enumerate(loc) if not (i and isinstance(loc[i - 1], int) and x in _UNION_TAGS))
    if err.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        loc += ("type",)  # the discriminator is what is wrong (or missing)
    return loc


class Strict(BaseModel):
    """Unknown fields are refused (a misspelt field must not silently change nothing)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# -- /v1/decisions, reference dialect ----------------------------------------------


class ChoiceOption(Strict):
    name: str
    description: str | None = None


class RefQuestionBase(Strict):
    id: str
    question: str
    calibration: str | None = None  # ladle's extensions (decisions.md)
    head: str | None = None


class ChoiceQuestion(RefQuestionBase):
    type: Literal["choice"]
    options: list[ChoiceOption]


class ScoreQuestion(RefQuestionBase):
    type: Literal["score"]
    levels: list[str]


class YesNoQuestion(RefQuestionBase):
    type: Literal["yes_no"]
    yes: str | None = None
    no: str | None = None


RefQuestion = Annotated[ChoiceQuestion | ScoreQuestion | YesNoQuestion, Field(discriminator="type")]


class DecisionsRequest(Strict):
    input: str | dict[str, Any] | list[Any]
    questions: list[RefQuestion] = Field(min_length=1)
    temperature: float = Field(1.0, gt=0)
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_format_version: int | None = None
    return_prompt_token_ids: bool = False
    model: str | None = None


class DecisionAnswer(BaseModel):
    type: str
    probabilities: dict[str, float]
    label_mass: float
    choice: str | None = None
    score: float | None = None
    prompt_token_ids: list[int] | None = None  # only with return_prompt_token_ids
    label_token_ids: list[int] | None = None
    raw_probabilities: dict[str, float] | None = None  # only where a calibration or head answered
    answered_by: Literal["labels", "head"] | None = None

    @model_serializer(mode="wrap")
    def _drop_optional_fields(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if self.prompt_token_ids is None:
            data.pop("prompt_token_ids", None)
            data.pop("label_token_ids", None)
        if self.answered_by is None:
            data.pop("raw_probabilities", None)
            data.pop("answered_by", None)
        return data


class DecisionsResponse(BaseModel):
    object: Literal["decisions"] = "decisions"
    model: str
    prompt_format_version: int
    answers: dict[str, DecisionAnswer]
    usage: Usage


# -- /v1/score ---------------------------------------------------------------------


class ScoreRequest(Strict):
    query: str | list[int]
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | list[list[int]]
    apply_softmax: bool = False
    temperature: float = Field(1.0, gt=0)
    item_first: bool = False
    return_token_logprobs: bool = False
    model: str | None = None


class ScoreResponse(BaseModel):
    object: Literal["scoring"] = "scoring"
    model: str
    scores: list[list[float]]
    token_logprobs: list[list[float]] | None = None
    usage: Usage
