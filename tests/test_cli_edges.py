"""Bad input at the CLI (issue 18): each is one line and a documented exit code, through the real
sshd and pct shim: non-UTF-8 arguments, bad identity files, host keys of another type,
`runs stop` with nothing running, a word that is neither host nor run, torch missing for doctor."""

from __future__ import annotations

import json
import subprocess
import venv

import pytest
from runs_helpers import install_standin
from sshd import CLI, SHIM_VMID, keygen, run_main_in_process


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("where", ["shim", "local"])
def test_arguments_that_are_not_utf8_pass_through_as_bytes(shim_host, where):
    hostile = [b"\xff", b"caf\xe9", b"\xc3\x28 mixed \xe2\x82\xac", b"-n", b"\x80\x81\x82"]
    for arg in hostile:
        res = subprocess.run(
            [*CLI, "exec", where, "--", "printf", "%s", arg], env=shim_host.env, capture_output=True, timeout=60
        )
        assert res.returncode == 0 and res.stdout == arg, (arg, res.stderr)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: d / "nope", "no such file"),
        (lambda d: d, "is a directory"),
        (lambda d: (d / "junk").write_text("hello\n") and d / "junk", "is not a private key"),
        (lambda d: d / "id.pub", "is a public key"),
        (
            lambda d: (
                (d / "broken").write_text(
                    "-----BEGIN OPENSSH PRIVATE KEY-----\nbm90IGEga2V5\n-----END OPENSSH PRIVATE KEY-----\n"
                )
                and d / "broken"
            ),
            "cannot be loaded",
        ),
    ],
)
def test_a_bad_identity_file_names_the_file_and_the_field(shim_host, tmp_path, make, words):
    keys = tmp_path / "keys"
    keys.mkdir()
    keygen(keys / "id", "test")
    path = make(keys)
    inventory = shim_host.write_inventory(
        tmp_path / "hosts.yaml", {"k": shim_host.host_entry(200, identity_file=str(path))}
    )
    res = shim_host.run_cli("exec", "k", "--", "true", env={"DFLASHCTL_INVENTORY": str(inventory)})
    assert res.returncode == 2
    # The inventory's full path, as every other hosts.yaml error: the file may be any of four places.
    assert one_line(res).startswith(f"error: {inventory}: host 'k': identity_file {path}: {words}")


def test_a_key_of_another_type_on_record_is_not_presented_as_new(shim_host, tmp_path):
    home = shim_host.make_home(tmp_path / "home")
    other = tmp_path / "rsa"
    subprocess.run(["ssh-keygen", "-q", "-t", "rsa", "-b", "2048", "-N", "", "-f", str(other)], check=True)
    kind, blob = other.with_suffix(".pub").read_text().split()[:2]
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{shim_host.port} {kind} {blob}\n")
    env = {"HOME": str(home)}
    connect = shim_host.run_cli("exec", "shim", "--", "true", env=env)
    assert connect.returncode == 3 and "has CHANGED" in one_line(connect) and "ssh-keygen -R" in one_line(connect)
    trust = shim_host.run_cli("hosts", "trust", "shim", "--yes", env=env)
    assert trust.returncode == 3 and "ssh-keygen -R" in one_line(trust)
    assert "offers a ssh-ed25519 key SHA256:" in one_line(trust)
    assert "a different key is already known for this host (ssh-rsa SHA256:" in one_line(trust)
    assert (home / ".ssh" / "known_hosts").read_text().count("\n") == 1  # nothing added
    checks = {
        c["name"]: c
        for c in json.loads(shim_host.run_cli("hosts", "check", "shim", "--json", env=env).stdout)["checks"]
    }
    assert "hosts trust shim" not in checks["reachable"]["hint"] and "ssh-keygen -R" in checks["reachable"]["hint"]


def test_runs_stop_with_nothing_running_says_so_first(shim_host):
    install_standin(shim_host.container_dir(SHIM_VMID) / "work" / "payload")
    done = shim_host.run_cli("train", "shim", "--no-push", "--set", "run.steps=1", "--follow")
    assert done.returncode == 0
    res = shim_host.run_cli("runs", "stop", "shim")
    assert res.returncode == 5 and one_line(res) == "error: no running run on shim (pct 200)"
    stopped = shim_host.run_cli("runs", "stop", "stopped")
    assert stopped.returncode == 4 and "stopping" not in stopped.stderr and "201" in one_line(stopped)


def test_a_word_that_is_neither_host_nor_run_says_both(shim_host):
    install_standin(shim_host.container_dir(SHIM_VMID) / "work" / "payload")
    assert shim_host.run_cli("train", "shim", "--no-push", "--set", "run.steps=1", "--follow").returncode == 0
    for args in (["logs", "tail", "nosuch"], ["runs", "show", "nosuch"], ["runs", "stop", "nosuch"]):
        res = shim_host.run_cli(*args)
        assert res.returncode == 5, args
        line = one_line(res)
        assert (
            line.startswith("error: 'nosuch' is neither a host in the inventory (hosts: ")
            and "nor a run on shim" in line
        )


def test_a_word_that_is_neither_host_nor_run_says_both_before_the_first_run(tmp_path):
    """On a fresh machine (no hosts.yaml, no runs) `runs show gpu1` meant a host: `local: no runs yet` hid that."""
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for args in (("runs", "show", "gpu1"), ("logs", "tail", "gpu1"), ("runs", "stop", "gpu1"), ("eval", "gpu1")):
        res = run_main_in_process(args, env, tmp_path)
        assert res.returncode == 5, args
        line = one_line(res)
        assert line.startswith(
            "error: 'gpu1' is neither a host in the inventory (hosts: local) nor a run on local (no runs yet)"
        ), line


def test_doctor_without_torch_is_exit_4_like_inspect(shim_host, tmp_path):
    bare = tmp_path / "bare"
    venv.EnvBuilder(with_pip=False).create(bare)
    inventory = shim_host.write_inventory(
        tmp_path / "hosts.yaml", {"notorch": shim_host.host_entry(200, python=str(bare / "bin" / "python"))}
    )
    env = {"DFLASHCTL_INVENTORY": str(inventory)}
    doctor = shim_host.run_cli("doctor", "notorch", "--quick", env=env, timeout=120)
    inspect = shim_host.run_cli("inspect", "compile_fx", "-H", "notorch", env=env)
    assert doctor.returncode == inspect.returncode == 4
    assert "torch is not installed for" in one_line(doctor) and "torch is not installed for" in one_line(inspect)
