"""`dflashctl tunnel` through the real sshd and pct shim: an HTTP request to a server in the
container and back, and nothing left on either side after Ctrl-C."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from runs_helpers import wait_until
from sshd import CLI, SHIM_VMID, free_port
from test_mux import mux  # noqa: F401 - persist hosts with a private mux directory, no mux left after

# Answers each connection once the client has finished sending, then keeps its end open for good.
HOLDING_SERVER = """
import socket, sys
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("ready", flush=True)
held = []
while True:
    conn, _ = server.accept()
    request = b""
    while chunk := conn.recv(65536):
        request += chunk
    conn.sendall(b"got " + request)
    held.append(conn)
"""


def relays(port: int) -> list[int]:
    """Pids of relays to `port` running on this machine (the shim's containers run here)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(b"Remote side of `dflashctl tunnel`" in part for part in cmd) and str(port).encode() in cmd[-2:]:
                found.append(int(entry.name))
    return found


class Lines:
    """A process's stderr lines as they come (read by a thread), with a bounded wait for each."""

    def __init__(self, stream) -> None:  # type: ignore[no-untyped-def]
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            self.queue.put(line.rstrip("\n"))
        self.queue.put(None)

    def next(self, timeout: float = 60) -> str | None:
        """The next line (None at the end); fails the test when none comes within timeout."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout} s") from None


def _tunnel(mux, where: str, port: int, local: int) -> tuple[subprocess.Popen, Lines]:  # type: ignore[no-untyped-def]
    tunnel = subprocess.Popen(
        [*CLI, "tunnel", where, f"{port}:{local}"],
        env={**mux.sshd.env, **mux.env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = Lines(tunnel.stderr)
    assert lines.next().startswith(f"forwarding 127.0.0.1:{local} -> port {port} in ")
    return tunnel, lines


def _ctrl_c(tunnel: subprocess.Popen, lines: Lines) -> list[str]:
    """SIGINT the tunnel; the stderr lines it printed after the ones already read."""
    tunnel.send_signal(signal.SIGINT)
    assert tunnel.wait(60) == 0
    rest = []
    while (line := lines.next()) is not None:
        rest.append(line)
    return rest


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n and (part := sock.recv(n - len(data))):
        data += part
    return data


@pytest.mark.parametrize("where", ["shim", "local"])
def test_tunnel_carries_http_and_leaves_nothing_after_ctrl_c(shim_host, where):
    site = shim_host.container_dir(SHIM_VMID) / "site"
    site.mkdir()
    (site / "hello.txt").write_text("hello from the container\n")
    port, local = free_port("127.0.0.1"), free_port("127.0.0.1")
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=site,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tunnel = subprocess.Popen(
        [*CLI, "tunnel", where, f"{port}:{local}"],
        env=shim_host.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert tunnel.stderr.readline().startswith(f"forwarding 127.0.0.1:{local} -> port {port} in ")

        def fetch() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{local}/hello.txt", timeout=20) as answer:
                return answer.read().decode()

        assert wait_until(lambda: _try(fetch), 30, "the server") == "hello from the container\n"
        assert fetch() == "hello from the container\n"  # a second connection, its own relay
        tunnel.send_signal(signal.SIGINT)
        _, err = tunnel.communicate(timeout=60)
        assert tunnel.returncode == 0 and err.strip().endswith("tunnel closed")
        wait_until(lambda: not relays(port), 30, "the relays to end")
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{local}/hello.txt", timeout=5)
    finally:
        tunnel.kill()
        server.kill()


def _try(fetch):  # type: ignore[no-untyped-def]
    try:
        return fetch()
    except OSError:
        return None


def test_tunnel_bad_ports_are_usage_errors(shim_host):
    res = shim_host.run_cli("tunnel", "shim", "80:abc")
    assert res.returncode == 2 and "PORT[:LOCAL] takes port numbers" in res.stderr


@pytest.mark.parametrize("where", ["shim", "p", "local"])
def test_ctrl_c_ends_relays_whose_server_keeps_its_end_open(mux, where):
    """Two clients half-close and get their answers; the server never closes its ends. After
    Ctrl-C no relay is left (before: each stayed, holding an SSH session), and the mux (`p`)
    runs no command any more."""
    port, local = free_port("127.0.0.1"), free_port("127.0.0.1")
    server = subprocess.Popen([sys.executable, "-c", HOLDING_SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    tunnel = None
    try:
        assert server.stdout.readline() == "ready\n"
        tunnel, lines = _tunnel(mux, where, port, local)
        clients = []
        for word in (b"one", b"two"):
            client = socket.create_connection(("127.0.0.1", local), timeout=60)
            clients.append(client)
            client.sendall(word)
            client.shutdown(socket.SHUT_WR)  # the relay passes the half-close on to the server
            assert _recv_exactly(client, 4 + len(word)) == b"got " + word
        assert len(relays(port)) == 2
        assert _ctrl_c(tunnel, lines) == ["tunnel closed"]
        wait_until(lambda: not relays(port), 60, "the relays to end")
        if where == "p":
            wait_until(lambda: mux.stats("p")["active"] == 0, 60, "the mux's commands to end")
        for client in clients:
            assert client.recv(1) == b""
            client.close()
    finally:
        if tunnel is not None:
            tunnel.kill()
        server.kill()


@pytest.mark.parametrize("where", ["shim", "p", "local"])
def test_refused_port_closes_the_local_connection_at_once(mux, where):
    """Nothing listens on the port: the client's connection is closed without it writing anything
    (before: it stayed open until the client wrote), and the tunnel prints one line and goes on."""
    port, local = free_port("127.0.0.1"), free_port("127.0.0.1")
    tunnel, lines = _tunnel(mux, where, port, local)
    try:
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", local), timeout=60) as client:
                assert client.recv(1) == b""
            assert lines.next() == f"relay: cannot connect to port {port} in the container: Connection refused"
        assert _ctrl_c(tunnel, lines) == ["tunnel closed"]
    finally:
        tunnel.kill()
