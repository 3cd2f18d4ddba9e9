"""`dflashctl runs pull`: a run's directory copied out of the container through real sshd + pct shim.

Copies must be byte-exact, checkpoints only as asked, and atomic: an existing destination, a bad
run, a stopped container or a connection dropped mid-stream leave no directory behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest
from runs_helpers import install_standin
from sshd import SHIM_VMID
from test_exec import one_line_error

from dflashctl.containers import Target
from dflashctl.errors import ConnectError, RemoteError
from dflashctl.inventory import HostSpec
from dflashctl.pull import pull_run
from dflashctl.transport import LocalTransport

MB = 1 << 20


def tree(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every regular file under root."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture
def finished_run(shim_host, tmp_path) -> tuple[str, Path]:
    """A succeeded stand-in run on `shim` with an export, odd file names and three checkpoints."""
    source = install_standin(tmp_path / "payload_src")
    res = shim_host.run_cli("train", "shim", "--source", str(source), "--follow", "--name", "p1",
                            "--set", "run.steps=2")
    assert res.returncode == 0, res.stderr
    run_id = res.stderr.split("started run ")[1].split()[0]
    run_dir = shim_host.container_dir(SHIM_VMID) / "work" / "runs" / run_id
    (run_dir / "export").mkdir()
    (run_dir / "export" / "model.safetensors").write_bytes(os.urandom(3 * MB))
    (run_dir / "export" / "name with spaces 'q' ü.json").write_text("{}")
    for step in (2, 10, 9):
        ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"step": step}))
    (run_dir / "checkpoints" / ".tmp-step_00000011").mkdir()  # a checkpoint being written
    (run_dir / "link").symlink_to("/etc/passwd")  # links are not followed or copied
    return run_id, run_dir


def test_pull_copies_the_run_without_checkpoints_byte_exact(shim_host, tmp_path, finished_run):
    run_id, run_dir = finished_run
    res = shim_host.run_cli("runs", "pull", "shim", "p1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    pulled = tmp_path / run_id
    expected = {k: v for k, v in tree(run_dir).items() if not k.startswith("checkpoints/")}
    assert tree(pulled) == expected and "export/name with spaces 'q' ü.json" in expected
    assert not (pulled / "link").exists() and not (pulled / "checkpoints").exists()
    assert res.stderr.startswith(f"pulled run {run_id} (succeeded) from shim (pct 200) to {pulled}: ")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial directory left


@pytest.mark.parametrize("which,steps", [("latest", ["step_00000010"]),
                                         ("all", ["step_00000002", "step_00000009", "step_00000010"])])
def test_pull_checkpoints_latest_or_all(shim_host, tmp_path, finished_run, which, steps):
    run_id, run_dir = finished_run
    res = shim_host.run_cli("runs", "pull", run_id[:-3], "--to", str(tmp_path / "out"), "--checkpoints", which)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == steps
    expected = {k: v for k, v in tree(run_dir / "checkpoints").items() if k.split("/")[0] in steps}
    assert tree(tmp_path / "out" / "checkpoints") == expected


@pytest.mark.parametrize("args,code,message", [
    (["runs", "pull", "shim", "zzz"], 5, "error: shim (pct 200): no runs yet"),
    (["runs", "pull", "stopped"], 4, "error: stopped: container 201 is not running (start it with `pct start 201`)"),
    (["runs", "pull", "--checkpoints", "some"], 2, "error: --checkpoints must be one of none, latest, all, got 'some'"),
])
def test_pull_errors_are_one_line_and_leave_nothing(shim_host, tmp_path, args, code, message):
    res = shim_host.run_cli(*args, "--to", str(tmp_path / "out"))
    assert res.returncode == code and one_line_error(res) == message
    assert list(tmp_path.iterdir()) == []


def test_pull_never_overwrites(shim_host, tmp_path, finished_run):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep")
    res = shim_host.run_cli("runs", "pull", "--to", str(dest))
    assert res.returncode == 2 and one_line_error(res) == f"error: {dest} already exists: pull into a new directory (--to)"
    assert tree(dest) == {"mine.txt": hashlib.sha256(b"keep").hexdigest()}


def test_dropped_connection_mid_pull_keeps_nothing(shim_host, tmp_path, finished_run):
    _, run_dir = finished_run
    (run_dir / "export" / "big.bin").write_bytes(os.urandom(24 * MB))
    struck = []

    def strike(done: int, total: int) -> None:
        if done > 2 * MB and not struck:
            struck.append(shim_host.kill_connections())

    here = tmp_path / "here"
    here.mkdir()
    with shim_host.session() as session:
        with pytest.raises(ConnectError, match="lost.* during pull; nothing was kept at .*out, run it again"):
            pull_run(session.target("shim"), "p1", here / "out", on_bytes=strike)
    assert struck and struck[0] >= 1
    assert list(here.iterdir()) == []


def test_a_hostile_tar_is_refused(tmp_path):
    """A compromised container answering with `../` in the tar cannot write outside the destination."""
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    fake = tmp_path / "fake-python"
    header = json.dumps({"run_id": "r1", "state": "succeeded", "files": 1, "bytes": 3})
    answer = header.encode() + b"\n" + payload.getvalue()
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.buffer.write({answer!r})\n")
    fake.chmod(0o755)
    target = Target(HostSpec(name="evil", transport="local", python=str(fake), workdir=str(tmp_path)), LocalTransport())
    (tmp_path / "dest").mkdir()
    with pytest.raises(RemoteError, match=r"refusing tar member '\.\./escaped\.txt'"):
        pull_run(target, "r1", tmp_path / "dest" / "out")
    assert not (tmp_path / "dest" / "escaped.txt").exists() and list((tmp_path / "dest").iterdir()) == []
