"""What a run asks for in devices: `--gpus` (else hosts.yaml's `gpus`) parsed once, passed down.

The one parser of a GPU choice on the CLI side; the program's pre-flight then says what the run
holds (runctl pins it from that answer), so nothing below re-reads the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import UsageError

CPU = "cpu"  # the "GPU" a run on the CPU holds, so two such runs still conflict


@dataclass(frozen=True)
class GpuChoice:
    """auto (nothing said: the program takes every visible GPU, else the CPU), the CPU, or GPU indices."""

    indices: tuple[int, ...] = ()
    cpu: bool = False

    @property
    def auto(self) -> bool:
        """True when nobody chose: the program decides."""
        return not self.cpu and not self.indices

    def names(self) -> list[str]:
        """What the run is taken to hold before its pre-flight answers: `["0", "1"]`, else `["cpu"]`."""
        return [str(i) for i in self.indices] or [CPU]

    def text(self) -> str:
        """The choice as a program's `--gpus` value: `0,1`, `cpu` or `auto`."""
        return CPU if self.cpu else ",".join(map(str, self.indices)) or "auto"

    def trainer_sets(self) -> list[str]:
        """The trainer's `--set` items for this choice (none for auto: its own resolution decides)."""
        if self.cpu:
            return ["run.device=cpu"]
        if len(self.indices) == 1:
            return [f"run.device=cuda:{self.indices[0]}"]
        return [f"run.gpus=[{','.join(map(str, self.indices))}]"] if self.indices else []


def parse_gpus(text: str | None, host_gpus: Sequence[int] = ()) -> GpuChoice:
    """`--gpus 0,1` or `--gpus cpu`; without the flag, the host's `gpus:` (else auto)."""
    if text is None:
        return GpuChoice(tuple(host_gpus))
    if text.strip().lower() == CPU:
        return GpuChoice(cpu=True)
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() for t in items):
        raise UsageError(f"--gpus must be GPU indices like 0,1 (or cpu), got {text!r}")
    indices = [int(t) for t in items]
    if twice(indices):
        raise UsageError(f"--gpus lists an index twice: {text!r}")
    return GpuChoice(tuple(indices))


def host_gpus(value: object) -> tuple[int, ...] | str:
    """hosts.yaml's `gpus:` (a list of GPU indices; absent or null: none) as indices, or what is
    wrong with it (a message for the inventory's error)."""
    gpus = [] if value is None else value
    if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
        return f"gpus must be a list of GPU indices like [0, 1], got {value!r}"
    if twice(gpus):
        return f"gpus lists an index twice: {value!r}"
    return tuple(gpus)


def twice(indices: Sequence[int]) -> bool:
    """Whether an index is listed more than once."""
    return len(set(indices)) != len(indices)
