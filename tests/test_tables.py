"""Tables on a narrow terminal and in a pipe (issue 29 items 5 and 7): rich Consoles in-process,
their width and terminal-ness forced, so the rendering is exactly what a user at that width sees."""

from __future__ import annotations

import io

from rich.console import Console
from rich.text import Text
from runs_helpers import install_standin, local_env

from dflashctl.runs import print_runs
from dflashctl.tables import Column, fields, show

RUNS = [
    {
        "run_id": "20261202-023745-a1b2",
        "name": "qwen3 8b drafter, long context sweep",
        "kind": "train",
        "state": "succeeded",
        "exit_code": 0,
        "gpus": ["0", "1", "2", "3"],
        "started_at": "2026-12-02T02:37:45Z",
        "started_ts": 1.0,
        "ended_ts": 3700.0,
        "last": {"step": 60, "total_steps": 60, "loss": 1.2345, "spec_tau": 3.1},
    },
    {
        "run_id": "20261202-031500-ffff",
        "name": None,
        "kind": "data",
        "state": "failed",
        "exit_code": 100,
        "gpus": ["cpu"],
        "started_at": "2026-12-02T03:15:00Z",
        "started_ts": 2.0,
        "ended_ts": 62.0,
        "last": {"rows_done": 20, "rows_total": 60},
    },
]


def terminal(width: int) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=True, color_system=None, legacy_windows=False), buf


def test_runs_list_at_80_columns_keeps_ids_names_and_states_whole():
    console, buf = terminal(80)
    print_runs(console, RUNS, "shim (pct 200)")
    out = buf.getvalue()
    assert "…" not in out
    assert all(len(line) <= 80 for line in out.splitlines())
    for run in RUNS:
        assert run["run_id"] in out
    assert "succeeded" in out and "failed (100)" in out
    words = out.replace("│", " ").split()
    assert all(w in words for w in ("qwen3", "8b", "drafter,")), out  # the name is folded, not cut
    assert "hidden at 80 columns: kind, GPUs, started, duration" in out  # and says what it left out


def test_a_wide_terminal_shows_every_column():
    console, buf = terminal(200)
    print_runs(console, RUNS, "shim")
    out = buf.getvalue()
    assert "12-02 02:37" in out and "1:01:39" in out and "hidden at" not in out


def test_a_terminal_too_narrow_for_anything_still_never_cuts_an_id():
    console, buf = terminal(40)
    print_runs(console, RUNS, "shim")
    assert RUNS[0]["run_id"] in buf.getvalue()


def test_a_piped_table_is_not_padded_to_its_longest_cell():
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=False)
    rows = [["a", "x" * 2000, "ok"], ["b", "short", "ok"], ["c", "name", "failed"]]
    show(console, [Column("id"), Column("name", text=True), Column("state")], rows)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4 and len(lines[1]) == len("a   ") + 2000 + len("  ok")
    assert lines[2] == "b   short  ok" and lines[3] == "c   name   failed"  # aligned among themselves


LONG_VALUE = "/runs/" + "deep/" * 12 + "20261204-225758-abcd"


def test_fields_on_a_narrow_terminal_fold_long_values_never_cut_them():
    console, buf = terminal(40)
    fields(console, [("run", Text("20261202-023745-a1b2")), ("overrides", Text(f"run.output_dir={LONG_VALUE}"))])
    out = buf.getvalue()
    assert "…" not in out and all(len(line) <= 40 for line in out.splitlines())
    values = "".join(line[len("overrides  ") :].rstrip() for line in out.splitlines())  # folded pieces rejoined
    assert values == f"20261202-023745-a1b2run.output_dir={LONG_VALUE}", out


def test_runs_show_in_a_pipe_is_one_whole_line_per_field_at_any_width(sshd_host, tmp_path):
    """`runs show | cat` at 40 columns: no value cut with "…" or wrapped (payload, argv, override paths),
    and no chart lines among the rows (a grep met them) unless --curves asks for them."""
    env = {**local_env(tmp_path), "COLUMNS": "40"}
    install_standin(tmp_path / "wd" / "payload")
    tag = f"standin.tag={LONG_VALUE}"
    done = sshd_host.run_cli("train", "local", "--no-push", "--set", "run.steps=1", "--set", tag, "--follow", env=env)
    assert done.returncode == 0, done.stderr
    run_id = done.stderr.split("started run ")[1].split()[0]
    shown = sshd_host.run_cli("runs", "show", "local", run_id, env=env)
    lines = shown.stdout.splitlines()
    assert shown.returncode == 0 and "…" not in shown.stdout, shown.stdout
    by_label = {line.split()[0]: line.split(maxsplit=1)[1] for line in lines}
    assert [line.split()[0] for line in lines[:4]] == ["run", "name", "kind", "state"]  # no continuation lines
    assert by_label["run"] == run_id and by_label["overrides"] == f"run.steps=1 {tag}"
    assert len({line.index(by_label[line.split()[0]]) for line in lines}) == 1  # values aligned in one column
    argv = by_label["argv"]
    assert argv.endswith(f"--set run.steps=1 --set {tag}") and f"run.output_dir={tmp_path}/wd/runs/{run_id}" in argv
    assert "training loss" not in shown.stdout  # the rows only
    forced = sshd_host.run_cli("runs", "show", "local", run_id, "--curves", env=env)
    assert forced.stdout.startswith(shown.stdout) and "training loss" in forced.stdout
    on_a_terminal = sshd_host.run_cli("runs", "show", "local", run_id, env={**env, "FORCE_COLOR": "1"})
    assert "training loss" in on_a_terminal.stdout  # drawn by default there


def evaluated(run_id: str, **report: object) -> dict:
    """A listed run whose eval.json headline is `report` over a greedy eval on a separate prompts file."""
    source = {"from": "data.spec_prompts_path", "file": "/d/held.jsonl", "rows": 8, "sha256": "ab" * 32}
    figures = {"tau": 1.8, "tau_prompt_mean": 2.4, "temperature": 0.0, "identical": True, "prompts_source": source}
    return {**RUNS[0], "run_id": run_id, "eval": {**figures, **report}}


SPLIT = {
    "from": "the held-out split (0.05) of data.train_path",
    "file": "/d/train.jsonl",
    "rows": 9,
    "sha256": "c" * 64,
}
TAUS = [
    evaluated("r-file"),  # the plain case: greedy, mean of per-prompt tau, a prompts file of its own
    evaluated("r-split", prompts_source=SPLIT),
    evaluated("r-old", prompts_source=None, tau_prompt_mean=None),  # before both fields
    evaluated("r-sampled", temperature=0.8, identical=None, prompts_source=SPLIT),
    {**RUNS[0], "run_id": "r-train", "last": {"spec_tau": 1.5, "spec_tau_prompt_mean": 1.9}},
    {**RUNS[0], "run_id": "r-train-old"},  # in training, the pooled figure only
]


def test_the_tau_column_marks_a_sampled_a_pooled_and_a_held_out_split_eval():
    """`runs list`'s tau said `2.40` alike for a sampled eval, an old report's pooled figure and an
    eval on the training file's own held-out split: each now carries a mark, kept whole in a pipe."""
    buf = io.StringIO()
    print_runs(Console(file=buf, width=200, force_terminal=False), TAUS, "shim")
    header, *lines = buf.getvalue().splitlines()
    assert {line.split()[0]: line.split()[-1] for line in lines} == {
        "r-file": "2.40",
        "r-split": "2.40h",
        "r-old": "1.80?p",
        "r-sampled": "2.40hs",
        "r-train": "~1.90",
        "r-train-old": "~3.10p",
    }
    assert header.split()[-1] == "TAU" and len(lines) == len(TAUS)  # in a pipe: one row per line, no legend


def test_a_terminal_names_the_tau_marks_shown_below_the_table():
    console, buf = terminal(300)
    print_runs(console, TAUS, "shim")
    legend = buf.getvalue().splitlines()[-1]
    assert legend == (
        "tau: ~ in training (no eval yet); h eval prompts: the held-out split of the training data, not a "
        "separate file; ? eval prompts not recorded (an older report); p pooled (no mean of per-prompt tau "
        "recorded); s sampled (temperature > 0), not greedy"
    )
    console, buf = terminal(200)
    print_runs(console, TAUS[:1], "shim")  # nothing marked: nothing to explain
    assert not buf.getvalue().splitlines()[-1].startswith("tau:")
    console, buf = terminal(40)  # the tau column hidden: its legend too
    print_runs(console, TAUS, "shim")
    assert "tau:" not in buf.getvalue() and "hidden at 40 columns:" in buf.getvalue()
