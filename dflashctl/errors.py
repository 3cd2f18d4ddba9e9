"""The few exception types of dflashctl; the CLI turns each into one line and an exit code.

Exit codes (documented in docs/cli.md):
  1 a check or remote step failed       2 bad input (arguments, hosts.yaml)
  3 cannot reach or trust the host      4 the container or its tools are not usable
  5 the thing asked for does not exist  6 conflict (GPUs busy, run already exists)
  130 interrupted (Ctrl-C)              141 our own stdout went away (`| head`), quietly
"""

from __future__ import annotations


class DflashError(Exception):
    """Base of every error that the CLI reports as one clean line."""

    exit_code = 1


class UsageError(DflashError):
    """Bad arguments or a malformed inventory."""

    exit_code = 2


class ConnectError(DflashError):
    """The host cannot be reached, authenticated or trusted."""

    exit_code = 3


class ConnectionLost(ConnectError):
    """An established connection dropped mid-call: what it was running may still run on the host."""


class ContainerError(DflashError):
    """The container is stopped, or lacks a tool we need (interpreter, tar)."""

    exit_code = 4


class NotFoundError(DflashError):
    """A module, symbol, run or file that was asked for does not exist."""

    exit_code = 5


class ConflictError(DflashError):
    """The request clashes with existing state (GPUs busy with another run)."""

    exit_code = 6


class RemoteError(DflashError):
    """A remote command failed in a way none of the above describes."""

    exit_code = 1


class Interrupted(DflashError):
    """Ctrl-C: the CLI's SIGINT handler raises this instead of KeyboardInterrupt, so that no
    library (click, typer) swallows it and the documented `error: interrupted` is printed."""

    exit_code = 130

    def __init__(self, detail: str = "") -> None:
        super().__init__(f"interrupted; {detail}" if detail else "interrupted")


class OutputClosed(DflashError):
    """This process's own stdout or stderr went away (a reader such as `head` closed the pipe) or
    cannot be written (`> /dev/full`). A closed pipe ends the command quietly, as `tail -f | head`
    does; any other write error is one line."""

    exit_code = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left

    def __init__(self, exc: OSError, what: str = "stdout"):
        self.quiet = isinstance(exc, BrokenPipeError)
        super().__init__(f"cannot write to {what}: {exc.strerror or exc}")
