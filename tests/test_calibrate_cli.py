"""`ladle calibrate fit` end to end: the labelled tickets through a live server's /v1/decisions,
a temperature fitted on one part and judged on situations it never saw."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from server_utils import EXAMPLES, Server, labelled_set_args

from ladle.calibrate import methods
from ladle.calibrate.cli import split
from ladle.calibrate.client import read_labelled
from ladle.cli import main


def test_temperature_fit_halves_held_out_ece(labelled_server: Server, labelled_examples: Path, tmp_path: Path) -> None:
    server, out, reports = labelled_server, tmp_path / "team.json", tmp_path / "report"
    code = main(["calibrate", "fit", *labelled_set_args(server, examples=labelled_examples), "--method", "temperature",
                 "--out", str(out), "--report-dir", str(reports), "--concurrency", "8"])
    assert code == 0
    report = json.loads((reports / "report.json").read_text())
    before, after = report["before"], report["after"]
    assert (report["n_fit"], report["n_heldout"]) == (112, 48)
    assert after["ece"] <= before["ece"] / 2 and after["nll"] < before["nll"]
    assert after["accuracy"] == before["accuracy"]  # a temperature never changes the argmax
    assert sum(map(sum, after["confusion"]["rows_true_columns_chosen"])) == 48
    assert 0 < report["label_mass"]["suggested_floor"] <= report["label_mass"]["median"] <= 1
    assert (reports / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(out.read_text())
    assert saved["labels"] == ["billing", "technical", "sales", "account"] and saved["question_id"] == "team"
    assert saved["model"] == server.model and saved["prompt_format_version"] == 1
    calibrator = methods.load(saved)
    assert isinstance(calibrator, methods.TemperatureScaling) and calibrator.temperature > 1  # the model is overconfident


def test_split_is_seeded_and_disjoint() -> None:
    question = json.loads((EXAMPLES / "tickets.question.json").read_text())
    data = read_labelled(EXAMPLES / "tickets.fit.jsonl", question)
    fit, held = split(data, seed=3)
    again, _ = split(data, seed=3)
    assert len(held.inputs) == 56 and len(fit.inputs) == 168 and fit.inputs == again.inputs
    assert not set(fit.inputs) & set(held.inputs)
    assert np.array_equal(np.sort(np.concatenate([fit.labels, held.labels])), np.sort(data.labels))


def test_a_label_outside_the_options_is_refused_with_its_line(tmp_path: Path) -> None:
    question = json.loads((EXAMPLES / "tickets.question.json").read_text())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "label": "billing"}\n{"input": "b", "label": "legal"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: label 'legal'"):
        read_labelled(bad, question)
