"""`dflashctl tunnel HOST PORT[:LOCAL]`: a local port forwarded to a port inside the container.

Each accepted local connection starts `remote/relay.py` in the container over the host's
existing SSH connection (the `persist:` one when there is one), through `pct exec` or `docker
exec`, which connects to 127.0.0.1:PORT in the container's own network namespace: the container
needs no address the laptop can reach. Bytes flow both ways until either side closes. Ctrl-C
closes the listener and every relay (docs/cli.md).
"""

from __future__ import annotations

import socket
import threading
from typing import Callable

from .containers import Target, remote_script
from .errors import UsageError
from .transport import CHUNK, Process


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
            self.relays.add(proc)
        threading.Thread(target=self._to_remote, args=(conn, proc), daemon=True).start()
        threading.Thread(target=self._errors, args=(proc,), daemon=True).start()
        try:
            while data := proc.stdout.read1(CHUNK):
                conn.sendall(data)
        except Exception:  # noqa: BLE001 - either side went away: close both
            pass
        finally:
            conn.close()
            proc.kill()
            with self.lock:
                self.relays.discard(proc)

    def _to_remote(self, conn: socket.socket, proc: Process) -> None:
        try:
            while data := conn.recv(CHUNK):
                proc.stdin.write(data)
                proc.stdin.flush()
        except Exception:  # noqa: BLE001 - the local client or the relay went away
            pass
        try:
            proc.stdin.close()
        except Exception:  # noqa: BLE001
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
            relays, self.relays = list(self.relays), set()
        for proc in relays:
            proc.kill()
