"""SSH transport and the test harness: real sshd, the pct shim, exit codes, streaming, drops."""

import hashlib
import subprocess
import sys
import threading

import pytest
from runs_helpers import wait_until
from sshd import ECHO_BOTH, MB, run_concurrently, run_together

from dflashctl.containers import Target
from dflashctl.errors import ConnectError, RemoteError


def test_ssh_client_binary_logs_in(sshd_host):
    """OpenSSH's own client accepts the harness's HOME, key and known_hosts."""
    result = subprocess.run(
        [
            "ssh",
            "-F",
            "none",
            "-o",
            "BatchMode=yes",
            "-o",
            f"UserKnownHostsFile={sshd_host.home}/.ssh/known_hosts",
            "-i",
            f"{sshd_host.home}/.ssh/id_ed25519",
            "-p",
            str(sshd_host.port),
            f"{sshd_host.user}@{sshd_host.address}",
            "id -u; exit 7",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=sshd_host.env,
    )
    assert result.returncode == 7, result.stderr
    assert result.stdout.strip().isdigit()


def test_session_runs_id_in_shim_container(shim_container, shim_host):
    with shim_host.session() as session:
        target: Target = session.target("shim")
        result = target.run(["sh", "-c", 'id -u; echo "$HOME"; pwd; exit 3'])
    assert result.exit_code == 3
    uid, home, cwd = result.text().split()
    assert uid.isdigit() and home == str(shim_container) and cwd == str(shim_container)


def test_pct_shim_status_and_stopped(shim_host):
    pct = str(shim_host.pct_path)
    status = subprocess.run([pct, "status", "201"], capture_output=True, text=True)
    assert status.stdout == "status: stopped\n"
    stopped = subprocess.run([pct, "exec", "201", "--", "true"], capture_output=True, text=True)
    assert (stopped.returncode, stopped.stderr) == (255, "container '201' not running!\n")
    missing = subprocess.run([pct, "exec", "999", "--", "true"], capture_output=True, text=True)
    assert missing.returncode != 0 and "999.conf' does not exist" in missing.stderr
    no_dashes = subprocess.run([pct, "exec", "200", "true"], capture_output=True, text=True)
    assert no_dashes.returncode != 0
    listing = subprocess.run([pct, "list"], capture_output=True, text=True).stdout.splitlines()
    assert listing[0].split() == ["VMID", "Status", "Lock", "Name"]
    assert [line.split()[:2] for line in listing[1:]] == [["200", "running"], ["201", "stopped"]]


def test_pct_shim_push_pull(shim_container, shim_host, tmp_path):
    pct = str(shim_host.pct_path)
    src = tmp_path / "a.bin"
    src.write_bytes(b"\x00payload\xff")
    subprocess.run([pct, "push", "200", str(src), "a.bin"], check=True)
    assert (shim_container / "a.bin").read_bytes() == b"\x00payload\xff"
    subprocess.run([pct, "pull", "200", "a.bin", str(tmp_path / "b.bin")], check=True)
    assert (tmp_path / "b.bin").read_bytes() == b"\x00payload\xff"
    shim_host.set_running(200, False)
    refused = subprocess.run([pct, "push", "200", str(src), "a.bin"], capture_output=True, text=True)
    assert refused.returncode == 255 and "running" in refused.stderr


def test_kill_connections_drops_ssh(sshd_host):
    with sshd_host.session() as session:
        target = session.target("bare")
        assert target.run(["true"]).ok
        assert sshd_host.kill_connections() >= 1
        # the next command reconnects: the listener stayed up
        assert target.run(["echo", "again"]).text() == "again\n"


# --- streaming -----------------------------------------------------------------------------------


def test_large_streams_both_ways_through_pct(shim_container, shim_host):
    payload = hashlib.sha256(b"seed").digest() * (50 * MB // 32)
    with shim_host.session() as session:
        result = session.target("shim").run([sys.executable, "-c", ECHO_BOTH], stdin=payload, timeout=120)
    assert result.exit_code == 0
    assert len(result.stdout) == len(payload) and result.stdout == payload
    assert len(result.stderr) == len(payload) and result.stderr == payload


def test_streaming_callbacks_see_output_before_exit(shim_host, tmp_path):
    # The command only finishes once the callback has seen its first line: without streaming it
    # would wait for a file that is never made, and time out.
    go = tmp_path / "go"
    seen: list[bytes] = []

    def on_stdout(chunk: bytes) -> None:
        seen.append(chunk)
        go.touch()

    script = 'echo first; while [ ! -e "$1" ]; do sleep 0.05; done; echo second'
    with shim_host.session() as session:
        result = session.target("bare").run(["sh", "-c", script, "sh", str(go)], on_stdout=on_stdout, timeout=30)
    assert result.ok and seen[0].startswith(b"first\n") and b"".join(seen) == b"first\nsecond\n"


def test_connection_reused_for_every_command(shim_host):
    with shim_host.session() as session:
        target = session.target("shim")
        target.run(["true"])
        transport = session.transport(session.host("shim")).connection()
        for _ in range(5):
            assert target.run(["true"]).ok
        assert session.transport(session.host("shim")).connection() is transport


def test_concurrent_commands_share_one_connection(shim_host):
    with shim_host.session() as session:
        results = run_concurrently(session.target("bare"))
    assert [(r.exit_code, r.text()) for r in results] == [(i, f"{i}\n") for i in range(8)]


def test_commands_beyond_max_sessions_open_overflow_connections(few_sessions_host, tmp_path):
    """That sshd allows 3 sessions per connection: 8 commands running at once all succeed (before,
    5 failed with `the server refused a new session`), and the extra connections close after."""
    with few_sessions_host.session() as session:
        results = run_together(session.target("bare"), 8, tmp_path)
        assert [(r.exit_code, r.text()) for r in results] == [(0, f"{i}\n") for i in range(8)]
        transport = session.transport(session.host("bare"))
        wait_until(lambda: transport.trim() == 0, 30, "the overflow connections to close")
        assert session.target("bare").run(["echo", "main"]).text() == "main\n"


def test_overflow_connections_go_through_the_one_jump_host_connection(few_sessions_host, tmp_path):
    """Through a ProxyJump (the same sshd), 8 commands at once need 3 connections but one hop."""
    host = few_sessions_host
    jump = host.host_entry(None, proxy_jump=f"{host.user}@{host.address}:{host.port}")
    inventory = host.write_inventory(tmp_path / "hosts.yaml", {"jumped": jump})
    (tmp_path / "meeting").mkdir()
    with host.session(inventory=inventory) as session:
        results = run_together(session.target("jumped"), 8, tmp_path / "meeting")
        assert [(r.exit_code, r.text()) for r in results] == [(0, f"{i}\n") for i in range(8)]
        assert len(session.transport(session.host("jumped"))._hops) == 1


def test_timeout_raises_remote_error(shim_host):
    with shim_host.session() as session:  # a sleep that ended by itself would not raise
        with pytest.raises(RemoteError, match="timed out"):
            session.target("bare").run(["sleep", "30"], timeout=1)


def test_env_is_applied_with_env_wrapper(shim_host):
    with shim_host.session() as session:
        transport = session.transport(session.host("bare"))
        result = transport.run(["sh", "-c", 'printf "%s|%s" "$A" "$B"'], env={"A": "x y", "B": "$(id)"})
    assert result.stdout == b"x y|$(id)"


def test_target_env_is_set_inside_the_container(shim_host):
    with shim_host.session() as session:
        result = session.target("shim").run(["sh", "-c", 'printf "%s|%s" "$X" "$HOME"'], env={"X": "a b"})
    assert result.stdout == f"a b|{shim_host.container_dir(200)}".encode()


def test_dropped_connection_mid_stream_raises_connect_error(shim_host):
    streaming = threading.Event()

    def on_stdout(_chunk: bytes) -> None:
        streaming.set()

    def kill_once_streaming() -> None:
        streaming.wait(30)
        shim_host.kill_connections()

    with shim_host.session() as session:
        target = session.target("shim")
        killer = threading.Thread(target=kill_once_streaming)
        killer.start()
        with pytest.raises(ConnectError, match="connection to shim lost"):
            target.run(["sh", "-c", "while :; do echo tick; sleep 0.1; done"], on_stdout=on_stdout, timeout=60)
        killer.join()
    assert streaming.is_set()


def test_two_hosts_in_one_session(shim_host, second_sshd_host, tmp_path):
    second_sshd_host.reset()
    shim_host.link(second_sshd_host)
    inventory = shim_host.write_inventory(tmp_path / "hosts.yaml", {"gpu2": second_sshd_host.host_entry(200)})
    with shim_host.session(inventory=inventory) as session:
        homes = {
            name: session.target(name).run(["sh", "-c", 'echo "$HOME"']).text().strip() for name in ("shim", "gpu2")
        }
    assert homes == {"shim": str(shim_host.container_dir(200)), "gpu2": str(second_sshd_host.container_dir(200))}
