"""The user's path as whole processes, for the benches that time it (gpu_acceptance.py,
quality.py): a scratch workdir with an inventory of the `local` host (no `gpus`, as a new user's),
`python -m dflashctl` run against it, a log file beside the printed lines, a time budget."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# The benches import dflashctl from this checkout, as the CLI processes they start do (PYTHONPATH
# below): the GPU machine has a bare copy of the tree, where the package is not installed.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class LocalHostBench:
    """One scratch workdir (wiped first unless `keep`), its inventory, the CLI and a budget. The
    inventory has two names for the machine: `local` (with `fork_server:`) and `plain` (the same
    workdir, no fork server: every run a new process, for a comparison in the same call)."""

    def __init__(self, out: Path, work: Path, logname: str, budget_s: float, keep: bool = False, fork_server: int = 0):
        self.out, self.work = out, work
        self.deadline = time.monotonic() + budget_s
        self.logfile = (out / logname).open("w")
        self.printing = True
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        self.inventory = work / "hosts.yaml"
        host = f"    transport: local\n    workdir: {json.dumps(str(work / 'dflashctl'))}\n"
        self.inventory.write_text(
            # fork_server: none by default; 1800 forks the runs after the first.
            f"default: local\nhosts:\n  local:\n{host}    fork_server: {fork_server}\n"
            f"  plain:\n{host}    fork_server: 0\n"
        )

    def log(self, text: str) -> None:
        """Keep a line, and print it while stdout is open: a reader that went away (a `| grep` that
        exited) must not end a bench mid-run (session 16 lost a build that way)."""
        self.logfile.write(text + "\n")
        self.logfile.flush()
        if self.printing:
            try:
                print(text, flush=True)
            except BrokenPipeError:
                self.printing = False
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process's stdout from here on)

    def left(self, cap: float) -> float:
        """Seconds a step may take: its cap, or what is left of the budget."""
        return max(5.0, min(cap, self.deadline - time.monotonic()))

    def env(self) -> dict[str, str]:
        """This process's environment with the inventory, the checkout and unbuffered output."""
        env = dict(os.environ, DFLASHCTL_INVENTORY=str(self.inventory), PYTHONUNBUFFERED="1", NO_COLOR="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return env

    def process(
        self, argv: list[str], timeout: float, env: dict[str, str] | None = None
    ) -> tuple[int, str, str, float]:
        """A whole process in the workdir (in `env`, default `self.env()`): (exit code, stdout,
        stderr, seconds); 124 on timeout."""
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, env=env or self.env(), cwd=self.work
            )
        except subprocess.TimeoutExpired as exc:
            out, err = (
                text.decode(errors="replace") if isinstance(text, bytes) else (text or "")
                for text in (exc.stdout, exc.stderr)
            )
            # What it printed before the kill stays: a detached run's id is in it (the caller stops it).
            return 124, out, f"{err}timed out after {timeout:.0f} s", time.monotonic() - t0
        return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0

    def run_dir(self, run_id: str) -> Path:
        """A run's directory in the workdir."""
        return self.work / "dflashctl" / "runs" / run_id

    def run_config(self, run_id: str) -> dict:
        """The run's config as the trainer resolved it (config.resolved.yaml)."""
        return yaml.safe_load((self.run_dir(run_id) / "config.resolved.yaml").read_text())

    def records(self, run_id: str) -> list[dict]:
        """The run's metrics.jsonl records (none before it writes any)."""
        path = self.run_dir(run_id) / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def regen_random(self, name: str, dry: bool, timeout: float, batch: int | None = 64, length: int = 128) -> dict:
        """`data push` 4 batches (at least 256 prompts) of `length` random ids, then `data regen
        --preset qwen3-8b --batch-size BATCH --max-new-tokens 512 --follow` into dataset `name` (dry:
        the tiny preset on the CPU, 16 x 16 at batch 4; batch None: no --batch-size, the default a
        user gets, planned as 4 batches of 256 rows): a row with the whole command's and the later
        batches' output tokens/s and the GPU's peak memory."""
        given = batch
        preset, rows, length, new, batch, vocab = (
            ("tiny", 16, 8, 16, 4, 511)
            if dry
            else ("qwen3-8b", max(256, 4 * (batch or 256)), length, 512, batch, 151600)
        )
        prompts = self.work / f"{name}-prompts.jsonl"
        write_random_prompts(prompts, rows, length, vocab)
        cli = [sys.executable, "-m", "dflashctl"]
        code, _, err, _ = self.process([*cli, "data", "push", "local", str(prompts)], self.left(120))
        if code != 0:
            return {"ok": False, "exit": code, "note": f"push: {err.strip()[-300:]}"}
        regen = ["data", "regen", "local", "--prompts", prompts.name, "--out", name, "--preset", preset]
        regen += [*(["--batch-size", str(batch)] if given is not None else []), "--max-new-tokens", str(new)]
        regen += ["--gpus", "cpu"] if dry else []
        code, _, err, secs = self.process([*cli, *regen, "--follow"], self.left(timeout))
        self.log(err[-3000:])
        match = re.search(r"started regen run (\S+)", err)
        if code != 0 or not match:
            return {"ok": False, "exit": code, "note": err.strip()[-300:]}
        records = self.records(match.group(1))
        rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
        tokens = output_tokens(self.work / "dflashctl" / "data" / f"{name}.jsonl")
        return {
            "ok": True,
            "exit": code,
            "preset": preset,
            "rows": rows,
            "prompt_tokens": length,
            "batch": batch if given is not None else "default",
            "max_new_tokens": new,
            "output_tokens": tokens,
            "regen_s": round(secs, 1),
            "whole_command_tokens_per_s": round(tokens / secs, 1),
            "tokens_per_s": rates[-1] if rates else None,  # the last progress record: from the first batch's end
            "gpu_mem_gb": max((r["gpu_mem_gb"] for r in records if r.get("gpu_mem_gb")), default=None),
        }


def write_random_prompts(path: Path, rows: int, length: int, vocab: int) -> None:
    """`rows` jsonl prompts of `length` seeded random token ids below `vocab` (speed, not quality)."""
    rng = random.Random(0)
    path.write_text(
        "".join(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(length)]}) + "\n" for _ in range(rows))
    )


def output_tokens(regenerated: Path) -> int:
    """Tokens the target generated in a `data regen` output file (the rows' unmasked tokens)."""
    return sum(
        len(row["input_ids"]) - sum(1 for m in row["loss_mask"] if not m)
        for row in map(json.loads, regenerated.read_text().splitlines())
    )
