"""hosts.yaml: lookup order and validation messages that name the file, the host and the field."""

from __future__ import annotations

import os
import subprocess

import pytest
from sshd import CLI, run_main_in_process

from dflashctl.errors import UsageError
from dflashctl.inventory import completions, load_inventory, parse_inventory


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "hosts:\n  gpu1:\n    container: {runtime: pct, vmid: abc}\n",
            "hosts.yaml: host 'gpu1': container.vmid must be an integer, got 'abc'",
        ),
        ("hosts:\n  gpu1:\n    port: 70000\n", "hosts.yaml: host 'gpu1': port must be an integer 1-65535, got 70000"),
        (
            "hosts:\n  gpu1:\n    transport: telnet\n",
            "hosts.yaml: host 'gpu1': transport must be one of ssh, local, got 'telnet'",
        ),
        ("hosts:\n  gpu1:\n    adress: x\n", "hosts.yaml: host 'gpu1': unknown field 'adress'"),
        (
            "hosts:\n  gpu1:\n    container: {runtime: docker}\n",
            "hosts.yaml: host 'gpu1': container.name is required for runtime docker (the container's name or id)",
        ),
        (
            "hosts:\n  gpu1:\n    container: {runtime: lxd}\n",
            "hosts.yaml: host 'gpu1': container.runtime must be one of pct, docker, none, got 'lxd'",
        ),
        (
            "hosts:\n  gpu1:\n    container: {runtime: pct, vmid: 200, docker: podman}\n",
            "hosts.yaml: host 'gpu1': container.docker needs container.runtime docker",
        ),
        (
            "hosts:\n  gpu1:\n    container: {runtime: docker, name: '-it'}\n",
            "hosts.yaml: host 'gpu1': container.name must match [a-zA-Z0-9][a-zA-Z0-9_.-]* "
            "(a docker name or id), got '-it'",
        ),
        (
            "hosts:\n  gpu1:\n    container: {runtime: none, vmid: 200}\n",
            "hosts.yaml: host 'gpu1': container.vmid needs container.runtime pct",
        ),
        (
            "hosts:\n  gpu1:\n    container: {runtime: docker, name: t, docker: ''}\n",
            "hosts.yaml: host 'gpu1': container.docker must be a command or path, got ''",
        ),
        ("hosts:\n  gpu1:\n    gpus: [0, 0]\n", "hosts.yaml: host 'gpu1': gpus lists an index twice: [0, 0]"),
        (
            "hosts:\n  gpu1:\n    fork_server: 30m\n",
            "hosts.yaml: host 'gpu1': fork_server must be a non-negative integer (seconds; 0 = off), got '30m'",
        ),
        (
            "hosts:\n  gpu1:\n    gpus: 2\n",
            "hosts.yaml: host 'gpu1': gpus must be a list of GPU indices like [0, 1], got 2",
        ),
        (
            "hosts:\n  gpu1:\n    on_event: curl x\n",
            "hosts.yaml: host 'gpu1': on_event must be a command as a list of arguments, like [curl, -fsS, URL], "
            "got 'curl x'",
        ),
        (
            "hosts:\n  local:\n    address: 10.0.0.1\n",
            "hosts.yaml: host 'local': address, user, port, identity_file and proxy_jump only apply to transport ssh",
        ),
        ("default: gpu9\nhosts:\n  gpu1: {}\n", "hosts.yaml: default host 'gpu9' is not defined under hosts"),
        ("hosts: [a, b]\n", "hosts.yaml: 'hosts' must be a mapping of host name to settings"),
        (
            "hosts:\n  'a,b': {}\n",
            "hosts.yaml: host 'a,b': a name cannot hold a comma (the command line reads h1,h2 as two hosts)",
        ),
        (
            "hosts:\n  a: {}\ngroups:\n  'x,y': [a]\n",
            "hosts.yaml: group 'x,y': a name cannot hold a comma (the command line reads h1,h2 as two hosts)",
        ),
        ("hosts:\n  gpu1: {address: [}\n", "hosts.yaml: line 2, column 20: expected the node content, but found '}'"),
        (
            "hosts:\n  gpu1:\n    container: {runtime: pct}\n",
            "hosts.yaml: host 'gpu1': container.vmid is required for runtime pct (the container's id, like vmid: 200)",
        ),
        (
            "hosts:\n  gpu1: {}\n  gpu2: {}\n  gpu1: {}\n",
            "hosts.yaml: line 4: duplicate key 'gpu1' in hosts (first on line 2)",
        ),
        (
            "hosts:\n  gpu1:\n    port: 22\n    user: a\n    port: 23\n",
            "hosts.yaml: line 5: duplicate key 'port' in hosts.gpu1 (first on line 3)",
        ),
        ("hosts:\n  gpu1: {workdir: 2024-13-45}\n", "hosts.yaml: line 2, column 19: bad value: month must be in 1..12"),
        (b"hosts:\n  gpu1:\n    user: caf\xe9\n", "hosts.yaml: line 3, column 14: not UTF-8 text (byte 0xe9)"),
    ],
)
def test_validation_messages(text, message):
    with pytest.raises(UsageError) as info:
        parse_inventory(text)
    assert str(info.value).startswith(message)


def test_a_merge_key_may_repeat_what_it_merges():
    inv = parse_inventory("hosts:\n  gpu1: &g {address: h, port: 22}\n  gpu2:\n    <<: *g\n    port: 23\n")
    assert (inv.get("gpu2").address, inv.get("gpu2").port) == ("h", 23)


def test_a_full_host_entry_parses():
    inv = parse_inventory(
        "default: gpu1\nhosts:\n  gpu1:\n    address: 10.1.2.6\n    user: root\n    port: 22\n"
        "    container: {runtime: pct, vmid: 200}\n    python: /root/venv/bin/python\n    gpus: [0, 1]\n"
    )
    host = inv.get(None)
    assert (host.name, host.address, host.user, host.port, host.gpus) == ("gpu1", "10.1.2.6", "root", 22, (0, 1))
    assert (host.container.runtime, host.container.vmid, host.container.executable) == ("pct", 200, "/usr/sbin/pct")
    assert inv.get("local").transport == "local"  # always there


def test_fork_server_is_on_for_ssh_hosts_and_off_for_local_unless_asked():
    inv = parse_inventory(
        "hosts:\n  a: {address: h}\n  b: {address: h, fork_server: 0}\n  c: {transport: local, fork_server: 60}\n"
    )
    assert [inv.get(n).fork_server for n in ("a", "b", "c", "local")] == [1800, 0, 60, 0]


def test_docker_container_defaults_to_docker_and_takes_another_cli():
    inv = parse_inventory(
        "hosts:\n  a: {container: {runtime: docker, name: trainer}}\n"
        "  b: {container: {runtime: docker, name: trainer, docker: /usr/bin/podman}}\n"
    )
    assert inv.get("a").container.executable == "docker" and inv.get("a").container.describe() == "docker trainer"
    assert inv.get("b").container.executable == "/usr/bin/podman"


def test_repo_example_inventory_is_valid():
    from pathlib import Path

    inv = load_inventory(Path(__file__).parent.parent / "hosts.yaml")
    assert inv.default == "local"


def test_cli_reports_bad_inventory_with_exit_2(shim_host, tmp_path):
    bad = tmp_path / "hosts.yaml"
    bad.write_text("hosts:\n  gpu1:\n    container: {runtime: pct, vmid: abc}\n")
    result = shim_host.run_cli("hosts", "list", env={"DFLASHCTL_INVENTORY": str(bad)})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: {bad}: host 'gpu1': container.vmid must be an integer, got 'abc'"


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"hosts:\n  gpu1:\n    \xff\xfe\n", "line 3, column 5: not UTF-8 text (byte 0xff)"),
        (b"hosts:\n  a: {}\n  b: {}\n  a: {}\n", "line 4: duplicate key 'a' in hosts (first on line 2)"),
        (b"hosts:\n  a:\n    port: 22\n    port: 23\n", "line 4: duplicate key 'port' in hosts.a (first on line 3)"),
        (
            b"hosts:\n  a: {container: {runtime: pct}}\n",
            "host 'a': container.vmid is required for runtime pct (the container's id, like vmid: 200)",
        ),
        (
            b"hosts:\n  a:\n    user: root\n  port: [\n",
            "line 5, column 1: expected the node content, but found '<stream end>'",
        ),
    ],
)
def test_a_bad_inventory_file_is_one_line_naming_its_full_path(shim_host, tmp_path, content, problem):
    bad = tmp_path / "hosts.yaml"
    bad.write_bytes(content)
    for args in (("hosts", "list"), ("exec", "shim", "--", "true")):
        result = shim_host.run_cli(*args, env={"DFLASHCTL_INVENTORY": str(bad)})
        assert (result.returncode, result.stderr) == (2, f"error: {bad}: {problem}\n"), args


def test_a_directory_as_the_inventory_is_named_as_such(shim_host, tmp_path):
    for args, env, source in (
        (("-i", str(tmp_path)), {}, ""),
        ((), {"DFLASHCTL_INVENTORY": str(tmp_path)}, " (from $DFLASHCTL_INVENTORY)"),
    ):
        for command in (("hosts", "list"), ("exec", "shim", "--", "true")):
            result = shim_host.run_cli(*args, *command, env=env)
            expected = f"error: inventory file {tmp_path} is a directory, not a file{source}\n"
            assert (result.returncode, result.stderr) == (2, expected), command


def test_lookup_order(shim_host, tmp_path):
    """--inventory, then $DFLASHCTL_INVENTORY, then ./hosts.yaml, then ~/.config/dflashctl/hosts.yaml."""

    def inventory(path, name):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"default: {name}\nhosts:\n  {name}: {{transport: local}}\n")
        return path

    home = tmp_path / "home"
    inventory(home / ".config/dflashctl/hosts.yaml", "from-config")
    cwd = tmp_path / "cwd"
    inventory(cwd / "hosts.yaml", "from-cwd")
    env_file = inventory(tmp_path / "env.yaml", "from-env")
    flag_file = inventory(tmp_path / "flag.yaml", "from-flag")

    def chosen(*args, env_var=""):
        result = shim_host.run_cli(
            *args, "hosts", "list", cwd=cwd, env={"HOME": str(home), "DFLASHCTL_INVENTORY": env_var}
        )
        assert result.returncode == 0, result.stderr
        header, default = result.stdout.splitlines()[:2]  # in a pipe: plain columns, the default host first
        assert header.split()[:2] == ["DEFAULT", "NAME"]
        return default.split()[1]

    assert chosen("--inventory", str(flag_file), env_var=str(env_file)) == "from-flag"
    assert chosen(env_var=str(env_file)) == "from-env"
    assert chosen() == "from-cwd"
    (cwd / "hosts.yaml").unlink()
    assert chosen() == "from-config"


def test_missing_explicit_inventory_exit_2(shim_host, tmp_path):
    result = shim_host.run_cli("--inventory", str(tmp_path / "nope.yaml"), "hosts", "list")
    assert result.returncode == 2
    assert "inventory file not found" in result.stderr and "Traceback" not in result.stderr


def test_an_unknown_host_without_any_hosts_yaml_says_where_one_was_looked_for(tmp_path):
    """A new user's file in another place (or `mkdir -p` of the file's own path) left only `(known: local)`."""
    home, cwd = tmp_path / "home", (tmp_path / "cwd").resolve()
    (home / ".config/dflashctl/hosts.yaml").mkdir(parents=True)
    cwd.mkdir()
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    looked = (
        f"no hosts.yaml found (looked for {cwd}/hosts.yaml, {home}/.config/dflashctl/hosts.yaml (a directory); "
        "--inventory or $DFLASHCTL_INVENTORY names another)"
    )
    res = run_main_in_process(("exec", "gpu1", "--", "true"), env, cwd)
    assert (res.returncode, res.stderr) == (2, f"error: unknown host 'gpu1' (known: local); {looked}\n")
    res = run_main_in_process(("runs", "show", "gpu1"), env, cwd)
    neither = "'gpu1' is neither a host in the inventory (hosts: local) nor a run on local (no runs yet)"
    assert (res.returncode, res.stderr) == (5, f"error: {neither}; {looked}\n")


COMPLETION_INVENTORY = """default: gpu1
hosts:
  gpu1: {address: 10.1.2.6, user: root, container: {runtime: pct, vmid: 200}}
  gpu2: {address: 10.1.2.7, container: {runtime: docker, name: trainer}}
groups:
  all-gpus: [gpu1, gpu2]
"""


def test_completions_list_hosts_and_groups_by_prefix():
    inv = parse_inventory(COMPLETION_INVENTORY)
    assert completions(inv, "") == [
        ("gpu1", "root@10.1.2.6 pct 200"),
        ("gpu2", "10.1.2.7 docker trainer"),
        ("local", "this machine"),
        ("all-gpus", "group: gpu1, gpu2"),
    ]
    assert [name for name, _ in completions(inv, "gpu")] == ["gpu1", "gpu2"]
    assert completions(inv, "zz") == []


@pytest.mark.parametrize(
    "words,expected",
    [
        ("dflashctl logs tail g", ["gpu1", "gpu2"]),
        ("dflashctl --inventory {inv} inspect compile_fx -H a", ["all-gpus"]),
        ("dflashctl --inventory /nonexistent.yaml exec ", []),  # a broken inventory completes nothing, silently
    ],
)
def test_shell_completion_of_host_arguments(tmp_path, words, expected):
    inv = tmp_path / "hosts.yaml"
    inv.write_text(COMPLETION_INVENTORY)
    words = words.format(inv=inv)
    env = {
        **os.environ,
        "DFLASHCTL_INVENTORY": str(inv),
        "_DFLASHCTL_COMPLETE": "complete_bash",
        "COMP_WORDS": words,
        "COMP_CWORD": str(len(words.split(" ")) - 1),
    }
    result = subprocess.run(CLI, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.split() == expected
