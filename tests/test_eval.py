"""`dflashctl eval` end to end (issue 15): a real tiny run trained through the CLI, then its
export decoded speculatively against its target, on `local` and through sshd + the pct shim."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from runs_helpers import alive, install_standin, local_env, pids_where
from sshd import CLI, SHIM_VMID

from dflashctl.evaluation import no_export_reason
from dflashctl.modelcard import _eval_lines
from dflashctl.figures import eval_rows

TRAIN = ["--set", "run.steps=60", "--set", "run.eval_every=60", "--set", "run.checkpoint_every=60", "--follow"]


def one_line(result) -> str:  # type: ignore[no-untyped-def]
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def local_run(sshd_host, tmp_path_factory) -> dict[str, str]:
    """The environment of a `local` host (its work directory module-wide) holding the trained run
    `ev`: the evals on `local` below and the refusals read it; each eval reads back only what it wrote."""
    env = local_env(tmp_path_factory.mktemp("eval-local"))
    trained = sshd_host.run_cli("train", "local", "--name", "ev", *TRAIN, env=env, timeout=300)
    assert trained.returncode == 0, trained.stderr
    return env


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "shim"])
def test_eval_reports_real_tau_and_a_lossless_decode(shim_host, request, where):
    if where == "local":
        env = request.getfixturevalue("local_run")
    else:
        env = {}
        trained = shim_host.run_cli("train", where, "--name", "ev", *TRAIN, env=env, timeout=300)
        assert trained.returncode == 0, trained.stderr
    res = shim_host.run_cli(
        "eval", where, "ev", "--count", "6", "--max-new-tokens", "24", "--json", env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["identical"] and report["prompts"] == 6 and 1.0 <= report["tau"] <= 8
    assert len(report["acceptance_by_position"]) == 7 and report["speedup"] > 0
    assert 1.0 <= report["tau_prompt_mean"] <= 8
    free = report["baseline"]  # issue 26: prompt lookup, on by default, lossless
    assert free["identical"] and free["num_tokens"] == 7 and 1.0 <= free["tau"] <= 8 and free["speedup"] > 0
    assert report["drafter_vs_baseline"]["tau"] == report["tau"] / free["tau"]
    assert "prompt 6/6: tau" in res.stderr  # progress, streamed
    saved = json.loads(Path(report["run_dir"], "eval.json").read_text())
    assert saved["tau"] == report["tau"]
    listed = shim_host.run_cli("runs", "list", where, env=env)
    header, row = listed.stdout.splitlines()[:2]
    # `h`: the demo data's held-out split, as the report's prompts_source says (docs/runs.md's marks)
    assert header.split()[-1] == "TAU" and row.split()[-1] == f"{report['tau_prompt_mean']:.2f}h"
    shown = shim_host.run_cli("runs", "show", where, "ev", "--no-curves", env=env)
    assert (
        f"speculative tau {report['tau_prompt_mean']:.3f} (mean of per-prompt tau; pooled {report['tau']:.3f})"
        in shown.stdout
        and "identical: yes" in shown.stdout
    )
    lookup_mean = free["tau_prompt_mean"]
    lookup = f"prompt lookup: tau {lookup_mean:.3f} (mean of per-prompt tau; pooled {free['tau']:.3f}), speedup"
    assert f"{lookup} {free['speedup']:.2f}x over the target alone" in shown.stdout
    if where == "local":
        # the text report and eval's options are the CLI's and the payload's, alike on every transport:
        # once, through sshd
        return
    text = shim_host.run_cli("eval", where, "ev", "--count", "2", "--max-new-tokens", "8", env=env, timeout=300)
    assert (
        text.returncode == 0 and "output identical to the target's own greedy decode: yes (2/2 prompts)" in text.stdout
    )
    assert (
        "mean of per-prompt tau (z-lab's benchmark.py)" in text.stdout and "pooled over all verify steps" in text.stdout
    )
    assert "prompt lookup (the free baseline: 7 tokens" in text.stdout and "identical: yes (2/2 prompts)" in text.stdout
    assert "drafter / prompt lookup: tau" in text.stdout
    off = shim_host.run_cli(
        "eval", where, "ev", "--count", "1", "--max-new-tokens", "4", "--no-baseline", "--json", env=env, timeout=300
    )
    assert off.returncode == 0 and json.loads(off.stdout)["baseline"] is None, off.stderr
    sampled = shim_host.run_cli(
        "eval", where, "ev", "--count", "2", "--temperature", "0.8", "--json", env=env, timeout=300
    )
    assert sampled.returncode == 0, sampled.stderr
    report = json.loads(sampled.stdout)
    assert report["temperature"] == 0.8 and report["identical"] is None and 1.0 <= report["tau"] <= 8
    assert report["baseline"] is None  # prompt lookup is measured greedy only
    bad = shim_host.run_cli("eval", where, "ev", "--temperature", "-1", env=env)
    assert bad.returncode == 2 and one_line(bad) == "error: --temperature must be 0 (greedy) or positive, got -1"


@pytest.mark.slow
def test_ctrl_c_stops_the_eval_on_the_host_before_the_cli_exits(shim_host):
    """Over SSH a Ctrl-C left the decode running on the host (on a GPU: holding it) until its next
    progress line met the closed channel; now it is stopped before the CLI exits, as an exec's command."""
    # An export is all the eval needs here, not a trained drafter (the decode below runs for minutes either way).
    brief = ["--set", "run.steps=2", "--set", "run.eval_every=2", "--set", "run.checkpoint_every=2", "--follow"]
    trained = shim_host.run_cli("train", "shim", "--name", "evi", *brief, timeout=300)
    assert trained.returncode == 0, trained.stderr
    runs = str(shim_host.container_dir(SHIM_VMID) / "work" / "runs").encode()
    long = ["--max-new-tokens", "4000", "--count", "32", "--no-baseline"]  # minutes of decoding on a CPU
    proc = subprocess.Popen(
        [*CLI, "eval", "shim", "evi", *long], env=shim_host.env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    remote: list[int] = []
    try:
        while b"warm-up decode" not in (line := proc.stderr.readline()):
            assert line, proc.stderr.read()
        remote = [pid for pid in _pids_naming(runs) if pid != proc.pid]
        assert remote
        proc.send_signal(signal.SIGINT)
        assert (proc.wait(120), proc.stderr.read()) == (130, b"error: interrupted\n")
        assert not [pid for pid in remote if alive(pid)]
    finally:
        proc.kill()
        for pid in remote:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _pids_naming(text: bytes) -> list[int]:
    return pids_where(lambda args: text in b"\0".join(args))


def test_eval_bad_input_is_one_line(shim_host, local_run, tmp_path):
    env = local_run  # refusals need an export, not a trained drafter: the run above has one
    empty = tmp_path / "empty.jsonl"
    for text in ("\n", ""):  # a 0-byte file is no file of prompts either (it evaluated the run's own)
        empty.write_text(text)
        res = shim_host.run_cli("eval", "local", "ev", "--prompts", str(empty), env=env, timeout=120)
        assert res.returncode == 2 and one_line(res).endswith("the prompts file has no prompts")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"input_ids": [5] * 4090}) + "\n")
    res = shim_host.run_cli("eval", "local", "ev", "--prompts", str(long), env=env, timeout=120)
    assert res.returncode == 2 and "prompt 1 has 4090 tokens" in one_line(res) and "context of 4096" in one_line(res)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello"}\n')
    res = shim_host.run_cli("eval", "local", "ev", "--prompts", str(bad), env=env, timeout=120)
    assert res.returncode == 2 and "prompts line 1: expected a JSON object with input_ids" in one_line(res)
    res = shim_host.run_cli("eval", "local", "ev", "--gpus", "0,1", env=env)
    assert (
        res.returncode == 2
        and one_line(res) == "error: --gpus 0,1: eval runs on one GPU (the loop decodes one prompt at a time)"
    )
    res = shim_host.run_cli("eval", "local", "ev", "--gpus", "0", env=env, timeout=120)  # this machine has no GPU
    assert res.returncode == 2 and "CUDA" in one_line(res), res.stderr


def test_an_eval_on_other_prompts_is_kept_beside_the_default_one(shim_host, local_run, tmp_path):
    """`eval --prompts FILE` overwrote eval.json, the report of the eval on the run's own prompts that
    `runs list`, `runs show` and the model card read: it is now eval-<FILE's stem>.json, and
    `runs show` lists it under its own rows."""
    env = local_run
    quick = ["--max-new-tokens", "4", "--json"]
    default = shim_host.run_cli("eval", "local", "ev", "--count", "1", *quick, env=env, timeout=300)
    assert default.returncode == 0, default.stderr
    run_dir = Path(json.loads(default.stdout)["run_dir"])
    kept = (run_dir / "eval.json").read_text()
    mine = tmp_path / "my prompts.jsonl"  # the space is not kept in the report's name
    mine.write_text("".join(json.dumps({"input_ids": [5 + i, 9, 11, 3 + i]}) + "\n" for i in range(2)))
    res = shim_host.run_cli("eval", "local", "ev", "--prompts", str(mine), *quick, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert (run_dir / "eval.json").read_text() == kept
    saved = json.loads((run_dir / "eval-my_prompts.json").read_text())
    assert saved["prompts"] == report["prompts"] == 2 and saved["tau"] == report["tau"]
    assert report["report_file"] == str(run_dir / "eval-my_prompts.json")
    # Which prompts: the file's name (it went over stdin), its rows and the sha256 of its bytes.
    sha = hashlib.sha256(mine.read_bytes()).hexdigest()
    assert saved["prompts_source"] == {"from": "--prompts", "file": "my prompts.jsonl", "rows": 2, "sha256": sha}
    own = json.loads(kept)["prompts_source"]
    assert own == {"from": "the held-out split of the demo data (seed 0)", "file": None, "rows": None, "sha256": None}
    shown = shim_host.run_cli("runs", "show", "local", "ev", "--no-curves", env=env).stdout
    evals = [line for line in shown.splitlines() if line.startswith("eval ")]
    assert len(evals) == 2 and evals[0].endswith("(1 prompts x 4 tokens, greedy, identical: yes)")
    mine_rows = [line for line in evals if line.startswith("eval on my_prompts ")]
    assert len(mine_rows) == 1 and "(2 prompts x 4 tokens, greedy" in mine_rows[0]
    sources = [re.split(r"\s{2,}", line) for line in shown.splitlines() if line.startswith("prompts")]
    assert sources == [
        ["prompts", "the held-out split of the demo data (seed 0)"],
        ["prompts on my_prompts", f"--prompts my prompts.jsonl (2 rows, sha256 {sha[:16]})"],
    ], shown


def test_eval_of_a_run_without_an_export_says_so(shim_host):
    install_standin(shim_host.container_dir(SHIM_VMID) / "work" / "payload")
    started = shim_host.run_cli("train", "shim", "--no-push", "--set", "run.steps=1", "--follow")
    assert started.returncode == 0
    res = shim_host.run_cli("eval", "shim", timeout=120)
    run_id = started.stderr.split("started run ")[1].split()[0]
    # the stand-in writes no export: the run succeeded without one
    assert res.returncode == 2 and one_line(res).startswith(
        f"error: shim (pct 200): run {run_id} succeeded but has no export: "
    )


def test_eval_of_a_failed_run_says_it_failed_before_its_export(shim_host, tmp_path):
    env = local_env(tmp_path)
    install_standin(tmp_path / "wd" / "payload")
    failed = shim_host.run_cli(
        "train", "local", "--no-push", "--set", "run.steps=5", "--set", "standin.fail_at=2", "--follow", env=env
    )
    assert failed.returncode == 100, failed.stderr
    run_id = failed.stderr.split("started run ")[1].split()[0]
    res = shim_host.run_cli("eval", "local", run_id, env=env, timeout=120)
    assert res.returncode == 2, res.stderr  # bad input, as docs/cli.md has it: not the run's own 100
    assert one_line(res) == f"error: local: run {run_id} failed (exit code 3) before its last step: it has no export"


def test_the_no_export_line_says_what_became_of_the_run():
    def reason(state: str, **extra: object) -> str:
        return no_export_reason({"state": state, "run_dir": "/w/runs/r", **extra})

    assert reason("stopped", exit_code=143) == "was stopped before its last step: it has no export"
    assert reason("lost") == "was lost (it ended with no exit code recorded) before its last step: it has no export"
    assert reason("running") == "is running: it has no export yet (one is written at its last step)"
    assert reason("queued") == "is queued: it has no export yet (one is written at its last step)"
    assert reason("succeeded", exit_code=0) == "succeeded but has no export: /w/runs/r/export has no model.safetensors"


def test_a_report_from_before_prompts_source_says_its_prompts_were_not_recorded():
    old = {"tau": 2.0, "tau_prompt_mean": 2.5, "speedup": 1.5, "identical": True, "prompts": 4}
    old |= {"max_new_tokens": 8, "device": "cpu", "temperature": 0.0, "per_prompt": [{}] * 4}
    rows = eval_rows(old)
    assert [label for label, _ in rows] == ["eval", "prompts"] and "speculative tau 2.500" in rows[0][1].plain
    # runs list marks its tau `?`: runs show says the same in words (it left the row out)
    assert rows[1][1].plain == "not recorded (a report from before eval recorded its prompts)"
    sampled = eval_rows({**old, "temperature": 0.8, "identical": None})[0][1].plain  # runs list's `s`
    assert sampled.endswith("(4 prompts x 8 tokens, sampled at temperature 0.8)")
    assert "speedup 1.50x over the target alone on cpu" in rows[0][1].plain
    # A report from before the mean of per-prompt tau: its one figure is named as the pooled one.
    pooled = {k: v for k, v in old.items() if k != "tau_prompt_mean"}
    assert "speculative tau 2.000 (pooled), speedup" in eval_rows(pooled)[0][1].plain
    # The baseline row said `tau 4.198` (which average?) and `speedup 2.99x` (over what?).
    free = {"method": "prompt lookup", "tau": 3.692, "tau_prompt_mean": 4.198, "speedup": 2.99}
    row = dict(eval_rows({**old, "baseline": free}))["baseline"].plain
    assert row == (
        "prompt lookup: tau 4.198 (mean of per-prompt tau; pooled 3.692), speedup 2.99x over the "
        "target alone (no drafter: what costs nothing)"
    )
    line = _eval_lines(old, "`dflashctl eval`")[0]
    assert line.endswith("output identical to the target's greedy decode: yes")
    given = {"from": "--prompts", "file": "p.jsonl", "rows": 3, "sha256": "ab" * 32}
    assert eval_rows({**old, "prompts_source": given})[1][1].plain == f"--prompts p.jsonl (3 rows, sha256 {'ab' * 8})"
    line = _eval_lines({**old, "prompts_source": given}, "`dflashctl eval`")[0]
    assert line.endswith(
        f"identical to the target's greedy decode: yes; prompts: --prompts p.jsonl (3 rows, sha256 {'ab' * 32})"
    )
