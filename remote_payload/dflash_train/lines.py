"""Whole lines on the payload programs' stdout and stderr. Under PYTHONUNBUFFERED=1 (runctl sets it)
print() writes a line's text and its newline in two writes, and another writer of the same
train.log (an event hook's relay, another rank of the process launcher) can land between them.
Standard library only."""

from __future__ import annotations

import sys


def whole_lines() -> None:
    """At a program's entry: stdout and stderr keep what is written until a newline, then write it
    at once (one write per print; a partial line waits for its newline or a flush)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # None: no stream, or one a caller replaced
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)


def say(line: str) -> None:
    """`line` on stdout in one write with its newline, however the stream is set up: print writes
    the two apart, and a line another thread prints meanwhile could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
