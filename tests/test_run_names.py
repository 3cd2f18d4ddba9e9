"""A run's name identifies one run on its host: a start with a `--name` that a run there has
already is refused before anything starts, under the same lock as the GPU check, so two starts
racing cannot both win. Names duplicated before the check existed still resolve as before (the
ambiguity error). Real parts: the CLI (in-process), sshd + the pct shim, `local`, the stand-in trainer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from runs_helpers import install_standin, meta, race, run_dir, wait_until
from sshd import SHIM_VMID, run_main_in_process
from test_eval import local_env
from test_runs import kill_leftovers

from dflashctl.devices import GpuChoice
from dflashctl.runs import start_run, stop_run

LONG = ["--set", "run.steps=100000", "--set", "standin.step_time=0.05"]


def runs_in(workdir: Path) -> list[str]:
    root = workdir / "runs"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


@pytest.fixture
def shim(shim_host):
    """(sshd host, container workdir) with the stand-in trainer in the container's payload."""
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    yield shim_host, workdir
    kill_leftovers(workdir)


def test_a_second_start_with_a_taken_name_on_local_is_one_line_exit_2(sshd_host, tmp_path):
    env = local_env(tmp_path)
    workdir = tmp_path / "wd"
    install_standin(workdir / "payload")
    args = ("train", "local", "--no-push", "--name", "my-drafter", "--set", "run.steps=1")
    first = sshd_host.run_cli(*args, "--follow", env=env, timeout=120)
    assert first.returncode == 0, first.stderr
    (run_id,) = runs_in(workdir)
    again = sshd_host.run_cli(*args, "--detach", env=env)
    assert again.returncode == 6 and again.stdout == "", again.stderr
    assert again.stderr.splitlines() == [
        f"error: local: a run named 'my-drafter' exists already ({run_id}, succeeded); choose another --name "
        f"(that run stays reachable by its id: dflashctl runs show local {run_id})"
    ]
    assert runs_in(workdir) == [run_id]  # nothing was started, no directory left behind
    shown = sshd_host.run_cli("runs", "show", "local", "my-drafter", "--json", "--no-curves", env=env)
    assert shown.returncode == 0 and json.loads(shown.stdout)["run_id"] == run_id
    other = sshd_host.run_cli("train", "local", "--no-push", "--name", "other", "--set", "run.steps=1", env=env)
    assert other.returncode == 0, other.stderr  # another name starts as ever


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_name_is_refused_before_anything(tmp_path, blank):
    """`--name ''` started an unnamed run, `--name '  '` one whose NAME column was empty (a pipe's columns shifted)."""
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    regen = ("data", "regen", "local", "--prompts", "p.jsonl", "--out", "o")
    for args in (("train", "local", "--no-push"), regen):
        res = run_main_in_process((*args, "--name", blank), env, tmp_path)
        expected = f"error: --name {blank!r} is blank: give the run a name, or leave --name out\n"
        assert (res.returncode, res.stderr) == (2, expected), args
    assert not (tmp_path / ".dflashctl").exists()  # nothing was pushed or started


def test_two_starts_racing_for_one_name_one_wins(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    with shim_host.session() as session:
        target = session.target("shim")

        def start() -> object:
            return start_run(target, gpus=GpuChoice(cpu=True), overrides=["run.steps=1"], name="r", force=True)

        winner, (refused,) = race(start, start)
        assert f"a run named 'r' exists already ({winner.run_id}, " in str(refused)
        assert runs_in(workdir) == [winner.run_id]
        stop_run(target, winner.run_id, grace=10)


def test_a_queued_run_holds_its_name_and_resume_by_name_still_works(shim):
    host, workdir = shim
    holder = host.run_cli("train", "shim", "--no-push", "--gpus", "0", *LONG, "--detach").stdout.strip()
    queued = host.run_cli("train", "shim", "--no-push", "--gpus", "0", *LONG, "--name", "q", "--queue", "--detach")
    assert queued.returncode == 0 and "queued behind" in queued.stderr, queued.stderr
    waiting = queued.stdout.strip()
    again = host.run_cli("train", "shim", "--no-push", "--gpus", "1", *LONG, "--name", "q", "--queue", "--detach")
    assert again.returncode == 6 and again.stdout == ""
    assert f"a run named 'q' exists already ({waiting}, queued)" in again.stderr
    assert runs_in(workdir) == sorted([holder, waiting])
    assert host.run_cli("runs", "stop", "shim", "q").returncode == 0
    assert host.run_cli("runs", "stop", "shim", holder).returncode == 0
    # The name's own run continues under it: --resume is no new start.
    resumed = host.run_cli("train", "shim", "--no-push", "--resume", "q", "--detach")
    assert resumed.returncode == 0 and resumed.stdout.strip() == waiting, resumed.stderr
    wait_until(lambda: meta(workdir, waiting).get("supervisor"), 60, "the resumed run's supervisor")
    assert host.run_cli("runs", "stop", "shim", waiting).returncode == 0


def test_a_data_run_given_that_name_is_refused_too(shim):
    host, workdir = shim
    started = host.run_cli("train", "shim", "--no-push", "--name", "shared", "--set", "run.steps=1", "--follow")
    assert started.returncode == 0, started.stderr
    (run_id,) = runs_in(workdir)
    (workdir / "data").mkdir()
    (workdir / "data" / "prompts.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    regen = host.run_cli(
        "data", "regen", "shim", "--prompts", "prompts.jsonl", "--out", "o", "--name", "shared", timeout=180
    )
    assert regen.returncode == 6, regen.stderr
    assert f"a run named 'shared' exists already ({run_id}, succeeded)" in regen.stderr
    assert runs_in(workdir) == [run_id]


def test_names_duplicated_before_the_check_stay_ambiguous(shim):
    host, workdir = shim
    started = host.run_cli("train", "shim", "--no-push", "--name", "dup", "--set", "run.steps=1", "--follow")
    assert started.returncode == 0, started.stderr
    (first,) = runs_in(workdir)
    # What a dflashctl without the check left: a second run directory under the same name.
    second = first[:-4] + ("0000" if not first.endswith("0000") else "0001")
    shutil.copytree(run_dir(workdir, first), run_dir(workdir, second))
    info = meta(workdir, second)
    info.update(run_id=second, run_dir=str(run_dir(workdir, second)))
    (run_dir(workdir, second) / "run.json").write_text(json.dumps(info))
    shown = host.run_cli("runs", "show", "shim", "dup")
    assert shown.returncode == 2 and shown.stdout == ""
    assert shown.stderr.strip().endswith(
        f"'dup' matches 2 runs: {min(first, second)}, {max(first, second)}; give more of the run id"
    )
    assert host.run_cli("runs", "show", "shim", second, "--no-curves").returncode == 0  # each by its id
    refused = host.run_cli("train", "shim", "--no-push", "--name", "dup", "--set", "run.steps=1", "--detach")
    assert refused.returncode == 6 and "a run named 'dup' exists already" in refused.stderr
