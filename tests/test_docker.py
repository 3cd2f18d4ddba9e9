"""Docker containers end to end: real sshd, the docker test shim (tests/shims/docker), the CLI.

The shim honours the `docker exec -i NAME CMD...` contract dflashctl relies on (argv exec'd with no
shell, exit codes passed through, the daemon's "is not running" / "No such container" errors);
the hosts are `dock` (container `trainer`, running) and `dockstop` (`halted`, exited). Hostile
arguments through `docker exec` are tested with pct's in test_quoting.py.
"""

from __future__ import annotations

import json
import pytest
from runs_helpers import install_standin
from sshd import DOCKER_NAME
from test_exec import one_line_error
from test_hosts import rows


def test_exit_code_streams_stdin_and_cwd_pass_through(shim_host):
    result = shim_host.run_cli("exec", "dock", "--", "sh", "-c", "pwd; cat; echo oops >&2; exit 42", input="fed\n")
    assert result.returncode == 42
    assert result.stdout == f"{shim_host.docker_dir(DOCKER_NAME)}\nfed\n" and result.stderr == "oops\n"


@pytest.mark.parametrize(
    "host,extra,message",
    [
        (
            "dockstop",
            None,
            "error: dockstop: docker container 'halted' is not running (start it with `docker start halted`)",
        ),
        ("ghost", {"name": "ghost"}, "error: ghost: no docker container named 'ghost' (see `docker ps -a`)"),
        (
            "nodocker",
            {"docker": "/nonexistent/docker"},
            "error: nodocker: `/nonexistent/docker` not found on the host (set container.docker)",
        ),
    ],
)
def test_unusable_container_is_exit_4_with_one_line(shim_host, tmp_path, host, extra, message):
    env = {}
    if extra:
        entry = shim_host.docker_entry(DOCKER_NAME)
        entry["container"].update(extra)
        env["DFLASHCTL_INVENTORY"] = str(shim_host.write_inventory(tmp_path / "hosts.yaml", {host: entry}))
    result = shim_host.run_cli("exec", host, "--", "true", env=env)
    assert result.returncode == 4
    assert one_line_error(result) == message


def test_missing_program_in_the_container_is_exit_4(shim_host):
    result = shim_host.run_cli("exec", "dock", "--", "no-such-program-xyz")
    assert result.returncode == 4
    assert one_line_error(result) == "error: dock (docker trainer): `no-such-program-xyz` not found"


def test_hosts_check_reads_the_container_state(shim_host):
    running = rows(shim_host.run_cli("hosts", "check", "dock", "--json"))
    assert running["container"]["ok"] and running["container"]["detail"] == "docker trainer running"
    assert running["interpreter"]["ok"]
    stopped = shim_host.run_cli("hosts", "check", "dockstop", "--json")
    checks = rows(stopped)
    assert stopped.returncode == 1 and not checks["container"]["ok"]
    assert checks["container"]["detail"] == "docker halted is not running (false)"
    assert checks["container"]["hint"] == "docker start halted"


def test_train_pushes_runs_and_follows_inside_the_container(shim_host, tmp_path):
    source = install_standin(tmp_path / "payload_src")
    res = shim_host.run_cli("train", "dock", "--source", str(source), "--follow", "--set", "run.steps=3")
    assert res.returncode == 0, res.stderr
    assert "step 3/3" in res.stdout and "standin: done" in res.stdout
    workdir = shim_host.docker_dir(DOCKER_NAME) / "work"
    (run_json,) = workdir.glob("runs/*/run.json")
    assert json.loads(run_json.read_text())["payload_hash"]  # pushed into the container's workdir
    assert (run_json.parent / "exit_code").read_text().strip() == "0"
    listing = shim_host.run_cli("runs", "list", "dock")
    assert listing.returncode == 0 and run_json.parent.name in listing.stdout and "succeeded" in listing.stdout
    assert "hosts" not in listing.stdout  # one host listed: no host column


def test_runs_list_over_two_hosts_names_each_runs_host(shim_host, tmp_path):
    source = install_standin(tmp_path / "payload_src")
    ids = {}
    for host in ("dock", "shim"):
        res = shim_host.run_cli("train", host, "--source", str(source), "--follow", "--set", "run.steps=2")
        assert res.returncode == 0, res.stderr
        ids[host] = res.stderr.split("started run ")[1].split()[0]
    listed = shim_host.run_cli("runs", "list", "dock,shim")
    assert listed.returncode == 0, listed.stderr
    header, *lines = listed.stdout.splitlines()  # in a pipe: plain columns, one run per line
    assert header.split() == [
        "RUN",
        "NAME",
        "KIND",
        "STATE",
        "HOSTS",
        "GPUS",
        "STARTED",
        "DURATION",
        "STEP",
        "LOSS",
        "TAU",
    ]
    rows = {line.split()[0]: line.split() for line in lines}
    assert {host: rows[run_id][4] for host, run_id in ids.items()} == {"dock": "dock", "shim": "shim"}
    assert all(
        rows[run_id][2:4] == ["train", "succeeded"] for run_id in ids.values()
    )  # whole words: `| grep succeeded`
    # A host that cannot be listed does not hide the others' runs: one error line each, its exit code.
    partial = shim_host.run_cli("runs", "list", "dock,dockstop,shim", "--json")
    assert partial.returncode == 4 and "Traceback" not in partial.stderr
    assert sorted(r["run_id"] for r in json.loads(partial.stdout)) == sorted(ids.values())
    assert partial.stderr.strip().splitlines() == [
        "error: dockstop: docker container 'halted' is not running (start it with `docker start halted`)"
    ]
    alone = shim_host.run_cli("runs", "list", "dockstop")  # one host: its error alone, no empty table
    assert alone.returncode == 4 and alone.stdout == "" and one_line_error(alone).startswith("error: dockstop: docker")
    both = shim_host.run_cli("runs", "list", "shim", "--all")
    assert both.returncode == 2 and both.stderr.strip() == "error: give HOST or --all, not both"
