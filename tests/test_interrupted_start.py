"""An interrupted start (issue 29 item 9): a Ctrl-C (or kill) while `train` starts leaves nothing,
or a run that `runs list` shows and that holds no GPU it does not use. The interrupt comes at a
defined point (the stand-in's pre-flight signals runctl start), or its outcome is crafted on disk
(a start killed after run.json); nothing depends on timing."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from runs_helpers import install_standin, local_session

from dflashctl.errors import Interrupted, RemoteError
from dflashctl.devices import CPU, GpuChoice
from dflashctl.runs import list_runs, start_run, stop_run


def preflights_left(marker: str, workdir: Path) -> list[int]:
    """Pids of stand-in pre-flights of this workdir's runs whose command line holds marker (another
    test's, or another suite's on the same machine, are not this test's)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            if marker.encode() in line and str(workdir).encode() in line:
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_a_signal_during_the_preflight_leaves_no_run_and_no_process(tmp_path, sig):
    workdir = tmp_path / "work"
    install_standin(workdir / "payload")
    marker = f"standin.preflight_signal={sig}"
    with local_session(workdir) as session:
        target = session.target(None)
        with pytest.raises(RemoteError, match="interrupted .*nothing was started"):
            start_run(target, gpus=GpuChoice(cpu=True), overrides=[marker])
        assert list((workdir / "runs").iterdir()) == [workdir / "runs" / ".lock"]
        assert preflights_left(marker, workdir) == []  # runctl killed the pre-flight it was waiting for
        run = start_run(target, gpus=GpuChoice(cpu=True), overrides=["run.steps=1"])  # the GPUs (here: cpu) are free
        assert [r["run_id"] for r in list_runs(target)] == [run.run_id]


def test_a_start_killed_after_run_json_is_a_lost_run_that_holds_nothing(tmp_path):
    workdir = tmp_path / "work"
    install_standin(workdir / "payload")
    runs = workdir / "runs"
    killed = runs / "20261202-010203-dead"
    killed.mkdir(parents=True)
    # What runctl start leaves when killed -9 between run.json and the supervisor: its own marker,
    # now of a process that is gone (this pid with another start time: never alive).
    starter = {"pid": os.getpid(), "start": 1, "boot": None}
    (killed / "run.json").write_text(
        json.dumps(
            {
                "run_id": killed.name,
                "gpus": [CPU],
                "started_ts": 9e12,
                "started_at": "2026-12-02T01:02:03Z",
                "starter": starter,
            }
        )
    )
    unborn = runs / "20261202-010204-beef"  # killed -9 earlier still: no run.json, invisible
    (unborn / "checkpoints").mkdir(parents=True)
    with local_session(workdir) as session:
        target = session.target(None)
        listed = {r["run_id"]: r["state"] for r in list_runs(target)}
        assert listed == {killed.name: "lost"}  # visible, and not `running` (a young start would be)
        run = start_run(
            target, gpus=GpuChoice(cpu=True), overrides=["run.steps=100000"]
        )  # not refused: lost holds no GPU
        try:
            assert not unborn.exists()  # the next start cleared what the killed one left
        finally:
            assert stop_run(target, run.run_id, grace=10)["state"] == "stopped"


def test_ctrl_c_in_the_client_during_a_local_start_leaves_nothing(tmp_path):
    """The CLI's Ctrl-C (its handler raises Interrupted) while `runctl start` runs locally: the
    client ends runctl with SIGTERM and its grace, so runctl undoes the start instead of being
    killed half-way (which left an empty run directory and a pre-flight behind)."""
    workdir = tmp_path / "work"
    install_standin(workdir / "payload")
    marker = "standin.preflight_signal_client=INT"

    def interrupt(signum, frame):
        raise Interrupted()

    before = signal.signal(signal.SIGINT, interrupt)
    try:
        with local_session(workdir) as session:
            with pytest.raises(Interrupted):
                start_run(session.target(None), gpus=GpuChoice(cpu=True), overrides=[marker])
    finally:
        signal.signal(signal.SIGINT, before)
    assert list((workdir / "runs").iterdir()) == [workdir / "runs" / ".lock"]
    assert preflights_left(marker, workdir) == []
