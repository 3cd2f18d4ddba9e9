"""The training run's metrics: when a sync point logs, evaluates and checkpoints (`Cadence`), the
running training figures between two records (`TrainMeter`), and metrics.jsonl (`MetricsLog`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Cadence:
    """`run.log_every`, `run.eval_every` and `run.checkpoint_every` over a run of `total` steps."""

    log_every: int
    eval_every: int
    checkpoint_every: int
    total: int

    def syncs(self, step: int) -> bool:
        """Whether the workers stop at `step` for a sync point: the steps that log, evaluate or
        checkpoint, and no others (each waits for the GPU; the last step and a stop are ones too)."""
        return step % self.log_every == 0 or step % self.eval_every == 0 or step % self.checkpoint_every == 0

    def evaluates(self, step: int) -> bool:
        """A held-out evaluation after `step` (the last step's is the final one, told apart)."""
        return step % self.eval_every == 0 and step < self.total

    def ends(self, step: int, stopping: bool) -> bool:
        """Whether the sync point after `step` is the run's last: its last step, or a stop."""
        return step == self.total or stopping

    def logs(self, step: int, stopping: bool) -> bool:
        """A train record after `step`: on schedule, with an evaluation, at the end or at a stop."""
        return step % self.log_every == 0 or self.evaluates(step) or self.ends(step, stopping)

    def checkpoints(self, step: int, stopping: bool) -> bool:
        """A checkpoint after `step`: on schedule, at the end or at a stop."""
        return step % self.checkpoint_every == 0 or self.ends(step, stopping)


class TrainMeter:
    """The mean loss and the step time of the steps since the last train record: the time from the
    end of one sync point to the next, summed over the sync points between two records (a sync
    point's own work, an evaluation or a checkpoint, is not step time)."""

    def __init__(self, record_step: int, clock: Callable[[], float] = time.perf_counter):
        self.loss_sum, self.steps, self.step_s, self.record_step = 0.0, 0, 0.0, record_step
        self.clock = clock
        self.t0 = clock()

    def add(self, mean_loss_sum: float, steps: int) -> None:
        """At a sync point: its loss (summed over its steps, averaged over replicas), its step count,
        and the time since the last one ended."""
        self.step_s += self.clock() - self.t0
        self.loss_sum += mean_loss_sum
        self.steps += steps

    def restart_clock(self) -> None:
        """Steps run from now on (at the end of a sync point, or the start of training)."""
        self.t0 = self.clock()

    def record(self, step: int, total: int, tokens: int, replica, devices: list[torch.device]) -> dict:
        """The train record of the steps up to `step`; the meter starts over."""
        elapsed = max(self.step_s, 1e-9)
        steps = max(self.steps, 1)
        record = {
            "event": "train",
            "step": step,
            "total_steps": total,
            "loss": self.loss_sum / steps,
            "acceptance_length": None,
            "lr": replica.last_lr,
            "grad_norm": float(replica.last_grad_norm),
            "tokens_per_s": tokens / elapsed,
            "step_time_s": elapsed / steps,
            "gpu_mem_gb": gpu_mem_gb(devices),
            "train_acceptance_length": float(replica.last_acceptance),
        }
        self.loss_sum, self.steps, self.step_s, self.record_step = 0.0, 0, 0.0, step
        return record


def train_line(record: dict) -> str:
    """The log line of a train record."""
    return (
        f"step {record['step']}/{record['total_steps']} loss {record['loss']:.4f} lr {record['lr']:.2e} "
        f"gnorm {record['grad_norm']:.3f} {record['tokens_per_s']:.0f} tok/s (all GPUs) "
        f"{record['step_time_s'] * 1000:.1f} ms/step"
    )


def gpu_mem_gb(devices: list[torch.device]) -> float | None:
    """Peak allocated memory of the most loaded worker GPU (None on CPU)."""
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
    if not cuda:
        return None
    return round(max(torch.cuda.max_memory_allocated(d) for d in cuda) / 2**30, 3)


class MetricsLog:
    """Appends JSON lines to <out>/metrics.jsonl."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            # Drop what the interrupted run logged after its last checkpoint.
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        """Append one record."""
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
