"""dflashctl's programs in the container installed by content hash (dflashctl/agent.py): through
real sshd + the pct shim, and on `local`. Installed once and reused, reinstalled when the content
changes, and at home under a workdir whose path a shell would mangle.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml
from runs_helpers import local_session
from sshd import SHIM_VMID

from dflashctl import agent
from dflashctl.remote.agent import KEEP
from dflashctl.runs import call, list_runs

HOSTILE = "w $(touch PWNED) `id` 'q\" ü;x"


def installed(workdir: Path) -> list[Path]:
    """The agent versions installed under workdir."""
    return sorted((workdir / ".agent").iterdir()) if (workdir / ".agent").exists() else []


@pytest.fixture
def changed_agent(tmp_path, monkeypatch):
    """This dflashctl's agent with `runctl list` answering one more key: another content hash."""
    copy = tmp_path / "remote"
    shutil.copytree(agent.REMOTE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    listing = copy / "runctl" / "listing.py"
    text = listing.read_text()
    listing.write_text(text.replace('emit({"runs": ', 'emit({"changed": True, "runs": ', 1))
    assert listing.read_text() != text
    monkeypatch.setattr(agent, "REMOTE", copy)
    agent.bundle.cache_clear()
    yield
    agent.bundle.cache_clear()


def test_the_call_sends_a_small_launcher_not_the_program(shim_host):
    with shim_host.session() as session:
        argv = agent.agent_argv(session.target("shim"), "runctl", ["list", "w"])
    assert sum(len(a) for a in argv) < 4000  # was the whole runctl source: 43 kB on every call
    assert len(agent.bundle()[1]) > 30000


def test_installed_once_then_reused_then_replaced_when_it_changes(shim_host, request):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    with shim_host.session() as session:
        target = session.target("shim")
        assert list_runs(target) == []
        (first,) = installed(workdir)
        assert first.name == agent.bundle()[0] and (first / "dflashctl_agent" / "runctl" / "__main__.py").is_file()
        inode = first.stat().st_ino
        assert list_runs(target) == []  # the second call finds it: nothing is installed again
        assert installed(workdir) == [first] and first.stat().st_ino == inode
        changed = request.getfixturevalue("changed_agent")  # noqa: F841 - the fixture patches agent
        assert call(target, "list", [target.host.workdir]) == {"changed": True, "runs": []}
    second = [p for p in installed(workdir) if p != first]
    assert len(second) == 1 and second[0].name != first.name


def test_a_hostile_workdir_path_over_ssh(shim_host, tmp_path):
    workdir = shim_host.container_dir(SHIM_VMID) / HOSTILE
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(
        yaml.safe_dump({"default": "shim", "hosts": {"shim": shim_host.host_entry(SHIM_VMID, workdir=str(workdir))}})
    )
    with shim_host.session(inventory=inventory) as session:
        assert list_runs(session.target("shim")) == [] and list_runs(session.target("shim")) == []
    assert [p.name for p in installed(workdir)] == [agent.bundle()[0]]
    assert not list(shim_host.container_dir(SHIM_VMID).rglob("PWNED")) and not Path("PWNED").exists()


def test_local_installs_under_a_hostile_workdir(tmp_path):
    workdir = tmp_path / HOSTILE
    with local_session(workdir) as session:
        target = session.target(None)
        assert list_runs(target) == [] and list_runs(target) == []
    assert [p.name for p in installed(workdir)] == [agent.bundle()[0]]
    assert not list(tmp_path.rglob("PWNED"))


def test_install_keeps_a_few_versions(tmp_path):
    workdir = tmp_path / "work"
    for i in range(KEEP + 2):
        old = workdir / ".agent" / f"old{i}"
        old.mkdir(parents=True)
        os.utime(old, (1e9 + i, 1e9 + i))  # long ago: older than the install below
    with local_session(workdir) as session:
        list_runs(session.target(None))
    names = [p.name for p in installed(workdir)]
    assert agent.bundle()[0] in names and len(names) == KEEP and "old0" not in names
