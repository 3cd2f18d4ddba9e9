"""Messages, help and small renderings the CLI gets right (issue 29 items 7 and 12): in-process
through main() where no host is needed, through the real sshd and pct shim where one is."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest
from runs_helpers import install_standin
from sshd import SHIM_VMID

from dflashctl.cli import main
from dflashctl.remote.runctl import state as runctl
from dflashctl.runs import metrics_summary


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run main() in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["dflashctl", *args])
    monkeypatch.setenv("COLUMNS", "200")
    before = signal.getsignal(signal.SIGINT)  # main() installs its own Ctrl-C handler
    try:
        with pytest.raises(SystemExit) as exc:
            main()
    finally:
        signal.signal(signal.SIGINT, before)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_a_mistyped_command_suggests_once(monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "runs", "lst")
    assert code == 2 and err.splitlines()[0] == "error: No such command 'lst'. Did you mean 'list'?"


def test_help_keeps_brackets_and_shows_no_meaningless_default(monkeypatch, capsys):
    _, out, _ = cli(monkeypatch, capsys, "runs", "show", "--help")
    assert "pip install 'dflashctl[plot]'" in out
    _, out, _ = cli(monkeypatch, capsys, "doctor", "--help")
    steps = next(line for line in out.splitlines() if "--steps" in line)
    assert "default 30 on GPU, 3 on CPU" in steps and "[default: 0]" not in out


def test_runs_show_counts_steps_like_runs_list_after_a_resume():
    records = [
        {"event": "train", "step": 20, "total_steps": 60, "loss": 2.0},
        {"event": "eval", "step": 20, "total_steps": 60, "loss": 2.1, "acceptance_length": 1.5},
        {"event": "start", "step": 20, "time_to_first_step_s": 9.0},
    ]  # a resumed run, before its first step
    assert dict(metrics_summary(records, 3))["step"] == "20/60"


def test_no_progress_line_before_the_first_training_record(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    untrained = {"event": "eval", "step": 0, "total_steps": 60, "loss": 9.0, "acceptance_length": 1.0}
    metrics.write_text(json.dumps(untrained) + "\n" + json.dumps({"event": "start", "step": 0}) + "\n")
    assert runctl.last_metrics(str(tmp_path)) is None  # was {acceptance_length: 1.0}: `step None accept 1.00`
    first = {"event": "train", "step": 1, "total_steps": 60, "loss": 8.0, "acceptance_length": None}
    with metrics.open("a") as fh:
        fh.write(json.dumps(first) + "\n")
    assert runctl.last_metrics(str(tmp_path)) == {
        **{k: v for k, v in first.items() if v is not None},
        "acceptance_length": 1.0,
    }


def test_hosts_trust_in_a_pipe_keeps_the_fingerprint_on_its_line(shim_host, tmp_path):
    home = shim_host.make_home(tmp_path / "home", trusted=False)
    res = shim_host.run_cli("hosts", "trust", "shim", "--yes", env={"HOME": str(home), "COLUMNS": "60"})
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[0]
    assert first.startswith(f"shim: [127.0.0.1]:{shim_host.port} offers ssh-ed25519 key SHA256:")
    assert len(res.stdout.splitlines()) == 2 and res.stdout.splitlines()[1].startswith("recorded in ")


def test_a_passphrase_protected_key_says_what_to_do(shim_host, tmp_path):
    key = tmp_path / "locked"
    shutil.copy(shim_host.home / ".ssh" / "id_ed25519", key)
    subprocess.run(["ssh-keygen", "-q", "-p", "-N", "secret", "-f", str(key)], check=True, capture_output=True)
    inventory = shim_host.write_inventory(
        tmp_path / "hosts.yaml", {"k": shim_host.host_entry(SHIM_VMID, identity_file=str(key))}
    )
    res = shim_host.run_cli("exec", "k", "--", "true", env={"DFLASHCTL_INVENTORY": str(inventory)})
    assert res.returncode == 3
    assert res.stderr.strip() == (
        f"error: k: {key} is protected by a passphrase, which dflashctl does not ask for; "
        f"load it into ssh-agent (ssh-add {key}) or use a key without a passphrase"
    )


def test_stopping_an_ended_run_does_not_say_stopping(shim_host):
    install_standin(shim_host.container_dir(SHIM_VMID) / "work" / "payload")
    done = shim_host.run_cli("train", "shim", "--no-push", "--set", "run.steps=1", "--detach")
    run_id = done.stdout.strip()
    assert shim_host.run_cli("logs", "tail", "shim", run_id, "-f").returncode == 0  # it has ended
    res = shim_host.run_cli("runs", "stop", "shim", run_id)
    assert res.returncode == 0 and res.stderr == "" and res.stdout.startswith(f"run {run_id} had already ended: ")


def test_a_resumed_run_is_listed_by_its_last_start_and_shown_with_both():
    """`runs list` sorts by the last (re)start and measures the duration from it: its `started`
    column is that time too (it showed the first start, so a resumed run sat among newer ones under
    an older time); `runs show` gives both, and says what the duration counts."""
    import io

    from rich.console import Console

    from dflashctl.runs import details_rows, print_runs

    run = {
        "run_id": "20261204-230008-a5d3",
        "state": "stopped",
        "started_at": "2026-12-04T23:00:08Z",
        "resumed_at": "2026-12-04T23:41:30Z",
        "resumes": 1,
        "started_ts": 1000.0,
        "ended_ts": 1120.0,
    }
    out = io.StringIO()
    print_runs(Console(file=out, width=200), [run], "local")
    (row,) = out.getvalue().splitlines()[1:]
    assert " 23:41 " in row and "23:00" not in row and " 2:00 " in row, row
    shown = {label: value.plain for label, value in details_rows(run)}
    assert (shown["started"], shown["resumed"]) == ("2026-12-04T23:00:08Z", "2026-12-04T23:41:30Z (1x)")
    assert shown["duration"] == "2:00 (since the last resume)"
