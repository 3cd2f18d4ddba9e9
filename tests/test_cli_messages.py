"""Messages, help and small renderings the CLI gets right (issue 29 items 7 and 12): in-process
through main() where no host is needed, through the real sshd and pct shim where one is."""

from __future__ import annotations

import inspect
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


@pytest.mark.parametrize("option", ["--debug", "--inventory", "-i"])
def test_a_global_option_after_the_command_says_where_it_goes(monkeypatch, capsys, option):
    """`(rerun with --debug)` invites `dflashctl runs show X --debug`, which said only `No such option`."""
    args = [option] if option == "--debug" else [option, "hosts.yaml"]
    code, _, err = cli(monkeypatch, capsys, "runs", "show", "x", *args)
    first = err.splitlines()[0]
    assert code == 2 and first == (
        f"error: No such option '{option}'. ({option} is dflashctl's own option: give it before the command, "
        f"dflashctl {option} ... runs show ...)"
    )


@pytest.mark.parametrize(
    "item, message",
    [
        ("target=5", "target is a section: give target.KEY=VALUE (keys: path, backend, "),
        ("preset.x=1", "preset.x is not a key to set: give --preset NAME"),
    ],
)
def test_train_set_of_a_section_or_the_preset_is_one_line(monkeypatch, capsys, tmp_path, item, message):
    """The pre-flight by the payload's config code: `target=5` said `unknown config key 'target'`,
    `preset.x=1` an internal TypeError."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DFLASHCTL_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(monkeypatch, capsys, "train", "local", "--set", item, "--detach")
    assert (code, out) == (2, "") and err.startswith(f"error: trainer config: {message}") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # refused before anything was pushed or written


def test_help_keeps_brackets_and_shows_no_meaningless_default(monkeypatch, capsys):
    _, out, _ = cli(monkeypatch, capsys, "runs", "show", "--help")
    assert "pip install 'dflashctl[plot]'" in out
    _, out, _ = cli(monkeypatch, capsys, "doctor", "--help")
    steps = next(line for line in out.splitlines() if "--steps" in line)
    assert "default 30 on GPU, 3 on CPU" in steps and "[default: 0]" not in out


def test_every_command_summary_is_one_paragraph_without_hard_breaks():
    """The command lists of `--help` print a docstring's first paragraph with its line breaks kept
    (typer's rich mode): `train`'s wrapped docstring showed as three ragged lines in `dflashctl --help`."""
    import click
    import typer

    from dflashctl.cli_common import app

    def commands(group: click.Group):  # type: ignore[no-untyped-def]
        for name, command in group.commands.items():
            yield name, command
            if isinstance(command, click.Group):
                yield from commands(command)

    broken = [
        name
        for name, command in commands(typer.main.get_command(app))
        if "\n" in inspect.cleandoc(command.help or "").split("\n\n")[0]
    ]
    assert broken == []


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


def test_runs_show_says_which_tau_and_whose_tokens_per_second():
    records = [{"event": "eval", "step": 0, "total_steps": 60, "loss": 6.6, "acceptance_length": 1.0}]
    records += [
        {"event": "train", "step": s, "total_steps": 60, "loss": 5.0, "tokens_per_s": 35014.2} for s in (50, 60)
    ]
    final = {"event": "final", "step": 60, "total_steps": 60, "loss": 4.7, "acceptance_length": 2.56}
    records.append({**final, "spec_tau": 1.204, "spec_tau_prompt_mean": 1.525, "spec_prompts": 4})
    rows = dict(metrics_summary(records, len(records)))
    # Was `1.525 (best 1.525; real draft-and-verify, greedy, held-out prompts)`: not which average
    # (pooled is 1.204 here), nor that it is the trainer's own figure on its few prompts.
    assert rows["speculative tau"].startswith("1.525 mean of per-prompt tau (best 1.525; in training:")
    assert "on 4 held-out prompts" in rows["speculative tau"]
    # Was a bare `35014`: the sum over every worker, of the steps since the record before.
    assert rows["tokens/s"] == "35014 (all workers together, steps 51-60)"
    older = [{k: v for k, v in r.items() if k not in ("spec_tau_prompt_mean", "spec_prompts")} for r in records]
    assert dict(metrics_summary(older, 4))["speculative tau"].startswith("1.204 pooled (best 1.204; in training:")
    resumed = [*records[:2], {"event": "start", "step": 54}, records[2]]  # resumed from step 54's checkpoint
    assert dict(metrics_summary(resumed, 4))["tokens/s"] == "35014 (all workers together, steps 55-60)"
    regen = {"rows_done": 8, "rows_total": 120, "tokens_per_s": 99.6, "rate_includes_start_up": True}
    assert dict(metrics_summary([regen], 1))["output tok/s"] == "100 (incl. start-up)"  # as its log line says
    assert dict(metrics_summary([{**regen, "rate_includes_start_up": False}], 1))["output tok/s"] == "100"


def test_runctl_show_keeps_the_record_before_the_last_for_the_rate_span(tmp_path, capsys):
    from dflashctl.remote.runctl.listing import cmd_show

    run = tmp_path / "runs" / "20261205-000000-abcd"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run.name, "run_dir": str(run), "gpus": ["cpu"]}))
    lines = [
        {"event": "train", "step": s, "total_steps": 3000, "loss": 1.0, "tokens_per_s": 9.0} for s in range(1, 3001)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cmd_show(str(tmp_path), "", "1000")
    shown = json.loads(capsys.readouterr().out)
    # Thinned to every 3rd record, the one kept before the last was step 2998's: the rate of step
    # 3000 alone (log_every 1) would have read as `steps 2999-3000`.
    assert [r["step"] for r in shown["metrics"][-2:]] == [2999, 3000]
    assert dict(metrics_summary(shown["metrics"], 3000))["tokens/s"] == "9 (all workers together, step 3000)"
