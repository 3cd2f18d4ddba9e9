"""Checkpoints that do not stop training (issue 31): the step loop waits only for the copy of the
state into host memory (`host_copy`); a background thread writes the files (`checkpoint.write_checkpoint`).
One write is in flight at a time, and a write's outcome (its line, or its error) is reported in
the step loop's thread, at the next sync point or when the run waits for it. A stop's checkpoint
waits only for the files of a periodic write in flight, not for their flush (5-9 s at 8B on an
H200 box): the stop's newer checkpoint supersedes that write, which is then never published."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import (
    CheckpointState,
    WriteTicket,
    checkpoint_state,
    flush_later,
    stale_checkpoints,
    temp_dir,
    write_checkpoint,
)
from .host_copy import HostBuffers


# Between two arenas of the buffers' background allocation: the launches an arena's pinning held up
# catch up (an 8B step is ~0.22 s); ~50 arenas take ~2.5 s more in all. A save that needs the buffers
# drops the pauses (`hurry`): training waits then anyway.
RESERVE_PAUSE_S = 0.05


class CheckpointWriteError(RuntimeError):
    """A checkpoint's files could not be written: the run fails with it."""


@dataclass
class _Write:
    """One background write; its thread fills in `path` and `seconds`, or `error`."""

    step: int
    durable: bool
    ticket: WriteTicket = field(default_factory=WriteTicket)
    path: Path | None = None
    seconds: float = 0.0
    error: BaseException | None = None


class CheckpointWriter:
    """Rank 0's checkpoints of one run: `save` copies and hands the files to a background thread,
    `poll` reports a finished write, `wait` waits for the one in flight (a stop, the run's end)."""

    def __init__(self, out_dir: Path, keep: int, log: Callable[[str], None], fail_step: int | None = None):
        self.out_dir, self.keep, self.log, self.fail_step = out_dir, keep, log, fail_step
        self.buffers = HostBuffers()
        self.pending: _Write | None = None  # the write in flight, and its thread
        self.thread: threading.Thread | None = None
        self.superseded: list[tuple[_Write, threading.Thread]] = []  # flushing when a stop's came
        self.reserved = False  # whether `reserve` was called (its allocation may still be under way)
        self.reserving: threading.Thread | None = None  # the buffers' allocation in the background, if started
        self.hurry = threading.Event()  # set: the allocation goes on without its pauses
        self.owed = False  # whether a periodic checkpoint was put off by the allocation

    def due(self, step: int, scheduled: bool, final: bool) -> bool:
        """Whether to checkpoint at the sync point after `step`: when `scheduled` there or owed from
        an earlier one. A periodic checkpoint that falls while the host buffers are still being
        allocated (the first ~7 s after the first step at 8B) is put off to the next sync point that
        finds them ready, so that it never blocks training; a `final` one (a stop, the run's last
        step) is taken at once and waits for the allocation, without its pauses."""
        if not (scheduled or self.owed):
            return False
        if final or self.reserving is None or not self.reserving.is_alive():
            self.owed = False
            return True
        if not self.owed:
            self.owed = True
            self.log(
                f"checkpoint step {step}: put off to the next sync point (its host buffers are still being "
                f"allocated in the background; training goes on)"
            )
        return False

    def reserve(self, drafter, optimizer, scheduler, config: dict, device: torch.device) -> None:
        """Allocate the host buffers for this state, once; on CUDA, pinned, in a background thread: at
        8B scale 12.6 GB, whose allocation blocked the first checkpoint's step for 5-6 s. Call it
        once the optimizer holds its state (after the first step, or at a resume's start); `due` puts
        a periodic checkpoint off while it runs, and a stop's `save` waits for it."""
        if self.reserved:
            return
        self.reserved = True
        live = checkpoint_state(0, drafter, optimizer, scheduler, config, device)
        state = (live.weights, live.optim)
        if device.type != "cuda":  # pageable memory, not pinned: allocated lazily, in microseconds
            self._reserve(state, device)
            return
        self.reserving = threading.Thread(target=self._reserve, args=(state, device), name="dflash-checkpoint-buffers")
        self.reserving.start()

    def _reserve(self, state, device: torch.device) -> None:
        if device.type == "cuda":  # a new thread's current device is cuda:0: no context made on another GPU
            torch.cuda.set_device(device)
        try:
            self.buffers.reserve(state, device, lambda: self.hurry.wait(RESERVE_PAUSE_S))
        except (RuntimeError, MemoryError) as exc:  # host memory short: the first save allocates, as before
            self.log(f"checkpoint: host buffers not allocated ahead ({type(exc).__name__}: {exc}); the first save will")

    def save(
        self, step: int, drafter, optimizer, scheduler, config: dict, device: torch.device, durable: bool = True
    ) -> None:
        """Copy the state of `step` to host memory, then write it in the background (after the
        previous write, whose buffers the copy reuses, has finished; for a stop's, not `durable`,
        after its files only: `_supersede`); `durable`: flushed to the disk before it is published
        (see `write_checkpoint`)."""
        t0 = time.perf_counter()
        previous = self.pending.step if self.pending else None
        if durable:
            self.wait()
        else:
            self._supersede()
        if self.reserving is not None:
            self.hurry.set()
            self.reserving.join()  # the buffers' allocation, started once the optimizer held its state
        t1 = time.perf_counter()
        live = checkpoint_state(step, drafter, optimizer, scheduler, config, device)
        (weights, optim), allocated = self.buffers.copy((live.weights, live.optim), device)
        t2 = time.perf_counter()
        fresh = " into new host buffers" if allocated else ""
        waited = ""
        if t1 - t0 >= 0.01:
            what = "the host buffers' allocation"
            if previous is not None:
                what = f"step {previous}'s {'write' if durable else 'files'}"
            waited = f", after waiting {t1 - t0:.2f} s for {what}"
        self.log(
            f"checkpoint step {step}: training blocked {t2 - t0:.2f} s: copied {self.buffers.nbytes / 1e9:.2f} GB "
            f"to host memory in {t2 - t1:.2f} s{fresh}{waited}; writing it in the background"
        )
        self.pending = _Write(step, durable)
        state = CheckpointState(step, weights, optim, live.meta)
        # A daemon: a superseded write's flush, cut short by the stop's exit, must not hold the exit up.
        self.thread = threading.Thread(
            target=self._write, args=(self.pending, state), name="dflash-checkpoint-writer", daemon=True
        )
        self.thread.start()

    def _write(self, write: _Write, state: CheckpointState) -> None:
        t0 = time.perf_counter()
        try:
            write.path = write_checkpoint(
                self.out_dir,
                state,
                self.keep,
                fail=state.step == self.fail_step,
                durable=write.durable,
                ticket=write.ticket,
            )
        except BaseException as exc:  # reported by the step loop's thread, which fails the run with it
            write.error = exc
        finally:
            write.ticket.written.set()  # a failed write too: whoever waits for its files is told
        write.seconds = time.perf_counter() - t0

    def _supersede(self) -> None:
        """Before a stop's checkpoint: wait for the files of the write in flight (its host buffers are
        then free for the stop's copy), and leave its flush under way, unpublished: the stop's newer
        checkpoint replaces it. A write that failed, or has finished, is reported as `wait` does."""
        write, thread = self.pending, self.thread
        if thread is None:
            return
        write.ticket.written.wait()
        if write.error is not None or not thread.is_alive():
            self.wait()
            return
        with write.ticket.lock:  # the write publishes under this lock, or, from now on, never
            write.ticket.superseded = True
            published = not temp_dir(self.out_dir, write.step).exists()
        self.superseded.append((write, thread))
        self.pending = self.thread = None
        if published:  # just now: only the removal of older checkpoints was left, which the exit may cut
            self.log(f"checkpoint step {write.step}: on disk (the stop's checkpoint comes next)")
        else:
            self.log(
                f"checkpoint step {write.step}: its files are written, their flush to the disk is still under "
                f"way; the stop's checkpoint replaces it (it is not published)"
            )

    def poll(self) -> None:
        """Report the write in flight if it has finished (raises CheckpointWriteError if it failed)."""
        if self.thread is not None and not self.thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the write in flight, if any, and report it (raises CheckpointWriteError if it failed)."""
        write, thread = self.pending, self.thread
        if thread is None:
            return
        self.pending = self.thread = None
        thread.join()
        if write.error is not None:
            raise CheckpointWriteError(
                f"writing the checkpoint of step {write.step} failed after {write.seconds:.1f} s: "
                f"{type(write.error).__name__}: {write.error}"
            ) from write.error
        where = "on disk"
        if not write.durable:  # a stop's: flushed by a process that outlives this one
            # Superseded writes still flushing are cut short by the exit: their directories go too.
            unpublished = [temp_dir(self.out_dir, w.step) for w, _ in self.superseded if w.path is None]
            flusher = flush_later(write.path, self.keep, unpublished)
            if flusher is None:  # no process to prune after the flush: the disk must not fill up
                for old in [*stale_checkpoints(write.path.parent, self.keep), *unpublished]:
                    shutil.rmtree(old, ignore_errors=True)
            where = (
                f"flushed to disk after the exit by pid {flusher}, which then removes older checkpoints"
                if flusher
                else "in the page cache, which the kernel writes back after the exit"
            )
        self.log(f"checkpoint: {write.path} (written in {write.seconds:.2f} s in the background, {where})")

    def settle(self) -> None:
        """After a failed run: let the write in flight finish (its checkpoint is a good one) and log,
        rather than raise, its own error, so that the run's failure stays the one reported."""
        try:
            self.wait()
        except CheckpointWriteError as exc:
            self.log(f"error: {exc}")
