"""`run.launcher`: the decision, and `processes` (one trainer process per device, joined through
distributed.py) on 2 CPU "devices" over gloo against threads: the same parameters, a stop that
reaches every rank, a failing rank named by the others."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.config import ConfigError, load_config
from dflash_train.plan import THREADS_KEEP_UP, launcher_decision, resolve_run, threads_keep_up

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"
GPUS = [f"cuda:{i}" for i in range(9)]


@pytest.mark.parametrize(
    "setting, gpus, hidden, expected, why",
    [
        ("auto", 2, 256, "processes", "2 GPUs > 1"),
        ("auto", 3, 4096, "threads", "3 GPUs <= 3"),
        ("auto", 4, 4096, "processes", "4 GPUs > 3"),
        ("auto", 3, 2048, "threads", "3 GPUs <= 3"),
        ("auto", 4, 1024, "processes", "4 GPUs > 3"),
        ("auto", 1, 256, "threads", "one device"),
        ("threads", 8, 256, "threads", "run.launcher threads"),
        ("processes", 2, 4096, "processes", "run.launcher processes"),
    ],
)
def test_the_decision_follows_the_predicted_gpu_count(setting, gpus, hidden, expected, why):
    value, reason = launcher_decision(setting, GPUS[:gpus], hidden)
    assert value == expected and why in reason


def test_the_table_and_multi_host_runs():
    assert [threads_keep_up(h) for h in (64, 1023, 1024, 4095, 4096, 8192)] == [1, 1, 3, 3, 3, 3]
    assert THREADS_KEEP_UP[-1][0] == 0  # every width has an entry
    assert launcher_decision("auto", GPUS[:4], 256, multi_host=True)[0] == "threads"
    with pytest.raises(ConfigError, match="multi-host run already runs one process per host"):
        launcher_decision("processes", GPUS[:4], 256, multi_host=True)


def test_processes_turn_the_parallel_warm_up_off_and_cpu_defaults_to_threads():
    plan = resolve_run(
        load_config(
            overrides=["run.threads=2", "run.compile=default", "run.launcher=processes", "run.parallel_warmup=on"]
        )
    )
    cfg, notes = plan.cfg, plan.notes
    assert cfg.run.launcher == "processes" and cfg.run.parallel_warmup == "off"
    assert "launcher: processes (run.launcher processes)" in notes
    assert "parallel warm-up: off (one process per device: they compile in parallel anyway)" in notes
    assert resolve_run(load_config(overrides=["run.threads=2"])).cfg.run.launcher == "threads"


# Small and fast: random tokens, 2 CPU workers of 2 sequences each.
SMALL = [
    "data.source=random",
    "data.num_train=48",
    "data.num_eval=8",
    "target.num_layers=4",
    "run.threads=2",
    "data.batch_size=2",
    "run.log_every=3",
    "run.eval_every=6",
    "run.checkpoint_every=6",
]


def trainer(out: Path, *sets: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "dflash_train", "--set", f"run.output_dir={out}"]
    for item in [*SMALL, *sets]:
        argv += ["--set", item]
    env = dict(os.environ, PYTHONPATH=str(PAYLOAD), PYTHONUNBUFFERED="1")
    return subprocess.Popen(argv, cwd=PAYLOAD, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["event"] == "train"]


def test_processes_train_the_same_parameters_as_threads(tmp_path):
    procs, threads = tmp_path / "procs", tmp_path / "threads"
    p = trainer(procs, "run.launcher=processes", "run.steps=6")
    t = trainer(threads, "run.launcher=threads", "run.steps=6")
    text_p, text_t = p.communicate(timeout=180)[0], t.communicate(timeout=180)[0]
    assert p.returncode == 0, text_p
    assert t.returncode == 0, text_t
    assert "launcher: 2 processes, one per device (cpu, cpu)" in text_p
    assert "node rank0 (rank 0) of 2 joined gloo group" in text_p and "nodes in sync: parameter checksum" in text_p
    assert (procs / "ranks" / "1" / "train.log").is_file()
    assert not list((procs / "ranks" / "1").glob("checkpoints/step_*"))  # rank 0 alone checkpoints
    # Exactly equal, not close: with 2 replicas both averages are exact in fp32 (threads: (g0 + g1) / 2;
    # processes: g0 * 0.5 + g1 * 0.5 over gloo; scaling by 1/2 is exact and a two-term sum commutes).
    # With more replicas the summation orders differ and only a few ulps per step would be promised.
    ckpt = "checkpoints/step_00000006/drafter.safetensors"
    a, b = load_file(str(procs / ckpt)), load_file(str(threads / ckpt))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(procs) == losses(threads) and len(losses(procs)) == 2
    moved = load_file(str(procs / ckpt))
    assert any(not torch.equal(moved[k], torch.zeros_like(moved[k])) for k in moved)


def test_ranks_do_not_tell_runctl_of_their_stop_agreement(monkeypatch):
    """A rank stopped by the others' agreement would leave the launcher's run recorded as stopped
    however the launcher itself ended (docs/multihost.md): that file is for one node per host."""
    from dflash_train.launcher import Rank, child_env

    monkeypatch.setenv("DFLASHCTL_AGREED_STOP_FILE", "/run/x/agreed_stop")
    monkeypatch.setenv("DFLASHCTL_REASON_FILE", "/run/x/reason")
    env = child_env(Rank(1, "cpu", Path("/out/ranks/1"), Path("/out/ranks/1/train.log")), 2, 29500, "r")
    assert "DFLASHCTL_AGREED_STOP_FILE" not in env and env["DFLASHCTL_REASON_FILE"] == "/run/x/reason"


def test_sigterm_to_the_launcher_stops_every_rank_at_one_step(tmp_path):
    out = tmp_path / "run"
    proc = trainer(out, "run.launcher=processes", "run.steps=100000", "run.log_every=1", "run.checkpoint_every=1000")
    for line in proc.stdout:
        if line.startswith("step 2/"):
            proc.send_signal(signal.SIGTERM)  # the launcher alone (runctl signals the group: the same)
            break
    rest = proc.communicate(timeout=90)[0]
    assert proc.returncode == 143, rest
    assert "stopped by signal 15" in rest
    step = int(rest.split("stopped by signal 15 after step ")[1].split(";")[0])
    rank1 = (out / "ranks" / "1" / "train.log").read_text()
    assert f"stopped by signal 15 after step {step};" in rank1  # the same step on both ranks
    assert (out / "checkpoints" / f"step_{step:08d}").is_dir()


def test_a_failing_rank_is_named_and_ends_the_run(tmp_path):
    proc = trainer(
        tmp_path / "run", "run.launcher=processes", "run.steps=8", "debug.fail_at=step:3", "debug.fail_rank=1"
    )
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, text  # rank 0's code: another node failed (distributed.EXIT_NODE_LOST)
    assert "error: node rank1 (rank 1) failed: WorkerError: worker 0 (cpu) failed during step 3" in text
    assert f"launcher: rank 1 exit 1 (log: {tmp_path / 'run' / 'ranks' / '1' / 'train.log'})" in text
    assert (
        "InjectedFault: injected fault at step:3 on worker 0"
        in (tmp_path / "run" / "ranks" / "1" / "train.log").read_text()
    )
