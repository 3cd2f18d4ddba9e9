"""The `dflashctl` command line: wires commands to functions and turns errors into exit codes.

Logic lives in the modules named for each job; the command groups (cli_hosts, cli_runs,
cli_data, cli_tools, sharing cli_common) parse options, open a Session, call one function and
render its result; this file is the entry point and the global options.
"""

from __future__ import annotations

import sys
from typing import Optional

import click
import typer

# The command groups register their commands on `app` when imported.
from . import __version__, cli_data, cli_hosts, cli_runs, cli_tools  # noqa: F401
from .cli_common import AppState, app, app_state
from .errors import DflashError, Interrupted, OutputClosed
from .output import guarded_stdout


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflashctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    inventory: Optional[str] = typer.Option(
        None,
        "--inventory",
        "-i",
        help="hosts.yaml to use (else $DFLASHCTL_INVENTORY, ./hosts.yaml, ~/.config/dflashctl/hosts.yaml).",
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    state = app_state(ctx)
    state.inventory = inventory
    state.debug = debug


def main() -> None:
    """Console entry point: run the app, print errors as one red line, exit with their code."""
    import signal
    from functools import partial

    state = AppState()
    code = 0
    # Our own: click and typer swallow KeyboardInterrupt. A kill (SIGTERM) or a closed terminal (SIGHUP)
    # must stop what a Ctrl-C stops (a guarded command on the host) rather than end this process
    # with it still running there; a SIGHUP ignored on purpose (nohup) stays ignored.
    caught = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        caught.append(signal.SIGHUP)
    previous = {sig: signal.signal(sig, partial(_interrupt, state)) for sig in caught}
    try:
        with guarded_stdout():
            # Not standalone: click's errors come here, to be printed as one line like ours.
            rv = app(obj=state, standalone_mode=False, prog_name="dflashctl")  # also names the completion variable
        code = rv if isinstance(rv, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except OutputClosed as exc:
        code = exc.exit_code if exc.quiet else _report(state, exc, exc.exit_code)
        _quiet_std_streams()
    except Interrupted as exc:
        code = _report(state, exc, state.interrupt_code(), _interrupted_line(state, exc))
    except DflashError as exc:
        code = _report(state, exc, exc.exit_code)
    except click.exceptions.NoArgsIsHelpError as exc:  # `dflashctl runs`: that group's help, once
        if help_text := exc.format_message():  # empty where typer's rich help has printed itself already
            typer.echo(help_text)
        code = exc.exit_code
    except click.UsageError as exc:
        code = _report(state, exc, exc.exit_code, _usage_line(exc))
    except click.ClickException as exc:
        code = _report(state, exc, exc.exit_code, exc.format_message())
    except (click.Abort, KeyboardInterrupt):
        code = _report(state, None, state.interrupt_code(), _interrupted_line(state, Interrupted()))
    except Exception as exc:  # a bug: still one line unless --debug
        hint = "" if state.debug else " (rerun with --debug)"
        code = _report(state, exc, 1, f"internal error: {type(exc).__name__}: {exc}{hint}")
    finally:
        for session in state.sessions:
            session.close()
        for sig, handler in previous.items():  # an in-process caller (the tests) gets its own back
            signal.signal(sig, handler)
    if state.interrupted and code == Interrupted.exit_code:  # a follow detached: the shell's code for the signal
        code = state.interrupt_code()
    sys.exit(code)


def _interrupt(state: AppState, signum: int, frame: object) -> None:
    state.interrupted, state.signum = True, signum
    if _starting_a_thread(frame):
        _signal_again(signum)
        return
    raise Interrupted()


def _starting_a_thread(frame: object) -> bool:
    """Whether the signal came in threading.Thread.start's own frame. Raised there, just after the new
    thread came to be, start's `except Exception` undoes its bookkeeping under that thread, which then
    dies of a KeyError that CPython prints (`Exception ignored in thread started by ...`), or the CLI
    ends with `internal error: KeyError`."""
    import threading

    return getattr(frame, "f_code", None) is threading.Thread.start.__code__


def _signal_again(signum: int) -> None:
    """Send this main thread the signal again from a bare thread (one C call: no threading bookkeeping
    to break), so that it is raised a moment later, once start has moved on."""
    import _thread
    import signal

    _thread.start_new_thread(signal.pthread_kill, (_thread.get_ident(), signum))


def _interrupted_line(state: AppState, exc: Interrupted) -> str:
    """`interrupted...`, naming the signal when it was not a Ctrl-C (`interrupted by SIGTERM; ...`)."""
    import signal

    text = str(exc)
    if state.signum == signal.SIGINT:
        return text
    return text.replace("interrupted", f"interrupted by {signal.Signals(state.signum).name}", 1)


def _usage_line(exc: "click.UsageError") -> str:
    """`No such option: --bogus` and, on a second line, the command's usage and where help is."""
    message = exc.format_message()
    head, *hints = message.split(" Did you mean ")
    if len(hints) > 1 and len(set(hints)) == 1:  # click and typer each add the same suggestion
        message = f"{head} Did you mean {hints[0]}"
    if exc.ctx is None:
        return message
    message += _global_option_hint(exc)
    usage = exc.ctx.get_usage().replace("Usage: ", "usage: ", 1)
    return f"{message}\n{usage} (see {exc.ctx.command_path} --help)"


def _global_option_hint(exc: "click.UsageError") -> str:
    """Where a global option goes when it came after a command (`(rerun with --debug)` invites that)."""
    name = getattr(exc, "option_name", None)
    ctx = exc.ctx
    if not isinstance(exc, click.NoSuchOption) or ctx is None or ctx.parent is None:
        return ""
    if not any(name in param.opts and not param.is_eager for param in ctx.find_root().command.params):
        return ""
    command = ctx.command_path.split(" ", 1)[1]
    return f" ({name} is dflashctl's own option: give it before the command, dflashctl {name} ... {command} ...)"


def _quiet_std_streams() -> None:
    """Point stdout and stderr at /dev/null: the interpreter's own flush at exit must not fail again."""
    import os

    null = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(null, stream.fileno())
        except (OSError, ValueError):
            pass


def _report(state: AppState, exc: BaseException | None, code: int, message: str | None = None) -> int:
    from rich.console import Console
    from rich.text import Text

    err = Console(stderr=True)
    try:
        if state.debug and exc is not None:
            import traceback

            err.print(Text("".join(traceback.format_exception(exc)), style="dim"))
        err.print(Text("error: ", style="bold red") + Text(message or str(exc)), soft_wrap=True)
    except OSError:  # stderr itself is gone: the exit code is all that is left
        _quiet_std_streams()
    return code
