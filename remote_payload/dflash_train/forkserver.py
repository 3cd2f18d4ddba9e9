"""The fork server (issue 31: a warm start without the import bill).

A process in the container that imports torch, Dynamo, Inductor and the trainer once, then forks a
trainer for each run that asks: the fork skips the seconds a new process spends importing them
(docs/runs.md). runctl's supervisor starts it and is its only client (dflashctl/remote/runctl/forking.py).

    python -m dflash_train.forkserver NAME --idle-s SECONDS [--bytecode-cache DIR]

It forks only while a fork of it is a clean process: no CUDA context (torch is told to ask NVML,
not the driver, whether CUDA is there, PYTORCH_NVML_BASED_CUDA_CHECK) and no other Python thread.
Its self-check starts the driver (cuInit) in a forked child and in a new process: when the two
differ, it refuses every request with the reason, and runs start plainly. It stops serving when a
module it imported changed on disk (a pip upgrade) or on SIGTERM, and ends SECONDS after the last
request or the end of the last trainer it forked, whichever is later (once stopped: when the last
trainer it forked has ended).

Protocol, one connection per run, on the abstract unix socket NAME (binding it is the claim: a
second server for NAME exits at once; peers of another uid are refused). The client sends one JSON
line {"argv", "cwd", "env", "ignored", "blocked"} (the last two: the signals it ignores and blocks,
which a plain start inherits) with its stdin, stdout and stderr as SCM_RIGHTS; the server forks and
answers {"pid": N}; the child runs the trainer only once the client has answered {"go": true}, which
the server confirms with {"started": true} (a client that gave up, or whose go-ahead came too late,
leaves no trainer behind); when it ends the server sends {"exit": CODE}, Popen's returncode (-N:
signal N). Or the server answers {"refused": REASON}.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .bytecode import keep_bytecode

# What every trainer imports (the compiler's entry point as compiling.preload_compiler imports it),
# and a data run's module.
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "dflash_train.train", "dflash_train.regen")
PACKAGE = "dflash_train"  # the modules a request may run
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
STDIO = 3  # a request brings exactly its stdin, stdout and stderr
MAX_REQUEST = 4 << 20
PEER_TIMEOUT_S = 10.0  # for a client's request, and its go-ahead once it has the pid: it answers at once
CHECK_TIMEOUT_S = 60.0  # for the self-check's driver start: a hung driver is a refusal, not a hung server
CUINIT = "from dflash_train.forkserver import cuinit; print(cuinit())"


@dataclass
class Request:
    """One run's trainer: `python -m MODULE ARGS...` in cwd with exactly env, on the client's fds."""

    module: str
    args: list[str]
    cwd: str
    env: dict[str, str]
    fds: list[int]
    ignored: list[int]  # the signals the client ignores and blocks: a plain start inherits them
    blocked: list[int]


class Refusal(Exception):
    """A request this server does not serve; the message is its reason."""


def preload() -> dict[str, tuple[int, int]]:
    """Import what every trainer imports, torch told to ask NVML whether CUDA is there (a started
    driver does not work in a forked child); the (mtime, size) of each imported module's file."""
    os.environ[NVML_CHECK] = "1"
    for name in PRELOAD:
        importlib.import_module(name)
    return {path: stamp for path, stamp in map(file_stamp, module_files()) if stamp is not None}


def module_files() -> list[str]:
    """The files of every module imported so far."""
    return sorted({m.__file__ for m in list(sys.modules.values()) if isinstance(getattr(m, "__file__", None), str)})


def file_stamp(path: str) -> tuple[str, tuple[int, int] | None]:
    """(path, (mtime_ns, size)), or (path, None) when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return path, None
    return path, (st.st_mtime_ns, st.st_size)


def changed_module(stamps: dict[str, tuple[int, int]]) -> str | None:
    """A module file that changed on disk since the preload, or None."""
    for path, stamp in stamps.items():
        if file_stamp(path)[1] != stamp:
            return path
    return None


def cuinit() -> str:
    """What the CUDA driver's cuInit(0) returns in this process (0: it started), or why it cannot be asked."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no libcuda.so.1"
    return str(driver.cuInit(0))


def in_fork(fn: Callable[[], str]) -> str:
    """fn() in a child forked from this process: what it returned, or why there is no answer."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.write(w, fn().encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        if not select.select([r], [], [], CHECK_TIMEOUT_S)[0]:
            os.kill(pid, signal.SIGKILL)
            return "no answer in %g s" % CHECK_TIMEOUT_S
        said = b""
        while chunk := os.read(r, 65536):
            said += chunk
        return said.decode() or "no answer (the child died)"
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def fresh_cuinit() -> str:
    """cuinit() in a new process (the package's own directory on its path)."""
    try:
        fresh = subprocess.run(
            [sys.executable, "-c", CUINIT],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "no answer in %g s" % CHECK_TIMEOUT_S
    return fresh.stdout.strip() or "failed: " + fresh.stderr.strip()[-200:]


def native_threads() -> list[str]:
    """The names of this process's OS threads other than the caller's ([] where /proc cannot say)."""
    names = []
    try:
        tids = [t for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id()]
    except OSError:
        return []
    for tid in tids:
        try:
            with open("/proc/self/task/%s/comm" % tid) as comm:
                names.append(comm.read().strip())
        except OSError:
            pass  # it ended meanwhile
    return names


def fork_refusal() -> str | None:
    """Why no trainer may be forked from this process, or None."""
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return "threads run after the preload (%s): a fork would keep none of them" % ", ".join(others)
    forked, new = in_fork(cuinit), fresh_cuinit()
    if forked != new:
        why = "the CUDA driver does not start in a child forked after the preload"
        return "%s (cuInit: %s there, %s in a new process)" % (why, forked, new)
    return None


def read_request(conn: socket.socket) -> Request:
    """The client's request line and the fds that came with it (Refusal when malformed; the fds are
    closed whenever no Request carries them)."""
    data, fds = b"", []
    try:
        while not data.endswith(b"\n"):
            chunk, ancillary, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(STDIO * 4))
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", payload[: len(payload) - len(payload) % 4]).tolist()
            if not chunk or len(data) + len(chunk) > MAX_REQUEST:
                raise Refusal("no whole request came")
            data += chunk
        return parse_request(data, fds)
    except BaseException:
        close_all(fds)
        raise


def parse_request(data: bytes, fds: list[int]) -> Request:
    """A request line as a Request (Refusal unless it runs one of the package's modules on 3 fds)."""
    try:
        raw = json.loads(data)
        argv, cwd, env, ignored, blocked = raw["argv"], raw["cwd"], raw["env"], raw["ignored"], raw["blocked"]
        strings = all(isinstance(a, str) for a in argv) and all(isinstance(x, str) for x in [cwd, *env, *env.values()])
        numbers = all(type(n) is int and 0 < n < signal.NSIG for n in [*ignored, *blocked])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise Refusal("malformed request: %s" % exc) from None
    if not (strings and numbers):
        raise Refusal("malformed request: argv, cwd and env must be strings, ignored and blocked signal numbers")
    module = argv[2] if len(argv) > 2 and argv[1] == "-m" else ""
    if len(fds) != STDIO or not (module == PACKAGE or module.startswith(PACKAGE + ".")):
        raise Refusal("it runs `python -m %s...` with stdin, stdout and stderr, not %s" % (PACKAGE, argv[:3]))
    return Request(module, argv[3:], cwd, env, fds, ignored, blocked)


def close_all(fds: list[int]) -> None:
    """Close each fd, ignoring those already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def send(conn: socket.socket, message: dict) -> bool:
    """Send one JSON line; False when the client is gone."""
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False


def peer_uid(conn: socket.socket) -> int:
    """The connecting process's uid (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    return struct.unpack("iII", creds)[1]


class Server:
    """The listening socket, the trainers forked and still running (pid -> their client's
    connection), and what ends the service."""

    def __init__(self, listener: socket.socket, idle_s: float, stamps: dict, refusal: str | None):
        self.listener: socket.socket | None = listener
        self.idle_s, self.stamps, self.refusal = idle_s, stamps, refusal
        self.children: dict[int, socket.socket] = {}
        self.last = time.monotonic()  # the last request, or the last trainer's end
        self.ended = "idle for %g s" % idle_s
        self.stopping = False
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)  # a SIGCHLD wakes select(): exits are reported at once
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # SIGTERM (`hosts servers --stop`) ends the service, not the server: the trainers it forked
        # still get their exit codes sent to their supervisors.
        signal.signal(signal.SIGTERM, self.stop)

    def stop(self, *_: object) -> None:
        """SIGTERM: serve no more; exit once the trainers forked have ended (serve() closes the socket)."""
        self.stopping = True

    def serve(self) -> Request | None:
        """Answer requests until idle with no trainer left (None); in a forked child, its Request."""
        while self.children or self.listener is not None and time.monotonic() - self.last < self.idle_s:
            watch = [self.wake_r] + ([self.listener] if self.listener is not None else [])
            ready = select.select(watch, [], [], 1.0)[0]
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            self.reap()
            if self.stopping:
                self.close_listener("stopped by SIGTERM")
            if self.listener is not None and self.listener in ready:
                self.last = time.monotonic()
                try:
                    conn = self.listener.accept()[0]
                except OSError:  # the client left before it was accepted
                    continue
                request = self.answer(conn)
                if request is not None:
                    return request
        self.close_listener(self.ended)
        return None

    def answer(self, conn: socket.socket) -> Request | None:
        """One connection: refuse it, or fork its trainer (the child returns the Request)."""
        conn.settimeout(PEER_TIMEOUT_S)
        try:
            request = read_request(conn)  # read first: a client sends all of it before it reads
        except Exception as exc:  # noqa: BLE001 - whatever a client sends is a refusal, never the server's end
            return self.refuse(conn, [], str(exc) or type(exc).__name__)
        if peer_uid(conn) != os.getuid():
            return self.refuse(conn, request.fds, "the client runs as another user")
        changed = changed_module(self.stamps)
        if changed:  # later runs get a new server, which the next client starts
            self.refusal = "%s changed on disk since this server imported it" % changed
            self.close_listener(self.refusal)
        if self.refusal:
            return self.refuse(conn, request.fds, self.refusal)
        try:
            return self.fork(conn, request)
        except OSError as exc:  # no fork to be had (memory, process limits): this run starts plainly
            return self.refuse(conn, request.fds, "cannot fork: %s" % exc)

    def refuse(self, conn: socket.socket, fds: list[int], reason: str) -> None:
        """Answer {"refused": reason} and drop the connection and its fds."""
        close_all(fds)
        send(conn, {"refused": reason})
        conn.close()

    def close_listener(self, why: str) -> None:
        """Stop serving: the name is free for the next server at once, whatever this one still does."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            self.ended = why
            print("fork server %d: no longer serving: %s" % (os.getpid(), why), flush=True)

    def fork(self, conn: socket.socket, request: Request) -> Request | None:
        """Fork the trainer; it starts once the client says go (then the server confirms), else it
        is killed unstarted."""
        sys.stdout.flush()
        sys.stderr.flush()
        gate_r, gate_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never goes back to serving: it becomes the trainer or ends here
            try:
                os.close(gate_w)
                self.close_in_child(conn)
                go = os.read(gate_r, 1)
                os.close(gate_r)
            except BaseException:
                os._exit(1)
            if go != b"g":
                os._exit(0)
            return request
        os.close(gate_r)
        close_all(request.fds)
        try:
            go = send(conn, {"pid": pid}) and json.loads(conn.makefile("rb").readline() or b"{}").get("go")
        except (OSError, ValueError, AttributeError):
            go = False
        if go:
            os.write(gate_w, b"g")
            self.children[pid] = conn
            send(conn, {"started": True})
            print("forked trainer %d: python -m %s" % (pid, request.module), flush=True)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            conn.close()
        os.close(gate_w)
        return None

    def reap(self) -> None:
        """Send each ended trainer's exit code to its client."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.last = time.monotonic()  # the idle wait starts when the last trainer ends
            conn = self.children.pop(pid, None)
            if conn is not None:
                send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()

    def close_in_child(self, conn: socket.socket) -> None:
        """In a forked trainer: drop everything of the server (its socket, its clients', the
        wake-up pipe and SIGCHLD handler), so the trainer holds nothing a client waits on."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        close_all([self.wake_r, self.wake_w])
        for sock in [conn, *self.children.values()] + ([self.listener] if self.listener is not None else []):
            sock.close()


@dataclass
class Start:
    """What the server's own start changed that a plain process would not have: the bytecode
    choice, undone in each child before its trainer makes its own."""

    pycache_prefix: str | None
    dont_write_bytecode: bool


def take_signals(ignored: list[int], blocked: list[int]) -> None:
    """Take the signal dispositions and mask a new Python process started by the client would have."""
    # What the client ignores stays ignored over exec; the rest is default (SIGINT: Python's
    # KeyboardInterrupt). SIGPIPE and SIGXFSZ are ignored by Python's start-up (Popen resets them for
    # it), and handlers installed from C (faulthandler's, as PYTHONFAULTHANDLER in the environment
    # both share installs them at start-up) are the new process's too.
    for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ}:
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        if signal.getsignal(sig) is None and sig not in ignored:
            continue
        try:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else default)
        except (OSError, ValueError):
            pass  # a signal the C library keeps for itself
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def become(request: Request, start: Start) -> None:
    """In the forked child: take the run's fds, a session of its own, its directory, environment and
    signals, and run its module as `python -m` would (raises its SystemExit)."""
    os.setsid()
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
    close_all([fd for fd in request.fds if fd > 2])
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    take_signals(request.ignored, request.blocked)
    sys.pycache_prefix, sys.dont_write_bytecode = start.pycache_prefix, start.dont_write_bytecode
    if (
        "numpy" in sys.modules
    ):  # a new process seeds numpy's global generator afresh; Python's random is reseeded at fork
        sys.modules["numpy"].random.seed()
    if not hasattr(sys.modules.get(request.module), "__path__"):
        # `python -m` imports the module once, as __main__; runpy would run a second copy of the
        # preloaded one, with a warning.
        sys.modules.pop(request.module, None)
    sys.argv = ["-m", *request.args]
    runpy.run_module(request.module, run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> int:
    """Claim the name, preload, check, serve; in a forked child, become its trainer."""
    ap = argparse.ArgumentParser(prog="python -m dflash_train.forkserver", description=__doc__.splitlines()[0])
    ap.add_argument("name", help="the abstract unix socket's name")
    ap.add_argument("--idle-s", type=float, required=True, help="end this long after the last request or trainer")
    ap.add_argument("--bytecode-cache", help="torch's compiled bytecode, where its install has none (bytecode.py)")
    args = ap.parse_args(argv)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + args.name)
    except OSError:
        return 0  # another server has the name (started by a run beside this one's)
    print("fork server %d: %s is mine; importing" % (os.getpid(), args.name), flush=True)
    start = Start(sys.pycache_prefix, sys.dont_write_bytecode)
    began = time.monotonic()
    try:
        kept = keep_bytecode(args.bytecode_cache)
        stamps = preload()
    except ImportError as exc:
        print("fork server %d: cannot preload: %s" % (os.getpid(), exc), flush=True)
        return 4
    # Native threads (a library's idle pool) do not stop a fork, but Python warns of them at each
    # fork: name them once, beside the self-check that shows a forked child can start CUDA.
    threads = native_threads()
    refusal = fork_refusal()
    listener.listen(16)
    print(
        "fork server %d: %s imported in %.1f s%s; %s"
        % (
            os.getpid(),
            ", ".join(PRELOAD),
            time.monotonic() - began,
            " (%s)" % kept if kept else "",
            "refusing: " + refusal if refusal else "serving",
        ),
        flush=True,
    )
    if threads and not refusal:
        print(
            "fork server %d: %d native thread(s) besides this one at the self-check (%s): a forked trainer "
            "keeps none of them, and cuInit answered in a fork as in a new process"
            % (os.getpid(), len(threads), ", ".join(threads)),
            flush=True,
        )
    server = Server(listener, args.idle_s, stamps, refusal)
    request = server.serve()
    if request is None:
        print("fork server %d: %s: exiting" % (os.getpid(), server.ended), flush=True)
        return 0
    become(request, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
