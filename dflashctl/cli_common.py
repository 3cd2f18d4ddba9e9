"""What every command group of the CLI shares: the Typer app, the call's state, completion,
and the HOST/RUN argument rules."""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, List, Optional

import typer

if TYPE_CHECKING:  # rich is imported where output is drawn: a piped call never loads it
    from rich.console import Console

from .errors import DflashError, Interrupted, NotFoundError, UsageError
from .inventory import completions, load_inventory
from .session import Session

app = typer.Typer(
    help="Train DFlash drafters on your GPU hosts: push, train, follow, inspect, diagnose.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# The command groups, here so that `--help` lists them in this order whatever imports them first.
hosts_app = typer.Typer(help="Inventory: list, check, trust and disconnect hosts.", no_args_is_help=True)
app.add_typer(hosts_app, name="hosts")
runs_app = typer.Typer(help="Training runs: list, show, stop, pull.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")
logs_app = typer.Typer(help="Run logs: tail and follow.", no_args_is_help=True)
app.add_typer(logs_app, name="logs")
data_app = typer.Typer(
    help="Datasets in the container: push, list, and regenerate responses with the target "
    "(a run names one as data:NAME).",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data")


@dataclass
class AppState:
    """Options shared by every command of one CLI call."""

    inventory: Optional[str] = None
    debug: bool = False
    sessions: list = field(default_factory=list)
    interrupted: bool = False  # a Ctrl-C came (an error that follows may be its doing)
    signum: int = signal.SIGINT  # what interrupted: SIGINT (Ctrl-C), SIGTERM or SIGHUP (a kill, a closed terminal)

    def interrupt_code(self) -> int:
        """The exit code of an interrupted call: 128 + the signal, as a shell reports one (130 for Ctrl-C)."""
        return 128 + self.signum

    def session(self) -> Session:
        """Load the inventory and open a Session that is closed when the call ends."""
        session = Session(load_inventory(self.inventory))
        self.sessions.append(session)
        return session


def app_state(ctx: typer.Context) -> AppState:
    return ctx.ensure_object(AppState)


@contextmanager
def detaches(state: AppState, host: str, run_id: str, err: Console) -> Iterator[None]:
    """Once a run exists, a Ctrl-C anywhere after (or an error it caused, such as a channel that a
    Ctrl-C cut while it opened) leaves the run going: one line that names it, exit 130."""
    from rich.text import Text

    try:
        yield
    except DflashError as exc:
        if not (isinstance(exc, Interrupted) or state.interrupted):
            raise
        err.print(Text(f"detached; the run goes on. Re-attach: dflashctl logs tail {host} {run_id} -f"), soft_wrap=True)
        raise typer.Exit(Interrupted.exit_code) from None  # main() gives it the signal's own code


def complete_host(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """Shell completion of HOST from the inventory (read locally; no host is contacted)."""
    try:
        return completions(load_inventory(ctx.find_root().params.get("inventory")), incomplete)
    except DflashError:  # a broken hosts.yaml completes nothing rather than printing an error mid-line
        return []


def complete_run(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """Shell completion of RUN: run ids and names on the HOST given before it (one quick remote call)."""
    from .runs import run_completions
    from .ssh import SshOptions

    try:
        inventory = load_inventory(ctx.find_root().params.get("inventory"))
        host = inventory.resolve_many(ctx.params.get("host"))[0]
        # A TAB must not hang on a dead host: one short connection attempt, a short answer timeout.
        with Session(inventory, ssh_options=SshOptions(connect_timeout=3, attempts=1)) as session:
            return run_completions(session.target(host.name), incomplete, timeout=5)
    except DflashError:  # unreachable, untrusted, no runs directory: nothing to offer, and no error mid-line
        return []


# HOST and RUN of `runs show/stop/pull` and `logs tail`: `CMD RUN` alone means RUN on the default host.
HOST_THEN_RUN = {
    "help": "Host (default host if omitted; a single non-host argument is a RUN).",
    "autocompletion": complete_host,
}
RUN_ARG = {"help": "Run id, unique prefix, or name (default: the latest run).", "autocompletion": complete_run}


def hosts_or_all(session: Session, host: Optional[str], all_hosts: bool) -> list:
    """The hosts named by HOST (a host, `h1,h2` or a group; each once), or with --all every inventory host."""
    if all_hosts and host is not None:
        raise UsageError("give HOST or --all, not both")
    if all_hosts:
        return list(session.inventory.hosts.values())
    named = {spec.name: spec for spec in session.inventory.resolve_many(host)}  # `h1,h1`: once, in order
    return list(named.values())


def run_name(value: Optional[str]) -> Optional[str]:
    """--name's callback: a blank name started an unnamed run ('') or one no table shows ('  ')."""
    if value is not None and not value.strip():
        raise UsageError(f"--name {value!r} is blank: give the run a name, or leave --name out")
    return value


def parse_env(items: List[str]) -> dict:
    """`--env KEY=VALUE` (repeatable) as a dict; bad names are a usage error."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise UsageError(f"--env {item!r} is not of the form NAME=VALUE")
        env[key] = value
    return env


def host_and_run(session: Session, host: Optional[str], run: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """`CMD RUN` means RUN on the default host: a lone argument naming no host, group or host list is a run."""
    inv = session.inventory
    if host is not None and run is None and host not in inv.hosts and host not in inv.groups and "," not in host:
        return None, host
    return host, run


@contextmanager
def word_is_host_or_run(session: Session, host: Optional[str], run: Optional[str]):
    """A lone word taken as a run that no run matches may have been meant as a host: say both."""
    try:
        yield
    except NotFoundError as exc:
        # "no runs yet" too: on a fresh machine the word was a host far more often than a run.
        none_yet = "no runs yet" in str(exc)
        if host is None and run is not None and run not in session.inventory.hosts:
            if none_yet or "no run matches" in str(exc):
                known = ", ".join(sorted(session.inventory.hosts)) or "none"
                raise NotFoundError(
                    f"'{run}' is neither a host in the inventory (hosts: {known}) nor a run on "
                    f"{session.host(None).name}"
                    + (" (no runs yet)" if none_yet else "")
                    + session.inventory.none_found()
                ) from None
        raise


def run_target(session: Session, host: Optional[str], run: Optional[str]):  # type: ignore[no-untyped-def]
    """(target, host, run) for `CMD [HOST] [RUN]`: a lone word naming no host is the RUN."""
    host, run = host_and_run(session, host, run)
    return session.target(first_host(session, host)), host, run


def first_host(session: Session, spec: Optional[str]) -> Optional[str]:
    """The host to ask first for HOST given as a host, `a,b` or a group name (None: the default)."""
    return session.inventory.resolve_many(spec)[0].name if spec else None


def split_command(text: str, option: str) -> list:
    """A command given as one shell-like line, split into argv (never run through a shell)."""
    import shlex

    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"{option} {text!r}: {exc}") from None
    if not argv:
        raise UsageError(f"{option} needs a command")
    return argv


def held(gpus: List[str]) -> str:
    """`GPUs 0,1`, `CPU`, or `no GPU` (a remote engine): what a started run holds."""
    if not gpus:
        return "no GPU"
    numeric = [g for g in gpus if g != "cpu"]
    return f"GPU{'s' if len(numeric) > 1 else ''} {','.join(numeric)}" if numeric else "CPU"


def follow_choice(follow: bool, detach: bool) -> Optional[bool]:
    """--follow (True), --detach (False) or neither (None: the terminal decides); both is a UsageError."""
    if follow and detach:
        raise UsageError("--follow and --detach contradict each other: give one")
    return True if follow else False if detach else None


def follow_or_detach(
    state: AppState,
    session: Session,
    target,
    run_id: str,
    what: str,  # type: ignore[no-untyped-def]
    follow: Optional[bool],
    err: Console,
) -> Optional[int]:
    """After a start (`what`: `started run ID on HOST, GPUs 0,1`): print the run id and how to
    follow it (None), or follow its log until the run ends (its exit code). --follow defaults to
    whether stdout is a terminal."""
    from rich.console import Console
    from rich.text import Text
    from .logs import attach

    with detaches(state, target.host.name, run_id, err):
        if not (sys.stdout.isatty() if follow is None else follow):
            typer.echo(run_id)
            err.print(
                Text(f"{what}; follow it: dflashctl logs tail {target.host.name} {run_id} -f", style="dim"),
                soft_wrap=True,
            )
            return None
        err.print(Text(f"{what} (Ctrl-C detaches; the run goes on)", style="dim"), soft_wrap=True)
        out = Console()
        return attach(
            session,
            target.host.name,
            run_id,
            follow=True,
            lines=-1,
            out=sys.stdout.buffer,
            console=out if out.is_terminal else None,
            err=err,
        )
