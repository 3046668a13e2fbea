"""ladle's decision extensions served (decisions.md, "ladle's extensions"): a question naming a
calibration gets calibrated and raw probabilities; one naming a head is answered by it from the
same prefill; mismatched or unknown ones are refused with a 400 naming the field, in every dialect."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_utils import MODEL, Server, ServerThread, own_server

from ladle.calibrate.methods import TemperatureScaling, VectorScaling
from ladle.config import EngineConfig
from ladle.decisions.extensions import Extensions
from ladle.heads.head import DecisionHead
from ladle.server.app import create_app

TEAMS = ["billing", "sales", "technical"]
QUESTION = {"id": "team", "type": "choice", "question": "Which team should handle this ticket?",
            "options": [{"name": n} for n in TEAMS]}
TICKET = "I was charged twice for my subscription this month and need a refund for the duplicate."
LAYER = -8  # counted from the end
POOL_FROM = 8  # mean pooling from this token on


def calibration_file(path: Path, calibrator, model: str = MODEL, labels: list[str] = TEAMS,
                     prompt_format_version: int = 1) -> str:
    path.write_text(json.dumps({"ladle_calibration": 1, **calibrator.to_json(), "model": model, "question_id": "team",
                                "labels": labels, "prompt_format_version": prompt_format_version}))
    return str(path)


def head_file(path: Path, hidden: int, model: str = MODEL) -> str:
    rng = np.random.default_rng(0)
    head = DecisionHead(rng.normal(size=(3, hidden)) * 0.05, np.array([0.1, -0.2, 0.3]), rng.normal(size=hidden),
                        rng.uniform(0.5, 2.0, size=hidden), LAYER, TEAMS, model, "team", 1, "mean", POOL_FROM)
    head.save(path)
    return str(path)


@pytest.fixture(scope="module")
def plain_server() -> Iterator[Server]:
    """A private engine: its prefix cache fills with these decisions' template heads, which
    must not warm the shared server that other modules expect cold."""
    with own_server(EngineConfig(num_kv_blocks=512)) as s:
        yield s


@pytest.fixture(scope="module")
def ext_server(plain_server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same engine behind a second app that loaded calibrations and heads."""
    server = plain_server
    d = tmp_path_factory.mktemp("extensions")
    hidden = len(httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"}).json()["data"][0]["embedding"])
    calibrations = [
        f"hot={calibration_file(d / 'hot.json', TemperatureScaling(2.5))}",
        f"sales_bias={calibration_file(d / 'bias.json', VectorScaling([1.0] * 3, [0.0, 8.0, 0.0]))}",
        f"other_model={calibration_file(d / 'other.json', TemperatureScaling(2.0), model='another-model')}",
        f"yes_no={calibration_file(d / 'yn.json', TemperatureScaling(2.0), labels=['yes', 'no'])}",
        f"format_2={calibration_file(d / 'v2.json', TemperatureScaling(2.0), prompt_format_version=2)}",
    ]
    heads = [f"router={head_file(d / 'router.safetensors', hidden)}",
             f"stale={head_file(d / 'stale.safetensors', hidden, model='another-model')}"]
    thread = ServerThread(create_app(server.engine, MODEL,
                                     decision_extensions=Extensions.load(MODEL, calibrations, heads))).start()
    try:
        yield Server(thread.url, server.engine)
    finally:
        thread.stop()


def decide(url: str, **question_fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/decisions", timeout=60, json={
        "input": TICKET, "return_prompt_token_ids": True, "questions": [{**QUESTION, **question_fields}]})


def plain(url: str) -> dict:
    return decide(url).json()["answers"]["team"]


def test_calibrated_answer_carries_calibrated_and_raw_probabilities(ext_server: Server) -> None:
    raw = plain(ext_server.url)
    assert "raw_probabilities" not in raw and "answered_by" not in raw  # plain answers are unchanged
    answer = decide(ext_server.url, calibration="hot").json()["answers"]["team"]
    assert answer["answered_by"] == "labels"
    assert answer["raw_probabilities"] == raw["probabilities"]
    want = TemperatureScaling(2.5).apply(np.array([[raw["probabilities"][n] for n in TEAMS]]))[0]
    assert [answer["probabilities"][n] for n in TEAMS] == pytest.approx(want, abs=1e-12)
    assert sum(answer["probabilities"].values()) == pytest.approx(1.0, abs=1e-12)
    assert answer["label_mass"] == raw["label_mass"]


def test_choice_follows_the_calibrated_probabilities(ext_server: Server) -> None:
    raw = plain(ext_server.url)
    answer = decide(ext_server.url, calibration="sales_bias").json()["answers"]["team"]
    assert answer["choice"] == "sales" and max(answer["probabilities"], key=answer["probabilities"].get) == "sales"
    assert raw["choice"] != "sales" or raw["probabilities"]["sales"] < answer["probabilities"]["sales"]


def test_head_answers_from_the_hidden_state_of_the_same_prompt(ext_server: Server, tmp_path: Path) -> None:
    raw = plain(ext_server.url)
    answer = decide(ext_server.url, head="router").json()["answers"]["team"]
    assert answer["answered_by"] == "head"
    assert answer["raw_probabilities"] == raw["probabilities"] and answer["label_mass"] == raw["label_mass"]
    # the head's own arithmetic on the state /v1/embeddings reads from the decision's exact tokens
    state = httpx.post(f"{ext_server.url}/v1/embeddings", json={
        "input": [raw["prompt_token_ids"]], "layer": LAYER, "pooling": "mean", "pooling_start": POOL_FROM,
        "normalize": False}).json()["data"][0]["embedding"]
    head = DecisionHead.load(Path(ext_server_head_path(tmp_path, len(state))))
    want = head.probabilities(np.array(state))
    assert [answer["probabilities"][n] for n in TEAMS] == pytest.approx(want, abs=1e-9)
    assert answer["choice"] == TEAMS[int(np.argmax(want))]


def ext_server_head_path(tmp_path: Path, hidden: int) -> str:
    """The same head the server loaded (seeded), written again."""
    return head_file(tmp_path / "router.safetensors", hidden)


def test_head_and_calibration_in_the_other_dialects(ext_server: Server) -> None:
    openai_body = {"model": MODEL, "input": TICKET, "questions": [
        {"type": "choice", "instructions": QUESTION["question"], "choices": [{"value": n} for n in TEAMS],
         "x_head": "router"},
        {"type": "choice", "instructions": QUESTION["question"], "choices": [{"value": n} for n in TEAMS]}]}
    head_answer, plain_answer = httpx.post(f"{ext_server.url}/v1/decisions", json=openai_body,
                                           timeout=60).json()["answers"]
    assert head_answer["x_answered_by"] == "head" and "x_answered_by" not in plain_answer
    assert head_answer["x_raw_probabilities"] == [p["probability"] for p in plain_answer["probabilities"]]
    s1 = httpx.post(f"{ext_server.url}/v1/systemone", timeout=60, json={"state": TICKET, "questions": {
        "team": {"type": "choice", "instructions": QUESTION["question"], "criteria": {n: None for n in TEAMS},
                 "x_calibration": "hot"}}}).json()["answers"]["team"]
    assert s1["x_answered_by"] == "labels"
    want = TemperatureScaling(2.5).apply(np.array([s1["x_raw_probabilities"]]))[0]
    assert [s1["probabilities"][n] for n in TEAMS] == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("fields, param, words", [
    ({"calibration": "nope"}, "questions[0].calibration", "no calibration named 'nope'"),
    ({"head": "nope"}, "questions[0].head", "no head named 'nope'"),
    ({"calibration": "other_model"}, "questions[0].calibration", "another-model"),
    ({"head": "stale"}, "questions[0].head", "another-model"),
    ({"calibration": "yes_no"}, "questions[0].calibration", "options"),
    ({"calibration": "format_2"}, "questions[0].calibration", "prompt format version 2"),
    ({"calibration": "hot", "head": "router"}, "questions[0].head", "not both"),
])
def test_refusals_name_the_field(ext_server: Server, fields: dict, param: str, words: str) -> None:
    r = decide(ext_server.url, **fields)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_refusals_in_the_other_dialects_and_with_a_temperature(ext_server: Server) -> None:
    r = httpx.post(f"{ext_server.url}/v1/decisions", json={"model": MODEL, "input": TICKET, "questions": [
        {"type": "predicate", "instructions": "Is this about money?", "x_calibration": "hot"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "questions[0].x_calibration"
    r = httpx.post(f"{ext_server.url}/v1/decisions", json={"input": TICKET, "temperature": 2.0,
                                                          "questions": [{**QUESTION, "calibration": "hot"}]})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_a_server_without_extensions_refuses_the_fields(plain_server: Server) -> None:
    r = decide(plain_server.url, head="router")
    assert r.status_code == 400 and r.json()["error"]["param"] == "questions[0].head"
