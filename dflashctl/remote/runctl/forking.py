"""Warm starts (issue 31): a run's trainer forked by the fork server, a process in the container
that has imported torch, the compiler and the trainer already (remote_payload/dflash_train/
forkserver.py has the protocol), with a plain start whenever no server answers or it refuses.

One server serves the runs that would start the same process: same user, interpreter, payload
version (cwd) and environment, the run's own variables (PER_RUN_ENV) and the login's
(SESSION_ENV) aside; the name of its abstract unix socket is a hash of those. A run that finds none
starts one (its log: <workdir>/fork-server/NAME.log) and starts plainly itself.
"""

import array
import hashlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import time

from ..wire import BYTECODE_CACHE, WORKDIR_TOKEN
from .common import SUPERVISOR_POLL_S, alive, marker

SERVER_MODULE = "dflash_train.forkserver"
PACKAGE = "dflash_train"  # the trainer's modules, which the server has imported
# Set per run by the supervisor and the multi-host launch; none is read while torch is imported.
PER_RUN_ENV = frozenset(
    (
        "DFLASHCTL_REASON_FILE",
        "DFLASHCTL_AGREED_STOP_FILE",
        "DFLASH_NODES",
        "DFLASH_RUN_ID",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
    )
)
# What differs between two logins or shells of one user, and nothing imports.
SESSION_ENV = frozenset(
    ("SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK", "XDG_SESSION_ID", "PWD", "OLDPWD", "SHLVL", "_")
)
ANSWER_TIMEOUT_S = 30.0  # the server answers at once; this is for one that hangs


class NoFork(Exception):
    """Why this attempt starts plainly."""


def start_trainer(argv, cwd, env, idle_s, workdir):
    """The trainer for one attempt and how it started ("forked" or "plain"): forked by the fork
    server when the run allows one (idle_s > 0) and it answers, else a plain Popen (OSError when
    that fails), with a line saying why when a fork was tried."""
    if idle_s > 0 and len(argv) > 2 and argv[1] == "-m" and (argv[2] + ".").startswith(PACKAGE + "."):
        try:
            return ask(argv, cwd, env, idle_s, workdir), "forked"
        except NoFork as exc:
            print("dflashctl: plain start: %s" % exc, flush=True)
    child = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    return child, "plain"


def server_name(argv0, cwd, env):
    """The abstract socket name of the server for runs of this interpreter, payload and environment."""
    same = sorted((k, v) for k, v in env.items() if k not in PER_RUN_ENV and k not in SESSION_ENV)
    ident = json.dumps([os.getuid(), argv0, cwd, same])
    return "dflashctl-fork-" + hashlib.sha256(ident.encode()).hexdigest()[:24]


def ask(argv, cwd, env, idle_s, workdir):
    """Ask the server for the trainer: a Forked, or NoFork (after starting a server when none was there)."""
    name = server_name(argv[0], cwd, env)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(ANSWER_TIMEOUT_S)
    try:
        try:
            sock.connect("\0" + name)
        except OSError:  # none, or one still importing: the next run gets it
            log = spawn_server(argv[0], cwd, env, name, idle_s, workdir)
            raise NoFork("no fork server was ready; one is starting for the runs after this one (log: %s)" % log)
        check_server(sock)
        reader = Lines(sock)
        request = (json.dumps({"argv": argv, "cwd": cwd, "env": env, **inherited_signals()}) + "\n").encode()
        sent = sock.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        sock.sendall(request[sent:])
        answer = reader.message(ANSWER_TIMEOUT_S)
        if answer is None or "pid" not in answer:
            refused = (answer or {}).get("refused") or "no answer"
            raise NoFork("the fork server refused: %s" % refused)
        # Said before the go-ahead, so that it comes before anything the trainer writes to the log.
        print("dflashctl: warm start: forked by the fork server (torch and the trainer imported)", flush=True)
        sock.sendall(b'{"go": true}\n')
        if not (reader.message(ANSWER_TIMEOUT_S) or {}).get("started"):  # the go-ahead came too late
            raise NoFork("the fork server did not start the trainer it forked after all")
    except (OSError, ValueError) as exc:
        sock.close()
        raise NoFork("the fork server could not be asked: %s" % exc)
    except NoFork:
        sock.close()
        raise
    return Forked(int(answer["pid"]), sock, reader)


def inherited_signals():
    """The signals a plain start's trainer inherits from this process over exec: those it ignores
    and those it blocks (a supervisor started with SIGINT ignored, as a shell's background job is,
    starts trainers that ignore it)."""
    ignored = [int(s) for s in signal.valid_signals() if signal.getsignal(s) == signal.SIG_IGN]
    return {"ignored": ignored, "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))}


def check_server(sock):
    """NoFork unless the name is held by a process of this user in this pid namespace: the request
    carries the run's environment and fds, and the pid answered is signalled later."""
    pid, uid, _ = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII")))
    if uid != os.getuid() or pid <= 0:
        raise NoFork("the fork server's name is held by another user's process or another container's (uid %d)" % uid)


def spawn_server(argv0, cwd, env, name, idle_s, workdir):
    """Start a server for `name` outside this process's tree (it outlives the run); its log's path.
    A second server for one name exits at once, so runs starting side by side may each start one."""
    home = os.path.expanduser(workdir)
    log = os.path.join(home, "fork-server", name + ".log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    server_env = {k: v for k, v in env.items() if k not in PER_RUN_ENV}
    cache = BYTECODE_CACHE.replace(WORKDIR_TOKEN, home)  # the trainer's default (runs.trainer_argv)
    argv = [argv0, "-m", SERVER_MODULE, name, "--idle-s", str(idle_s), "--bytecode-cache", cache]
    pid = os.fork()
    if pid == 0:  # the go-between exits at once: the server's parent becomes init, which reaps it
        try:
            os.setsid()
            with open(log, "ab") as out:
                subprocess.Popen(argv, cwd=cwd, env=server_env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return log


class Lines:
    """JSON lines read off a socket."""

    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def message(self, timeout):
        """The next message; None at end of stream; socket.timeout when none came in time."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise socket.timeout("no answer in %g s" % timeout)
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


class Forked:
    """A trainer the server forked, waited on as a Popen: its exit code comes from the server."""

    def __init__(self, pid, sock, reader):
        self.pid, self.sock, self.reader = pid, sock, reader
        self.mark = marker(pid)
        self.returncode = None
        self.server_lost = False

    def wait(self, timeout=None):
        """The exit code (-N: signal N), as Popen.wait; subprocess.TimeoutExpired after timeout s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            if self.server_lost:
                self.wait_unreported(min(left, SUPERVISOR_POLL_S))
                continue
            try:
                message = self.reader.message(left)
            except socket.timeout:
                continue
            except (OSError, ValueError):
                message = None
            if message is None:
                self.server_lost = True
                self.sock.close()
            elif "exit" in message:
                self.returncode = int(message["exit"])
                self.sock.close()
        return self.returncode

    def wait_unreported(self, seconds):
        """The server ended while its trainer ran: wait for the trainer itself; its exit code is
        lost (recorded as 1, with a line that says so)."""
        if alive(self.mark):
            time.sleep(seconds)
            return
        print(
            "dflashctl: the fork server ended before the trainer it forked: the trainer's exit code is lost",
            flush=True,
        )
        self.returncode = 1
