"""Several hosts, one run: torch.distributed between processes, threads inside each process.

`dflashctl train h1,h2` starts one trainer process per host with the usual variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus DFLASH_NODES (host names by rank) and
DFLASH_RUN_ID. Inside each process the threaded workers (workers.py) train one replica per GPU;
this module adds the second level:

- `NodeGroup.cross_reduce(flats)`: the host's already averaged flat gradient buffers become the
  average over every replica of every host (one `all_reduce` per buffer from one thread: NCCL on
  GPUs, gloo on CPU). Hosts may hold different numbers of replicas: each host's mean is weighted
  by its replica count.
- `NodeGroup.cross_check(checksum)`: the parameter checksums of all hosts must be equal; a
  mismatch raises workers.DivergenceError naming the hosts.
- `NodeGroup.sharded(data)`: global replica indices, so every replica of every host gets its own
  slice of the global batch (same slices as one host with as many threads).
- Liveness: from the rendezvous on (the process group's setup included), every process bumps a
  heartbeat counter in the rendezvous TCPStore every `dist.heartbeat_s` (1 s) and watches the
  others'. A peer whose counter stalls for `dist.lost_after_s` (15 s; 3 s once a collective has
  failed), a peer that reported its own failure, or a rendezvous store that stops answering (rank
  0 died) ends this process within seconds: the reason, naming the node, goes to stderr and to
  $DFLASHCTL_REASON_FILE (runctl shows it as the run's failure reason), then
  `os._exit(EXIT_NODE_LOST)`. A hard exit on purpose: a thread stuck inside a collective cannot be
  interrupted otherwise. Collectives also carry the process-group timeout (`dist.timeout_s`) as a
  backstop.
- Checkpoints: rank 0 writes them (`NodeGroup.is_main`); on resume, `sync_checkpoint` sends rank
  0's latest checkpoint to every node, so `load_checkpoint` works the same everywhere.

Network, ports and interface selection (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME): docs/multihost.md.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .config import DistConfig

EXIT_NODE_LOST = 75  # sysexits EX_TEMPFAIL: another node died; rerun (or resume) when it is back
REASON_FILE_ENV = "DFLASHCTL_REASON_FILE"  # set by dflashctl's runctl for every run
AGREED_STOP_ENV = "DFLASHCTL_AGREED_STOP_FILE"  # likewise: where record_agreed_stop writes
CONNECT_GRACE_S = 5.0  # past `dist.rendezvous_timeout_s`, for torch's own connect error to come first
TELL_TIMEOUT_S = 5.0  # how long a rank 0 that cannot serve the rendezvous tries to tell the others


@dataclass(frozen=True)
class NodeEnv:
    """Where this process sits in the group (the environment dflashctl sets) and the config's
    `dist` timeouts."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    nodes: tuple[str, ...]  # host names by rank, for messages
    timeout_s: float  # the four below: config.DistConfig
    rendezvous_timeout_s: float
    heartbeat_s: float
    lost_after_s: float
    run_id: str = "run"

    @classmethod
    def from_env(cls, cfg: DistConfig, environ: Mapping[str, str] | None = None) -> "NodeEnv | None":
        """The group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, or None (one host)."""
        env = os.environ if environ is None else environ
        world = int(env.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return None
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ValueError(f"WORLD_SIZE={world} but {', '.join(missing)} not set")
        rank = int(env["RANK"])
        if not 0 <= rank < world:
            raise ValueError(f"RANK {rank} is outside 0..{world - 1}")
        names = tuple(n for n in env.get("DFLASH_NODES", "").split(",") if n)
        if len(names) != world:
            names = tuple(f"rank{r}" for r in range(world))
        return cls(
            rank,
            world,
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            names,
            timeout_s=cfg.timeout_s,
            rendezvous_timeout_s=cfg.rendezvous_timeout_s,
            heartbeat_s=cfg.heartbeat_s,
            lost_after_s=cfg.lost_after_s,
            run_id=env.get("DFLASH_RUN_ID", "run"),
        )

    def node(self, rank: int) -> str:
        """`h2 (rank 1)`: how messages name a node."""
        return f"{self.nodes[rank]} (rank {rank})"

    @property
    def rendezvous(self) -> str:
        """`master_addr:master_port`, as messages show the rendezvous store."""
        return f"{self.master_addr}:{self.master_port}"


class NodeLost(RuntimeError):
    """Another node died or failed; the message names it."""


class RendezvousStopped(Exception):
    """A stop request (SIGTERM, SIGINT) came while this node waited for the rendezvous."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _rank0_lost(env: NodeEnv, exc: BaseException, during: str = "") -> str:
    """The verdict when rank 0's store stops answering (rank 0 died or is cut off)."""
    return (
        f"lost node {env.node(0)}{during}: the rendezvous store at {env.rendezvous} stopped answering "
        f"({_first_line(exc)})"
    )


def _store(env: NodeEnv, is_master: bool, timeout_s: float) -> dist.Store:
    """A TCPStore connection (or, on rank 0 once, the server), under this run's key prefix."""
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"dflash/{env.run_id}/", store)


def _tell_waiting_nodes(env: NodeEnv, reason: str) -> None:
    """Rank 0 cannot serve the rendezvous: when another run's store holds its port, the other nodes
    are connected to that store, waiting for rank 0 under this run's keys. Leave them the reason
    there (`fail/0`: they exit with it at once) rather than to `dist.rendezvous_timeout_s`. Best
    effort, and bounded: a holder that is not a store never answers the connect."""
    bound = min(TELL_TIMEOUT_S, env.rendezvous_timeout_s)

    def tell() -> None:
        try:
            _store(env, False, bound).set("fail/0", reason[:2000])
        except Exception:  # noqa: BLE001 - nothing to tell it to: the others time out as before
            pass

    helper = threading.Thread(target=tell, name="dflash-rendezvous-failed", daemon=True)
    helper.start()
    helper.join(bound + 1)


class Monitor(threading.Thread):
    """Heartbeats out, heartbeats in: turns a dead or failed peer into a named, prompt exit."""

    def __init__(self, env: NodeEnv, on_lost: Callable[[str], None]):
        super().__init__(name="dflash-node-monitor", daemon=True)
        self.env, self.on_lost = env, on_lost
        # Its own connection: the TCPStore client is not meant for concurrent use by two threads.
        self.store = _store(env, False, max(5.0, 2 * env.heartbeat_s))
        self.halt = threading.Event()
        self.suspect = threading.Event()  # a collective failed: judge quickly
        self.verdict: str | None = None
        self.during = ""  # ` while joining the gloo group`: what this node is doing, for the verdict
        self.seen = {r: (-1, time.monotonic()) for r in range(env.world_size) if r != env.rank}

    def run(self) -> None:
        """Beat this node's heartbeat and watch the peers' until one is lost or failed (calls on_lost) or halted."""
        env = self.env
        while not self.halt.is_set():
            try:
                self.store.add(f"hb/{env.rank}", 1)
                reason = self._check()
            except Exception as exc:  # noqa: BLE001 - the store is rank 0's: it died or is cut off
                if self.halt.is_set():
                    return
                reason = _rank0_lost(env, exc, self.during)
            if reason is not None and not self.halt.is_set():
                self.verdict = reason
                self.on_lost(reason)
                return
            self.halt.wait(env.heartbeat_s if not self.suspect.is_set() else min(env.heartbeat_s, 0.5))

    def _check(self) -> str | None:
        env, now = self.env, time.monotonic()
        limit = min(env.lost_after_s, max(3.0, 3 * env.heartbeat_s)) if self.suspect.is_set() else env.lost_after_s
        for r, (count, since) in self.seen.items():
            if self.store.check([f"fail/{r}"]):
                return f"node {env.node(r)} failed: {self.store.get(f'fail/{r}').decode(errors='replace')}"
            if self.store.check([f"done/{r}"]):
                continue
            value = self.store.add(f"hb/{r}", 0)
            if value != count:
                self.seen[r] = (value, now)
            elif now - since > limit:
                return (
                    f"lost node {env.node(r)}{self.during}: no heartbeat for {now - since:.0f} s "
                    f"(process killed, host down or network cut)"
                )
        return None

    def stop(self) -> None:
        """Halt the heartbeat loop and wait up to 5 s for it (unless called from the monitor thread)."""
        self.halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(5)


class NodeGroup:
    """One trainer process's membership in a multi-host run (see the module docstring)."""

    def __init__(
        self,
        env: NodeEnv,
        device_type: str,
        local_replicas: int,
        on_lost: Callable[[str], None] | None = None,
        log: Callable[[str], None] = print,
        stopped: Callable[[], bool] = lambda: False,
    ):
        if local_replicas < 1:
            raise ValueError("local_replicas must be at least 1")
        self.env, self.log = env, log
        self.rank, self.world_size = env.rank, env.world_size
        self.local_replicas = local_replicas
        self.device_type = device_type
        self.on_lost = on_lost or _exit_node_lost
        self._closed = False
        self.last_check: tuple[int, int] | None = None  # (number of checks, common checksum)
        self._store = self._rendezvous(stopped)
        backend = "nccl" if device_type == "cuda" else "gloo"
        with self._setup("starting the heartbeat monitor"):
            self.monitor = Monitor(env, self._lost)
        # Watching before the group's setup: gloo's and NCCL's own connect wait for a node that died
        # in it up to `dist.timeout_s` (30 min), its heartbeat stops within `dist.lost_after_s`.
        joining = f"joining the {backend} group"
        self.monitor.during = f" while {joining}"
        self.monitor.start()
        with self._setup(joining):
            timeout = datetime.timedelta(seconds=env.timeout_s)  # the collectives' backstop, as before
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("pg/", self._store),
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
            )
            # Checksums, counts and objects travel on gloo even when gradients go over NCCL.
            self.control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
        self.monitor.during = ""
        counts = self._gather_ints([local_replicas])
        self.replica_counts = [c[0] for c in counts]
        self.total_replicas = sum(self.replica_counts)
        self.replica_offset = sum(self.replica_counts[: env.rank])
        self.scale = local_replicas / self.total_replicas
        log(
            f"node {env.node(env.rank)} of {env.world_size} joined {backend} group at {env.rendezvous}: "
            f"replicas per node {self.replica_counts} (global {self.total_replicas})"
        )

    # -- setup --------------------------------------------------------------------------------

    def _rendezvous(self, stopped: Callable[[], bool]) -> dist.Store:
        """Rank 0 serves the store; everyone announces itself and waits (bounded) for the rest.
        RendezvousStopped as soon as `stopped()` is true."""
        env = self.env
        t0 = time.monotonic()
        self.log(
            f"node {env.node(env.rank)} of {env.world_size}: waiting for the rendezvous at {env.rendezvous} "
            f"(up to {env.rendezvous_timeout_s:g} s)"
        )
        store = self._connect(stopped)
        missing = [r for r in range(env.world_size) if r != env.rank]
        try:
            store.set(f"join/{env.rank}", env.nodes[env.rank])
            while missing := [r for r in range(env.world_size) if not store.check([f"join/{r}"])]:
                if stopped():
                    raise RendezvousStopped()
                if env.rank != 0 and store.check(["fail/0"]):  # rank 0 could not serve: _tell_waiting_nodes
                    raise NodeLost(f"node {env.node(0)} failed: {store.get('fail/0').decode(errors='replace')}")
                if time.monotonic() - t0 > env.rendezvous_timeout_s:
                    names = ", ".join(env.node(r) for r in missing)
                    raise NodeLost(
                        f"{names} did not join the rendezvous at {env.rendezvous} within {env.rendezvous_timeout_s:g} s"
                    )
                time.sleep(0.1)
        except (NodeLost, RendezvousStopped):
            raise
        except Exception as exc:  # noqa: BLE001 - only rank 0's store is asked here: rank 0 died or is cut off
            names = ", ".join(env.node(r) for r in missing if r != 0)
            raise NodeLost(_rank0_lost(env, exc, f" while waiting for {names} to join" if names else "")) from exc
        return store

    def _connect(self, stopped: Callable[[], bool]) -> dist.Store:
        """The rendezvous store, made by a helper thread: the C++ connect holds its thread until
        rank 0 answers or `dist.rendezvous_timeout_s` ends, and Python runs signal handlers only in
        the main thread, so the main thread waits here, free to hear a stop (and then leaves the
        helper, a daemon thread, to its timeout)."""
        env, box = self.env, {}

        def connect() -> None:
            try:
                box["store"] = _store(env, env.rank == 0, env.rendezvous_timeout_s)
            except Exception as exc:  # noqa: BLE001 - judged below, in the main thread
                box["error"] = exc

        helper = threading.Thread(target=connect, name="dflash-rendezvous", daemon=True)
        helper.start()
        # torch's connect ends by `dist.rendezvous_timeout_s`, unless a program that is not a store
        # accepted it: torch then waits for its answer for ever. Its own error, when it comes, says more.
        deadline = time.monotonic() + env.rendezvous_timeout_s + CONNECT_GRACE_S
        while helper.is_alive():
            if stopped():
                raise RendezvousStopped()
            if time.monotonic() > deadline:
                raise NodeLost(
                    f"cannot reach the rendezvous of {env.node(0)} at {env.rendezvous} within "
                    f"{env.rendezvous_timeout_s:g} s (no rendezvous store answered there: is the port taken by "
                    f"another program?)"
                )
            helper.join(0.1)
        exc = box.get("error")
        if exc is None:
            return box["store"]
        if env.rank == 0:
            reason = (
                f"cannot serve the rendezvous on port {env.master_port} ({_first_line(exc)}); "
                f"is the port in use by another run or program? Choose a free one: dflashctl train --rdzv-port"
            )
            _tell_waiting_nodes(env, reason)
            raise NodeLost(f"{env.node(0)} {reason}")
        raise NodeLost(
            f"cannot reach the rendezvous of {env.node(0)} at {env.rendezvous} within "
            f"{env.rendezvous_timeout_s:g} s ({_first_line(exc)})"
        )

    @contextmanager
    def _setup(self, what: str) -> Iterator[None]:
        """A setup step after the rendezvous: a failure becomes NodeLost, naming rank 0 when its store
        no longer answers, else the node the monitor (once it runs) finds lost (the step's error
        alone could be any node's), else this node, whose reason the others are told."""
        try:
            yield
        except Exception as exc:
            try:
                self._store.check([f"join/{self.rank}"])
            except Exception:  # noqa: BLE001 - rank 0 died or is cut off
                raise NodeLost(_rank0_lost(self.env, exc, f" while {what}")) from exc
            failed = f"{what} failed on {self.env.node(self.rank)}: {_first_line(exc)}"
            watching = getattr(self, "monitor", None) is not None and self.monitor.is_alive()
            lost = self._explain(what, exc, failed) if watching else NodeLost(failed)
            if not watching or self.monitor.verdict is None:
                # This node's own failure (no other node was found lost): the others, waiting in the
                # same step, exit naming it and why (a wrong GLOO_SOCKET_IFNAME, say) at once.
                self.report_failure(failed)
            raise lost from exc

    # -- the hooks ----------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        """Rank 0: the only node that writes checkpoints and exports."""
        return self.rank == 0

    def cross_reduce(self, flats: list[torch.Tensor]) -> None:
        """In place: each host's mean gradient buffer becomes the mean over all replicas of all hosts."""
        with self._collective("gradient all-reduce"):
            for flat in flats:
                if self.scale != 1.0:
                    flat.mul_(self.scale)
                if flat.is_cuda:
                    with torch.cuda.device(flat.device):
                        dist.all_reduce(flat)
                else:
                    dist.all_reduce(flat)

    def cross_check(self, checksum: int | torch.Tensor, step: int | None = None) -> None:
        """Raise workers.DivergenceError unless every host's parameter checksum equals this one."""
        from .workers import DivergenceError

        value = int(checksum.item()) if isinstance(checksum, torch.Tensor) else int(checksum)
        sums = [c[0] for c in self._gather_ints([value], "checksum comparison")]
        if len(set(sums)) != 1:
            at = f" at step {step}" if step is not None else ""
            shown = ", ".join(f"{self.env.node(r)} {s}" for r, s in enumerate(sums))
            raise DivergenceError(f"hosts diverged{at}: parameter checksums {shown}")
        self.last_check = ((self.last_check or (0, 0))[0] + 1, sums[0])

    def mean(self, local_values: Sequence[float]) -> float:
        """The mean over every replica of every host, from this host's replicas' values."""
        t = torch.tensor([float(sum(local_values))], dtype=torch.float64)
        with self._collective("metrics all-reduce"):
            dist.all_reduce(t, group=self.control)
        return float(t.item()) / self.total_replicas

    def any(self, flag: bool) -> bool:
        """True on every host if it is True on any (e.g. a stop request seen by one node)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        with self._collective("flag all-reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())

    def stop_agreement(self, requested: Callable[[], bool]) -> "AgreedStop":
        """run_threaded's `should_stop` for several hosts: a stop seen on any node (SIGTERM
        arrives at slightly different steps) stops every node at the same step."""
        return AgreedStop(self, requested)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` of rank `src` on every rank (pickled; keep it small-ish)."""
        box = [obj if self.rank == src else None]
        with self._collective("object broadcast"):
            dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]

    def barrier(self) -> None:
        """Wait until every node gets here (on the control group); a failure becomes NodeLost."""
        with self._collective("barrier"):
            dist.barrier(group=self.control)

    def _gather_ints(self, values: Sequence[int], what: str = "start-up exchange") -> list[list[int]]:
        """Every rank's list of ints (same length everywhere), by rank."""
        t = torch.tensor(list(values), dtype=torch.int64)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        with self._collective(what):
            dist.all_gather(out, t, group=self.control)
        return [o.tolist() for o in out]

    def sharded(self, data: Callable[[int, int, int], Any]) -> Callable[[int, int, int], Any]:
        """run_threaded's `data(step, rank, world)` over global replica indices (local rank + offset)."""
        offset, total = self.replica_offset, self.total_replicas
        return lambda step, rank, world: data(step, offset + rank, total)

    def sync_checkpoint(self, out_dir: str | Path, chunk_bytes: int = 64 << 20) -> Path | None:
        """Rank 0's latest checkpoint, on every node: rank 0 returns its own directory; the others
        get a copy under <out_dir>/.resume/ (only rank 0 ever writes <out_dir>/checkpoints/).
        Files travel in chunks as uint8 tensors (no pickling of gigabytes under the GIL, which
        would starve the heartbeat thread)."""
        from .checkpoint import latest_checkpoint

        path = latest_checkpoint(out_dir) if self.is_main else None
        manifest = None
        if path is not None:
            manifest = (path.name, [(f.name, f.stat().st_size) for f in sorted(path.iterdir()) if f.is_file()])
        manifest = self.broadcast(manifest)
        if manifest is None:
            return None
        name, files = manifest
        dest = path if self.is_main else Path(out_dir) / ".resume" / name
        if not self.is_main:
            dest.mkdir(parents=True, exist_ok=True)
        for fname, size in files:
            with open(dest / fname, "rb" if self.is_main else "wb") as fh:
                for offset in range(0, size, chunk_bytes):
                    n = min(chunk_bytes, size - offset)
                    buf = (
                        torch.frombuffer(bytearray(fh.read(n)), dtype=torch.uint8)
                        if self.is_main
                        else torch.empty(n, dtype=torch.uint8)
                    )
                    with self._collective("checkpoint broadcast"):
                        dist.broadcast(buf, src=0, group=self.control)
                    if not self.is_main:
                        fh.write(buf.numpy().tobytes())
        return dest

    # -- failure and shutdown -----------------------------------------------------------------

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            raise self._explain(what, exc) from exc

    def _explain(self, what: str, exc: BaseException, failed: str | None = None) -> BaseException:
        """A failed collective (or setup step) usually means a peer died: wait briefly for the
        monitor's verdict (which ends the process), else report the step's own error (`failed`)."""
        self.monitor.suspect.set()
        deadline = time.monotonic() + max(10.0, 4 * self.env.heartbeat_s + 5)
        while self.monitor.verdict is None and self.monitor.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.monitor.verdict is not None:
            return NodeLost(self.monitor.verdict)
        return NodeLost(
            failed or f"{what} across {self.world_size} nodes failed on {self.env.node(self.rank)}: {_first_line(exc)}"
        )

    def _lost(self, reason: str) -> None:
        if self._closed:
            return
        self.on_lost(reason)

    def report_failure(self, message: str) -> None:
        """Tell the other nodes why this one is about to fail (they exit naming it at once)."""
        try:
            self._store.set(f"fail/{self.rank}", message[:2000])
        except Exception:  # noqa: BLE001 - best effort: heartbeats still time out
            pass

    def close(self, error: BaseException | None = None) -> None:
        """Leave the group. Clean exit: rank 0 keeps the store up until every node is done (while
        still watching them); with an error: report it and leave at once."""
        if self._closed:
            return
        if error is not None and not isinstance(error, NodeLost):
            self.report_failure(f"{_first_line(error)} (see that node's train.log)")
        if error is None and self.last_check is not None:
            self.log(
                f"nodes in sync: parameter checksum {self.last_check[1]} on all {self.world_size} nodes "
                f"({self.last_check[0]} checks)"
            )
        if error is None and self.is_main:
            self._store.set(f"done/{self.rank}", "1")
            while not all(self._store.check([f"done/{r}"]) for r in range(1, self.world_size)):
                if self.monitor.verdict is not None or not self.monitor.is_alive():
                    break  # a node died after the end: its verdict already ended this process
                time.sleep(0.1)
        self._closed = True
        self.monitor.stop()
        if error is None and not self.is_main:
            try:
                self._store.set(f"done/{self.rank}", "1")
            except Exception:  # noqa: BLE001 - rank 0 gone after the last step: nothing left to do
                pass
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> "NodeGroup":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)  # Ctrl-C / SystemExit too: never wait for the others then


class AgreedStop:
    """Called once per step (in the gradient barrier's action): True on every node as soon as any
    node's local flag is; `requested` stays True afterwards (for the checkpoint-and-exit path)."""

    def __init__(self, group: NodeGroup, local: Callable[[], bool]):
        self.group, self.local, self.requested = group, local, False

    def __call__(self) -> bool:
        if not self.requested:
            self.requested = self.group.any(self.local())
        return self.requested


def write_reason(reason: str, env_name: str = REASON_FILE_ENV) -> None:
    """Put the failure reason where dflashctl's runctl looks for it (if it started us)."""
    path = os.environ.get(env_name)
    if not path:
        return
    try:
        tmp = f"{path}.tmp.{os.getpid()}"
        Path(tmp).write_text(reason + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def record_agreed_stop(note: str) -> None:
    """Tell dflashctl's runctl that this node stopped because the group agreed to (a stop asked of
    another node), so that it records a stop, not a failure with exit code 143."""
    write_reason(note, AGREED_STOP_ENV)


_EXITING = threading.Lock()  # the monitor and the main thread may both reach a verdict: one line


def _exit_node_lost(reason: str) -> None:
    """Default verdict action: say why, record it, and end the process now."""
    _EXITING.acquire()  # a second verdict waits here for the first one's exit
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    sys.stderr.write(f"error: {reason}; exiting with code {EXIT_NODE_LOST}\n")
    sys.stderr.flush()
    write_reason(reason)
    os._exit(EXIT_NODE_LOST)


def init_from_env(
    device_type: str,
    local_replicas: int,
    cfg: DistConfig,
    log: Callable[[str], None] = print,
    environ: Mapping[str, str] | None = None,
    stopped: Callable[[], bool] = lambda: False,
) -> NodeGroup | None:
    """The NodeGroup when WORLD_SIZE > 1 (dflashctl multi-host runs), else None; timeouts from `cfg`.
    RendezvousStopped when `stopped()` turns true before every node has joined."""
    env = NodeEnv.from_env(cfg, environ)
    if env is None:
        return None
    try:
        return NodeGroup(env, device_type, local_replicas, log=log, stopped=stopped)
    except NodeLost as exc:  # rendezvous failed: same message, record and exit code as a lost node
        _exit_node_lost(str(exc))
        raise  # unreachable unless os._exit is patched
