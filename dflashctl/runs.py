"""Training runs on a host: start them detached, list, show and stop them.

The remote half is the runctl package (`dflashctl/remote/runctl/`, installed by agent.py); this module builds its
requests, turns its
answers into results or exceptions, and renders them. Layout, states and exit codes:
docs/runs.md.
"""

from __future__ import annotations

import calendar
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.text import Text

from .agent import run_agent
from .containers import Target
from .devices import GpuChoice
from .figures import eval_rows, in_training_tau, tau_cell, tau_legend
from .errors import ConflictError, ContainerError, Interrupted, NotFoundError, RemoteError, UsageError
from .guard import InterruptedAfter
from .inventory import HostSpec
from .plot import series
from .remote.wire import BYTECODE_CACHE, COMPILE_CACHE, RUN_DIR_TOKEN, START_ANSWER_S, WORKDIR_TOKEN
from .tables import Column, counted, notes, show
from .transport import Completed

TRAINER_MODULE = "dflash_train"
CONFIG_NAME = "config.input.yaml"  # the --config file as given, copied into the run directory

# Exit codes of `train --follow` and `logs tail -f` for how the run ended (see docs/runs.md).
# They sit above errors.py's 1-6 so a script can tell "the run failed" from "dflashctl failed".
STATE_EXIT = {"succeeded": 0, "failed": 100, "stopped": 101, "lost": 102}
EXIT_DETACHED = 130  # Ctrl-C while following: the run goes on
RESTART_DELAY_S = 10.0  # `--restart-delay`'s default: the wait before the first restart (doubling)
STATE_STYLE = {
    "queued": "blue",
    "running": "cyan",
    "succeeded": "green",
    "failed": "red",
    "stopped": "yellow",
    "lost": "magenta",
}


@dataclass(frozen=True)
class StartedRun:
    """What `train` learns at once: the run id, its directory, and the trainer's pid."""

    run_id: str
    run_dir: str
    pid: int | None
    gpus: list[
        str
    ]  # what the run holds, as its pre-flight said: GPU indices, ["cpu"], or [] (nothing: a remote engine)
    queued_behind: list[str] | None = None  # --queue: the runs it waits for (None: it started)


def trainer_argv(
    host: HostSpec,
    run_dir: str,
    config_path: str | None,
    overrides: Sequence[str],
    gpus: GpuChoice,
    preset: str | None = None,
) -> list[str]:
    """The trainer's command line: the one place to change when the trainer's interface changes."""
    argv = [host.interpreter, "-m", TRAINER_MODULE]
    if preset:
        argv += ["--preset", preset]
    if config_path:
        argv += ["--config", config_path]
    for item in trainer_sets(run_dir, gpus, overrides):
        argv += ["--set", item]
    return argv


def trainer_sets(run_dir: str, gpus: GpuChoice, overrides: Sequence[str]) -> list[str]:
    """The trainer's `--set` items: dflashctl's own (run directory, caches, the device choice), then
    the user's overrides, which come last and so win."""
    sets = [
        f"run.output_dir={run_dir}",
        f"run.compile_cache_dir={COMPILE_CACHE}",
        f"run.bytecode_cache_dir={BYTECODE_CACHE}",
        f"data.dir={WORKDIR_TOKEN}/data",
    ]
    return [*sets, *gpus.trainer_sets(), *overrides]


def restart_policy(max_restarts: int, restart_on: str | None, delay_s: float | None) -> dict[str, Any] | None:
    """`--max-restarts N --restart-on 1,75 --restart-delay 10` as the supervisor's policy (None: off);
    delay_s None: not given (RESTART_DELAY_S)."""
    if max_restarts < 0 or not 0 <= (delay_s or 0) < float("inf"):
        raise UsageError("--max-restarts and --restart-delay take 0 or more")
    codes = None
    if restart_on is not None:
        items = [t.strip() for t in restart_on.split(",")]
        if not all(t.isdigit() and 0 < int(t) < 256 for t in items):
            raise UsageError(f"--restart-on takes exit codes like 1,75,137, got {restart_on!r}")
        codes = [int(t) for t in items]
    if max_restarts == 0:
        # Either alone was ignored: with no restarts there is nothing to restart on or wait before.
        for flag, value in (("--restart-on", restart_on), ("--restart-delay", delay_s)):
            if value is not None:
                raise UsageError(f"{flag} needs --max-restarts N (N > 0)")
        return None
    return {"max": max_restarts, "on": codes, "delay_s": RESTART_DELAY_S if delay_s is None else delay_s}


def check_trainer_config(
    source: Path | None, config_file: Path | None, preset: str | None, overrides: Sequence[str], gpus: GpuChoice
) -> dict[str, Any] | None:
    """The run's config as the trainer's own code in the payload about to be pushed (`source`,
    else the shipped one) resolves it, with `{run_dir}` and `{workdir}` still unfilled; a bad
    --preset, --config or --set is a UsageError here, before anything is pushed. None: that
    payload has no config code to ask (its pre-flight in the container decides)."""
    from .payload import default_source
    from .trainer_config import check_config

    return check_config(source or default_source(), config_file, preset, trainer_sets(RUN_DIR_TOKEN, gpus, overrides))


def start_run(
    target: Target,
    *,
    gpus: GpuChoice,
    config_file: Path | None = None,
    overrides: Sequence[str] = (),
    name: str | None = None,
    force: bool = False,
    payload_hash: str | None = None,
    env: dict[str, str] | None = None,
    run_id: str | None = None,
    group: dict[str, Any] | None = None,
    preset: str | None = None,
    restart: dict[str, Any] | None = None,
    on_event: Sequence[str] = (),
    queue: bool = False,
    config: dict[str, Any] | None = None,
) -> StartedRun:
    """Start the trainer detached on target. The trainer's pre-flight (config and devices, nothing
    built), the GPU check and the start happen under one remote lock; a bad config is a
    UsageError and a missing module a ContainerError, and neither leaves a run behind.

    run_id: use this id instead of a fresh one (a multi-host run has one id on every node);
    group: the multi-host membership recorded in run.json (multihost.py); config: what
    check_trainer_config resolved before the push, recorded in run.json."""
    host = target.host
    config_path = f"{RUN_DIR_TOKEN}/{CONFIG_NAME}" if config_file else None
    spec = {
        "argv": trainer_argv(host, RUN_DIR_TOKEN, config_path, overrides, gpus, preset),
        "preflight": True,
        "cwd": f"{host.workdir}/payload",
        "name": name,
        "host": host.name,
        "config": config,
        "config_name": CONFIG_NAME,
        "config_text": config_file.read_text(encoding="utf-8") if config_file else None,
        "overrides": list(overrides),
        "payload_hash": payload_hash,
        "gpus": gpus.names(),  # what it holds unless its pre-flight says otherwise
        "force": force,
        "env": env or {},
    }
    if name:
        spec["unique_name"] = True  # runctl refuses it when a run on the host has it
    if run_id:
        spec["run_id"] = run_id
    if group:
        spec["group"] = group
    if restart:
        spec["restart"] = restart
    if queue:
        spec["queue"] = True
    hook = list(on_event) or list(host.on_event)
    if hook:
        spec["on_event"] = hook
    return launch(target, spec)


def launch(target: Target, spec: dict[str, Any]) -> StartedRun:
    """`runctl start` with a run's spec (argv, cwd, kind, gpus, ...; see start_run): pre-flight,
    GPU check and start under the remote lock."""
    # The pre-flight's own one line names what it checked: the trainer's config, or a data run's options.
    checked = "data regen" if spec.get("kind") == "data" else "trainer config"
    answer = call(
        target,
        "start",
        [target.host.workdir],
        stdin=json.dumps(dict(spec, fork_server_s=target.host.fork_server)).encode(),
        timeout=START_ANSWER_S,
        settle=True,
        checked=checked,
    )
    return StartedRun(
        answer["run_id"],
        answer["run_dir"],
        answer.get("pid"),
        answer.get("gpus", list(spec["gpus"])),
        answer.get("queued_behind"),
    )


def resume_run(
    target: Target,
    selector: str,
    *,
    payload_hash: str | None,
    force: bool = False,
    env: dict[str, str] | None = None,
    kind: str = "train",
    group: dict[str, Any] | None = None,
    check: bool = False,
    preflight: bool = True,
    rdzv_port: int | None = None,
) -> StartedRun:
    """Start an ended run again in its own directory, from its newest checkpoint (`--resume`),
    on the payload now in the container (pre-flight and GPU check as for a new run). A run of
    another kind (a data run given to `train --resume`) is refused. group: the run's group as
    recorded, when every node resumes (multihost_resume.py; runctl refuses a node of a group
    without it); check: make every check, start nothing; rdzv_port: the group's rendezvous moves
    there (run.json and MASTER_PORT, written by runctl under its lock)."""
    spec = {
        "cwd": f"{target.host.workdir}/payload",
        "payload_hash": payload_hash,
        "force": force,
        "env": env or None,
        "preflight": preflight,
        "kind": kind,
        "group": group,
        "check": check,
        "rdzv_port": rdzv_port,
        "fork_server_s": target.host.fork_server,
    }
    answer = call(
        target,
        "resume",
        [target.host.workdir, selector],
        stdin=json.dumps(spec).encode(),
        timeout=START_ANSWER_S,
        settle=True,
    )
    return StartedRun(answer["run_id"], answer["run_dir"], answer.get("pid"), answer.get("gpus") or [])


def refuse_resume(target: Target, run: dict[str, Any], kind: str) -> None:
    """Refuse, with runctl resume's own line, a resume as `kind` that the run's record (`runs
    show`'s answer) rules out: a live run, a run that succeeded, a run of the other kind.
    Asked before anything is pushed; runctl asks again under its lock."""
    from .remote.runctl.state import resume_refusal

    refusal = resume_refusal(run["run_id"], run, run.get("state"), kind)
    if refusal is not None:
        raise answer_error(target, refusal.answer)


def push_payload(target: Target, source: Path | None, console: Console) -> str:
    """Bring `<workdir>/payload` up to date (only changes travel); returns the manifest hash."""
    from .payload import BarProgress, push

    if console.is_terminal:
        with BarProgress(console) as bar:
            result = push(target, source, progress=bar)
    else:
        result = push(target, source)
    console.print(Text(result.summary(), style="dim"), soft_wrap=True)
    return result.manifest_hash


def list_runs(target: Target, timeout: float = 120) -> list[dict[str, Any]]:
    """Every run on the host, oldest first, with state and latest metrics."""
    return call(target, "list", [target.host.workdir], timeout=timeout)["runs"]


def fork_servers(target: Target, stop: bool) -> dict[str, Any]:
    """The fork servers in the host's container (runctl servers): {servers, stopped}; stop: SIGTERM to each."""
    return call(target, "servers", [target.host.workdir, "1" if stop else "0"])


def print_fork_servers(console: Console, answer: dict[str, Any], host: str, stop: bool) -> None:
    """`hosts servers`: one row per server, the reasons below the table, then what --stop did."""
    servers = answer["servers"]
    if not servers:
        console.print(f"{host}: no fork server running", highlight=False)
    else:
        columns = [Column("server"), Column("pid", "right"), Column("state"), Column("trainers", drop=2)]
        columns += [Column("memory", "right", drop=1), Column("idle limit", "right", drop=3), Column("started", drop=4)]
        rows = [
            [
                s["name"],
                str(s["pid"]),
                s["state"].split(":")[0],
                ",".join(map(str, s["trainers"])) or "-",
                f"{s['rss_mb']} MB" if s.get("rss_mb") is not None else "?",
                f"{s['idle_s']:g} s" if s.get("idle_s") is not None else "?",
                s.get("started") or "?",
            ]
            for s in servers
        ]
        show(console, columns, rows, title=f"fork servers on {host}")
        notes(console, [(str(s["pid"]), s["state"], "") for s in servers if ":" in s["state"]])
    if stop:  # SIGTERM: each stops serving now and exits once the trainers it forked have ended
        running = sum(1 for s in servers if s["trainers"])
        line = f"stopped {counted(len(answer['stopped']), 'fork server')}"
        console.print(line + (f"; {running} exit once their runs end" if running else ""), highlight=False)


def run_completions(target: Target, incomplete: str, timeout: float) -> list[tuple[str, str]]:
    """(run id or name, what it is) for RUN completion: ids and names starting with incomplete, newest first."""
    found = []
    runs = list_runs(target, timeout)
    # Newest first by start time: ids of runs started in the same second sort by their random suffix.
    for run in sorted(runs, key=lambda r: (r.get("started_ts") or 0, r["run_id"]), reverse=True):
        run_id, name, state = run["run_id"], run.get("name") or "", run.get("state") or ""
        if run_id.startswith(incomplete):
            found.append((run_id, f"{name} {state}".strip()))
        if name and name.startswith(incomplete) and not any(c.isspace() for c in name):  # one shell word only
            found.append((name, f"{run_id} {state}"))
    return found


def show_run(target: Target, selector: str | None, metrics: bool = True) -> dict[str, Any]:
    """One run (latest when selector is empty) with its metrics thinned for plotting (or none)."""
    return call(target, "show", [target.host.workdir, selector or "", "1000" if metrics else "0"])


def check_grace(grace: float) -> None:
    """A stop's grace period must not be negative (UsageError)."""
    if grace < 0:
        raise UsageError(f"--grace must be 0 or more seconds, got {grace:g}")


def stop_run(target: Target, selector: str | None, grace: float) -> dict[str, Any]:
    """SIGTERM the run's process group, SIGKILL after grace seconds; returns the final summary."""
    check_grace(grace)
    return call(target, "stop", [target.host.workdir, selector or "", f"{grace:g}"], timeout=grace + 90)


def call(
    target: Target,
    command: str,
    args: Sequence[str],
    *,
    stdin: bytes | None = None,
    timeout: float | None = 120,
    settle: bool = False,
    checked: str = "trainer config",
) -> dict[str, Any]:
    """Run one runctl command and return its JSON answer; error answers become exceptions.
    settle (a start): Ctrl-C reaches runctl as SIGINT, which undoes the start or, past its last
    point, completes it; Interrupted then says which (guard.py). checked: what a pre-flight's
    `config` error is about, for its line."""
    try:
        result = run_agent(target, "runctl", [command, *args], stdin=stdin, timeout=timeout, settle=settle)
    except InterruptedAfter as exc:
        raise Interrupted(_interrupted_start(target, exc.result)) from None
    if not result.ok:
        raise RemoteError(f"{target.label}: {result.err_line()}")
    lines = result.text().strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RemoteError(f"{target.label}: runctl {command} gave no answer: {result.err_line()}") from None
    if "error" in answer:
        raise answer_error(target, answer, checked)
    return answer


def _interrupted_start(target: Target, result: Completed) -> str:
    """What an interrupted start left, from runctl's own answer: a run that goes on, or nothing."""
    try:
        answer = json.loads(result.text().strip().splitlines()[-1])
    except (IndexError, ValueError):
        return f"{target.label}: see whether a run started with: dflashctl runs list {target.host.name}"
    if "run_id" not in answer:
        return "nothing was started"
    run_id = answer["run_id"]
    return f"run {run_id} had started and goes on; stop it with: dflashctl runs stop {target.host.name} {run_id}"


def answer_error(target: Target, answer: dict[str, Any], checked: str = "trainer config") -> Exception:
    """The exception for a runctl error answer (not_found, ambiguous, conflict, name_taken)."""
    kind, message = answer["error"], answer.get("message", "")
    if kind == "not_found":
        return NotFoundError(f"{target.label}: {message}")
    if kind == "config":  # the program's own one line, from its pre-flight
        return UsageError(f"{target.label}: {checked}: {message}")
    if kind == "usage":
        return UsageError(f"{target.label}: {message}")
    if kind == "missing_module":
        return ContainerError(
            f"{target.label}: {message}; install it there, or point `python:` in hosts.yaml "
            f"at an interpreter that has it"
        )
    if kind in ("conflict_running", "conflict_state"):  # still running; a resume of a run that succeeded
        return ConflictError(f"{target.label}: {message}")
    if kind == "ambiguous":
        return UsageError(
            f"{target.label}: {message}: {', '.join(answer.get('candidates', []))}; give more of the run id"
        )
    if kind == "name_taken":
        return name_taken(target, answer["name"], answer["run_id"], answer["state"])
    if kind == "conflict":
        held = "; ".join(
            f"run {rid}" + (f" ({name!r})" if name else "") + f" uses {', '.join(shared)}"
            for rid, name, shared in answer.get("runs", [])
        )
        return ConflictError(f"{target.label}: GPUs busy: {held} (stop it, pick other --gpus, or use --force)")
    return RemoteError(f"{target.label}: {message}")


def name_taken(target: Target, name: str, run_id: str, state: str) -> ConflictError:
    """The refusal of a start whose --name a run on the host has already (exit 6, as docker's name conflict)."""
    return ConflictError(
        f"{target.label}: a run named {name!r} exists already ({run_id}, {state}); choose another --name "
        f"(that run stays reachable by its id: dflashctl runs show {target.host.name} {run_id})"
    )


def check_name_free(target: Target, name: str) -> None:
    """Refuse (name_taken) a name a run on the host has, before anything is pushed or started.
    Only a first look: runctl start checks again under its lock, where the answer cannot change."""
    taken = [r for r in list_runs(target) if r.get("name") == name]
    if taken:
        raise name_taken(target, name, taken[-1]["run_id"], taken[-1]["state"])


def exit_code_for(state: str) -> int:
    """The documented exit code for how a run ended (0 succeeded, 100 failed, ...)."""
    return STATE_EXIT.get(state, 1)


# --- rendering ---------------------------------------------------------------------------------


def last_start(run: dict[str, Any]) -> str | None:
    """When the trainer last started: its last --resume, else the end of its wait in the queue, else
    the run's start; None while it waits in the queue (or was cancelled there)."""
    if run.get("queued"):
        return None
    return run.get("resumed_at") or run.get("dequeued_at") or run.get("started_at")


def iso_ts(iso: Any) -> float | None:
    """run.json's `2026-11-30T11:30:00Z` (UTC) as a Unix time; None if absent or malformed."""
    try:
        return float(calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError):
        return None


def dequeued_ts(run: dict[str, Any]) -> float | None:
    """When a `train --queue` run left its queue and started its trainer; None if it did not wait
    (or waits still)."""
    # dequeued_at alone: a run.json written before runctl recorded dequeued_ts.
    return run.get("dequeued_ts") or iso_ts(run.get("dequeued_at"))


def duration(run: dict[str, Any]) -> float | None:
    """Seconds the trainer ran since its last start (until now, on the host's clock, while it runs);
    a wait in the queue does not count, and a run still queued (or cancelled there) has none."""
    if run.get("queued"):
        return None
    start = max(run.get("started_ts") or 0, dequeued_ts(run) or 0)
    end = run.get("ended_ts") or (run.get("now_ts") if run.get("state") == "running" else None)
    return end - start if start and end else None


def queue_wait(run: dict[str, Any]) -> float | None:
    """Seconds a `train --queue` run waited for its GPUs (so far, while it waits); None if it never queued."""
    since = iso_ts(run.get("started_at"))  # its creation: started_ts moves on with every --resume
    if not run.get("queued_behind") or since is None:
        return None
    until = dequeued_ts(run) or run.get("ended_ts") or run.get("now_ts")
    return max(0.0, until - since) if until else None


def queue_row(run: dict[str, Any]) -> list[tuple[str, Text]]:
    """`runs show`'s `queued` row for a run that waited in the queue: since when, how long, behind whom."""
    wait = queue_wait(run)
    if wait is None:
        return []
    how = "waiting for" if run.get("state") == "queued" else "waited"
    end = ", cancelled before it started" if run.get("queued") and run.get("state") != "queued" else ""
    behind = ", ".join(run.get("queued_behind") or [])
    return [("queued", Text(f"{run.get('started_at')}, {how} {fmt_duration(wait)} (behind {behind}){end}"))]


def fmt_bytes(size: int) -> str:
    """`12.3 MB` (decimal units, as rich and ls -h --si print them)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def fmt_duration(seconds: float | None) -> str:
    """`1:02:03` / `4:05`, or `-`."""
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def short_time(iso: str | None) -> str:
    """`2026-11-30T11:46:43Z` as `11-30 11:46` (UTC), for narrow tables."""
    return f"{iso[5:10]} {iso[11:16]}" if iso and len(iso) >= 16 else "-"


def state_text(run: dict[str, Any]) -> Text:
    """The state, coloured, with the exit code when it is not 0."""
    state = run.get("state", "?")
    code = run.get("exit_code")
    label = f"{state} ({code})" if code not in (None, 0) else state
    if run.get("restarts"):
        label += f", restarts {run['restarts']}"
    return Text(label, style=STATE_STYLE.get(state, ""))


def print_runs(console: Console, runs: Sequence[dict[str, Any]], host: str, several_hosts: bool = False) -> None:
    """`runs list`: a table on a terminal, aligned plain columns in a pipe (tables.py); names are
    shown literally (Text, never markup). A `hosts` column names each run's host, or its nodes for
    a run across several hosts (docs/multihost.md); it is there when several hosts were listed or
    such a run is."""
    multi = several_hosts or any(run.get("nodes") for run in runs)
    # A narrow terminal keeps run, name and state (never cut) and drops from `started` down (tables.py).
    columns = [
        Column("run"),
        Column("name", text=True),
        Column("kind", drop=7),
        Column("state"),
        Column("GPUs", drop=5),
        Column("started", drop=8),
        Column("duration", "right", drop=6),
        Column("step", "right", drop=1),
        Column("loss", "right", drop=2),
        Column("tau", "right", drop=3),
    ]
    if multi:
        columns.insert(4, Column("hosts", drop=4))
    rows = []
    for run in runs:
        last = run.get("last") or {}
        step, total = progress_of(run)
        cells = [
            Text(run.get("run_id", "?")),
            Text(run.get("name") or "-"),
            Text(run.get("kind") or "train"),
            state_text(run),
            Text(",".join(run.get("gpus") or []) or "-"),
            Text(short_time(last_start(run))),
            Text(fmt_duration(duration(run))),
            Text("-" if step is None else (f"{step}/{total}" if total else str(step))),
            Text("-" if last.get("loss") is None else f"{last['loss']:.4f}"),
            Text(tau_cell(run)),
        ]
        if multi:
            cells.insert(4, Text(",".join(n["host"] for n in run.get("nodes") or []) or str(run.get("host") or "-")))
        rows.append(cells)
    legend = tau_legend([row[-1].plain for row in rows])
    show(console, columns, rows, title=f"runs on {host} (times UTC)", legend=[("tau", legend)] if legend else [])


def progress_of(run: dict[str, Any]) -> tuple[int | None, int | None]:
    """(done, total) of a run: steps of a training run, rows of a data run."""
    last = run.get("last") or {}
    if run.get("kind") == "data":
        return last.get("rows_done"), last.get("rows_total")
    return last.get("step"), last.get("total_steps")


def details_rows(run: dict[str, Any]) -> list[tuple[str, Text]]:
    """`runs show`: run.json fields and a metrics summary, as (label, value) rows for tables.fields."""
    rows: list[tuple[str, Text]] = [
        ("run", Text(run["run_id"])),
        ("name", Text(run.get("name") or "-")),
        ("kind", Text(run.get("kind") or "train")),
        ("state", state_text(run)),
        ("host", Text(str(run.get("host")))),
        ("GPUs", Text(",".join(run.get("gpus") or []))),
        *queue_row(run),
        ("started", Text(str(run.get("dequeued_at") or run.get("started_at")) if not run.get("queued") else "-")),
        *([("resumed", Text(f"{run.get('resumed_at')} ({run['resumes']}x)"))] if run.get("resumes") else []),
        ("duration", Text(fmt_duration(duration(run)) + (" (since the last resume)" if run.get("resumes") else ""))),
        ("directory", Text(str(run.get("run_dir")))),
        ("pid", Text(str((run.get("trainer") or {}).get("pid", "-")))),
        ("payload", Text(str(run.get("payload_hash") or "-"))),
        ("argv", Text(" ".join(run.get("argv") or []))),
        ("overrides", Text(" ".join(run.get("overrides") or []) or "-")),
    ]
    extra: list[tuple[str, Text]] = []  # right after the state
    if run.get("reason"):
        extra.append(("reason", Text(str(run["reason"]), style="red")))
    if run.get("eval"):
        extra += eval_rows(run["eval"])
    for prompts, figures in sorted((run.get("evals") or {}).items()):  # `eval --prompts FILE`'s, by FILE's stem
        extra += eval_rows(figures, f" on {prompts}")
    if run.get("nodes"):
        extra.append(("nodes", node_states(run["nodes"])))
        extra.append(("rendezvous", Text(str((run.get("group") or {}).get("rendezvous", "-")))))
    rows[4:4] = extra
    rows += [(k, Text(v)) for k, v in metrics_summary(run.get("metrics") or [], run.get("metrics_count", 0))]
    return rows


def node_states(nodes: Sequence[dict[str, Any]]) -> Text:
    """`h1 (rank 0) failed (75), h2 (rank 1) lost`: every node of a multi-host run."""
    text = Text()
    for i, node in enumerate(nodes):
        if i:
            text.append(", ")
        text.append(f"{node['host']} (rank {node['rank']}) ")
        text.append_text(state_text(node))
    return text


def metrics_summary(records: Sequence[dict[str, Any]], count: int) -> list[tuple[str, str]]:
    """Last step, last/best loss, last/best acceptance length, throughput."""
    if not records:
        return [("metrics", "none yet")]
    last = records[-1]
    if "rows_done" in last:  # a data run's progress records
        start_up = bool(last.get("rate_includes_start_up"))
        return [
            ("rows", f"{last['rows_done']}/{last.get('rows_total', '?')} ({last.get('rows_failed', 0)} failed)"),
            # Counted from the program's start until the first round of batches is in (its log says so too).
            ("output tok/s", f"{last.get('tokens_per_s') or 0:.0f}" + (start_up * " (incl. start-up)")),
        ]
    losses = series(records, "loss")[1]
    accs = series(records, "acceptance_length")[1]
    # The step as `runs list` has it: of the latest training record (a resumed run's last record
    # may be its `start` event, which has no total_steps).
    trained = [r for r in records if r.get("event", "train") == "train"] or records
    step = trained[-1]
    out = [("metrics", f"{count} records"), ("step", f"{step.get('step')}/{step.get('total_steps', '?')}")]
    if losses:
        out.append(("loss", f"{losses[-1]:.4f} (best {min(losses):.4f})"))
    if accs:
        out.append(("acceptance", f"teacher-forced {accs[-1]:.3f} (best {max(accs):.3f}; a proxy)"))
    out += in_training_tau(records)
    speed = series(records, "tokens_per_s")[1]
    if speed:
        out.append(("tokens/s", f"{speed[-1]:.0f} ({train_rate_span(records)})"))
    return out


def train_rate_span(records: Sequence[dict[str, Any]]) -> str:
    """What the latest training record's tokens/s covers: every worker's tokens, over the steps since
    the record (or resume) before it, sync points (evaluations, checkpoints) not counted."""
    trained = [i for i, r in enumerate(records) if r.get("event", "train") == "train" and "tokens_per_s" in r]
    last = trained[-1]
    first = next((r.get("step") for r in reversed(records[:last]) if r.get("event", "train") in ("train", "start")), 0)
    first, step = (first or 0) + 1, records[last].get("step")
    return f"all workers together, {f'step {step}' if first == step else f'steps {first}-{step}'}"
