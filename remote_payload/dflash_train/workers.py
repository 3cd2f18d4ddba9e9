"""Data-parallel training with one Python thread per device, and a coordinator.

Each worker thread owns one replica on one device (`cuda:i`, or `cpu` for tests). Per step every
replica runs forward+backward on its own micro-batch; the coordinator averages the gradients
(NCCL all-reduce inside this one process on CUDA, a fixed-order sum on CPU) and every replica
steps its own optimizer on the identical result, so replicas stay bit-for-bit equal. That is
checked (parameter checksums) at every sync point; a mismatch is an error.

Any worker's exception aborts every barrier, stops the others and is re-raised by
`run_threaded` as `WorkerError` carrying that worker's traceback. Barriers time out, so a stalled
worker becomes an error too, never a hang.

Why threads compile the way they do (and the measurements): docs/threaded-compile.md.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .compiling import EAGER, CompilePolicy
from .faults import InjectedFault
from .grad_buckets import GradBuckets


class WorkerError(RuntimeError):
    """A worker thread failed (or stalled); the message holds its traceback."""

    def __init__(self, rank: int | None, device: str, phase: str, detail: str):
        who = "coordinator" if rank is None else f"worker {rank} ({device})"
        super().__init__(f"{who} failed during {phase}:\n{detail}")
        self.rank, self.device, self.phase = rank, device, phase


class DivergenceError(RuntimeError):
    """Replicas that must be identical are not."""


class NonFiniteLossError(RuntimeError):
    """A replica's loss is NaN or inf: the run stops before it checkpoints NaN weights or trains on."""


@dataclass(frozen=True)
class ReplicaOps:
    """How to build and train one replica; the workers are generic over these four callables."""

    build: Callable[[torch.device, int, CompilePolicy], Any]  # (device, seed, policy) -> replica
    forward_backward: Callable[[Any, Any], torch.Tensor]  # (replica, batch) -> loss; grads accumulate in .grad
    # (replica, keep_grads) -> None: clip, step, zero grads; in place when keep_grads (the flat buffers
    # stay attached), else set to None (backward then writes fresh ones).
    optimizer_step: Callable[[Any, bool], None]
    parameters: Callable[[Any], Sequence[torch.Tensor]]  # trainable params, same order on every replica
    progress: Callable[[Any], str] | None = None  # (replica) -> where its warm-up is, for progress lines
    # (replica) -> None, under the warm-up lock after the forward/backward calls, gradients zeroed
    # (attached where the run keeps flat buffers): compile or capture what replays later (the
    # optimizer step, parts of the forward), leaving parameters and state as they were.
    warm_up_step: Callable[[Any], None] | None = None


def every(n: int) -> Callable[[int], bool]:
    """A sync schedule for `ThreadedOptions.sync_at`: every `n`-th step."""
    if n < 1:
        raise ValueError(f"a sync interval must be positive, not {n}")
    return lambda step: step % n == 0


@dataclass
class ThreadedOptions:
    """Knobs of the threaded run. The trainer fills them from the run config (train.py)."""

    policy: CompilePolicy = EAGER  # the run plan's (plan.resolve_run); eager by default
    seed: int = 0
    warmup_steps: int = 2  # fwd+bwd calls per worker under the warm-up lock (compile + capture)
    # The steps that are sync points (checksums compared, on_sync called; the last step and a
    # requested stop are too). Each one waits for the GPU: the trainer names only the steps it needs.
    sync_at: Callable[[int], bool] = every(10)
    barrier_timeout_s: float = 1800.0  # a step barrier not passed in time: error
    # Start-up waits (the build/compile lock, the barriers before step 1) include other workers'
    # builds and compiles, minutes on a GPU and seconds on a loaded CPU: a separate, longer bound.
    compile_timeout_s: float = 1800.0
    grace_s: float = 5.0  # after a failure, how long to wait for the other workers to stop
    start_step: int = 0  # steps already done (resume): training runs steps start_step+1 .. steps
    # Fault injection (the run config's `debug` section, and `dflashctl doctor --inject`):
    fail_at: str | None = None  # build | compile | step:K (K from 1): raise InjectedFault there
    hang_at: str | None = None  # same places: block forever there (tests the stall paths)
    fail_rank: int = 0  # the worker that fails or hangs
    # Same places: worker fail_rank calls request_stop() there, as if SIGTERM came at that moment
    # (a stop at a defined point, for tests of the stop rule; run_threaded's docstring states it).
    stop_at: str | None = None
    request_stop: Callable[[], None] | None = None
    # Polled once per step in the gradient barrier's action; True makes this step a sync point and
    # the last one (SIGTERM -> checkpoint -> exit). Must be cheap: a flag read.
    should_stop: Callable[[], bool] | None = None
    # Polled by the main thread until step 1 starts (build, compile and warm-up can take minutes):
    # True ends the run at once, since there is nothing to save; the result says so. Local only: a
    # flag read, never a collective.
    stop_before_start: Callable[[], bool] | None = None
    # Called in the main thread every `progress_every_s` until step 1 starts, with a line saying
    # what each busy worker does (phase, and `ReplicaOps.progress` of its replica).
    on_progress: Callable[[str], None] | None = None
    progress_every_s: float = 10.0
    # Called in rank 0's thread after warm-up, before the first step, while every worker waits
    # (the trainer's step-0 evaluation). Gets a SyncPoint with step=start_step and no losses.
    on_start: Callable[["SyncPoint"], None] | None = None
    # Multi-host hooks (distributed.py). cross_reduce(flats) runs in the gradient barrier's action
    # after the in-process average, on replica 0's flat gradient buffers (one per dtype, on replica
    # 0's device), and must average them across hosts in place (e.g. dist.all_reduce + div_, in
    # stream order, no host sync needed); the result is then copied to every replica.
    cross_reduce: Callable[[list[torch.Tensor]], None] | None = None
    # cross_check(checksum) runs at every sync point after the in-process replicas agreed, with
    # their common parameter checksum, and must raise (e.g. DivergenceError) if another host's differs.
    cross_check: Callable[[int], None] | None = None


@dataclass
class SyncPoint:
    """Handed to `on_sync` (in rank 0's thread) while every other worker waits: a safe point to
    log, evaluate or checkpoint replica 0."""

    step: int
    losses: list[float]  # this step's loss on each replica (own micro-batch)
    seconds_since_last: float  # wall time since the previous sync point (or the start)
    replicas: list[Any]
    loss_sums: list[float] = field(default_factory=list)  # per replica: sum of losses since the previous sync
    steps_since_last: int = 0
    checksum: int = 0  # the replicas' common parameter checksum (compared already)
    warmup_s: list[float] = field(default_factory=list)  # per replica: compile + warm-up seconds

    @property
    def loss(self) -> float:
        """Mean loss across replicas (the global batch's loss for equal micro-batches)."""
        return sum(self.losses) / len(self.losses)


@dataclass
class ThreadedResult:
    """What a finished threaded run reports."""

    policy: CompilePolicy
    steps: int  # the last step done
    losses: list[float]
    checksums: list[int]
    warmup_s: list[float]
    step_ms: list[float]
    replicas: list[Any] = field(repr=False)
    stopped_before_start: bool = False  # a stop came before step 1: nothing trained, nothing to save


def param_checksum(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Exact integer sum of the parameters' bit patterns (int64 tensor on their device)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    sums = [p.detach().view(ints[p.element_size()]).sum(dtype=torch.int64) for p in params]
    return torch.stack(sums).sum()


def _average_local(per_rank: list[list[torch.Tensor]], cross: Callable[[list[torch.Tensor]], None] | None) -> None:
    """Replicas on one device (CPU tests, or one GPU twice): fixed-order sum into rank 0's buffers,
    mean, the cross-host hook, then a copy into every other rank's buffers. In place."""
    world = len(per_rank)
    for bucket in zip(*per_rank):
        total = bucket[0]
        for t in bucket[1:]:
            total += t
        total /= world
    if cross is not None:
        cross(per_rank[0])
    for bucket in zip(*per_rank):
        for t in bucket[1:]:
            t.copy_(bucket[0])


def _average_nccl(per_rank: list[list[torch.Tensor]], cross: Callable[[list[torch.Tensor]], None] | None) -> None:
    """NCCL across the ranks' GPUs from this one thread, in place.

    Enqueued on each device's current stream; every worker thread uses the default stream, so
    the collective is ordered after its backward and before its optimizer step with no host sync.
    Without a cross-host hook: all-reduce then mean. With one: reduce to rank 0, mean, hook on
    rank 0's buffers, broadcast back.
    """
    world = len(per_rank)
    if cross is None:
        for bucket in zip(*per_rank):
            torch.cuda.nccl.all_reduce(list(bucket))
            for t in bucket:
                t.div_(world)
        return
    for bucket in zip(*per_rank):
        torch.cuda.nccl.reduce(list(bucket), root=0)
        bucket[0].div_(world)
    cross(per_rank[0])
    for bucket in zip(*per_rank):
        torch.cuda.nccl.broadcast(list(bucket), root=0)


def hang_forever() -> None:
    """Fault injection (`hang_at`): the worker blocks for good, as a deadlocked compile would."""
    while True:
        time.sleep(3600)


class Stopped(Exception):
    """This worker stops because the run stops (another worker failed, or a stop was asked for)."""


class SerialLock:
    """The lock under which worker threads build, compile and capture, one thread at a time: the
    same seed then gives identical replicas, and no CUDA graph capture overlaps another thread's
    (torch < 2.13 has no lock of its own; docs/threaded-compile.md). Shared by the trainer's
    workers and data regeneration's. A wait gives up with TimeoutError after `timeout_s`, and
    with Stopped as soon as `stop` is set."""

    def __init__(self, stop: threading.Event, timeout_s: float):
        self.stop, self.timeout_s = stop, timeout_s
        self._lock = threading.Lock()

    @contextmanager
    def held(self, who: str) -> Iterator[None]:
        """Hold the lock for the block; `who` names the waiter in a timeout's message."""
        deadline = time.monotonic() + self.timeout_s
        while not self._lock.acquire(timeout=0.1):
            if self.stop.is_set():
                raise Stopped()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{who} waited {self.timeout_s:g}s for the build/compile lock")
        try:
            yield
        finally:
            self._lock.release()


def capture_graph(device: torch.device, rehearse: Callable[[], object], body: Callable[[], Any]) -> tuple[Any, Any]:
    """(CUDA graph, body's output) for `body()` captured on `device` from a worker thread. `rehearse()`
    runs first on a side stream: lazy one-off work (optimizer state, library handles, a compiled
    function's first-call set-up) must not land in the capture (PyTorch's capture recipe). The
    capture runs on a stream of `device` (torch.cuda.graph's default capture stream is one per
    process, made on whichever device asked first) with capture_error_mode thread_local: call it
    under the warm-up lock, while the other workers wait there or at the ready barrier."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        rehearse()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
        out = body()
    return graph, out


def bind_device(device: torch.device) -> None:
    """Make `device` the current CUDA device of the calling thread (first in a worker: every CUDA
    call after it targets that GPU); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class Coordinator:
    """Owns the barriers, locks and shared slots of one threaded run."""

    def __init__(
        self,
        ops: ReplicaOps,
        devices: Sequence[torch.device],
        data: Callable[[int, int, int], Any],
        steps: int,
        options: ThreadedOptions,
        on_sync: Callable[[SyncPoint], bool | None] | None,
    ):
        self.ops, self.devices, self.data, self.steps, self.opt = ops, list(devices), data, steps, options
        self.on_sync = on_sync
        self.world = len(self.devices)
        kinds = {d.type for d in self.devices}
        if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
            raise ValueError(f"workers need devices of one kind, cpu or cuda: {self.devices}")
        self.policy = options.policy
        if len(set(self.devices)) == 1:
            self.reduce = _average_local  # CPU "devices", or one GPU shared by several replicas
        elif kinds == {"cuda"} and len(set(self.devices)) == self.world:
            self.reduce = _average_nccl
        else:
            raise ValueError(f"workers need one device shared by all or distinct GPUs: {self.devices}")
        self.fault = _parse_fault(options.fail_at, "fail_at")
        self.hang = _parse_fault(options.hang_at, "hang_at")
        self.stop_site = _parse_fault(options.stop_at, "stop_at")
        if steps < 1:
            raise ValueError("steps must be positive")
        if not 0 <= options.start_step <= steps:
            raise ValueError(f"start_step {options.start_step} outside [0, {steps}]")
        self.stop = threading.Event()
        self.serial = SerialLock(self.stop, options.compile_timeout_s)  # builds and warm-ups, one at a time
        self.error_lock = threading.Lock()
        self.error: WorkerError | None = None
        self.phase = ["starting"] * self.world
        self.ready = threading.Barrier(self.world, action=self._ready_action)
        self.reduced = threading.Barrier(self.world, action=self._reduce_action)
        self.synced = threading.Barrier(self.world, action=self._sync_action)
        self.resumed = threading.Barrier(self.world)
        self.started = threading.Barrier(self.world, action=self._start_action)
        self.barriers = (self.ready, self.reduced, self.synced, self.resumed, self.started)
        self.replicas: list[Any] = [None] * self.world
        self.buckets: list[GradBuckets | None] = [None] * self.world
        # Gradients need a reduction unless one replica trains alone with no cross-host hook.
        self.reducing = self.world > 1 or options.cross_reduce is not None
        # Gradients live in flat buffers (GradBuckets) where the reduction or a captured optimizer step
        # needs them at fixed addresses. A replica alone lets backward hand over fresh ones each step:
        # accumulating into zeroed buffers reads and writes every fp32 gradient once more, and zeroing
        # them writes it again (4.2 GB at the 8B shape, a few ms of a 220 ms step).
        self.flat_grads = self.reducing or self.policy.capture_optimizer
        self.loss: list[torch.Tensor | None] = [None] * self.world
        self.loss_sum: list[torch.Tensor | None] = [None] * self.world
        self.sums: list[torch.Tensor | None] = [None] * self.world
        self.checksums: list[int] = [0] * self.world
        self.last_losses: list[float] = [float("nan")] * self.world
        self.warmup_s = [0.0] * self.world
        self.step_ms = [0.0] * self.world
        self.finish_after = steps
        self.step_now = options.start_step  # the step the current barrier is for
        self.sync_now = False  # decided once per step in the gradient barrier's action
        self.last_sync_step = options.start_step
        self.last_sync_time = 0.0
        self.point: SyncPoint | None = None
        self.stepping = threading.Event()  # set when step 1 starts: stops then go through the steps
        self.start_lock = threading.Lock()  # stepping is set, or a stop before step 1 seen, under it

    # -- coordinator side -------------------------------------------------------------------

    def run(self) -> ThreadedResult:
        """Start one thread per device, wait, and raise the first worker failure."""
        threads = [
            threading.Thread(target=self._worker, args=(r,), name=f"dflash-worker-{r}", daemon=True)
            for r in range(self.world)
        ]
        t0 = next_report = time.monotonic()
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads) and not self.stop.wait(0.1):
                if self.stepping.is_set():
                    continue
                if self._stopped_before_start():
                    return self._abandon()
                if self.opt.on_progress is not None and time.monotonic() >= next_report + self.opt.progress_every_s:
                    next_report = time.monotonic()
                    self.opt.on_progress(self.progress_line(next_report - t0))
        except BaseException as exc:  # Ctrl-C / SystemExit in the main thread: stop the workers
            self._fail(None, "main thread", exc)
        if self._stopped_before_start():  # also when the signal broke a compile before it was seen
            return self._abandon()
        deadline = time.monotonic() + self.opt.grace_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.error is not None:
            raise self.error
        return ThreadedResult(
            self.policy, self.finish_after, self.last_losses, self.checksums, self.warmup_s, self.step_ms, self.replicas
        )

    def _stopped_before_start(self) -> bool:
        with self.start_lock:
            return (
                not self.stepping.is_set() and self.opt.stop_before_start is not None and self.opt.stop_before_start()
            )

    def _start_action(self) -> None:
        """Runs in the last worker to reach step 1: the one point where a run starts stepping.
        A stop requested before it ends the run untrained; one after it goes through the steps."""
        with self.start_lock:
            if self.opt.stop_before_start is not None and self.opt.stop_before_start():
                self.stop.set()  # the coordinator abandons the run; the workers end below
            else:
                self.stepping.set()

    def _abandon(self) -> ThreadedResult:
        """End a run stopped before step 1 at once. Workers may be deep in a compile that cannot be
        interrupted: they are daemon threads, left behind; the caller exits the process."""
        self.stop.set()
        for barrier in self.barriers:
            barrier.abort()
        return ThreadedResult(
            self.policy,
            self.opt.start_step,
            self.last_losses,
            self.checksums,
            self.warmup_s,
            self.step_ms,
            self.replicas,
            stopped_before_start=True,
        )

    def progress_line(self, elapsed: float) -> str:
        """`start-up 41 s: worker 0 (cuda:0) compile/warm-up: forward: target layer 12/34 (1/2 workers ready)`."""
        busy = []
        for rank in range(self.world):
            phase = self.phase[rank]
            if phase.startswith("waiting") or phase in ("ready", "start"):
                continue
            detail = ""
            if self.ops.progress is not None and self.replicas[rank] is not None:
                detail = self.ops.progress(self.replicas[rank])
            busy.append(f"worker {rank} ({self.devices[rank]}) {phase}" + (f": {detail}" if detail else ""))
        ready = sum(1 for phase in self.phase if phase in ("ready", "start"))
        return f"start-up {elapsed:.0f} s: {'; '.join(busy) or 'waiting'} ({ready}/{self.world} workers ready)"

    def _fail(self, rank: int | None, phase: str, exc: BaseException, abort: bool = True) -> None:
        """Record the first failure, then abort every barrier so no worker waits forever.

        Barrier actions pass abort=False: they run holding their barrier's (non-reentrant) lock,
        so aborting from inside would deadlock that thread; their exception breaks the barrier,
        and the thread aborts the others when it reaches `_worker`'s handler."""
        with self.error_lock:
            secondary = self.stop.is_set() and isinstance(exc, (threading.BrokenBarrierError, Stopped))
            if self.error is None and not secondary:
                device = "coordinator" if rank is None else str(self.devices[rank])
                detail = "".join(traceback.format_exception(exc))
                if isinstance(exc, TimeoutError):
                    detail += f"phases: {self.phase}\n"
                self.error = WorkerError(rank, device, phase, detail)
                self.error.__cause__ = exc
            self.stop.set()
        if abort:
            for barrier in self.barriers:
                barrier.abort()

    def _ready_action(self) -> None:
        """Runs in the last thread to arrive after warm-up: create the NCCL communicator now.
        torch.cuda.nccl makes it on the first collective (~0.6 s on 2 x H200), which would
        otherwise land in step 1. The buffers are zeros here, so the all-reduce leaves them so."""
        try:
            if self.reducing and self.reduce is _average_nccl:
                torch.cuda.nccl.all_reduce([b.flats[0] for b in self.buckets])
                for device in self.devices:
                    torch.cuda.synchronize(device)
        except BaseException as exc:  # recorded before the broken barrier wakes the others
            self._fail(None, "NCCL communicator set-up", exc, abort=False)
            raise

    def _reduce_action(self) -> None:
        """Runs in the last thread to arrive: average every rank's gradient buffers, and decide
        whether this step is a sync point (and the last one, when a stop was requested)."""
        step = self.step_now
        try:
            if self.reducing:
                self.reduce([b.flats for b in self.buckets], self.opt.cross_reduce)
            if self.opt.should_stop is not None and self.opt.should_stop():
                self.finish_after = min(self.finish_after, step)
            self.sync_now = self.opt.sync_at(step) or step >= self.finish_after
        except BaseException as exc:  # recorded before the broken barrier wakes the others
            self._fail(None, f"step {step} gradient all-reduce", exc, abort=False)
            raise

    def _sync_action(self) -> None:
        """Runs in the last thread to arrive: compare checksums (here and across hosts), collect losses."""
        step = self.step_now
        try:
            sums = [int(s.item()) for s in self.sums]
            losses = [float(loss.item()) for loss in self.loss]
            loss_sums = [float(s.item()) for s in self.loss_sum]
            self.checksums, self.last_losses = sums, losses
            if not all(math.isfinite(x) for x in losses + loss_sums):
                since = f"since step {self.last_sync_step}: {loss_sums}"
                raise NonFiniteLossError(f"the loss is not finite at step {step}: {losses} ({since})")
            if len(set(sums)) != 1:
                raise DivergenceError(f"replicas diverged at step {step}: parameter checksums {sums}")
            if self.opt.cross_check is not None:
                self.opt.cross_check(sums[0])
            now = time.monotonic()
            self.point = SyncPoint(
                step,
                losses,
                now - self.last_sync_time,
                self.replicas,
                loss_sums,
                step - self.last_sync_step,
                sums[0],
                list(self.warmup_s),
            )
            self.last_sync_time, self.last_sync_step = now, step
        except BaseException as exc:  # recorded before the broken barrier wakes the others
            self._fail(None, f"step {step} sync", exc, abort=False)
            raise

    # -- worker side ------------------------------------------------------------------------

    def _worker(self, rank: int) -> None:
        try:
            self._train(rank)
        except BaseException as exc:  # every failure must reach the coordinator, or others hang
            self._fail(rank, self.phase[rank], exc)

    def _train(self, rank: int) -> None:
        device = self.devices[rank]
        bind_device(device)
        with self._serialised(rank, "build"):
            self._maybe_fail(rank, "build")
            torch.manual_seed(self.opt.seed)
            replica = self.ops.build(device, self.opt.seed, self.policy)
            params = list(self.ops.parameters(replica))
        self.replicas[rank] = replica
        buckets = self.buckets[rank] = GradBuckets(params)
        if self.flat_grads:
            buckets.attach()
        self._warm_up(rank, replica)
        self.loss_sum[rank] = torch.zeros((), device=device)
        self._wait(rank, self.ready, "ready", self.opt.compile_timeout_s)
        if self.opt.on_start is not None and rank == 0:
            self.phase[rank] = "on_start"
            self.opt.on_start(SyncPoint(self.opt.start_step, [], 0.0, self.replicas, warmup_s=list(self.warmup_s)))
        self._wait(rank, self.started, "start", self.opt.compile_timeout_s)
        if not self.stepping.is_set():  # _start_action saw a stop: nothing trained, nothing to save
            raise Stopped()
        self.last_sync_time = t0 = time.monotonic()
        step = self.opt.start_step
        while step < self.finish_after:
            step += 1
            self.phase[rank] = f"step {step} forward/backward"
            self._maybe_fail(rank, f"step:{step}")
            loss = self.ops.forward_backward(replica, self.data(step - 1, rank, self.world)).detach()
            self.loss[rank] = loss
            self.loss_sum[rank] += loss
            self.step_now = step
            self._wait(rank, self.reduced, f"step {step} gradient all-reduce")
            if self.sync_now and self.flat_grads and not buckets.attached():
                raise RuntimeError(
                    "a gradient was replaced instead of accumulated in place (optimizer_step "
                    "must zero grads with set_to_none=False)"
                )
            self.phase[rank] = f"step {step} optimizer"
            self.ops.optimizer_step(replica, self.flat_grads)
            if self.sync_now:
                self.sums[rank] = param_checksum(params)
                self._wait(rank, self.synced, f"step {step} sync")
                self.loss_sum[rank].zero_()
                if rank == 0 and self.on_sync is not None:
                    self.phase[rank] = f"step {step} on_sync"
                    if self.on_sync(self.point):
                        self.finish_after = step
                self._wait(rank, self.resumed, f"step {step} after sync")
        _synchronize(device)
        done = step - self.opt.start_step
        self.step_ms[rank] = (time.monotonic() - t0) / max(done, 1) * 1e3

    def _warm_up(self, rank: int, replica: Any) -> None:
        """Compile and capture under the lock, leaving parameters and optimizer untouched."""
        with self._serialised(rank, "compile/warm-up"):
            t0 = time.monotonic()
            self._maybe_fail(rank, "compile")
            if self.opt.warmup_steps:
                batch = self.data(self.opt.start_step, rank, self.world)
                for _ in range(self.opt.warmup_steps):
                    self.ops.forward_backward(replica, batch)
                _synchronize(self.devices[rank])
            self.buckets[rank].zero()
            if self.ops.warm_up_step is not None:
                self.ops.warm_up_step(replica)
                _synchronize(self.devices[rank])
            self.warmup_s[rank] = time.monotonic() - t0

    @contextmanager
    def _serialised(self, rank: int, phase: str) -> Iterator[None]:
        self.phase[rank] = f"waiting for lock ({phase})"
        with self.serial.held(f"worker {rank} ({phase})"):
            self.phase[rank] = phase
            yield

    def _wait(self, rank: int, barrier: threading.Barrier, phase: str, timeout: float | None = None) -> None:
        if self.stop.is_set():
            raise Stopped()
        self.phase[rank] = phase
        timeout = self.opt.barrier_timeout_s if timeout is None else timeout
        try:
            barrier.wait(timeout=timeout)
        except threading.BrokenBarrierError:
            if self.stop.is_set():  # broken by a failure elsewhere, already recorded
                raise
            raise TimeoutError(f"barrier timed out after {timeout:g}s") from None

    def _maybe_fail(self, rank: int, where: str) -> None:
        if rank != self.opt.fail_rank:
            return
        if self.stop_site == where and self.opt.request_stop is not None:
            self.opt.request_stop()
        if self.hang == where:
            hang_forever()
        if self.fault == where:
            raise InjectedFault(f"injected fault at {where} on worker {rank} (fail_at={self.opt.fail_at})")


def _parse_fault(spec: str | None, name: str = "fail_at") -> str | None:
    """Validate a fault site: None, 'build', 'compile' or 'step:K' with K >= 1."""
    if spec is None or spec in ("build", "compile"):
        return spec
    kind, _, k = spec.partition(":")
    if kind != "step" or not k.isdigit() or int(k) < 1:
        raise ValueError(f"{name} must be build, compile or step:K (K >= 1), got {spec!r}")
    return f"step:{int(k)}"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def use_cpu_threads(threads: int) -> None:
    """Apply `run.cpu_threads` (config.py says why one is the default); 0 keeps torch's default."""
    if threads > 0:
        torch.set_num_threads(threads)


def live_workers(before: Collection[threading.Thread] = ()) -> list[str]:
    """Names of worker threads still running (stuck in a compile, or hung on purpose), leaving out
    those in `before`: a snapshot of `threading.enumerate()` taken before a run, so that an earlier
    run's left-behind workers in the same process are not taken for this run's."""
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("dflash-worker-") and t.is_alive() and t not in before
    ]


def run_threaded(
    ops: ReplicaOps,
    devices: Sequence[torch.device | str],
    data: Callable[[int, int, int], Any],
    steps: int,
    options: ThreadedOptions | None = None,
    on_sync: Callable[[SyncPoint], bool | None] | None = None,
) -> ThreadedResult:
    """Train one replica per device in one thread each, data-parallel; raise WorkerError on any failure.

    `data(step, rank, world)` returns rank's micro-batch for 0-based `step`; `on_sync` runs in
    rank 0's thread at the steps `options.sync_at` names, at the last step and at a requested stop,
    while all other workers wait; it may return True to end the run there. A single device is
    the same loop with one thread (world 1: no gradient reduction).

    The stop rule: step 1 starts at one point (the last worker reaching it, after warm-up and
    `on_start`). A stop (`stop_before_start`) requested before that point ends the run there with
    nothing trained (`stopped_before_start`); one requested later (`should_stop`, polled when
    every worker has finished a step's backward) ends the run after that step, as a sync point.
    """
    coordinator = Coordinator(
        ops, [torch.device(d) for d in devices], data, steps, options or ThreadedOptions(), on_sync
    )
    return coordinator.run()


def shard_batch(batch: Any, rank: int, world: int) -> Any:
    """Rank's equal slice (dim 0) of every tensor field of a dataclass batch."""
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    n = next(v for v in fields.values() if isinstance(v, torch.Tensor)).shape[0]
    if n % world:
        raise ValueError(f"batch of {n} sequences does not split into {world} equal micro-batches")
    per = n // world
    return dataclasses.replace(
        batch, **{k: v[rank * per : (rank + 1) * per] for k, v in fields.items() if isinstance(v, torch.Tensor)}
    )


def sharded(global_batch: Callable[[int], Any]) -> Callable[[int, int, int], Any]:
    """`data` for run_threaded from a function of the step that returns the global batch."""
    return lambda step, rank, world: shard_batch(global_batch(step), rank, world)
