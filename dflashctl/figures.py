"""How a run's tau reads: `runs list`'s tau cell, `runs show`'s eval rows and in-training tau, and
the prompts an eval used (docs/eval.md). Two averages of tau differ by up to 2x, so each figure
names its form."""

from __future__ import annotations

from typing import Any, Sequence

from rich.text import Text

from .plot import series


def headline_tau(figures: dict[str, Any], mean_key: str, pooled_key: str) -> float | None:
    """The mean of per-prompt tau (the figure z-lab's benchmark prints), else the pooled one
    (records and reports written before the mean existed)."""
    value = figures.get(mean_key)
    return value if value is not None else figures.get(pooled_key)


def tau_cell(run: dict[str, Any]) -> str:
    """The run's real acceptance length: `dflashctl eval`'s, else the training log's latest
    speculative tau (marked `~`: the trainer's held-out prompts), else `-`."""
    tau = headline_tau(run.get("eval") or {}, "tau_prompt_mean", "tau")
    if tau is not None:
        return f"{tau:.2f}"
    spec = headline_tau(run.get("last") or {}, "spec_tau_prompt_mean", "spec_tau")
    return f"~{spec:.2f}" if spec is not None else "-"


def eval_rows(ev: dict[str, Any], prompts: str = "") -> list[tuple[str, Text]]:
    """`runs show`'s `eval` row (tau, speedup, how it was decoded) and its `baseline` row (prompt
    lookup); `prompts` (` on NAME`) labels an eval on other prompts than the run's own."""
    how = (
        ("greedy, identical: " + ("yes" if ev["identical"] else "NO"))
        if ev.get("identical") is not None
        else f"sampled at temperature {ev.get('temperature')}"
    )
    tau = f"speculative {tau_words(ev)}"
    rows = [
        (
            "eval" + prompts,
            Text(
                f"{tau}, speedup {ev['speedup']:.2f}x over the target alone on {ev['device']} "
                f"({ev['prompts']} prompts x {ev['max_new_tokens']} tokens, {how})"
            ),
        )
    ]
    source = prompts_text(ev.get("prompts_source"))
    if source is not None:
        rows.append(("prompts" + prompts, Text(source)))
    free = ev.get("baseline")
    if free and free.get("tau") is not None:
        rows.append(
            (
                "baseline" + prompts,
                Text(
                    f"{free.get('method') or 'prompt lookup'}: {tau_words(free)}, speedup "
                    f"{free['speedup']:.2f}x over the target alone (no drafter: what costs nothing)"
                ),
            )
        )
    return rows


def tau_words(figures: dict[str, Any]) -> str:
    """`tau 2.296 (mean of per-prompt tau; pooled 1.459)`, or `tau 1.459 (pooled)` for a report
    from before the mean existed: either form named, as the two differ by up to 2x."""
    mean = figures.get("tau_prompt_mean")
    if mean is None:
        return f"tau {figures['tau']:.3f} (pooled)"
    return f"tau {mean:.3f} (mean of per-prompt tau; pooled {figures['tau']:.3f})"


def prompts_text(source: Any, digits: int = 16) -> str | None:
    """An eval report's `prompts_source` in words (`--prompts my.jsonl (2 rows, sha256 ...)`, the
    sha256 cut to `digits`); None for a report written before eval recorded it."""
    if not isinstance(source, dict) or not source.get("from"):
        return None
    if not source.get("file"):
        return str(source["from"])
    sha = str(source.get("sha256") or "?")[:digits]
    return f"{source['from']} {source['file']} ({source.get('rows')} rows, sha256 {sha})"


def in_training_tau(records: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """The trainer's own speculative tau (runs list's `~X`): which average, on how many prompts."""
    form, taus = "mean of per-prompt tau", series(records, "spec_tau_prompt_mean")[1]
    if not taus:  # a run from before the mean existed
        form, taus = "pooled", series(records, "spec_tau")[1]
    if not taus:
        return []
    latest = next(r for r in reversed(records) if r.get("spec_tau") is not None)
    prompts = f"{latest['spec_prompts']} " if latest.get("spec_prompts") else ""
    return [
        (
            "speculative tau",
            f"{taus[-1]:.3f} {form} (best {max(taus):.3f}; in training: real draft-and-verify on "
            f"{prompts}held-out prompts, greedy)",
        )
    ]
