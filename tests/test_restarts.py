"""Restart with resume and event hooks (issue 20): `train --max-restarts N` through sshd + the pct shim, with the
stand-in trainer failing at a chosen step. Waits are bounded polls, never timing assertions."""

from __future__ import annotations

import json
import os
import shlex
import signal

import pytest
from runs_helpers import alive, install_standin, local_env, meta, run_dir, wait_until
from sshd import SHIM_VMID

FAST = ["--restart-delay", "0.2"]


def start(host, *args: str) -> tuple[object, str]:  # type: ignore[no-untyped-def]
    res = host.run_cli("train", "shim", "--no-push", *args, "--follow", timeout=120)
    return res, res.stderr.split("started run ")[1].split()[0]


def final_record(workdir, run_id: str) -> dict:
    lines = (run_dir(workdir, run_id) / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def test_a_crash_restarts_from_the_checkpoint_and_finishes_like_an_unbroken_run(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    steps = ["--set", "run.steps=12", "--set", "standin.checkpoint_every=4"]
    res, run_id = start(
        shim_host, *steps, "--set", "standin.fail_at=6", "--set", "standin.fail_once=true", "--max-restarts", "2", *FAST
    )
    assert res.returncode == 0, res.stderr  # the followed run succeeded in the end
    log = (run_dir(workdir, run_id) / "train.log").read_text()
    assert "dflashctl: restart 1/2 after exit code 3, from the checkpoint at step 4" in log
    assert "standin: resuming after step 4" in log and "standin: done" in log
    info = meta(workdir, run_id)
    assert info["restarts"] == 1 and info["last_restart"]["exit_code"] == 3
    unbroken_res, unbroken = start(shim_host, *steps, "--force")
    assert unbroken_res.returncode == 0
    assert final_record(workdir, run_id) == final_record(workdir, unbroken)
    listed = shim_host.run_cli("runs", "list", "shim")
    row = next(line for line in listed.stdout.splitlines() if line.startswith(run_id))
    assert "succeeded, restarts 1" in row


def test_failing_at_the_same_step_again_stops_restarting(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    res, run_id = start(
        shim_host,
        "--set",
        "run.steps=12",
        "--set",
        "standin.checkpoint_every=4",
        "--set",
        "standin.fail_at=6",
        "--max-restarts",
        "5",
        *FAST,
    )
    assert res.returncode == 100  # failed
    log = (run_dir(workdir, run_id) / "train.log").read_text()
    assert log.count("dflashctl: restart ") == 1
    assert "failed again (exit 3) without getting past its checkpoint at step 4: not restarting" in log
    assert meta(workdir, run_id)["restarts"] == 1


def test_config_errors_and_unlisted_codes_are_not_restarted(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    for extra in (["--set", "standin.fail_code=2"], ["--set", "standin.fail_code=3", "--restart-on", "1,75"]):
        res, run_id = start(
            shim_host,
            "--set",
            "run.steps=8",
            "--set",
            "standin.fail_at=2",
            "--max-restarts",
            "3",
            *FAST,
            *extra,
            "--force",
        )
        assert res.returncode == 100
        assert "dflashctl: restart" not in (run_dir(workdir, run_id) / "train.log").read_text()
    bad = shim_host.run_cli("train", "shim", "--restart-on", "x", "--max-restarts", "1")
    assert bad.returncode == 2 and "--restart-on takes exit codes" in bad.stderr


@pytest.mark.parametrize("flag", [["--restart-on", "1"], ["--restart-delay", "5"]], ids=lambda f: f[0])
def test_a_restart_option_without_max_restarts_is_refused(shim_host, tmp_path, flag):
    """`--restart-delay S` without `--max-restarts N` was ignored unsaid (restarts are off): refused
    as `--restart-on` is, before any host is asked (--no-push on an empty workdir: had it gone on,
    it would have found no trainer there, and started none)."""
    res = shim_host.run_cli("train", "local", "--no-push", *flag, env=local_env(tmp_path))
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == f"error: {flag[0]} needs --max-restarts N (N > 0)\n"


def test_a_stop_during_the_restart_delay_ends_the_run(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    res = shim_host.run_cli(
        "train",
        "shim",
        "--no-push",
        "--set",
        "run.steps=12",
        "--set",
        "standin.fail_at=2",
        "--max-restarts",
        "3",
        "--restart-delay",
        "300",
        "--detach",
    )
    run_id = res.stdout.strip()
    log = run_dir(workdir, run_id) / "train.log"
    wait_until(lambda: "dflashctl: restart 1/3" in log.read_text(), 60, "the restart notice")
    stopped = shim_host.run_cli("runs", "stop", "shim", run_id, timeout=120)  # long before the 300 s delay
    assert stopped.returncode == 0 and "stopped (3)" in stopped.stdout
    assert "standin: pid" in log.read_text() and log.read_text().count("standin: pid") == 1  # never restarted


HOOK = (
    "import json, os, sys; keys = ('DFLASHCTL_EVENT', 'DFLASHCTL_RUN_ID', 'DFLASHCTL_RUN_NAME', "
    "'DFLASHCTL_STATE', 'DFLASHCTL_EXIT_CODE'); "
    "open(sys.argv[1], 'a').write(json.dumps({k: os.environ[k] for k in keys}) + '\\n')"
)


def hooks_running(events) -> list[int]:  # type: ignore[no-untyped-def]
    """Pids of event hooks (from hook_command) still writing to `events`."""
    found = []
    for entry in os.scandir("/proc"):
        try:
            args = open(os.path.join(entry.path, "cmdline"), "rb").read().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if os.fsencode(str(events)) in args:
            found.append(int(entry.name))
    return found


def hook_command(host, events) -> str:  # type: ignore[no-untyped-def]
    """A --on-event command line that appends each event's environment to `events`."""
    return f"{host.host_entry(SHIM_VMID)['python']} -c {shlex.quote(HOOK)} {events}"


def test_the_event_hook_runs_once_per_event_with_hostile_names_passed_literally(shim_host, tmp_path):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    events = tmp_path / "events.jsonl"
    name = "a'b\"c; $(touch /tmp/pwned) `x` \\n"
    command = hook_command(shim_host, events)
    res, run_id = start(
        shim_host,
        "--name",
        name,
        "--set",
        "run.steps=12",
        "--set",
        "standin.checkpoint_every=4",
        "--set",
        "standin.fail_at=6",
        "--set",
        "standin.fail_once=true",
        "--max-restarts",
        "1",
        *FAST,
        "--on-event",
        command,
    )
    assert res.returncode == 0, res.stderr
    wait_until(lambda: events.exists() and len(events.read_text().splitlines()) == 3, 60, "three events")
    wait_until(lambda: not hooks_running(events), 60, "the event hooks to end")
    # Hooks run detached, so a slow one may write after the next: the order is the log's (fired
    # in order); the hooks' file shows each ran once.
    log = (run_dir(workdir, run_id) / "train.log").read_text()
    assert [line.split()[-1] for line in log.splitlines() if line.startswith("dflashctl: event ")] == [
        "started",
        "restarted",
        "succeeded",
    ]
    seen = sorted(
        (json.loads(line) for line in events.read_text().splitlines()),
        key=lambda e: ["started", "restarted", "succeeded"].index(e["DFLASHCTL_EVENT"]),
    )
    assert [e["DFLASHCTL_EVENT"] for e in seen] == ["started", "restarted", "succeeded"]
    assert all(e["DFLASHCTL_RUN_ID"] == run_id and e["DFLASHCTL_RUN_NAME"] == name for e in seen)
    assert seen[-1]["DFLASHCTL_STATE"] == "succeeded" and seen[-1]["DFLASHCTL_EXIT_CODE"] == "0"
    assert not os.path.exists("/tmp/pwned")


def test_a_lost_run_fires_the_lost_event_once_at_the_next_contact(shim_host, tmp_path):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    events = tmp_path / "events.jsonl"
    res = shim_host.run_cli(
        "train",
        "shim",
        "--no-push",
        "--set",
        "run.steps=100000",
        "--detach",
        "--on-event",
        hook_command(shim_host, events),
    )
    run_id = res.stdout.strip()
    # `--detach` returns once the pids are recorded, a moment before the supervisor fires `started`:
    # killed in between (a busy machine), the run would have no started event.
    wait_until(lambda: events.exists() and "started" in events.read_text(), 60, "the started event")
    info = meta(workdir, run_id)
    os.kill(info["supervisor"]["pid"], signal.SIGKILL)
    os.killpg(info["pgid"], signal.SIGKILL)
    for _ in range(3):  # three contacts, one event
        listed = shim_host.run_cli("runs", "list", "shim", "--json")
        assert listed.returncode == 0 and json.loads(listed.stdout)[0]["state"] == "lost"
    wait_until(lambda: events.exists() and "lost" in events.read_text(), 60, "the lost event")
    # Hooks run detached: only once none is left can a second `lost` no longer come.
    wait_until(lambda: not hooks_running(events), 60, "the event hooks to end")
    kinds = [json.loads(line)["DFLASHCTL_EVENT"] for line in events.read_text().splitlines()]
    assert kinds == ["started", "lost"]


def test_a_follow_ends_only_after_the_final_hook_has_written_to_the_log(shim_host):
    """The final event's hook writes after the run has ended (here a full second later); the
    follow waits for the supervisor's done marker, so the hook's line is always in its output."""
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    late = (
        "import os, sys, time\n"
        "if os.environ['DFLASHCTL_EVENT'] == 'succeeded':\n"
        "    time.sleep(1)\n"
        "    print('hook: the last word', flush=True)\n"
    )
    command = f"{shim_host.host_entry(SHIM_VMID)['python']} -c {shlex.quote(late)}"
    res, run_id = start(shim_host, "--set", "run.steps=3", "--on-event", command)
    assert res.returncode == 0, res.stderr
    assert res.stdout.rstrip("\n").endswith("[hook succeeded] hook: the last word")
    assert (run_dir(workdir, run_id) / ".supervisor_done").exists()
    tail = shim_host.run_cli("logs", "tail", "shim", run_id, "-f", "-n", "1")
    assert tail.returncode == 0 and tail.stdout == "[hook succeeded] hook: the last word\n"


def test_a_hooks_line_lands_whole_in_the_log_however_slowly_it_is_written(shim_host, tmp_path):
    """The hook wrote straight into train.log: half a line of it, another writer's line, then the
    rest, and the log had a line broken in two. Its lines now reach the log whole, each in one
    write, marked `[hook EVENT] `. The final event's hook: the trainer has ended, so the test's own
    line is the only other writer."""
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    half, go = tmp_path / "half", tmp_path / "go"
    slow = (
        "import os, sys, time\n"
        "if os.environ['DFLASHCTL_EVENT'] == 'succeeded':\n"
        "    sys.stdout.write('hook: half a line')\n"
        "    sys.stdout.flush()\n"
        f"    open({str(half)!r}, 'w').close()\n"
        "    deadline = time.time() + 60\n"
        f"    while not os.path.exists({str(go)!r}) and time.time() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    print(' and the rest', flush=True)\n"
        "    sys.stderr.write('hook: no newline at the end')\n"
    )
    command = f"{shim_host.host_entry(SHIM_VMID)['python']} -c {shlex.quote(slow)}"
    res = shim_host.run_cli("train", "shim", "--no-push", "--set", "run.steps=2", "--detach", "--on-event", command)
    log = run_dir(workdir, res.stdout.strip()) / "train.log"
    wait_until(half.exists, 60, "the hook's half line")
    with open(log, "a") as fh:
        fh.write("another writer's line\n")
    go.touch()
    wait_until(lambda: (log.parent / ".supervisor_done").exists(), 60, "the supervisor to end")
    lines = log.read_text().splitlines()
    assert "another writer's line" in lines
    assert "[hook succeeded] hook: half a line and the rest" in lines
    assert lines[-1] == "[hook succeeded] hook: no newline at the end"


@pytest.mark.slow
def test_hooks_still_running_at_the_end_are_stopped_not_left_on_the_host(shim_host, tmp_path):
    """A hook that never ends (`started`'s and the final event's here) outlived its run, re-parented
    to pid 1: the supervisor now gives the final one its 30 s, then stops every hook still running
    and says so in the log. Slow: the 30 s are waited out."""
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    pids = tmp_path / "hook-pids"
    command = f"sh -c {shlex.quote(f'echo $$ >> {pids}; exec sleep 600')}"
    res, run_id = start(shim_host, "--set", "run.steps=2", "--on-event", command)
    assert res.returncode == 0, res.stderr
    started = [int(p) for p in pids.read_text().split()]
    try:
        assert len(started) == 2  # the `started` and `succeeded` events' hooks
        wait_until(lambda: not any(alive(p) for p in started), 30, "the hooks to be stopped")
        log = (run_dir(workdir, run_id) / "train.log").read_text()
        assert log.count("still ran at the run's end: stopped") == 2
    finally:
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
