"""Connection reuse across CLI calls (`persist:`): the background mux, through real sshd + pct shim."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from dflashctl.errors import ContainerError, UsageError
from dflashctl.inventory import DEFAULT_PERSIST_S, parse_inventory
from dflashctl.mux import MuxUnavailable, mux_stats, socket_path, stop_all_muxes
from runs_helpers import alive, wait_until
from sshd import CLI, ECHO_BOTH, MB, run_concurrently, run_together

from test_quoting import PRINT_ARGS, arguments


def _mux_pids(runtime: Path) -> list[int]:
    """Mux processes serving sockets under runtime (their config argument names the path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not alive(int(entry.name)):
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dflashctl.mux_server" in cmd and any(str(runtime).encode() in part for part in cmd):
            pids.append(int(entry.name))
    return pids


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


class Mux:
    """The test's view: hosts with persist on, a private runtime dir, and CLI/in-process helpers."""

    def __init__(self, shim_host, tmp_path: Path, runtime: Path):
        self.sshd = shim_host
        self.runtime = runtime
        extra = {
            "p": shim_host.host_entry(200, persist=30),
            "pstopped": shim_host.host_entry(201, persist=30),
            "pbare": shim_host.host_entry(None, persist=30),
            "pshort": shim_host.host_entry(None, persist=1),
        }
        self.inventory = shim_host.write_inventory(tmp_path / "hosts.yaml", extra)
        self.env = {"DFLASHCTL_INVENTORY": str(self.inventory), "XDG_RUNTIME_DIR": str(runtime)}
        self.hosts = parse_inventory(self.inventory.read_text(), self.inventory).hosts

    def cli(self, *args: str, env: dict | None = None, **kw):  # type: ignore[no-untyped-def]
        return self.sshd.run_cli(*args, env={**self.env, **(env or {})}, **kw)

    def stats(self, name: str) -> dict | None:
        return mux_stats(self.hosts[name])

    def session(self):  # type: ignore[no-untyped-def]
        return self.sshd.session(inventory=self.inventory)


@pytest.fixture
def mux(shim_host, tmp_path, monkeypatch):
    """Persist hosts + a short private XDG_RUNTIME_DIR; stops every mux after and checks none is left."""
    yield from _muxes(shim_host, tmp_path, monkeypatch)


@pytest.fixture
def few_mux(few_sessions_host, tmp_path, monkeypatch):
    """The same on the sshd that allows only 3 sessions per connection."""
    few_sessions_host.reset()
    yield from _muxes(few_sessions_host, tmp_path, monkeypatch)


def _muxes(shim_host, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    runtime = Path(tempfile.mkdtemp(prefix="mx", dir="/tmp"))
    runtime.chmod(0o700)
    # in-process helpers compute the same socket names as the CLI subprocesses
    monkeypatch.setenv("HOME", str(shim_host.home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    helper = Mux(shim_host, tmp_path, runtime)
    try:
        yield helper
    finally:
        for path in (runtime, runtime / "dflashctl"):
            if path.exists():
                path.chmod(0o700)
        for sock in (runtime / "dflashctl").glob("*.sock"):
            sock.chmod(0o600)
        stop_all_muxes()
        leftover = [pid for pid in _mux_pids(runtime) if not _gone(pid, 5)]
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(runtime)])
        assert not leftover, f"mux processes left behind: {leftover}"


def test_persist_is_validated():
    def host(value: str) -> str:
        with pytest.raises(UsageError) as info:
            parse_inventory(f"hosts:\n  gpu1:\n    address: h\n    persist: {value}\n")
        return str(info.value)

    assert host("-1") == "hosts.yaml: host 'gpu1': persist must be a non-negative integer (seconds; 0 = off), got -1"
    assert "got 'abc'" in host("abc")
    assert "got True" in host("true")
    assert "got 1.5" in host("1.5")
    inv = parse_inventory("hosts:\n  gpu1:\n    address: h\n    persist: 600\n  gpu2:\n    address: h\n")
    assert (inv.hosts["gpu1"].persist, inv.hosts["gpu2"].persist) == (600, DEFAULT_PERSIST_S) == (600, 60)
    assert parse_inventory("hosts:\n  box:\n    transport: local\n").hosts["box"].persist == 0
    assert parse_inventory("hosts:\n  gpu1:\n    address: h\n    persist: 0\n").hosts["gpu1"].persist == 0
    with pytest.raises(UsageError, match="persist only applies to transport ssh"):
        parse_inventory("hosts:\n  box:\n    transport: local\n    persist: 5\n")


def test_two_cli_calls_reuse_one_connection(mux):
    first = mux.cli("exec", "p", "--", "sh", "-c", 'echo "out $HOME"; echo err >&2; exit 7')
    assert (first.returncode, first.stdout, first.stderr) == (7, f"out {mux.sshd.container_dir(200)}\n", "err\n")
    before = mux.stats("p")
    second = mux.cli("exec", "p", "--", "sh", "-c", "cat; exit 3", input="piped\n")
    assert (second.returncode, second.stdout, second.stderr) == (3, "piped\n", "")
    after = mux.stats("p")
    assert before["pid"] == after["pid"] and after["connects"] == 1
    assert after["channels"] == before["channels"] + 1
    assert len(_mux_pids(mux.runtime)) == 1


def test_client_does_not_import_paramiko(mux):
    code = (
        "import sys\n"
        "sys.argv = ['dflashctl', 'exec', 'pbare', '--', 'echo', 'ok']\n"
        "from dflashctl.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "print('paramiko' in sys.modules, code, file=sys.stderr)\n"
    )
    mux.cli("exec", "pbare", "--", "true")  # the mux is up
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**mux.sshd.env, **mux.env})  # fmt: skip
    assert result.stdout == "ok\n"
    assert result.stderr.split() == ["False", "0"]


@given(arguments)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_hostile_arguments_round_trip_through_the_mux(mux, args):
    with mux.session() as session:
        result = session.target("p").run([*PRINT_ARGS, *args])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == b"".join(a.encode() + b"\0" for a in args)


def test_20mb_both_ways_and_concurrent_channels(mux):
    payload = hashlib.sha256(b"mux").digest() * (20 * MB // 32)
    with mux.session() as session:
        target = session.target("p")
        result = target.run([sys.executable, "-c", ECHO_BOTH], stdin=payload, timeout=120)
        assert result.exit_code == 0
        assert result.stdout == payload and result.stderr == payload
        results = run_concurrently(target)
    assert [(r.exit_code, r.text()) for r in results] == [(i, f"{i}\n") for i in range(8)]


def test_commands_beyond_max_sessions_overflow_to_more_connections(few_mux, tmp_path):
    """That sshd allows 3 sessions per connection: 8 commands at once through one mux all succeed
    (before, 5 failed with `the server refused a new session`) on extra connections that the mux
    closes when their commands have ended."""
    with few_mux.session() as session:
        results = run_together(session.target("pbare"), 8, tmp_path)
        assert [(r.exit_code, r.text()) for r in results] == [(0, f"{i}\n") for i in range(8)]
        stats = lambda: mux_stats(few_mux.hosts["pbare"], session.ssh_options)  # noqa: E731
        first = stats()
        assert first["connects"] >= 3  # 8 sessions at 3 per connection
        wait_until(lambda: stats()["overflow"] == 0, 30, "the overflow connections to close")
        assert session.target("pbare").run(["echo", "again"]).text() == "again\n"
        assert stats()["pid"] == first["pid"]


def test_concurrent_cli_calls_start_one_mux(mux):
    with ThreadPool() as pool:
        outs = pool.map(lambda i: mux.cli("exec", "pbare", "--", "echo", str(i)), range(5))
    assert [(o.returncode, o.stdout) for o in outs] == [(0, f"{i}\n") for i in range(5)]
    assert len(_mux_pids(mux.runtime)) == 1
    assert mux.stats("pbare")["connects"] == 1


class ThreadPool:
    def __enter__(self):  # type: ignore[no-untyped-def]
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(8)
        return self.pool

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown()


def test_stopped_container_gives_the_one_line_error(mux):
    result = mux.cli("exec", "pstopped", "--", "true")
    assert result.returncode == 4
    assert result.stderr.strip() == "error: pstopped: container 201 is not running (start it with `pct start 201`)"
    with mux.session() as session, pytest.raises(ContainerError, match="container 201 is not running"):
        session.target("pstopped").run(["true"])


def test_mux_exits_after_its_idle_time(mux):
    assert mux.cli("exec", "pshort", "--", "true").returncode == 0
    pid = mux.stats("pshort")["pid"]
    assert _gone(pid, 5)
    assert not socket_path(mux.hosts["pshort"], None).exists()


def test_killed_mux_leaves_a_stale_socket_that_is_replaced(mux):
    assert mux.cli("exec", "pbare", "--", "true").returncode == 0
    pid = mux.stats("pbare")["pid"]
    os.kill(pid, signal.SIGKILL)
    assert _gone(pid, 5)
    path = socket_path(mux.hosts["pbare"], None)
    assert path.exists() and mux.stats("pbare") is None  # stale: connect refused
    again = mux.cli("exec", "pbare", "--", "echo", "back")
    assert (again.returncode, again.stdout) == (0, "back\n")
    assert mux.stats("pbare")["pid"] != pid


def test_dropped_connection_fails_the_command_and_the_next_call_gets_a_new_mux(mux):
    assert mux.cli("exec", "p", "--", "true").returncode == 0
    old = mux.stats("p")["pid"]
    proc = subprocess.Popen(
        [*CLI, "exec", "p", "--", "sh", "-c", "echo tick; sleep 30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**mux.sshd.env, **mux.env},
    )
    try:
        assert proc.stdout.readline() == b"tick\n"
        assert mux.sshd.kill_connections() >= 1
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3
    # The guard's stop cannot reach the host either: the line says what may be left there.
    assert err.decode().strip() == "error: connection to p lost; the command may still run on p (pct 200)"
    assert _gone(old, 5)
    again = mux.cli("exec", "p", "--", "echo", "again")
    assert (again.returncode, again.stdout) == (0, "again\n")
    stats = mux.stats("p")
    assert stats["pid"] != old and stats["connects"] == 1


def test_unsafe_socket_dir_is_refused_and_the_call_goes_direct(mux):
    assert mux.cli("exec", "pbare", "--", "true").returncode == 0
    pid = mux.stats("pbare")["pid"]
    assert mux.cli("hosts", "disconnect", "pbare").stdout.strip() == "pbare: connection closed"
    assert _gone(pid, 5)  # the mux removes its socket as it exits, after disconnect has answered
    directory = mux.runtime / "dflashctl"
    directory.chmod(0o755)
    with pytest.raises(MuxUnavailable, match="mode 0700"):
        socket_path(mux.hosts["pbare"], None)
    result = mux.cli("--debug", "exec", "pbare", "--", "echo", "direct")
    assert (result.returncode, result.stdout) == (0, "direct\n")
    assert not list(directory.glob("*.sock")) and not _mux_pids(mux.runtime)


def test_hosts_disconnect(mux):
    assert mux.cli("exec", "p", "--", "true").returncode == 0
    assert mux.cli("exec", "pbare", "--", "true").returncode == 0
    pid = mux.stats("p")["pid"]
    assert mux.cli("hosts", "disconnect", "p").stdout.strip() == "p: connection closed"
    assert _gone(pid, 5) and mux.stats("p") is None
    assert mux.cli("hosts", "disconnect", "p").stdout.strip() == "p: no persistent connection"
    assert mux.cli("hosts", "disconnect", "--all").stdout.strip() == "closed 1 connection(s): pbare"
    assert not _mux_pids(mux.runtime) or all(_gone(p, 5) for p in _mux_pids(mux.runtime))
    assert mux.cli("hosts", "disconnect", "shim").stdout.strip() == "shim: no persistent connection"


def test_in_process_connect_error_is_relayed(mux, tmp_path):
    """A mux that cannot connect reports the direct transport's message (here: unknown host key)."""
    home = mux.sshd.make_home(tmp_path / "untrusted", trusted=False)
    result = mux.cli("exec", "pbare", "--", "true", env={"HOME": str(home)})
    assert result.returncode == 3
    assert "unknown host key" in result.stderr and "dflashctl hosts trust pbare" in result.stderr


@pytest.mark.skipif(os.getuid() != 0 or not Path("/usr/bin/python3").exists(), reason="needs root and a system python3")
def test_mux_serves_only_its_own_uid(mux):
    """SO_PEERCRED: even with the directory and socket opened up, another uid gets no answer."""
    assert mux.cli("exec", "pbare", "--", "true").returncode == 0
    path = socket_path(mux.hosts["pbare"], None)
    for p in (mux.runtime, path.parent):
        p.chmod(0o711)
    path.chmod(0o777)
    probe = (
        "import socket, struct, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "try:\n"
        "    s.sendall(struct.pack('!cI', b'Q', 0)); s.settimeout(10)\n"
        "    print('answer' if s.recv(100) else 'hung up')\n"
        "except (BrokenPipeError, ConnectionResetError):\n    print('hung up')\n"
    )
    result = subprocess.run(["/usr/bin/python3", "-c", probe, str(path)], capture_output=True, text=True, timeout=30,
                            user=65534, group=65534)  # fmt: skip
    assert result.returncode == 0, result.stderr  # it could connect...
    assert result.stdout.strip() == "hung up"  # ...but got no answer
    path.chmod(0o600)
    path.parent.chmod(0o700)
    assert mux.stats("pbare")["pid"]  # the owner is still served


def test_a_bad_identity_file_is_named_with_the_inventory_file_through_the_mux(mux, tmp_path):
    """The mux connects in its own process: its identity_file error names the file and host as a
    direct connection's does (it said `hosts.yaml:` for any inventory file)."""
    missing = tmp_path / "no-such-key"
    inventory = mux.sshd.write_inventory(
        tmp_path / "other.yaml", {"k": mux.sshd.host_entry(200, persist=30, identity_file=str(missing))}
    )
    res = mux.cli("exec", "k", "--", "true", env={"DFLASHCTL_INVENTORY": str(inventory)})
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: {inventory}: host 'k': identity_file {missing}: no such file"
