"""The end of a payload process (trainer, eval, regen, warm-up, doctor) without the interpreter's teardown.

The teardown of a process that loaded torch takes 1.1-1.5 s on a CPU box and more with CUDA state
(contexts, pinned and device memory), and whoever waits for the process (`runs stop`, the trainer
waiting for its warm-up processes, the CLI's eval) waits it out. Standard library only."""

from __future__ import annotations

import os
import sys
import threading


def exit_now(code: int) -> None:
    """End the process with `code` at once when nothing needs the teardown: stdout and stderr are
    flushed, every file the payload writes is closed by the time its main returns, and no thread
    Python would wait for (non-daemon) is alive; else the normal exit."""
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say there
            pass
    os._exit(code)
