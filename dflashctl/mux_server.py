"""The mux's server side (mux.py describes the design and the protocol): one paramiko connection
held for `persist` seconds, serving the commands that CLI calls send over a unix socket.

`python -m dflashctl.mux_server CONFIG_JSON` (mux.py starts it) detaches and serves.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import DflashError
from .inventory import HostSpec
from .mux import (
    CODE,
    EOF,
    ERROR,
    EXIT,
    GONE,
    INFO,
    KILL,
    LOCK_WAIT_S,
    START,
    STARTED,
    STATS,
    STDERR,
    STDIN,
    STDOUT,
    MuxUnavailable,
    connect,
    peer_uid,
    recv_frame,
    send_frame,
)
from .transport import CHUNK

if TYPE_CHECKING:
    from .ssh import SshOptions

log = logging.getLogger("dflashctl.mux")


class _Dying(Exception):
    """The mux's SSH connection died; it serves nothing more."""


def serve(host: HostSpec, options: "SshOptions | None", path: Path) -> int:
    """Run the mux for host at path until idle for host.persist seconds, dead, or told to stop."""
    import fcntl

    os.umask(0o077)
    lock_fd = os.open(f"{path.with_suffix('.lock')}", os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            try:  # another mux holds the lock: if it answers, it serves the socket
                connect(path).close()
                return 0
            except (OSError, MuxUnavailable):
                pass
            if time.monotonic() > deadline:
                return 1
            time.sleep(0.05)
    try:
        path.unlink()  # stale: its mux is gone (we hold the lock)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    inode = os.stat(path).st_ino
    server = _Server(host, options)
    signal.signal(signal.SIGTERM, lambda *_: server.stop.set())
    try:
        server.run(listener)
    finally:
        try:
            if os.stat(path).st_ino == inode:
                path.unlink()
        except OSError:
            pass
        listener.close()
        server.shutdown()
        os.close(lock_fd)
    return 0


class _Server:
    def __init__(self, host: HostSpec, options: "SshOptions | None"):
        from .ssh import SshTransport

        server = self

        class _Counting(SshTransport):
            def _connect_once(self):  # type: ignore[no-untyped-def]
                if server.connects and self._client is None:
                    raise _Dying()  # never reconnect the main connection: a new mux takes over
                client = super()._connect_once()
                with server.lock:  # overflow connections are made beside the main one
                    server.connects += 1
                return client

        self.host = host
        self.transport = _Counting(host, options)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.active = 0
        self.last = time.monotonic()
        self.connects = 0
        self.channels = 0
        self.threads: list[threading.Thread] = []

    def alive(self) -> bool:
        """Whether the SSH connection is up (True before the first connect, False once it has dropped)."""
        client = self.transport._client
        if client is None:
            return not self.connects
        t = client.get_transport()
        return t is not None and t.is_active()

    def run(self, listener: socket.socket) -> None:
        """Accept same-user clients, one thread each, until stopped, idle past persist, or the SSH link is down."""
        listener.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                self.transport.trim()  # overflow connections live only as long as their commands
                with self.lock:
                    idle = self.active == 0 and time.monotonic() - self.last > self.host.persist
                if idle or not self.alive():
                    break
                continue
            except OSError:
                break
            try:
                if peer_uid(conn) != os.getuid():
                    conn.close()
                    continue
            except OSError:
                conn.close()
                continue
            conn.settimeout(None)
            with self.lock:
                self.active += 1
                self.last = time.monotonic()
            thread = threading.Thread(target=self.handle, args=(conn,), daemon=True)
            self.threads = [t for t in self.threads if t.is_alive()] + [thread]
            thread.start()

    def shutdown(self) -> None:
        """Stop serving, close the SSH connection (open channels fail) and give handler threads 2 s each."""
        self.stop.set()
        try:
            self.transport.close()  # open channels fail: their clients hear "connection lost"
        except Exception:  # noqa: BLE001
            pass
        for t in self.threads:
            t.join(2)

    def stats(self) -> bytes:
        """The mux's pid, host, connect and channel counts, other clients active, overflow connections
        open and persist, as JSON."""
        overflow = self.transport.trim()
        with self.lock:
            data = {"pid": os.getpid(), "host": self.host.name, "connects": self.connects, "channels": self.channels,
                    "active": self.active - 1, "overflow": overflow, "persist": self.host.persist}  # fmt: skip
        return json.dumps(data).encode()

    def handle(self, conn: socket.socket) -> None:
        """Serve one client connection (a stats query, a stop request or a command), then close it."""
        try:
            frame = recv_frame(conn)
            if frame is None:
                return
            kind, payload = frame
            if kind == STATS:
                send_frame(conn, INFO, self.stats())
            elif kind == EXIT:
                send_frame(conn, INFO, self.stats())
                self.stop.set()
            elif kind == START:
                self.command(conn, json.loads(payload))
        except OSError:
            pass
        finally:
            with self.lock:
                self.active -= 1
                self.last = time.monotonic()
            try:
                conn.close()
            except OSError:
                pass

    def command(self, conn: socket.socket, request: dict) -> None:
        """Run the request's argv over the shared connection, relaying stdin, stdout, stderr and exit code."""
        proc = self._start(conn, request)
        if proc is None:
            return
        with self.lock:
            self.channels += 1
        send_lock = threading.Lock()

        def send(kind: bytes, payload: bytes = b"") -> None:
            with send_lock:
                send_frame(conn, kind, payload)

        send(STARTED)
        pumps = [threading.Thread(target=_pump, args=(proc, proc.stdout, STDOUT, send), daemon=True),
                 threading.Thread(target=_pump, args=(proc, proc.stderr, STDERR, send), daemon=True)]  # fmt: skip
        for t in pumps:
            t.start()
        threading.Thread(target=_feed, args=(conn, proc), daemon=True).start()
        for t in pumps:
            t.join()
        try:
            code = proc.wait()
        except DflashError as exc:
            send(ERROR, json.dumps({"cls": type(exc).__name__, "msg": str(exc)}).encode())
            return
        except Exception as exc:  # noqa: BLE001
            send(
                ERROR,
                json.dumps({"cls": "ConnectionLost", "msg": f"connection to {self.host.name} lost ({exc})"}).encode(),
            )
            return
        send(CODE, struct.pack("!i", code))
        try:
            conn.shutdown(socket.SHUT_RDWR)  # wakes the reader
        except OSError:
            pass

    def _start(self, conn: socket.socket, request: dict):  # type: ignore[no-untyped-def]
        """The started command's Process, or None after telling the client why not (GONE, ERROR)."""
        if self.stop.is_set():
            send_frame(conn, GONE)
            return None
        try:
            return self.transport.start(request["argv"], env=request.get("env"))
        except _Dying:
            self.stop.set()
            send_frame(conn, GONE)
        except DflashError as exc:
            if not self.connects:
                self.stop.set()  # never connected: let the next call start afresh
            send_frame(conn, ERROR, json.dumps({"cls": type(exc).__name__, "msg": str(exc)}).encode())
        return None


def _pump(proc, stream, kind: bytes, send) -> None:  # type: ignore[no-untyped-def]
    """Relay one output stream of the command to the client as `kind` frames."""
    try:
        while data := stream.read1(CHUNK):
            send(kind, data)
    except OSError:
        proc.kill()  # the client hung up
    except BaseException:  # noqa: BLE001 - connection lost: the command's wait() reports it
        pass


def _feed(conn: socket.socket, proc) -> None:  # type: ignore[no-untyped-def]
    """Relay the client's STDIN and EOF frames to the command; KILL or a gone client kills it."""
    broken = False
    while True:
        try:
            frame = recv_frame(conn)
        except OSError:
            frame = None
        if frame is None or frame[0] == KILL:
            proc.kill()
            return
        kind, payload = frame
        if kind == STDIN and not broken:
            try:
                proc.stdin.write(payload)
            except Exception:  # noqa: BLE001 - the command stopped reading
                broken = True
        elif kind == EOF:
            try:
                proc.stdin.close()
            except Exception:  # noqa: BLE001
                pass


def _main(argv: list[str]) -> int:
    """`python -m dflashctl.mux_server CONFIG_JSON`: detach (second fork, new session) and serve."""
    config = json.loads(argv[0])
    if os.fork() > 0:
        os._exit(0)
    try:
        os.setsid()
    except OSError:
        pass
    host = HostSpec(transport="ssh", **config["host"])
    options = None
    if config.get("options"):
        from .ssh import SshOptions

        opts = dict(config["options"])
        opts["home"] = Path(opts["home"]) if opts.get("home") else None
        options = SshOptions(**opts)
    try:
        code = serve(host, options, Path(config["path"]))
    except Exception:  # noqa: BLE001 - nobody to tell: clients fall back to direct
        code = 1
    os._exit(code)  # cleaned up already; interpreter shutdown would wait on paramiko's threads


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
