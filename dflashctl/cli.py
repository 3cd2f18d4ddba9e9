"""The `dflashctl` command line: wires commands to functions and turns errors into exit codes.

Logic lives in the modules named for each job; this file parses options, opens a Session,
calls one function, and renders its result.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field
from typing import List, Optional

import typer
from rich.console import Console
from rich.text import Text

from . import __version__
from .errors import DflashError, UsageError
from .inventory import load_inventory
from .session import Session

app = typer.Typer(
    help="Train DFlash drafters on your GPU hosts: push, train, follow, inspect, diagnose.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
hosts_app = typer.Typer(help="Inventory: list, check and trust hosts.", no_args_is_help=True)
app.add_typer(hosts_app, name="hosts")


@dataclass
class AppState:
    """Options shared by every command of one CLI call."""

    inventory: Optional[str] = None
    debug: bool = False
    sessions: list = field(default_factory=list)

    def session(self) -> Session:
        """Load the inventory and open a Session that is closed when the call ends."""
        session = Session(load_inventory(self.inventory))
        self.sessions.append(session)
        return session


def _state(ctx: typer.Context) -> AppState:
    return ctx.ensure_object(AppState)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflashctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    inventory: Optional[str] = typer.Option(
        None, "--inventory", "-i", help="hosts.yaml to use (else $DFLASHCTL_INVENTORY, ./hosts.yaml, ~/.config/dflashctl/hosts.yaml)."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    state = _state(ctx)
    state.inventory = inventory
    state.debug = debug


# --- hosts -------------------------------------------------------------------------------------


@hosts_app.command("list")
def hosts_list(ctx: typer.Context) -> None:
    """List the inventory's hosts."""
    from .hosts import render_host_table

    session = _state(ctx).session()
    Console().print(render_host_table(session.inventory))


@hosts_app.command("check")
def hosts_check(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, help="Host name (default host if omitted)."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Check reachability, container, interpreter, torch and GPUs of a host."""
    from .hosts import check_host, render_checks

    session = _state(ctx).session()
    checks = check_host(session, host)
    render_checks(checks, json_out=json_out)
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


@hosts_app.command("trust")
def hosts_trust(
    ctx: typer.Context,
    host: str = typer.Argument(..., help="Host whose SSH key to record in ~/.ssh/known_hosts."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (scripts)."),
) -> None:
    """Show a host's SSH key fingerprint and record it as trusted."""
    from .ssh import trust_host

    session = _state(ctx).session()
    trust_host(session.host(host), confirm=None if yes else _confirm)


def _confirm(question: str) -> bool:
    return typer.confirm(question, default=False)


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_cmd(
    ctx: typer.Context,
    host: str = typer.Argument(..., help="Host to run on."),
    command: List[str] = typer.Argument(..., help="Command and arguments (put them after --)."),
) -> None:
    """Run a command inside the host's container; its exit code is passed through."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("exec needs a command: dflashctl exec HOST -- CMD [ARGS...]")
    session = _state(ctx).session()
    target = session.target(host)
    out, err = sys.stdout.buffer, sys.stderr.buffer

    def write(stream):  # type: ignore[no-untyped-def]
        def sink(chunk: bytes) -> None:
            stream.write(chunk)
            stream.flush()

        return sink

    result = target.run(command, stdin=None, on_stdout=write(out), on_stderr=write(err))
    raise typer.Exit(result.exit_code)


# --- push --------------------------------------------------------------------------------------


@app.command("push")
def push_cmd(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, help="Host to push to (default host if omitted)."),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="List what would be sent and deleted; change nothing."),
    source: Optional[str] = typer.Option(None, "--source", help="Payload directory (default: the repo's remote_payload/)."),
) -> None:
    """Send remote_payload/ to <workdir>/payload in the container: incremental, atomic, verified."""
    from pathlib import Path

    from .payload import BarProgress, push

    target = _state(ctx).session().target(host)
    console = Console()
    src = Path(source).expanduser() if source else None
    if dry_run:
        result = push(target, src, dry_run=True)
        for path in result.sent_paths:
            console.print(Text(f"send    {path}"))
        for path in result.deleted_paths:
            console.print(Text(f"delete  {path}"))
    elif console.is_terminal:
        with BarProgress(console) as bar:
            result = push(target, src, progress=bar)
    else:
        result = push(target, src)
    console.print(Text(result.summary()), soft_wrap=True)


# --- entry point -------------------------------------------------------------------------------


def main() -> None:
    """Console entry point: run the app, print errors as one red line, exit with their code."""
    state = AppState()
    code = 0
    try:
        app(obj=state, standalone_mode=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except DflashError as exc:
        code = _report(state, exc, exc.exit_code)
    except KeyboardInterrupt:
        code = _report(state, None, 130, "interrupted")
    except Exception as exc:  # a bug: still one line unless --debug
        code = _report(state, exc, 1, f"internal error: {type(exc).__name__}: {exc} (rerun with --debug)")
    finally:
        for session in state.sessions:
            session.close()
    sys.exit(code)


def _report(state: AppState, exc: BaseException | None, code: int, message: str | None = None) -> int:
    err = Console(stderr=True)
    if state.debug and exc is not None:
        err.print(Text("".join(traceback.format_exception(exc)), style="dim"))
    err.print(Text("error: ", style="bold red") + Text(message or str(exc)), soft_wrap=True)
    return code
