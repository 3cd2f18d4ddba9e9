"""Multi-host runs end to end: `dflashctl train shim,gpu2` through two real sshd hosts (127.0.0.1
and 127.0.0.2), each with its pct shim container, the real trainer on CPU (gloo), 2 threads per host.

Both "hosts" are loopback addresses of this machine, so the rendezvous is 127.0.0.1 and gloo is
told to use `lo` (GLOO_SOCKET_IFNAME, docs/multihost.md). Waits are bounded polls; the one timing
assertion is the issue's: a node death ends the other node within 60 s.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest
import yaml
from runs_helpers import install_standin, wait_until
from sshd import SHIM_VMID, free_port

from dflashctl.inventory import HostSpec
from dflashctl.multihost import Prefixer, combine, node_env, rendezvous_address

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

TRAIN_PY = Path(__file__).resolve().parent.parent / "remote_payload" / "dflash_train" / "train.py"
STEPS = 6
# Random tokens: every anchor is valid and every micro-batch has the same loss weight, so the mean
# of 4 micro-batch gradients is the global batch's gradient however the replicas are spread.
TINY = [
    "data.source=random",
    f"run.steps={STEPS}",
    "data.batch_size=2",
    "data.num_train=24",
    "data.num_eval=2",
    "run.eval_batches=1",
    "run.log_every=1",
    "run.eval_every=1000",
    "run.checkpoint_every=1000",
]
LONG = [s for s in TINY if not s.startswith("run.steps=")] + ["run.steps=100000"]


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


class Pair:
    """Two sshd hosts in one inventory: `shim` (127.0.0.1, rank 0) and `gpu2` (127.0.0.2), group `pair`."""

    def __init__(self, first, second, inventory: Path):
        self.first, self.second, self.inventory = first, second, inventory
        self.work = {"shim": first.container_dir(SHIM_VMID) / "work", "gpu2": second.container_dir(SHIM_VMID) / "work"}

    def cli(self, *args: str, timeout: float = 120):
        return self.first.run_cli(*args, timeout=timeout, env={"DFLASHCTL_INVENTORY": str(self.inventory)})

    def run_dir(self, host: str, run_id: str) -> Path:
        return self.work[host] / "runs" / run_id

    def meta(self, host: str, run_id: str) -> dict:
        return json.loads((self.run_dir(host, run_id) / "run.json").read_text())

    def exit_code(self, host: str, run_id: str) -> int | None:
        path = self.run_dir(host, run_id) / "exit_code"
        return int(path.read_text()) if path.exists() else None

    def log(self, host: str, run_id: str) -> str:
        path = self.run_dir(host, run_id) / "train.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def train(self, hosts: str, extra: list[str], *args: str) -> str:
        # A free rendezvous port for a run across hosts (not 29500 in a test); one host takes none.
        port = [] if hosts in self.work else ["--rdzv-port", str(free_port("127.0.0.1"))]
        done = self.cli(
            "train",
            hosts,
            "--detach",
            "--gpus",
            "cpu",
            *port,
            "--env",
            "GLOO_SOCKET_IFNAME=lo",
            *args,
            *sets(extra),
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def losses(self, host: str, run_id: str) -> list[float]:
        lines = (self.run_dir(host, run_id) / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if r.get("event") == "train"]


@pytest.fixture
def pair(sshd_host, second_sshd_host, tmp_path):
    sshd_host.reset()
    second_sshd_host.reset()
    sshd_host.link(second_sshd_host)
    path = sshd_host.write_inventory(tmp_path / "hosts.yaml", {"gpu2": second_sshd_host.host_entry(SHIM_VMID)})
    data = yaml.safe_load(path.read_text())
    data["groups"] = {"pair": ["shim", "gpu2"]}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    pair = Pair(sshd_host, second_sshd_host, path)
    yield pair
    for work in pair.work.values():  # nothing a failed test started may outlive it
        for meta_path in (work / "runs").glob("*/run.json"):
            info = json.loads(meta_path.read_text())
            if (meta_path.parent / "exit_code").exists():
                continue
            for key in ("trainer", "supervisor"):
                pid = (info.get(key) or {}).get("pid")
                try:
                    if pid:
                        os.killpg(pid, signal.SIGKILL) if key == "trainer" else os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


# --- unit ----------------------------------------------------------------------------------------


def test_rendezvous_address_and_node_env():
    h1 = HostSpec(name="h1", address="10.0.0.1")
    h2 = HostSpec(name="h2", address="10.0.0.2", rendezvous_address="172.16.0.2")
    assert rendezvous_address(h1) == "10.0.0.1" and rendezvous_address(h2) == "172.16.0.2"
    with pytest.raises(Exception, match="rendezvous_address"):
        rendezvous_address(HostSpec(name="local", transport="local"))
    env = node_env([h2, h1], 1, "r1", "172.16.0.2", 29500, {"NCCL_SOCKET_IFNAME": "eth0", "RANK": "9"})
    assert env == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "172.16.0.2",
        "MASTER_PORT": "29500",
        "DFLASH_NODES": "h2,h1",
        "DFLASH_RUN_ID": "r1",
    }


def view(host, rank, state, code=None, reason=None):
    return {"host": host, "rank": rank, "state": state, "exit_code": code, "reason": reason}


def test_combined_state_and_reason():
    lost = "lost node b (rank 1): no heartbeat for 3 s"
    assert combine([view("a", 0, "failed", 75, lost), view("b", 1, "lost")]) == ("failed", 75, lost)
    assert combine([view("a", 0, "failed", 75, lost), view("b", 1, "failed", 137)])[2] == lost
    assert combine([view("a", 0, "running"), view("b", 1, "lost")])[0] == "running"
    assert combine([view("a", 0, "succeeded", 0), view("b", 1, "succeeded", 0)]) == ("succeeded", 0, None)
    assert combine([view("a", 0, "stopped", 143), view("b", 1, "failed", 75, lost)])[0] == "stopped"
    assert combine([view("a", 0, "succeeded", 0), view("b", 1, "failed", 1)]) == (
        "failed",
        1,
        "node b (rank 1) failed with exit code 1",
    )
    # Rank 0 failed, then `train --follow` stopped the node that could not go on without it.
    busy = "a (rank 0) cannot serve the rendezvous on port 29500 (...)"
    assert combine([view("a", 0, "failed", 75, busy), view("b", 1, "stopped", 137)]) == ("failed", 75, busy)
    unknown = {**view("b", 1, "unknown"), "error": "connection refused"}
    assert combine([view("a", 0, "lost"), unknown]) == ("lost", None, "node a (rank 0) lost")


def test_prefixer_writes_whole_lines_per_host():
    import io

    out = io.BytesIO()
    p = Prefixer(out)
    a, b = p.sink("a"), p.sink("b")
    a(b"one\ntw")
    b(b"x\n")
    a(b"o\n")
    b(b"tail")
    p.flush()
    assert out.getvalue() == b"[a] one\n[b] x\n[a] two\n[b] tail\n"


# --- end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_hosts_two_threads_match_one_host_four_threads(pair):
    """2 hosts x 2 threads (gloo) == 1 host x 4 threads on the same global batch of 8 sequences."""
    port = free_port("127.0.0.1")
    done = pair.cli(
        "train",
        "pair",
        "--follow",
        "--gpus",
        "cpu",
        "--rdzv-port",
        str(port),
        "--env",
        "GLOO_SOCKET_IFNAME=lo",
        *sets([*TINY, "run.threads=2"]),
    )
    assert done.returncode == 0, done.stderr
    run_id = next(p.name for p in (pair.work["shim"] / "runs").iterdir() if p.is_dir())
    assert f"run {run_id} succeeded" in done.stderr
    logs = {h: pair.log(h, run_id) for h in ("shim", "gpu2")}
    for host, rank in (("shim", 0), ("gpu2", 1)):
        assert f"node {host} (rank {rank}) of 2 joined gloo group at 127.0.0.1:{port}" in logs[host]
        assert "replicas per node [2, 2] (global 4)" in logs[host]
        assert pair.meta(host, run_id)["group"] == {
            "nodes": ["shim", "gpu2"],
            "rank": rank,
            "world_size": 2,
            "rendezvous": f"127.0.0.1:{port}",
        }
    # All 4 replicas equal: 2 per process (checked in-process at every step) and across the hosts.
    sums = [
        line.split("checksum ")[1].split()[0]
        for h in ("shim", "gpu2")
        for line in logs[h].splitlines()
        if line.startswith("nodes in sync:")
    ]
    assert len(sums) == 2 and sums[0] == sums[1]
    losses = pair.losses("shim", run_id)
    assert len(losses) == STEPS and losses == pair.losses("gpu2", run_id)  # all-reduced: the same bits
    # Only rank 0 writes checkpoints and the export.
    assert list((pair.run_dir("shim", run_id) / "checkpoints").glob("step_*"))
    assert not list((pair.run_dir("gpu2", run_id) / "checkpoints").glob("step_*"))
    assert (pair.run_dir("shim", run_id) / "export").is_dir() and not (pair.run_dir("gpu2", run_id) / "export").exists()

    shown = json.loads(pair.cli("runs", "show", "gpu2", run_id, "--json").stdout)
    assert shown["state"] == "succeeded" and [n["state"] for n in shown["nodes"]] == ["succeeded", "succeeded"]
    listed = json.loads(pair.cli("runs", "list", "shim", "--json").stdout)
    assert [(r["run_id"], r["host"]) for r in listed] == [(run_id, "shim,gpu2")]

    # The reference: one host, 4 threads, same global batch (4 x 2 sequences), same seed.
    ref = pair.train("shim", [*TINY, "run.threads=4"])
    wait_until(lambda: pair.exit_code("shim", ref) is not None, 120, "the 1-host run to end")
    assert pair.exit_code("shim", ref) == 0, pair.log("shim", ref)
    # Tolerance: only the order of float32 additions in the gradient mean differs
    # (((g0+g1)/2 + (g2+g3)/2)/2 against (g0+g1+g2+g3)/4), a few ulps (~1e-7 relative) per step.
    # Losses see it through parameters: rtol 1e-5. Adam divides by sqrt(v): an element whose
    # gradient is itself rounding noise can move by up to one lr step differently, so parameters
    # get atol lr/10 as in tests/payload/test_workers.py, and most must be equal to 1e-5.
    torch.testing.assert_close(losses, pair.losses("shim", ref), rtol=1e-5, atol=0)
    ckpt = f"checkpoints/step_{STEPS:08d}/drafter.safetensors"
    multi = load_file(str(pair.run_dir("shim", run_id) / ckpt))
    single = load_file(str(pair.run_dir("shim", ref) / ckpt))
    lr = 2e-3  # the tiny preset's
    assert multi.keys() == single.keys()
    for key in multi:
        torch.testing.assert_close(multi[key], single[key], rtol=1e-3, atol=lr / 10)
    close = sum(int(torch.isclose(multi[k], single[k], rtol=1e-5, atol=1e-7).sum()) for k in multi)
    assert close >= 0.99 * sum(t.numel() for t in multi.values())


@pytest.mark.slow
def test_killed_node_fails_the_other_within_60s_naming_it(pair):
    run_id = pair.train("shim,gpu2", [*LONG, "run.threads=2"])
    wait_until(
        lambda: "step 2/" in pair.log("shim", run_id) and "step 2/" in pair.log("gpu2", run_id),
        90,
        "both nodes to train",
    )
    dead = pair.meta("gpu2", run_id)
    os.killpg(dead["trainer"]["pid"], signal.SIGKILL)  # the node dies: its trainer and its supervisor
    os.kill(dead["supervisor"]["pid"], signal.SIGKILL)
    wait_until(lambda: pair.exit_code("shim", run_id) is not None, 60, "the surviving node to exit")
    assert pair.exit_code("shim", run_id) == 75
    log = pair.log("shim", run_id)
    assert "error: lost node gpu2 (rank 1)" in log, log[-3000:]
    assert not list((pair.run_dir("shim", run_id)).glob("checkpoints/.tmp*"))

    shown = json.loads(pair.cli("runs", "show", "shim", run_id, "--json").stdout)
    assert shown["state"] == "failed" and shown["exit_code"] == 75
    assert shown["reason"].startswith("lost node gpu2 (rank 1)")
    assert [(n["host"], n["state"]) for n in shown["nodes"]] == [("shim", "failed"), ("gpu2", "lost")]
    text = pair.cli("runs", "show", "pair", run_id, "--no-curves").stdout
    assert "failed (75)" in text and "reason" in text and "lost node gpu2 (rank 1)" in text


@pytest.mark.slow
def test_logs_per_node_and_all_then_stop_stops_every_node(pair):
    run_id = pair.train("pair", [*LONG, "run.threads=2"])
    wait_until(
        lambda: "step 2/" in pair.log("shim", run_id) and "step 2/" in pair.log("gpu2", run_id),
        90,
        "both nodes to train",
    )
    for where in ("pair", "gpu2"):  # any node, or the group: rank 0's log unless --host
        rank0 = pair.cli("logs", "tail", where, run_id, "-n", "1000")
        assert rank0.returncode == 0 and "node shim (rank 0) of 2 joined" in rank0.stdout
    other = pair.cli("logs", "tail", "shim", run_id, "--host", "gpu2", "-n", "1000")
    assert "node gpu2 (rank 1) of 2 joined" in other.stdout and "node shim (rank 0)" not in other.stdout
    both = pair.cli("logs", "tail", "shim", run_id, "--all", "-n", "1000").stdout.splitlines()
    assert any(line.startswith("[shim] node shim (rank 0) of 2 joined") for line in both)
    assert any(line.startswith("[gpu2] node gpu2 (rank 1) of 2 joined") for line in both)
    assert all(line.startswith(("[shim] ", "[gpu2] ")) for line in both)
    listed = pair.cli("runs", "list", "pair")
    assert run_id in listed.stdout and "shim,gpu2" in listed.stdout and "running" in listed.stdout

    stopped = pair.cli("runs", "stop", "gpu2", run_id, "--grace", "60")
    assert stopped.returncode == 0, stopped.stderr
    assert f"run {run_id} is now stopped (143) on shim,gpu2" in stopped.stdout
    assert pair.exit_code("shim", run_id) == 143 and pair.exit_code("gpu2", run_id) == 143
    step = int(pair.log("shim", run_id).split("after step ")[1].split(";")[0])
    assert f"after step {step};" in pair.log("gpu2", run_id)  # the nodes agreed on the step
    assert (pair.run_dir("shim", run_id) / f"checkpoints/step_{step:08d}").is_dir()
    assert not list((pair.run_dir("gpu2", run_id)).glob("checkpoints/step_*"))
    followed = pair.cli("logs", "tail", "pair", run_id, "-f", "-n", "0")
    assert followed.returncode == 101 and f"run {run_id} stopped" in followed.stderr


@pytest.mark.slow
def test_stop_with_a_node_unreachable_names_it_and_that_node_ends_stopped(pair, tmp_path):
    """`runs stop` with gpu2 out of reach said `is now stopped (143) on shim,gpu2` and exited 0; now
    it names the node it stopped and the one it could not reach (exit 3). gpu2's trainer still
    stops with the group (stop agreement): that node showed `failed (143)`, now `stopped`."""
    run_id = pair.train("pair", [*LONG, "run.threads=1"])
    wait_until(
        lambda: "step 2/" in pair.log("shim", run_id) and "step 2/" in pair.log("gpu2", run_id),
        90,
        "both nodes to train",
    )
    cut = yaml.safe_load(pair.inventory.read_text())
    cut["hosts"]["gpu2"]["port"] = free_port("127.0.0.2")  # nothing listens there: connection refused
    (tmp_path / "cut.yaml").write_text(yaml.safe_dump(cut, sort_keys=False))
    stopped = pair.first.run_cli(
        "runs", "stop", "shim", run_id, "--grace", "60", env={"DFLASHCTL_INVENTORY": str(tmp_path / "cut.yaml")}
    )
    assert stopped.returncode == 3, stopped.stderr
    assert stopped.stdout == f"run {run_id} is now stopped (143) on shim\n"
    last = stopped.stderr.splitlines()[-1]
    assert last.startswith(f"error: could not stop run {run_id} on gpu2 (rank 1): "), stopped.stderr
    assert last.endswith(f"; it may still be running there (retry: dflashctl runs stop gpu2 {run_id})")
    wait_until(lambda: pair.exit_code("gpu2", run_id) is not None, 60, "gpu2 to stop with the group")
    shown = json.loads(pair.cli("runs", "show", "pair", run_id, "--json").stdout)
    assert [(n["host"], n["state"], n["exit_code"]) for n in shown["nodes"]] == [
        ("shim", "stopped", 143),
        ("gpu2", "stopped", 143),
    ]
    assert shown["state"] == "stopped"


def test_a_name_taken_on_one_node_refuses_the_group_before_anything_starts(pair):
    for work in pair.work.values():
        install_standin(work / "payload")
    first = pair.cli("train", "gpu2", "--no-push", "--gpus", "cpu", "--name", "n", "--set", "run.steps=1", "--follow")
    assert first.returncode == 0, first.stderr
    (taken,) = [p.name for p in (pair.work["gpu2"] / "runs").iterdir() if p.is_dir()]
    group = pair.cli("train", "pair", "--no-push", "--gpus", "cpu", "--name", "n", "--set", "run.steps=1", "--detach")
    assert group.returncode == 6 and group.stdout == "", group.stderr
    assert group.stderr.splitlines() == [
        f"error: gpu2 (pct 200): a run named 'n' exists already ({taken}, succeeded); choose another --name "
        f"(that run stays reachable by its id: dflashctl runs show gpu2 {taken})"
    ]
    assert not (pair.work["shim"] / "runs").exists()  # nothing started on the free node either


def test_a_rendezvous_port_in_use_is_refused_before_anything_starts(pair):
    """The port was found taken only by rank 0's trainer: the CLI followed it ~75 s, then exited 1
    saying `run R running`, while gpu2 waited for the rendezvous (300 s). Now: one line, exit 6."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        done = pair.cli("train", "pair", "--follow", "--gpus", "cpu", "--rdzv-port", str(port), *sets(TINY))
    assert done.returncode == 6 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == [
        f"error: shim (pct 200): port {port} is not free there (Address already in use): rank 0 serves the "
        f"rendezvous on it; choose another with --rdzv-port"
    ]
    assert not any((work / "runs").exists() for work in pair.work.values())  # nothing pushed or started
    assert not any((work / "payload").exists() for work in pair.work.values())


@pytest.mark.slow
def test_rank_0_unable_to_serve_the_rendezvous_stops_the_other_node_at_once(pair, monkeypatch):
    """A port taken after check_rdzv_port looked (a race no look can close; the look is skipped
    here, as if the port had been free then): rank 0's trainer fails naming its host and port, and
    `train --follow` stops gpu2 at once instead of leaving it to wait out the rendezvous timeout
    (an hour here), then reports the run failed (exit 100). gpu2 exits 143 on the SIGTERM (it
    used to ignore it inside the rendezvous wait and be killed after the 5 s grace: 137)."""
    import dflashctl.multihost

    monkeypatch.setattr(dflashctl.multihost, "check_rdzv_port", lambda *args: None)
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        done = pair.cli(
            "train",
            "pair",
            "--follow",
            "--gpus",
            "cpu",
            "--rdzv-port",
            str(port),
            "--env",
            "GLOO_SOCKET_IFNAME=lo",
            *sets([*LONG, "dist.rendezvous_timeout_s=3600"]),
        )
        (run_id,) = [p.name for p in (pair.work["shim"] / "runs").iterdir() if p.is_dir()]
        assert pair.exit_code("gpu2", run_id) is not None  # ended, while the port is still held
    assert done.returncode == 100, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith(
        f"run {run_id} failed (exit code 75): shim (rank 0) cannot serve the rendezvous on port {port} ("
    )
    assert last.endswith(
        "; is the port in use by another run or program? Choose a free one: dflashctl train --rdzv-port; "
        "stopped gpu2 (rank 1), which cannot go on without rank 0"
    ), last
    shown = json.loads(pair.cli("runs", "show", "pair", run_id, "--json").stdout)
    assert (shown["state"], shown["exit_code"]) == ("failed", 75)
    assert shown["reason"].startswith(f"shim (rank 0) cannot serve the rendezvous on port {port} (")
    # gpu2 heard the stop while it waited for the rendezvous: a clean stop, not the SIGKILL after the grace.
    nodes = [(n["host"], n["state"], n["exit_code"]) for n in shown["nodes"]]
    assert nodes == [("shim", "failed", 75), ("gpu2", "stopped", 143)], pair.log("gpu2", run_id)[-2000:]
    assert (
        pair.log("gpu2", run_id)
        .rstrip()
        .endswith("stopped by signal 15 while waiting for the rendezvous: nothing to save")
    )


def test_rank_0_unable_to_serve_the_rendezvous_ends_a_detached_run_on_every_node(pair, monkeypatch):
    """The same race with `--detach`, the port taken by another run's store: nobody follows to stop
    gpu2, which used to wait out `dist.rendezvous_timeout_s` (an hour here) connected to that store.
    Rank 0 now leaves its reason there, so gpu2 exits 75 at once with it, and the run is failed."""
    import subprocess
    import sys

    import dflashctl.multihost

    monkeypatch.setattr(dflashctl.multihost, "check_rdzv_port", lambda *args: None)
    port = free_port("127.0.0.1")
    holder = subprocess.Popen([sys.executable, "-c", SERVE_STORE, str(port)])
    try:
        run_store(port)  # the holder is up
        done = pair.cli(
            "train",
            "pair",
            "--detach",
            "--gpus",
            "cpu",
            "--rdzv-port",
            str(port),
            "--env",
            "GLOO_SOCKET_IFNAME=lo",
            *sets([*LONG, "dist.rendezvous_timeout_s=3600"]),
        )
        assert done.returncode == 0, done.stderr
        run_id = done.stdout.strip()
        ended = lambda: None not in (pair.exit_code("shim", run_id), pair.exit_code("gpu2", run_id))  # noqa: E731
        wait_until(ended, 60, "both nodes to end")  # a bound: before the fix, gpu2 waited an hour
    finally:
        holder.kill()
        holder.wait()
    shown = json.loads(pair.cli("runs", "show", "pair", run_id, "--json").stdout)
    cannot = f"cannot serve the rendezvous on port {port} ("
    assert (shown["state"], shown["exit_code"]) == ("failed", 75)
    assert shown["reason"].startswith(f"shim (rank 0) {cannot}")
    nodes = [(n["host"], n["state"], n["exit_code"]) for n in shown["nodes"]]
    assert nodes == [("shim", "failed", 75), ("gpu2", "failed", 75)], pair.log("gpu2", run_id)[-2000:]
    assert shown["nodes"][1]["reason"].startswith(f"node shim (rank 0) failed: {cannot}")


def trainer_pair(out: Path, extra: list[str], *args: str, timeout: float = 90) -> list[str]:
    """Rank 0 and rank 1 trainers as local processes (no dflashctl): their logs, after both exited 0."""
    import subprocess
    import sys

    port = free_port("127.0.0.1")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH", "RANK", "WORLD_SIZE", "MASTER_"))}
    procs = []
    for rank in (0, 1):
        env = {
            **base,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DFLASH_NODES": "a,b",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        argv = [sys.executable, "-m", "dflash_train", *args, *sets([*extra, f"run.output_dir={out / str(rank)}"])]
        procs.append(
            subprocess.Popen(
                argv, cwd=TRAIN_PY.parent.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return logs


@pytest.mark.slow
def test_resume_across_the_group_from_rank_0s_checkpoint(tmp_path):
    """Only rank 0 has checkpoints; on --resume it hands its latest to rank 1, and the resumed run
    ends bit for bit where the uninterrupted one did."""
    cfg = [s for s in TINY if not s.startswith(("run.steps=", "run.checkpoint_every="))]
    cfg += ["run.steps=4", "run.checkpoint_every=2"]
    trainer_pair(tmp_path, cfg)
    ckpts = tmp_path / "0" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002", "step_00000004"]
    assert not (tmp_path / "1" / "checkpoints").exists() or not list((tmp_path / "1" / "checkpoints").iterdir())
    straight = load_file(str(ckpts / "step_00000004" / "drafter.safetensors"))
    import shutil

    shutil.rmtree(ckpts / "step_00000004")  # as if the run had stopped after step 2
    logs = trainer_pair(tmp_path, cfg, "--resume")
    assert "resuming from" in logs[0] and "step_00000002" in logs[1]  # rank 1 loaded rank 0's copy
    resumed = load_file(str(ckpts / "step_00000004" / "drafter.safetensors"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.slow
def test_train_resume_continues_a_group_run_on_every_node_from_rank_0s_checkpoint(pair):
    """The same through the CLI: `train pair --resume RUN` of a run stopped after step 2 (by
    debug.stop_at, as a SIGTERM at that step: both nodes exit 143, rank 0 checkpoints) continues
    both nodes from rank 0's checkpoint to the run's end."""
    cfg = [s for s in TINY if not s.startswith("run.steps=")] + ["run.steps=4", "debug.stop_at=step:2"]
    run_id = pair.train("pair", cfg)
    wait_until(lambda: None not in (pair.exit_code("shim", run_id), pair.exit_code("gpu2", run_id)), 120, "the stop")
    assert [pair.exit_code(h, run_id) for h in ("shim", "gpu2")] == [143, 143], pair.log("gpu2", run_id)[-2000:]
    assert [p.name for p in pair.run_dir("shim", run_id).glob("checkpoints/step_*")] == ["step_00000002"]
    # --env replaces the variables given at the start (as for one host); the rendezvous's are the run's.
    env = ["--env", "GLOO_SOCKET_IFNAME=lo", "--env", "EXTRA=1"]
    resumed = pair.cli("train", "pair", "--resume", run_id, *env, "--follow", timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert [pair.meta(h, run_id)["env"]["RANK"] for h in ("shim", "gpu2")] == ["0", "1"]
    assert pair.meta("gpu2", run_id)["env"]["EXTRA"] == "1"
    assert f"run {run_id} succeeded" in resumed.stderr
    assert "/checkpoints/step_00000002 at step 2" in pair.log("shim", run_id)
    assert "/.resume/step_00000002 at step 2" in pair.log("gpu2", run_id)  # rank 0's copy
    assert [pair.exit_code(h, run_id) for h in ("shim", "gpu2")] == [0, 0]
    losses = pair.losses("shim", run_id)
    assert len(losses) == 4 and losses == pair.losses("gpu2", run_id)


def test_rendezvous_timeout_names_the_missing_node(tmp_path):
    """A node that never comes: the one waiting exits 75 naming it (and records the reason), after
    the config's `dist.rendezvous_timeout_s` (given as a trainer override, not the 300 s default)."""
    import subprocess
    import sys

    procs = {}
    for rank, port in ((0, free_port("127.0.0.1")), (1, free_port("127.0.0.1"))):  # two separate groups of one
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DFLASH_NODES": "a,b",
            "GLOO_SOCKET_IFNAME": "lo",
            "DFLASHCTL_REASON_FILE": str(tmp_path / f"reason{rank}"),
        }
        argv = sets(["dist.rendezvous_timeout_s=2", "run.device=cpu", f"run.output_dir={tmp_path / str(rank)}"])
        procs[rank] = subprocess.Popen(
            [sys.executable, "-m", "dflash_train", *argv],
            cwd=TRAIN_PY.parent.parent,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
    errs = {rank: p.communicate(timeout=60)[1] for rank, p in procs.items()}
    assert [procs[r].returncode for r in (0, 1)] == [75, 75], errs
    assert "error: b (rank 1) did not join the rendezvous at 127.0.0.1:" in errs[0]
    assert "error: cannot reach the rendezvous of a (rank 0) at 127.0.0.1:" in errs[1]
    assert all(" within 2 s" in err for err in errs.values()), errs
    assert (tmp_path / "reason0").read_text().startswith("b (rank 1) did not join")


# Rank 0 of a group of 3 in the tests below: a bare TCPStore server, the store a real rank 0 serves.
SERVE_STORE = (
    "import datetime, sys, threading, torch.distributed as dist; "
    "store = dist.TCPStore('127.0.0.1', int(sys.argv[1]), 3, True, "
    "timeout=datetime.timedelta(seconds=600), wait_for_workers=False); threading.Event().wait()"
)


@pytest.mark.parametrize("window", ["join", "init"])
def test_rank_0_dying_during_the_rendezvous_is_a_lost_node_not_a_traceback(tmp_path, window):
    """World of 3. Rank 0 dies (SIGKILL) after rank 1 joined its store, while rank 2 has not
    ("join"), or once every node joined and rank 1 is inside init_process_group ("init": rank 1
    has written its first process-group key, and waits for ranks 0 and 2). Rank 1's store call
    used to end in a torch traceback and exit 1; now it exits 75 with one line naming rank 0,
    recorded as the reason, as the other rendezvous failures."""
    import datetime
    import subprocess
    import sys

    import torch.distributed as dist

    port = free_port("127.0.0.1")
    server = subprocess.Popen([sys.executable, "-c", SERVE_STORE, str(port)])
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH", "RANK", "WORLD_SIZE", "MASTER_"))}
    env = {
        **base,
        "RANK": "1",
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "DFLASH_NODES": "a,b,c",
        "DFLASH_RUN_ID": "r1",
        "GLOO_SOCKET_IFNAME": "lo",
        "DFLASHCTL_REASON_FILE": str(tmp_path / "reason"),
    }
    # Ranks 0 and 2 are this test's keys, with no heartbeat: only the store's end may end rank 1.
    settings = ["dist.rendezvous_timeout_s=600", "dist.lost_after_s=600"]
    argv = sets([*settings, "run.device=cpu", f"run.output_dir={tmp_path / 'out'}"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_train", *argv],
        cwd=TRAIN_PY.parent.parent,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The test's own connection to rank 0's store (it retries until the server is up): the keys
        # tell where rank 1 is.
        raw = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        store = dist.PrefixStore("dflash/r1/", raw)
        wait_until(lambda: store.check(["join/1"]) or proc.poll() is not None, 120, "rank 1's join")
        if window == "init":
            # Counted before the two joins below: rank 1 may see them and go on before this test could
            # count again. Past these two, only rank 1 adds keys: its monitor's three heartbeat
            # counters (it watches the group's setup), then its first process-group key.
            keys = raw.num_keys() + 2 + 3
            store.set("join/0", "a")
            store.set("join/2", "c")
            wait_until(lambda: raw.num_keys() > keys or proc.poll() is not None, 120, "rank 1's init_process_group")
        assert proc.poll() is None, proc.communicate()[1]
        server.kill()
        server.wait()
        err = proc.communicate(timeout=60)[1]  # a bound: the exit follows the kill at once
    finally:
        for p in (server, proc):
            if p.poll() is None:
                p.kill()
                p.wait()
    during = "while waiting for c (rank 2) to join" if window == "join" else "while joining the gloo group"
    lost = f"lost node a (rank 0) {during}: the rendezvous store at 127.0.0.1:{port} stopped answering ("
    assert proc.returncode == 75, err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1].startswith(f"error: {lost}"), err
    assert err.splitlines()[-1].endswith("); exiting with code 75"), err
    assert (tmp_path / "reason").read_text().startswith(lost)


def node_process(tmp_path: Path, rank: int, world: int, port: int, settings: list[str], **extra_env: str):
    """One real trainer node of group `r1` (nodes a, b, c... by rank) on 127.0.0.1:port, stderr piped;
    its reason file is tmp_path/reason<rank>; extra_env over its environment."""
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH", "RANK", "WORLD_SIZE", "MASTER_"))}
    env = {
        **base,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "DFLASH_NODES": ",".join("abcdefgh"[:world]),
        "DFLASH_RUN_ID": "r1",
        "GLOO_SOCKET_IFNAME": "lo",
        "DFLASHCTL_REASON_FILE": str(tmp_path / f"reason{rank}"),
        **extra_env,
    }
    argv = sets([*settings, "run.device=cpu", f"run.output_dir={tmp_path / str(rank)}"])
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_train", *argv],
        cwd=TRAIN_PY.parent.parent,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_store(port: int):
    """The test's own connection to the store on 127.0.0.1:port, under group r1's keys (it retries
    until the store is up)."""
    import datetime

    import torch.distributed as dist

    raw = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    return dist.PrefixStore("dflash/r1/", raw)


# A node that joins group r1 as rank 1 of 2 and beats its heartbeat as a real node's monitor does, but
# never sets up the process group: the node of the test below, stalled in the group's setup until killed.
JOIN_AND_BEAT = (
    "import datetime, sys, time, torch.distributed as dist; "
    "store = dist.PrefixStore('dflash/r1/', dist.TCPStore('127.0.0.1', int(sys.argv[1]), 2, False, "
    "timeout=datetime.timedelta(seconds=60), wait_for_workers=False)); store.set('join/1', 'b')\n"
    "while True: store.add('hb/1', 1); time.sleep(0.2)"
)


def test_a_node_killed_while_the_group_is_set_up_ends_the_others_by_name(tmp_path):
    """Rank 1 joins the rendezvous, then dies (SIGKILL) before the process group is set up. Rank 0,
    inside init_process_group waiting for it, used to wait out gloo's own connect (`dist.timeout_s`,
    1800 s): its monitor started only after the setup. Now the monitor watches the setup too: exit
    75 after `dist.lost_after_s`, one line naming rank 1, recorded as the reason."""
    import subprocess
    import sys

    port = free_port("127.0.0.1")
    proc = node_process(tmp_path, 0, 2, port, ["dist.heartbeat_s=0.5", "dist.lost_after_s=3"])
    victim = None
    try:
        store = run_store(port)
        wait_until(lambda: store.check(["join/0"]) or proc.poll() is not None, 120, "rank 0's join")
        victim = subprocess.Popen([sys.executable, "-c", JOIN_AND_BEAT, str(port)])
        wait_until(lambda: store.check(["join/1"]) or victim.poll() is not None, 120, "rank 1's join")
        assert proc.poll() is None, proc.communicate()[1]
        victim.kill()
        victim.wait()
        err = proc.communicate(timeout=60)[1]  # a bound: before the fix, 1800 s
    finally:
        for p in (proc, victim):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    lost = "lost node b (rank 1) while joining the gloo group: no heartbeat for "
    assert proc.returncode == 75, err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [err.splitlines()[-1]], err
    assert err.splitlines()[-1].startswith(f"error: {lost}"), err
    assert err.splitlines()[-1].endswith(" s (process killed, host down or network cut); exiting with code 75"), err
    assert (tmp_path / "reason0").read_text().startswith(lost)


def test_a_node_whose_own_setup_fails_tells_the_others_why(tmp_path):
    """Rank 1 cannot join the gloo group for a reason of its own (its GLOO_SOCKET_IFNAME names no
    interface). Rank 0, waiting for it in the same step, found it lost only when its heartbeat
    stopped (`dist.lost_after_s`), and could say no more; rank 1 now leaves its reason in the store,
    and rank 0 exits 75 naming it and that reason."""
    port = free_port("127.0.0.1")
    watch = ["dist.heartbeat_s=0.5", "dist.lost_after_s=120"]  # a heartbeat verdict cannot come first
    procs = [
        node_process(tmp_path, 0, 2, port, watch),
        node_process(tmp_path, 1, 2, port, watch, GLOO_SOCKET_IFNAME="nosuch0"),
    ]
    try:
        errs = [p.communicate(timeout=110)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [75, 75], errs
    own = "joining the gloo group failed on b (rank 1): RuntimeError: "
    assert errs[1].splitlines()[-1].startswith(f"error: {own}"), errs[1]
    assert errs[0].splitlines()[-1].startswith(f"error: node b (rank 1) failed: {own}"), errs[0]
    assert "nosuch0" in errs[0].splitlines()[-1]


def test_rank_0_unable_to_serve_the_rendezvous_ends_the_waiting_node_at_once(tmp_path):
    """Another run's store holds the port (taken after dflashctl's pre-flight look): rank 1 connects
    to it and waits there for rank 0 under this run's keys, and used to wait out
    `dist.rendezvous_timeout_s` (an hour here) unless `train --follow` stopped it. Rank 0 now leaves
    its reason in that store under this run's keys, and rank 1 exits 75 at once with it."""
    import subprocess
    import sys

    port = free_port("127.0.0.1")
    holder = subprocess.Popen([sys.executable, "-c", SERVE_STORE, str(port)])
    procs = []
    try:
        # The holder is up once a client connects (the client retries until then).
        run_store(port)
        procs = [node_process(tmp_path, r, 2, port, ["dist.rendezvous_timeout_s=3600"]) for r in (0, 1)]
        errs = [p.communicate(timeout=60)[1] for p in procs]  # a bound: before the fix, rank 1 waited an hour
    finally:
        for p in (holder, *procs):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [75, 75], errs
    cannot = f"cannot serve the rendezvous on port {port} ("
    advice = "; is the port in use by another run or program? Choose a free one: dflashctl train --rdzv-port"
    assert errs[0].splitlines()[-1].startswith(f"error: a (rank 0) {cannot}"), errs[0]
    last = errs[1].splitlines()[-1]
    assert last.startswith(f"error: node a (rank 0) failed: {cannot}"), errs[1]
    assert last.endswith(f"{advice}; exiting with code 75"), errs[1]
    assert "Traceback" not in errs[1], errs[1]
    assert (tmp_path / "reason1").read_text().startswith(f"node a (rank 0) failed: {cannot}")


def test_a_port_held_by_a_program_that_is_not_a_store_ends_the_wait_on_time(tmp_path):
    """Something else listens on the rendezvous port and never answers: torch's store client waits
    for its answer for ever (past its own timeout), and so did rank 1. Now it gives up after
    `dist.rendezvous_timeout_s` (and a few seconds for torch's own connect to fail first): exit 75,
    one line naming rank 0 and the likely cause."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        proc = node_process(tmp_path, 1, 2, port, ["dist.rendezvous_timeout_s=2"])
        try:
            err = proc.communicate(timeout=60)[1]  # a bound: before the fix, for ever
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 75, err
    cannot = f"cannot reach the rendezvous of a (rank 0) at 127.0.0.1:{port} within 2 s ("
    assert err.splitlines()[-1].startswith(f"error: {cannot}"), err
    assert "no rendezvous store answered there" in err.splitlines()[-1], err
    assert (tmp_path / "reason1").read_text().startswith(cannot)


@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_while_waiting_for_the_rendezvous_stops_at_once(tmp_path, rank):
    """A node whose peer never comes (rank 1: no store to connect to; rank 0: nobody joins) used to
    ignore SIGTERM until `dist.rendezvous_timeout_s` ran out (the C++ connect holds the main thread),
    so `runs stop` ended it with SIGKILL. Now it stops as before step 1: exit 143, nothing saved,
    no failure reason, and an existing checkpoint left as it was."""
    import subprocess
    import sys

    out = tmp_path / "out"
    kept = out / "checkpoints" / "step_00000002"
    kept.mkdir(parents=True)
    (kept / "meta.json").write_text("{}")
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port("127.0.0.1")),
        "DFLASH_NODES": "a,b",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1",
        "DFLASHCTL_REASON_FILE": str(tmp_path / "reason"),
    }
    argv = sets(["dist.rendezvous_timeout_s=3600", "run.device=cpu", f"run.output_dir={out}"])
    log = tmp_path / "train.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_train", "--resume", *argv],
            cwd=TRAIN_PY.parent.parent,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        node = "a (rank 0)" if rank == 0 else "b (rank 1)"
        waiting = f"node {node} of 2: waiting for the rendezvous at 127.0.0.1:{env['MASTER_PORT']} (up to 3600 s)"
        wait_until(lambda: waiting in log.read_text() or proc.poll() is not None, 120, "the rendezvous wait")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)  # a bound, not a timing claim: before the fix it waited out the 3600 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 143, text
    assert text.splitlines()[-1] == "stopped by signal 15 while waiting for the rendezvous: nothing to save", text
    assert not (tmp_path / "reason").exists()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]
    assert (kept / "meta.json").read_text() == "{}"


def test_on_event_reaches_every_node_of_a_group(pair):
    """`train pair --on-event CMD` dropped CMD: no node ran a hook. Each node's run now carries it
    (its runctl fires it; tests/test_restarts.py tests the firing itself)."""
    for work in pair.work.values():
        install_standin(work / "payload")
    hook = ["sh", "-c", "true"]
    group = pair.cli(
        "train",
        "pair",
        "--no-push",
        "--gpus",
        "cpu",
        "--rdzv-port",  # the stand-in serves none, but rank 0's host must be able to (not on 29500 in a test)
        str(free_port("127.0.0.1")),
        "--set",
        "run.steps=1",
        "--on-event",
        " ".join(hook),
        "--follow",
    )
    assert group.returncode == 0, group.stderr
    for work in pair.work.values():
        (meta_path,) = (work / "runs").glob("*/run.json")
        assert json.loads(meta_path.read_text())["on_event"] == hook


def held_group_run(pair: Pair, steps: int = 4, step_time: float = 0.05) -> str:
    """A run of the stand-in across both hosts, held after step 2 on both nodes (running)."""
    for work in pair.work.values():
        install_standin(work / "payload")
    config = [f"run.steps={steps}", f"standin.step_time={step_time}", "standin.hold_at=2"]
    run_id = pair.train("pair", config, "--no-push")
    wait_until(
        lambda: all("holding after step 2" in pair.log(h, run_id) for h in ("shim", "gpu2")), 60, "both nodes to hold"
    )
    return run_id


def test_a_group_run_resumes_on_every_node_from_any_of_them(pair):
    """`train gpu2 --resume RUN` (a node that is not rank 0) continues both nodes: same run id,
    ranks and rendezvous, each node's recorded environment. runctl still refuses one node alone."""
    from dflashctl.errors import UsageError
    from dflashctl.runs import resume_run

    run_id = held_group_run(pair)
    before = {h: pair.meta(h, run_id) for h in ("shim", "gpu2")}
    stopped = pair.cli("runs", "stop", "shim", run_id)
    assert stopped.returncode == 0 and "stopped (143) on shim,gpu2" in stopped.stdout, stopped.stderr
    with pair.first.session(inventory=pair.inventory) as session, pytest.raises(UsageError) as refused:
        resume_run(session.target("shim"), run_id, payload_hash=None)  # as a client that names no group
    assert f"run {run_id} spans several hosts: one node alone cannot continue it" in str(refused.value)
    assert "resumes" not in pair.meta("shim", run_id)

    resumed = pair.cli("train", "gpu2", "--no-push", "--resume", run_id[:12], "--follow")
    assert resumed.returncode == 0, resumed.stderr
    rendezvous = before["shim"]["group"]["rendezvous"]
    assert f"resumed run {run_id} on shim (rank 0), gpu2 (rank 1), rendezvous {rendezvous}" in resumed.stderr
    assert f"run {run_id} succeeded" in resumed.stderr
    for host in ("shim", "gpu2"):
        assert "standin: resuming after step 2" in pair.log(host, run_id) and pair.exit_code(host, run_id) == 0
        after = pair.meta(host, run_id)
        assert after["resumes"] == 1 and after["argv"][-1] == "--resume"
        assert after["env"] == before[host]["env"] and after["group"] == before[host]["group"]
    assert [pair.meta(h, run_id)["env"]["RANK"] for h in ("shim", "gpu2")] == ["0", "1"]
    shown = json.loads(pair.cli("runs", "show", "shim", run_id, "--json").stdout)
    assert shown["state"] == "succeeded" and [n["state"] for n in shown["nodes"]] == ["succeeded", "succeeded"]
    assert shown["resumes"] == 1 and shown["host"] == "shim,gpu2"


def test_a_group_resume_is_refused_before_any_node_starts(pair, tmp_path):
    """A node still running, a host set that is not the run's nodes, --rdzv-port for a run of one
    host, an unreachable node: one line each, and no node resumed."""
    from dflashctl.errors import UsageError
    from dflashctl.runs import resume_run

    run_id = held_group_run(pair)
    running = pair.cli("train", "gpu2", "--no-push", "--resume", run_id)
    assert running.returncode == 6 and running.stdout == "", running.stderr
    assert running.stderr.splitlines() == [
        f"error: run {run_id} is still running on shim, gpu2 (stop it first: dflashctl runs stop shim {run_id})"
    ]
    assert pair.cli("runs", "stop", "gpu2", run_id).returncode == 0
    blocker = pair.train("gpu2", ["run.steps=100000"], "--no-push")  # holds gpu2's CPU
    busy = pair.cli("train", "shim", "--no-push", "--resume", run_id)
    assert busy.returncode == 6 and len(busy.stderr.splitlines()) == 1, busy.stderr
    assert busy.stderr.startswith(f"error: gpu2 (pct 200): GPUs busy: run {blocker} uses cpu")
    assert busy.stderr.rstrip().endswith("; nothing was resumed")
    assert pair.cli("runs", "stop", "gpu2", blocker).returncode == 0
    alone = pair.cli("train", "gpu2", "--no-push", "--resume", blocker, "--rdzv-port", "29501")
    assert alone.returncode == 2 and alone.stderr.splitlines() == [
        f"error: run {blocker} ran on gpu2 alone: it has no rendezvous to move (drop --rdzv-port)"
    ]
    with pair.first.session(inventory=pair.inventory) as session, pytest.raises(UsageError) as by_hand:
        resume_run(session.target("gpu2"), blocker, payload_hash=None, rdzv_port=29501)  # runctl refuses too
    assert str(by_hand.value).endswith(
        f"run {blocker} ran on one host: it has no rendezvous to move (drop --rdzv-port)"
    )
    assert "resumes" not in pair.meta("gpu2", blocker)
    data = yaml.safe_load(pair.inventory.read_text())
    data["hosts"]["gpu3"] = dict(data["hosts"]["gpu2"])
    three = tmp_path / "three.yaml"
    three.write_text(yaml.safe_dump(data, sort_keys=False))
    wrong = pair.first.run_cli(
        "train", "shim,gpu3", "--no-push", "--resume", run_id, env={"DFLASHCTL_INVENTORY": str(three)}
    )
    assert wrong.returncode == 2 and wrong.stderr.splitlines() == [
        f"error: run {run_id} ran on shim,gpu2, not shim,gpu3: name one of its hosts, or exactly those"
    ]
    data["hosts"]["gpu2"]["port"] = free_port("127.0.0.2")  # nothing listens there
    gone = tmp_path / "gone.yaml"
    gone.write_text(yaml.safe_dump(data, sort_keys=False))
    unreachable = pair.first.run_cli(
        "train", "shim", "--no-push", "--resume", run_id, env={"DFLASHCTL_INVENTORY": str(gone)}
    )
    assert unreachable.returncode == 3 and len(unreachable.stderr.splitlines()) == 1, unreachable.stderr
    assert unreachable.stderr.startswith("error: gpu2") and "nothing was resumed" in unreachable.stderr
    assert all("resumes" not in pair.meta(h, run_id) for h in ("shim", "gpu2"))


def test_a_group_resume_checks_its_port_and_can_move_the_rendezvous(pair):
    """Rank 0's recorded port taken since the run stopped: the resume is refused before any node
    starts (it was a rendezvous failure), and `--rdzv-port P` moves the rendezvous: every node's
    runctl records it (group.rendezvous, MASTER_PORT). Nodes left with different rendezvous (a move
    that stopped part-way) need --rdzv-port."""
    run_id = held_group_run(pair)
    assert pair.cli("runs", "stop", "shim", run_id).returncode == 0
    before = {h: pair.meta(h, run_id) for h in ("shim", "gpu2")}
    addr, _, old_port = before["shim"]["group"]["rendezvous"].rpartition(":")
    with socket.create_server((addr, int(old_port))):
        taken = pair.cli("train", "gpu2", "--no-push", "--resume", run_id, "--follow")
        assert taken.returncode == 6 and taken.stdout == "", taken.stderr
        assert taken.stderr.splitlines() == [
            f"error: shim (pct 200): port {old_port} is not free there (Address already in use): rank 0 serves "
            f"the rendezvous on it; choose another with --rdzv-port"
        ]
        assert all("resumes" not in pair.meta(h, run_id) for h in ("shim", "gpu2"))
        split = pair.run_dir("gpu2", run_id) / "run.json"
        split.write_text(json.dumps(dict(before["gpu2"], group=dict(before["gpu2"]["group"], rendezvous=f"{addr}:1"))))
        refused = pair.cli("train", "shim", "--no-push", "--resume", run_id)
        assert refused.returncode == 2 and refused.stderr.splitlines() == [
            f"error: gpu2: run {run_id} there records the rendezvous {addr}:1, not {addr}:{old_port}: give every "
            f"node one with --rdzv-port"
        ]
        port = free_port("127.0.0.1")
        moved = pair.cli("train", "pair", "--no-push", "--resume", run_id, "--rdzv-port", str(port), "--follow")
    assert moved.returncode == 0, moved.stderr
    assert f"resumed run {run_id} on shim (rank 0), gpu2 (rank 1), rendezvous {addr}:{port}" in moved.stderr
    for host in ("shim", "gpu2"):
        after = pair.meta(host, run_id)
        assert after["resumes"] == 1 and pair.exit_code(host, run_id) == 0
        assert after["group"] == dict(before[host]["group"], rendezvous=f"{addr}:{port}")
        assert after["env"] == dict(before[host]["env"], MASTER_PORT=str(port))


def test_a_node_refused_after_the_others_resumed_stops_them_again(pair, monkeypatch):
    """gpu2's CPU taken between the checks and the starts (a run started there at that moment):
    its runctl refuses, and shim, resumed already, is stopped again; the error says so."""
    import io

    from rich.console import Console

    from dflashctl import multihost_resume
    from dflashctl.devices import parse_gpus
    from dflashctl.errors import ConflictError
    from dflashctl.runs import start_run, stop_run

    run_id = held_group_run(pair, steps=10000, step_time=0.5)  # resumed, it runs until stopped
    assert pair.cli("runs", "stop", "shim", run_id).returncode == 0
    real, blockers = multihost_resume.resume_run, []

    def racing(target, selector, **kw):
        if target.host.name == "gpu2" and not kw["check"]:
            blockers.append(start_run(target, gpus=parse_gpus("cpu"), overrides=["run.steps=100000"]).run_id)
        return real(target, selector, **kw)

    monkeypatch.setattr(multihost_resume, "resume_run", racing)
    with pair.first.session(inventory=pair.inventory) as session:
        _, group = multihost_resume.find_run(session, [session.host("gpu2")], run_id)
        try:
            with pytest.raises(ConflictError) as refused:
                multihost_resume.resume_group(
                    session,
                    run_id,
                    group,
                    force=False,
                    env={},
                    push=False,
                    source=None,
                    console=Console(file=io.StringIO()),
                )
        finally:
            for blocker in blockers:
                stop_run(session.target("gpu2"), blocker, 5.0)
    assert str(refused.value).startswith("gpu2 (pct 200): GPUs busy: run ")
    assert str(refused.value).endswith(f" (run {run_id} not resumed there; stopped it again on shim)")
    assert pair.meta("shim", run_id)["resumes"] == 1 and "resumes" not in pair.meta("gpu2", run_id)
    shown = json.loads(pair.cli("runs", "show", "shim", run_id, "--json").stdout)
    assert [(n["host"], n["state"]) for n in shown["nodes"]] == [("shim", "stopped"), ("gpu2", "stopped")]
