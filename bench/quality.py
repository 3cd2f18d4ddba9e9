"""Drafter quality against training time, through the whole user path as whole processes (issue 26).

    python3 bench/quality.py --out $OUT                         # one GPU: points at 1, 2, 4 training minutes
    python3 bench/quality.py --out $OUT --minutes 2,5,10 --target /tmp/qwen3-py
    python3 bench/quality.py --out $OUT --recipe 'deep drafter.num_layers=5' --recipe 'b8 drafter.block_size=8'
    python3 bench/quality.py --dry-run --out /tmp/q             # CPU, tiny sizes: checks the script

The whole GPU bench (3.5-minute build, regeneration of 16,384 prompts x 256 tokens, a calibration
compile, the points and their evaluations) outgrows one 10-minute device call: split it, e.g.
`python3 bench/build_target.py --out /tmp/qwen3-py` in one call, then `bench/quality.py --target
/tmp/qwen3-py --work /tmp/qb --minutes 1,2` and `--target /tmp/qwen3-py --work /tmp/qb --reuse
--minutes 4` (the regenerated data and the compile cache stay) in the next ones, on the same
warm machine. Without --work each call gets a fresh directory under the temp dir.

Steps, each a `dflashctl` process against an inventory with the `local` host (no SSH):
  build      bench/build_target.py: a Qwen3 target trained on the machine's Python source
             (skipped when --target names a directory that already holds one)
  push       `data push local train-prompts.jsonl` (the build's `{"prompt"}` rows)
  regen      `data regen local --prompts ... --set target.path=DIR`: the target's own continuations
  calibrate  per recipe, a short `train local` whose ms/step turns each --minutes point into steps
             (it also warms the compile cache for the runs after it)
  points     per recipe and point, `train local --set target.path=DIR --set data.source=jsonl
             --set data.train_path=data:... RECIPE --set run.steps=N --follow`, then `eval local RUN
             --prompts heldout-prompts.jsonl --json` (prompts from packages the target never saw);
             prompt lookup is decoded by the call's first eval only (`--no-baseline` after it: it
             does not depend on the drafter)
With --resumable (and --work), a run longer than the call is stopped near the call's end (the
trainer checkpoints) and recorded in --work/points.json; the next call with --reuse --resumable
resumes it (`train local --resume RUN --follow`) before anything else and scores it once it ends
(a 10-GPU-minute point over two or three 10-minute device calls); points scored by an earlier call
are not trained again, and their rows come back into the table.
Runs train one at a time: on one H200, three runs side by side stepped at 77 ms each against
23.7 ms alone (0.92x the throughput), so a --parallel mode was measured and removed (docs/quality.md).
A point's training minutes are the run's measured step time (its metrics' step_time_s x steps:
compile, evaluations and checkpoints left out), one full schedule per point (warm-up, cosine
decay), as a user training for that long would run it. Prints a table of minutes vs tau, speedup,
the prompt-lookup baseline from eval.json (`-` until `dflashctl eval` reports one), held-out loss;
writes quality.json and quality.log under --out. Results: docs/quality.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from userpath import ROOT, LocalHostBench

REGEN_NAME = "quality-regen"
# The product's own defaults for this target (the real-target preset: no overrides).
DEFAULT_RECIPE = "default"
# What a run with target.path trained before the recipe followed the target (the tiny preset).
OLD_DEFAULTS = (
    "old-defaults drafter.num_layers=1 drafter.block_size=8 data.max_length=64 data.anchors_per_seq=8 "
    "data.batch_size=8 optim.lr=2e-3 run.spec_prompts=16 run.spec_new_tokens=64"
)
# A `train` start's line on stderr (`started run ID on local, ...`, or `resumed run ID ...`).
RUN_STARTED = re.compile(r"(?:started|resumed) run (\S+)")
# A point's time beside its steps: start-up and compile (a warm cache), evaluations, export, `eval`.
POINT_OVERHEAD_S = 150.0
# --resumable: runs stopped at the end of a call, resumed by the next (`--reuse`) call, in --work.
POINTS = "points.json"
DRY_RECIPE = (
    "tiny drafter.num_layers=1 drafter.block_size=8 data.max_length=160 data.anchors_per_seq=16 data.batch_size=8"
)


@dataclass(frozen=True)
class Plan:
    """The sizes of one bench run: the GPU bench or the CPU dry run."""

    build: tuple[str, ...]  # bench/build_target.py options
    regen_new_tokens: int
    regen_batch: int
    eval_count: int
    eval_new_tokens: int
    calibrate_steps: int
    minutes: str
    gpus: tuple[str, ...]  # --gpus for train, regen and eval
    # --resumable: budget kept for `runs stop` after a follow (the trainer writes its checkpoint),
    # and the least budget a run is started or resumed with: the margin, a start-up (77-138 s to the
    # first step on the GPU, 65,536 rows and a cold compile; session 15 started one with 129 s left,
    # stopped it in its compile and paid that compile again) and a minute of steps.
    stop_margin_s: float = 60.0
    min_start_s: float = 240.0


GPU = Plan(
    build=("--size", "gpu", "--minutes", "3.5"),
    regen_new_tokens=256,
    regen_batch=256,
    eval_count=64,
    eval_new_tokens=128,
    calibrate_steps=300,
    minutes="1,2,4",
    gpus=(),
)
DRY = Plan(
    build=(
        "--size",
        "tiny",
        "--steps",
        "150",
        "--seq-len",
        "128",
        "--batch-size",
        "16",
        "--lr",
        "3e-3",
        "--max-corpus-mb",
        "1",
        "--tokenizer-mb",
        "1",
        "--train-prompts",
        "96",
        "--eval-prompts",
        "8",
        "--prompt-chars",
        "160",
        "--cpu-threads",
        "1",
        "--device",
        "cpu",
    ),
    regen_new_tokens=48,
    regen_batch=32,
    eval_count=8,
    eval_new_tokens=32,
    calibrate_steps=10,
    minutes="0.05,0.1,0.2",
    gpus=("--gpus", "cpu"),
    stop_margin_s=10.0,
    min_start_s=20.0,
)


def fmt(value, spec: str = ".2f") -> str:
    """A figure for the table, `-` when absent."""
    return "-" if value is None else format(value, spec)


class Bench(LocalHostBench):
    """One scratch workdir, its inventory, and the CLI as whole processes."""

    def __init__(self, out: Path, work: Path, plan: Plan, budget_min: float, reuse: bool, curve: bool = False):
        super().__init__(out, work, "quality.log", budget_min * 60, keep=reuse)
        self.plan, self.curve = plan, curve
        # A run's --name must be new on its host: a later --reuse call's runs (its calibration
        # again) get this call's own suffix. The bench finds its runs by id, never by name.
        self.call = time.strftime("%H%M%S")

    def run(self, argv: list[str], what: str, timeout: float) -> tuple[int, str, str, float]:
        """A whole process: (exit code, stdout, stderr, seconds); its output goes to the log."""
        code, out, err, secs = self.process(argv, timeout)
        self.log(f"--- {what}: exit {code} in {secs:.1f} s ---")
        self.log((out + err).rstrip()[-6000:])
        return code, out, err, secs

    def cli(self, *args: str, what: str, timeout: float) -> tuple[int, str, str, float]:
        """`python -m dflashctl ARGS`."""
        return self.run([sys.executable, "-m", "dflashctl", *args], what, timeout)

    def train(
        self, target: Path, recipe: list[str], steps: int, name: str, evals: int = 1, resumable: bool = False
    ) -> tuple[str | None, list[dict], float, bool]:
        """One `train local ... --follow` of `steps` steps, evaluated `evals` times in training:
        (run id or None, its records, CLI seconds, stopped). With `resumable`, a run that would
        outlast the budget is stopped plan.stop_margin_s before its end (the trainer checkpoints on the
        stop) for a later call to resume; else it is stopped when the budget is out, and lost."""
        every = max(1, steps // 20)
        sets = [
            f"target.path={target}",
            "data.source=jsonl",
            f"data.train_path=data:{REGEN_NAME}.jsonl",
            *recipe,
            f"run.steps={steps}",
            f"run.log_every={every}",
            f"run.eval_every={max(1, -(-steps // evals))}",  # rounded up: the last falls on the final evaluation
            f"run.checkpoint_every={steps}",
        ]
        if self.curve:  # each in-training evaluation decodes eval's prompts: tau against minutes from one run
            sets += [
                f"data.spec_prompts_path={target / 'heldout-prompts.jsonl'}",
                f"run.spec_prompts={self.plan.eval_count}",
                f"run.spec_new_tokens={self.plan.eval_new_tokens}",
            ]
        argv = [*self.plan.gpus, *[a for s in sets for a in ("--set", s)], "--name", f"{name}-{self.call}"]
        return self.follow(argv, name, resumable)

    def resume(self, run_id: str, name: str) -> tuple[str | None, list[dict], float, bool]:
        """`train local --resume RUN --follow`: a run an earlier call stopped, from its checkpoint."""
        return self.follow(["--resume", run_id], name, resumable=True)

    def follow(self, argv: list[str], name: str, resumable: bool) -> tuple[str | None, list[dict], float, bool]:
        """`train local ARGV --follow` within the budget; see train()."""
        margin = self.plan.stop_margin_s if resumable else 0.0
        code, out, err, secs = self.cli(
            "train", "local", *argv, "--follow", what=f"train {name}", timeout=max(5.0, self.left(1800) - margin)
        )
        found = RUN_STARTED.search(err)
        run_id = found.group(1) if found else None
        stopped = code == 124 and run_id is not None
        if stopped:  # `--follow` cut by the budget, the run detached: stop it (a checkpoint) and free the GPU
            self.cli("runs", "stop", "local", run_id, what=f"stop {run_id}", timeout=120)
        if run_id is None or (code != 0 and not (stopped and resumable)):
            return None, [], secs, False
        return run_id, self.records(run_id), secs, stopped


def train_seconds(records: list[dict], upto: int | None = None) -> float:
    """Seconds spent in training steps (up to step `upto`): each train record's step time x the steps
    since the last."""
    total, last = 0.0, 0
    for r in records:
        if r.get("event") == "train" and r["step"] > last and (upto is None or r["step"] <= upto):
            total += r["step_time_s"] * (r["step"] - last)  # a resumed run's log repeats no step
            last = r["step"]
    return total


def steady_step_s(records: list[dict]) -> float | None:
    """The median step time after the first logged interval (which holds the first steps' work)."""
    times = [r["step_time_s"] for r in records if r.get("event") == "train"][1:]
    return statistics.median(times) if times else None


def parse_recipes(given: list[str]) -> tuple[list[tuple[str, list[str]]], dict[str, set[int]]]:
    """`--recipe 'NAME[@STEPS,...] key=v key=v'` values as (name, overrides), and the --steps
    points each pinned recipe trains (a recipe without @ trains them all)."""
    recipes, pinned = [], {}
    for text in given:
        head, *sets = text.split()
        name, _, at = head.partition("@")
        bad = [s for s in sets if "=" not in s]
        if bad or not name or "=" in name or (at and not re.fullmatch(r"\d+(,\d+)*", at)):
            raise SystemExit(f"--recipe {text!r}: expected 'NAME[@STEPS,...] key=value ...'")
        recipes.append((name, sets))
        if at:
            pinned[name] = {int(n) for n in at.split(",")}
    return recipes, pinned


class Scorer:
    """A finished run's row: its training figures, then `dflashctl eval` on the held-out prompts
    beside the prompt-lookup baseline (decoded by the call's first eval only: it does not depend on
    the drafter, so the later rows show that eval's, labelled so)."""

    def __init__(self, bench: Bench, plan: Plan, target: Path, agreement: bool):
        self.bench, self.plan, self.target, self.agreement = bench, plan, target, agreement
        self.baseline: dict | None = None

    def score(self, row: dict, records: list[dict], cli_s: float, last: bool) -> bool:
        """Fill `row` (logged as a ROW line); True if the run or its eval failed."""
        row["cli_s"] = round(cli_s, 1)
        final = next((r for r in records if r.get("event") == "final"), None)
        if row.get("run") is None or final is None:
            self.bench.log("ROW " + json.dumps(row))
            return True
        row.update(
            train_min=round(train_seconds(records) / 60, 2),
            held_out_loss=final.get("loss"),
            teacher_forced=final.get("acceptance_length"),
            in_training_tau=final.get("spec_tau"),
            in_training_tau_mean=final.get("spec_tau_prompt_mean"),
            in_training_tau_se=final.get("spec_tau_prompt_se"),
            in_training_split=self.in_training_split(row["run"]),
            spec_eval_s=final.get("spec_eval_s"),
            in_training=[
                {
                    **{k: r.get(k) for k in ("step", "loss", "spec_tau_prompt_mean", "spec_tau")},
                    "train_min": round(train_seconds(records, r["step"]) / 60, 2),
                }
                for r in records
                if r.get("event") in ("eval", "final") and r.get("step")
            ],
        )
        failed = self.evaluate(row)
        if self.agreement and last:
            failed |= self.agree(row)
        self.bench.log("ROW " + json.dumps(row))
        return failed

    def eval_json(self, run_id: str, args: list[str], what: str, timeout: float) -> tuple[int, dict]:
        """`eval local RUN ARGS --json`: (exit code, its report, {} when it printed none)."""
        code, text, _, _ = self.bench.cli(
            "eval", "local", run_id, *args, *self.plan.gpus, "--json", what=what, timeout=self.bench.left(timeout)
        )
        try:
            return code, json.loads(text)
        except ValueError:
            return code, {}

    def evaluate(self, row: dict) -> bool:
        """`eval local RUN --prompts heldout-prompts.jsonl`: tau, speedup and the baseline into row."""
        plan, run_id = self.plan, row["run"]
        args = ["--prompts", str(self.target / "heldout-prompts.jsonl"), "--max-new-tokens", str(plan.eval_new_tokens)]
        args += ["--count", str(plan.eval_count), *(["--no-baseline"] if self.baseline else [])]
        code, report = self.eval_json(run_id, args, f"eval {run_id}", 900)
        if self.baseline is None and isinstance(report.get("baseline"), dict):
            self.baseline = {**report["baseline"], "from_run": run_id}
        lookup = self.baseline or {}
        row.update(
            tau_mean=report.get("tau_prompt_mean"),
            tau=report.get("tau"),
            speedup=report.get("speedup"),
            step_cost=report.get("step_cost"),
            identical=report.get("identical"),
            differences_are_ties=report.get("differences_are_ties"),
            lookup_tau_mean=lookup.get("tau_prompt_mean"),
            lookup_tau=lookup.get("tau"),
            lookup_speedup=lookup.get("speedup"),
            lookup_from_run=lookup.get("from_run"),
            tau_over_lookup=(report["tau"] / lookup["tau"]) if lookup.get("tau") and report.get("tau") else None,
            eval_exit=code,
        )
        return code != 0 or not report

    def in_training_split(self, run_id: str) -> str:
        """What the run's in-training tau decoded: `--curve` runs decode eval's prompts, the others
        the trainer's own (fewer and shorter), so the two figures compare only within a kind."""
        cfg = self.bench.run_config(run_id)
        whose = "eval's prompts" if cfg["data"].get("spec_prompts_path") else "the run's held-out split"
        return f"{cfg['run']['spec_prompts']} x {cfg['run']['spec_new_tokens']} tokens, {whose}"

    def agree(self, row: dict) -> bool:
        """`eval` on the run's own held-out split with the trainer's prompt count and length."""
        run_id = row["run"]
        spec = self.bench.run_config(run_id)["run"]
        args = ["--max-new-tokens", str(spec["spec_new_tokens"]), "--count", str(spec["spec_prompts"]), "--no-baseline"]
        code, same = self.eval_json(run_id, args, f"eval {run_id} (the trainer's held-out split)", 600)
        row.update(agreement_eval_tau_mean=same.get("tau_prompt_mean"), agreement_eval_tau=same.get("tau"))
        return code != 0 or not same


def report_lines(rows: list[dict], curve: bool) -> list[str]:
    """The bench's tables: one row per run; with `curve`, tau at each in-training evaluation, and
    every recipe's tau at the first recipe's evaluation minutes (per GPU-minute, not per step)."""
    head = (
        "recipe",
        "steps",
        "train min",
        "tau mean/pooled",
        "speedup",
        "lookup tau mean/pooled",
        "lookup speedup",
        "tau/lookup",
        "held-out loss",
        "tf accept",
        "in-training tau mean +- se",
        "eval on that split",
    )
    lines = ["", " | ".join(head)]
    for r in rows:
        lines.append(
            " | ".join(
                [
                    r["recipe"] + (" (stopped: the next call resumes it)" if r.get("pending") else ""),
                    str(r["steps"]),
                    fmt(r.get("train_min")),
                    f"{fmt(r.get('tau_mean'))}/{fmt(r.get('tau'))}",
                    fmt(r.get("speedup")),
                    f"{fmt(r.get('lookup_tau_mean'))}/{fmt(r.get('lookup_tau'))}",
                    fmt(r.get("lookup_speedup")),
                    fmt(r.get("tau_over_lookup")),
                    fmt(r.get("held_out_loss"), ".3f"),
                    fmt(r.get("teacher_forced"), ".2f"),
                    f"{fmt(r.get('in_training_tau_mean'))} +- {fmt(r.get('in_training_tau_se'))}"
                    + (f" ({r['in_training_split']})" if r.get("in_training_split") else ""),
                    fmt(r.get("agreement_eval_tau_mean")),
                ]
            )
        )
    if not curve:
        return lines
    lines += [
        "",
        "recipe | run steps | step | train min | tau mean/pooled (in training, eval's prompts) | held-out loss",
    ]
    for r in rows:
        for e in r.get("in_training") or []:
            lines.append(
                f"{r['recipe']} | {r['steps']} | {e['step']} | {fmt(e.get('train_min'))} | "
                f"{fmt(e.get('spec_tau_prompt_mean'))}/{fmt(e.get('spec_tau'))} | {fmt(e.get('loss'), '.3f')}"
            )
    return lines + equal_minutes_lines(rows)


def tau_at(points: list[tuple[float, float]], minute: float) -> float | None:
    """A run's tau at `minute` of training, linear between its evaluations; None outside them."""
    for (m0, t0), (m1, t1) in zip(points, points[1:]):
        if m0 <= minute <= m1:
            return t0 if m1 == m0 else t0 + (t1 - t0) * (minute - m0) / (m1 - m0)
    return points[0][1] if len(points) == 1 and points[0][0] == minute else None


def equal_minutes_lines(rows: list[dict]) -> list[str]:
    """Each run's in-training tau (pooled, eval's prompts) at the first run's evaluation minutes,
    and its ratio to the first run's: recipes compared per GPU-minute."""
    curves = [
        (r["recipe"], sorted((e["train_min"], e["spec_tau"]) for e in r.get("in_training") or [] if e.get("spec_tau")))
        for r in rows
    ]
    curves = [(name, points) for name, points in curves if points]
    if len(curves) < 2:
        return []
    base_name, base = curves[0]
    marks = [m for m, _ in base]
    lines = ["", f"pooled tau at {base_name}'s evaluation minutes (linear between a run's evaluations; - outside them)"]
    lines.append("recipe | " + " | ".join(f"{m:.2f} min" for m in marks))
    for name, points in curves:
        cells = []
        for m, base_tau in base:
            tau = tau_at(points, m)
            cells.append("-" if tau is None else f"{tau:.2f} ({tau / base_tau:.2f}x)")
        lines.append(f"{name} | " + " | ".join(cells))
    return lines


def train_in_turn(
    bench: Bench,
    scorer: Scorer,
    earlier: list[dict],
    recipes: list[tuple[str, list[str]]],
    fixed_steps: list[int] | None,
    pinned: dict[str, set[int]],
    minutes: list[float],
    target: Path,
    args: argparse.Namespace,
    result: dict,
) -> bool:
    """One run at a time: the runs an earlier call stopped first, then each recipe's points (by
    --steps, or by --minutes through a calibration run), each scored as it ends. True if a run or
    its eval failed."""
    plan, failed = bench.plan, False
    for row in earlier:
        if row.get("pending") and bench.left(1e9) >= plan.min_start_s:
            run_id, records, cli_s, stopped = bench.resume(row["run"], f"{row['recipe']}-{row['steps']}")
            if not stopped:
                del row["pending"]
                failed |= scorer.score(row, records, cli_s, last=True)
        result["rows"].append(row)
    started = {(r["recipe"], r["steps"]) for r in earlier}
    for name, recipe in recipes:
        if fixed_steps:
            points, step_s = [(None, n) for n in fixed_steps if n in pinned.get(name, {n})], None
        else:
            run_id, records, _, _ = bench.train(target, recipe, plan.calibrate_steps, f"calibrate-{name}")
            step_s = steady_step_s(records)
            if step_s is None:
                bench.log(f"calibration of {name} failed: no step times")
                failed = True
                continue
            bench.log(f"{name}: {step_s * 1e3:.2f} ms/step")
            points = [(point, max(2, round(point * 60 / step_s))) for point in minutes]
        for i, (point, steps) in enumerate(points):
            need = steps * step_s + POINT_OVERHEAD_S if step_s else None
            if (name, steps) in started:
                continue
            # a resumable run needs only enough budget to start (and checkpoint); else the whole point
            least = plan.min_start_s if args.resumable else need or 0
            if any(r.get("pending") for r in result["rows"]) or bench.left(1e9) < least:
                bench.log(f"{name}-{steps}: skipped, {bench.left(1e9):.0f} s of --budget-min left (need {least:.0f})")
                continue
            run_id, records, cli_s, stopped = bench.train(
                target, recipe, steps, f"{name}-{steps}", args.evals, args.resumable
            )
            row = {"recipe": name, "minutes": point, "steps": steps, "run": run_id}
            result["rows"].append(row)
            if stopped:
                bench.log(f"{name}-{steps}: stopped at the call's end as {run_id}; the next --reuse call resumes it")
                row["pending"] = True
                continue
            if records:
                step_s = steady_step_s(records) or step_s
            failed |= scorer.score(row, records, cli_s, last=i == len(points) - 1)
    return failed


def main(argv: list[str] | None = None) -> int:
    """Build, push, regenerate, train and evaluate; print the table; 1 if a step failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "quality_out")
    ap.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch workdir, wiped first (default: a new directory under the temp dir)",
    )
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep --work from an earlier call: its target, regenerated data and compile cache",
    )
    ap.add_argument("--rows", type=int, default=None, help="regenerate only the first N training prompts")
    ap.add_argument(
        "--train-prompts",
        type=int,
        default=None,
        help="training prompts the build writes (build_target.py's default 16,384): more fresh rows, fewer epochs",
    )
    ap.add_argument(
        "--regen-batch",
        type=int,
        default=None,
        help="prompts per regeneration batch (GPU default 256; more rows call for larger batches)",
    )
    ap.add_argument(
        "--target",
        type=Path,
        default=None,
        help="the target directory: reused when it holds a build, else built there (default: in --work)",
    )
    ap.add_argument("--minutes", default=None, help="training minutes per point, e.g. 2,5,10 (default 1,2,4)")
    ap.add_argument(
        "--steps",
        default=None,
        help="training steps per point instead of --minutes (no calibration run), e.g. 2500,6000",
    )
    ap.add_argument(
        "--evals",
        type=int,
        default=1,
        help="in-training evaluations per run (held-out split, the trainer's own decode)",
    )
    ap.add_argument(
        "--curve",
        action="store_true",
        help="the in-training evaluations decode eval's held-out prompts (data.spec_prompts_path, eval's "
        "count and length): with --evals K, tau on the goal's prompts at K points of each run",
    )
    ap.add_argument(
        "--agreement",
        action="store_true",
        help="at each recipe's last point, also `eval` the run's held-out split as the trainer did "
        "(its spec_prompts x spec_new_tokens): in-training tau against eval's",
    )
    ap.add_argument(
        "--recipe",
        action="append",
        default=[],
        help="'NAME key=value ...' trainer overrides of one recipe (repeatable: each is trained at every point; "
        "'NAME@13620 ...' only at those --steps points)",
    )
    ap.add_argument(
        "--old-defaults",
        action="store_true",
        help="also train what target.path got before the recipe followed the target (the tiny recipe)",
    )
    ap.add_argument("--set", dest="sets", action="append", default=[], help="key=value for every recipe's runs")
    ap.add_argument("--budget-min", type=float, default=60.0, help="stop starting steps after this many minutes")
    ap.add_argument(
        "--resumable",
        action="store_true",
        help="runs longer than one call: a run the budget would cut is stopped with a checkpoint and "
        f"recorded in --work/{POINTS}; the next call with --reuse --resumable resumes it before anything else",
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: check the script itself")
    ap.add_argument("--report", type=Path, help="print the tables of an earlier call's quality.json, run nothing")
    args = ap.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        print("\n".join(report_lines(saved["rows"], saved.get("curve", False))))
        return 0
    plan = DRY if args.dry_run else GPU
    if args.regen_batch:
        plan = dataclasses.replace(plan, regen_batch=args.regen_batch)
    if (args.reuse or args.resumable) and args.work is None:
        raise SystemExit("--reuse and --resumable need --work: the workdir kept between calls")
    try:
        minutes = [float(m) for m in (args.minutes or plan.minutes).split(",") if m.strip()]
    except ValueError:
        raise SystemExit(f"--minutes {args.minutes!r}: expected numbers separated by commas, e.g. 1,2,4") from None
    if not minutes or min(minutes) <= 0:
        raise SystemExit(f"--minutes {args.minutes!r}: expected positive numbers, e.g. 1,2,4")
    given = args.recipe or [DRY_RECIPE if args.dry_run else DEFAULT_RECIPE]
    parsed, pinned = parse_recipes(given + [OLD_DEFAULTS] * args.old_defaults)
    fixed_steps = [int(n) for n in args.steps.split(",")] if args.steps else None
    points = set(fixed_steps or [])
    stray = {name: sorted(at - points) for name, at in pinned.items() if not at <= points}
    if stray:
        raise SystemExit(f"--recipe NAME@STEPS picks among --steps {args.steps or '(none given)'}: not {stray}")
    recipes = [(name, sets + args.sets) for name, sets in parsed]
    # A fresh directory by default: two benches on one machine must not wipe each other's.
    # Absolute: the build and the CLI run with the workdir as their current directory.
    out = Path(args.out).resolve()
    work = (args.work or Path(tempfile.mkdtemp(prefix="dflash-quality-"))).resolve()
    target = (args.target or work / "target").resolve()
    if args.reuse and not (target / "build.json").is_file():
        # A device machine released between calls comes back bare: building again would spend ~6
        # minutes of the call on what the caller meant to reuse (session 19 lost two calls so).
        raise SystemExit(
            f"--reuse: {target} holds no build from an earlier call (a machine released between calls "
            "starts bare); run without --reuse to build and regenerate again"
        )
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(out, work, plan, args.budget_min, args.reuse, args.curve)
    result: dict = {
        "minutes": minutes,
        "recipes": dict(recipes),
        "plan": plan.__dict__,
        "curve": args.curve,
        "rows": [],
    }

    def finish(code: int) -> int:
        (out / "quality.json").write_text(json.dumps(result, indent=1) + "\n")
        return code

    more_prompts = ["--train-prompts", str(args.train_prompts)] if args.train_prompts else []
    if (target / "build.json").is_file():
        bench.log(f"reusing the target in {target}")
    else:
        code, *_ = bench.run(
            [sys.executable, str(ROOT / "bench" / "build_target.py"), "--out", str(target), *plan.build, *more_prompts],
            "build",
            timeout=bench.left(900),
        )
        if code != 0:
            return finish(1)
    result["build"] = json.loads((target / "build.json").read_text())
    if (work / "dflashctl" / "data" / f"{REGEN_NAME}.jsonl").is_file():
        bench.log(f"reusing the regenerated dataset {REGEN_NAME}.jsonl in {work}")
    else:
        prompts = work / "quality-prompts.jsonl"
        prompts.write_text("".join((target / "train-prompts.jsonl").read_text().splitlines(True)[: args.rows]))
        code, *_ = bench.cli("data", "push", "local", str(prompts), what="push", timeout=bench.left(300))
        if code != 0:
            return finish(1)
        code, _, _, secs = bench.cli(
            "data",
            "regen",
            "local",
            "--prompts",
            prompts.name,
            "--out",
            REGEN_NAME,
            "--set",
            f"target.path={target}",
            "--max-new-tokens",
            str(plan.regen_new_tokens),
            "--batch-size",
            str(plan.regen_batch),
            *plan.gpus,
            "--follow",
            what="regen",
            timeout=bench.left(1800),
        )
        result["regen_s"] = round(secs, 1)
        if code != 0:
            return finish(1)

    failed = False
    scorer = Scorer(bench, plan, target, args.agreement)
    points_path = work / POINTS
    # --resumable: every point an earlier call started. Stopped ones are resumed first and scored once
    # they end; scored ones are not trained again (their rows come back into this call's table).
    earlier = json.loads(points_path.read_text()) if args.resumable and points_path.is_file() else []
    failed |= train_in_turn(bench, scorer, earlier, recipes, fixed_steps, pinned, minutes, target, args, result)
    if args.resumable:
        points_path.write_text(json.dumps(result["rows"], indent=1) + "\n")

    for line in report_lines(result["rows"], args.curve):
        bench.log(line)
    return finish(1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
