"""Issue 28: `run.tensorboard` writes the scalars of metrics.jsonl as TensorBoard events (read
back with tensorboard's own reader), drops the interrupted run's events on --resume, is off by
default, and without the tensorboard package the trainer stops at the pre-flight (exit 4)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from dflash_train.__main__ import main
from dflash_train.config import load_config
from dflash_train.dashboard import TAGS
from dflash_train.train import run_training


def _config(out: Path, *extra: str):
    return load_config(
        overrides=[
            f"run.output_dir={out}",
            "run.steps=20",
            "run.log_every=5",
            "run.eval_every=10",
            "run.checkpoint_every=10",
            "run.keep_checkpoints=2",
            *extra,
        ]
    )


def _events(out: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard reads the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(out / "tensorboard"))
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def _expected(out: Path) -> dict[str, list[tuple[int, float]]]:
    """The same, from metrics.jsonl: every scalar the dashboard maps, at its record's step."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, tag in TAGS.get(record["event"], {}).items():
            if record.get(key) is not None:
                expected.setdefault(tag, []).append((record["step"], pytest.approx(record[key], rel=1e-6)))
    return expected


def test_tensorboard_holds_the_logged_scalars(tmp_path):
    out = tmp_path / "run"
    assert run_training(_config(out, "run.tensorboard=true"), log=lambda line: None) == 0
    events = _events(out)
    assert events == _expected(out)
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/acceptance_length_teacher_forced",
        "eval/acceptance_length_teacher_forced",
        "eval/spec_tau_prompt_mean",
        "eval/spec_tau_pooled",
    } <= set(events)
    assert [step for step, _ in events["train/loss"]] == [5, 10, 15, 20]
    assert [step for step, _ in events["eval/spec_tau_pooled"]] == [10, 20]  # not at step 0: untrained, not decoded


@pytest.mark.slow
def test_resume_drops_the_interrupted_runs_later_events(tmp_path):
    """Trained to 20, its step-20 checkpoint then lost: --resume from 10 writes steps 15 and 20
    again, and TensorBoard shows each step once, the resumed values (as metrics.jsonl)."""
    out = tmp_path / "run"
    cfg = _config(out, "run.tensorboard=true")
    assert run_training(cfg, log=lambda line: None) == 0
    shutil.rmtree(out / "checkpoints" / "step_00000020")
    assert run_training(_config(out, "run.tensorboard=true", "run.seed=1"), resume=True, log=lambda line: None) == 0
    events = _events(out)
    assert [step for step, _ in events["train/loss"]] == [5, 10, 15, 20]
    assert events == _expected(out)


def test_off_by_default(tmp_path):
    out = tmp_path / "run"
    assert run_training(_config(out, "run.steps=5", "run.log_every=5"), log=lambda line: None) == 0
    assert (out / "metrics.jsonl").is_file() and not (out / "tensorboard").exists()


@pytest.mark.parametrize("preflight", [True, False])
def test_without_tensorboard_the_trainer_stops_at_once_exit_4(tmp_path, capsys, monkeypatch, preflight):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what `import tensorboard` meets where it is not installed
    args = ["--set", f"run.output_dir={tmp_path / 'run'}", "--set", "run.tensorboard=true"]
    assert main(args + (["--preflight"] if preflight else [])) == 4
    captured = capsys.readouterr()
    message = f"tensorboard is not installed in {sys.executable} (run.tensorboard needs it)"
    if preflight:
        assert json.loads(captured.out) == {
            "ok": False,
            "error": "missing_module",
            "module": "tensorboard",
            "message": message,
        }
    else:
        assert captured.err == f"error: {message}\n"
        assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained
