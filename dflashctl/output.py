"""Writing to this process's own streams: a reader that went away ends the command (OutputClosed)."""

from __future__ import annotations

from typing import IO, Callable

from .errors import OutputClosed


def write_out(stream: IO[bytes], data: bytes, what: str = "stdout") -> None:
    """Write and flush data, or raise OutputClosed when the stream cannot take it."""
    try:
        stream.write(data)
        stream.flush()
    except OSError as exc:
        raise OutputClosed(exc, what) from None


def sink(stream: IO[bytes], what: str = "stdout") -> Callable[[bytes], None]:
    """A callback that writes each chunk to stream (see write_out)."""
    return lambda data: write_out(stream, data, what)
