"""`run.tensorboard`: the training log's scalars, as they go to metrics.jsonl, also written as
TensorBoard events under `<output_dir>/tensorboard` (docs/trainer.md#tensorboard-runtensorboard)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

# metrics.jsonl key -> TensorBoard tag, by record event. "teacher_forced" is the proxy (true
# context, random anchors); "spec_tau" the real draft-and-verify figure, in both averages.
TRAIN_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "train_acceptance_length": "train/acceptance_length_teacher_forced",
}
EVAL_TAGS = {
    "loss": "eval/loss",
    "acceptance_length": "eval/acceptance_length_teacher_forced",
    "spec_tau_prompt_mean": "eval/spec_tau_prompt_mean",
    "spec_tau": "eval/spec_tau_pooled",
}
TAGS = {"train": TRAIN_TAGS, "eval": EVAL_TAGS, "final": EVAL_TAGS}
SUBDIR = "tensorboard"


class Records(Protocol):
    """Where the trainer sends its metric records (metrics.MetricsLog)."""

    def write(self, record: dict) -> None: ...


def require() -> None:
    """Import the tensorboard package now, so that a run without it stops at the pre-flight
    (ModuleNotFoundError naming it) rather than after the model is built."""
    import tensorboard  # noqa: F401


class TensorBoardRecords:
    """Passes each record on, then writes its scalars as events at the record's step."""

    def __init__(self, records: Records, logdir: Path, resume_step: int | None):
        require()
        from torch.utils.tensorboard import SummaryWriter

        self.records = records
        # On --resume, events past the checkpoint (from the interrupted run) are dropped, as
        # MetricsLog drops their lines.
        self.writer = SummaryWriter(str(logdir), purge_step=None if resume_step is None else resume_step + 1)

    def write(self, record: dict) -> None:
        """Record to metrics.jsonl, scalars to the event file (flushed: a live TensorBoard sees them)."""
        self.records.write(record)
        for key, tag in TAGS.get(record.get("event", ""), {}).items():
            if record.get(key) is not None:
                self.writer.add_scalar(tag, float(record[key]), record["step"])
        self.writer.flush()


def with_tensorboard(records: Records, on: bool, out: Path, resume_step: int | None) -> Records:
    """`records` itself, or with `run.tensorboard` on, records that also go to TensorBoard."""
    return TensorBoardRecords(records, out / SUBDIR, resume_step) if on else records
