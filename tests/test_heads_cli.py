"""`ladle heads fit` end to end: the labelled tickets through a live server, a head fitted on
the model's hidden states, then served with --decision-head and asked about situations the
fit never saw."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_utils import EXAMPLES, MODEL, Server, ServerThread, labelled_set_args, own_server

from ladle.calibrate.client import read_labelled
from ladle.cli import main
from ladle.config import EngineConfig
from ladle.decisions.extensions import Extensions
from ladle.server.app import create_app



@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with own_server(EngineConfig(num_kv_blocks=2048)) as s:
        yield s


@pytest.mark.slow  # fits a head end to end over a labelled set
def test_fitted_head_served_beats_the_zero_shot_decision(server: Server, tmp_path: Path) -> None:
    head, reports = tmp_path / "team.safetensors", tmp_path / "report"
    code = main(["heads", "fit", *labelled_set_args(server), "--out", str(head), "--report-dir", str(reports), "--concurrency", "8"])
    assert code == 0
    report = json.loads((reports / "report.json").read_text())
    sidecar = json.loads(head.with_suffix(".json").read_text())
    assert sidecar["model"] == MODEL and sidecar["labels"] == ["billing", "technical", "sales", "account"]
    assert sidecar["pooling"] == "mean" and sidecar["pool_from"] > 0 and report["n_heldout"] == 96
    assert report["after"]["accuracy"] >= report["before"]["accuracy"] + 0.3
    assert report["after"]["ece"] < report["before"]["ece"]

    question = json.loads((EXAMPLES / "tickets.question.json").read_text())
    held = read_labelled(EXAMPLES / "tickets.heldout.jsonl", question)
    extensions = Extensions.load(MODEL, [], [f"team={head}"])
    thread = ServerThread(create_app(server.engine, MODEL, decision_extensions=extensions)).start()
    try:
        chosen = []
        for text in held.inputs:
            r = httpx.post(f"{thread.url}/v1/decisions", timeout=60,
                           json={"input": text, "questions": [{**question, "head": "team"}]})
            answer = r.json()["answers"][question["id"]]
            assert answer["answered_by"] == "head"
            chosen.append(held.options.index(answer["choice"]))
    finally:
        thread.stop()
    # served from the decision's own prefill, the head agrees with the one fit judged, example for example
    accuracy = float(np.mean(np.array(chosen) == held.labels))
    assert accuracy == pytest.approx(report["after"]["accuracy"], abs=1e-12)
