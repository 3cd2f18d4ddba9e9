"""`dflashctl tunnel HOST PORT[:LOCAL]`: a local port forwarded to a port inside the container.

Each accepted local connection starts `remote/relay.py` in the container over the host's
existing SSH connection (the `persist:` one when there is one), through `pct exec` or `docker
exec`, which connects to 127.0.0.1:PORT in the container's own network namespace: the container
needs no address the laptop can reach. Bytes flow both ways until either side closes. Ctrl-C
closes the listener and every relay (docs/cli.md).

What the local client sends goes to the relay in frames (see relay.py), so that the client's
half-close (an empty frame) and the end of the relay's stdin (the tunnel let go: the relay exits
whatever the server does) differ.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Callable

from .containers import Target, remote_script
from .errors import UsageError
from .transport import CHUNK, Process

_FRAME = struct.Struct("!I")  # the length before each chunk sent to the relay


def parse_ports(spec: str) -> tuple[int, int]:
    """`PORT` or `PORT:LOCAL` as (remote port, local port); LOCAL defaults to PORT."""
    remote, _, local = spec.partition(":")
    try:
        ports = (int(remote), int(local or remote))
    except ValueError:
        raise UsageError(f"PORT[:LOCAL] takes port numbers like 8000 or 8000:18000, got {spec!r}") from None
    if not all(0 < p < 65536 for p in ports):
        raise UsageError(f"ports must be 1-65535, got {spec!r}")
    return ports


class Tunnel:
    """The listening socket on 127.0.0.1:LOCAL and the relays of its open connections."""

    def __init__(self, target: Target, remote_port: int, local_port: int, notice: Callable[[str], None]):
        self.target, self.remote_port, self.notice = target, remote_port, notice
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind(("127.0.0.1", local_port))
        except OSError as exc:
            self.listener.close()
            raise UsageError(f"cannot listen on 127.0.0.1:{local_port}: {exc.strerror}") from None
        self.listener.listen(16)
        self.local_port = self.listener.getsockname()[1]
        self.relays: set[Process] = set()
        self.lock = threading.Lock()
        self.closed = False

    def serve(self) -> None:
        """Accept connections until the listener is closed (each relayed on its own threads)."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        argv = [self.target.host.interpreter, "-S", "-c", remote_script("relay"), str(self.remote_port)]
        try:
            proc = self.target.start(argv)
        except Exception as exc:  # noqa: BLE001 - one failed connection is a notice, not the end of the tunnel
            self.notice(f"connection not relayed: {exc}")
            conn.close()
            return
        with self.lock:
            if not self.closed:  # else a relay started as the tunnel closed: end it at once
                self.relays.add(proc)
        if self.closed:
            proc.kill()
            _hang_up(conn)
            return
        threading.Thread(target=self._to_remote, args=(conn, proc), daemon=True).start()
        threading.Thread(target=self._errors, args=(proc,), daemon=True).start()
        try:
            while data := proc.stdout.read1(CHUNK):
                conn.sendall(data)
        except Exception:  # noqa: BLE001 - either side went away: close both
            pass
        finally:
            _hang_up(conn)
            proc.kill()
            with self.lock:
                self.relays.discard(proc)

    def _to_remote(self, conn: socket.socket, proc: Process) -> None:
        try:
            while data := conn.recv(CHUNK):
                proc.stdin.write(_FRAME.pack(len(data)) + data)
                proc.stdin.flush()
            proc.stdin.write(_FRAME.pack(0))  # the client has finished sending; stdin stays open
            proc.stdin.flush()
        except Exception:  # noqa: BLE001 - the local client or the relay went away
            pass

    def _errors(self, proc: Process) -> None:
        try:
            for line in proc.stderr.read().decode("utf-8", "replace").splitlines():
                if line.strip():
                    self.notice(line.strip())
        except Exception:  # noqa: BLE001 - a dropped channel ends the relay anyway
            pass

    def close(self) -> None:
        """Stop listening and end every relay."""
        self.listener.close()
        with self.lock:
            self.closed = True
            relays, self.relays = list(self.relays), set()
        for proc in relays:
            proc.kill()


def _hang_up(conn: socket.socket) -> None:
    """Close a local connection so that its client sees it now: close() alone sends nothing while
    another thread still waits in recv() on it."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()
