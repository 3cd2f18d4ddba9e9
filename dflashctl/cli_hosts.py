"""`dflashctl hosts ...`, `exec`, `push` and `inspect`: the inventory and the containers."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from .cli_common import app, app_state, complete_host, hosts_or_all
from .cli_common import hosts_app
from .errors import UsageError


# --- hosts -------------------------------------------------------------------------------------


@hosts_app.command("list")
def hosts_list(ctx: typer.Context) -> None:
    """List the inventory's hosts."""
    from rich.console import Console
    from .hosts import print_host_table

    session = app_state(ctx).session()
    print_host_table(Console(), session.inventory)


@hosts_app.command("check")
def hosts_check(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None,
        help="Host, `h1,h2` or a group (default host if omitted).",
        autocompletion=complete_host,
    ),
    all_hosts: bool = typer.Option(False, "--all", help="Check every host in the inventory."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Check reachability, container, interpreter, torch and GPUs of a host (several at once)."""
    from .hosts import check_host, check_hosts, render_checks, render_many

    session = app_state(ctx).session()
    hosts = hosts_or_all(session, host, all_hosts)
    if len(hosts) == 1:
        checks = check_host(session, hosts[0].name)
        render_checks(checks, json_out=json_out)
        ok = all(c.ok for c in checks)
    else:
        results = check_hosts(session, hosts)
        render_many(results, json_out=json_out)
        ok = all(c.ok for checks in results.values() for c in checks)
    if not ok:
        raise typer.Exit(1)


@hosts_app.command("trust")
def hosts_trust(
    ctx: typer.Context,
    host: str = typer.Argument(
        ...,
        help="Host whose SSH key to record in ~/.ssh/known_hosts.",
        autocompletion=complete_host,
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (scripts)."),
) -> None:
    """Show a host's SSH key fingerprint and record it as trusted."""
    from .host_trust import trust_host

    session = app_state(ctx).session()
    trust_host(session.host(host), confirm=None if yes else _confirm)


@hosts_app.command("disconnect")
def hosts_disconnect(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None,
        help="Host whose persistent connection to close (default host if omitted).",
        autocompletion=complete_host,
    ),
    all_hosts: bool = typer.Option(False, "--all", help="Close every persistent connection of this user."),
) -> None:
    """Stop the background connection (mux) kept by `persist:`, like `ssh -O exit`."""
    from rich.console import Console
    from .mux import MuxUnavailable, stop_all_muxes, stop_mux

    out = Console(highlight=False)
    try:
        if all_hosts:
            if host:
                raise UsageError("give a HOST or --all, not both")
            stopped = stop_all_muxes()
            out.print(f"closed {len(stopped)} connection(s)" + (f": {', '.join(stopped)}" if stopped else ""))
            return
        spec = app_state(ctx).session().host(host)
        if spec.transport != "ssh":
            out.print(f"{spec.name}: transport {spec.transport}, no connection to close")
            return
        out.print(f"{spec.name}: " + ("connection closed" if stop_mux(spec) else "no persistent connection"))
    except MuxUnavailable as exc:
        raise UsageError(str(exc)) from None


@hosts_app.command("servers")
def hosts_servers(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None, help="Host whose container to look in (default host if omitted).", autocompletion=complete_host
    ),
    stop: bool = typer.Option(False, "--stop", help="Stop every fork server (each exits once its runs end)."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """List the fork servers in a host's container (warm starts, `fork_server:`); --stop stops them."""
    import json

    from rich.console import Console
    from .runs import fork_servers, print_fork_servers

    target = app_state(ctx).session().target(host)
    answer = fork_servers(target, stop)
    if json_out:
        typer.echo(json.dumps(answer, indent=2))
    else:
        print_fork_servers(Console(highlight=False), answer, target.label, stop)


def _confirm(question: str) -> bool:
    """Ask on the terminal; no answer (stdin at its end, as in a script) is a no, not an interrupt."""
    import click

    try:
        return typer.confirm(question, default=False)
    except click.exceptions.Abort:  # click's answer to EOF (a Ctrl-C raises our Interrupted instead)
        return False


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_cmd(
    ctx: typer.Context,
    host: str = typer.Argument(
        ...,
        help="Host to run on.",
        autocompletion=complete_host,
    ),
    command: List[str] = typer.Argument(..., help="Command and arguments (put them after --)."),
) -> None:
    """Run a command inside the host's container; its exit code is passed through."""
    from .passthrough import run_passthrough

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("exec needs a command: dflashctl exec HOST -- CMD [ARGS...]")
    target = app_state(ctx).session().target(host)
    raise typer.Exit(run_passthrough(target, command))


# --- push --------------------------------------------------------------------------------------


@app.command("push")
def push_cmd(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None,
        help="Host to push to (default host if omitted).",
        autocompletion=complete_host,
    ),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="List what would be sent and deleted; change nothing."),
    source: Optional[str] = typer.Option(
        None,
        "--source",
        help="Payload directory (default: the trainer that ships with dflashctl, remote_payload/ in a checkout).",
    ),
) -> None:
    """Send the trainer (this package's payload, or --source) to <workdir>/payload: incremental, atomic, verified."""
    from pathlib import Path

    from .payload import BarProgress, push

    target = app_state(ctx).session().target(host)
    src = Path(source).expanduser() if source else None
    if dry_run:
        result = push(target, src, dry_run=True)
        for path in result.sent_paths:
            typer.echo(f"send    {path}")  # one line per path, never wrapped: scripts read these
        for path in result.deleted_paths:
            typer.echo(f"delete  {path}")
    elif sys.stdout.isatty():  # a bar on a terminal; in a pipe nothing loads rich (a push's start-up)
        from rich.console import Console

        with BarProgress(Console()) as bar:
            result = push(target, src, progress=bar)
    else:
        result = push(target, src)
    typer.echo(result.summary())


# --- inspect -----------------------------------------------------------------------------------


@app.command("inspect")
def inspect_cmd(
    ctx: typer.Context,
    target: str = typer.Argument(
        ..., help="Alias (compile_fx, inductor.config, ...), dotted module, symbol or config key."
    ),
    host: Optional[str] = typer.Option(
        None, "--host", "-H", help="Host to read from (default host if omitted).", autocompletion=complete_host
    ),
    lines: Optional[str] = typer.Option(None, "--lines", "-l", help="A:B, A:+N (A and N more) or A (with --context)."),
    context: int = typer.Option(0, "--context", "-C", help="Lines around --lines A or around --grep matches."),
    grep: Optional[str] = typer.Option(
        None, "--grep", "-g", help="Regex; show matching lines (config: matching keys)."
    ),
    path: bool = typer.Option(False, "--path", help="Print the remote file path and package version."),
    source: bool = typer.Option(False, "--source", help="For config modules: show source instead of live values."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Read remote PyTorch source (lines, symbols, grep) or live config, exactly and fast."""
    from .introspect import InspectOptions, run_inspect

    opts = InspectOptions(target, lines, context, grep, path, source, json_out)
    remote = app_state(ctx).session().target(host)
    from .output import write_out

    def write(text: str) -> None:
        write_out(sys.stdout.buffer, text.encode("utf-8"))  # a closed pipe or a full disk: OutputClosed

    # Highlighted on a terminal; in a pipe the exact text, without loading rich (a read's start-up).
    pretty = None
    if sys.stdout.isatty() and not json_out:
        from rich.console import Console

        pretty = Console()
    run_inspect(remote, opts, write, pretty=pretty)
