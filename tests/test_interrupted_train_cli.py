"""Ctrl-C of `dflashctl train HOST` during its start, through the CLI over the real sshd with the pct
stand-in (direct and through the mux) and on `local` (issue 29 item 9). `runctl start` runs under
the guard, so the Ctrl-C reaches it as SIGINT: before the start's last point it undoes the start
(nothing is left, and the line says so); after it, the run goes on, and the line names it and how
to stop it. The Ctrl-C comes from the stand-in at a defined point (its pre-flight, or the trainer's
start), never after a sleep."""

from __future__ import annotations

import json
import signal

import pytest
from runs_helpers import install_standin, run_dir, wait_until
from sshd import SHIM_VMID
from test_interrupted_start import preflights_left
from test_mux import mux  # noqa: F401 - persist hosts with a private mux directory, no mux left after


@pytest.fixture
def train(mux, tmp_path):  # type: ignore[no-untyped-def]
    """(workdir, run_cli) for hosts shim (ssh), p (ssh through the mux) and loc (local), all three on
    the one workdir in pct container 200, which holds the stand-in trainer."""
    workdir = mux.sshd.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    extra = {"p": mux.sshd.host_entry(SHIM_VMID, persist=30), "loc": {"transport": "local", "workdir": str(workdir)}}
    env = {**mux.env, "DFLASHCTL_INVENTORY": str(mux.sshd.write_inventory(tmp_path / "train.yaml", extra))}
    # A real process: the Ctrl-C is a SIGINT to the CLI's own process.
    return workdir, lambda *args, **kw: mux.sshd.run_cli(*args, env=env, timeout=180, process=True, **kw)


def runs_in(workdir) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(p.name for p in (workdir / "runs").iterdir() if p.name != ".lock")


@pytest.mark.parametrize("where", ["shim", "p", "loc"])
def test_ctrl_c_during_the_preflight_leaves_nothing_and_says_so(train, where, tmp_path):
    workdir, cli = train
    tag = f"standin.tag={tmp_path}"  # the stand-in signals this test's CLI, not another suite's
    marker = "standin.preflight_signal_cli=INT"
    res = cli("train", where, "--no-push", "--detach", "--set", marker, "--set", tag)
    assert res.returncode == 130 and res.stderr == "error: interrupted; nothing was started\n", res.stderr
    assert runs_in(workdir) == [] and preflights_left(marker, workdir) == []
    started = cli("train", where, "--no-push", "--detach", "--set", "run.steps=1")  # nothing holds the cpu
    assert started.returncode == 0, started.stderr
    assert runs_in(workdir) == [started.stdout.strip()]
    # Its supervisor writes exit_code last: the next test's reset of the container must not race it.
    wait_until(
        (run_dir(workdir, started.stdout.strip()) / "exit_code").exists, timeout=120, what="the started run to end"
    )


@pytest.mark.parametrize("where, sig", [("shim", "INT"), ("p", "INT"), ("loc", "INT"), ("loc", "TERM")])
def test_ctrl_c_once_the_run_exists_names_it_and_how_to_stop_it(train, where, sig, tmp_path):
    """The Ctrl-C comes once the CLI follows the started run's log: the one line names the run,
    which goes on and is stopped by the command it gives. A SIGTERM detaches the same way, with
    the shell's code for it (it exited 130, as for a Ctrl-C)."""
    workdir, cli = train
    tag = f"standin.tag={tmp_path}"  # the stand-in signals this test's CLI, not another suite's
    res = cli(
        "train",
        where,
        "--no-push",
        "--follow",
        "--set",
        f"standin.start_signal_cli={sig}",
        "--set",
        "run.steps=100000",
        "--set",
        tag,
    )
    [run_id] = runs_in(workdir)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 128 + getattr(signal, f"SIG{sig}"), res.stderr
    assert last == f"detached; the run goes on. Re-attach: dflashctl logs tail {where} {run_id} -f"
    listed = json.loads(cli("runs", "list", where, "--json").stdout)
    assert [(r["run_id"], r["state"]) for r in listed] == [(run_id, "running")]
    stopped = cli("runs", "stop", where, run_id)
    assert stopped.returncode == 0, stopped.stderr
