"""Checkpoints (safetensors weights + JSON meta + torch-saved optimizer state) and the stop flag
that turns SIGTERM/SIGINT into a clean save-and-exit. Writing one while training goes on:
`checkpoint_writer`."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from .checkpoint_flush import fsync_path
from .faults import InjectedFault
from .host_copy import tensors_of, with_tensors
from .tensor_file import write_safetensors

WEIGHTS, META, OPTIM = "drafter.safetensors", "meta.json", "optimizer.pt"
OPTIM_SHARD = "optimizer-{}.safetensors"  # the optimizer's tensors (OPTIM holds the rest)
OPTIM_SHARDS = 4  # 2/3 of a checkpoint's bytes: written from this many threads at once, with the weights


class StopFlag:
    """Records a termination signal; the training loop polls `requested` between steps."""

    def __init__(self):
        self.signum: int | None = None
        self.at: float | None = None  # time.monotonic() when it arrived: what a stop's latency counts from

    @property
    def requested(self) -> bool:
        """True once a signal arrived."""
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """Shell convention for death by signal: 128 + signum (143 for SIGTERM)."""
        return 128 + (self.signum or 0)

    def install(self) -> None:
        """Catch SIGTERM and SIGINT (only possible from the main thread; a no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def request(self, signum: int) -> None:
        """Record a stop, as the signal handler does (the first signal's number is kept)."""
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()

    def _handle(self, signum, _frame) -> None:
        self.request(signum)


def _encode_state(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode_state(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state(device: torch.device) -> dict[str, str]:
    """Torch RNG states (CPU and the CUDA device, if any) as JSON-safe strings."""
    states = {"cpu": _encode_state(torch.get_rng_state())}
    if device.type == "cuda":
        states["cuda"] = _encode_state(torch.cuda.get_rng_state(device))
    return states


def restore_rng_state(states: dict[str, str], device: torch.device) -> None:
    """Inverse of `rng_state`."""
    torch.set_rng_state(_decode_state(states["cpu"]))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(_decode_state(states["cuda"]), device)


def checkpoint_dir(out_dir: str | Path) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(out_dir) / "checkpoints"


@dataclass
class CheckpointState:
    """What a checkpoint holds, in host memory: the drafter's weights, {"optimizer", "scheduler"}
    states, and the meta (step, config, RNG states)."""

    step: int
    weights: dict[str, torch.Tensor]
    optim: dict
    meta: dict


def checkpoint_state(step: int, drafter, optimizer, scheduler, config: dict, device: torch.device) -> CheckpointState:
    """The live training state of `step` (tensors still the training's own, on its device)."""
    weights = {k: v.detach() for k, v in drafter.state_dict().items()}
    optim = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    return CheckpointState(step, weights, optim, {"step": step, "config": config, "rng": rng_state(device)})


def _optim_files(optim: dict) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """The optimizer and scheduler state as written: its structure with each tensor replaced by an
    empty placeholder (torch.save'd, a few KB), and its tensors named by their index in `tensors_of`
    order, in OPTIM_SHARDS files of about equal size, so that they are written at once."""
    tensors = list(tensors_of(optim))
    structure = with_tensors(optim, (torch.empty(0) for _ in tensors))
    total = max(1, sum(t.numel() * t.element_size() for t in tensors))
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(OPTIM_SHARDS)]
    done = 0
    for i, tensor in enumerate(tensors):
        shards[min(OPTIM_SHARDS - 1, done * OPTIM_SHARDS // total)][str(i)] = tensor
        done += tensor.numel() * tensor.element_size()
    return structure, shards


def _load_optim(path: Path, device: torch.device) -> dict:
    """The {"optimizer", "scheduler"} state of checkpoint `path`: its structure from OPTIM, its
    tensors from the shard files (or, from a checkpoint written before they existed, in OPTIM)."""
    state = torch.load(path / OPTIM, map_location=device, weights_only=True)
    shards = sorted(path.glob(OPTIM_SHARD.format("*")))
    if not shards:
        return state
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(str(shard), device=str(device)))
    wanted = sum(1 for _ in tensors_of(state))
    if set(tensors) != {str(i) for i in range(wanted)}:
        raise ValueError(f"checkpoint {path}: its optimizer files hold {len(tensors)} tensors, its structure {wanted}")
    return with_tensors(state, (tensors[str(i)] for i in range(wanted)))


@dataclass
class WriteTicket:
    """One write's hand-offs with whoever started it: `written` is set once its files are in the page
    cache (the host memory they were written from is free again); `superseded`, set under `lock`,
    keeps a write whose flush is still under way from being published (a stop's newer checkpoint
    replaces it), and the write then removes its temporary directory instead."""

    written: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    superseded: bool = False


def sync_in_child(directory: Path, names: Sequence[str]) -> None:
    """Flush the written files `names` of `directory`, then the directory, from a process of its own
    session (checkpoint_flush.py --sync): this process's exit never waits for that flush, and a
    stop's signals to the run do not reach it. OSError with the child's line if it failed."""
    script = Path(__file__).with_name("checkpoint_flush.py")
    argv = [sys.executable, "-I", str(script), "--sync", str(directory), *(str(directory / n) for n in names)]
    done = subprocess.run(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise OSError(why[-1] if why else f"checkpoint_flush.py --sync exited {done.returncode}")


def temp_dir(out_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before it is published (renamed into place)."""
    return checkpoint_dir(out_dir) / f".tmp_step_{step:08d}"


def write_checkpoint(
    out_dir: str | Path,
    state: CheckpointState,
    keep: int = 2,
    fail: bool = False,
    durable: bool = True,
    ticket: WriteTicket | None = None,
) -> Path | None:
    """Write checkpoints/step_XXXXXXXX atomically (a temp dir, renamed once complete); its files (the
    weights, the optimizer's structure, the optimizer's tensors in OPTIM_SHARDS files) are written
    at once, one thread each, then (`durable`) flushed at once by a process of its own
    (`sync_in_child`: a stop that supersedes this write exits without waiting for the flush).
    `durable`: every file and the rename are on the disk before this returns (a power loss never
    leaves a torn checkpoint that --resume would take), the page cache holds neither a backlog nor
    the files when the next write comes, and the checkpoints beyond the newest `keep` are then
    removed; without it (a stop's checkpoint: the process exits sooner) the flush and the removal
    are left to `flush_later`. `ticket`: told when the files are written; a write superseded before
    it is published returns None and leaves nothing. `fail` (debug.fail_checkpoint) raises
    InjectedFault after those files, before the meta: a crash in the middle of a write."""
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step:08d}"
    tmp = temp_dir(out_dir, state.step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    structure, shards = _optim_files(state.optim)
    files = {WEIGHTS: partial(write_safetensors, tensors=state.weights), OPTIM: partial(torch.save, structure)}
    files.update({OPTIM_SHARD.format(k): partial(write_safetensors, tensors=shard) for k, shard in enumerate(shards)})
    names = [*files, META]  # what the flush covers: the meta is written last, by this thread
    with ThreadPoolExecutor(len(names), thread_name_prefix="dflash-checkpoint-file") as pool:
        for done in [pool.submit(save, tmp / name) for name, save in files.items()]:
            done.result()
        if fail:
            raise InjectedFault(f"injected fault writing checkpoint step {state.step} (debug.fail_checkpoint)")
        (tmp / META).write_text(json.dumps(state.meta, indent=1))
        if ticket is not None:
            ticket.written.set()
    if durable:
        sync_in_child(tmp, names)
    with ticket.lock if ticket is not None else contextlib.nullcontext():
        published = ticket is None or not ticket.superseded
        if published:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
    if not published:  # a newer checkpoint replaces this one
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    if durable:
        fsync_path(root)
        for old in stale_checkpoints(root, keep):
            shutil.rmtree(old, ignore_errors=True)
    return final


def stale_checkpoints(root: Path, keep: int) -> list[Path]:
    """The checkpoints under `root` beyond the newest `keep` (0: none is stale)."""
    return sorted(root.glob("step_*"))[:-keep] if keep > 0 else []


def flush_later(path: Path, keep: int, also: Sequence[Path] = ()) -> int | None:
    """Start checkpoint_flush.py on a written checkpoint in a process of its own session (it
    outlives this one): the checkpoint reaches the disk seconds after the exit, and then the
    checkpoints beyond the newest `keep` are removed, and `also` (superseded writes' temporary
    directories). Its pid, or None where it cannot be started (the kernel then writes the files
    back, and the older checkpoints stay)."""
    script = Path(__file__).with_name("checkpoint_flush.py")
    old = [*stale_checkpoints(path.parent, keep), *also]
    argv = [sys.executable, "-I", str(script), str(path), *map(str, old)]
    # Its output would land in the run's log after the run's last line: none is kept.
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    try:
        return os.posix_spawn(sys.executable, argv, os.environ, file_actions=quiet, setsid=True)
    except OSError:
        return None


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    found = sorted(p for p in checkpoint_dir(out_dir).glob("step_*") if (p / META).exists())
    return found[-1] if found else None


def load_checkpoint(path: str | Path, drafter: torch.nn.Module, optimizer, scheduler, device: torch.device) -> dict:
    """Restore weights, optimizer, scheduler and RNG in place; returns the meta dict."""
    path = Path(path)
    drafter.load_state_dict(load_file(str(path / WEIGHTS), device=str(device)))
    state = _load_optim(path, device)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    meta = json.loads((path / META).read_text())
    restore_rng_state(meta["rng"], device)
    return meta
