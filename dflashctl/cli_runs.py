"""`dflashctl train`, `runs list/show/stop/pull` and `logs tail`: logic in runs.py / logs.py,
exit codes in docs/runs.md."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

if TYPE_CHECKING:  # rich is imported where output is drawn: a piped call never loads it
    from rich.console import Console

from .cli_common import (
    HOST_THEN_RUN,
    RUN_ARG,
    AppState,
    app,
    app_state,
    complete_host,
    detaches,
    first_host,
    held,
    host_and_run,
    hosts_or_all,
    parse_env,
    run_name,
    run_target,
    split_command,
    word_is_host_or_run,
)
from .cli_common import logs_app, runs_app
from .cli_common import follow_choice, follow_or_detach
from .errors import DflashError, NotFoundError, UsageError
from .session import Session
from .yamlfile import load_yaml_file


# --- runs --------------------------------------------------------------------------------------
# `train`, `runs list/show/stop`, `logs tail`: logic in runs.py / logs.py, exit codes in docs/runs.md.


@app.command("train")
def train_cmd(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None,
        help="Host to train on (default host if omitted); `h1,h2` or a group: one run across those hosts.",
        autocompletion=complete_host,
    ),
    gpus: Optional[str] = typer.Option(
        None, "--gpus", help="GPU indices like 0,1, or cpu (default: the host's gpus, else every GPU the trainer sees)."
    ),
    preset: Optional[str] = typer.Option(
        None,
        "--preset",
        help="Trainer preset: real-target (default with target.path), tiny (default without), qwen3-8b, llama3-8b, "
        "qwen3-30b-a3b (random weights: speed only) (docs/trainer.md).",
    ),
    config: Optional[Path] = typer.Option(
        None, "--config", help="Trainer config (YAML); copied into the run directory."
    ),
    overrides: List[str] = typer.Option(
        [],
        "--set",
        help="Config override key=value (repeatable). Out of GPU memory? --set data.max_length=2048 "
        "or fewer data.anchors_per_seq.",
    ),
    name: Optional[str] = typer.Option(
        None, "--name", callback=run_name, help="A label for the run (stored as given)."
    ),
    resume: Optional[str] = typer.Option(
        None,
        "--resume",
        metavar="RUN",
        help="Continue an ended run (id, prefix or name) from its newest checkpoint, in its directory with its config. "
        "A run across several hosts continues on all its nodes: HOST is any of them (or exactly them, or their group).",
    ),
    max_restarts: int = typer.Option(
        0,
        "--max-restarts",
        help="Restart the trainer from its newest checkpoint after a crash or stall, up to N times.",
    ),
    restart_on: Optional[str] = typer.Option(
        None, "--restart-on", help="Exit codes that restart it, e.g. 1,75,137 (default: any but 0, 2, 4 and a stop)."
    ),
    restart_delay: Optional[float] = typer.Option(
        None,
        "--restart-delay",
        help="Seconds before the first restart (doubling; default 10); needs --max-restarts.",
        show_default=False,
    ),
    on_event: Optional[str] = typer.Option(
        None,
        "--on-event",
        help="Command run in the container at each run event (started, restarted, succeeded, "
        "failed, stopped, lost), split like a shell line; its environment says which "
        "(DFLASHCTL_EVENT, DFLASHCTL_RUN_ID, ...). Default: hosts.yaml's on_event.",
    ),
    follow: bool = typer.Option(False, "--follow", help="Stream the log until the run ends (default on a terminal)."),
    detach: bool = typer.Option(False, "--detach", help="Return once the run has started (default in a pipe)."),
    force: bool = typer.Option(False, "--force", help="Start even if a live run uses the same GPUs."),
    queue: bool = typer.Option(
        False,
        "--queue",
        help="If the GPUs are busy, wait for them (FIFO, in the container: "
        "no client needs to stay connected) instead of refusing.",
    ),
    no_push: bool = typer.Option(False, "--no-push", help="Use the payload already in the container."),
    source: Optional[Path] = typer.Option(
        None, "--source", help="Payload directory to push (default: the trainer that ships with dflashctl)."
    ),
    rdzv_port: Optional[int] = typer.Option(
        None,
        "--rdzv-port",
        help="Several hosts: the rendezvous (MASTER_PORT) on the first host (default 29500). "
        "With --resume: move a run's rendezvous there (its port was taken since).",
    ),
    env_items: List[str] = typer.Option(
        [],
        "--env",
        help="NAME=VALUE for the trainer's environment (repeatable), e.g. NCCL_SOCKET_IFNAME=eth0. "
        "With --resume: instead of those the run was started with.",
    ),
) -> None:
    """Push the payload if it changed, pre-flight the config and devices, start the trainer detached and follow it.

    `--resume RUN` continues an ended run instead (every node of a run across hosts)."""
    from .runs import restart_policy

    session = app_state(ctx).session()
    opts = TrainOptions(
        gpus=gpus,
        config=config,
        overrides=list(overrides),
        preset=preset,
        name=name,
        force=force,
        no_push=no_push,
        source=source.expanduser() if source else None,
        env=parse_env(env_items),
        follow=follow_choice(follow, detach),
        resume=resume,
        restart=restart_policy(max_restarts, restart_on, restart_delay),
        hook=split_command(on_event, "--on-event") if on_event is not None else [],
        queue=queue,
        rdzv_port=rdzv_port,
    )
    if queue and force:  # --force started at once past the queued runs it was meant to wait behind
        raise UsageError("--queue waits for the GPUs and --force takes them at once: give one")
    if config is not None:  # its syntax and keys checked here, whatever trainer reads it (--no-push, --source)
        load_yaml_file(config, f"--config: {config}")
    _refuse_with_resume(
        resume,
        (
            ("--config", config),
            ("--set", overrides),
            ("--preset", preset),
            ("--name", name),
            ("--gpus", gpus),
            ("--max-restarts", max_restarts),
            ("--queue", queue),  # a resume never waited: it was dropped unsaid
            ("--on-event", on_event is not None),  # the run keeps its hook (dropped unsaid before too)
        ),
    )
    hosts = session.inventory.resolve_many(host)
    if resume is not None:
        raise typer.Exit(_resume(app_state(ctx), session, hosts, opts))
    if len(hosts) > 1:
        if opts.restart or queue:
            raise UsageError(
                "--max-restarts and --queue take one host (a run across several hosts continues as a whole: "
                "dflashctl train HOST --resume RUN)"
            )
        raise typer.Exit(_train_group(app_state(ctx), session, hosts, opts))
    if rdzv_port is not None:  # it was ignored: a run on one host has no rendezvous
        raise UsageError(f"--rdzv-port is for a run across several hosts; one on {hosts[0].name} has none: drop it")
    raise typer.Exit(_train_one(app_state(ctx), session, hosts[0].name, opts))


@dataclass(frozen=True)
class TrainOptions:
    """`train`'s options, parsed once by the command and handed to the one-host or several-host path."""

    gpus: Optional[str]
    config: Optional[Path]
    overrides: list[str]
    preset: Optional[str]
    name: Optional[str]
    force: bool
    no_push: bool
    source: Optional[Path]  # the payload directory to push (None: the one that ships with dflashctl)
    env: dict
    follow: Optional[bool]
    resume: Optional[str]
    restart: Optional[dict]  # one host only, like --queue
    hook: list
    queue: bool
    rdzv_port: Optional[int]  # several hosts only (None: the default)


def _train_one(state: AppState, session: Session, host: str, opts: TrainOptions) -> int:
    """`train HOST` (or `--resume RUN`) on one host, options checked; the exit code."""
    from rich.console import Console
    from rich.text import Text
    from .devices import parse_gpus
    from .runs import check_trainer_config, push_payload, resume_run, start_run

    target = session.target(host)
    err = Console(stderr=True)
    gpu_choice = parse_gpus(opts.gpus, target.host.gpus)
    # A bad --preset, --config or --set fails here, before anything is pushed (--no-push: the
    # payload in the container is not here to ask; its pre-flight decides).
    checked = (
        None
        if opts.no_push or opts.resume is not None
        else check_trainer_config(opts.source, opts.config, opts.preset, opts.overrides, gpu_choice)
    )
    payload_hash = None if opts.no_push else push_payload(target, opts.source, err)
    if opts.resume is not None:
        run = resume_run(target, opts.resume, payload_hash=payload_hash, force=opts.force, env=opts.env)
        verb = "resumed"
    else:
        run = start_run(
            target,
            gpus=gpu_choice,
            config_file=opts.config,
            overrides=opts.overrides,
            name=opts.name,
            force=opts.force,
            payload_hash=payload_hash,
            env=opts.env,
            preset=opts.preset,
            restart=opts.restart,
            on_event=opts.hook,
            queue=opts.queue,
            config=checked,
        )
        verb = "started"
        if run.queued_behind is not None:
            verb = "queued"
            err.print(
                Text(
                    f"GPUs busy: queued behind {', '.join(run.queued_behind)}; it starts by itself when they "
                    f"are free (runs stop cancels it)",
                    style="dim",
                ),
                soft_wrap=True,
            )
    what = f"{verb} run {run.run_id} on {target.label}, {held(run.gpus)}"
    return follow_or_detach(state, session, target, run.run_id, what, opts.follow, err) or 0


def _resume(state: AppState, session: Session, hosts: list, opts: TrainOptions) -> int:
    """`train HOST --resume RUN`: one host's run, or every node of a run across hosts (HOST: any
    of them, or exactly them); the exit code."""
    from rich.console import Console
    from .multihost_resume import find_run, resume_group

    run_id, group = find_run(session, hosts, opts.resume)
    if group is None:
        if opts.rdzv_port is not None:
            raise UsageError(
                f"run {run_id} ran on {hosts[0].name} alone: it has no rendezvous to move (drop --rdzv-port)"
            )
        return _train_one(state, session, hosts[0].name, opts)
    err = Console(stderr=True)
    nodes, started = resume_group(
        session,
        run_id,
        group,
        force=opts.force,
        env=opts.env,
        push=not opts.no_push,
        source=opts.source,
        console=err,
        rdzv_port=opts.rdzv_port,
    )
    return _follow_group(state, session, nodes, started, opts.follow, err, verb="resumed")


def _refuse_with_resume(resume: Optional[str], flags: tuple) -> None:
    """--resume continues a run as it was: any of these (flag, value) pairs given is a UsageError."""
    given = [flag for flag, value in flags if value]
    if resume is not None and given:
        raise UsageError(f"--resume continues a run as it was started (config, GPUs, hook): drop {', '.join(given)}")


def _train_group(state: AppState, session: Session, hosts: list, opts: TrainOptions) -> int:
    """`train h1,h2`: one run across hosts (docs/multihost.md); returns the exit code."""
    from rich.console import Console
    from .multihost import DEFAULT_RDZV_PORT, check_hosts, check_names, check_rdzv_port, push_all, start_group
    from .devices import parse_gpus
    from .runs import check_trainer_config

    check_hosts(hosts)
    err = Console(stderr=True)
    gpu_lists = {h.name: parse_gpus(opts.gpus, h.gpus) for h in hosts}
    # Before anything is pushed, as for one host.
    configs = (
        {}
        if opts.no_push
        else {
            h.name: check_trainer_config(opts.source, opts.config, opts.preset, opts.overrides, gpu_lists[h.name])
            for h in hosts
        }
    )
    if opts.name:
        check_names(session, hosts, opts.name)
    rdzv_port = DEFAULT_RDZV_PORT if opts.rdzv_port is None else opts.rdzv_port
    check_rdzv_port(session, hosts[0], rdzv_port)  # a port in use: refused before anything starts
    hashes = {} if opts.no_push else push_all(session, hosts, opts.source, err)
    group = start_group(
        session,
        hosts,
        gpus=gpu_lists,
        config_file=opts.config,
        overrides=opts.overrides,
        name=opts.name,
        force=opts.force,
        payload_hashes=hashes,
        rdzv_port=rdzv_port,
        env=opts.env,
        preset=opts.preset,
        configs=configs,
        on_event=opts.hook,  # it was dropped for a run across hosts
    )
    return _follow_group(state, session, hosts, group, opts.follow, err)


def _follow_group(
    state: AppState, session: Session, hosts: list, group, follow: Optional[bool], err: Console, verb: str = "started"
) -> int:
    """Print a started (or resumed) group's id and how to follow it, or follow its first node until the run ends."""
    from rich.console import Console
    from rich.text import Text
    from functools import partial

    from .logs import attach
    from .multihost import final_state

    names = ", ".join(f"{h.name} (rank {i})" for i, h in enumerate(hosts))
    first = hosts[0].name
    if not (sys.stdout.isatty() if follow is None else follow):
        typer.echo(group.run_id)
        err.print(
            Text(
                f"{verb} run {group.run_id} on {names}, rendezvous {group.rendezvous}; follow it: "
                f"dflashctl logs tail {first} {group.run_id} -f (--all: every node)",
                style="dim",
            ),
            soft_wrap=True,
        )
        return 0
    with detaches(state, first, group.run_id, err):
        err.print(
            Text(
                f"{verb} run {group.run_id} on {names}, rendezvous {group.rendezvous}; following {first} "
                f"(Ctrl-C detaches; the run goes on)",
                style="dim",
            ),
            soft_wrap=True,
        )
        out = Console()
        return attach(
            session,
            first,
            group.run_id,
            follow=True,
            lines=-1,
            out=sys.stdout.buffer,
            console=out if out.is_terminal else None,
            err=err,
            final=partial(final_state, session, first, stop_rest=True),
        )


@runs_app.command("list")
def runs_list(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None,
        help="Host, `h1,h2` or a group (default host if omitted).",
        autocompletion=complete_host,
    ),
    all_hosts: bool = typer.Option(False, "--all", help="List the runs of every host in the inventory."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """List the runs on a host (or several): state, GPUs, start, duration, last step and loss."""
    from rich.console import Console
    from rich.text import Text
    from .multihost import list_group_runs
    from .runs import print_runs

    session = app_state(ctx).session()
    hosts = hosts_or_all(session, host, all_hosts)
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
    host: Optional[str] = typer.Argument(None, **HOST_THEN_RUN),
    run: Optional[str] = typer.Argument(None, **RUN_ARG),
    plot: Optional[Path] = typer.Option(
        None,
        "--plot",
        help="Also write the curves to this file: .png, .pdf or .svg (needs: pip install 'dflashctl\\[plot]').",
    ),
    curves: Optional[bool] = typer.Option(
        None,
        "--curves/--no-curves",
        help="Draw loss and acceptance length as text (default: on a terminal, not in a pipe).",
        show_default=False,
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Show one run: run.json fields, a metrics summary, and loss / acceptance-length curves."""
    from rich.console import Console
    from rich.text import Text
    from .multihost import show_group
    from .plot import check_plot_path, save_png, terminal_plot
    from .runs import details_rows
    from .tables import fields

    if plot is not None:
        plot = check_plot_path(plot)  # before anything is printed
    session = app_state(ctx).session()
    host, run = host_and_run(session, host, run)
    with word_is_host_or_run(session, host, run):
        info = show_group(session, first_host(session, host), run)  # several hosts: combined over the nodes
    if json_out:  # the plot is written too (stdout keeps the JSON only)
        if plot is not None:
            save_png(info.get("metrics") or [], plot, info["run_id"])
        typer.echo(json.dumps(info, indent=2))
        return
    console = Console()
    fields(console, details_rows(info))
    # Like the tables: a pipe gets the label/value rows only (chart lines would meet a grep).
    draw = console.is_terminal if curves is None else curves
    drawing = terminal_plot(info.get("metrics") or [], width=min(console.width, 120)) if draw else None
    if drawing:
        console.print(Text(drawing), soft_wrap=True)
    if plot is not None:
        save_png(info.get("metrics") or [], plot, info["run_id"])
        console.print(Text(f"wrote {plot}"))


@runs_app.command("stop")
def runs_stop(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, **HOST_THEN_RUN),
    run: Optional[str] = typer.Argument(None, **RUN_ARG),
    grace: float = typer.Option(60.0, "--grace", help="Seconds between SIGTERM (trainer checkpoints) and SIGKILL."),
) -> None:
    """Stop a run: SIGTERM to its trainer (it checkpoints), SIGKILL to its process group after --grace."""
    from rich.console import Console
    from rich.text import Text
    from .multihost import stop_group
    from .runs import check_grace, show_run, state_text

    check_grace(grace)  # before the "stopping" line
    session = app_state(ctx).session()
    target, host, run = run_target(session, host, run)
    with word_is_host_or_run(session, host, run):
        # Which run, before saying "stopping": an unreachable host or stopped container is one error line.
        shown = show_run(target, run, metrics=False) if run else None
        run_id = shown["run_id"] if shown else _latest_running(target)
    err = Console(stderr=True)
    if shown is None or shown.get("state") in ("running", "queued"):  # an ended run: only "had already ended"
        err.print(Text(f"stopping {run_id} on {target.label} (SIGKILL after {grace:g} s)...", style="dim"))
    info, unreached = stop_group(session, target.host.name, run_id, grace)  # a multi-host run: every node
    if info is not None:  # the nodes that answered only: a stop not done is never claimed
        verb = "had already ended:" if info.get("already") else "is now"
        where = f" on {info['host']}" if info.get("nodes") else ""
        Console().print(Text(f"run {info['run_id']} {verb} ") + state_text(info) + Text(where), soft_wrap=True)
    for rank, (node, exc) in unreached.items():
        err.print(
            Text("error: ", style="bold red")
            + Text(
                f"could not stop run {run_id} on {node} (rank {rank}): {exc}; it may still be running there "
                f"(retry: dflashctl runs stop {node} {run_id})"
            ),
            soft_wrap=True,
        )
    if unreached:
        exc = next(iter(unreached.values()))[1]
        raise typer.Exit(exc.exit_code if isinstance(exc, DflashError) else 1)


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
    host: Optional[str] = typer.Argument(None, **HOST_THEN_RUN),
    run: Optional[str] = typer.Argument(None, **RUN_ARG),
    to: Optional[Path] = typer.Option(None, "--to", help="Directory to create (default: ./RUN_ID); must not exist."),
    checkpoints: str = typer.Option("none", "--checkpoints", help="Also copy checkpoints: none, latest or all."),
    base_model: Optional[str] = typer.Option(
        None,
        "--base-model",
        help="The model card's base_model (Hub ORG/NAME); default: the run's target.path if it is one.",
    ),
    license_id: str = typer.Option("other", "--license", help="The model card's license (a Hub license id)."),
) -> None:
    """Copy a run's directory here: exported drafter with a model card, config, logs, metrics, checkpoints if asked."""
    from rich.console import Console
    from rich.text import Text
    from rich.filesize import decimal
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from .modelcard import card_after_pull
    from .pull import pull_run

    session = app_state(ctx).session()
    target, host, run = run_target(session, host, run)
    err = Console(stderr=True)
    guard = word_is_host_or_run(session, host, run)
    bar = Progress(
        TextColumn("pulling"),
        BarColumn(),
        DownloadColumn(binary_units=False),
        TransferSpeedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )
    with guard, bar:
        task = bar.add_task("pull", total=None)
        pulled = pull_run(
            target,
            run,
            to.expanduser() if to else None,
            checkpoints,
            on_bytes=lambda done, total: bar.update(task, completed=done, total=total),
        )
    err.print(
        Text(
            f"pulled run {pulled.run_id} ({pulled.state}) from {target.label} to {pulled.dest}: "
            f"{pulled.files} files, {decimal(pulled.bytes)} in {pulled.seconds:.1f} s"
        ),
        soft_wrap=True,
    )
    card = card_after_pull(pulled.dest, base_model, license_id)
    if card is not None:
        err.print(Text(card), soft_wrap=True)


@logs_app.command("tail")
def logs_tail(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, **HOST_THEN_RUN),
    run: Optional[str] = typer.Argument(None, **RUN_ARG),
    lines: int = typer.Option(
        50, "--lines", "-n", help="How many lines from the end to show first (-1: the whole log)."
    ),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep following until the run ends; exit with its state's code."
    ),
    since_step: Optional[int] = typer.Option(
        None, "--since-step", help="Start at the first log line of step K or later."
    ),
    node: Optional[str] = typer.Option(
        None,
        "--host",
        help="Multi-host run: the node whose log to show (default: the rank-0 node).",
        autocompletion=complete_host,
    ),
    all_nodes: bool = typer.Option(
        False, "--all", help="Multi-host run: every node's log, each line prefixed with its host name."
    ),
) -> None:
    """Print a run's last lines; with -f follow it (surviving dropped connections) to the end."""
    from rich.console import Console
    from functools import partial

    from .logs import attach
    from .multihost import attach_all, final_state, pick_node

    if lines < -1 or (since_step is not None and since_step < 0):
        raise UsageError("-n takes 0 or more lines (-1: the whole log) and --since-step 0 or more")
    session = app_state(ctx).session()
    host, run = host_and_run(session, host, run)
    err = Console(stderr=True)
    if all_nodes:
        if node is not None:
            raise UsageError("--all and --host exclude each other")
        raise typer.Exit(
            attach_all(
                session, host, run, follow=follow, lines=lines, since_step=since_step, out=sys.stdout.buffer, err=err
            )
        )
    with word_is_host_or_run(session, host, run):
        where, run = pick_node(session, host, run, node)
    out = Console()
    raise typer.Exit(
        attach(
            session,
            where,
            run,
            follow=follow,
            lines=lines,
            since_step=since_step,
            out=sys.stdout.buffer,
            console=out if out.is_terminal else None,
            err=err,
            final=partial(final_state, session, where),
        )
    )  # several hosts: the whole run's state
