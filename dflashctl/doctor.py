"""`dflashctl doctor HOST`: push the payload, run its doctor inside the container, render the report.

The checks themselves live in the payload (`remote_payload/dflash_train/doctor.py`) because the
smoke tests need the trainer's own step and the container's torch. This side only ships the
payload, starts `report`, streams its progress lines, and turns its JSON into a table.
Report format and exit codes: docs/doctor.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Callable

from rich.console import Console
from rich.text import Text

from .containers import LineSplitter, Target
from .devices import parse_gpus
from .errors import ContainerError, RemoteError, UsageError
from .remote.wire import COMPILE_CACHE, WORKDIR_TOKEN
from .tables import Column, notes, show

SCHEMA = "dflashctl.doctor/1"
# Runs the payload's doctor from wherever push put it: argv[1] is that directory.
BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from dflash_train.doctor import main; sys.exit(main(sys.argv[1:]))"
)
PROGRESS_PREFIX = "doctor: "
USAGE_PREFIX = "doctor usage error: "  # not a progress line: the error is shown once, by the CLI
MISSING_PREFIX = "doctor missing module: "
EXIT_MISSING = 4  # the container lacks torch: the same exit code and words as `inspect`
STARTUP_ALLOWANCE_S = 180  # imports, environment checks and a cold push, on top of the smoke limits
SMOKE_POLICIES = 4
STATUS_STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "n/a": "dim", "skipped": "dim"}


@dataclass(frozen=True)
class DoctorOptions:
    """What the user asked `dflashctl doctor` for; passed through to the container side."""

    quick: bool = False
    gpus: str | None = None
    policies: str | None = None
    smoke_timeout: float = 120.0
    steps: int = 0
    inject: str | None = None
    jobs: int | None = None  # smoke tests at once; None: the container side's default (one per 4 CPUs)

    def argv(self) -> list[str]:
        """The `report` subcommand's arguments."""
        args = ["report", "--smoke-timeout", str(self.smoke_timeout)]
        if self.quick:
            args.append("--quick")
        for flag, value in (("--gpus", self.gpus), ("--policies", self.policies), ("--inject", self.inject)):
            if value:
                args += [flag, value]
        if self.steps:
            args += ["--steps", str(self.steps)]
        if self.jobs is not None:  # passed even when < 1: the container side rejects it (exit 2)
            args += ["--jobs", str(self.jobs)]
        return args

    def time_limit(self) -> float:
        """How long the whole remote report may take before the client gives up."""
        # + 1: the compile pass (all policies at once) comes before the timed one-by-one pass
        return STARTUP_ALLOWANCE_S + (0 if self.quick else (SMOKE_POLICIES + 1) * (self.smoke_timeout + 5))


def run_doctor(target: Target, options: DoctorOptions, progress: Callable[[str], None] | None = None) -> dict:
    """Push the payload, run the doctor in the container, and return its report (with `host` added)."""
    from .guard import run_guarded
    from .payload import push

    choice = parse_gpus(options.gpus, target.host.gpus)  # a bad --gpus fails before the push
    opts = replace(options, gpus=None if choice.auto else choice.text())
    payload_dir = push(target).remote_dir
    lines = LineSplitter(progress, PROGRESS_PREFIX)
    cache = COMPILE_CACHE.replace(WORKDIR_TOKEN, target.host.workdir)  # the cache dflashctl's runs compile into
    argv = [target.host.interpreter, "-c", BOOTSTRAP, payload_dir, *opts.argv(), "--compile-cache-dir", cache]
    # Guarded: over SSH a Ctrl-C would otherwise leave the report and its smoke tests running on the host.
    result = run_guarded(target, argv, timeout=opts.time_limit(), on_stderr=lines.feed)
    if result.exit_code == 2:
        raise UsageError("doctor: " + (lines.last.removeprefix(USAGE_PREFIX) or "bad arguments"))
    if result.exit_code == EXIT_MISSING and lines.last.startswith(MISSING_PREFIX):
        module = lines.last.removeprefix(MISSING_PREFIX)
        raise ContainerError(f"{target.label}: {module} is not installed for {target.host.interpreter}")
    doc = parse_report(result.stdout)
    if doc is None:
        raise RemoteError(
            f"{target.label}: doctor gave no report (exit {result.exit_code}): {lines.last or 'no output'}"
        )
    doc["host"] = target.host.name
    return doc


def parse_report(stdout: bytes) -> dict | None:
    """The report document from the container's stdout (its last JSON line), or None."""
    for line in reversed(stdout.decode("utf-8", "replace").splitlines()):
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                return None
            return doc if doc.get("schema") == SCHEMA else None
    return None


def render_report(doc: dict, console: Console) -> None:
    """The report: a table of check, status and result (the verdict in its own section), then each
    row's evidence and fix hint below it, whole (tables.py: nothing is folded into a narrow cell)."""
    devices = " + ".join(doc["devices"])
    rows, below, sections = [], [], []
    for row in doc["checks"]:
        verdict = row["id"] == "verdict"
        if verdict:
            sections.append(len(rows))
        rows.append(
            [
                Text(row["check"], style="bold" if verdict else ""),
                Text(row["status"], style=STATUS_STYLES.get(row["status"], "")),
                Text(row["result"], style="bold" if verdict else ""),
            ]
        )
        if row["evidence"] or row["hint"]:
            below.append((row["check"], row["evidence"], row["hint"]))
    show(
        console,
        [Column("check"), Column("status"), Column("result", text=True)],
        rows,
        title=f"doctor {doc.get('host', '')}: torch {doc['torch']}, smoke devices {devices}",
        sections=sections,
    )
    notes(console, below)
    failed = [r["check"] for r in doc["checks"] if r["status"] == "fail"]
    summary = f"{len(failed)} failed: {', '.join(failed)}" if failed else "no failures"
    console.print(Text(f"{summary} ({doc['elapsed_s']} s)", style="red" if failed else "green"))
