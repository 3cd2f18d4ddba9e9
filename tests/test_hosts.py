"""`dflashctl hosts list` and `hosts check`, end to end against the real sshd + pct shim and `local`."""

from __future__ import annotations

import json
import socket
import subprocess

from sshd import CLI, run_main_in_process

from dflashctl.hosts import _interpreter_checks
from dflashctl.inventory import HostSpec


def rows(result: subprocess.CompletedProcess) -> dict[str, dict]:
    """`hosts check --json` output as {check name: row}."""
    assert "Traceback" not in result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] == (result.returncode == 0)
    return {row["name"]: row for row in doc["checks"]}


def test_hosts_list_shows_every_host_and_the_default(shim_host):
    result = shim_host.run_cli("hosts", "list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    shim_line = next(line for line in lines if " shim " in line)
    assert "*" in shim_line and "pct 200" in shim_line and f"127.0.0.1:{shim_host.port}" in shim_line
    for name in ("stopped", "bare", "local"):
        assert any(f" {name} " in line for line in lines), name


def test_check_passes_on_shim_host_and_local(shim_host):
    """Both checks import torch remotely, so they run side by side."""
    procs = {
        name: subprocess.Popen(
            [*CLI, "hosts", "check", name, *flags],
            env=shim_host.env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        for name, flags in (("shim", ["--json"]), ("local", []))
    }
    outs = {name: proc.communicate(timeout=300) for name, proc in procs.items()}
    shim = subprocess.CompletedProcess([], procs["shim"].returncode, *outs["shim"])
    assert shim.returncode == 0, shim.stdout + shim.stderr
    checks = rows(shim)
    assert list(checks) == [
        "reachable",
        "container",
        "interpreter",
        "torch",
        "triton",
        "trainer packages",
        "cuda",
        "nvidia-smi",
    ]
    assert checks["container"]["detail"] == "pct 200 running"
    assert checks["torch"]["detail"].startswith("2.")
    local_out, local_err = outs["local"]
    assert procs["local"].returncode == 0, local_out + local_err
    assert "torch" in local_out and "FAIL" not in local_out


def test_check_several_hosts_at_once(shim_host):
    result = shim_host.run_cli("hosts", "check", "shim,stopped", "--json", timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and [(h["host"], h["ok"]) for h in doc["hosts"]] == [("shim", True), ("stopped", False)]
    by_host = {h["host"]: {c["name"]: c for c in h["checks"]} for h in doc["hosts"]}
    assert by_host["shim"]["torch"]["ok"] and by_host["stopped"]["container"]["hint"] == "pct start 201"
    table = shim_host.run_cli("hosts", "check", "stopped,dockstop")
    assert table.returncode == 1
    lines = table.stdout.strip().splitlines()
    assert lines[0].split() == ["HOST", "CHECK", "STATUS", "DETAIL"]  # in a pipe: plain columns, a host per row
    hosts = [line.split()[0] for line in lines[1:] if line.split()[0] in ("stopped", "dockstop") and "FAIL" in line]
    assert hosts == ["stopped", "dockstop"]
    assert "stopped container: " in table.stdout and "hint: pct start 201" in table.stdout  # below the table
    assert lines[-1] == "0 of 2 hosts ok; failing: stopped, dockstop"


def test_a_host_named_twice_is_checked_once(tmp_path):
    """`hosts check local,local` (and `runs list local,local`) showed every row twice."""
    res = run_main_in_process(("hosts", "check", "local,local", "--json"), {"HOME": str(tmp_path)}, tmp_path)
    doc = json.loads(res.stdout)
    assert res.returncode == 0 and "hosts" not in doc and doc["ok"], res.stdout + res.stderr


def test_check_all_and_a_host_exclude_each_other(shim_host):
    result = shim_host.run_cli("hosts", "check", "shim", "--all")
    assert result.returncode == 2 and result.stderr.strip() == "error: give HOST or --all, not both"


def test_check_stopped_container_fails_with_hint(shim_host):
    result = shim_host.run_cli("hosts", "check", "stopped", "--json")
    assert result.returncode == 1
    checks = rows(result)
    assert checks["reachable"]["ok"] and not checks["container"]["ok"]
    assert checks["container"]["hint"] == "pct start 201"
    assert "interpreter" not in checks  # nothing to run it in


def test_check_unreachable_host_is_a_failed_row(shim_host, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        inventory = shim_host.write_inventory(
            tmp_path / "hosts.yaml", {"x": shim_host.host_entry(None, port=sock.getsockname()[1])}
        )
        result = shim_host.run_cli("hosts", "check", "x", env={"DFLASHCTL_INVENTORY": str(inventory)})
    assert result.returncode == 1
    assert "reachable" in result.stdout and "FAIL" in result.stdout and "connection refused" in result.stdout
    assert "Traceback" not in result.stderr


def test_check_unknown_key_hints_trust(shim_host, tmp_path):
    home = shim_host.make_home(tmp_path / "home", trusted=False)
    checks = rows(shim_host.run_cli("hosts", "check", "bare", "--json", env={"HOME": str(home)}))
    assert not checks["reachable"]["ok"] and checks["reachable"]["hint"] == "dflashctl hosts trust bare"


def test_check_missing_interpreter(shim_host, tmp_path):
    inventory = shim_host.write_inventory(
        tmp_path / "hosts.yaml", {"nopy": shim_host.host_entry(200, python="/nonexistent/python3")}
    )
    result = shim_host.run_cli("hosts", "check", "nopy", "--json", env={"DFLASHCTL_INVENTORY": str(inventory)})
    assert result.returncode == 1
    checks = rows(result)
    assert checks["container"]["ok"] and not checks["interpreter"]["ok"]
    assert "/nonexistent/python3" in checks["interpreter"]["detail"]


def test_gpu_rows_from_probe_answers():
    """Row logic for GPU hosts, which CI does not have (the probe's JSON is the interface)."""
    gpu_host = HostSpec(name="g", gpus=(0, 1))
    no_cuda = {
        c.name: c for c in _interpreter_checks(gpu_host, {"python": "3.11", "torch": "2.13.0", "nvidia_smi": None})
    }
    assert not no_cuda["cuda"].ok and not no_cuda["nvidia-smi"].ok and not no_cuda["triton"].ok
    answer = {
        "python": "3.11",
        "torch": "2.13.0",
        "triton": "3.5.0",
        "cuda_available": True,
        "cuda_version": "12.8",
        "gpu_count": 2,
        "gpu_names": ["NVIDIA H200", "NVIDIA H200"],
        "packages": {"numpy": "2.1.0", "safetensors": "0.4.5", "yaml": "6.0.2"},
        "nvidia_smi": {
            "gpus": [
                {
                    "index": "0",
                    "name": "NVIDIA H200",
                    "memory_total_mib": "143771",
                    "memory_used_mib": "0",
                    "utilization_pct": "0",
                }
            ]
        },
    }
    ok = {c.name: c for c in _interpreter_checks(gpu_host, answer)}
    assert all(c.ok for c in ok.values()) and "2 GPU(s)" in ok["cuda"].detail
    three = {c.name: c for c in _interpreter_checks(HostSpec(name="g", gpus=(0, 2)), answer)}
    assert not three["cuda"].ok and "[2]" in three["cuda"].hint
    missing = {
        c.name: c for c in _interpreter_checks(gpu_host, {**answer, "packages": {**answer["packages"], "yaml": None}})
    }
    assert not missing["trainer packages"].ok and missing["trainer packages"].hint.endswith("pip install pyyaml")
