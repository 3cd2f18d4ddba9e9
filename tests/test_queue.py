"""`train --queue` (issue 20): a per-host FIFO in the container for busy GPUs, through sshd + the
pct shim with the stand-in trainer. Waits are bounded polls, never timing assertions."""

from __future__ import annotations

import json
import threading

from runs_helpers import install_standin, run_dir, wait_until
from sshd import SHIM_VMID

LONG = ["--set", "run.steps=100000", "--set", "standin.step_time=0.05"]


def states(host) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {r["run_id"]: r["state"] for r in json.loads(host.run_cli("runs", "list", "shim", "--json").stdout)}


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
    refused = shim_host.run_cli("train", "shim", "--no-push", "--gpus", "1", *LONG, "--detach")
    assert refused.returncode == 6  # without --queue, busy GPUs are still a refusal
    shim_host.run_cli("runs", "stop", "shim", holder)
