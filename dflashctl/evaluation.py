"""`dflashctl eval`: a run's exported drafter against its target by real speculative decoding,
in the container (the payload's `dflash_train/evaluate.py`); this side resolves the run, pushes
the payload, sends the prompts and renders the report. docs/eval.md."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.text import Text

from .containers import LineSplitter, Target
from .errors import ContainerError, RemoteError, UsageError
from .devices import CPU, parse_gpus
from .figures import prompts_text
from .runs import show_run

# Runs the payload's evaluator from wherever push put it: argv[1] is that directory.
BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from dflash_train.evaluate import main; sys.exit(main(sys.argv[1:]))"
)
PROGRESS_PREFIX = "eval: "
USAGE_PREFIX = "eval error: "
MISSING_PREFIX = "eval missing module: "
NO_EXPORT = "no export in "  # how the evaluator's refusal of a run without an export begins
TIME_LIMIT_S = 3600  # a long decode on a slow box: a backstop, not an estimate


def report_name(prompts: Path | None) -> str:
    """The report's file in the run directory: eval.json for the run's own prompts (what `runs list`,
    `runs show` and the model card read), eval-<stem>.json beside it for `--prompts FILE`."""
    if prompts is None:
        return "eval.json"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", prompts.stem).strip("._")[:80]
    return f"eval-{stem or 'prompts'}.json"


def eval_device(gpus: str | None) -> str | None:
    """`--gpus N` (or cpu) as the one device the evaluation runs on; None: the run's own."""
    if gpus is None:
        return None
    choice = parse_gpus(gpus)
    if choice.cpu:
        return CPU
    if len(choice.indices) != 1:
        raise UsageError(f"--gpus {gpus}: eval runs on one GPU (the loop decodes one prompt at a time)")
    return f"cuda:{choice.indices[0]}"


def run_eval(
    target: Target,
    selector: str | None,
    prompts: Path | None,
    max_new_tokens: int,
    count: int,
    temperature: float = 0.0,
    progress: Callable[[str], None] | None = None,
    gpus: str | None = None,
    baseline: bool = True,
) -> dict[str, Any]:
    """Evaluate the run (latest when selector is empty) on its host; the report (eval.json's content)."""
    from .guard import run_guarded
    from .payload import push

    device = eval_device(gpus)
    if max_new_tokens < 1 or count < 1:
        raise UsageError("--max-new-tokens and --count must be at least 1")
    if not 0 <= temperature < float("inf"):
        raise UsageError(f"--temperature must be 0 (greedy) or positive, got {temperature:g}")
    stdin = None
    if prompts is not None:
        try:
            stdin = prompts.read_bytes()
        except OSError as exc:
            raise UsageError(f"--prompts {prompts}: {exc.strerror}") from None
    info = show_run(target, selector, metrics=False)
    payload_dir = push(target).remote_dir
    argv = [
        target.host.interpreter,
        "-c",
        BOOTSTRAP,
        payload_dir,
        info["run_dir"],
        "--max-new-tokens",
        str(max_new_tokens),
        "--count",
        str(count),
        "--temperature",
        repr(temperature),
        *(["--prompts", "-", "--prompts-name", prompts.name] if prompts is not None else []),
        *(["--device", device] if device else []),
        *([] if baseline else ["--no-baseline"]),
        "--report",
        report_name(prompts),
    ]
    lines = LineSplitter(progress, PROGRESS_PREFIX)
    # Guarded: over SSH a Ctrl-C would leave the decode running on the host (holding its GPU).
    result = run_guarded(target, argv, stdin=stdin, timeout=TIME_LIMIT_S, on_stderr=lines.feed)
    if result.exit_code == 2 and lines.last.startswith(USAGE_PREFIX + NO_EXPORT):
        raise UsageError(f"{target.label}: run {info['run_id']} {no_export_reason(info)}")
    if result.exit_code == 2 and lines.last.startswith(USAGE_PREFIX):
        raise UsageError(f"{target.label}: run {info['run_id']}: {lines.last.removeprefix(USAGE_PREFIX)}")
    if result.exit_code == 4 and lines.last.startswith(MISSING_PREFIX):
        module = lines.last.removeprefix(MISSING_PREFIX)
        raise ContainerError(f"{target.label}: {module} is not installed for {target.host.interpreter}")
    try:
        report = json.loads(result.text().strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RemoteError(
            f"{target.label}: eval gave no report (exit {result.exit_code}): {lines.last or 'no output'}"
        ) from None
    report["run_id"] = info["run_id"]
    report["report_file"] = f"{info['run_dir']}/{report_name(prompts)}"
    return report


def no_export_reason(info: dict[str, Any]) -> str:
    """Why a run has no export, by its state (docs/runs.md), as the rest of a line after `run ID`."""
    state = info.get("state")
    ended = {
        "failed": f"failed (exit code {info.get('exit_code')})",
        "stopped": "was stopped",
        "lost": "was lost (it ended with no exit code recorded)",
    }
    if state in ended:
        return f"{ended[state]} before its last step: it has no export"
    if state == "succeeded":
        return f"succeeded but has no export: {info.get('run_dir')}/export has no model.safetensors"
    return f"is {state}: it has no export yet (one is written at its last step)"  # queued or running


def render(report: dict[str, Any], console: Console) -> None:
    """The figures a user came for, one per line."""
    by_position = "  ".join(f"{i}: {a:.2f}" for i, a in enumerate(report["acceptance_by_position"], 1))
    greedy = report["temperature"] == 0
    how = "greedy" if greedy else f"sampled at temperature {report['temperature']:g}"
    lines = [
        f"run {report['run_id']}: {report['prompts']} prompts x up to {report['max_new_tokens']} new tokens, "
        f"{how}, on {report['device']}",
        *([f"prompts: {source}"] if (source := prompts_text(report.get("prompts_source"), 64)) else []),
        f"speculative tau: {report['tau_prompt_mean']:.3f} mean of per-prompt tau (z-lab's benchmark.py), "
        f"{report['tau']:.3f} pooled over all verify steps (SpecForge): tokens per verify step "
        f"(block {report['block_size']}, bonus token included)",
        f"acceptance by draft position: {by_position}",
        f"target alone {report['target_ms_per_token']:.2f} ms/token, speculative {report['spec_ms_per_token']:.2f} "
        f"ms/token: speedup {report['speedup']:.2f}x",
        f"one verify step (draft, verify, accept) costs {report['spec_ms_per_step']:.2f} ms = "
        f"{report['step_cost']:.2f} target decode steps (speedup = tau / that)",
        f"wrote {report['report_file']}",
    ]
    if greedy:
        same = sum(r["identical"] for r in report["per_prompt"])
        verdict = (
            "yes"
            if report["identical"]
            else "no, at numerical ties only"
            if report.get("differences_are_ties")
            else "NO"
        )
        lines.insert(
            -1, f"output identical to the target's own greedy decode: {verdict} ({same}/{report['prompts']} prompts)"
        )
        gaps = [r["first_difference"]["logit_gap"] for r in report["per_prompt"] if r.get("first_difference")]
        known = [g for g in gaps if g is not None]
        if known:
            why = " (ties: a block and a one-token forward round differently)" if verdict != "NO" else ""
            lines.insert(
                -1, f"where they part, the target's two candidates are at most {max(known):.3g} logits apart{why}"
            )
    lines[-1:-1] = baseline_lines(report)
    for line in lines:
        console.print(Text(line), soft_wrap=True, highlight=False)


def baseline_lines(report: dict[str, Any]) -> list[str]:
    """The prompt-lookup baseline's figures and the drafter's ratios to them (none if it was off)."""
    free = report.get("baseline")
    if free is None:
        return ["prompt lookup baseline: measured greedy only (--temperature 0)"] if report["temperature"] else []
    same = sum(r["identical"] for r in free["per_prompt"])
    verdict = "yes" if free["identical"] else "no, at numerical ties only" if free["differences_are_ties"] else "NO"
    ratio = report["drafter_vs_baseline"]
    return [
        f"prompt lookup (the free baseline: {free['num_tokens']} tokens copied from where the last "
        f"{free['max_ngram']}..1 tokens last occurred): tau {free['tau_prompt_mean']:.3f} mean per prompt, "
        f"{free['tau']:.3f} pooled; {free['ms_per_token']:.2f} ms/token, speedup {free['speedup']:.2f}x; "
        f"output identical: {verdict} ({same}/{len(free['per_prompt'])} prompts)",
        f"drafter / prompt lookup: tau {ratio['tau_prompt_mean']:.2f}x (mean per prompt), {ratio['tau']:.2f}x "
        f"(pooled), speedup {ratio['speedup']:.2f}x",
    ]
