"""One training run across several hosts: one trainer process per host, one run id.

`dflashctl train h1,h2` (or a group from hosts.yaml) pushes the payload to every host, picks the
first host as the rendezvous (torch.distributed's MASTER_ADDR: its `rendezvous_address`, else
its ssh address; the port is `--rdzv-port`), and starts the trainer on every host through the
same `runctl start` as a single-host run, with one client-chosen run id and the torch.distributed
variables in its environment. Each node's run.json records the group (`nodes` by rank, its
`rank`, the rendezvous), so any node can tell which other hosts to ask: `runs list/show/stop`
and `logs tail` combine the nodes' views here. Inside the trainer the two-level gradient
averaging, the liveness monitor and rank-0-only checkpoints are remote_payload's distributed.py.
Network setup and limits: docs/multihost.md.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from rich.console import Console
from rich.text import Text

from .devices import GpuChoice
from .errors import ConflictError, DflashError, Interrupted, OutputClosed, RemoteError, UsageError
from .output import write_out
from .inventory import HostSpec
from .logs import Ending, Reconnect, read_log
from .runs import (
    STATE_STYLE,
    StartedRun,
    check_name_free,
    exit_code_for,
    list_runs,
    push_payload,
    show_run,
    start_run,
    stop_run,
)
from .session import Session

DEFAULT_RDZV_PORT = 29500
T = TypeVar("T")
R = TypeVar("R")


def rendezvous_address(host: HostSpec) -> str:
    """Where the other nodes reach this host's trainer: `rendezvous_address`, else its ssh address."""
    if host.rendezvous_address:
        return host.rendezvous_address
    if host.transport == "ssh":
        return host.address or host.name
    raise UsageError(
        f"host '{host.name}' is local: set its rendezvous_address in hosts.yaml (the address the "
        f"other hosts reach it at), or put another host first"
    )


def new_run_id() -> str:
    """The same format runctl uses (UTC start time + 4 hex digits), chosen here for every node."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-%04x" % random.getrandbits(16)


def parallel(fn: Callable[[T], R], items: Sequence[T]) -> list[R | BaseException]:
    """fn over items in one thread each; results (or the exception raised) in item order."""
    out: list[Any] = [None] * len(items)

    def one(i: int) -> None:
        try:
            out[i] = fn(items[i])
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def check_hosts(hosts: Sequence[HostSpec]) -> None:
    """Refuse a host named twice (one trainer per host: use more GPUs on it instead)."""
    seen = set()
    for host in hosts:
        if host.name in seen:
            raise UsageError(f"host '{host.name}' is listed twice (one trainer per host)")
        seen.add(host.name)


def check_names(session: Session, hosts: Sequence[HostSpec], name: str) -> None:
    """Refuse a --name that a run on any of the hosts has, before anything is pushed or started: a
    node refusing it at its start would leave the nodes started before it stopped under that name."""
    results = parallel(lambda h: check_name_free(session.target(h.name), name), hosts)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]


# Listens on the port as rank 0's TCPStore will (every interface, SO_REUSEADDR as libuv sets it) and
# lets go at once; exit 3 with the reason when it cannot.
PORT_PROBE = """import os, socket, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    sock.bind(("", int(sys.argv[1])))
    sock.listen()
except OSError as exc:
    print(os.strerror(exc.errno) if exc.errno else exc)
    sys.exit(3)
"""


def check_rdzv_port(session: Session, host: HostSpec, port: int) -> None:
    """Refuse (ConflictError) a --rdzv-port that rank 0's host cannot listen on, before anything is
    pushed or started. Only a first look: a port taken after it fails rank 0's trainer (docs/multihost.md)."""
    if not 0 < port < 65536:
        raise UsageError(f"--rdzv-port must be 1-65535, got {port}")
    target = session.target(host.name)
    result = target.run([host.interpreter, "-S", "-c", PORT_PROBE, str(port)], timeout=60)
    if result.exit_code == 3:
        raise ConflictError(
            f"{target.label}: port {port} is not free there ({result.text().strip()}): rank 0 serves the "
            f"rendezvous on it; choose another with --rdzv-port"
        )
    if not result.ok:
        raise RemoteError(f"{target.label}: cannot check port {port}: {result.err_line()}")


def push_all(session: Session, hosts: Sequence[HostSpec], source: Path | None, console: Console) -> dict[str, str]:
    """Push the payload to every host at once; returns each host's manifest hash."""
    quiet = Console(file=console.file, force_terminal=False, no_color=console.no_color, width=console.width)
    results = parallel(lambda h: push_payload(session.target(h.name), source, quiet), hosts)
    for host, result in zip(hosts, results):
        if isinstance(result, BaseException):
            raise result
    return {h.name: str(r) for h, r in zip(hosts, results)}


@dataclass(frozen=True)
class GroupStart:
    """What `train h1,h2` learns at once."""

    run_id: str
    rendezvous: str
    nodes: list[tuple[HostSpec, StartedRun]]


def node_env(
    hosts: Sequence[HostSpec], rank: int, run_id: str, addr: str, port: int, extra: dict[str, str]
) -> dict[str, str]:
    """The torch.distributed variables (and ours) for the trainer of node `rank`."""
    return {
        **extra,
        "RANK": str(rank),
        "WORLD_SIZE": str(len(hosts)),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "DFLASH_NODES": ",".join(h.name for h in hosts),
        "DFLASH_RUN_ID": run_id,
    }


def start_group(
    session: Session,
    hosts: Sequence[HostSpec],
    *,
    gpus: dict[str, GpuChoice],
    config_file: Path | None,
    overrides: Sequence[str],
    name: str | None,
    force: bool,
    payload_hashes: dict[str, str | None],
    rdzv_port: int,
    env: dict[str, str] | None = None,
    preset: str | None = None,
    configs: dict[str, dict[str, Any] | None] | None = None,
    on_event: Sequence[str] = (),
) -> GroupStart:
    """Start one trainer per host under one run id; if any node cannot start, stop the others.
    configs: each host's config as checked before the push (runs.check_trainer_config), for run.json;
    on_event: `--on-event`, run on every node (else each host's own hosts.yaml on_event)."""
    check_hosts(hosts)
    if len(hosts) < 2:
        raise UsageError("a multi-host run needs at least two hosts")
    if not 0 < rdzv_port < 65536:
        raise UsageError(f"--rdzv-port must be 1-65535, got {rdzv_port}")
    addr = rendezvous_address(hosts[0])
    run_id = new_run_id()
    rendezvous = f"{addr}:{rdzv_port}"
    nodes = [h.name for h in hosts]

    def start(rank: int) -> StartedRun:
        host = hosts[rank]
        group = {"nodes": nodes, "rank": rank, "world_size": len(hosts), "rendezvous": rendezvous}
        return start_run(
            session.target(host.name),
            gpus=gpus[host.name],
            config_file=config_file,
            overrides=overrides,
            name=name,
            force=force,
            payload_hash=payload_hashes.get(host.name),
            env=node_env(hosts, rank, run_id, addr, rdzv_port, env or {}),
            run_id=run_id,
            group=group,
            preset=preset,
            config=(configs or {}).get(host.name),
            on_event=on_event,
        )

    results = parallel(start, list(range(len(hosts))))
    failed = [(h, r) for h, r in zip(hosts, results) if isinstance(r, BaseException)]
    if failed:
        started = [h for h, r in zip(hosts, results) if not isinstance(r, BaseException)]
        parallel(lambda h: stop_run(session.target(h.name), run_id, 5.0), started)
        host, exc = failed[0]
        if started and isinstance(exc, DflashError):
            undone = ", ".join(h.name for h in started)
            raise type(exc)(f"{exc} (run {run_id} not started there; stopped it again on {undone})") from exc
        raise exc
    return GroupStart(run_id, rendezvous, [(h, r) for h, r in zip(hosts, results)])  # type: ignore[misc]


# --- combined views ----------------------------------------------------------------------------


def node_view(host: str, rank: int, info: dict[str, Any] | BaseException | None) -> dict[str, Any]:
    """One node's line in a multi-host run: state, exit code, reason (or why it could not be asked)."""
    if isinstance(info, BaseException) or info is None:
        error = "no such run there" if info is None else str(info)
        return {"host": host, "rank": rank, "state": "unknown", "exit_code": None, "reason": None, "error": error}
    return {
        "host": host,
        "rank": rank,
        "state": info.get("state"),
        "exit_code": info.get("exit_code"),
        "reason": info.get("reason"),
        "pid": (info.get("trainer") or {}).get("pid"),
        "run_dir": info.get("run_dir"),
    }


def combine(views: Sequence[dict[str, Any]]) -> tuple[str, int | None, str | None]:
    """The run's state across its nodes, an exit code, and the reason when it failed.

    running while any node runs; stopped if any node was stopped, unless rank 0 failed (the
    others were then stopped because they could not go on without it); succeeded when all did;
    failed when any failed (reason: what a surviving node recorded, naming the dead one, else the
    first failed/lost node); lost when nodes are only lost or cannot be asked."""
    states = [v["state"] for v in views]
    culprit = next((v for v in views if v["state"] in ("failed", "lost") and not v.get("reason")), None)
    reported = next((v for v in views if v.get("reason")), None)
    if "running" in states:
        state = "running"
    elif "stopped" in states and states[0] != "failed":
        state = "stopped"
    elif all(s == "succeeded" for s in states):
        state = "succeeded"
    elif "failed" in states:
        state = "failed"
    else:
        state = "lost"
    code = next((v["exit_code"] for v in views if v["state"] == state and v.get("exit_code") is not None), None)
    reason = None
    if state in ("failed", "lost"):
        if reported is not None:
            reason = reported["reason"]
        elif culprit is not None:
            what = f"failed with exit code {culprit['exit_code']}" if culprit["state"] == "failed" else "lost"
            reason = f"node {culprit['host']} (rank {culprit['rank']}) {what}"
        else:
            bad = next((v for v in views if v["state"] == "unknown"), None)
            reason = f"node {bad['host']} (rank {bad['rank']}) cannot be asked: {bad['error']}" if bad else None
    return state, code, reason


def merged(base: dict[str, Any], views: list[dict[str, Any]]) -> dict[str, Any]:
    """A node's summary (rank 0's when it answered) with the combined state, reason and nodes."""
    state, code, reason = combine(views)
    out = dict(base)
    out.update(state=state, exit_code=code, reason=reason, nodes=views, host=",".join(v["host"] for v in views))
    return out


def _ask(session: Session, host: str, fn: Callable[[Any], dict[str, Any]]) -> dict[str, Any] | BaseException:
    try:
        return fn(session.target(host))
    except Exception as exc:  # noqa: BLE001 - a dead node is what we are reporting on
        return exc


def show_group(session: Session, host: str | None, selector: str | None, metrics: bool = True) -> dict[str, Any]:
    """`runs show` for any run: a single-host run as it is, a multi-host one combined over its nodes."""
    info = show_run(session.target(host), selector, metrics=metrics)
    group = info.get("group")
    if not group:
        return info
    run_id, here = info["run_id"], info.get("host")
    nodes = list(group["nodes"])

    def ask(name: str) -> dict[str, Any] | BaseException:
        if name == here:
            return info
        return _ask(session, name, lambda t: show_run(t, run_id, metrics=metrics and name == nodes[0]))

    answers = parallel(ask, nodes)
    views = [node_view(n, r, a) for r, (n, a) in enumerate(zip(nodes, answers))]
    base = answers[0] if isinstance(answers[0], dict) else info
    return merged(base, views)


def list_group_runs(session: Session, hosts: Sequence[HostSpec]) -> tuple[list[dict[str, Any]], dict[str, DflashError]]:
    """`runs list` over hosts: single-host runs as they are, each multi-host run once, combined
    over all its nodes (nodes outside `hosts` are asked too); plus the hosts that could not be
    listed and why, so one dead host does not hide the others' runs."""
    answers = parallel(lambda h: list_runs(session.target(h.name)), hosts)
    failed: dict[str, DflashError] = {}
    for host, answer in zip(hosts, answers):
        if isinstance(answer, DflashError):
            failed[host.name] = answer
        elif isinstance(answer, BaseException):
            raise answer
    single: list[dict[str, Any]] = []
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for runs in answers:
        if isinstance(runs, BaseException):
            continue
        for run in runs:
            if run.get("group"):
                groups.setdefault(run["run_id"], {})[str(run.get("host"))] = run
            else:
                single.append(run)
    asked = {h.name for h in hosts}
    missing = sorted(
        {n for by_host in groups.values() for run in by_host.values() for n in run["group"]["nodes"]} - asked
    )
    extra: dict[str, Any] = dict(
        zip(missing, parallel(lambda n: _ask(session, n, lambda t: {"runs": list_runs(t)}), missing))
    )
    extra.update(failed)  # a listed host that failed is a node whose state is unknown, with why
    combined = []
    for run_id, by_host in groups.items():
        nodes = list(next(iter(by_host.values()))["group"]["nodes"])
        for name in nodes:
            if name not in by_host and isinstance(extra.get(name), dict):
                found = [r for r in extra[name]["runs"] if r.get("run_id") == run_id]
                if found:
                    by_host[name] = found[0]

        def answer(n: str) -> dict[str, Any] | BaseException | None:
            found = by_host.get(n)
            return found if found is not None or not isinstance(extra.get(n), BaseException) else extra[n]

        views = [node_view(n, r, answer(n)) for r, n in enumerate(nodes)]
        base = by_host.get(nodes[0]) or next(iter(by_host.values()))
        combined.append(merged(base, views))
    return sorted(single + combined, key=lambda r: (r.get("started_ts") or 0, r.get("run_id", ""))), failed


def stop_group(
    session: Session, host: str | None, selector: str | None, grace: float
) -> tuple[dict[str, Any] | None, dict[int, tuple[str, BaseException]]]:
    """`runs stop`: a multi-host run is stopped on every node at once (each SIGTERM, then SIGKILL).
    Returns the summary over the nodes that answered (None if none did) and, by rank, each node
    that did not (host, why): its stop is not confirmed."""
    info = show_run(session.target(host), selector, metrics=False)
    group = info.get("group")
    if not group:
        return stop_run(session.target(host), info["run_id"], grace), {}
    run_id, nodes = info["run_id"], list(group["nodes"])
    answers = parallel(lambda n: _ask(session, n, lambda t: stop_run(t, run_id, grace)), nodes)
    failed = {r: (n, a) for r, (n, a) in enumerate(zip(nodes, answers)) if isinstance(a, BaseException)}
    views = [node_view(n, r, a) for r, (n, a) in enumerate(zip(nodes, answers)) if r not in failed]
    if not views:
        return None, failed
    base = answers[0] if isinstance(answers[0], dict) else info
    out = merged(base, views)
    out["already"] = all(a.get("already") for a in answers if isinstance(a, dict))
    return out, failed


def pick_node(
    session: Session, host_spec: str | None, selector: str | None, node: str | None
) -> tuple[str, str | None]:
    """Which host's log `logs tail` reads, and the run: HOST (a host, `a,b` or a group) says where
    to find the run; a multi-host run's log is its rank-0 node's unless `--host NAME` picks one."""
    hosts = session.inventory.resolve_many(host_spec) if host_spec else [session.host(None)]
    info = show_run(session.target(hosts[0].name), selector, metrics=False)
    nodes = list((info.get("group") or {}).get("nodes") or [info.get("host") or hosts[0].name])
    if node is None:
        return (nodes[0] if info.get("group") else hosts[0].name), info["run_id"]
    if node not in nodes:
        raise UsageError(f"run {info['run_id']} has no node '{node}' (nodes: {', '.join(nodes)})")
    return node, info["run_id"]


def final_state(
    session: Session, host: str, ending: Ending, wait_s: float = 75.0, stop_rest: bool = False
) -> tuple[Ending, str | None]:
    """After following one node to its end: the whole run's state (all nodes) and reason. The
    other nodes end within seconds of it (a lost peer is noticed within a minute): wait for them.
    stop_rest (`train --follow`): once rank 0 failed, stop the nodes still running at once; without
    the rendezvous they cannot go on, and one still waiting for it would hold its GPUs until
    `dist.rendezvous_timeout_s` (a port taken after check_rdzv_port's look, say)."""
    deadline = time.monotonic() + wait_s
    stopped = ""
    while True:
        try:
            info = show_group(session, host, ending.run_id, metrics=False)
        except Exception:  # noqa: BLE001 - the node's own ending is still worth reporting
            return ending, None
        nodes = info.get("nodes") or []
        if stop_rest and not stopped and nodes and nodes[0]["state"] == "failed":
            rest = [v for v in nodes[1:] if v["state"] in ("running", "queued")]
            if rest:
                stopped = _stop_rest(session, ending.run_id, rest)
                continue
        if info["state"] != "running" or not nodes or time.monotonic() > deadline:
            reason = "; ".join(r for r in (info.get("reason"), stopped) if r) or None
            return Ending(ending.run_id, info["state"], info.get("exit_code")), reason
        time.sleep(0.5)


def _stop_rest(session: Session, run_id: str, views: list[dict[str, Any]]) -> str:
    """Stop these nodes of a run whose rank 0 failed (nothing to save: only rank 0 checkpoints);
    what was done, in words, naming the nodes that could not be reached."""
    answers = parallel(lambda v: _ask(session, v["host"], lambda t: stop_run(t, run_id, 5.0)), views)
    done = [f"{v['host']} (rank {v['rank']})" for v, a in zip(views, answers) if isinstance(a, dict)]
    said = [f"stopped {', '.join(done)}, which cannot go on without rank 0"] if done else []
    said += [
        f"could not stop {v['host']} (rank {v['rank']}): {a}" for v, a in zip(views, answers) if not isinstance(a, dict)
    ]
    return "; ".join(said)


class Prefixer:
    """Whole lines from several streams, each prefixed `[host] `, written under one lock."""

    def __init__(self, out: IO[bytes]):
        self.out = out
        self.lock = threading.Lock()
        self.partial: dict[str, bytes] = {}

    def sink(self, host: str) -> Callable[[bytes], None]:
        """A writer for host's stream: whole lines go out prefixed `[host] `, a partial one waits for the rest."""
        prefix = f"[{host}] ".encode()

        def write(data: bytes) -> None:
            with self.lock:
                data = self.partial.pop(host, b"") + data
                *lines, rest = data.split(b"\n")
                if rest:
                    self.partial[host] = rest
                if lines:
                    write_out(self.out, b"".join(prefix + line + b"\n" for line in lines))

        return write

    def flush(self) -> None:
        """Write out every held-back partial line, newline-terminated, and flush the output."""
        with self.lock:
            data = b"".join(f"[{host}] ".encode() + rest + b"\n" for host, rest in self.partial.items())
            self.partial.clear()
            write_out(self.out, data)


def attach_all(
    session: Session,
    host_spec: str | None,
    selector: str | None,
    *,
    follow: bool,
    lines: int,
    since_step: int | None,
    out: IO[bytes],
    err: Console,
    policy: Reconnect = Reconnect(),
) -> int:
    """`logs tail --all`: every node's log at once, lines prefixed with the host; with follow,
    until every node's trainer has ended; exit code for the whole run's state."""
    hosts = session.inventory.resolve_many(host_spec) if host_spec else [session.host(None)]
    info = show_run(session.target(hosts[0].name), selector, metrics=False)
    run_id = info["run_id"]
    nodes = list((info.get("group") or {}).get("nodes") or [info.get("host") or hosts[0].name])
    prefixer = Prefixer(out)

    def read(name: str) -> Ending:
        def notice(msg: str) -> None:
            err.print(Text(f"[{name}] {msg}", style="dim"), soft_wrap=True)

        return read_log(
            session,
            name,
            run_id,
            on_data=prefixer.sink(name),
            follow=follow,
            lines=lines,
            since_step=since_step,
            on_notice=notice,
            policy=policy,
        )

    results: list[Any] = [None] * len(nodes)
    threads = []
    for i, name in enumerate(nodes):

        def run(i: int = i, name: str = name) -> None:
            try:
                results[i] = read(name)
            except Exception as exc:  # noqa: BLE001 - one unreachable node must not hide the others
                results[i] = exc

        threads.append(threading.Thread(target=run, daemon=True))
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.2)
            closed = next((r for r in results if isinstance(r, OutputClosed)), None)
            if closed is not None:  # our stdout went away: the other readers have nowhere to write
                raise closed
    except (KeyboardInterrupt, Interrupted):
        prefixer.flush()
        err.print(
            Text(f"detached; the run goes on. Re-attach: dflashctl logs tail {hosts[0].name} {run_id} --all -f"),
            soft_wrap=True,
        )
        from .runs import EXIT_DETACHED

        return EXIT_DETACHED
    prefixer.flush()
    for name, result in zip(nodes, results):
        if isinstance(result, BaseException):
            err.print(Text(f"[{name}] cannot read the log: {result}", style="red"), soft_wrap=True)
    if not follow:
        return 0
    ending, reason = final_state(session, hosts[0].name, Ending(run_id, "unknown", None))
    report_ending(err, ending, reason)
    return exit_code_for(ending.state)


def report_ending(err: Console, ending: Ending, reason: str | None) -> None:
    """`run ID failed (exit code 75): lost node h2 (rank 1): ...` on stderr."""
    code = f" (exit code {ending.exit_code})" if ending.exit_code not in (None, 0) else ""
    why = f": {reason}" if reason else ""
    err.print(
        Text(f"run {ending.run_id} {ending.state}{code}{why}", style=STATE_STYLE.get(ending.state, "")), soft_wrap=True
    )
