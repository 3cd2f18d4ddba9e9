"""`dflashctl push` end to end: on `local`, and through real sshd + the pct shim.

Only the transport is wrapped (to count remote commands and stdin bytes); everything it
carries runs for real: sshd, the pct shim, the remote script, the filesystem.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Iterator, Sequence

import pytest
from runs_helpers import wait_until
from sshd import CLI, SHIM_VMID, CuttingRelay, SshdHost

from dflashctl.containers import Target
from dflashctl.errors import ConnectError, RemoteError
from dflashctl.inventory import HostSpec
from dflashctl.payload import DEFAULT_IGNORES, DefaultIgnores, push
from dflashctl.transport import LocalTransport, Process, Transport

SUMMARY = re.compile(r"^pushed \d+ files? \([^)]+\), deleted \d+, unchanged \d+ in \d+\.\d s$")

# Relative path -> (content, mode); every one must arrive byte-exact with its mode.
PAYLOAD = {
    "train.py": (b"print('train v1')\n", 0o644),
    "run.sh": (b"#!/bin/sh\necho run\n", 0o755),
    "pkg/__init__.py": (b"", 0o644),
    "pkg/mod.py": (os.urandom(100_000), 0o644),
    "data/with space.txt": (b"spaces\n", 0o644),
    'data/it\'s "quoted".txt': (b"quotes\n", 0o600),
    "data/ünïcødé 名前.txt": ("non-ascii ✓\n".encode(), 0o644),
    "data/$(touch pwned);`id`.txt": (b"hostile\n", 0o644),
    ".dflashignore": (b"*.log\nsecret/\n", 0o644),
}
# Present locally, never sent: .dflashignore patterns and the built-in defaults.
IGNORED = [
    "out.log",
    "secret/key",
    "__pycache__/m.cpython-311.pyc",
    "pkg/__pycache__/x.pyc",
    "pkg/y.pyc",
    ".git/HEAD",
    "build/lib/x.py",
    "dist/x.whl",
    "dflash.egg-info/PKG-INFO",
]
BIG_FILES = 4
BIG_SIZE = 8 * 1024 * 1024  # 32 MB in all: long enough to interrupt mid-stream


class Recorder(Transport):
    """Wraps a real transport and records each command and the stdin bytes it is fed."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.name = inner.name
        self.commands: list[list[str]] = []
        self.stdin_bytes = 0

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Process:
        self.commands.append(list(argv))
        proc = self.inner.start(argv, env)
        proc.stdin = _CountingWriter(proc.stdin, self)
        return proc

    def reset(self) -> None:
        self.commands.clear()
        self.stdin_bytes = 0


class _CountingWriter:
    def __init__(self, inner: IO[bytes], recorder: Recorder):
        self.inner, self.recorder = inner, recorder

    def write(self, data: bytes) -> int:
        self.recorder.stdin_bytes += len(data)
        return self.inner.write(data)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


def write_tree(root: Path, files: dict[str, tuple[bytes, int]]) -> None:
    for rel, (data, mode) in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)


def read_tree(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under root (following the payload symlink) as (content, mode bits)."""
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            out[path.relative_to(root).as_posix()] = (path.read_bytes(), path.stat().st_mode & 0o7777)
    return out


def payload_dir(target: Target) -> Path:
    """The remote payload as seen from this machine (shim containers are local directories)."""
    return Path(target.host.workdir) / "payload"


def staging_leftovers(target: Target) -> list[str]:
    store = Path(target.host.workdir) / ".payload"
    return sorted(p.name for p in store.iterdir() if p.name.startswith(("stage-", "link-")))


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    write_tree(root, PAYLOAD)
    write_tree(root, {rel: (b"ignored\n", 0o644) for rel in IGNORED})
    return root


@pytest.fixture(params=["local", "shim"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """A Target whose transport is recorded: `local` (subprocess) or `shim` (sshd + pct 200)."""
    if request.param == "local":
        host = HostSpec(name="local", transport="local", workdir=str(tmp_path / "work"))
        yield Target(host, Recorder(LocalTransport()))
        return
    sshd: SshdHost = request.getfixturevalue("shim_host")
    with sshd.session() as session:
        host = session.host("shim")
        yield Target(host, Recorder(session.transport(host)))


def recorder(target: Target) -> Recorder:
    assert isinstance(target.transport, Recorder)
    return target.transport


def test_first_push_then_noop(target: Target, source: Path) -> None:
    first = push(target, source)
    assert (first.files_sent, first.deleted, first.unchanged) == (len(PAYLOAD), 0, 0)
    assert first.bytes_sent == sum(len(data) for data, _ in PAYLOAD.values())
    assert first.remote_dir == str(payload_dir(target))
    assert read_tree(payload_dir(target)) == PAYLOAD
    assert not (Path(target.host.workdir) / "pwned").exists()

    recorder(target).reset()
    again = push(target, source)
    assert (again.files_sent, again.bytes_sent, again.deleted, again.unchanged) == (0, 0, 0, len(PAYLOAD))
    assert len(recorder(target).commands) <= 2 and again.remote_commands <= 2  # in fact 1
    assert recorder(target).stdin_bytes == 0  # no file content (nor anything else) went out
    assert again.manifest_hash == first.manifest_hash


def test_change_delete_mode_and_new_file(target: Target, source: Path) -> None:
    push(target, source)
    (source / "train.py").write_bytes(b"print('train v2')\n")
    (source / "data/with space.txt").unlink()
    (source / "pkg/mod.py").chmod(0o755)  # same bytes, new mode: must still change remotely
    write_tree(source, {"new dir/ä 'x'.py": (b"new\n", 0o644)})
    recorder(target).reset()

    result = push(target, source)
    assert sorted(result.sent_paths) == ["new dir/ä 'x'.py", "pkg/mod.py", "train.py"]
    assert result.deleted_paths == ["data/with space.txt"]
    assert result.unchanged == len(PAYLOAD) - 3
    # Only the three sent files' bytes (plus a small header) crossed; unchanged files did not.
    assert result.bytes_sent <= recorder(target).stdin_bytes < result.bytes_sent + 16 * 1024
    expected = dict(PAYLOAD)
    del expected["data/with space.txt"]
    expected["train.py"] = (b"print('train v2')\n", 0o644)
    expected["pkg/mod.py"] = (PAYLOAD["pkg/mod.py"][0], 0o755)
    expected["new dir/ä 'x'.py"] = (b"new\n", 0o644)
    assert read_tree(payload_dir(target)) == expected


def test_dflashignore_change_deletes_remotely(target: Target, source: Path) -> None:
    push(target, source)
    (source / ".dflashignore").write_bytes(b"*.log\nsecret/\ndata/\n")
    result = push(target, source)
    assert len(result.deleted_paths) == 4 and all(p.startswith("data/") for p in result.deleted_paths)
    assert not (payload_dir(target) / "data").exists()


def test_dry_run_changes_nothing(target: Target, source: Path) -> None:
    preview = push(target, source, dry_run=True)
    assert sorted(preview.sent_paths) == sorted(PAYLOAD) and len(recorder(target).commands) == 1
    assert not payload_dir(target).exists()

    push(target, source)
    (source / "train.py").unlink()
    recorder(target).reset()
    preview = push(target, source, dry_run=True)
    assert (preview.sent_paths, preview.deleted_paths) == ([], ["train.py"])
    assert len(recorder(target).commands) == 1 and recorder(target).stdin_bytes == 0
    assert (payload_dir(target) / "train.py").exists()


def test_remote_edit_is_detected_and_repaired(target: Target, source: Path) -> None:
    push(target, source)
    (payload_dir(target) / "train.py").write_bytes(b"edited on the host\n")
    result = push(target, source)
    assert result.sent_paths == ["train.py"]
    assert read_tree(payload_dir(target)) == PAYLOAD


def test_next_push_cleans_leftovers(target: Target, source: Path) -> None:
    push(target, source)
    store = Path(target.host.workdir) / ".payload"
    write_tree(store / "stage-dead", {"half.bin": (b"x" * 1000, 0o644)})
    (store / "link-dead").symlink_to(".payload/v/dead")
    write_tree(store / "v" / "dead", {"old.py": (b"", 0o644)})
    result = push(target, source)
    assert result.files_sent == 0
    assert staging_leftovers(target) == [] and not (store / "v" / "dead").exists()
    assert read_tree(payload_dir(target)) == PAYLOAD


# --- CLI and errors (real sshd + shim) ----------------------------------------------------------


def test_cli_prints_one_summary_line(shim_host: SshdHost, source: Path) -> None:
    done = shim_host.run_cli("push", "shim", "--source", str(source))
    assert done.returncode == 0, done.stderr
    assert SUMMARY.match(done.stdout.strip()), done.stdout
    assert done.stdout.startswith(f"pushed {len(PAYLOAD)} files (")


def test_cli_dry_run_lists_changes(shim_host: SshdHost, source: Path) -> None:
    with shim_host.session() as session:
        push(session.target("shim"), source)
    (source / "train.py").write_bytes(b"v2\n")
    (source / "run.sh").unlink()
    done = shim_host.run_cli("push", "shim", "--dry-run", "--source", str(source))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["send    train.py", "delete  run.sh"] and len(lines) == 3
    assert lines[2] == f"would push 1 file (3 bytes), would delete 1, unchanged {len(PAYLOAD) - 2}"  # one tense


def test_push_to_runtime_none_over_ssh(shim_host: SshdHost, source: Path, tmp_path: Path) -> None:
    inventory = shim_host.write_inventory(
        tmp_path / "hosts.yaml", {"plain": shim_host.host_entry(None, workdir=str(tmp_path / "plain"))}
    )
    done = shim_host.run_cli("push", "plain", "--source", str(source), env={"DFLASHCTL_INVENTORY": str(inventory)})
    assert done.returncode == 0, done.stderr
    assert read_tree(tmp_path / "plain" / "payload") == PAYLOAD


@pytest.mark.parametrize(
    ("host", "python", "message"),
    [
        ("stopped", None, "container 201 is not running"),
        ("nopy", "/nonexistent/python3", "`/nonexistent/python3` not found"),
    ],
)
def test_unusable_container_is_one_line_exit_4(
    shim_host: SshdHost, source: Path, tmp_path: Path, host: str, python: str | None, message: str
) -> None:
    extra = {"nopy": shim_host.host_entry(SHIM_VMID, python=python)} if python else {}
    inventory = shim_host.write_inventory(tmp_path / "hosts.yaml", extra)
    done = shim_host.run_cli("push", host, "--source", str(source), env={"DFLASHCTL_INVENTORY": str(inventory)})
    assert done.returncode == 4
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


# --- interrupted pushes --------------------------------------------------------------------------


def make_big(source: Path) -> dict[str, tuple[bytes, int]]:
    """Add BIG_FILES random files to source, so a push takes long enough to interrupt; return v2."""
    big = {f"big/blob{i}.bin": (os.urandom(BIG_SIZE), 0o644) for i in range(BIG_FILES)}
    write_tree(source, big)
    return {**PAYLOAD, **big}


class Watcher(threading.Thread):
    """Checks, until stopped, that the live payload stays complete and readable while a push runs."""

    def __init__(self, workdir: Path):
        super().__init__(daemon=True)
        self.workdir = workdir
        self.stop = threading.Event()
        self.old_payload_readable = True

    def run(self) -> None:
        while not self.stop.is_set():
            if (self.workdir / "payload" / "train.py").read_bytes() != PAYLOAD["train.py"][0]:
                self.old_payload_readable = False
            time.sleep(0.005)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


@pytest.fixture
def cut_host(shim_host: SshdHost, tmp_path: Path):  # type: ignore[no-untyped-def]
    """The shim container through a relay that drops the connection once 2 MB have gone to sshd
    (mid-way through make_big's 32 MB): (env for the CLI, inventory, home, relay)."""
    relay = CuttingRelay(shim_host.port, after=2 * 1024 * 1024)
    home = shim_host.make_home(tmp_path / "home")
    inventory = shim_host.write_inventory(
        tmp_path / "hosts.yaml", {"cut": relay.host_entry(shim_host, home, SHIM_VMID)}
    )
    env = {**shim_host.env, "HOME": str(home), "DFLASHCTL_INVENTORY": str(inventory)}
    try:
        yield env, inventory, home, relay
    finally:
        relay.close()


def test_dropped_ssh_connection_keeps_old_payload(shim_host: SshdHost, source: Path, cut_host) -> None:
    _, inventory, home, relay = cut_host
    with shim_host.session() as session:
        target = session.target("shim")
        push(target, source)
        workdir = Path(target.host.workdir)
    v2 = make_big(source)
    watcher = Watcher(workdir)
    watcher.start()
    with shim_host.session(home=home, inventory=inventory) as session:
        with pytest.raises(ConnectError) as caught:
            push(session.target("cut"), source)
    watcher.stop.set()
    watcher.join()
    assert relay.cut.is_set() and watcher.old_payload_readable
    assert "lost" in str(caught.value) and "\n" not in str(caught.value)
    assert read_tree(workdir / "payload") == PAYLOAD

    with shim_host.session() as session:
        result = push(session.target("shim"), source)
    assert result.files_sent == BIG_FILES and staging_leftovers(target) == []
    assert read_tree(workdir / "payload") == v2


def test_cli_reports_dropped_connection_in_one_line(shim_host: SshdHost, source: Path, cut_host) -> None:
    env, _, _, relay = cut_host
    with shim_host.session() as session:
        push(session.target("shim"), source)
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    make_big(source)
    watcher = Watcher(workdir)
    watcher.start()
    proc = subprocess.run(
        [*CLI, "push", "cut", "--source", str(source)],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    watcher.stop.set()
    watcher.join()
    assert relay.cut.is_set() and watcher.old_payload_readable
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    err = proc.stderr
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "lost" in err, err
    assert read_tree(workdir / "payload") == PAYLOAD


STALL = """
import os, signal, subprocess, sys
after, pidfile, real = int(sys.argv[1]), sys.argv[2], sys.argv[3]
with open(pidfile, "w") as fh:
    fh.write(str(os.getpid()))
child = subprocess.Popen([real, *sys.argv[4:]], stdin=subprocess.PIPE)
passed = 0
while passed < after and (data := os.read(0, 65536)):
    child.stdin.write(data)
    child.stdin.flush()
    passed += len(data)
if passed < after:
    child.stdin.close()
    sys.exit(child.wait())
signal.pause()  # the stream stalls here, until this wrapper is killed
"""


def stalling_python(tmp_path: Path, after: int) -> tuple[Path, Path]:
    """An interpreter for a host entry whose stdin stops after `after` bytes: the remote end of a
    push stalls there (the client blocks mid-stream, whatever the machine's speed) until the
    wrapper is killed, which ends the receiver's stdin. (its path, the file with the wrapper's pid)"""
    import sys

    script, pidfile, wrapper = tmp_path / "stall.py", tmp_path / "stall.pid", tmp_path / "python-stall"
    script.write_text(STALL)
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -S {script} {after} {pidfile} {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, pidfile


def staged_bytes(workdir: Path) -> int:
    """Bytes in the push's staging directories."""
    return sum(
        _size(Path(d) / n)
        for stage in (workdir / ".payload").glob("stage-*")
        for d, _, ns in os.walk(stage)
        for n in ns
    )


@pytest.mark.parametrize("kind", ["shim", "local"])
def test_killed_client_keeps_old_payload(shim_host: SshdHost, source: Path, tmp_path: Path, kind: str) -> None:
    """The client killed mid-stream (its stream stalled after 2 of 32 MB, so the kill cannot come
    too late): the old payload stays whole and readable, and the next push finishes the job."""
    stall, pidfile = stalling_python(tmp_path, after=2 * 1024 * 1024)
    local = {"transport": "local", "workdir": str(tmp_path / "work")}
    hosts = {
        "loc": local,
        "locstall": {**local, "python": str(stall)},
        "shimstall": shim_host.host_entry(200, python=str(stall)),
    }
    inventory = shim_host.write_inventory(tmp_path / "hosts.yaml", hosts)
    host = "loc" if kind == "local" else "shim"
    with shim_host.session(inventory=inventory) as session:
        target = session.target(host)
        push(target, source)  # in-process: the subprocess below is the one that gets killed
    workdir = Path(target.host.workdir)
    v2 = make_big(source)
    watcher = Watcher(workdir)
    watcher.start()
    proc = subprocess.Popen(
        [*CLI, "push", f"{host}stall" if kind == "local" else "shimstall", "--source", str(source)],
        env={**shim_host.env, "DFLASHCTL_INVENTORY": str(inventory)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: staged_bytes(workdir) >= 1024 * 1024, 60, "the push to stage 1 MB")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)  # the receiver's stdin ends: it discards its staging
    watcher.stop.set()
    watcher.join()
    assert watcher.old_payload_readable and read_tree(workdir / "payload") == PAYLOAD
    wait_until(lambda: staging_leftovers(target) == [], 60, "the receiver to discard its staging")

    with shim_host.session(inventory=inventory) as session:
        result = push(session.target(host), source)
    assert result.files_sent == BIG_FILES and read_tree(workdir / "payload") == v2
    assert staging_leftovers(target) == []


# --- a full disk (a tiny tmpfs; needs root, skipped elsewhere) ----------------------------------


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs with 40 inodes, so both bytes and inodes can run out."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,nr_inodes=40", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_full_disk_keeps_old_payload(tiny_disk: Path, source: Path) -> None:
    target = Target(HostSpec(name="local", transport="local", workdir=str(tiny_disk / "work")), LocalTransport())
    push(target, source)
    write_tree(source, {"big.bin": (os.urandom(5_000_000), 0o644)})
    with pytest.raises(RemoteError, match=r"not enough space .* need 5\.0 MB"):
        push(target, source)  # refused before sending anything

    (source / "big.bin").unlink()
    write_tree(source, {f"many/f{i}.py": (b"x", 0o644) for i in range(40)})
    with pytest.raises(RemoteError, match="no space left on device") as caught:
        push(target, source)  # bytes fit, inodes do not: fails mid-staging
    assert "previous payload is unchanged" in str(caught.value)
    assert read_tree(payload_dir(target)) == PAYLOAD and staging_leftovers(target) == []


def test_failed_first_push_claims_no_previous_payload(source: Path, tmp_path: Path) -> None:
    # A workdir under a regular file cannot be created: the push fails with no payload ever there.
    (tmp_path / "file").write_bytes(b"")
    target = Target(
        HostSpec(name="local", transport="local", workdir=str(tmp_path / "file" / "work")), LocalTransport()
    )
    with pytest.raises(RemoteError) as caught:
        push(target, source)
    assert str(caught.value).endswith("(any previous payload is unchanged)")


def test_version_in_use_by_a_process_survives_later_pushes(source: Path, tmp_path: Path) -> None:
    target = Target(HostSpec(name="local", transport="local", workdir=str(tmp_path / "work")), LocalTransport())
    push(target, source)
    version = payload_dir(target).resolve()  # what `train` runs in: the version, not the link
    runner = subprocess.Popen(["sleep", "60"], cwd=version)
    try:
        for text in (b"v2\n", b"v3\n", b"v4\n"):
            (source / "train.py").write_bytes(text)
            push(target, source)
        assert version.is_dir() and (version / "train.py").read_bytes() == PAYLOAD["train.py"][0]
    finally:
        runner.kill()
        runner.wait()
    push(target, source)  # nothing to send, but the cleanup runs
    assert not version.exists()
    assert len(list((Path(target.host.workdir) / ".payload" / "v").iterdir())) == 2  # live + previous


def test_default_ignores_match_as_pathspec_does():
    """Without a .dflashignore push skips importing pathspec; its own matcher must agree with it."""
    import pathspec

    reference, ours = pathspec.GitIgnoreSpec.from_lines(list(DEFAULT_IGNORES)), DefaultIgnores()
    names = [
        "__pycache__",
        "a.pyc",
        ".git",
        "build",
        "dist",
        "x.egg-info",
        "build.py",
        "mybuild",
        "a.pyco",
        ".gitignore",
        "egg-info",
        "Build",
        "a.PYC",
        "x.pyc.txt",
        "[b]",
        "a b",
        "ü.pyc",
        ".pyc",
    ]
    checked = 0
    for depth in range(3):
        for parents in itertools.product(["pkg", "build", "a.pyc", "x.egg-info"], repeat=depth):
            for name, slash in itertools.product(names, ("", "/")):
                rel = "/".join([*parents, name]) + slash
                assert ours.match_file(rel) == reference.match_file(rel), rel
                checked += 1
    assert checked == 2 * len(names) * (1 + 4 + 16)
