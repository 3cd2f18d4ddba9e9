"""dflashctl's own programs in the container (runctl and the wire constants it shares with the CLI),
installed there by content hash, like the payload, instead of sent as source with every call.

Each call sends only the launcher (remote/agent.py, about 2 kB) with `<workdir>/.agent/<hash>`:
in the common case that is one round trip. A launcher that finds no such directory exits with
EXIT_MISSING; the client then installs the files (one more call) and repeats the call once.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from .containers import Target, remote_script
from .errors import RemoteError
from .remote.agent import EXIT_MISSING, MISSING, PACKAGE
from .transport import Completed

REMOTE = Path(__file__).parent / "remote"
FILES = ("__init__.py", "wire.py", "runctl/*.py")  # under dflashctl/remote/, installed as dflashctl_agent/
INSTALL_TIMEOUT_S = 120.0
T = TypeVar("T")


class AgentMissing(Exception):
    """The launcher found no agent of this hash in the container."""


@lru_cache(maxsize=1)
def bundle() -> tuple[str, bytes]:
    """(content hash, the files as the launcher's --install reads them): sha256 over paths and texts."""
    files = {
        f"{PACKAGE}/{p.relative_to(REMOTE).as_posix()}": p.read_text(encoding="utf-8")
        for pattern in FILES
        for p in sorted(REMOTE.glob(pattern))
    }
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:20]
    return digest, json.dumps(files).encode()


def agent_root(target: Target) -> str:
    """`<workdir>/.agent/<hash>` (~ is expanded by the launcher, in the container)."""
    return f"{target.host.workdir}/.agent/{bundle()[0]}"


def agent_argv(target: Target, module: str, args: Sequence[str], flags: Sequence[str] = ()) -> list[str]:
    """The argv that runs `dflashctl_agent.<module> ARGS` in the container (flags go to the interpreter)."""
    return [target.host.interpreter, *flags, "-c", remote_script("agent"), agent_root(target), module, *args]


def is_missing(code: int | None, stderr: bytes) -> bool:
    """Whether a call ended because the agent is not installed (its exit code and its line)."""
    return code == EXIT_MISSING and MISSING.encode() in stderr


def install(target: Target) -> None:
    """Install this dflashctl's agent in the container (a RemoteError if that fails)."""
    argv = [target.host.interpreter, "-S", "-c", remote_script("agent"), "--install", agent_root(target)]
    result = target.run(argv, stdin=bundle()[1], timeout=INSTALL_TIMEOUT_S)
    if not result.ok:
        raise RemoteError(
            f"{target.label}: cannot install dflashctl's agent in {agent_root(target)}: {result.err_line()}"
        )


def with_agent(target: Target, call: Callable[[], T]) -> T:
    """call(), and once more after installing the agent when call raised AgentMissing."""
    try:
        return call()
    except AgentMissing:
        install(target)
    return call()


def run_agent(target: Target, module: str, args: Sequence[str], *, flags: Sequence[str] = (), **kw: Any) -> Completed:
    """Target.run of one agent module (kw as for Target.run), installing the agent when missing."""

    def call() -> Completed:
        result = target.run(agent_argv(target, module, args, flags), **kw)
        if is_missing(result.exit_code, result.stderr):
            raise AgentMissing()
        return result

    return with_agent(target, call)
