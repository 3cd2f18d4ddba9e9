"""SSH transport and the test harness: real sshd, the pct shim, exit codes, streaming, drops."""

import subprocess

from dflashctl.containers import Target


def test_ssh_client_binary_logs_in(sshd_host):
    """OpenSSH's own client accepts the harness's HOME, key and known_hosts."""
    result = subprocess.run(
        ["ssh", "-F", "none", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={sshd_host.home}/.ssh/known_hosts",
         "-i", f"{sshd_host.home}/.ssh/id_ed25519", "-p", str(sshd_host.port),
         f"{sshd_host.user}@{sshd_host.address}", "id -u; exit 7"],
        capture_output=True, text=True, timeout=30, env=sshd_host.env,
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
