"""`dflashctl exec`: run a command in a container with the terminal's streams passed through."""

from __future__ import annotations

import os
import sys
import threading
from typing import Sequence

from .containers import Target
from .errors import ConnectionLost, ContainerError, OutputClosed
from .guard import run_guarded
from .output import sink

EXIT_OUTPUT_CLOSED = 255  # what OpenSSH exits with when its local stdout goes away mid-stream
EXIT_SIGNALLED = 255  # and when the remote command was killed by a signal (no exit status)


def run_passthrough(target: Target, command: Sequence[str]) -> int:
    """Run command in the target's container, streaming its output live; return its exit code.
    If our own stdout or stderr goes away (`| head -c 10`), the command is stopped and the exit
    code is 255, as ssh's (OutputClosed carries it). The command runs under the guard: an
    interrupted call leaves nothing of it on the host (guard.py)."""
    out = sink(sys.stdout.buffer)
    err = _StderrGate(sink(sys.stderr.buffer, "stderr"))

    def on_stdout(chunk: bytes) -> None:
        err.release()
        out(chunk)

    try:
        result = run_guarded(target, command, stdin=_forwarded_stdin(), on_stdout=on_stdout, on_stderr=err)
    except ContainerError:
        err.discard()  # pct's own complaint; the one-line error says it better
        raise
    except OutputClosed as exc:
        exc.exit_code = EXIT_OUTPUT_CLOSED
        raise
    except ConnectionLost as exc:  # the guard's stop could not reach the host either
        raise ConnectionLost(f"{exc}; the command may still run on {target.label}") from None
    err.release()
    # The guard exits 255 for a command killed by a signal; a local guard (or the shell before it)
    # killed by one has a negative code: ssh's 255 for it too, as over SSH (docs/cli.md).
    return result.exit_code if result.exit_code >= 0 else EXIT_SIGNALLED


def _forwarded_stdin():  # type: ignore[no-untyped-def]
    """Like ssh: a pipe or file on stdin is forwarded, an interactive terminal is not.

    Reads the raw fd: a daemon thread blocked in sys.stdin.buffer would hold its lock and abort
    the interpreter at exit.
    """
    if sys.stdin is None or sys.stdin.isatty():
        return None
    fd = sys.stdin.fileno()
    return iter(lambda: os.read(fd, 1 << 16), b"")


class _StderrGate:
    """Holds a command's first stderr bytes for a moment: if the container turns out to be
    unusable they are pct/docker's own message, which our one-line error replaces."""

    HOLD_S = 0.5
    LIMIT = 4096

    def __init__(self, sink) -> None:  # type: ignore[no-untyped-def]
        self._sink = sink
        self._held = bytearray()
        self._open = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __call__(self, chunk: bytes) -> None:
        with self._lock:
            if not self._open:
                self._held.extend(chunk)
                if len(self._held) <= self.LIMIT:
                    if self._timer is None:
                        self._timer = threading.Timer(self.HOLD_S, self.release)
                        self._timer.daemon = True
                        self._timer.start()
                    return
                self._open_locked()
                return
        self._sink(chunk)

    def release(self) -> None:
        """Pass held bytes on and stop holding."""
        with self._lock:
            if not self._open:
                self._open_locked()

    def discard(self) -> None:
        """Drop held bytes and stop holding."""
        with self._lock:
            self._held.clear()
            self._open = True
            self._cancel_timer()

    def _open_locked(self) -> None:
        self._open = True
        self._cancel_timer()
        held, self._held = bytes(self._held), bytearray()
        if held:
            self._sink(held)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
