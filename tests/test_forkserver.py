"""Warm starts: the fork server (remote_payload/dflash_train/forkserver.py) and runctl's client
(dflashctl/remote/runctl/forking.py), with the real trainer at its tiny preset on the CPU.

A forked run must be the plain run it replaces: the same losses, lines, exit codes and stops. Waits
are bounded polls on what the server logs and what the runs record; nothing asserts on timing.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from runs_helpers import alive, meta, run_dir, wait_until
from sshd import CLI

from dflashctl.remote.runctl import forking

REPO = Path(__file__).resolve().parents[1]
STUB = Path(__file__).parent / "shims" / "libcuda_stub.c"
TINY = ["--preset", "tiny", "--set", "run.steps=5"]
LONG = ["--preset", "tiny", "--set", "run.steps=100000"]
SERVE_WAIT_S = 240.0  # a bound for importing torch on a loaded 2-core machine, not an expectation


class Host:
    """A `local` host with a fork server allowed, driven through the CLI as a whole process."""

    def __init__(self, root: Path):
        self.workdir = root / "work"
        self.inventory = root / "hosts.yaml"
        self.inventory.write_text(
            "default: fs\nhosts:\n  fs:\n    transport: local\n"
            f"    workdir: {json.dumps(str(self.workdir))}\n    python: {json.dumps(sys.executable)}\n"
            "    fork_server: 120\n"
        )
        # One environment for every command: a server serves runs whose environment is its own.
        self.env = dict(os.environ, DFLASHCTL_INVENTORY=str(self.inventory), NO_COLOR="1")
        self.cwd = root

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`dflashctl ARGS`: its exit code and output."""
        return subprocess.run(
            [*CLI, *args], capture_output=True, text=True, env=self.env, cwd=self.cwd, timeout=timeout, check=False
        )

    def train(self, *args: str) -> str:
        """A detached run's id (the run must start)."""
        res = self.cli("train", "fs", *args, "--detach")
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    def ended(self, run_id: str) -> int:
        """Wait for the run's exit code."""
        path = run_dir(self.workdir, run_id) / "exit_code"
        wait_until(path.exists, timeout=300, what=f"run {run_id} to end")
        return int(path.read_text())

    def log(self, run_id: str) -> str:
        """The run's train.log."""
        return (run_dir(self.workdir, run_id) / "train.log").read_text(errors="replace")

    def server_logs(self) -> list[Path]:
        """The fork servers' logs."""
        return sorted((self.workdir / "fork-server").glob("*.log"))

    def serving(self) -> int:
        """Wait until this host's (one) fork server serves; its pid."""

        def ready() -> str | None:
            logs = self.server_logs()
            return next((m for m in map(serving_line, logs) if m), None)

        line = wait_until(ready, timeout=SERVE_WAIT_S, what="the fork server to serve")
        return int(re.match(r"fork server (\d+):", line).group(1))

    def forked_run(self) -> tuple[int, str, int]:
        """A first run (it starts the server), then a long one forked and stepping: (server pid,
        the long run's id, its trainer's pid)."""
        self.cli("train", "fs", *TINY, "--follow")
        server = self.serving()
        run_id = self.train(*LONG)
        wait_until(lambda: "step 1" in self.log(run_id) or None, timeout=300, what="a step")
        return server, run_id, meta(self.workdir, run_id)["trainer"]["pid"]


def serving_line(log: Path) -> str | None:
    """The server's `... serving` line, once it has written it."""
    return next((ln for ln in log.read_text().splitlines() if ln.endswith("; serving")), None)


def losses(workdir: Path, run_id: str) -> list[float]:
    """The run's training losses, step by step."""
    path = run_dir(workdir, run_id) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if r.get("event") == "train"]


def trainer_lines(text: str) -> list[str]:
    """A log's lines less the supervisor's and the figures that are timings."""
    kept = [ln for ln in text.splitlines() if ln and not ln.startswith("dflashctl: ")]
    return [re.sub(r"\d+\.\d+ (s|ms|tok/s)\b|\d+ tok/s|in [\d.]+ s", "T", ln) for ln in kept]


def kill_servers(host: Host) -> None:
    """The fork servers of a host must not outlive the test (they would idle out in minutes)."""
    for log in host.server_logs():
        for pid in re.findall(r"^fork server (\d+):", log.read_text(), re.M):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory):
    """A host whose first run started plainly and started the fork server: (host, that run, server pid)."""
    host = Host(tmp_path_factory.mktemp("forkserver"))
    first = host.train(*TINY)
    yield host, first, host.serving()
    kill_servers(host)


def test_a_forked_run_is_the_plain_run_it_replaces(warm):
    host, first, _ = warm
    assert host.ended(first) == 0
    assert meta(host.workdir, first)["start"] == "plain"
    assert "dflashctl: plain start: no fork server was ready; one is starting" in host.log(first)
    second = host.train(*TINY)
    assert host.ended(second) == 0
    assert meta(host.workdir, second)["start"] == "forked"
    assert "dflashctl: warm start: forked by the fork server" in host.log(second)
    assert losses(host.workdir, second) == losses(host.workdir, first)
    plain, forked = (trainer_lines(host.log(r)) for r in (first, second))
    assert [ln.replace(first, "RUN") for ln in plain] == [ln.replace(second, "RUN") for ln in forked]
    assert (run_dir(host.workdir, second) / "export").is_dir()


def test_a_forked_run_stops_and_resumes_as_a_plain_one(warm):
    host, _, server = warm
    run_id = host.train(*LONG)
    wait_until(lambda: "step 1" in host.log(run_id) or None, timeout=300, what="a step")
    res = host.cli("runs", "stop", "fs", run_id)
    assert res.returncode == 0, res.stderr
    assert host.ended(run_id) == 143
    assert meta(host.workdir, run_id)["start"] == "forked"
    assert "continue from its newest checkpoint" in host.log(run_id)
    stopped_at = len(host.log(run_id))
    res = host.cli("train", "fs", "--resume", run_id, "--detach")
    assert res.returncode == 0, res.stderr
    wait_until(lambda: "\nstep " in host.log(run_id)[stopped_at:] or None, timeout=300, what="a step after the resume")
    assert "dflashctl: warm start: forked" in host.log(run_id)[stopped_at:]
    assert host.cli("runs", "stop", "fs", run_id).returncode == 0
    assert host.ended(run_id) == 143
    assert alive(server)  # the server outlives its trainers


def test_a_trainer_outlives_its_server_and_the_lost_exit_code_is_said(tmp_path):
    host = Host(tmp_path)
    try:
        server, run_id, trainer = host.forked_run()
        os.kill(server, signal.SIGKILL)
        wait_until(lambda: not alive(server), timeout=60, what="the server's end")
        assert alive(trainer)
        # The orphaned trainer keeps the server's command line but is no server: nothing to stop.
        assert json.loads(host.cli("hosts", "servers", "fs", "--json").stdout)["servers"] == []
        host.cli("runs", "stop", "fs", run_id)
        assert host.ended(run_id) == 1
        assert "the fork server ended before the trainer it forked: the trainer's exit code is lost" in host.log(run_id)
        again = host.train(*TINY)
        assert host.ended(again) == 0
        assert "plain start: no fork server was ready" in host.log(again)
    finally:
        kill_servers(host)


def test_hosts_servers_lists_the_server_and_a_stop_waits_for_its_runs(tmp_path):
    host = Host(tmp_path)
    try:
        server, run_id, trainer = host.forked_run()
        listed = host.cli("hosts", "servers", "fs")
        assert listed.returncode == 0 and f"{server} serving {trainer}" in " ".join(listed.stdout.split())
        stop = host.cli("hosts", "servers", "fs", "--stop", "--json")
        assert stop.returncode == 0, stop.stderr
        answer = json.loads(stop.stdout)
        (shown,) = answer["servers"]  # the forked trainer, with the server's command line, is not one
        assert (shown["pid"], shown["trainers"], answer["stopped"]) == (server, [trainer], [server])
        assert shown["log"] == str(host.server_logs()[0])
        stopping = "no longer serving: stopped by SIGTERM"
        wait_until(lambda: stopping in host.server_logs()[0].read_text() or None, timeout=60, what="the stop")
        (shown,) = json.loads(host.cli("hosts", "servers", "fs", "--json").stdout)["servers"]
        assert shown["state"] == stopping and alive(server)  # it waits for its trainer
        host.cli("runs", "stop", "fs", run_id)
        assert host.ended(run_id) == 143  # the trainer's own exit code, sent by the stopped server
        wait_until(lambda: not alive(server), timeout=60, what="the server's end")
        assert host.cli("hosts", "servers", "fs").stdout.strip() == "fs: no fork server running"
    finally:
        kill_servers(host)


NO_SIGNALS = {"ignored": [], "blocked": []}  # a client that ignores and blocks no signal


def ask_raw(name: str, request: dict, fds: list[int]) -> tuple[socket.socket, dict]:
    """Send a request to the server `name` by hand: (the connection, its first answer)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect("\0" + name)
    sock.sendmsg([(json.dumps(request) + "\n").encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(
        b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds)))])  # fmt: skip
    return sock, json.loads(sock.makefile("rb").readline())


def server_name(host: Host) -> str:
    """The name of the host's one server (its log's name)."""
    (log,) = [p for p in host.server_logs() if serving_line(p)]
    return log.stem


def test_the_server_forks_only_the_trainer_and_only_on_the_go_ahead(warm):
    host, _, _ = warm
    name = server_name(host)
    payload = os.path.realpath(host.workdir / "payload")
    r, w = os.pipe()
    try:
        other = {"argv": [sys.executable, "-m", "json.tool"], "cwd": payload, "env": {}, **NO_SIGNALS}
        _, answer = ask_raw(name, other, [0, w, w])
        assert answer["refused"].startswith("it runs `python -m dflash_train...`")
        malformed = "malformed request: argv, cwd and env must be strings, ignored and blocked signal numbers"
        for bad in ({"argv": [sys.executable, "-m", 7]}, {"ignored": ["SIGINT"]}, {"blocked": [2.0]}, {"blocked": [0]}):
            _, answer = ask_raw(name, {**other, **bad}, [0, w, w])
            assert answer["refused"] == malformed
        _, answer = ask_raw(name, {"argv": other["argv"], "cwd": payload, "env": {}}, [0, w, w])
        assert answer["refused"] == "malformed request: 'ignored'"
        trainer = {
            "argv": [sys.executable, "-m", "dflash_train", *TINY], "cwd": payload, "env": dict(os.environ), **NO_SIGNALS
        }  # fmt: skip
        sock, answer = ask_raw(name, trainer, [0, w, w])
        # The forked child waits: a trainer running now would print its config within this second.
        assert select.select([r], [], [], 1.0)[0] == []
        sock.close()  # no go-ahead: the child is killed before it runs anything
        wait_until(lambda: not alive(answer["pid"]), timeout=60, what="the unstarted child's end")
        os.close(w)
        w = -1
        assert os.read(r, 1) == b""  # it wrote nothing: the trainer never ran
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert serving_line(host.server_logs()[0])  # the malformed requests did not end it


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_the_server_refuses_another_users_client(warm):
    host, _, _ = warm
    name = server_name(host)
    trainer = {"argv": [sys.executable, "-m", "dflash_train"], "cwd": str(host.workdir), "env": {}, **NO_SIGNALS}
    pid = os.fork()
    if pid == 0:  # another user's client: its exit code says what it was answered
        code = 1
        try:
            os.setuid(65534)
            code = 0 if ask_raw(name, trainer, [0, 1, 2])[1].get("refused") == "the client runs as another user" else 3
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


# A program of the package that shows what a process started as `python -m` has (issue 31: a forked
# run must be the plain run), then exits as told: a code, or a signal (killKILL).
SHOW = """
import json, os, signal, sys
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "path0": sys.path[0], "name": __name__,
    "fds": sorted(os.listdir("/proc/self/fd")), "pgid_is_pid": os.getpgid(0) == os.getpid(),
    "signals": {int(s): str(signal.getsignal(s)) for s in signal.valid_signals()},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
}), flush=True)
how = sys.argv[1]
if how.startswith("kill"):
    os.kill(os.getpid(), getattr(signal, "SIG" + how[4:]))
sys.exit(int(how))
"""
# The supervisor's start of one attempt (runctl/forking.py), its stdout the run's log.
CLIENT = """
import json, signal, sys
from dflashctl.remote.runctl.forking import start_trainer
argv, cwd, env, idle_s, workdir, quiet = json.loads(sys.argv[1])
# quiet: a supervisor started as a shell's background job is (SIGINT ignored), and more; else
# defaults, whatever the test run inherited (the server ignores SIGUSR1 and blocks SIGUSR2).
signal.signal(signal.SIGINT, signal.SIG_IGN if quiet else signal.default_int_handler)
signal.signal(signal.SIGUSR1, signal.SIG_IGN if quiet else signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_SETMASK, [signal.SIGUSR2] if quiet else [])
child, how = start_trainer(argv, cwd, env, idle_s, workdir)
print(json.dumps({"how": how, "code": child.wait()}), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def shown(tmp_path_factory: pytest.TempPathFactory):
    """Run SHOW plainly or forked: (how it started, exit code, what it showed)."""
    root = tmp_path_factory.mktemp("shown")
    payload = root / "payload"
    shutil.copytree(REPO / "remote_payload" / "dflash_train", payload / "dflash_train")
    (payload / "dflash_train" / "show.py").write_text(SHOW)
    # A run's own variable; faulthandler's handlers, installed from C at start-up.
    env = dict(os.environ, DFLASHCTL_REASON_FILE=str(root / "reason"), PYTHONFAULTHANDLER="1")
    argv = [sys.executable, "-m", "dflash_train.show"]
    name = forking.server_name(argv[0], str(payload), env)
    server = start_server(payload, name, root / "server.log", env, idle_s=120, quiet=True)
    wait_until(lambda: said(root / "server.log", "; serving"), timeout=SERVE_WAIT_S, what="the server to serve")

    def run(idle_s: int, how: str, quiet: bool) -> tuple[str, int, dict]:
        with (root / "out").open("wb") as out:
            res = subprocess.run(
                [sys.executable, "-c", CLIENT, json.dumps([[*argv, how], str(payload), env, idle_s, str(root), quiet])],
                stdout=out, stderr=subprocess.PIPE, cwd=root, timeout=120, check=True,
            )  # fmt: skip
        answer = json.loads(res.stderr.splitlines()[-1])
        return answer["how"], answer["code"], json.loads((root / "out").read_text().splitlines()[-1])

    yield run
    server.kill()
    server.wait()


@pytest.mark.parametrize(
    ("how", "code", "quiet"),
    [("0", 0, False), ("3", 3, False), ("killKILL", -9, False), ("killTERM", -15, False), ("0", 0, True)],
)
def test_a_forked_process_has_what_a_plain_one_has_and_ends_as_it_does(shown, how, code, quiet):
    plain, forked = shown(0, how, quiet), shown(120, how, quiet)
    assert (plain[0], forked[0]) == ("plain", "forked")
    assert plain[1] == forked[1] == code
    # argv, cwd, exact environment, sys.path, __main__, fds, session, each signal's disposition, the mask
    assert forked[2] == plain[2]
    assert (plain[2]["signals"][str(int(signal.SIGUSR1))] == str(signal.SIG_IGN)) == quiet
    assert (plain[2]["blocked"] == [int(signal.SIGUSR2)]) == quiet


def start_server(
    cwd: Path, name: str, log: Path, env: dict[str, str], idle_s: float, quiet: bool = False
) -> subprocess.Popen:
    """A fork server started by hand, as runctl starts one; quiet: with SIGUSR1 ignored and SIGUSR2
    blocked, which its children must not keep unless their client has them."""

    def quieted() -> None:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])

    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dflash_train.forkserver", name, "--idle-s", str(idle_s)],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            preexec_fn=quieted if quiet else None,
        )


def said(log: Path, tail: str) -> str | None:
    """The server's start-up line once it ends with `tail`."""
    return next((ln for ln in log.read_text().splitlines() if ln.startswith("fork server") and tail in ln), None)


def test_a_server_whose_preload_started_the_driver_refuses_and_runs_start_plainly(tmp_path):
    """The stand-in driver fails in a child forked from a process that loaded it (LD_PRELOAD: the
    server), as the real one fails after the driver started; without the preload it serves."""
    if shutil.which("cc") is None:
        pytest.fail("cc is missing: .ci/run installs gcc")
    lib = tmp_path / "lib"
    lib.mkdir()
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib / "libcuda.so.1"), str(STUB)], check=True)
    payload = tmp_path / "payload"
    shutil.copytree(REPO / "remote_payload" / "dflash_train", payload / "dflash_train")
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib))
    poisoned = dict(env, LD_PRELOAD=str(lib / "libcuda.so.1"))
    logs = {"ok": tmp_path / "ok.log", "poisoned": tmp_path / "poisoned.log"}
    argv = [sys.executable, "-m", "dflash_train", *TINY]
    servers = [
        start_server(payload, forking.server_name(argv[0], str(payload), env), logs["ok"], env, idle_s=1),
        start_server(payload, forking.server_name(argv[0], str(payload), poisoned), logs["poisoned"], poisoned, 120),
    ]
    try:
        line = wait_until(lambda: said(logs["poisoned"], "refusing"), timeout=SERVE_WAIT_S, what="the self-check")
        assert line.endswith(
            "refusing: the CUDA driver does not start in a child forked after the preload "
            "(cuInit: 3 there, 0 in a new process)"
        )
        with pytest.raises(forking.NoFork, match="the fork server refused: the CUDA driver does not start"):
            forking.ask(argv, str(payload), poisoned, 120, str(tmp_path))
        assert servers[0].wait(timeout=SERVE_WAIT_S) == 0  # served (cuInit 0 in both), then idled out
        assert said(logs["ok"], "; serving")
        assert "idle for 1 s: exiting" in logs["ok"].read_text()
    finally:
        for server in servers:
            server.kill()
            server.wait()


def test_a_module_changed_on_disk_ends_the_service_and_frees_the_name(tmp_path):
    payload = tmp_path / "payload"
    shutil.copytree(REPO / "remote_payload" / "dflash_train", payload / "dflash_train")
    argv = [sys.executable, "-m", "dflash_train", *TINY]
    env = dict(os.environ)
    name = forking.server_name(argv[0], str(payload), env)
    log = tmp_path / "server.log"
    server = start_server(payload, name, log, env, idle_s=120)
    try:
        wait_until(lambda: said(log, "; serving"), timeout=SERVE_WAIT_S, what="the server to serve")
        regen = payload / "dflash_train" / "regen.py"
        regen.write_text(regen.read_text() + "\n")  # as a pip upgrade or a push in place would
        with pytest.raises(forking.NoFork, match=r"refused: \S+/dflash_train/regen.py changed on disk"):
            forking.ask(argv, str(payload), env, 120, str(tmp_path))
        assert server.wait(timeout=60) == 0  # no trainer of its own running: it ends
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        claim.bind("\0" + name)  # the name is free for the next server
        claim.close()
    finally:
        server.kill()
        server.wait()


def test_one_server_serves_the_runs_that_would_start_the_same_process():
    env = {"PATH": "/usr/bin", "HOME": "/root", "TORCHINDUCTOR_CACHE_DIR": "/c"}
    base = forking.server_name("python3", "/w/payload-1", env)
    per_run = dict(env, DFLASHCTL_REASON_FILE="/r/reason", MASTER_PORT="29500", RANK="1", SSH_CONNECTION="a b c d")
    assert forking.server_name("python3", "/w/payload-1", per_run) == base
    assert forking.server_name("python3", "/w/payload-2", env) != base  # another pushed payload
    assert forking.server_name("/opt/venv/bin/python", "/w/payload-1", env) != base
    assert forking.server_name("python3", "/w/payload-1", dict(env, TORCHINDUCTOR_CACHE_DIR="/d")) != base
    assert forking.server_name("python3", "/w/payload-1", dict(env, PYTHONPATH="/x")) != base


def test_a_run_of_another_program_or_without_a_server_allowed_starts_plainly(tmp_path):
    out = tmp_path / "out"
    child, how = forking.start_trainer(
        [sys.executable, "-c", "print('hi')"], str(tmp_path), dict(os.environ), 60, str(out)
    )
    assert (child.wait(), how) == (0, "plain")
    assert not out.exists()  # no server was asked for, nor started
    argv = [sys.executable, "-m", "dflash_train", "--help"]
    child, how = forking.start_trainer(argv, str(REPO / "remote_payload"), dict(os.environ), 0, str(out))
    assert how == "plain"
    child.wait()
    assert not out.exists()  # no server was started for a run that allows none
