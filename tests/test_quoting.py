"""Arguments reach the container byte-exact: argv lists, `shlex.join`, never pasted strings (pct and docker)."""

from __future__ import annotations

import shlex
from typing import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashctl.containers import Target, wrap_argv
from dflashctl.inventory import ContainerSpec, HostSpec
from dflashctl.transport import env_argv
from dflashctl.transport import Completed, Process, Transport

HOSTILE = [
    "",
    " ",
    "'",
    '"',
    "\\",
    "$(id)",
    "`id`",
    ";",
    "&&",
    "|",
    "\n",
    "a\nb",
    "$HOME",
    "${IFS}",
    "*",
    "?",
    "~",
    "#",
    "!",
    "--",
    "-c",
    "-",
    "é✓中文",
    "\t",
    "'\"'\"'",
    "$'\\x41'",
    "\x7f",
    "\x01",
]
PRINT_ARGS = ["bash", "-lc", 'for a; do printf "%s\\0" "$a"; done', "_"]  # printf alone prints once for no args

arguments = st.lists(
    st.one_of(
        st.sampled_from(HOSTILE),
        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40),
    ),
    max_size=8,
)


class RecordingTransport(Transport):
    """Remembers the argv lists it is asked to start (unit tests of command construction only)."""

    name = "fake"

    def __init__(self) -> None:
        self.started: list[list[str]] = []

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Process:
        raise AssertionError("not used")

    def run(self, argv, **kw) -> Completed:  # type: ignore[no-untyped-def, override]
        self.started.append(list(argv))
        return Completed(list(argv), 0, b"", b"")


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        (ContainerSpec("pct", vmid=200), ["/usr/sbin/pct", "exec", "200", "--", "ls", "-l", "a b"]),
        (ContainerSpec("pct", vmid=200, tool="/opt/pct"), ["/opt/pct", "exec", "200", "--", "ls", "-l", "a b"]),
        (ContainerSpec("docker", name="trainer"), ["docker", "exec", "-i", "trainer", "ls", "-l", "a b"]),
        (ContainerSpec("docker", name="t1", tool="podman"), ["podman", "exec", "-i", "t1", "ls", "-l", "a b"]),
        (ContainerSpec(), ["ls", "-l", "a b"]),
    ],
)
def test_wrap_argv_per_runtime(container, expected):
    transport = RecordingTransport()
    Target(HostSpec(name="h", container=container), transport).run(["ls", "-l", "a b"])
    assert transport.started == [expected]


def test_pct_always_gets_double_dash_even_for_dash_args():
    assert wrap_argv(ContainerSpec("pct", vmid=300), ["--help"]) == ["/usr/sbin/pct", "exec", "300", "--", "--help"]


def test_env_wrapper_keeps_values_as_single_arguments():
    assert env_argv(["cmd"], {"A": "x y", "B": "$(id)"}) == ["env", "--", "A=x y", "B=$(id)", "cmd"]
    assert shlex.split(shlex.join(env_argv(["c"], {"K": "'\n"}))) == ["env", "--", "K='\n", "c"]


@given(arguments)
@settings(max_examples=100, deadline=None)
def test_shlex_join_round_trips_through_a_posix_shell_parser(args):
    """Cheap local oracle for what the remote login shell does with our command line."""
    argv = ["/usr/sbin/pct", "exec", "200", "--", *PRINT_ARGS, *args]
    assert shlex.split(shlex.join(argv)) == argv


@pytest.fixture(scope="module", params=["shim", "dock"])
def container_target(request, sshd_host) -> Iterator[Target]:
    """The pct shim's or the docker shim's container, one session (one SSH connection) for every example."""
    sshd_host.reset()
    with sshd_host.session() as session:
        yield session.target(request.param)


@given(arguments)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_hostile_arguments_survive_sshd_the_container_tool_and_bash(container_target, args):
    """sshd's login shell, `pct exec` / `docker exec` and `bash -lc` hand back exactly the bytes we sent."""
    result = container_target.run([*PRINT_ARGS, *args], timeout=30)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == b"".join(a.encode() + b"\0" for a in args)
