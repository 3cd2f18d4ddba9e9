"""Containers wrap a transport: the same argv runs via `pct exec`, `docker exec`, or directly.

`Target` is what every command talks to: one host, its transport and its container runtime.
Failures that mean "the container is not usable" become ContainerError with a hint.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Callable, Sequence

from .errors import ContainerError, DflashError, RemoteError
from .inventory import ContainerSpec, HostSpec
from .transport import CHUNK, STDERR_TAIL, Completed, Process, Sink, StdinSource, Transport, env_argv

_PCT_NOT_RUNNING = re.compile(r"container '?(\d+)'? not running", re.I)
# pct's `load_config` dies with this for a vmid that has no config on this node (exit 255).
_PCT_MISSING = re.compile(r"Configuration file '\S*lxc/\d+\.conf' does not exist")
_DOCKER_NOT_RUNNING = re.compile(r"container \S+ is not running", re.I)
_DOCKER_MISSING = re.compile(r"No such container", re.I)
_NOT_FOUND_CODES = (126, 127)


def wrap_argv(container: ContainerSpec, argv: Sequence[str]) -> list[str]:
    """The argv that runs `argv` inside the container, as the host must execute it."""
    argv = [str(a) for a in argv]
    if container.runtime == "pct":
        return [container.executable, "exec", str(container.vmid), "--", *argv]
    if container.runtime == "docker":
        return [container.executable, "exec", "-i", str(container.name), *argv]
    return argv


class Target:
    """One host's container, reached through a transport; all remote work goes through here."""

    def __init__(self, host: HostSpec, transport: Transport):
        self.host = host
        self.transport = transport

    @property
    def label(self) -> str:
        """`gpu1 (pct 200)` style name for messages."""
        inside = self.host.container.describe()
        return self.host.name if inside == "-" else f"{self.host.name} ({inside})"

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Process:
        """Start argv in the container (with env variables set inside it) and return its live streams."""
        return self.transport.start(wrap_argv(self.host.container, env_argv(argv, env)))

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: StdinSource = None,
        timeout: float | None = None,
        on_stdout: Sink | None = None,
        on_stderr: Sink | None = None,
        env: dict[str, str] | None = None,
        settle: bool = False,
    ) -> Completed:
        """Run argv in the container (env is set inside it); raise ContainerError when the container is unusable.
        settle: a Ctrl-C is passed on to the command as SIGINT and its answer awaited (guard.py)."""
        if settle:
            from .guard import run_guarded

            return run_guarded(
                self, argv, stdin=stdin, timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr, env=env, settle=True
            )
        result = self.transport.run(
            wrap_argv(self.host.container, env_argv(argv, env)),
            stdin=stdin,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
        )
        self.raise_for_container(result, argv)
        return result

    def raise_for_container(self, result: Completed, argv: Sequence[str]) -> None:
        """Turn 'container stopped or missing' and 'program not found' outcomes into ContainerError."""
        if result.ok:
            return
        err = result.stderr.decode("utf-8", "replace")
        spec = self.host.container
        if spec.runtime == "pct" and _PCT_NOT_RUNNING.search(err):
            raise ContainerError(
                f"{self.host.name}: container {spec.vmid} is not running (start it with `pct start {spec.vmid}`)"
            )
        if spec.runtime == "pct" and _PCT_MISSING.search(err):
            raise ContainerError(f"{self.host.name}: no pct container {spec.vmid} on this host (see `pct list`)")
        if spec.runtime == "docker" and _DOCKER_NOT_RUNNING.search(err):
            raise ContainerError(
                f"{self.host.name}: docker container '{spec.name}' is not running "
                f"(start it with `docker start {spec.name}`)"
            )
        if spec.runtime == "docker" and _DOCKER_MISSING.search(err):
            raise ContainerError(f"{self.host.name}: no docker container named '{spec.name}' (see `docker ps -a`)")
        if result.exit_code in _NOT_FOUND_CODES and _mentions_missing(err):
            if spec.runtime != "none" and result.argv[0] == spec.executable and argv[0] not in err:
                raise ContainerError(
                    f"{self.host.name}: `{spec.executable}` not found on the host (set container.{spec.runtime})"
                )
            hint = " (set `python` for this host in hosts.yaml)" if argv[0] == self.host.interpreter else ""
            raise ContainerError(f"{self.label}: `{argv[0]}` not found{hint}")

    def python(
        self,
        script: str,
        args: Sequence[str] = (),
        *,
        flags: Sequence[str] = (),
        stdin: StdinSource = None,
        timeout: float | None = None,
        on_stdout: Sink | None = None,
        on_stderr: Sink | None = None,
        settle: bool = False,
    ) -> Completed:
        """Run one of dflashctl's remote-side scripts (`dflashctl/remote/<script>.py`) with the host's interpreter.

        flags go to the interpreter before `-c` (e.g. `-S` for scripts that need no site set-up);
        settle as for run.
        """
        source = remote_script(script)
        return self.run(
            [self.host.interpreter, *flags, "-c", source, *args],
            stdin=stdin,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            settle=settle,
        )

    def python_checked(self, script: str, args: Sequence[str] = (), **kw) -> Completed:  # type: ignore[no-untyped-def]
        """Like `python`, but a non-zero exit becomes RemoteError with the script's last stderr line."""
        result = self.python(script, args, **kw)
        if not result.ok:
            raise RemoteError(f"{self.label}: {result.err_line()}")
        return result


class Dialogue:
    """A started container command driven through its streams: lines and bytes from its stdout,
    its stdin for writing, stderr drained by a thread and kept (its tail) for the error message.

    push and pull use it as a context manager: an exception inside kills the command, so the
    remote sees EOF and discards whatever it was staging. `start`: how the command starts (default
    Target.start; guard.start_guarded makes that kill stop it on the host too)."""

    def __init__(
        self, target: Target, argv: Sequence[str], start: Callable[[Target, Sequence[str]], Process] | None = None
    ):
        self.target, self.argv = target, list(argv)
        self.proc: Process = (start or Target.start)(target, self.argv)
        try:  # a Ctrl-C before the caller holds this Dialogue must still kill the command
            self._pending = b""
            self._stderr = bytearray()
            self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
            self._drain.start()
        except BaseException:
            self.proc.kill()
            raise

    def __enter__(self) -> "Dialogue":
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        if kind is not None:
            self.proc.kill()

    def _drain_stderr(self) -> None:
        try:
            while chunk := self.proc.stderr.read1(CHUNK):
                self._stderr.extend(chunk)
                del self._stderr[:-STDERR_TAIL]
        except DflashError:
            pass  # a lost connection also surfaces on stdout, where it is reported

    def line(self) -> bytes | None:
        """The next stdout line without its newline; None when stdout ends first."""
        while b"\n" not in self._pending:
            chunk = self.proc.stdout.read1(CHUNK)
            if not chunk:
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def read(self, n: int = -1) -> bytes:
        """Stdout after the lines read so far (file-like, for tarfile's stream mode)."""
        if self._pending:
            cut = len(self._pending) if n < 0 else n
            data, self._pending = self._pending[:cut], self._pending[cut:]
            return data
        return self.proc.stdout.read(n)

    def ended(self) -> Completed:
        """Wait for the command: its exit code and stderr tail (stdout not kept); a container that
        is unusable (stopped, tool missing) raises ContainerError here."""
        code = self.proc.wait()
        self._drain.join(timeout=5)
        result = Completed(wrap_argv(self.target.host.container, self.argv), code, b"", bytes(self._stderr))
        self.target.raise_for_container(result, self.argv)
        return result


def remote_script(name: str) -> str:
    """Source text of a remote-side script shipped inside the dflashctl package."""
    # A path beside this module, not importlib.resources: its import costs more than the read.
    return (Path(__file__).parent / "remote" / f"{name}.py").read_text(encoding="utf-8")


def _mentions_missing(err: str) -> bool:
    lowered = err.lower()
    return "not found" in lowered or "no such file" in lowered or "executable file not found" in lowered


class LineSplitter:
    """Turns a remote command's streamed stderr into lines: those starting with `prefix` are
    progress (to the callback, prefix removed), the last line is kept for the error message."""

    def __init__(self, progress: Callable[[str], None] | None, prefix: str):
        self.progress, self.prefix = progress, prefix
        self.buffer = ""
        self.last = ""

    def feed(self, chunk: bytes) -> None:
        """Accept a chunk of stderr."""
        self.buffer += chunk.decode("utf-8", "replace")
        *complete, self.buffer = self.buffer.split("\n")
        for line in filter(str.strip, complete):
            self.last = line.strip()
            if self.progress and line.startswith(self.prefix):
                self.progress(line[len(self.prefix) :])
