"""Typed decisions over HTTP: /v1/decisions (both dialects), /v1/score and /v1/systemone.

A private server: decisions fill the prefix cache with the chat template's head, and tests of
the session server count on finding it cold.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_utils import MODEL, Server, own_server

from ladle.config import EngineConfig
from ladle.decisions import scoring

TICKET = "The integration keeps failing."
TEAM = {"id": "team", "type": "choice", "question": "Which team should handle this ticket?",
        "options": [{"name": "billing"}, {"name": "technical", "description": "bugs and outages"}, {"name": "sales"}]}
SEVERITY = {"id": "severity", "type": "score", "question": "How severe is the problem?",
            "levels": ["cosmetic", "degraded", "blocking"]}
URGENT = {"id": "urgent", "type": "yes_no", "question": "The customer needs an answer today.",
          "yes": "they say it is urgent"}
_inputs = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with own_server(EngineConfig(num_kv_blocks=1024)) as s:
        yield s


def fresh_input() -> str:
    """An input no earlier request used, so its prefix starts cold."""
    return f"Ticket {next(_inputs)}-{id(_inputs)}: {TICKET}"


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/{path}", json=body, timeout=120)


def decide(server: Server, **body) -> dict:
    r = post(server, "decisions", {"input": TICKET, "questions": [TEAM], **body})
    assert r.status_code == 200, r.text
    return r.json()


def assert_distribution(probs: dict[str, float], keys: list[str]) -> None:
    assert list(probs) == keys
    assert all(0.0 <= p <= 1.0 for p in probs.values())
    assert math.fsum(probs.values()) == pytest.approx(1.0, abs=1e-12)


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- the reference dialect ---------------------------------------------------------------


def test_ticket_example(server: Server) -> None:
    body = decide(server, model=MODEL)
    assert body["object"] == "decisions" and body["model"] == MODEL and body["prompt_format_version"] == 1
    team = body["answers"]["team"]
    assert team["type"] == "choice"
    assert_distribution(team["probabilities"], ["billing", "technical", "sales"])
    assert 0.0 < team["label_mass"] <= 1.0
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    assert team["score"] is None and "prompt_token_ids" not in team
    usage = body["usage"]
    assert usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"] > 0


def test_score_and_yes_no(server: Server) -> None:
    body = decide(server, input=fresh_input(), questions=[SEVERITY, URGENT])
    sev, urgent = body["answers"]["severity"], body["answers"]["urgent"]
    assert_distribution(sev["probabilities"], ["0", "1", "2"])
    assert sev["score"] == pytest.approx(sum(i * p for i, p in enumerate(sev["probabilities"].values())))
    assert 0.0 <= sev["score"] <= 2.0 and sev["choice"] is None and 0.0 < sev["label_mass"] <= 1.0
    assert_distribution(urgent["probabilities"], ["yes", "no"])
    assert urgent["choice"] is None and urgent["score"] is None and 0.0 < urgent["label_mass"] <= 1.0
    assert body["usage"]["completion_tokens"] == 0


def test_questions_share_their_prefix_through_the_cache(server: Server) -> None:
    questions = [TEAM, SEVERITY, URGENT, {**TEAM, "id": "team2", "question": "Who owns this?"}]
    body = decide(server, input=fresh_input() + " " + "It fails every night. " * 12, questions=questions,
                  return_prompt_token_ids=True)
    ids = [a["prompt_token_ids"] for a in body["answers"].values()]
    shared = min(shared_prefix(ids[0], x) for x in ids[1:]) // 16 * 16
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(map(len, ids))
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 3 * shared > 0  # computed once, reused three times


def test_json_input_and_temperature(server: Server) -> None:
    base = decide(server, input={"ticket": TICKET, "tags": ["sync", 3]}, return_prompt_token_ids=True)
    team = base["answers"]["team"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": team["prompt_token_ids"]}).json()["prompt"]
    assert '{"ticket":"The integration keeps failing.","tags":["sync",3]}\n\nQuestion:' in text
    assert team["label_token_ids"] == [49, 50, 51]
    hot = decide(server, input={"ticket": TICKET, "tags": ["sync", 3]}, temperature=5.0)["answers"]["team"]
    assert hot["label_mass"] == pytest.approx(team["label_mass"], abs=1e-6)
    assert max(hot["probabilities"].values()) < max(team["probabilities"].values())


def _refusal(server: Server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err


def _with(**changes) -> dict:
    body = {"input": TICKET, "questions": [copy.deepcopy(TEAM), copy.deepcopy(SEVERITY), copy.deepcopy(URGENT)]}
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = body
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        if value is _DROP:
            del node[int(last) if last.isdigit() else last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return body


_DROP = object()
LETTERS = [{"name": f"option {i}"} for i in range(27)]

REFUSALS = [  # (body, param, words the message must hold)
    (_with(color="blue"), "color", "Extra inputs"),
    (_with(questions__0__colour="red"), "questions[0].colour", "Extra inputs"),
    (_with(questions__0__options__0__label="x"), "questions[0].options[0].label", "Extra inputs"),
    (_with(questions__0__instruction="x"), "questions[0].instruction", "Extra inputs"),
    (_with(input="   "), "input", "blank"),
    (_with(input=42), "input", ""),
    (_with(input=_DROP), "input", "required"),
    (_with(questions=[]), "questions", ""),
    (_with(questions__1__id="team"), "questions[1].id", "'team' is used twice"),
    (_with(questions__1__id=" "), "questions[1].id", "blank"),
    (_with(questions__0__question=""), "questions[0].question", "'team'"),
    (_with(questions__0__type="ranking"), "questions[0].type", ""),
    (_with(questions__0__options=[{"name": "a"}]), "questions[0].options", "'team' (questions[0].options): must have"),
    (_with(questions__0__options=LETTERS), "questions[0].options", "must have 2 to 26"),
    (_with(questions__0__options=[{"name": "Sales "}, {"name": "sales"}]), "questions[0].options[1]", "'team'"),
    (_with(questions__0__options=[{"name": "a\nb"}, {"name": "c"}]), "questions[0].options[0]", "line breaks"),
    (_with(questions__0__options=[{"name": " "}, {"name": "c"}]), "questions[0].options[0]", "blank"),
    (_with(questions__1__levels=["only"]), "questions[1].levels", "'severity' (questions[1].levels): must"),
    (_with(questions__1__levels=[str(i) for i in range(11)]), "questions[1].levels", "2 to 10"),
    (_with(questions__1__levels=["low", ""]), "questions[1].levels[1]", "'severity'"),
    (_with(temperature=0), "temperature", ""),
    (_with(temperature=-1.0), "temperature", ""),
    (_with(prompt_format_version=2), "prompt_format_version", "version 1"),
    (_with(chat_template_kwargs={"enable_thinking": True}), "chat_template_kwargs.enable_thinking", "reasoning"),
    (_with(return_prompt_token_ids="maybe"), "return_prompt_token_ids", ""),
]


@pytest.mark.parametrize("body, param, words", REFUSALS, ids=[r[1] + ":" + r[2][:20] for r in REFUSALS])
def test_refusals_name_the_field(server: Server, body: dict, param: str, words: str) -> None:
    err = _refusal(server, "decisions", body)
    assert err["param"] == param and words in err["message"]


def test_non_finite_temperature_is_refused(server: Server) -> None:
    body = json.dumps({"input": TICKET, "questions": [TEAM], "temperature": math.inf})  # "Infinity"
    r = httpx.post(f"{server.base_url}/decisions", headers={"content-type": "application/json"}, content=body)
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_too_many_questions_and_unknown_model(server: Server) -> None:
    many = [{**URGENT, "id": f"q{i}"} for i in range(401)]
    assert _refusal(server, "decisions", {"input": TICKET, "questions": many})["param"] == "questions"
    r = post(server, "decisions", {"input": TICKET, "questions": [TEAM], "model": "gpt-luna"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"


def test_prompt_too_long_is_refused_not_truncated(server: Server) -> None:
    err = _refusal(server, "decisions", {"input": "word " * 9000, "questions": [TEAM]})
    assert err["code"] == "context_length_exceeded" and err["param"] == "questions[0]" and "'team'" in err["message"]


def test_non_finite_score_is_500_never_nan(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    async def nan_scores(engine, jobs, priority=0):
        return [scoring.ScoreResult([float("nan")] * len(j.label_ids), len(j.prompt_ids), 0) for j in jobs]

    monkeypatch.setattr(scoring, "score", nan_scores)
    r = post(server, "decisions", {"input": TICKET, "questions": [TEAM]})
    assert r.status_code == 500 and "NaN" not in r.text
    assert r.json()["error"]["code"] == "non_finite_score"


# -- replay through /v1/score ---------------------------------------------------------------


def test_score_replays_a_decision(server: Server) -> None:
    body = decide(server, input=fresh_input(), questions=[TEAM, SEVERITY, URGENT], temperature=0.7,
                  return_prompt_token_ids=True)
    for answer in body["answers"].values():
        r = post(server, "score", {"query": answer["prompt_token_ids"], "label_token_ids": answer["label_token_ids"],
                                   "apply_softmax": True, "temperature": 0.7})
        assert r.status_code == 200, r.text
        [replayed] = r.json()["scores"]
        assert replayed == list(answer["probabilities"].values())  # bit for bit, as the README promises


def test_cold_and_warm_prefix_are_bit_identical(server: Server) -> None:
    request = {"input": fresh_input() + " The sync job times out. " * 8, "questions": [TEAM, SEVERITY, URGENT]}
    cold, warm = decide(server, **request), decide(server, **request)
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in (cold, warm)]
    assert cached[1] > cached[0]
    for key, answer in cold["answers"].items():
        assert warm["answers"][key]["probabilities"] == answer["probabilities"]


def test_score_endpoint(server: Server) -> None:
    tok = server.engine.tokenizer
    yes, no = tok.encode("yes"), tok.encode("no")
    r = post(server, "score", {"query": "Is the sky blue? Answer:", "items": [" yes", " no"],
                               "label_token_ids": yes + no, "return_token_logprobs": True, "model": MODEL})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and len(body["scores"]) == 2
    for scores, lps in zip(body["scores"], body["token_logprobs"]):
        assert scores == pytest.approx([math.exp(x) for x in lps]) and sum(scores) <= 1.0
    assert body["usage"]["completion_tokens"] == 0
    query = tok.encode("Colour:")
    per_item = post(server, "score", {"query": query, "items": [tok.encode(" red"), tok.encode(" blue")],
                                      "label_token_ids": [[33, 34], [35, 36, 37]], "apply_softmax": True})
    assert [len(s) for s in per_item.json()["scores"]] == [2, 3]
    assert all(sum(s) == pytest.approx(1.0) for s in per_item.json()["scores"])
    first = post(server, "score", {"query": query, "items": [tok.encode(" red")], "item_first": True,
                                   "label_token_ids": [33]}).json()
    assert first["usage"]["prompt_tokens"] == len(query) + 1


@pytest.mark.parametrize("body, param", [
    ({"query": "a", "items": [[1, 2]], "label_token_ids": [1]}, "items"),
    ({"query": [1, 2], "items": ["x"], "label_token_ids": [1]}, "items"),
    ({"query": [1, 2], "label_token_ids": []}, "label_token_ids"),
    ({"query": [1, 2], "label_token_ids": [10**7]}, "label_token_ids"),
    ({"query": [1, 2], "items": [[3]], "label_token_ids": [[1], [2]]}, "label_token_ids"),
    ({"query": [1, 10**7], "label_token_ids": [1]}, "query"),
    ({"query": [], "label_token_ids": [1]}, "query"),
    ({"query": [1] * 9000, "label_token_ids": [1]}, "query"),
    ({"query": [1], "label_token_ids": [1], "temperature": 0}, "temperature"),
    ({"query": [1], "label_token_ids": [1], "softmax": True}, "softmax"),
])
def test_score_refusals(server: Server, body: dict, param: str) -> None:
    assert _refusal(server, "score", body)["param"] == param


# -- the OpenAI dialect -----------------------------------------------------------------------


def test_openai_sdk_decisions_create(client: openai.OpenAI) -> None:
    d = client.decisions.create(
        model=MODEL, input=TICKET, prompt_cache_key="tickets", safety_identifier="user-1",
        questions=[
            {"type": "predicate", "instructions": "The customer is angry.", "name": "angry"},
            {"type": "choice", "instructions": "Which team should handle this ticket?",
             "choices": [{"value": "billing"}, {"value": "technical", "description": "bugs and outages"},
                         {"value": True}, {"value": "true"}]},
            {"type": "score", "instructions": "How severe is the problem?",
             "levels": [{"label": "cosmetic"}, {"label": "degraded"}, {"label": "blocking", "description": "no way"}]},
        ])
    assert isinstance(d, openai.types.Decision) and d.model == MODEL
    predicate, choice, score = d.answers
    assert predicate.type == "predicate" and predicate.name == "angry"
    reference = client.post("/decisions", cast_to=object, body={
        "input": TICKET, "questions": [{"id": "angry", "type": "yes_no", "question": "The customer is angry."}]})
    # the same question in the reference dialect: the same prompt, so the same bits
    assert predicate.probability == reference["answers"]["angry"]["probabilities"]["yes"]
    assert choice.type == "choice" and choice.name is None
    values = [p.value for p in choice.probabilities]
    assert values == ["billing", "technical", True, "true"] and isinstance(values[2], bool)
    best = max(choice.probabilities, key=lambda p: p.probability)
    assert choice.choice == best.value and 0.0 < choice.confidence <= 1.0
    assert math.fsum(p.probability for p in choice.probabilities) == pytest.approx(1.0)
    assert score.type == "score" and [p.value for p in score.probabilities] == [0, 1, 2]
    assert [p.label for p in score.probabilities] == ["cosmetic", "degraded", "blocking"]
    assert score.score == pytest.approx(sum(p.value * p.probability for p in score.probabilities))
    u = d.usage
    assert u.output_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    assert u.total_tokens == u.input_tokens > u.input_tokens_details.cached_tokens >= 0


def test_openai_message_input_reads_as_the_string(client: openai.OpenAI) -> None:
    q = [{"type": "predicate", "instructions": "The customer is angry."}]
    as_text = client.decisions.create(model=MODEL, input=TICKET, questions=q)
    as_parts = client.decisions.create(model=MODEL, questions=q, input=[
        {"role": "user", "type": "message", "content": [{"type": "input_text", "text": TICKET}]}])
    assert as_parts.answers[0].probability == as_text.answers[0].probability
    chat = client.decisions.create(model=MODEL, questions=q, input=[
        {"role": "developer", "content": "Support inbox."},
        {"role": "user", "content": [{"type": "input_json", "data": {"ticket": TICKET}}]}])
    # a transcript of the messages, JSON parts as compact JSON, asked as the reference dialect's yes_no
    transcript = f'developer: Support inbox.\n\nuser: {{"ticket":"{TICKET}"}}'
    reference = client.post("/decisions", cast_to=object, body={
        "input": transcript, "questions": [{"id": "angry", "type": "yes_no", "question": "The customer is angry."}]})
    assert chat.answers[0].probability == reference["answers"]["angry"]["probabilities"]["yes"]
    assert 0.0 < chat.answers[0].probability < 1.0


def test_openai_choice_past_26_gets_two_letter_labels(client: openai.OpenAI) -> None:
    values = [f"queue {i}" for i in range(30)]
    d = client.decisions.create(model=MODEL, input=TICKET, questions=[
        {"type": "choice", "instructions": "Which queue gets this ticket?", "choices": [{"value": v} for v in values]}])
    [answer] = d.answers
    assert [p.value for p in answer.probabilities] == values and answer.choice in values
    assert math.fsum(p.probability for p in answer.probabilities) == pytest.approx(1.0)


OPENAI_PREDICATE = {"type": "predicate", "instructions": "The customer is angry."}


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "1", "name": "f", "arguments": "{}"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"questions": [{**OPENAI_PREDICATE, "instructions": " "}]}, "questions[0].instructions"),
    ({"questions": [{**OPENAI_PREDICATE, "temperature": 2}]}, "questions[0].temperature"),
    ({"questions": [{"type": "choice", "instructions": "x", "choices": [{"value": "a"}]}]}, "questions[0].choices"),
    ({"questions": [{"type": "choice", "instructions": "x", "choices": [{"value": "a"}, {"value": "a"}]}]},
     "questions[0].choices[1].value"),
    ({"questions": [{"type": "choice", "instructions": "x", "choices": [{"value": str(i)} for i in range(256)]}]},
     "questions[0].choices"),
    ({"questions": [{"type": "score", "instructions": "x", "levels": [{"label": str(i)} for i in range(11)]}]},
     "questions[0].levels"),
    ({"questions": [OPENAI_PREDICATE] * 401}, "questions"),
    ({"temperature": 0.5}, "temperature"),
])
def test_openai_dialect_refusals(server: Server, body: dict, param: str) -> None:
    full = {"model": MODEL, "input": TICKET, "questions": [OPENAI_PREDICATE], **body}
    assert _refusal(server, "decisions", full)["param"] == param


# -- /v1/systemone ---------------------------------------------------------------------------


def test_systemone_three_types(server: Server) -> None:
    r = post(server, "systemone", {
        "model": MODEL, "state": {"message": TICKET, "channel": "email"}, "x_trace": "ignored",
        "questions": {
            "urgent": {"type": "noul", "instructions": "Does this convey urgency?",
                       "criteria": {"true": "Explicitly time-sensitive", "false": "No time pressure"}},
            "team": {"type": "choice", "instructions": "Which team should handle this?",
                     "criteria": {"billing": "Payments and refunds", "technical": None, "sales": None}},
            "severity": {"type": "score", "instructions": {"question": "How severe is it?", "scale": "3 steps"},
                         "criteria": ["cosmetic", "degraded", "blocking"]}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MODEL and list(body["answers"]) == ["urgent", "team", "severity"]
    urgent, team, severity = body["answers"].values()
    assert urgent["type"] == "noul" and 0.0 <= urgent["noul"] <= 1.0 and "confidence" not in urgent
    assert team["type"] == "choice" and team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    assert_distribution(team["probabilities"], ["billing", "technical", "sales"])
    q = max(team["probabilities"].values())
    assert team["confidence"] == pytest.approx(min(1.0, max(0.0, (3 * q - 1) / 2)))
    assert severity["legend"] == {"0": "cosmetic", "1": "degraded", "2": "blocking"}
    assert_distribution(severity["probabilities"], ["0", "1", "2"])
    assert 0.0 <= severity["confidence"] <= 1.0 and 0.0 <= severity["score"] <= 2.0
    for a in (urgent, team, severity):
        assert 0.0 < a["x_label_mass"] <= 1.0
    assert body["usage"]["output_tokens"] == 0 and body["usage"]["input_tokens"] > 0


def test_systemone_forty_options(server: Server) -> None:
    names = [f"queue-{i:02d}" for i in range(40)]
    r = post(server, "systemone", {"model": MODEL, "state": TICKET, "questions": {"queue": {
        "type": "choice", "instructions": "Which queue gets this ticket?", "criteria": dict.fromkeys(names)}}})
    assert r.status_code == 200, r.text
    answer = r.json()["answers"]["queue"]
    assert_distribution(answer["probabilities"], names)
    assert answer["choice"] in names and 0.0 < answer["x_label_mass"] <= 1.0


@pytest.mark.parametrize("change, param", [
    ({"temperature": 0.5}, "temperature"),
    ({"prompt_format_version": 1}, "prompt_format_version"),
    ({"return_prompt_token_ids": True}, "return_prompt_token_ids"),
    ({"state": " "}, "state"),
    ({"questions": {}}, "questions"),
    ({"questions": {"u": {"type": "noul", "instructions": "", "criteria": {"true": " "}}}}, "questions.u"),
    ({"questions": {"c": {"type": "choice", "instructions": "x", "criteria": {}}}}, "questions.c.criteria"),
    ({"questions": {"c": {"type": "choice", "instructions": "x",
                          "criteria": {f"o{i}": None for i in range(256)}}}}, "questions.c.criteria"),
    ({"questions": {"s": {"type": "score", "instructions": "x", "criteria": [str(i) for i in range(11)]}}},
     "questions.s.criteria"),
    ({"questions": {"s": {"type": "score", "instructions": " ", "criteria": ["a"]}}}, "questions.s.instructions"),
])
def test_systemone_refusals(server: Server, change: dict, param: str) -> None:
    body = {"model": MODEL, "state": TICKET, "questions": {"u": {"type": "noul", "instructions": "Urgent?"}}, **change}
    assert _refusal(server, "systemone", body)["param"] == param
