"""`dflashctl data regen` (issue 16) end to end through sshd + the pct shim: the builtin engine on
the tiny random target, `runs list` kind data, progress in the log, kill -9 and `runs stop`
then `--resume` giving exactly an uninterrupted run's file, the openai engine against the
stand-in server with retries, bad input, and a training run on the regenerated data."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dflashctl.errors import ConflictError
from dflashctl.runs import resume_run
from runs_helpers import ended_run, local_env, local_session, meta, run_dir, wait_until
from sshd import SHIM_VMID

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "shims" / "openai_standin.py"
# Sampled (the redone batch must draw as it did), 20 batches of 2 rows x 48 tokens: long enough
# on the tiny target to be caught mid-run.
SLOW = ["--max-new-tokens", "48", "--batch-size", "2", "--temperature", "0.8", "--seed", "3"]


def token_rows(n: int) -> str:
    """n token-id prompts of 5-8 tokens the tiny target's vocabulary holds."""
    return "".join(json.dumps({"input_ids": [(i * 7 + j) % 500 for j in range(5 + i % 4)]}) + "\n" for i in range(n))


def data_dir(host) -> Path:  # type: ignore[no-untyped-def]
    return host.container_dir(SHIM_VMID) / "work" / "data"


def push(host, tmp_path: Path, name: str, text: str) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / name
    src.write_text(text)
    res = host.run_cli("data", "push", "shim", str(src))
    assert res.returncode == 0, res.stderr


def reference(tmp_path: Path, prompts: Path, options: list[str]) -> bytes:
    """An uninterrupted run of the same program on this machine (not through dflashctl)."""
    out = tmp_path / "reference.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "dflash_train.regen", "--prompts", str(prompts), "--out", str(out), *options],
        cwd=ROOT / "remote_payload",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return out.read_bytes()


def partial_rows(host) -> int:  # type: ignore[no-untyped-def]
    path = data_dir(host) / ".slow.jsonl.partial"
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.fixture
def shim_work(shim_host):
    yield shim_host, shim_host.container_dir(SHIM_VMID) / "work"
    for path in (shim_host.container_dir(SHIM_VMID) / "work" / "runs").glob("*/run.json"):
        info = json.loads(path.read_text())  # whatever a failed test left running must not outlive it
        if not (path.parent / "exit_code").exists() and info.get("pgid"):
            try:
                os.killpg(info["pgid"], signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.slow
def test_builtin_regen_lists_as_data_and_trains(shim_work, tmp_path):
    host, workdir = shim_work
    push(host, tmp_path, "prompts.jsonl", token_rows(11) + json.dumps({"input_ids": [600]}) + "\n")
    res = host.run_cli(
        "data",
        "regen",
        "shim",
        "--prompts",
        "prompts",
        "--out",
        "regen",
        "--max-new-tokens",
        "12",
        "--batch-size",
        "4",
        "--follow",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "regen: 12/12 rows (100%), 1 failed" in res.stdout and "wrote data:regen.jsonl" in res.stderr
    rows = [json.loads(line) for line in (data_dir(host) / "regen.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(11))
    assert all(r["loss_mask"] == [0] * (5 + r["index"] % 4) + [1] * 12 for r in rows)
    (error,) = [json.loads(line) for line in (data_dir(host) / "regen.errors.jsonl").read_text().splitlines()]
    assert error == {"index": 11, "reason": "token id 600 is outside the target's vocabulary (512)"}
    listed = {d["name"]: d["rows"] for d in json.loads(host.run_cli("data", "list", "shim", "--json").stdout)}
    assert listed["regen.jsonl"] == 11 and listed["regen.errors.jsonl"] == 1

    train = host.run_cli(
        "train",
        "shim",
        "--set",
        "data.source=jsonl",
        "--set",
        "data.train_path=data:regen.jsonl",
        "--set",
        "run.steps=3",
        "--set",
        "data.batch_size=4",
        "--set",
        "run.eval_every=3",
        "--set",
        "data.max_length=24",
        "--follow",
        timeout=300,
    )
    assert train.returncode == 0, train.stderr
    assert "data: " + str(data_dir(host) / "regen.jsonl") in train.stdout
    runs = json.loads(host.run_cli("runs", "list", "shim", "--json").stdout)
    assert [(r["kind"], r["state"]) for r in runs] == [("data", "succeeded"), ("train", "succeeded")]
    assert runs[0]["gpus"] == ["cpu"] and runs[0]["last"]["rows_done"] == 12
    table = host.run_cli("runs", "list", "shim").stdout.splitlines()
    assert table[0].split()[:4] == ["RUN", "NAME", "KIND", "STATE"]
    assert table[1].split()[1:3] == ["regen.jsonl", "data"] and "12/12" in table[1]
    old = meta(workdir, runs[1]["run_id"])
    old.pop("kind")  # a run.json from before kinds reads as a training run
    (run_dir(workdir, runs[1]["run_id"]) / "run.json").write_text(json.dumps(old))
    assert json.loads(host.run_cli("runs", "list", "shim", "--json").stdout)[1]["kind"] == "train"
    # Whichever command asks: a data run that succeeded has nothing left to resume (the refusal of
    # the other kind: test_train_cli.py).
    wrong = host.run_cli("train", "shim", "--resume", runs[0]["run_id"], "--no-push")
    assert wrong.returncode == 6 and f"{runs[0]['run_id']} already succeeded: nothing to resume" in wrong.stderr


@pytest.mark.slow
def test_kill_9_and_stop_then_resume_give_the_uninterrupted_file(shim_work, tmp_path):
    host, workdir = shim_work
    push(host, tmp_path, "many.jsonl", token_rows(40))
    expected = reference(tmp_path, tmp_path / "many.jsonl", SLOW)
    run_id = host.run_cli(
        "data", "regen", "shim", "--prompts", "many.jsonl", "--out", "slow", *SLOW, "--detach", timeout=300
    ).stdout.strip()
    wait_until(lambda: partial_rows(host) >= 2, 120, "the first batch")
    os.kill(meta(workdir, run_id)["trainer"]["pid"], signal.SIGKILL)
    wait_until(lambda: (run_dir(workdir, run_id) / "exit_code").exists(), 60, "the supervisor to record the kill")
    (run,) = json.loads(host.run_cli("runs", "list", "shim", "--json").stdout)
    assert (run["state"], run["exit_code"]) == ("failed", 137), "the run ended before it was killed"
    log = (run_dir(workdir, run_id) / "train.log").read_text()
    assert f"continue where it stopped: dflashctl data regen shim --resume {run_id}" in log
    assert not (data_dir(host) / "slow.jsonl").exists()

    again = host.run_cli("data", "regen", "shim", "--resume", run_id, "--detach", timeout=300)
    assert again.returncode == 0 and "resumed regen run" in again.stderr
    killed_at = partial_rows(host)
    wait_until(lambda: partial_rows(host) >= killed_at + 2, 120, "progress after the resume")
    stopped = host.run_cli("runs", "stop", "shim", run_id, timeout=120)
    assert stopped.returncode == 0 and "stopped (143)" in stopped.stdout, stopped.stdout + stopped.stderr
    assert "regen: stopped after" in (run_dir(workdir, run_id) / "train.log").read_text()

    final = host.run_cli("data", "regen", "shim", "--resume", run_id, "--follow", timeout=300)
    assert final.returncode == 0, final.stderr
    assert "regen: resuming at row" in final.stdout and "regen: done, 40 rows" in final.stdout
    assert (data_dir(host) / "slow.jsonl").read_bytes() == expected
    assert not (data_dir(host) / ".slow.jsonl.partial").exists()
    assert meta(workdir, run_id)["resumes"] == 2


def test_openai_engine_through_the_standin_with_retries(shim_work, tmp_path):
    host, workdir = shim_work
    chats = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(5)]
    chats[2]["messages"][0]["content"] = "FAIL-ROW"
    push(host, tmp_path, "chats.jsonl", "".join(json.dumps(c) + "\n" for c in chats))
    port_file = tmp_path / "port"
    server = subprocess.Popen(
        [
            sys.executable,
            str(STANDIN),
            "--port-file",
            str(port_file),
            "--fail",
            "3",
            "--log",
            str(tmp_path / "requests.jsonl"),
        ]
    )
    try:
        wait_until(port_file.exists, 30, "the stand-in server")
        url = f"http://127.0.0.1:{port_file.read_text()}"
        res = host.run_cli(
            "data",
            "regen",
            "shim",
            "--prompts",
            "chats.jsonl",
            "--out",
            "oa",
            "--engine",
            "openai",
            "--endpoint",
            url,
            "--model",
            "standin",
            "--concurrency",
            "2",
            "--no-thinking",
            "--follow",
            timeout=300,
        )
    finally:
        server.kill()
        server.wait()
    assert res.returncode == 0, res.stderr
    assert "no GPU" in res.stderr and "regen: 5/5 rows (100%), 1 failed" in res.stdout
    rows = [json.loads(line) for line in (data_dir(host) / "oa.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 3, 4]
    assert all(
        r["messages"][0]["content"] == f"q{r['index']}"
        and r["messages"][1]["role"] == "assistant"
        and r["messages"][1]["content"].startswith("w")
        for r in rows
    )
    requests = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(requests) == 5 + 3
    assert all(r["body"]["chat_template_kwargs"] == {"enable_thinking": False} for r in requests)
    (run,) = json.loads(host.run_cli("runs", "list", "shim", "--json").stdout)
    assert (run["kind"], run["state"], run["gpus"]) == ("data", "succeeded", [])


def test_a_typo_in_set_or_preset_is_refused_before_the_push(shim_work, tmp_path):
    host, workdir = shim_work
    push(host, tmp_path, "p.jsonl", token_rows(2))
    for args, message in (
        (["--set", "target.nmu_layers=2"], "trainer config: unknown config key 'target.nmu_layers'"),
        (["--preset", "huge"], "trainer config: unknown preset 'huge'"),
    ):
        res = host.run_cli("data", "regen", "shim", "--prompts", "p", "--out", "x", *args, "--detach", timeout=120)
        assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), res.stderr
    assert not (workdir / "payload").exists()


def test_the_remote_pre_flights_refusal_names_regen_not_the_trainer(shim_work, tmp_path):
    """Prompt rows without a tokenizer are refused by regen's pre-flight on the host; its line was
    labelled `trainer config:`, which sent users looking in the trainer's settings."""
    host, workdir = shim_work
    push(host, tmp_path, "q.jsonl", json.dumps({"prompt": "hello"}) + "\n")
    res = host.run_cli("data", "regen", "shim", "--prompts", "q", "--out", "y", "--detach", timeout=120)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.startswith("error: shim (pct 200): data regen: "), res.stderr
    assert "need a tokenizer" in last and "trainer config" not in last


def test_bad_input_is_one_line_before_anything_starts(shim_work, tmp_path):
    host, workdir = shim_work
    push(host, tmp_path, "p.jsonl", token_rows(2))
    cases = [
        (["--prompts", "nope", "--out", "x"], "--prompts nope: no such dataset in data/ (have: p.jsonl;"),
        (["--prompts", "p", "--out", "p"], "--out p: dataset p.jsonl exists on shim (pct 200) already"),
        (["--prompts", "p", "--out", "../x"], "dataset name '../x.jsonl'"),
        (["--prompts", "p", "--out", "x", "--top-p", "2"], "--top-p must be in (0, 1], got 2"),
        (["--prompts", "p", "--out", "x", "--engine", "openai", "--model", "m"], "needs --endpoint URL"),
        (["--prompts", "p", "--out", "x", "--set", "drafter.num_layers=1"], "regen takes target.*"),
        (["--prompts", "p", "--out", "x", "--gpus", "0"], "CUDA is not available"),
        (["--resume", "r", "--seed", "1"], "--resume continues a regen with its own options: drop --seed"),
        (["--out", "x"], "data regen needs --prompts NAME and --out NAME"),
    ]
    for args, message in cases:
        res = host.run_cli("data", "regen", "shim", *args, "--detach", timeout=120)
        assert res.returncode == 2 and message in res.stderr.strip().splitlines()[-1], (args, res.stderr)
        assert "Traceback" not in res.stderr
    runs = workdir / "runs"
    assert not runs.exists() or not [p for p in runs.iterdir() if p.is_dir()]  # no refusal left a run behind


def test_a_resume_of_a_data_run_that_succeeded_is_refused_and_leaves_its_record(sshd_host, tmp_path):
    """`data regen --resume` of a run that succeeded started it again: the regen found its output
    complete and exited 0, but run.json's start moved to then (runs list's `started` and duration),
    its resumes counted one more, and an output removed since was made again from row 0. Refused
    (exit 6) before anything is pushed, and by runctl resume itself (a client asking it directly).
    The run's program here answers a pre-flight and exits 0, as the regen of a complete output does."""
    workdir, run_id = tmp_path / "wd", "20261201-100000-da7a"
    program = [sys.executable, "-c", "import json; print(json.dumps({'ok': True, 'holds': []}))"]
    path = ended_run(workdir, run_id, 0, kind="data", argv=program, cwd=str(tmp_path), config={"out": "out.jsonl"})
    record = (path / "run.json").read_bytes()
    line = f"run {run_id} already succeeded: nothing to resume (it wrote data:out.jsonl)"
    res = sshd_host.run_cli("data", "regen", "local", "--resume", run_id, "--detach", env=local_env(tmp_path))
    assert (res.returncode, res.stdout, res.stderr) == (6, "", f"error: local: {line}\n")
    with local_session(workdir) as session, pytest.raises(ConflictError, match=re.escape(line)):
        resume_run(session.target("local"), run_id, payload_hash=None, kind="data")
    assert (path / "run.json").read_bytes() == record
