"""Writing to this process's own streams: a reader that went away ends the command (OutputClosed)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import IO, Callable, Iterator

from .errors import OutputClosed


def write_out(stream: IO[bytes], data: bytes, what: str = "stdout") -> None:
    """Write and flush all of data, or raise OutputClosed when the stream cannot take it."""
    view = memoryview(data)
    try:
        # An unbuffered stream (PYTHONUNBUFFERED: sys.stdout.buffer is the raw file) writes part of
        # the data when a pipe's reader leaves midway and returns that count: write the rest to meet EPIPE.
        while view:
            written = stream.write(view)
            view = view[len(view) if written is None else written :]  # None: a stream that takes it all
        stream.flush()
    except OSError as exc:
        raise OutputClosed(exc, what) from None


def sink(stream: IO[bytes], what: str = "stdout") -> Callable[[bytes], None]:
    """A callback that writes each chunk to stream (see write_out)."""
    return lambda data: write_out(stream, data, what)


class _GuardedText:
    """sys.stdout while a command runs: a write or flush that fails raises OutputClosed. Without it,
    click and rich each turn a closed pipe into a bare `exit 1` (their own handling of EPIPE), and a
    full disk into an internal error."""

    def __init__(self, stream: IO[str], what: str):
        self._stream, self._what = stream, what

    def write(self, text: str) -> int:
        """Write text, or raise OutputClosed."""
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise OutputClosed(exc, self._what) from None

    def flush(self) -> None:
        """Flush, or raise OutputClosed."""
        try:
            self._stream.flush()
        except OSError as exc:
            raise OutputClosed(exc, self._what) from None

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._stream, name)  # isatty, fileno, encoding, buffer: the stream's own


@contextmanager
def guarded_stdout() -> Iterator[None]:
    """Run the block with sys.stdout guarded (see _GuardedText), flushing it at the end, inside the
    guard, so that output still buffered meets the same rule (also after a SystemExit); the stream
    is restored after."""
    stream = sys.stdout
    guarded = _GuardedText(stream, "stdout")
    sys.stdout = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        try:
            guarded.flush()
        finally:
            sys.stdout = stream
