"""`ladle calibrate check` end to end: the tickets replayed cold, warm, alone, batched and mixed with
chat traffic against one live server (bit-identical, as ladle promises), and shuffled in option order."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_utils import Server, labelled_set_args

from ladle.calibrate.check import CONDITIONS, compare, order_summary
from ladle.calibrate.client import Scored
from ladle.cli import main


def test_replay_is_bit_identical_and_order_moves_answers(labelled_server: Server, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    server = labelled_server
    server.wait_idle()
    # the server is shared with the other labelled-set tests: the reference pass must be computed cold
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    code = main(["calibrate", "check", *labelled_set_args(server, heldout=False), "--limit", "24", "--order-sample", "8",
                 "--repeats", "2", "--report-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["n_examples"] == 24 and report["model"] == server.model and report["failures"] == []
    assert set(report["replay"]) == set(CONDITIONS) == {"warm", "alone", "batched", "mixed"}
    for name, c in report["replay"].items():
        assert c["passes"] == 2 and len(c["per_pass"]) == 2, name
        assert (c["choice_flips"], c["max_abs_dp"], c["max_abs_dlabel_mass"]) == (0, 0.0, 0.0), (name, c)
    assert report["replay"]["alone"]["concurrency"] == 1 and report["replay"]["batched"]["concurrency"] == 24
    assert all(n > 0 for n in report["replay"]["mixed"]["chat_chunks_while_scoring"])  # decode really overlapped
    order = report["order"]
    assert order["n_examples"] == 8 and len(order["permutations"]) == 4
    assert len(order["position_prior"]) == 4 and sum(order["position_prior"]) == pytest.approx(1.0)
    assert 0.0 <= order["choice_change_fraction"] <= 1.0 and 0.0 <= order["tv_mean"] <= order["tv_max"] <= 1.0
    assert "replay OK" in printed
    server.wait_idle(10)  # the background chat streams were ended with the mixed passes


def test_compare_counts_a_flip_and_the_largest_deltas() -> None:
    reference = Scored(np.array([[0.6, 0.4], [0.2, 0.8], [0.5, 0.5]]), np.array([0.9, 0.8, np.nan]), "m", 1)
    other = Scored(np.array([[0.4, 0.6], [0.2, 0.8], [0.5, 0.5]]), np.array([0.9, 0.75, np.nan]), "m", 1)
    c = compare(reference, other)
    assert c.choice_flips == 1
    assert c.max_abs_dp == pytest.approx(0.2) and c.max_abs_dlabel_mass == pytest.approx(0.05)
    same = compare(reference, reference)
    assert (same.choice_flips, same.max_abs_dp, same.max_abs_dlabel_mass) == (0, 0.0, 0.0)


def test_order_summary_maps_positions_back_to_options() -> None:
    # whatever the order, the first position gets 0.7: a pure position bias
    permuted = [np.array([[0.7, 0.3], [0.7, 0.3]])]
    s = order_summary(permuted, [[0, 1], [1, 0]])
    assert s["tv_max"] == pytest.approx(0.4) and s["choice_change_fraction"] == 1.0
    assert s["position_prior"] == pytest.approx([0.7, 0.3]) and s["chosen_position_share"] == [1.0, 0.0]
