"""How argv reaches a host: the Transport interface and the `local` (subprocess) transport.

A transport runs an argv list on a host and streams bytes both ways. It never sees a shell
string built by pasting: the SSH transport joins argv with `shlex.join` for the remote login
shell, and the local one hands argv straight to `execve`.
"""

from __future__ import annotations

import abc
import os
import subprocess
import threading
from dataclasses import dataclass
from typing import IO, Callable, Iterable, Sequence, Union

from .errors import RemoteError, UsageError

# What `run` accepts as stdin: nothing, bytes, a binary file, or an iterable of chunks.
StdinSource = Union[None, bytes, IO[bytes], Iterable[bytes]]
Sink = Callable[[bytes], None]

CHUNK = 64 * 1024
STDERR_TAIL = 4096
LOCAL_KILL_GRACE_S = 10.0  # a local child's time between SIGTERM and SIGKILL (_LocalProcess.kill)


@dataclass
class Completed:
    """The outcome of one command: argv, exit code and whatever output was captured."""

    argv: list[str]
    exit_code: int
    stdout: bytes
    stderr: bytes  # all of it, or its last STDERR_TAIL bytes when it was streamed to a callback

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.exit_code == 0

    def text(self) -> str:
        """Stdout decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")

    def err_line(self) -> str:
        """The last non-empty stderr line, for one-line error messages."""
        lines = [ln for ln in self.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
        return lines[-1].strip() if lines else f"exit code {self.exit_code}"


class Read1Stream(abc.ABC):
    """A binary input stream built on `read1`; subclasses say how to get the next bytes."""

    @abc.abstractmethod
    def read1(self, n: int = CHUNK) -> bytes:
        """Up to n bytes, blocking only until some arrive; b'' at end of stream."""

    def read(self, n: int = -1) -> bytes:
        """Everything up to n bytes (all of it when n < 0)."""
        chunks = bytearray()
        while n < 0 or len(chunks) < n:
            data = self.read1(CHUNK if n < 0 else n - len(chunks))
            if not data:
                break
            chunks.extend(data)
        return bytes(chunks)


class Process(abc.ABC):
    """A started command: binary stdin/stdout/stderr streams plus wait and kill.

    stdout and stderr support `read1(n)`: whatever is available, b'' at end of stream.
    """

    stdin: IO[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes]

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command to end and return its exit code (TimeoutError on timeout)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop the command (or drop its channel); a local child gets a short grace (_LocalProcess)."""


class Transport(abc.ABC):
    """Runs argv lists on one host; connects lazily and is reused for a whole CLI call."""

    name: str

    @abc.abstractmethod
    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Process:
        """Start argv and return its streams without waiting."""

    def close(self) -> None:
        """Release the connection, if any."""

    def connected(self) -> bool:
        """Whether a command can start now without connecting first (a process here always can)."""
        return True

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: StdinSource = None,
        timeout: float | None = None,
        on_stdout: Sink | None = None,
        on_stderr: Sink | None = None,
        env: dict[str, str] | None = None,
    ) -> Completed:
        """Run argv to completion, streaming stdout/stderr concurrently and feeding stdin.

        Output goes to the callbacks when given, else it is captured in the result.
        """
        started = threading.Event()
        proc = self.start(argv, env=env)
        # From here on a Ctrl-C (the CLI's SIGINT handler raises wherever the main thread is) must
        # kill the command, also while the threads start. The pumps show nothing before all three
        # have started: a Ctrl-C that answers the command's first output does not land inside
        # Thread.start (where the handler would only put it off: cli._starting_a_thread).
        try:
            out, err = bytearray(), bytearray()
            errors: list[BaseException] = []
            threads = [
                threading.Thread(
                    target=_pump, args=(proc, proc.stdout, on_stdout, out, 0, errors, started), daemon=True
                ),
                threading.Thread(
                    target=_pump, args=(proc, proc.stderr, on_stderr, err, STDERR_TAIL, errors, started), daemon=True
                ),
                threading.Thread(target=_feed, args=(proc, stdin, errors), daemon=True),
            ]
            for t in threads:
                t.start()
            started.set()
            code = proc.wait(timeout)
        except TimeoutError:
            proc.kill()
            raise RemoteError(f"command timed out after {timeout:g} s: {argv[0]}") from None
        except BaseException:
            started.set()  # pumps already started drain the killed command's streams and end
            proc.kill()
            raise
        for t in threads[:2]:
            t.join()
        if errors:
            exc = errors[0]
            raise exc
        return Completed(list(argv), code, bytes(out), bytes(err))


def _pump(
    proc: Process,
    stream: IO[bytes],
    sink: Sink | None,
    buf: bytearray,
    tail: int,
    errors: list[BaseException],
    started: threading.Event,
) -> None:
    """Once `started` is set, move a command's output to sink (keeping its last `tail` bytes in
    buf), else into buf; a failure goes to errors, surfaced to the caller of run."""
    started.wait()
    try:
        while chunk := stream.read1(CHUNK):
            if sink is None:
                buf.extend(chunk)
                continue
            sink(chunk)
            if tail:  # keep the end of streamed stderr for error messages
                buf.extend(chunk)
                del buf[:-tail]
    except BaseException as exc:
        errors.append(exc)
        # Nobody drains this stream any more (a sink failed: say our stdout was closed), so the
        # command would block on a full pipe and run's wait() would never return.
        proc.kill()


def _feed(proc: Process, stdin: StdinSource, errors: list[BaseException]) -> None:
    """Write stdin to the command and close it; a failure other than a closed pipe goes to errors."""
    try:
        _write_stdin(proc.stdin, stdin)
    except (BrokenPipeError, OSError, EOFError) as exc:
        # The command may exit before reading all input; its exit code tells the story.
        if not _is_closed_pipe(exc):
            errors.append(exc)
    except BaseException as exc:
        errors.append(exc)


def env_argv(argv: Sequence[str], env: dict[str, str] | None) -> list[str]:
    """argv prefixed with `env -- K=V ...` (GNU env reads assignments after `--`, then the command).

    Used where variables cannot be passed directly: sshd drops most of them, and `pct exec`
    may clear the environment.
    """
    argv = [str(a) for a in argv]
    if not env:
        return argv
    for key in env:
        if not key or "=" in key:
            raise UsageError(f"bad environment variable name {key!r}")
    return ["env", "--", *(f"{k}={v}" for k, v in env.items()), *argv]


def _write_stdin(pipe: IO[bytes], source: StdinSource) -> None:
    """Copy source into the command's stdin, then close it so the command sees EOF."""
    try:
        if source is None:
            return
        if isinstance(source, (bytes, bytearray, memoryview)):
            pipe.write(bytes(source))
        elif hasattr(source, "read"):
            # read1 hands over what a pipe has now instead of waiting for a full chunk
            read = getattr(source, "read1", source.read)
            while chunk := read(CHUNK):
                pipe.write(chunk)
        else:
            for chunk in source:
                pipe.write(chunk)
        pipe.flush()
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _is_closed_pipe(exc: BaseException) -> bool:
    return isinstance(exc, (BrokenPipeError, EOFError)) or "closed" in str(exc).lower()


class _LocalProcess(Process):
    def __init__(self, popen: subprocess.Popen[bytes]):
        self._p = popen
        self.stdin, self.stdout, self.stderr = popen.stdin, popen.stdout, popen.stderr  # type: ignore[assignment]

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child's exit code; TimeoutError (not TimeoutExpired) on timeout."""
        try:
            return self._p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError from None

    def kill(self) -> None:
        """End the child unless it has already exited: SIGTERM, then SIGKILL after LOCAL_KILL_GRACE_S.
        The grace lets a command that must not be cut mid-way finish its step (runctl start undoes
        or completes a start); most commands die of the SIGTERM at once."""
        if self._p.poll() is not None:
            return
        self._p.terminate()
        try:
            self._p.wait(LOCAL_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            self._p.kill()
        except BaseException:  # a second Ctrl-C: no more waiting
            self._p.kill()
            raise


class LocalTransport(Transport):
    """Runs argv on this machine with subprocess (no shell), for the embedded `local` host."""

    def __init__(self, name: str = "local"):
        self.name = name

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Process:
        """Start argv as a child process with pipes on all three streams."""
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, **env} if env else None,
            )
        except FileNotFoundError:
            return _MissingProcess(argv[0])
        return _LocalProcess(popen)


class _MissingProcess(Process):
    """Mimics a shell's 'command not found' (exit 127) so both transports report it alike."""

    def __init__(self, program: str):
        import io

        self.stdin = io.BytesIO()
        self.stdout = io.BytesIO()
        self.stderr = io.BytesIO(f"{program}: command not found\n".encode())

    def wait(self, timeout: float | None = None) -> int:
        """Always 127, like a shell that cannot find the program."""
        return 127

    def kill(self) -> None:
        """Nothing runs, so there is nothing to stop."""
        pass
