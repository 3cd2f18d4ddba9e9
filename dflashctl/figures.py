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


# A mark after `runs list`'s tau says what the figure is; unmarked: `dflashctl eval`'s greedy mean
# of per-prompt tau on a prompts file of its own (data.spec_prompts_path or data.eval_path).
TAU_MARKS = {
    "~": "in training (no eval yet)",
    "h": "eval prompts: the held-out split of the training data, not a separate file",
    "?": "eval prompts not recorded (an older report)",
    "p": "pooled (no mean of per-prompt tau recorded)",
    "s": "sampled (temperature > 0), not greedy",
}


def tau_cell(run: dict[str, Any]) -> str:
    """The run's real acceptance length: `dflashctl eval`'s, else the training log's latest
    speculative tau (`~`), else `-`; marked as TAU_MARKS says."""
    ev = run.get("eval") or {}
    tau = headline_tau(ev, "tau_prompt_mean", "tau")
    if tau is not None:
        origin = prompts_origin(ev)
        marks = "?" if origin is None else "h" if origin.startswith("the held-out split") else ""
        return f"{tau:.2f}{marks}{pooled_mark(ev, 'tau_prompt_mean')}{'s' if sampled(ev) else ''}"
    last = run.get("last") or {}
    spec = headline_tau(last, "spec_tau_prompt_mean", "spec_tau")
    return f"~{spec:.2f}{pooled_mark(last, 'spec_tau_prompt_mean')}" if spec is not None else "-"


def pooled_mark(figures: dict[str, Any], mean_key: str) -> str:
    """`p` where the headline tau is the pooled one (written before the mean existed)."""
    return "p" if figures.get(mean_key) is None else ""


def tau_legend(cells: Sequence[str]) -> str | None:
    """The line below `runs list`'s table naming the marks its tau cells carry (None: no marks)."""
    shown = [mark for mark in TAU_MARKS if any(mark in cell for cell in cells)]
    return ("tau: " + "; ".join(f"{mark} {TAU_MARKS[mark]}" for mark in shown)) if shown else None


def sampled(ev: dict[str, Any]) -> bool:
    """An eval decoded by sampling (temperature > 0; a report from before the field was greedy)."""
    return bool(ev.get("temperature"))


def prompts_origin(ev: dict[str, Any]) -> str | None:
    """`from` of an eval's `prompts_source` (`--prompts`, `the held-out split ...`); None for a report
    written before eval recorded it."""
    source = ev.get("prompts_source")
    return str(source["from"]) if isinstance(source, dict) and source.get("from") else None


def eval_rows(ev: dict[str, Any], prompts: str = "") -> list[tuple[str, Text]]:
    """`runs show`'s `eval` row (tau, speedup, how it was decoded) and its `baseline` row (prompt
    lookup); `prompts` (` on NAME`) labels an eval on other prompts than the run's own."""
    how = (
        f"sampled at temperature {ev['temperature']}"
        if sampled(ev)
        else "greedy, identical: " + ("yes" if ev.get("identical") else "NO")
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
    source = prompts_text(ev.get("prompts_source"))  # runs list's `h`, or `?` where not recorded
    rows.append(("prompts" + prompts, Text(source or "not recorded (a report from before eval recorded its prompts)")))
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
