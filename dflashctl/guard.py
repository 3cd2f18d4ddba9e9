"""Commands that an interrupt must reach on the host too (`dflashctl exec`, `runctl start`, `doctor`,
`eval`, `runs pull`'s `runctl pack`, `inspect`'s live config).

Over SSH without a terminal, closing a channel sends the command no signal: `sleep 60` ran on
after Ctrl-C, through pct and docker as well. So the argv runs under `remote/guard.py`, in a
session of its own, and whatever ends the call early (Ctrl-C, our stdout closing, a timeout)
runs `guard.py stop TOKEN` in a second session, which signals that session (SIGINT, SIGTERM,
then SIGKILL; see guard.py) until nothing of it is left, and only then closes the first one.
Output that arrives once the stop has begun is dropped: the CLI prints its own one line.

A command that decides itself what an interrupt means (`runctl start` undoes a start, or past its
last point completes it) is run with `settle`: Ctrl-C sends it SIGINT (`guard.py interrupt`), its
own answer is awaited, and InterruptedAfter carries that answer; a second Ctrl-C stops it as above.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Sequence

from .containers import Target, remote_script, wrap_argv
from .errors import DflashError, Interrupted
from .transport import CHUNK, Completed, Process, Read1Stream, Sink, StdinSource, Transport, env_argv

# Runs the guard when the host's interpreter exists, else the argv itself (unguarded), so that
# exec can still inspect or repair a container that has no Python.
_PRELUDE = 'command -v "$1" >/dev/null 2>&1 || { shift 6; exec "$@"; }; exec "$@"'
STOP_TIMEOUT_S = 60.0  # a bound on the stop command: it ends by itself in about 15 s at most (guard.py)


def guarded_argv(interpreter: str, token: str, argv: Sequence[str]) -> list[str]:
    """The argv that runs argv under the guard (it must stay 6 words before argv: see _PRELUDE)."""
    return ["sh", "-c", _PRELUDE, "sh", interpreter, "-S", "-c", remote_script("guard"), "run", token, *argv]


def start_guarded(target: Target, argv: Sequence[str]) -> Process:
    """Target.start for a command that must not outlive an interrupted call: kill() stops it on the
    host first; afterwards `may_still_run(proc)` says why, when that stop could not be confirmed."""
    return _GuardedTransport(target).start(argv)


def may_still_run(proc: Process) -> str | None:
    """Why a killed command of start_guarded may still run on the host (its stop failed), else None."""
    return proc._owner.left if isinstance(proc, _GuardedProcess) else None


class InterruptedAfter(Interrupted):
    """Ctrl-C during a settled command, which then ended by itself: result is what it answered."""

    def __init__(self, result: Completed):
        super().__init__()
        self.result = result


def run_guarded(
    target: Target,
    argv: Sequence[str],
    *,
    stdin: StdinSource = None,
    timeout: float | None = None,
    on_stdout: Sink | None = None,
    on_stderr: Sink | None = None,
    env: dict[str, str] | None = None,
    settle: bool = False,
) -> Completed:
    """Target.run for a command that must not outlive an interrupted call. A Ctrl-C whose stop
    could not be confirmed says so in its one line (Interrupted with the reason); with settle, a
    Ctrl-C is passed on as SIGINT and InterruptedAfter brings the command's own answer."""
    guarded = _GuardedTransport(target, settle)
    try:
        result = guarded.run(argv, stdin=stdin, timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr, env=env)
    except Interrupted:
        if guarded.left:
            raise Interrupted(f"{target.label}: the command may still run ({guarded.left})") from None
        raise
    # The guard (or the shell, when it ran the argv unguarded) names a missing program; another
    # `not found` is the container tool's own (`pct` missing on the host).
    named = os.fsencode(argv[0]) in result.stderr
    seen = Completed(wrap_argv(target.host.container, argv), result.exit_code, b"", result.stderr)
    target.raise_for_container(seen, argv if named else [target.host.interpreter])
    if guarded.interrupted:
        raise InterruptedAfter(result)
    return result


class _GuardedTransport(Transport):
    """Starts each argv under the guard in the target's container, on the target's transport."""

    def __init__(self, target: Target, settle: bool = False):
        self.target = target
        self.name = target.transport.name
        self.settle = settle
        self.interrupted = False  # a settled command was sent SIGINT
        self.left: str | None = None  # why a stopped command may still run

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Process:
        """Start argv (with env) under the guard."""
        return _GuardedProcess(self, env_argv(argv, env))


class _GuardedProcess(Process):
    """The guard's `run` on the host; kill() stops the command's session through a second session."""

    def __init__(self, owner: _GuardedTransport, argv: Sequence[str]):
        self._owner = owner
        self._token = secrets.token_hex(16)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        target = owner.target
        try:
            self._proc = target.transport.start(
                wrap_argv(target.host.container, guarded_argv(target.host.interpreter, self._token, argv))
            )
        except Interrupted:
            self._stop_unheld()
            raise
        try:  # a Ctrl-C before the caller holds this process still stops the command
            self.stdin = self._proc.stdin
            self.stdout = _Until(self._proc.stdout, self._stopping)  # type: ignore[assignment]
            self.stderr = _Until(self._proc.stderr, self._stopping)  # type: ignore[assignment]
        except BaseException:
            self.kill()
            raise

    def wait(self, timeout: float | None = None) -> int:
        """The command's exit code (the guard exits as it does). A settled command's first Ctrl-C
        is passed on as SIGINT, and its end awaited again."""
        try:
            return self._proc.wait(timeout)
        except Interrupted:
            if not self._owner.settle or self._owner.interrupted:
                raise
        self._owner.interrupted = True
        try:
            self._guard("interrupt")
        except DflashError as exc:  # Interrupted included: the caller's kill() then stops the command
            raise exc if isinstance(exc, Interrupted) else Interrupted() from None
        return self._proc.wait(timeout)

    def kill(self) -> None:
        """Stop the command's session on the host (once, whoever asks first), then drop the channel."""
        self._stopping.set()
        try:
            with self._lock:
                if not self._stopped:
                    self._stopped = True
                    self._stop()
        finally:
            self._proc.kill()

    def _stop_unheld(self) -> None:
        """A Ctrl-C inside the transport's start: the command may have been sent (its stop leaves a
        mark that a command still to start obeys), unless the Ctrl-C cut the connect itself, when
        nothing was sent and a stop must not connect again."""
        self._stopping.set()
        self._stopped = True
        if self._owner.target.transport.connected():
            self._stop()

    def _stop(self) -> None:
        try:
            result = self._guard("stop")
        except Interrupted:
            raise  # a second Ctrl-C: stop waiting (the stop goes on by itself and skips to SIGKILL)
        except DflashError as exc:
            self._owner.left = str(exc)
            return
        if not result.ok:
            self._owner.left = f"its stop failed: {result.err_line()}"

    def _guard(self, action: str) -> Completed:
        """`guard.py ACTION TOKEN` in a second session."""
        target = self._owner.target
        argv = [target.host.interpreter, "-S", "-c", remote_script("guard"), action, self._token]
        return target.transport.run(wrap_argv(target.host.container, argv), timeout=STOP_TIMEOUT_S)


class _Until(Read1Stream):
    """A stream that ends (b'') once the command is being stopped."""

    def __init__(self, stream: Read1Stream, stopping: threading.Event):
        self._stream = stream
        self._stopping = stopping

    def read1(self, n: int = CHUNK) -> bytes:
        """The next bytes, or b'' once the stop has begun."""
        data = self._stream.read1(n)
        return b"" if self._stopping.is_set() else data
