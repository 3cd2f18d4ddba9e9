"""The step bench measures the trainer's step (docs/performance.md's MFU rows): its CPU dry run
asserts that the bench's own step computes the loss `replica.forward_loss` computes on the same
weights and batch, so a trainer change the bench does not follow fails here, not on a GPU."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import step_bench  # noqa: E402


def test_the_bench_step_is_the_trainers_step(tmp_path):
    assert step_bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "step_bench.json").read_text())["rows"]
    assert row["loss_matches_forward_loss"] is True, row


def test_a_plan_row_names_a_known_flex_variant():
    assert step_bench.plan_row("8b:fast:1:unguarded") == ("8b", "fast", 1, "unguarded")
    assert step_bench.plan_row("8b:trainer:2") == ("8b", "trainer", 2, "")
    for text in ("8b:fast:1:nope", "8b:trainer:1:unguarded"):
        with pytest.raises(SystemExit, match="a flex variant is one of unguarded, tma"):
            step_bench.plan_row(text)
