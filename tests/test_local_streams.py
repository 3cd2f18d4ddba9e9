"""The CLI's own streams and keyboard (issue 18): a closed pipe (`| head`), a full disk
(`> /dev/full`), Ctrl-C, and usage errors, each through the real sshd + pct shim and `local`.

Hangs are bounded by `communicate(timeout=...)` and pytest-timeout, never by a timing assertion.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from runs_helpers import install_standin, readers, run_dir, wait_until
from sshd import CLI, SHIM_VMID

BIG = "import sys\nwhile True:\n    sys.stdout.buffer.write(b'x' * 65536)\n"  # never ends on its own


def cli(host, *args: str, stdout=subprocess.PIPE, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, *args], stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE, env={**host.env, **(env or {})}
    )


@pytest.mark.parametrize("where", ["shim", "local"])
def test_exec_ends_when_our_stdout_closes_like_ssh(shim_host, where):
    """`dflashctl exec h -- cat big | head -c 10` used to hang for good once the pipe filled."""
    python = shim_host.host_entry(200)["python"]
    proc = cli(shim_host, "exec", where, "--", python, "-c", BIG)
    assert proc.stdout.read(10) == b"x" * 10
    proc.stdout.close()  # what `head -c 10` does next
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (255, b"")  # OpenSSH's exit code, and quiet


def test_exec_to_a_full_disk_is_one_line_and_255(shim_host):
    python = shim_host.host_entry(200)["python"]
    with open("/dev/full", "wb") as full:
        proc = cli(shim_host, "exec", "shim", "--", python, "-c", BIG, stdout=full)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 255
    assert err.decode().strip() == "error: cannot write to stdout: No space left on device"


def test_exec_through_the_mux_ends_when_our_stdout_closes(shim_host, tmp_path):
    runtime = Path(os.path.realpath("/tmp")) / f"mx{os.getpid()}"
    runtime.mkdir(mode=0o700, exist_ok=True)
    inventory = shim_host.write_inventory(tmp_path / "hosts.yaml", {"p": shim_host.host_entry(200, persist=30)})
    env = {"DFLASHCTL_INVENTORY": str(inventory), "XDG_RUNTIME_DIR": str(runtime)}
    python = shim_host.host_entry(200)["python"]
    try:
        proc = cli(shim_host, "exec", "p", "--", python, "-c", BIG, env=env)
        assert proc.stdout.read(10) == b"x" * 10
        proc.stdout.close()
        _, err = proc.communicate(timeout=60)
        assert (proc.returncode, err) == (255, b"")
        assert shim_host.run_cli("exec", "p", "--", "true", env=env).returncode == 0  # the mux still serves
    finally:
        shim_host.run_cli("hosts", "disconnect", "--all", env=env)
        subprocess.run(["rm", "-rf", str(runtime)])


def test_logs_follow_into_head_ends_quietly_and_leaves_no_reader(shim_host):
    """`logs tail -f | head` never ended, and logged in again every 0.2 s."""
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    run_id = shim_host.run_cli(
        "train", "shim", "--no-push", "--set", "run.steps=100000", "--set", "standin.lines=50", "--detach"
    ).stdout.strip()
    try:
        wait_until(lambda: (run_dir(workdir, run_id) / "train.log").stat().st_size > 200_000, 60, "log output")
        proc = cli(shim_host, "logs", "tail", "shim", run_id, "-f", "-n", "-1")
        assert proc.stdout.readline().startswith(b"standin: pid")
        proc.stdout.close()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 141 and err == b""
        wait_until(lambda: not readers(workdir), 30, "the remote log reader to end")
    finally:
        shim_host.run_cli("runs", "stop", "shim", run_id)


def test_ctrl_c_prints_interrupted_and_exits_130(shim_host):
    proc = cli(shim_host, "exec", "shim", "--", "sh", "-c", "echo ready; exec sleep 60")
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.decode().strip().splitlines()[-1] == "error: interrupted"


@pytest.mark.parametrize(
    "args, first",
    [
        (["train", "local", "--bogus"], "error: No such option '--bogus'"),
        (["nosuchcommand"], "error: No such command 'nosuchcommand'"),
        (["logs", "tail", "-n", "abc"], "error: Invalid value for '--lines' / '-n'"),
    ],
)
def test_usage_errors_are_one_line_and_a_usage_hint(shim_host, args, first):
    res = shim_host.run_cli(*args)
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 2, res.stderr
    assert lines[0].startswith(first) and lines[1].startswith("usage: dflashctl ") and lines[1].endswith("--help)")
    assert "╭" not in res.stderr  # no boxed panel


def test_no_arguments_show_the_help_once(shim_host):
    """A group without its command prints its help once (typer's help printed itself, and then
    again through click's error) and exits 2, as click does."""
    res = shim_host.run_cli("runs")
    assert res.stdout.count("Usage: dflashctl runs") == 1 and "list" in res.stdout and res.stderr == ""
    assert res.returncode == 2


def into_a_closed_pipe(host, *args: str) -> subprocess.CompletedProcess:
    """The CLI with stdout a pipe whose reader has left before it starts (`| head` that has read
    its lines): its first write fails, whatever the machine's speed."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [*CLI, *args], stdin=subprocess.DEVNULL, stdout=write, stderr=subprocess.PIPE, env=host.env, timeout=120
        )
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [["hosts", "list"], ["--help"], ["runs"], ["runs", "list", "local"]])
def test_a_table_or_help_into_a_closed_pipe_ends_quietly_with_141(shim_host, args):
    """click and rich each turned a closed pipe into a bare exit 1 (rich: `hosts list | head -1`);
    docs/cli.md promises 141, quietly."""
    res = into_a_closed_pipe(shim_host, *args)
    assert (res.returncode, res.stderr) == (141, b"")


def test_a_table_to_a_full_disk_is_one_line_and_141(shim_host):
    """`hosts list > /dev/full` was an internal error."""
    with open("/dev/full", "wb") as full:
        res = subprocess.run(
            [*CLI, "hosts", "list"], stdout=full, stderr=subprocess.PIPE, env=shim_host.env, timeout=120
        )
    assert (res.returncode, res.stderr.decode()) == (141, "error: cannot write to stdout: No space left on device\n")


def test_a_reader_that_leaves_midway_through_a_write_is_a_closed_pipe():
    """`inspect ... | head -1` exited 0 with its output cut where PYTHONUNBUFFERED is set (docker
    images often set it): sys.stdout.buffer is then the raw file, whose write into a pipe whose
    reader leaves midway returns the part written, and the rest was dropped. The reader here takes
    1,000 bytes and leaves while the 1 MB write waits on the full pipe, whatever the machine's speed."""
    import threading

    from dflashctl.errors import OutputClosed
    from dflashctl.output import write_out

    read, write = os.pipe()

    def head() -> None:
        os.read(read, 1000)
        os.close(read)

    reader = threading.Thread(target=head)
    reader.start()
    with os.fdopen(write, "wb", buffering=0) as stream, pytest.raises(OutputClosed) as caught:
        write_out(stream, b"x" * (1 << 20))
    reader.join()
    assert caught.value.quiet  # a closed pipe: the command ends quietly with 141
