"""`train --queue` (issue 20): a per-host FIFO in the container for busy GPUs, through sshd + the
pct shim with the stand-in trainer. Waits are bounded polls, never timing assertions."""

from __future__ import annotations

import json
import threading
import time

from runs_helpers import install_standin, run_dir, wait_until
from sshd import SHIM_VMID

LONG = ["--set", "run.steps=100000", "--set", "standin.step_time=0.05"]


def states(host) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {r["run_id"]: r["state"] for r in json.loads(host.run_cli("runs", "list", "shim", "--json").stdout)}


def show_rows(host, run_id: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    out = host.run_cli("runs", "show", "shim", run_id, "--no-curves").stdout
    return dict(line.split(None, 1) for line in out.splitlines() if line.strip())


def test_two_clients_queue_at_once_fifo_and_start_by_themselves(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    holder = shim_host.run_cli("train", "shim", "--no-push", "--gpus", "0", *LONG, "--detach").stdout.strip()
    answers: list = []
    clients = [
        threading.Thread(
            target=lambda: answers.append(
                shim_host.run_cli("train", "shim", "--no-push", "--gpus", "0", *LONG, "--queue", "--detach")
            )
        )
        for _ in range(2)
    ]
    for client in clients:
        client.start()
    for client in clients:
        client.join(120)
    assert all(a.returncode == 0 and "queued behind" in a.stderr for a in answers)
    first, second = sorted(a.stdout.strip() for a in answers)  # run ids sort by time: the FIFO order
    assert states(shim_host) == {holder: "running", first: "queued", second: "queued"}
    # The clients are gone; the queue lives in the container.
    assert shim_host.run_cli("runs", "stop", "shim", holder).returncode == 0
    wait_until(lambda: states(shim_host)[first] == "running", 60, "the first queued run to start")
    assert states(shim_host)[second] == "queued"
    assert "GPUs 0 free: starting" in (run_dir(workdir, first) / "train.log").read_text()
    assert shim_host.run_cli("runs", "stop", "shim", first).returncode == 0
    wait_until(lambda: states(shim_host)[second] == "running", 60, "the second queued run to start")
    assert shim_host.run_cli("runs", "stop", "shim", second).returncode == 0


def test_a_stop_cancels_a_queued_run_before_it_starts(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    holder = shim_host.run_cli("train", "shim", "--no-push", "--gpus", "1", *LONG, "--detach").stdout.strip()
    waiting = shim_host.run_cli(
        "train", "shim", "--no-push", "--gpus", "1", *LONG, "--queue", "--detach"
    ).stdout.strip()
    listed = shim_host.run_cli("runs", "list", "shim")
    assert any(line.startswith(waiting) and " queued " in f" {line} " for line in listed.stdout.splitlines())
    stopped = shim_host.run_cli("runs", "stop", "shim", waiting)
    assert stopped.returncode == 0 and "stopped (143)" in stopped.stdout
    log = (run_dir(workdir, waiting) / "train.log").read_text()
    assert "cancelled before it started" in log and "standin: pid" not in log
    rows = show_rows(shim_host, waiting)
    assert rows["duration"] == "-" and rows["started"] == "-"  # the trainer never ran
    assert "waited" in rows["queued"] and "cancelled before it started" in rows["queued"]
    refused = shim_host.run_cli("train", "shim", "--no-push", "--gpus", "1", *LONG, "--detach")
    assert refused.returncode == 6  # without --queue, busy GPUs are still a refusal
    shim_host.run_cli("runs", "stop", "shim", holder)


def test_a_queued_runs_duration_counts_from_its_start_and_show_gives_the_wait(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    holder = shim_host.run_cli("train", "shim", "--no-push", "--gpus", "2", *LONG, "--detach").stdout.strip()
    waiting = shim_host.run_cli(
        "train", "shim", "--no-push", "--gpus", "2", *LONG, "--queue", "--detach"
    ).stdout.strip()
    # Queued an hour ago: its supervisor writes run.json again only when it leaves the queue.
    path = run_dir(workdir, waiting) / "run.json"
    data = json.loads(path.read_text())
    data["started_ts"] -= 3600
    data["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(data["started_ts"]))
    path.write_text(json.dumps(data))
    assert shim_host.run_cli("runs", "stop", "shim", holder).returncode == 0
    wait_until(lambda: states(shim_host)[waiting] == "running", 60, "the queued run to start")
    rows = show_rows(shim_host, waiting)
    assert rows["queued"].startswith(data["started_at"]) and "waited 1:0" in rows["queued"]
    assert not rows["duration"].startswith("1:")  # not the hour it waited
    listed = [ln for ln in shim_host.run_cli("runs", "list", "shim").stdout.splitlines() if ln.startswith(waiting)]
    assert listed and " 1:0" not in listed[0]
    assert shim_host.run_cli("runs", "stop", "shim", waiting).returncode == 0


def test_a_run_json_from_before_dequeued_ts_counts_from_dequeued_at():
    from dflashctl.runs import duration, iso_ts, queue_wait

    queued = iso_ts("2026-12-01T10:00:00Z")
    run = {
        "state": "succeeded",
        "started_at": "2026-12-01T10:00:00Z",
        "started_ts": queued + 0.4,
        "queued": False,
        "queued_behind": ["20261201-095000-ab12"],
        "dequeued_at": "2026-12-01T11:00:00Z",
        "ended_ts": queued + 3660,
    }
    assert duration(run) == 60 and queue_wait(run) == 3600
