"""The performance gate (benchmarks/gate.py) fails when ladle slows down: a sleep planted in every engine
step (LADLE_PLANTED_STEP_SLEEP_MS, read by the engine for this test alone) must take the in-process ratio
under its floor. It times things, so it runs alone: `pytest -m gate` (.ci/run, after the suite)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GATE = Path(__file__).parents[1] / "benchmarks" / "gate.py"


@pytest.mark.gate
def test_the_gate_fails_on_a_planted_slowdown(tmp_path: Path) -> None:
    env = {**os.environ, "LADLE_PLANTED_STEP_SLEEP_MS": "200"}
    done = subprocess.run([sys.executable, str(GATE), "--cases", "inprocess"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "gate inprocess: ratio" in done.stdout and "BELOW THE FLOOR" in done.stdout
    assert "gate FAILED: inprocess" in done.stderr
