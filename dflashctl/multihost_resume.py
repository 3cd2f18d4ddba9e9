"""`train HOST --resume RUN` of a run across several hosts: every node continues at once.

HOST is any node of the run (or the list, or the group, naming exactly its nodes); its run.json
names the others. Every node is asked first (reachable, the run there, none running), the
payload is pushed, every node's `runctl resume` makes all its checks without starting (the
pre-flight included), and only then does every node start, each with its own run.json: same run
id and rank, the rendezvous recorded (or moved to `--rdzv-port`), its recorded environment. The
trainers' `--resume` then has rank 0 send its newest checkpoint to the others (remote_payload's
distributed.py). docs/multihost.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from .errors import ConflictError, DflashError, UsageError
from .inventory import HostSpec
from .multihost import GroupStart, check_rdzv_port, node_env, parallel, push_all
from .runs import StartedRun, refuse_resume, resume_run, show_run, stop_run
from .session import Session


def find_run(session: Session, hosts: Sequence[HostSpec], selector: str) -> tuple[str, dict[str, Any] | None]:
    """The id of the run `selector` names on the first host, and its group (None: a run of one
    host). Several hosts given must be exactly the run's nodes (in any order): else UsageError;
    a run of one host that its record refuses to resume (refuse_resume) is refused here, before
    anything is pushed (check_nodes asks every node of a group)."""
    target = session.target(hosts[0].name)
    info = show_run(target, selector, metrics=False)
    run_id, group = info["run_id"], info.get("group")
    given = [h.name for h in hosts]
    if group is None:
        refuse_resume(target, info, "train")
        if len(hosts) > 1:
            raise UsageError(
                f"run {run_id} ran on {hosts[0].name} alone: continue it with dflashctl train {hosts[0].name} "
                f"--resume {run_id}"
            )
        return run_id, None
    nodes = list(group["nodes"])
    if len(hosts) > 1 and sorted(given) != sorted(nodes):
        raise UsageError(
            f"run {run_id} ran on {','.join(nodes)}, not {','.join(given)}: name one of its hosts, or exactly those"
        )
    return run_id, group


def _raise(exc: BaseException, note: str) -> None:
    """Raise exc with `note` appended to its line (an error type that takes other arguments as it is)."""
    if note and isinstance(exc, DflashError) and type(exc).__init__ is Exception.__init__:
        raise type(exc)(f"{exc}{note}") from exc
    raise exc


def _first_failure(results: Sequence[Any], note: str) -> None:
    """If any node failed: the first one's (by rank) error, with note."""
    for result in results:
        if isinstance(result, BaseException):
            _raise(result, note)


def check_nodes(
    session: Session, hosts: Sequence[HostSpec], run_id: str, group: dict[str, Any], moving: bool = False
) -> list[dict[str, Any]]:
    """Before anything is pushed: every node answers, has the run with the same group, and none
    runs it (a node that cannot be asked is its one error line; nothing is resumed). Each node's
    group as it recorded it, by rank. moving (`--rdzv-port`): the rendezvous recorded may differ
    (a resume that moved it stopped part-way); the new one replaces it on every node."""
    answers = parallel(lambda h: show_run(session.target(h.name), run_id, metrics=False), hosts)
    _first_failure(answers, f"; nothing was resumed (every node of run {run_id} must answer)")
    for rank, (host, info) in enumerate(zip(hosts, answers)):
        recorded, expected = info.get("group") or {}, dict(group, rank=rank)
        if dict(recorded, rendezvous=None) == dict(expected, rendezvous=None) and recorded != expected:
            if not moving:
                raise UsageError(
                    f"{host.name}: run {run_id} there records the rendezvous {recorded['rendezvous']}, not "
                    f"{group['rendezvous']}: give every node one with --rdzv-port"
                )
        elif recorded != expected:
            raise UsageError(f"{host.name}: run {run_id} there records another group: {info.get('group')}")
    live = [(h.name, a["state"]) for h, a in zip(hosts, answers) if a.get("state") in ("running", "queued")]
    if live:
        raise ConflictError(
            f"run {run_id} is still {live[0][1]} on {', '.join(n for n, _ in live)} (stop it first: "
            f"dflashctl runs stop {live[0][0]} {run_id})"
        )
    return [info["group"] for info in answers]


def resume_group(
    session: Session,
    run_id: str,
    group: dict[str, Any],
    *,
    force: bool,
    env: dict[str, str],
    push: bool,
    source: Path | None,
    console: Console,
    rdzv_port: int | None = None,
) -> tuple[list[HostSpec], GroupStart]:
    """Continue every node of a run across hosts (see the module's doc); its nodes by rank and
    what started. env: `--env` (replaces each node's own, as for one host; the torch.distributed
    variables are the run's); rdzv_port: move the rendezvous there (each node's runctl records it);
    if a node cannot start, the nodes started are stopped again."""
    hosts = [session.host(name) for name in group["nodes"]]
    recorded = check_nodes(session, hosts, run_id, group, moving=rdzv_port is not None)
    addr, _, old_port = str(group["rendezvous"]).rpartition(":")
    port = int(old_port) if rdzv_port is None else rdzv_port
    check_rdzv_port(session, hosts[0], port)  # as a start does: a port taken since is one line, not a failed run
    hashes = push_all(session, hosts, source, console) if push else {}

    def resume(rank: int, check: bool) -> StartedRun:
        host = hosts[rank]
        return resume_run(
            session.target(host.name),
            run_id,
            payload_hash=hashes.get(host.name),
            force=force,
            env=node_env(hosts, rank, run_id, addr, port, env) if env else None,
            group=recorded[rank],
            check=check,
            preflight=check,  # checked a moment ago: the start need not wait for it again
            rdzv_port=rdzv_port,
        )

    ranks = list(range(len(hosts)))
    _first_failure(parallel(lambda r: resume(r, True), ranks), "; nothing was resumed")
    results = parallel(lambda r: resume(r, False), ranks)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        started = [h for h, r in zip(hosts, results) if not isinstance(r, BaseException)]
        parallel(lambda h: stop_run(session.target(h.name), run_id, 5.0), started)
        undone = f" (run {run_id} not resumed there; stopped it again on {', '.join(h.name for h in started)})"
        _raise(failed[0], undone if started else "")
    nodes = [(h, r) for h, r in zip(hosts, results) if isinstance(r, StartedRun)]
    return hosts, GroupStart(run_id, f"{addr}:{port}", nodes)
