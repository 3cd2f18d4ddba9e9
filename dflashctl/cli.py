"""The `dflashctl` command line: wires commands to functions and turns errors into exit codes.

Logic lives in the modules named for each job; this file parses options, opens a Session,
calls one function, and renders its result.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional

import click
import typer
from rich.console import Console
from rich.text import Text

from . import __version__
from .errors import DflashError, Interrupted, NotFoundError, OutputClosed, RemoteError, UsageError
from .inventory import completions, load_inventory
from .session import Session

app = typer.Typer(
    help="Train DFlash drafters on your GPU hosts: push, train, follow, inspect, diagnose.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
hosts_app = typer.Typer(help="Inventory: list, check, trust and disconnect hosts.", no_args_is_help=True)
app.add_typer(hosts_app, name="hosts")


@dataclass
class AppState:
    """Options shared by every command of one CLI call."""

    inventory: Optional[str] = None
    debug: bool = False
    sessions: list = field(default_factory=list)
    interrupted: bool = False  # a Ctrl-C came (an error that follows may be its doing)

    def session(self) -> Session:
        """Load the inventory and open a Session that is closed when the call ends."""
        session = Session(load_inventory(self.inventory))
        self.sessions.append(session)
        return session


def _state(ctx: typer.Context) -> AppState:
    return ctx.ensure_object(AppState)


@contextmanager
def _detaches(state: AppState, host: str, run_id: str, err: Console) -> Iterator[None]:
    """Once a run exists, a Ctrl-C anywhere after (or an error it caused, such as a channel that a
    Ctrl-C cut while it opened) leaves the run going: one line that names it, exit 130."""
    try:
        yield
    except DflashError as exc:
        if not (isinstance(exc, Interrupted) or state.interrupted):
            raise
        err.print(Text(f"detached; the run goes on. Re-attach: dflashctl logs tail {host} {run_id} -f"),
                  soft_wrap=True)
        raise typer.Exit(Interrupted.exit_code) from None


def _complete_host(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """Shell completion of HOST from the inventory (read locally; no host is contacted)."""
    try:
        return completions(load_inventory(ctx.find_root().params.get("inventory")), incomplete)
    except DflashError:  # a broken hosts.yaml completes nothing rather than printing an error mid-line
        return []


def _complete_run(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
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
_HOST_THEN_RUN = {"help": "Host (default host if omitted; a single non-host argument is a RUN).",
                  "autocompletion": _complete_host}
_RUN = {"help": "Run id, unique prefix, or name (default: the latest run).", "autocompletion": _complete_run}


def _hosts_or_all(session: Session, host: Optional[str], all_hosts: bool) -> list:
    """The hosts named by HOST (a host, `h1,h2` or a group), or with --all every inventory host."""
    if all_hosts and host is not None:
        raise UsageError("give HOST or --all, not both")
    return list(session.inventory.hosts.values()) if all_hosts else session.inventory.resolve_many(host)


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
    from .hosts import print_host_table

    session = _state(ctx).session()
    print_host_table(Console(), session.inventory)


@hosts_app.command("check")
def hosts_check(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None, help="Host, `h1,h2` or a group (default host if omitted).",
        autocompletion=_complete_host,
    ),
    all_hosts: bool = typer.Option(False, "--all", help="Check every host in the inventory."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Check reachability, container, interpreter, torch and GPUs of a host (several at once)."""
    from .hosts import check_host, check_hosts, render_checks, render_many

    session = _state(ctx).session()
    hosts = _hosts_or_all(session, host, all_hosts)
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
        ..., help="Host whose SSH key to record in ~/.ssh/known_hosts.",
        autocompletion=_complete_host,
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (scripts)."),
) -> None:
    """Show a host's SSH key fingerprint and record it as trusted."""
    from .ssh import trust_host

    session = _state(ctx).session()
    trust_host(session.host(host), confirm=None if yes else _confirm)


@hosts_app.command("disconnect")
def hosts_disconnect(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None, help="Host whose persistent connection to close (default host if omitted).",
        autocompletion=_complete_host,
    ),
    all_hosts: bool = typer.Option(False, "--all", help="Close every persistent connection of this user."),
) -> None:
    """Stop the background connection (mux) kept by `persist:`, like `ssh -O exit`."""
    from .mux import MuxUnavailable, stop_all_muxes, stop_mux

    out = Console(highlight=False)
    try:
        if all_hosts:
            if host:
                raise UsageError("give a HOST or --all, not both")
            stopped = stop_all_muxes()
            out.print(f"closed {len(stopped)} connection(s)" + (f": {', '.join(stopped)}" if stopped else ""))
            return
        spec = _state(ctx).session().host(host)
        if spec.transport != "ssh":
            out.print(f"{spec.name}: transport {spec.transport}, no connection to close")
            return
        out.print(f"{spec.name}: " + ("connection closed" if stop_mux(spec) else "no persistent connection"))
    except MuxUnavailable as exc:
        raise UsageError(str(exc)) from None


def _confirm(question: str) -> bool:
    return typer.confirm(question, default=False)


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_cmd(
    ctx: typer.Context,
    host: str = typer.Argument(
        ..., help="Host to run on.",
        autocompletion=_complete_host,
    ),
    command: List[str] = typer.Argument(..., help="Command and arguments (put them after --)."),
) -> None:
    """Run a command inside the host's container; its exit code is passed through."""
    from .passthrough import run_passthrough

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("exec needs a command: dflashctl exec HOST -- CMD [ARGS...]")
    target = _state(ctx).session().target(host)
    raise typer.Exit(run_passthrough(target, command))


# --- push --------------------------------------------------------------------------------------


@app.command("push")
def push_cmd(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None, help="Host to push to (default host if omitted).",
        autocompletion=_complete_host,
    ),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="List what would be sent and deleted; change nothing."),
    source: Optional[str] = typer.Option(None, "--source", help="Payload directory (default: the trainer that ships with dflashctl, remote_payload/ in a checkout)."),
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
            console.print(Text(f"send    {path}"), soft_wrap=True)  # never wrap a path: scripts read these
        for path in result.deleted_paths:
            console.print(Text(f"delete  {path}"), soft_wrap=True)
    elif console.is_terminal:
        with BarProgress(console) as bar:
            result = push(target, src, progress=bar)
    else:
        result = push(target, src)
    console.print(Text(result.summary()), soft_wrap=True)


# --- inspect -----------------------------------------------------------------------------------


@app.command("inspect")
def inspect_cmd(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Alias (compile_fx, inductor.config, ...), dotted module, symbol or config key."),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host to read from (default host if omitted).",
                                        autocompletion=_complete_host),
    lines: Optional[str] = typer.Option(None, "--lines", "-l", help="A:B, A:+N (A and N more) or A (with --context)."),
    context: int = typer.Option(0, "--context", "-C", help="Lines around --lines A or around --grep matches."),
    grep: Optional[str] = typer.Option(None, "--grep", "-g", help="Regex; show matching lines (config: matching keys)."),
    path: bool = typer.Option(False, "--path", help="Print the remote file path and package version."),
    source: bool = typer.Option(False, "--source", help="For config modules: show source instead of live values."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Read remote PyTorch source (lines, symbols, grep) or live config, exactly and fast."""
    from .introspect import InspectOptions, run_inspect

    opts = InspectOptions(target, lines, context, grep, path, source, json_out)
    remote = _state(ctx).session().target(host)
    console = Console()
    out = sys.stdout.buffer

    def write(text: str) -> None:
        out.write(text.encode("utf-8"))
        out.flush()

    run_inspect(remote, opts, write, pretty=console if console.is_terminal and not json_out else None)


# --- runs --------------------------------------------------------------------------------------
# `train`, `runs list/show/stop`, `logs tail`: logic in runs.py / logs.py, exit codes in docs/runs.md.

runs_app = typer.Typer(help="Training runs: list, show, stop, pull.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")
logs_app = typer.Typer(help="Run logs: tail and follow.", no_args_is_help=True)
app.add_typer(logs_app, name="logs")


def _parse_env(items: List[str]) -> dict:
    """`--env KEY=VALUE` (repeatable) as a dict; bad names are a usage error."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise UsageError(f"--env {item!r} is not of the form NAME=VALUE")
        env[key] = value
    return env


def _host_and_run(session: Session, host: Optional[str], run: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """`CMD RUN` means RUN on the default host: a lone argument naming no host, group or host list is a run."""
    inv = session.inventory
    if host is not None and run is None and host not in inv.hosts and host not in inv.groups and "," not in host:
        return None, host
    return host, run


@contextmanager
def _word_is_host_or_run(session: Session, host: Optional[str], run: Optional[str]):
    """A lone word taken as a run that no run matches may have been meant as a host: say both."""
    try:
        yield
    except NotFoundError as exc:
        if host is None and run is not None and run not in session.inventory.hosts and "no run matches" in str(exc):
            known = ", ".join(sorted(session.inventory.hosts)) or "none"
            raise NotFoundError(f"'{run}' is neither a host in the inventory (hosts: {known}) nor a run on "
                                f"{session.host(None).name}") from None
        raise


def _run_target(session: Session, host: Optional[str], run: Optional[str]):  # type: ignore[no-untyped-def]
    """(target, host, run) for `CMD [HOST] [RUN]`: a lone word naming no host is the RUN."""
    host, run = _host_and_run(session, host, run)
    return session.target(_first_host(session, host)), host, run


def _first_host(session: Session, spec: Optional[str]) -> Optional[str]:
    """The host to ask first for HOST given as a host, `a,b` or a group name (None: the default)."""
    return session.inventory.resolve_many(spec)[0].name if spec else None


@app.command("train")
def train_cmd(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None, help="Host to train on (default host if omitted); `h1,h2` or a group: one run across those hosts.",
        autocompletion=_complete_host,
    ),
    gpus: Optional[str] = typer.Option(
        None, "--gpus", help="GPU indices like 0,1, or cpu (default: the host's gpus, else every GPU the trainer sees)."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Trainer preset: real-target (default with target.path), tiny (default without), qwen3-8b, llama3-8b, qwen3-30b-a3b (random weights: speed only) (docs/trainer.md)."),
    config: Optional[Path] = typer.Option(None, "--config", help="Trainer config (YAML); copied into the run directory."),
    overrides: List[str] = typer.Option(
        [], "--set", help="Config override key=value (repeatable). Out of GPU memory? --set data.max_length=2048 "
                          "or fewer data.anchors_per_seq."),
    name: Optional[str] = typer.Option(None, "--name", help="A label for the run (stored as given)."),
    resume: Optional[str] = typer.Option(
        None, "--resume", metavar="RUN", help="Continue an ended run (id, prefix or name) from its newest checkpoint, "
                                             "in its directory with its config."),
    max_restarts: int = typer.Option(
        0, "--max-restarts", help="Restart the trainer from its newest checkpoint after a crash or stall, up to N times."),
    restart_on: Optional[str] = typer.Option(
        None, "--restart-on", help="Exit codes that restart it, e.g. 1,75,137 (default: any but 0, 2, 4 and a stop)."),
    restart_delay: float = typer.Option(10.0, "--restart-delay", help="Seconds before the first restart (doubling)."),
    on_event: Optional[str] = typer.Option(
        None, "--on-event", help="Command run in the container at each run event (started, restarted, succeeded, "
                                 "failed, stopped, lost), split like a shell line; its environment says which "
                                 "(DFLASHCTL_EVENT, DFLASHCTL_RUN_ID, ...). Default: hosts.yaml's on_event."),
    follow: Optional[bool] = typer.Option(None, "--follow/--detach", help="Stream the log until the run ends (default on a terminal)."),
    force: bool = typer.Option(False, "--force", help="Start even if a live run uses the same GPUs."),
    queue: bool = typer.Option(False, "--queue", help="If the GPUs are busy, wait for them (FIFO, in the container: "
                                                    "no client needs to stay connected) instead of refusing."),
    no_push: bool = typer.Option(False, "--no-push", help="Use the payload already in the container."),
    source: Optional[Path] = typer.Option(None, "--source", help="Payload directory to push (default: the trainer that ships with dflashctl)."),
    rdzv_port: int = typer.Option(29500, "--rdzv-port", help="Several hosts: the rendezvous (MASTER_PORT) on the first host."),
    env_items: List[str] = typer.Option([], "--env", help="NAME=VALUE for the trainer's environment (repeatable), e.g. NCCL_SOCKET_IFNAME=eth0."),
) -> None:
    """Push the payload if it changed, pre-flight the config and devices, start the trainer
    detached, and (optionally) follow it. `--resume RUN` continues an ended run instead."""
    from .logs import attach
    from .runs import check_trainer_config, parse_gpus, push_payload, restart_policy, resume_run, start_run

    session = _state(ctx).session()
    env = _parse_env(env_items)
    restart = restart_policy(max_restarts, restart_on, restart_delay)
    hook = _split_command(on_event, "--on-event") if on_event is not None else []
    if config is not None and not config.is_file():
        raise UsageError(f"--config: no such file: {config}")
    if resume is not None:
        given = [flag for flag, value in (("--config", config), ("--set", overrides), ("--preset", preset),
                                          ("--name", name), ("--gpus", gpus), ("--max-restarts", max_restarts)) if value]
        if given:
            raise UsageError(f"--resume continues a run with its own config and GPUs: drop {', '.join(given)}")
    hosts = session.inventory.resolve_many(host)
    if len(hosts) > 1:
        if resume is not None or restart or queue:
            raise UsageError("--resume, --max-restarts and --queue take one host (a run across several hosts restarts as a whole: "
                             "start it again with train)")
        raise typer.Exit(_train_group(session, hosts, gpus=gpus, config=config, overrides=overrides, name=name,
                                      follow=follow, force=force, no_push=no_push, source=source,
                                      rdzv_port=rdzv_port, env=env, preset=preset, state=_state(ctx)))
    target = session.target(hosts[0].name)
    err = Console(stderr=True)
    gpu_list = parse_gpus(gpus, target.host)
    payload_dir = source.expanduser() if source else None
    # A bad --preset, --config or --set fails here, before anything is pushed (--no-push: the
    # payload in the container is not here to ask; its pre-flight decides).
    checked = None if no_push or resume is not None else check_trainer_config(payload_dir, config, preset,
                                                                             overrides, gpu_list)
    payload_hash = None if no_push else push_payload(target, payload_dir, err)
    if resume is not None:
        run = resume_run(target, resume, payload_hash=payload_hash, force=force, env=env)
        verb = "resumed"
    else:
        run = start_run(target, gpus=gpu_list, config_file=config, overrides=overrides, name=name, force=force,
                        payload_hash=payload_hash, env=env, preset=preset, restart=restart, on_event=hook,
                        queue=queue, config=checked)
        verb = "started"
        if run.queued_behind is not None:
            verb = "queued"
            err.print(Text(f"GPUs busy: queued behind {', '.join(run.queued_behind)}; it starts by itself when they "
                           f"are free (runs stop cancels it)", style="dim"), soft_wrap=True)
    with _detaches(_state(ctx), target.host.name, run.run_id, err):
        on = f"{target.label}, {_held(run.gpus)}"
        if not (sys.stdout.isatty() if follow is None else follow):
            typer.echo(run.run_id)
            err.print(Text(f"{verb} run {run.run_id} on {on}; follow it: "
                           f"dflashctl logs tail {target.host.name} {run.run_id} -f", style="dim"), soft_wrap=True)
            return
        err.print(Text(f"{verb} run {run.run_id} on {on} (Ctrl-C detaches; the run goes on)", style="dim"),
                  soft_wrap=True)
        out = Console()
        code = attach(session, target.host.name, run.run_id, follow=True, lines=-1, out=sys.stdout.buffer,
                      console=out if out.is_terminal else None, err=err)
    raise typer.Exit(code)


def _split_command(text: str, option: str) -> list:
    """A command given as one shell-like line, split into argv (never run through a shell)."""
    import shlex

    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"{option} {text!r}: {exc}") from None
    if not argv:
        raise UsageError(f"{option} needs a command")
    return argv


def _held(gpus: List[str]) -> str:
    """`GPUs 0,1` or `CPU`: what a started run holds."""
    numeric = [g for g in gpus if g != "cpu"]
    return f"GPU{'s' if len(numeric) > 1 else ''} {','.join(numeric)}" if numeric else "CPU"


def _train_group(session: Session, hosts: list, *, gpus: Optional[str], config: Optional[Path], overrides: List[str],
                 name: Optional[str], follow: Optional[bool], force: bool, no_push: bool, source: Optional[Path],
                 rdzv_port: int, env: dict, preset: Optional[str], state: AppState) -> int:
    """`train h1,h2`: one run across hosts (docs/multihost.md); returns the exit code."""
    from functools import partial

    from .logs import attach
    from .multihost import check_hosts, final_state, push_all, start_group
    from .runs import check_trainer_config, parse_gpus

    check_hosts(hosts)
    err = Console(stderr=True)
    gpu_lists = {h.name: parse_gpus(gpus, h) for h in hosts}
    payload_dir = source.expanduser() if source else None
    # Before anything is pushed, as for one host.
    configs = {} if no_push else {h.name: check_trainer_config(payload_dir, config, preset, overrides,
                                                               gpu_lists[h.name]) for h in hosts}
    hashes = {} if no_push else push_all(session, hosts, payload_dir, err)
    group = start_group(session, hosts, gpus=gpu_lists, config_file=config, overrides=overrides, name=name,
                        force=force, payload_hashes=hashes, rdzv_port=rdzv_port, env=env, preset=preset,
                        configs=configs)
    names = ", ".join(f"{h.name} (rank {i})" for i, h in enumerate(hosts))
    first = hosts[0].name
    if not (sys.stdout.isatty() if follow is None else follow):
        typer.echo(group.run_id)
        err.print(Text(f"started run {group.run_id} on {names}, rendezvous {group.rendezvous}; follow it: "
                       f"dflashctl logs tail {first} {group.run_id} -f (--all: every node)", style="dim"),
                  soft_wrap=True)
        return 0
    with _detaches(state, first, group.run_id, err):
        err.print(Text(f"started run {group.run_id} on {names}, rendezvous {group.rendezvous}; following {first} "
                       f"(Ctrl-C detaches; the run goes on)", style="dim"), soft_wrap=True)
        out = Console()
        return attach(session, first, group.run_id, follow=True, lines=-1, out=sys.stdout.buffer,
                      console=out if out.is_terminal else None, err=err, final=partial(final_state, session, first))


@runs_app.command("list")
def runs_list(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None, help="Host, `h1,h2` or a group (default host if omitted).",
        autocompletion=_complete_host,
    ),
    all_hosts: bool = typer.Option(False, "--all", help="List the runs of every host in the inventory."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """List the runs on a host (or several): state, GPUs, start, duration, last step and loss."""
    from .multihost import list_group_runs
    from .runs import print_runs

    session = _state(ctx).session()
    hosts = _hosts_or_all(session, host, all_hosts)
    runs, failed = list_group_runs(session, hosts)  # a multi-host run appears once, its state over all nodes
    if len(hosts) == 1 and failed:
        raise failed[hosts[0].name]
    if json_out:
        typer.echo(json.dumps(runs, indent=2))
    else:
        label = session.target(hosts[0].name).label if len(hosts) == 1 else ", ".join(h.name for h in hosts)
        print_runs(Console(), runs, label, several_hosts=len(hosts) > 1)
    if failed:  # the others' runs were listed; each host that could not be is one error line
        err = Console(stderr=True)
        for exc in failed.values():
            err.print(Text("error: ", style="bold red") + Text(str(exc)), soft_wrap=True)
        raise typer.Exit(next(iter(failed.values())).exit_code)


@runs_app.command("show")
def runs_show(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, **_HOST_THEN_RUN),
    run: Optional[str] = typer.Argument(None, **_RUN),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also write the curves to this PNG (needs the plot extra: pip install 'dflashctl\\[plot]')."),
    curves: bool = typer.Option(True, "--curves/--no-curves", help="Draw loss and acceptance length in the terminal."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Show one run: run.json fields, a metrics summary, and loss / acceptance-length curves."""
    from .multihost import show_group
    from .plot import require_matplotlib, save_png, terminal_plot
    from .runs import details_table

    if plot is not None:
        require_matplotlib()  # before anything is printed
    session = _state(ctx).session()
    host, run = _host_and_run(session, host, run)
    with _word_is_host_or_run(session, host, run):
        info = show_group(session, _first_host(session, host), run)  # several hosts: combined over the nodes
    if json_out:
        typer.echo(json.dumps(info, indent=2))
        return
    console = Console()
    console.print(details_table(info))
    drawing = terminal_plot(info.get("metrics") or [], width=min(console.width, 120)) if curves else None
    if drawing:
        console.print(Text(drawing), soft_wrap=True)
    if plot is not None:
        save_png(info.get("metrics") or [], plot, info["run_id"])
        console.print(Text(f"wrote {plot}"))


@runs_app.command("stop")
def runs_stop(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, **_HOST_THEN_RUN),
    run: Optional[str] = typer.Argument(None, **_RUN),
    grace: float = typer.Option(60.0, "--grace", help="Seconds between SIGTERM (trainer checkpoints) and SIGKILL."),
) -> None:
    """Stop a run: SIGTERM to its trainer, SIGKILL to the trainer's process group after the grace period; state `stopped`."""
    from .multihost import stop_group
    from .runs import check_grace, show_run, state_text

    check_grace(grace)  # before the "stopping" line
    session = _state(ctx).session()
    target, host, run = _run_target(session, host, run)
    with _word_is_host_or_run(session, host, run):
        # Which run, before saying "stopping": an unreachable host or stopped container is one error line.
        shown = show_run(target, run, metrics=False) if run else None
        run_id = shown["run_id"] if shown else _latest_running(target)
    err = Console(stderr=True)
    if shown is None or shown.get("state") in ("running", "queued"):  # an ended run: only "had already ended"
        err.print(Text(f"stopping {run_id} on {target.label} (SIGKILL after {grace:g} s)...", style="dim"))
    info = stop_group(session, target.host.name, run_id, grace)  # a multi-host run: every node
    verb = "had already ended:" if info.get("already") else "is now"
    where = f" on {info['host']}" if info.get("nodes") else ""
    Console().print(Text(f"run {info['run_id']} {verb} ") + state_text(info) + Text(where), soft_wrap=True)


def _latest_running(target) -> str:  # type: ignore[no-untyped-def]
    """`runs stop HOST` with no RUN: the newest running run there (NotFoundError if none runs)."""
    from .runs import list_runs

    running = [r for r in list_runs(target) if r.get("state") == "running"]
    if not running:
        raise NotFoundError(f"no running run on {target.label}")
    return max(running, key=lambda r: (r.get("started_ts") or 0, r["run_id"]))["run_id"]


@runs_app.command("pull")
def runs_pull(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, **_HOST_THEN_RUN),
    run: Optional[str] = typer.Argument(None, **_RUN),
    to: Optional[Path] = typer.Option(None, "--to", help="Directory to create (default: ./RUN_ID); must not exist."),
    checkpoints: str = typer.Option("none", "--checkpoints", help="Also copy checkpoints: none, latest or all."),
) -> None:
    """Copy a run's directory here: exported drafter, config, logs, metrics (and checkpoints if asked)."""
    from rich.filesize import decimal
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from .pull import pull_run

    session = _state(ctx).session()
    target, host, run = _run_target(session, host, run)
    err = Console(stderr=True)
    guard = _word_is_host_or_run(session, host, run)
    bar = Progress(TextColumn("pulling"), BarColumn(), DownloadColumn(binary_units=False), TransferSpeedColumn(),
                   console=err, transient=True, disable=not err.is_terminal)
    with guard, bar:
        task = bar.add_task("pull", total=None)
        pulled = pull_run(target, run, to.expanduser() if to else None, checkpoints,
                          on_bytes=lambda done, total: bar.update(task, completed=done, total=total))
    err.print(Text(f"pulled run {pulled.run_id} ({pulled.state}) from {target.label} to {pulled.dest}: "
                   f"{pulled.files} files, {decimal(pulled.bytes)} in {pulled.seconds:.1f} s"), soft_wrap=True)


@logs_app.command("tail")
def logs_tail(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, **_HOST_THEN_RUN),
    run: Optional[str] = typer.Argument(None, **_RUN),
    lines: int = typer.Option(50, "--lines", "-n", help="How many lines from the end to show first (-1: the whole log)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep following until the run ends; exit with its state's code."),
    since_step: Optional[int] = typer.Option(None, "--since-step", help="Start at the first log line of step K or later."),
    node: Optional[str] = typer.Option(None, "--host", help="Multi-host run: the node whose log to show (default: the rank-0 node).",
                                        autocompletion=_complete_host),
    all_nodes: bool = typer.Option(False, "--all", help="Multi-host run: every node's log, each line prefixed with its host name."),
) -> None:
    """Print a run's last lines; with -f follow it (surviving dropped connections) to the end."""
    from functools import partial

    from .logs import attach
    from .multihost import attach_all, final_state, pick_node

    if lines < -1 or (since_step is not None and since_step < 0):
        raise UsageError("-n takes 0 or more lines (-1: the whole log) and --since-step 0 or more")
    session = _state(ctx).session()
    host, run = _host_and_run(session, host, run)
    err = Console(stderr=True)
    if all_nodes:
        if node is not None:
            raise UsageError("--all and --host exclude each other")
        raise typer.Exit(attach_all(session, host, run, follow=follow, lines=lines, since_step=since_step,
                                    out=sys.stdout.buffer, err=err))
    with _word_is_host_or_run(session, host, run):
        where, run = pick_node(session, host, run, node)
    out = Console()
    raise typer.Exit(attach(session, where, run, follow=follow, lines=lines, since_step=since_step,
                            out=sys.stdout.buffer, console=out if out.is_terminal else None,
                            err=err, final=partial(final_state, session, where)))  # several hosts: the whole run's state


# --- data --------------------------------------------------------------------------------------

data_app = typer.Typer(help="Datasets in the container: push, list, and regenerate responses with the target "
                            "(a run names one as data:NAME).",
                       no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("push")
def data_push(
    ctx: typer.Context,
    host: str = typer.Argument(..., help="Host to send the datasets to.", autocompletion=_complete_host),
    files: List[Path] = typer.Argument(..., help="JSONL files (each kept under its file name)."),
    as_name: Optional[str] = typer.Option(None, "--as", help="The dataset's name there (one file only)."),
) -> None:
    """Copy datasets into <workdir>/data/: streamed, hashed, atomic; unchanged files are skipped."""
    from .data import push_data
    from .runs import fmt_bytes

    target = _state(ctx).session().target(host)
    out = Console()
    for done in push_data(target, [f.expanduser() for f in files], as_name):
        verb = "sent" if done.sent else "unchanged"
        out.print(Text(f"{done.name}: {verb}, {fmt_bytes(done.size)}, {done.rows} rows, sha256 {done.sha256[:12]} "
                       f"(use it as data.train_path=data:{done.name})"), soft_wrap=True)


@data_app.command("list")
def data_list(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, help="Host (default host if omitted).", autocompletion=_complete_host),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """The datasets on a host: name, size, rows, sha256 prefix."""
    from .data import list_data
    from .runs import fmt_bytes
    from .tables import Column, show

    target = _state(ctx).session().target(host)
    datasets = list_data(target)
    if json_out:
        typer.echo(json.dumps(datasets, indent=2))
        return
    show(Console(), [Column("name"), Column("size", "right"), Column("rows", "right"), Column("sha256")],
         [[d["name"], fmt_bytes(d["size"]), str(d["rows"]), d["sha256"][:12]] for d in datasets],
         title=f"datasets on {target.label}")


@data_app.command("regen")
def data_regen(
    ctx: typer.Context,
    host: str = typer.Argument(..., help="Host whose container generates (and holds the datasets).",
                               autocompletion=_complete_host),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Pushed dataset of prompts: chat `messages`, "
                                                                  "a `prompt` string or `input_ids` per row."),
    out: Optional[str] = typer.Option(None, "--out", help="Name of the dataset to write (.jsonl is added); "
                                                          "a run then uses data.train_path=data:NAME.jsonl."),
    engine: str = typer.Option("builtin", "--engine", help="builtin (the project's Qwen3 target on the GPUs) or "
                                                           "openai (a server reachable from the container)."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="builtin: GPU indices like 0,1 (one worker each) or cpu "
                                                            "(default: the host's gpus, else every GPU there)."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Tokens per response at most."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling (with --temperature > 0)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling (per batch; openai: per row)."),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking",
                                            help="enable_thinking of Qwen3 chat templates (default: the template's)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Rows per batch (builtin 32, openai 1)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer directory in the container "
                                                                      "(default: target.path)."),
    preset: Optional[str] = typer.Option(None, "--preset", help="builtin: the target's shape preset (tiny, qwen3-8b, llama3-8b, qwen3-30b-a3b)."),
    overrides: List[str] = typer.Option([], "--set", help="builtin: target.path=DIR, another target.* key, run.dtype "
                                                          "or run.cpu_threads (repeatable)."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="openai: base URL, e.g. http://127.0.0.1:8000."),
    model: Optional[str] = typer.Option(None, "--model", help="openai: the served model's name."),
    concurrency: int = typer.Option(8, "--concurrency", help="openai: requests at once."),
    retries: int = typer.Option(8, "--retries", help="openai: retries of a 429, 5xx, connection error or non-JSON answer."),
    name: Optional[str] = typer.Option(None, "--name", help="A label for the run (default: the output's name)."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="RUN",
                                         help="Continue a stopped or failed regen run where it stopped."),
    follow: Optional[bool] = typer.Option(None, "--follow/--detach", help="Stream the log until the run ends "
                                                                          "(default on a terminal)."),
    force: bool = typer.Option(False, "--force", help="Start even if a live run uses the same GPUs."),
) -> None:
    """Regenerate responses with the target: a detached run (kind data) writing data/NAME.jsonl."""
    from .logs import attach
    from .regen import RegenRequest, check_request, datasets_for, start_regen
    from .runs import push_payload, resume_run

    fixed = ("host", "resume", "follow", "force")
    given = [f"--{p.replace('_', '-')}" for p in ctx.params if p not in fixed
             and ctx.get_parameter_source(p) is click.core.ParameterSource.COMMANDLINE]
    if resume is not None and given:
        raise UsageError(f"--resume continues a regen with its own options: drop {', '.join(given)}")
    if resume is None:
        if not prompts or not out:
            raise UsageError("data regen needs --prompts NAME and --out NAME (or --resume RUN)")
        request = RegenRequest(prompts, out, engine, gpus, max_new_tokens, temperature, top_p, seed, thinking,
                               batch_size, tokenizer, preset, tuple(overrides), endpoint, model, concurrency, retries)
        check_request(request)  # before anything is pushed
    session = _state(ctx).session()
    target = session.target(host)
    err = Console(stderr=True)
    if resume is not None:
        payload_hash = push_payload(target, None, err)
        run = resume_run(target, resume, payload_hash=payload_hash, force=force, kind="data")
        verb, dataset = "resumed", _regen_output(target, run.run_id)
    else:
        prompts_name, dataset = datasets_for(target, request)  # before the push: a wrong name changes nothing
        payload_hash = push_payload(target, None, err)
        run = start_regen(target, request, prompts_name, dataset, name=name, force=force, payload_hash=payload_hash)
        verb = "started"
    what = f"regen run {run.run_id} on {target.label}, {_held(run.gpus) if run.gpus else 'no GPU'}, writing data:{dataset}"
    if not (sys.stdout.isatty() if follow is None else follow):
        typer.echo(run.run_id)
        err.print(Text(f"{verb} {what}; follow it: dflashctl logs tail {target.host.name} {run.run_id} -f",
                       style="dim"), soft_wrap=True)
        return
    with _detaches(_state(ctx), target.host.name, run.run_id, err):
        err.print(Text(f"{verb} {what} (Ctrl-C detaches; the run goes on)", style="dim"), soft_wrap=True)
        out_console = Console()
        code = attach(session, target.host.name, run.run_id, follow=True, lines=-1, out=sys.stdout.buffer,
                      console=out_console if out_console.is_terminal else None, err=err)
    if code == 0:
        err.print(Text(f"wrote data:{dataset}; train on it with --set data.source=jsonl "
                       f"--set data.train_path=data:{dataset}"), soft_wrap=True)
    raise typer.Exit(code)


def _regen_output(target, run_id: str) -> str:  # type: ignore[no-untyped-def]
    """The output dataset of a data run, from its run.json."""
    from .runs import show_run

    return str((show_run(target, run_id, metrics=False).get("config") or {}).get("out", "?"))


# --- tunnel ------------------------------------------------------------------------------------


@app.command("tunnel")
def tunnel_cmd(
    ctx: typer.Context,
    host: str = typer.Argument(..., help="Host whose container has the port.", autocompletion=_complete_host),
    ports: str = typer.Argument(..., help="PORT in the container, or PORT:LOCAL to listen on another local port."),
) -> None:
    """Forward 127.0.0.1:LOCAL here to PORT inside the container (a served drafter, a dashboard)."""
    from .tunnel import Tunnel, parse_ports

    remote, local = parse_ports(ports)
    target = _state(ctx).session().target(host)
    err = Console(stderr=True)
    tunnel = Tunnel(target, remote, local, notice=lambda line: err.print(Text(line, style="dim"), soft_wrap=True))
    err.print(Text(f"forwarding 127.0.0.1:{tunnel.local_port} -> port {remote} in {target.label} "
                   f"(Ctrl-C closes it)"), soft_wrap=True)
    try:
        tunnel.serve()
    except (Interrupted, KeyboardInterrupt):
        pass
    finally:
        tunnel.close()
    err.print(Text("tunnel closed"), soft_wrap=True)


# --- eval --------------------------------------------------------------------------------------


@app.command("eval")
def eval_cmd(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, **_HOST_THEN_RUN),
    run: Optional[str] = typer.Argument(None, **_RUN),
    prompts: Optional[Path] = typer.Option(
        None, "--prompts", help="JSONL of input_ids, messages (chat) or prompt (text) rows "
                                "(default: the run's held-out split)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate per prompt."),
    count: int = typer.Option(16, "--count", help="At most this many prompts."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy, checked lossless; > 0: sampled."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="The one GPU to decode on, e.g. 3, or cpu "
                                                            "(default: the run's first device)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report (eval.json) as JSON."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline",
                                  help="Also decode by prompt lookup, the free baseline (greedy only)."),
) -> None:
    """Measure a finished run's real acceptance length (tau) and speedup by speculative decoding."""
    from .evaluation import render, run_eval

    session = _state(ctx).session()
    target, host, run = _run_target(session, host, run)
    err = Console(stderr=True)
    with _word_is_host_or_run(session, host, run):
        report = run_eval(target, run, prompts.expanduser() if prompts else None, max_new_tokens, count, temperature,
                          progress=lambda line: err.print(Text(line, style="dim"), soft_wrap=True), gpus=gpus,
                          baseline=baseline)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        render(report, Console())
    for what, figures in (("speculative", report), ("prompt-lookup", report.get("baseline") or {})):
        if figures.get("identical") is False and not figures.get("differences_are_ties"):
            raise RemoteError(f"run {report['run_id']}: the {what} output differs from the target's greedy "
                              f"decode (a bug: please report it with eval.json)")


# --- doctor ------------------------------------------------------------------------------------


@app.command("doctor")
def doctor_cmd(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None, help="Host to diagnose (default host if omitted).",
        autocompletion=_complete_host,
    ),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPU indices for the smoke tests, e.g. 0,1 (default: the host's gpus, else all)."),
    quick: bool = typer.Option(False, "--quick", help="Skip the threaded compile smoke tests."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    policies: Optional[str] = typer.Option(None, "--policies", help="Smoke-test only these policies: off,default,cudagraph-trees,cudagraphs."),
    smoke_timeout: float = typer.Option(120.0, "--smoke-timeout", help="Seconds per smoke test, after its imports, before it counts as a hang."),
    steps: int = typer.Option(0, "--steps", show_default=False,  # 0: decided by the device (doctor.py)
                              help="Timed steps per smoke test (default 30 on GPU, 3 on CPU)."),
    jobs: Optional[int] = typer.Option(None, "--jobs", help="Smoke tests run at once (default: one per 4 CPUs of the host)."),
    inject: Optional[str] = typer.Option(None, "--inject", hidden=True, help="Test hook, see docs/doctor.md."),
) -> None:
    """Diagnose a host: GPUs, driver, torch, caches, and threaded torch.compile smoke tests."""
    import json

    from .doctor import DoctorOptions, render_report, run_doctor

    target = _state(ctx).session().target(host)
    err = Console(stderr=True)
    options = DoctorOptions(quick, gpus, policies, smoke_timeout, steps, inject, jobs)
    doc = run_doctor(target, options, progress=lambda line: err.print(Text(line, style="dim")))
    if json_out:
        typer.echo(json.dumps(doc, indent=2))
    else:
        render_report(doc, Console())
    raise typer.Exit(0 if doc["ok"] else 1)


# --- entry point -------------------------------------------------------------------------------


def main() -> None:
    """Console entry point: run the app, print errors as one red line, exit with their code."""
    import signal
    from functools import partial

    state = AppState()
    code = 0
    signal.signal(signal.SIGINT, partial(_interrupt, state))  # our own: click and typer swallow KeyboardInterrupt
    try:
        # Not standalone: click's errors come here, to be printed as one line like ours.
        rv = app(obj=state, standalone_mode=False, prog_name="dflashctl")  # also names the completion variable
        code = rv if isinstance(rv, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except OutputClosed as exc:
        code = exc.exit_code if exc.quiet else _report(state, exc, exc.exit_code)
        _quiet_std_streams()
    except DflashError as exc:
        code = _report(state, exc, exc.exit_code)
    except click.exceptions.NoArgsIsHelpError as exc:  # `dflashctl runs`: that group's help
        typer.echo(exc.ctx.get_help())
        code = exc.exit_code
    except click.UsageError as exc:
        code = _report(state, exc, exc.exit_code, _usage_line(exc))
    except click.ClickException as exc:
        code = _report(state, exc, exc.exit_code, exc.format_message())
    except (click.Abort, KeyboardInterrupt):
        code = _report(state, None, Interrupted.exit_code, "interrupted")
    except Exception as exc:  # a bug: still one line unless --debug
        code = _report(state, exc, 1, f"internal error: {type(exc).__name__}: {exc} (rerun with --debug)")
    finally:
        for session in state.sessions:
            session.close()
    sys.exit(code)


def _interrupt(state: AppState, signum: int, frame: object) -> None:
    state.interrupted = True
    raise Interrupted()


def _usage_line(exc: "click.UsageError") -> str:
    """`No such option: --bogus` and, on a second line, the command's usage and where help is."""
    message = exc.format_message()
    head, *hints = message.split(" Did you mean ")
    if len(hints) > 1 and len(set(hints)) == 1:  # click and typer each add the same suggestion
        message = f"{head} Did you mean {hints[0]}"
    if exc.ctx is None:
        return message
    usage = exc.ctx.get_usage().replace("Usage: ", "usage: ", 1)
    return f"{message}\n{usage} (see {exc.ctx.command_path} --help)"


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
    err = Console(stderr=True)
    try:
        if state.debug and exc is not None:
            import traceback

            err.print(Text("".join(traceback.format_exception(exc)), style="dim"))
        err.print(Text("error: ", style="bold red") + Text(message or str(exc)), soft_wrap=True)
    except OSError:  # stderr itself is gone: the exit code is all that is left
        _quiet_std_streams()
    return code
