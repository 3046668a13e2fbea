"""The labelled decision sets under examples/decisions: what calibration and learned heads are fitted
and judged on, so their shape is checked here (regenerated from their script, balanced, held-out
situations never seen when fitting)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

DATA = Path(__file__).parents[1] / "examples" / "decisions"
SETS = ("tickets", "reviews")


def rows(name: str, part: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{name}.{part}.jsonl").read_text().splitlines()]


def test_the_files_are_what_the_script_writes(tmp_path: Path) -> None:
    shutil.copy(DATA / "make_data.py", tmp_path)
    subprocess.run([sys.executable, str(tmp_path / "make_data.py")], check=True, capture_output=True)
    for path in DATA.glob("*.json*"):
        assert (tmp_path / path.name).read_text() == path.read_text(), path.name


@pytest.mark.parametrize("name", SETS)
def test_labels_are_the_questions_options_and_balanced(name: str) -> None:
    question = json.loads((DATA / f"{name}.question.json").read_text())
    options = [o["name"] for o in question["options"]] if question["type"] == "choice" else ["yes", "no"]
    for part in ("fit", "heldout"):
        counts = Counter(r["label"] for r in rows(name, part))
        assert set(counts) == set(options) and len(set(counts.values())) == 1, (part, counts)
    assert len(rows(name, "fit")) + len(rows(name, "heldout")) >= 200


@pytest.mark.parametrize("name", SETS)
def test_held_out_situations_never_appear_in_the_fitted_part(name: str) -> None:
    def situation(text: str) -> str:
        """The sentence the class comes from: a ticket's first after its greeting, a review's second."""
        sentences = re.split(r"(?<=[.?]) ", text)
        return (sentences[0].split(", ", 1)[1] if name == "tickets" else sentences[1]).lower()

    fit = {situation(r["input"]) for r in rows(name, "fit")}
    held_out = {situation(r["input"]) for r in rows(name, "heldout")}
    assert held_out and not fit & held_out
    assert len({r["input"] for r in rows(name, "fit") + rows(name, "heldout")}) == len(rows(name, "fit")) + len(
        rows(name, "heldout"))  # no example twice
