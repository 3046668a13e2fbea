"""`ladle heads fit` end to end: the labelled tickets through a live server, a head fitted on
the model's hidden states, then served with --decision-head and asked about situations the
fit never saw."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from server_utils import MODEL, Server, app_server, labelled_set_args

from ladle.calibrate.client import read_labelled
from ladle.cli import main
from ladle.decisions.extensions import Extensions

CONCURRENCY = 8


async def decide_all(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """POST each body to /v1/decisions, CONCURRENCY at a time; the answers in order."""
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        async with limit:
            r = await client.post("/v1/decisions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*(one(client, body) for body in bodies))


@pytest.mark.slow  # fits a head end to end over a labelled set
def test_fitted_head_served_beats_the_zero_shot_decision(labelled_server: Server, labelled_quarter: Path,
                                                         tmp_path: Path) -> None:
    server, head, reports = labelled_server, tmp_path / "team.safetensors", tmp_path / "report"
    code = main(["heads", "fit", *labelled_set_args(server, examples=labelled_quarter), "--out", str(head),
                 "--report-dir", str(reports), "--concurrency", str(CONCURRENCY)])
    assert code == 0
    report = json.loads((reports / "report.json").read_text())
    sidecar = json.loads(head.with_suffix(".json").read_text())
    assert sidecar["model"] == MODEL and sidecar["labels"] == ["billing", "technical", "sales", "account"]
    assert sidecar["pooling"] == "mean" and sidecar["pool_from"] > 0 and report["n_heldout"] == 24
    assert report["after"]["accuracy"] >= report["before"]["accuracy"] + 0.3
    assert report["after"]["ece"] < report["before"]["ece"]

    question = json.loads((labelled_quarter / "tickets.question.json").read_text())
    held = read_labelled(labelled_quarter / "tickets.heldout.jsonl", question)
    extensions = Extensions.load(MODEL, [], [f"team={head}"])
    with app_server(server.engine, decision_extensions=extensions) as served:
        replies = asyncio.run(decide_all(served.url, [{"input": text, "questions": [{**question, "head": "team"}]}
                                                      for text in held.inputs]))
    answers = [reply["answers"][question["id"]] for reply in replies]
    assert all(answer["answered_by"] == "head" for answer in answers)
    chosen = [held.options.index(answer["choice"]) for answer in answers]
    # served from the decisions' own prefills (batched: scoring is batch-invariant), the head agrees
    # with the one fit judged, example for example
    accuracy = float(np.mean(np.array(chosen) == held.labels))
    assert accuracy == pytest.approx(report["after"]["accuracy"], abs=1e-12)
