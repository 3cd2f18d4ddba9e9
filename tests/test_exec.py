"""`dflashctl exec` and `hosts trust` end to end: real sshd, the pct shim, the CLI as a subprocess."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import threading

import pytest

from runs_helpers import install_standin
from sshd import keygen


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The CLI's error output: exactly one line, no traceback."""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


# --- commands in the container ---------------------------------------------------------------


def test_exit_code_and_streams_pass_through(shim_host, shim_container):
    result = shim_host.run_cli("exec", "shim", "--", "sh", "-c", "pwd; echo oops >&2; exit 42")
    assert result.returncode == 42
    assert result.stdout == f"{shim_container}\n"
    assert result.stderr == "oops\n"


def test_default_host_and_bare_host(shim_host):
    assert shim_host.run_cli("exec", "bare", "--", "sh", "-c", "exit 3").returncode == 3
    assert shim_host.run_cli("exec", "local", "--", "true").returncode == 0


def test_stdin_is_fed_to_the_command(shim_host):
    payload = bytes(range(256)) * 20000  # 5 MB of every byte value
    result = shim_host.run_cli("exec", "shim", "--", "sha256sum", input=payload)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0].decode() == hashlib.sha256(payload).hexdigest()


def test_large_output_on_both_streams_via_cli(shim_host):
    script = "import sys; sys.stdout.write('o' * (20 << 20)); sys.stderr.write('e' * (20 << 20))"
    result = shim_host.run_cli("exec", "shim", "--", shim_host.host_entry(200)["python"], "-c", script, binary=True)
    assert result.returncode == 0
    assert result.stdout == b"o" * (20 << 20) and result.stderr == b"e" * (20 << 20)


def test_stopped_container_exit_4(shim_host):
    result = shim_host.run_cli("exec", "stopped", "--", "true")
    assert result.returncode == 4
    assert "container 201 is not running" in one_line_error(result)


def test_missing_pct_container_is_one_line_exit_4_on_every_command(shim_host, tmp_path):
    inventory = shim_host.write_inventory(tmp_path / "hosts.yaml", {"novmid": shim_host.host_entry(999)})
    source = install_standin(tmp_path / "payload_src")
    expected = "error: novmid: no pct container 999 on this host (see `pct list`)"
    for args in (
        ("exec", "novmid", "--", "echo", "hi"),
        ("push", "novmid", "--source", str(source)),
        ("train", "novmid", "--source", str(source)),
        ("runs", "list", "novmid"),
    ):
        result = shim_host.run_cli(*args, env={"DFLASHCTL_INVENTORY": str(inventory)})
        assert (result.returncode, one_line_error(result), result.stdout) == (4, expected, ""), args


def test_missing_program_exit_4(shim_host):
    result = shim_host.run_cli("exec", "shim", "--", "no-such-program-xyz")
    assert result.returncode == 4
    assert "no-such-program-xyz" in one_line_error(result)


def test_unknown_host_exit_2(shim_host):
    result = shim_host.run_cli("exec", "nope", "--", "true")
    assert result.returncode == 2
    assert "unknown host 'nope'" in one_line_error(result)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["logs", "tail", "shim", "-n", "-2"],
            "error: -n takes 0 or more lines (-1: the whole log) and --since-step 0 or more",
        ),
        (
            ["logs", "tail", "--since-step", "-1"],
            "error: -n takes 0 or more lines (-1: the whole log) and --since-step 0 or more",
        ),
        (["runs", "stop", "shim", "--grace", "-1"], "error: --grace must be 0 or more seconds, got -1"),
    ],
)
def test_bad_numbers_are_usage_errors_before_any_remote_call(shim_host, args, message):
    result = shim_host.run_cli(*args)
    assert result.returncode == 2 and one_line_error(result) == message


def test_exec_needs_a_command(shim_host):
    result = shim_host.run_cli("exec", "shim", "--")
    assert result.returncode == 2


# --- connection failures ---------------------------------------------------------------------


def _with_host(shim_host, tmp_path, **entry):
    """An inventory with one extra host `x` (entry over the bare host's settings)."""
    return {
        "DFLASHCTL_INVENTORY": str(
            shim_host.write_inventory(tmp_path / "hosts.yaml", {"x": shim_host.host_entry(None, **entry)})
        )
    }


def test_closed_port_exit_3(shim_host, tmp_path):
    with socket.socket() as sock:  # bound but not listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        env = _with_host(shim_host, tmp_path, port=sock.getsockname()[1])
        result = shim_host.run_cli("exec", "x", "--", "true", env=env)
    assert result.returncode == 3
    line = one_line_error(result)
    assert "connection refused" in line and "attempts" in line


def test_unresolvable_address_exit_3(shim_host, tmp_path):
    result = shim_host.run_cli(
        "exec", "x", "--", "true", env=_with_host(shim_host, tmp_path, address="no-such-host.invalid")
    )
    assert result.returncode == 3
    assert "cannot resolve host 'no-such-host.invalid'" in one_line_error(result)


def test_wrong_key_authentication_failed_exit_3(shim_host, tmp_path):
    other = tmp_path / "other_key"
    keygen(other, "stranger")
    result = shim_host.run_cli("exec", "x", "--", "true", env=_with_host(shim_host, tmp_path, identity_file=str(other)))
    assert result.returncode == 3
    assert "authentication failed" in one_line_error(result)


def test_no_banner_is_retried_then_reported(shim_host):
    """A TCP server that never speaks SSH: banner timeout, retried, then one ConnectError."""
    from dflashctl.errors import ConnectError
    from dflashctl.inventory import HostSpec
    from dflashctl.ssh import SshOptions, SshTransport

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: [accepted.append(silent.accept()[0]) for _ in range(2)], daemon=True).start()
    host = HostSpec(name="silent", address="127.0.0.1", port=silent.getsockname()[1])
    transport = SshTransport(
        host, SshOptions(home=shim_host.home, agent=False, connect_timeout=0.5, attempts=2, backoff_s=0.1)
    )
    try:
        with pytest.raises(ConnectError, match="no SSH banner.*after 2 attempts"):
            transport.run(["true"])
    finally:
        silent.close()
        for conn in accepted:
            conn.close()
    assert len(accepted) == 2


# --- host keys ---------------------------------------------------------------------------------


def test_unknown_host_key_refused_then_trust_then_connect(shim_host, tmp_path):
    home = shim_host.make_home(tmp_path / "home", trusted=False)
    env = {"HOME": str(home)}
    refused = shim_host.run_cli("exec", "shim", "--", "true", env=env)
    assert refused.returncode == 3
    line = one_line_error(refused)
    assert "unknown host key" in line and "dflashctl hosts trust shim" in line

    trusted = shim_host.run_cli("hosts", "trust", "shim", "--yes", env=env)
    assert trusted.returncode == 0, trusted.stderr
    expected = subprocess.run(["ssh-keygen", "-lf", f"{shim_host.host_key}.pub"], capture_output=True, text=True).stdout
    assert expected.split()[1] in trusted.stdout  # same SHA256:... as ssh-keygen -lf
    assert shim_host.run_cli("exec", "shim", "--", "true", env=env).returncode == 0
    again = shim_host.run_cli("hosts", "trust", "shim", "--yes", env=env)
    assert again.returncode == 0 and "already trusted" in again.stdout
    assert (home / ".ssh" / "known_hosts").read_text().count(f"[127.0.0.1]:{shim_host.port}") == 1


def test_trust_asks_and_no_records_nothing(shim_host, tmp_path):
    home = shim_host.make_home(tmp_path / "home", trusted=False)
    declined = shim_host.run_cli("hosts", "trust", "shim", input="n\n", env={"HOME": str(home)})
    assert declined.returncode == 1
    assert "not trusted" in one_line_error(declined)
    assert (home / ".ssh" / "known_hosts").read_text() == ""
    unanswered = shim_host.run_cli("hosts", "trust", "shim", env={"HOME": str(home)})  # stdin at its end
    assert unanswered.returncode == 1 and "not trusted" in one_line_error(unanswered)  # was `interrupted`, 130
    accepted = shim_host.run_cli("hosts", "trust", "shim", input="y\n", env={"HOME": str(home)})
    assert accepted.returncode == 0 and "SHA256:" in accepted.stdout


def test_changed_host_key_always_refused(shim_host, tmp_path):
    home = shim_host.make_home(tmp_path / "home")
    impostor = keygen(tmp_path / "impostor", "impostor").split()
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{shim_host.port} {impostor[0]} {impostor[1]}\n")
    env = {"HOME": str(home)}
    result = shim_host.run_cli("exec", "shim", "--", "true", env=env)
    assert result.returncode == 3
    assert "has CHANGED" in one_line_error(result)
    trust = shim_host.run_cli("hosts", "trust", "shim", "--yes", env=env)
    assert trust.returncode == 3
    assert "refusing to replace" in one_line_error(trust)


def test_hashed_known_hosts_entry_is_accepted(shim_host, tmp_path):
    home = shim_host.make_home(tmp_path / "home")
    subprocess.run(["ssh-keygen", "-H", "-f", str(home / ".ssh" / "known_hosts")], check=True, capture_output=True)
    assert "|1|" in (home / ".ssh" / "known_hosts").read_text()
    assert shim_host.run_cli("exec", "shim", "--", "true", env={"HOME": str(home)}).returncode == 0


# --- ~/.ssh/config -----------------------------------------------------------------------------


def test_ssh_config_alias_and_proxy_jump(shim_host, tmp_path):
    """`address: gpubox` resolves through ~/.ssh/config; ProxyJump hops through the same sshd."""
    home = shim_host.make_home(tmp_path / "home")
    (home / ".ssh" / "config").write_text(
        f"Host gpubox\n  HostName 127.0.0.1\n  Port {shim_host.port}\n  User {shim_host.user}\n"
        f"  IdentityFile {home}/.ssh/id_ed25519\n"
    )
    extra = {
        "alias": {
            "address": "gpubox",
            "persist": 0,
            "container": {"runtime": "pct", "vmid": 200, "pct": str(shim_host.pct_path)},
        },
        "jumped": shim_host.host_entry(None, proxy_jump=f"{shim_host.user}@127.0.0.1:{shim_host.port}"),
    }
    env = {"HOME": str(home), "DFLASHCTL_INVENTORY": str(shim_host.write_inventory(tmp_path / "hosts.yaml", extra))}
    via_alias = shim_host.run_cli("exec", "alias", "--", "sh", "-c", 'echo "$HOME"', env=env)
    assert via_alias.returncode == 0, via_alias.stderr
    assert via_alias.stdout.strip() == str(shim_host.container_dir(200))
    via_jump = shim_host.run_cli("exec", "jumped", "--", "sh", "-c", "exit 5", env=env)
    assert via_jump.returncode == 5, via_jump.stderr


def test_ssh_config_match_exec_is_honoured(shim_host, tmp_path):
    """`Match exec` needs invoke, which dflashctl only imports for such configs: it must still work."""
    home = shim_host.make_home(tmp_path / "home")
    (home / ".ssh" / "config").write_text(
        f'Match host gpubox exec "true"\n  HostName 127.0.0.1\n  Port {shim_host.port}\n'
        f"  User {shim_host.user}\n  IdentityFile {home}/.ssh/id_ed25519\n"
    )
    extra = {"alias": {"address": "gpubox"}}
    env = {"HOME": str(home), "DFLASHCTL_INVENTORY": str(shim_host.write_inventory(tmp_path / "hosts.yaml", extra))}
    result = shim_host.run_cli("exec", "alias", "--", "sh", "-c", "exit 6", env=env)
    assert result.returncode == 6, result.stderr


# --- global options ------------------------------------------------------------------------------


def test_version_and_help(shim_host):
    assert shim_host.run_cli("--version").stdout.startswith("dflashctl ")
    for args in (["exec", "--help"], ["hosts", "trust", "--help"]):
        result = shim_host.run_cli(*args)
        assert result.returncode == 0 and "Usage" in result.stdout, args
    # Arguments' help is shown too (typer < 0.26 lost it with click 8.5: pinned below that).
    pull = shim_host.run_cli("runs", "pull", "--help", env={"COLUMNS": "200"})
    assert "Host (default host if omitted; a single non-host argument is a RUN)." in pull.stdout, pull.stdout
