"""Shared fixtures: real OpenSSH servers on loopback with the `pct` and `docker` test shims behind them.

The suite runs in three pytest-xdist worker processes (`-n 3 --dist loadfile`, pyproject.toml): each
file's tests run in order in one worker, beside another file's. So a test may scan /proc or signal
processes only by what is unique to it (its workdir, tmp path, port or run id, or a setting used by
one file alone: standin_trainer.signal_cli), and session fixtures (each sshd) exist once per worker.

Fixture API (all objects are `tests/sshd.py:SshdHost`):

`sshd_host` (session scope): sshd on 127.0.0.1, a free port, temp ed25519 host key, client key
and authorized_keys; root may log in by key only. Attributes:
  address, port, user             where it listens and who logs in (the current user)
  home                            client HOME: .ssh/id_ed25519 and .ssh/known_hosts trusting
                                  `[127.0.0.1]:PORT` (no .ssh/config)
  remote_home                     HOME of ssh sessions on the server side (sshd SetEnv), so the
                                  machine's ~/.bashrc stays out of the tests
  containers_root, pct_path       shim containers (one directory each) and the installed shim
  docker_root, docker_path        the same for the docker shim (tests/shims/docker)
  inventory_path                  hosts.yaml: `shim` (pct 200, running, python = sys.executable,
                                  workdir in the container; the default), `stopped` (pct 201,
                                  stopped), `bare` (runtime none), `dock` (docker shim container
                                  `trainer`, running), `dockstop` (docker `halted`, exited)
  env                             os.environ + HOME=home + DFLASHCTL_INVENTORY=inventory_path,
                                  without SSH_AUTH_SOCK; NO_COLOR=1, COLUMNS=200
Methods:
  container_dir(vmid) -> Path     the container's directory (HOME and cwd inside it)
  docker_dir(name) -> Path        the same for a docker shim container
  add_docker(name, running)       create (or empty) another docker shim container
  set_running(vmid, bool)         start/stop a shim container
  add_container(vmid, running)    create (or empty) another container
  reset()                         containers back to: 200 running and empty, 201 stopped;
                                  docker `trainer` running and empty, `halted` exited
  session(home=None, inventory=None) -> Session   in-process, SshOptions(home=...), no agent
  kill_connections() -> int       SIGKILL the per-connection sshd processes (listener stays up)
  run_cli(*args, input=None, timeout=60, env=None, cwd=None, binary=False, process=False)
                                  run dflashctl with env (+ overrides): main() in-process, or a
                                  subprocess when process=True, input or binary is given, or
                                  called from a thread; text mode unless binary=True or input is bytes
  make_home(dir, trusted=True)    a fresh client HOME with the same key (known_hosts empty if not trusted)
  write_known_hosts(home, trusted), host_key_line(), host_entry(vmid|None, **extra),
  write_inventory(path=None, extra_hosts=None)
  link(other)                     let this host's client HOME log in to another SshdHost too

`shim_host` (function scope): `sshd_host` after reset(); use it when a test touches containers.
`shim_container` (function scope): reset, then the `shim` host's container directory (vmid 200).
`second_sshd_host` (session scope): the same on 127.0.0.2 (its own keys, HOME and inventory).
`few_sessions_host` (session scope): the same on 127.0.0.3 with `MaxSessions 3` (the others allow
  64), so that a few concurrent commands exceed what one connection may carry.
  Multi-host: `sshd_host.link(second_sshd_host)`, then
  `sshd_host.write_inventory(path, {"gpu2": second_sshd_host.host_entry(200)})` and use
  `sshd_host.session(inventory=path)` or `run_cli(..., env={"DFLASHCTL_INVENTORY": str(path)})`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from sshd import SHIM_VMID, SshdHost

# The files that take longest on 2 busy cores, longest first: per-file totals of a whole run with a
# cold compile cache, as on a fresh CI machine (`pytest --junitxml=...`, the times summed by file;
# a warm cache shortens the compiling files: test_fastpath.py 58 s cold, 5 s warm). xdist hands
# out whole files (--dist loadfile) in collection order (--no-loadscope-reorder, pyproject.toml):
# starting the long ones first keeps one of them from running alone at the end while the other
# workers sit idle (test_restarts.py, when absent here, ran last: 42 s, most of it a hook's 30 s
# wait, the other two workers done for the last 35 s of it). Every other file follows in its usual order.
# Re-measure when a file grows; a stale entry only costs time, never a result.
LONGEST_FIRST = [
    "tests/test_doctor.py",
    "tests/test_multihost.py",
    "tests/payload/test_warmup.py",
    "tests/payload/test_workers.py",
    "tests/test_exec_interrupt.py",
    "tests/test_eval.py",
    "tests/payload/test_fastpath.py",
    "tests/payload/test_quality.py",
    "tests/payload/test_speculate.py",
    "tests/payload/test_train.py",
    "tests/test_restarts.py",
    "tests/payload/test_decode.py",
    "tests/test_runs.py",
    "tests/test_pull.py",
    "tests/test_regen_cli.py",
    "tests/test_train_cli.py",
    "tests/payload/test_launcher.py",
    "tests/payload/test_recipe.py",
    "tests/test_inspect.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files in LONGEST_FIRST order, then the rest; a file's own tests keep their order (stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    root = config.rootpath

    def key(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(root).as_posix(), len(rank))

    items.sort(key=key)


_STARTING_ENVIRONMENT = dict(os.environ)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """os.environ as this worker started, after each test. Code run in-process may set variables
    that later subprocesses would inherit: torch's first compile in a process sets
    TORCHINDUCTOR_CACHE_DIR to its default, and a trainer started after that used that shared
    cache instead of its own run.compile_cache_dir (the environment wins), so a cold-cache test
    found it warm. The snapshot is the worker's start, not each test's: a module-scoped fixture
    that compiles runs before a test's own snapshot would be taken."""
    yield
    wanted = dict(_STARTING_ENVIRONMENT)
    if "PYTEST_CURRENT_TEST" in os.environ:  # pytest's own, removed by pytest after teardown
        wanted["PYTEST_CURRENT_TEST"] = os.environ["PYTEST_CURRENT_TEST"]
    if os.environ != wanted:
        os.environ.clear()
        os.environ.update(wanted)


def _require_sshd() -> None:
    if not Path("/usr/sbin/sshd").exists() or shutil.which("ssh-keygen") is None:
        pytest.skip("openssh-server is not installed (apt-get install openssh-server)")


def _sshd(tmp_path_factory: pytest.TempPathFactory, address: str, max_sessions: int = 64) -> Iterator[SshdHost]:
    _require_sshd()
    host = SshdHost(tmp_path_factory.mktemp(f"sshd-{address}"), address, max_sessions).start()
    try:
        yield host
    finally:
        host.stop()


@pytest.fixture(scope="session")
def sshd_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdHost]:
    """A real sshd on 127.0.0.1 with the pct shim (see module docstring)."""
    yield from _sshd(tmp_path_factory, "127.0.0.1")


@pytest.fixture(scope="session")
def second_sshd_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdHost]:
    """A second, independent sshd on 127.0.0.2, for multi-host tests."""
    yield from _sshd(tmp_path_factory, "127.0.0.2")


@pytest.fixture(scope="session")
def few_sessions_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdHost]:
    """A real sshd on 127.0.0.3 that allows only 3 sessions per connection."""
    yield from _sshd(tmp_path_factory, "127.0.0.3", max_sessions=3)


@pytest.fixture
def shim_host(sshd_host: SshdHost) -> SshdHost:
    """sshd_host with its containers reset to the initial state."""
    sshd_host.reset()
    return sshd_host


@pytest.fixture
def shim_container(shim_host: SshdHost) -> Path:
    """The (freshly emptied, running) directory of the `shim` host's container 200."""
    return shim_host.container_dir(SHIM_VMID)
