"""`dflashctl tunnel` through the real sshd and pct shim: an HTTP request to a server in the
container and back, and nothing left on either side after Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from runs_helpers import wait_until
from sshd import CLI, SHIM_VMID, free_port


def relays() -> list[int]:
    """Pids of tunnel relays running on this machine (the shim's containers run here)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"Remote side of `dflashctl tunnel`" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("where", ["shim", "local"])
def test_tunnel_carries_http_and_leaves_nothing_after_ctrl_c(shim_host, where):
    site = shim_host.container_dir(SHIM_VMID) / "site"
    site.mkdir()
    (site / "hello.txt").write_text("hello from the container\n")
    port, local = free_port("127.0.0.1"), free_port("127.0.0.1")
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=site,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tunnel = subprocess.Popen([*CLI, "tunnel", where, f"{port}:{local}"], env=shim_host.env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        wait_until(lambda: not relays(), 30, "the relays to end")
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
